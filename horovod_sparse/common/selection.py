"""Local selection: which entries of the error-feedback accumulator a rank sends.

Sends nothing. Keeps everything it does not select (the caller leaves it in the residual).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from horovod_sparse.common.backend import Backend, Cell, Tensor, host_at_least

__all__ = ["ExactSelection", "LocalSelection", "ThresholdSelection", "make_selection"]


class LocalSelection(Protocol):
    """Chooses about ``k`` entries of ``accumulator`` by magnitude.

    Returns ascending int64 indices. Stateful methods (a threshold reused across steps)
    keep their state on the instance, one instance per bucket.
    """

    def select(self, ops: Backend, accumulator: Tensor, k: Any) -> Tensor:
        """``k``: a host int, or a graph scalar below n (see ``Backend.sparse_budget``)."""

    def select_values(self, ops: Backend, accumulator: Tensor, k: Any) -> tuple[Tensor, Tensor]:
        """:meth:`select`'s indices and the accumulator's values at them."""

    def most_rows(self, ops: Backend, k: Any) -> Any:
        """The most indices :meth:`select` returns for budget ``k``, whatever the values."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the same selections."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def bind(self, ops: Backend, like: Tensor) -> None:
        """Make the state's cells now (``like``: the accumulator's dtype and device)
        rather than at the first call."""

    def cells(self) -> dict[str, Cell]:
        """The state's cells by name, for a framework checkpoint that tracks variables."""


class ExactSelection:
    """Exactly the ``k`` largest magnitudes (``topk``): O(n log k), no state."""

    def select(self, ops: Backend, accumulator: Tensor, k: Any) -> Tensor:
        return ops.topk_indices(accumulator, k)

    def select_values(self, ops: Backend, accumulator: Tensor, k: Any) -> tuple[Tensor, Tensor]:
        indices = ops.topk_indices(accumulator, k)
        return indices, ops.take(accumulator, indices)

    def most_rows(self, ops: Backend, k: Any) -> Any:
        return k

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def bind(self, ops: Backend, like: Tensor) -> None:
        pass

    def cells(self) -> dict[str, Cell]:
        return {}


