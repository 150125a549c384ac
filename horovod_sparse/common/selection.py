"""Local selection: which entries of the error-feedback accumulator a rank sends.

Sends nothing. Keeps everything it does not select (the caller leaves it in the residual).
"""

from __future__ import annotations

import math
from typing import Protocol

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["ExactSelection", "LocalSelection", "ThresholdSelection", "make_selection"]


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


class ThresholdSelection:
    """Threshold-estimated top-k (Ok-Topk's reused threshold, DGC's sampled estimate).

    Step 1: every ``reestimate_steps`` calls, or sooner after a drift, estimate the
    magnitude above which about ``oversample * k`` entries lie, from a strided sample
    of ``sample_size`` entries. Step 2: one memory pass collects the candidates above
    the threshold. Step 3: if there are more than k, keep the k largest of them (a topk
    over ~1.25k entries, not n), which is exactly the top-k of the whole bucket. Step 4:
    if there are fewer than ``band[0] * k``, re-estimate at once and select again (and
    fall back to exact topk if the estimate still misses).

    Internal state: ``threshold`` (a device scalar) and the call count.
    Statistics: ``last_candidates`` (entries above the threshold at the last call).
    """

    def __init__(
        self,
        reestimate_steps: int = 10,
        oversample: float = 1.25,
        band: tuple[float, float] = (0.8, 2.0),
        sample_size: int = 1 << 16,
    ) -> None:
        self.reestimate_steps = reestimate_steps
        self.oversample = oversample
        self.band = band
        self.sample_size = sample_size
        self.threshold: Tensor | None = None
        self.calls = 0
        self.stale = True  # re-estimate at the next call
        self.last_candidates = 0

    def _estimate(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        numel = ops.num_rows(accumulator)
        sample = min(numel, self.sample_size)
        # The (oversample * k / n)-quantile of the sample, from the top.
        rank_in_sample = max(1, min(sample, math.ceil(self.oversample * k * sample / numel)))
        magnitudes = ops.strided_sample_abs(accumulator, sample, offset=self.calls)
        return ops.kth_largest(magnitudes, rank_in_sample)

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        if k >= ops.num_rows(accumulator):
            return ops.topk_indices(accumulator, k)
        if self.stale or self.threshold is None or self.calls % self.reestimate_steps == 0:
            self.threshold = self._estimate(ops, accumulator, k)
        self.calls += 1
        candidates = ops.indices_at_least(accumulator, self.threshold)
        count = ops.num_rows(candidates)
        if count < self.band[0] * k:
            # The distribution drifted down: correct the threshold now.
            self.threshold = self._estimate(ops, accumulator, k)
            candidates = ops.indices_at_least(accumulator, self.threshold)
            count = ops.num_rows(candidates)
            if count < self.band[0] * k:
                self.stale, self.last_candidates = True, count
                return ops.topk_indices(accumulator, k)
        self.last_candidates = count
        # Far above k means the threshold is stale (drift up): refresh it next call.
        self.stale = count > self.band[1] * k
        return ops.top_of(accumulator, candidates, k) if count > k else candidates


def make_selection(method: str, reestimate_steps: int = 10) -> LocalSelection:
    """A fresh selection object for the :class:`SparseConfig` ``selection`` name."""
    if method == "exact":
        return ExactSelection()
    if method == "threshold":
        return ThresholdSelection(reestimate_steps=reestimate_steps)
    raise ValueError(f"unknown selection method {method!r}")
