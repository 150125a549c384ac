"""Local selection: which entries of the error-feedback accumulator a rank sends.

Sends nothing. Keeps everything it does not select (the caller leaves it in the residual).
"""

from __future__ import annotations

from typing import Any, Protocol

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["ExactSelection", "LocalSelection", "ThresholdSelection", "make_selection"]


class LocalSelection(Protocol):
    """Chooses about ``k`` entries of ``accumulator`` by magnitude.

    Returns ascending int64 indices. Stateful methods (a threshold reused across steps)
    keep their state on the instance, one instance per bucket.
    """

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor: ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the same selections."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ExactSelection:
    """Exactly the ``k`` largest magnitudes (``topk``): O(n log k), no state."""

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        return ops.topk_indices(accumulator, k)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ThresholdSelection:
    """Threshold-estimated top-k (Ok-Topk's reused threshold, DGC's sampled estimate).

    Step 1: every ``reestimate_steps`` calls, or at once after the count left the band,
    estimate the magnitude above which about k entries lie, from a strided sample of
    ``sample_size`` entries. Step 2: one memory pass collects the entries above it.
    Step 3: a count inside ``band`` (as multiples of k) is accepted as it is; above it,
    the k largest candidates are kept (a topk over the candidates, not over n); below
    it, the threshold is re-estimated and the pass repeated, with exact topk as the
    last resort. So the count is always within the band.

    Internal state: ``threshold`` (a device scalar), the call count, a stale flag.
    Statistics: ``last_candidates`` (entries above the threshold at the last pass).
    """

    def __init__(
        self,
        reestimate_steps: int = 10,
        band: tuple[float, float] = (0.8, 1.25),
        sample_size: int = 1 << 16,
    ) -> None:
        self.reestimate_steps = reestimate_steps
        self.band = band
        self.sample_size = sample_size
        self.threshold: Tensor | None = None
        self.calls = 0
        self.stale = True  # re-estimate at the next call
        self.last_candidates = 0

    def _estimate(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        numel = ops.num_rows(accumulator)
        sample = min(numel, self.sample_size)
        # The (k / n)-quantile of the sample, from the top.
        rank_in_sample = max(1, min(sample, round(k * sample / numel)))
        magnitudes = ops.strided_sample_abs(accumulator, sample, offset=self.calls)
        return ops.kth_largest(magnitudes, rank_in_sample)

    def _pass(self, ops: Backend, accumulator: Tensor) -> tuple[Tensor, int]:
        candidates = ops.indices_at_least(accumulator, self.threshold)
        return candidates, ops.num_rows(candidates)

    def select(self, ops: Backend, accumulator: Tensor, k: int) -> Tensor:
        if k >= ops.num_rows(accumulator):
            return ops.topk_indices(accumulator, k)
        low, high = self.band[0] * k, self.band[1] * k
        if self.stale or self.threshold is None or self.calls % self.reestimate_steps == 0:
            self.threshold = self._estimate(ops, accumulator, k)
        self.calls += 1
        candidates, count = self._pass(ops, accumulator)
        self.stale = not (low <= count <= high)  # drifted: re-estimate next call
        if count < low:
            # Too few to send: correct the threshold now and select again.
            self.threshold = self._estimate(ops, accumulator, k)
            candidates, count = self._pass(ops, accumulator)
            if count < low:
                self.last_candidates = count
                return ops.topk_indices(accumulator, k)
        self.last_candidates = count
        return ops.top_of(accumulator, candidates, k) if count > high else candidates

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "calls": self.calls, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = state["threshold"]
        self.calls = int(state["calls"])
        self.stale = bool(state["stale"])


def make_selection(method: str, reestimate_steps: int = 10) -> LocalSelection:
    """A fresh selection object for the :class:`SparseConfig` ``selection`` name."""
    if method == "exact":
        return ExactSelection()
    if method == "threshold":
        return ThresholdSelection(reestimate_steps=reestimate_steps)
    raise ValueError(f"unknown selection method {method!r}")
