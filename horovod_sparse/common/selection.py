"""Local selection: which entries of the error-feedback accumulator a rank sends.

Sends nothing. Keeps everything it does not select (the caller leaves it in the residual).
"""

from __future__ import annotations

from typing import Protocol

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["ExactSelection", "LocalSelection", "make_selection"]


class LocalSelection(Protocol):
    """Chooses about ``k`` entries of ``accumulator`` by magnitude.

    Returns ascending int64 indices. Stateful methods (a threshold reused across steps)
    keep their state on the instance, one instance per bucket.
    """

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor: ...


class ExactSelection:
    """Exactly the ``k`` largest magnitudes (``topk``): O(n log k), no state."""

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        return ops.topk_indices(accumulator, k)


def make_selection(method: str) -> LocalSelection:
    """A fresh selection object for the :class:`SparseConfig` ``selection`` name."""
    if method == "exact":
        return ExactSelection()
    raise ValueError(f"unknown selection method {method!r}")