class ThresholdSelection:
    """Threshold-estimated top-k (Ok-Topk's reused threshold, DGC's sampled estimate).

    Step 1: every ``reestimate_steps`` calls, or at once after the count left the band,
    estimate the magnitude above which about k entries lie, from a strided sample: just
    large enough that about ``sample_rank`` of its entries lie above that magnitude (so
    the count it predicts is off by about 1/sqrt(sample_rank), 6 % at 256, well inside
    the band), and at most ``sample_size`` entries. Step 2: one memory pass collects
    the entries above it.
    Step 3: a count inside ``band`` (as multiples of k) is accepted as it is; above it,
    the k largest candidates are kept (a topk over the candidates, not over n); below
    it, the threshold is re-estimated and the pass repeated, with exact topk as the
    last resort. So the count is always within the band.

    Internal state, in backend cells (a ``tf.Variable`` under TensorFlow, so a traced
    step updates it on every call): ``threshold`` (a scalar in the bucket's dtype), the
    call count, and a stale flag.
    """

    def __init__(
        self,
        reestimate_steps: int = 1,
        band: tuple[float, float] = (0.8, 1.25),
        sample_size: int = 1 << 16,
        sample_rank: int = 256,
    ) -> None:
        self.reestimate_steps = reestimate_steps
        self.band = band
        self.sample_size = sample_size
        self.sample_rank = sample_rank
        # Made at the first call, when the backend and the bucket's dtype are known.
        self._cells: tuple[Cell, Cell, Cell] | None = None
        self._loaded: dict[str, Any] | None = None

    def _state(self, ops: Backend, like: Tensor) -> tuple[Cell, Cell, Cell]:
        if self._cells is None:
            loaded = self._loaded or {"threshold": None, "calls": 0, "stale": True}
            threshold = ops.cell(0.0, like)
            if loaded["threshold"] is not None:
                threshold.set(loaded["threshold"])
            self._cells = (threshold, ops.cell(int(loaded["calls"])), ops.cell(loaded["stale"]))
        return self._cells

    def bind(self, ops: Backend, like: Tensor) -> None:
        self._state(ops, like)

    def cells(self) -> dict[str, Cell]:
        if self._cells is None:
            return {}
        return dict(zip(("threshold", "calls", "stale"), self._cells))

    def sample_length(self, numel: int, k: Any) -> int:
        """Entries in the estimate's sample (a host int: the sample's shape). A budget
        that is a graph value (a decaying density under TF) gets the largest sample."""
        if isinstance(k, int) and k > 0:
            wanted = -(-self.sample_rank * numel // k)  # ceil: sample_rank above the k-th
            return min(numel, self.sample_size, wanted)
        return min(numel, self.sample_size)

    def _estimate(self, ops: Backend, accumulator: Tensor, k: Any, numel: int, calls: Any) -> Any:
        sample = self.sample_length(numel, k)
        # The (k / n)-quantile of the sample, from the top.
        rank_in_sample = ops.scaled_count(k, sample, numel, "round", least=1, most=sample)
        magnitudes = ops.strided_sample_abs(accumulator, sample, offset=calls)
        return ops.kth_largest(magnitudes, rank_in_sample)

    def most_rows(self, ops: Backend, k: Any) -> Any:
        # Step 3 trims any count above the band to k; k itself is within it.
        return ops.scaled_count(k, self.band[1], rounding="floor")

    def select(self, ops: Backend, accumulator: Tensor, k: Any) -> Tensor:
        if host_at_least(k, ops.length(accumulator)):
            return ops.topk_indices(accumulator, k)
        return self._select(ops, self._state(ops, accumulator), accumulator, k)

    def select_values(self, ops: Backend, accumulator: Tensor, k: Any) -> tuple[Tensor, Tensor]:
        """One :meth:`Backend.update_cells`: under TF with the NumPy kernels, the
        estimate, the pass, the band's decisions, the trim, the take and the state's
        writes are one host call, not about 30 kernels and two host calls."""
        if host_at_least(k, ops.length(accumulator)):
            indices = ops.topk_indices(accumulator, k)
            return indices, ops.take(accumulator, indices)
        selected: tuple[Tensor, Tensor] = ops.update_cells(
            self._select_values,
            self._state(ops, accumulator),
            [accumulator, k],
            returns=("int64", accumulator),
        )
        return selected

    def _select_values(
        self, ops: Backend, cells: Sequence[Cell], inputs: Sequence[Any]
    ) -> tuple[Tensor, Tensor]:
        accumulator, k = inputs
        indices = self._select(ops, cells, accumulator, k)
        return indices, ops.take(accumulator, indices)

    def _select(self, ops: Backend, cells: Sequence[Cell], accumulator: Tensor, k: Any) -> Tensor:
        numel = ops.length(accumulator)
        threshold_cell, calls_cell, stale_cell = cells
        # Integer bounds, the same test for an integer count (TF compares int64 tensors);
        # host ints, or graph scalars when k is one (a decaying density under TF).
        low = ops.scaled_count(k, self.band[0], rounding="ceil")
        high = ops.scaled_count(k, self.band[1], rounding="floor")
        calls = calls_cell.get()

        # Step 1: estimate when due; otherwise reuse the last threshold. Due every call
        # at reestimate_steps=1 (the default): no decision to take, and none to trace.
        def estimate() -> Tensor:
            return self._estimate(ops, accumulator, k, numel, calls)

        if self.reestimate_steps == 1:
            threshold = estimate()
        else:
            due = stale_cell.get() | (calls % self.reestimate_steps == 0)
            threshold = ops.cond(due, estimate, threshold_cell.get)
        threshold_cell.set(threshold)
        calls_cell.set(calls + 1)
        # Step 2: one pass above the threshold.
        candidates = ops.indices_at_least(accumulator, threshold)
        count = ops.num_rows(candidates)
        stale_cell.set((count < low) | (count > high))  # drifted: re-estimate next call

        # Step 3: too few to send: correct the threshold now (exact topk as the last
        # resort); then trim a count above the band to the k largest. The exact topk is
        # never trimmed (its k entries are the k largest of themselves), so one trim
        # serves every path and a graph builds its topk over the candidates once.
        def estimate_again() -> Tensor:
            corrected = self._estimate(ops, accumulator, k, numel, calls + 1)
            threshold_cell.set(corrected)
            found = ops.indices_at_least(accumulator, corrected)
            return ops.cond(
                ops.num_rows(found) < low, lambda: ops.topk_indices(accumulator, k), lambda: found
            )

        chosen = ops.cond(count < low, estimate_again, lambda: candidates)
        return ops.cond(
            ops.num_rows(chosen) > high, lambda: ops.top_of(accumulator, chosen, k), lambda: chosen
        )

    def state_dict(self) -> dict[str, Any]:
        if self._cells is None:
            return dict(self._loaded or {"threshold": None, "calls": 0, "stale": True})
        threshold, calls, stale = (cell.get() for cell in self._cells)
        return {"threshold": threshold, "calls": calls, "stale": stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = {
            "threshold": state["threshold"],
            "calls": int(state["calls"]),
            "stale": bool(state["stale"]),
        }
        if self._cells is not None:
            threshold, calls, stale = self._cells
            if state["threshold"] is not None:
                threshold.set(state["threshold"])
            calls.set(int(state["calls"]))
            stale.set(bool(state["stale"]))


def make_selection(method: str, reestimate_steps: int = 1) -> LocalSelection:
    """A fresh selection object for the :class:`SparseConfig` ``selection`` name."""
    if method == "exact":
        return ExactSelection()
    if method == "threshold":
        return ThresholdSelection(reestimate_steps=reestimate_steps)
    raise ValueError(f"unknown selection method {method!r}")
