"""One step of all buckets, decided once for every framework (docs/design.md §3).

:class:`Engine` owns what a step decides across buckets: each bucket's
:class:`~horovod_sparse.common.pipeline.StepKind` (with dense-step fusion's runs), the
one step count, the step records and the statistics made from them, what an automatic
scheduler is fed and when it decides, and the checkpoint and world-size policy of the
buckets' state. An adapter keeps the framework's side: hooks, bucket buffers, writing
results back, and its optimizer's own state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.fusion import DenseFusion
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.scheduler import AutoScheduler, TrialOutcome
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepKind, StepRecord

__all__ = ["Engine", "Reducer", "SharedState"]

Reducer = Union[BucketReducer, DenseBucketReducer]  # a runtime alias: Union for Python 3.9
# Per sparse bucket: (step count, partition boundaries, forced dense by the scheduler).
SharedState = dict[str, tuple[int, list[int], bool]]


class Engine:
    """The decisions of one step over all buckets.

    Args:
        ops: framework primitives.
        names: bucket names, identical on every rank, in plan order.
        reducers: one per bucket: sparse buckets first (:class:`BucketReducer`), then
            dense ones, as ``plan_model`` orders them.
        fusion: dense-step fusion over the first ``len(fusion.members)`` sparse buckets,
            or None.
        scheduler: an automatic scheduler over the sparse buckets, or None.

    Internal state: the step's kinds and fusion runs, the last step's records.
    """

    def __init__(
        self,
        ops: Backend,
        names: Sequence[str],
        reducers: Sequence[Reducer],
        fusion: DenseFusion | None = None,
        scheduler: AutoScheduler | None = None,
    ) -> None:
        self.ops = ops
        self.names = list(names)
        self.reducers = list(reducers)
        self.fusion = fusion
        self.scheduler = scheduler
        self.kinds: list[StepKind] = []
        self.fusion_runs: list[list[int]] = []  # runs of the current (or last) step
        self.records: list[tuple[Reducer, StepRecord]] = []  # of the last finished step

    @property
    def sparse(self) -> list[BucketReducer]:
        """The sparse buckets' reducers, in plan order."""
        return [r for r in self.reducers if isinstance(r, BucketReducer)]

    @property
    def step(self) -> int:
        """Steps taken: every sparse bucket takes one each step (0 without any)."""
        sparse = self.sparse
        return int(sparse[0].step) if sparse else 0

    # ------------------------------------------------------------------ a step
    def plan_step(self) -> list[StepKind]:
        """Each bucket's kind for this step, once the schedule and the density of the
        step are known and before any launch; dense-step fusion plans its runs here."""
        fusion = self.fusion
        fused: set[int] = set()
        if fusion is not None:
            members = self.reducers[: len(fusion.members)]
            self.fusion_runs = fusion.plan([_as_sparse(r).dense_step for r in members])
            fused = {i for i in range(len(members)) if fusion.fused(i)}
        self.kinds = [r.step_kind(i in fused) for i, r in enumerate(self.reducers)]
        return self.kinds

    def record_step(self) -> None:
        """Keep every bucket's record of the finished step (no device read) and feed an
        automatic scheduler each sparse bucket's host seconds."""
        self.records = [(r, r.last_record) for r in self.reducers]
        if self.scheduler is None:
            return
        for choice, reducer in zip(self.scheduler.choices, self.sparse):
            record = reducer.last_record
            seconds = float(record.seconds_select) + float(record.seconds_exchange)
            if record.dense:
                choice.observe(True, seconds)
            else:
                choice.observe(False, seconds, float(record.seconds_local))

    def stats(self) -> StepStats:
        """Statistics of the last finished step, summed over buckets (reads the device
        scalars of the records)."""
        total = StepStats()
        for reducer, record in self.records:
            total += reducer.stats_of(record.on_host(self.ops))
        return total

    # ------------------------------------------------------------------ scheduler
    def reschedule(self, like: Tensor, step_seconds: float | None) -> None:
        """At a step's start: report the last whole step's seconds, and every
        ``scheduler_steps`` steps let the scheduler decide (the same on every rank)."""
        scheduler = self.scheduler
        if scheduler is None or not self.sparse:
            return
        if step_seconds is not None:
            scheduler.observe_step(step_seconds)
        step = self.step
        if scheduler.due(step):
            scheduler.decide(like, step)
            self.apply_schedule()

    def apply_schedule(self) -> None:
        if self.scheduler is not None:
            for choice, reducer in zip(self.scheduler.choices, self.sparse):
                reducer.force_dense = choice.dense

    def restart_scheduler(self) -> None:
        """Decide again from the current step (after a restore or a shared state)."""
        if self.scheduler is not None and self.sparse:
            self.scheduler.restart(self.step)

    def schedule(self, overlapping: bool) -> dict[str, dict[str, Any]]:
        """Per sparse bucket: the chosen exchange and the scheduler's predictions
        (NaN before the first decision or without a scheduler)."""
        nan = float("nan")
        choices = self.scheduler.choices if self.scheduler is not None else []
        out = {}
        for index, (name, reducer) in enumerate(zip(self.names, self.sparse)):
            choice = choices[index] if choices else None
            out[name] = {
                "mode": "dense" if reducer.force_dense else "sparse",
                "overlap": overlapping,
                "predicted_dense_s": choice.predicted_dense if choice else nan,
                "predicted_sparse_s": choice.predicted_sparse if choice else nan,
                "local_s_per_element": choice.local_per_element if choice else nan,
                "measured_dense_s": choice.measured_dense if choice else nan,
                "measured_sparse_s": choice.measured_sparse if choice else nan,
            }
        return out

    def trials(self) -> list[TrialOutcome]:
        return list(self.scheduler.trials) if self.scheduler is not None else []

    # ------------------------------------------------------------------ state
    def shared_state(self) -> SharedState:
        """What every rank must agree on: per sparse bucket, the step count (density
        schedule, scheduler timing), the boundaries and the scheduler's choice."""
        return {
            name: (int(r.step), list(r.boundaries), bool(r.force_dense))
            for name, r in zip(self.names, self.sparse)
        }

    def adopt_shared_state(self, theirs: SharedState) -> None:
        """Take another rank's :meth:`shared_state`, and decide again from it."""
        for name, reducer in zip(self.names, self.sparse):
            reducer.step, boundaries, _ = theirs[name]
            reducer.boundaries = list(boundaries)
        if self.scheduler is not None:
            for choice, name in zip(self.scheduler.choices, self.names):
                choice.switch(theirs[name][2])
            self.apply_schedule()
        self.restart_scheduler()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each sparse bucket's state (residual, step, selection, boundaries) by name."""
        return {name: r.state_dict() for name, r in zip(self.names, self.sparse)}

    def load_state_dict(self, buckets: dict[str, dict[str, Any]], share: float = 1.0) -> None:
        """Restore :meth:`state_dict`; each residual is multiplied by ``share`` (the
        checkpoint policy: ``1 / P`` when every rank loads another rank's residuals).

        Raises:
            ValueError: a bucket has no matching state (another model or plan).
        """
        for name, reducer in zip(self.names, self.sparse):
            saved = buckets.get(name)
            if saved is None or self.ops.length(saved["residual"]) != reducer.numel:
                raise ValueError(f"checkpoint has no state matching bucket {name}")
            reducer.load_state_dict(saved)
            if share != 1.0:
                reducer.residual = self.ops.scale(reducer.residual, share)
        self.restart_scheduler()

    def follow_world_size(self, make_reducer: Callable[[int], Reducer]) -> None:
        """Rebuild every reducer for a new process-set size (elastic Horovod).

        Each surviving rank keeps its own residual: mass this process still owes the
        sum, whatever its new rank. Owner regions are cut again for the new size; the
        step count and the selection state carry over.
        """
        for index, old in enumerate(self.reducers):
            fresh = make_reducer(index)
            if isinstance(old, BucketReducer) and isinstance(fresh, BucketReducer):
                fresh.load_state_dict(old.state_dict())  # boundaries: re-cut
            self.reducers[index] = fresh
        self.apply_schedule()
        self.records = []


def _as_sparse(reducer: Reducer) -> BucketReducer:
    assert isinstance(reducer, BucketReducer), "fusion members are sparse buckets"
    return reducer
