"""One step of all buckets, decided once for every framework (docs/design.md §3).

:class:`Engine` owns what a step decides across buckets: each bucket's
:class:`~horovod_sparse.common.step.StepKind` (with dense-step fusion's runs), the
one step count, the step records and the statistics made from them, what an automatic
scheduler is fed and when it decides, and the checkpoint and world-size policy of the
buckets' state. Given the bucket buffers, it also runs the step: it launches each
bucket's exchange when its last tensor is in (a fused run's allreduce with the run's
last bucket), holds every exchange in flight as a
:class:`~horovod_sparse.common.handle.BucketHandle`, moves them on and records the
trace. An adapter keeps the framework's side: hooks, copying gradients into the
buffers, writing results back, and its optimizer's own state.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.fusion import DenseFusion, FusedPart
from horovod_sparse.common.global_selection import ReusedGlobalThreshold, grouped_threshold_keys
from horovod_sparse.common.handle import BucketHandle
from horovod_sparse.common.pipeline import (
    BucketReducer,
    DenseBucketReducer,
    OwnedSums,
    ScatterInFlight,
)
from horovod_sparse.common.scheduler import AutoScheduler, TrialOutcome
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepKind, StepRecord
from horovod_sparse.common.trace import Trace

__all__ = ["BucketView", "Engine", "Reducer", "SharedState"]

Reducer = Union[BucketReducer, DenseBucketReducer]  # a runtime alias: Union for Python 3.9
# Per sparse bucket: (step count, partition boundaries, forced dense by the scheduler).
# Per sparse bucket: step, boundaries, the scheduler's choice, the reused global
# threshold's state (None with global_selection="exact").
SharedState = dict[str, tuple[int, list[int], bool, dict[str, Any] | None]]


@dataclass(frozen=True)
class BucketView:
    """A read-only snapshot of one bucket, for users and tests (:meth:`Engine.views`).

    ``step``, ``boundaries`` and the flags are those of a sparse bucket (a dense bucket
    has no step count: 0, its one owner region, and False).
    """

    name: str
    sparse: bool
    numel: int
    world_size: int
    step: int
    boundaries: tuple[int, ...]
    force_dense: bool
    residual_clear: bool
    last_kind: StepKind | None


class Engine:
    """The decisions of one step over all buckets, and its run.

    Args:
        ops: framework primitives.
        names: bucket names, identical on every rank, in plan order.
        reducers: one per bucket: sparse buckets first (:class:`BucketReducer`), then
            dense ones, as ``plan_model`` orders them.
        fusion: dense-step fusion over the first ``len(fusion.members)`` sparse buckets,
            or None.
        scheduler: an automatic scheduler over the sparse buckets, or None.
        buffers: each bucket's flat buffer (needed to run a step: :meth:`arrived`).
        arenas: the tensors whose slices the fused buckets' buffers are.
        members: tensors per bucket: :meth:`arrived` launches a bucket at its last.
        trace: a trace recorder, or None.

    Hyperparameters: ``prescale`` and ``postscale`` (the reduce op's factors), which
    the adapter sets and updates with the world size.
    Internal state: the step's kinds, fusion runs and handles in flight; the last
    step's records.
    """

    def __init__(
        self,
        ops: Backend,
        names: Sequence[str],
        reducers: Sequence[Reducer],
        fusion: DenseFusion | None = None,
        scheduler: AutoScheduler | None = None,
        *,
        buffers: Sequence[Tensor] = (),
        arenas: Sequence[Tensor] = (),
        members: Sequence[int] = (),
        trace: Trace | None = None,
        progress: Callable[[int, StepStats], None] | None = None,
        progress_every: int = 0,
    ) -> None:
        self.ops = ops
        self.names = list(names)
        self.reducers = list(reducers)
        self.fusion = fusion
        self.scheduler = scheduler
        self.buffers = list(buffers)
        self.arenas = list(arenas)
        self.members = list(members) or [1] * len(self.reducers)
        self.trace = trace
        # ``log_every``: called with the step count and the step's figures every
        # ``progress_every`` finished steps (None on ranks that print nothing).
        self.progress = progress
        self.progress_every = progress_every
        self.finished_steps = 0
        self.prescale = 1.0
        self.postscale = 1.0
        self.kinds: list[StepKind] = []
        self.fusion_runs: list[list[int]] = []  # runs of the current (or last) step
        self.records: list[tuple[Reducer, StepRecord]] = []  # of the last finished step
        self.handles: list[BucketHandle | None] = []
        # Per bucket: a buffer whose entries the bucket sends are zeroed with the
        # residual's (momentum factor masking), or None.
        self.masked: list[Tensor | None] = [None] * len(self.reducers)
        self._waiting: list[int] = []
        self._planned = False
        self.begin_step()

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
        self._planned = True
        return self.kinds

    def mask_with(self, index: int, buffer: Tensor | None) -> None:
        """Zero ``buffer`` where sparse bucket ``index`` sends (momentum factor masking)."""
        self.masked[index] = buffer
        _as_sparse(self.reducers[index]).velocity = buffer

    def begin_step(self) -> None:
        """Forget the step in progress: nothing planned, nothing in flight, every
        bucket waiting for all of its tensors."""
        self._planned = False
        self._waiting = list(self.members)
        self.handles = [None] * len(self.reducers)

    @property
    def busy(self) -> bool:
        """Whether some bucket's exchange of this step is in flight."""
        return any(handle is not None for handle in self.handles)

    def kind(self, index: int) -> StepKind:
        """Bucket ``index``'s kind this step; the first call of a step plans them all,
        after the schedule and the step's density are known, before any launch."""
        if not self._planned:
            self.plan_step()
        return self.kinds[index]

    def gradients_in_buffer(self, index: int) -> bool:
        """Whether this step's gradients of bucket ``index`` are copied into its buffer
        (a dense step while the residual owes nothing); else they are added to the
        residual (:meth:`accumulate`)."""
        return self.reducers[index].gradients_in_buffer(self.kind(index))

    def accumulate(self, index: int, grad: Tensor, offset: int) -> None:
        """Error feedback of one tensor, straight into the residual: no buffer copy."""
        _as_sparse(self.reducers[index]).accumulate(grad, offset, self.prescale)

    def arrived(self, index: int) -> None:
        """One more tensor of bucket ``index`` is in; the last one launches the
        bucket's exchange now, during backward (a fused bucket's allreduce is its run's,
        launched with the run's last bucket)."""
        self._waiting[index] -= 1
        if self._waiting[index] > 0:
            return
        kind = self.kind(index)
        reducer, buffer = self.reducers[index], self.buffers[index]
        stage = reducer.launch(kind, buffer, self.prescale)
        if kind is StepKind.DENSE_FUSED:
            assert self.fusion is not None, "fused kinds come from fusion"
            run = self.fusion.complete(index)  # fusion members are the first buckets
            if run is not None:
                self._launch_run(self.fusion, run)
            return
        handle = BucketHandle(reducer, stage, buffer, self.postscale, out=buffer)
        self.handles[index] = handle
        if self.trace is not None:
            label = "reduce-scatter" if handle.scattering else "allreduce"
            name = self.names[index]
            self.trace.launched(name, name, label, time.perf_counter())

    def _launch_run(self, fusion: DenseFusion, run: list[int]) -> None:
        """One in-place allreduce over the arena slice of a run of dense buckets."""
        arena, start, stop = fusion.span(run)
        name = f"{self.reducers[run[0]].name}.fused.{self.names[run[-1]]}"
        shared = DenseFusion.launch(
            self.ops,
            self.arenas[arena][start:stop],
            stop - start,
            name,
            self.reducers[run[0]].process_set,
        )
        now = time.perf_counter()
        for index in run:
            reducer, buffer = _as_sparse(self.reducers[index]), self.buffers[index]
            stage = reducer.start_fused(FusedPart(shared, buffer, reducer.numel))
            self.handles[index] = BucketHandle(reducer, stage, buffer, self.postscale, out=buffer)
            if self.trace is not None:
                name = self.names[index]
                self.trace.launched(name, name, "allreduce (fused)", now)

    def launch_gathers(self, forward_order: bool = False) -> list[tuple[int, BucketHandle]]:
        """Finish every reduce-scatter and launch every all-gather (waits for none);
        every bucket's handle, in launch order, which the step no longer holds.

        Collectives run in launch order: ``forward_order`` launches the last planned
        bucket first (buckets are planned in backward order), so that with the
        all-gathers deferred to the next forward the first layers' results come first.
        """
        trace = self.trace
        ended = time.perf_counter()
        if trace is not None:
            self.poll()
            trace.backward_ended(ended)
        order = range(len(self.handles))
        indices = list(reversed(order) if forward_order else order)
        refreshed = self._refresh_together(indices)
        launched = []
        for index in indices:
            handle = self.handles[index]
            assert handle is not None, "every bucket was launched"
            began = time.perf_counter()
            was_scatter = handle.scattering
            handle.advance(refreshed.get(index))
            if trace is not None:
                name = self.names[index]
                trace.waited(name, began, time.perf_counter(), ended if was_scatter else None)
                if was_scatter:
                    trace.launched(f"{name}.ag", name, "all-gather", time.perf_counter())
            launched.append((index, handle))
            self.handles[index] = None
        return launched

    def _refresh_together(self, indices: list[int]) -> dict[int, tuple[OwnedSums, Tensor]]:
        """Run the radix selects of the sparse buckets whose global threshold refreshes
        this step together: one allreduce per digit for all of them, not four per
        bucket (the first sparse step and every ``refresh_steps``-th step refresh every
        bucket at once). Their reduce-scatters are received first. Whether a bucket
        refreshes is a host bool under PyTorch, the same on every rank. Returns each
        grouped bucket's owner sums and key, by bucket index; a bucket alone in its
        process set refreshes by itself as it advances."""
        groups: dict[int, list[int]] = {}  # by process set: the allreduce's ranks
        for index in indices:
            handle = self.handles[index]
            if handle is not None and handle.scattering:
                reducer = _as_sparse(self.reducers[index])
                if reducer.refresh_due():
                    groups.setdefault(id(reducer.process_set), []).append(index)
        together: dict[int, tuple[OwnedSums, Tensor]] = {}
        for due in groups.values():
            if len(due) < 2:
                continue
            reducers = [_as_sparse(self.reducers[index]) for index in due]
            owned = [r.receive(self._scatter(index)) for index, r in zip(due, reducers)]
            keys = grouped_threshold_keys(
                self.ops,
                [sums.keys for sums in owned],
                [reducer.k for reducer in reducers],
                f"{self.names[due[0]]}.refresh",
                reducers[0].process_set,
            )
            together.update((i, (sums, key)) for i, sums, key in zip(due, owned, keys))
        return together

    def _scatter(self, index: int) -> ScatterInFlight:
        """Bucket ``index``'s reduce-scatter in flight."""
        handle = self.handles[index]
        assert handle is not None and isinstance(handle.stage, ScatterInFlight)
        return handle.stage

    def finish(self, index: int, handle: BucketHandle) -> Tensor:
        """Wait for bucket ``index``'s all-gather (or dense allreduce); its result, flat,
        written into the bucket buffer."""
        began = time.perf_counter()
        result = handle.wait()
        if self.trace is not None:
            # A sparse step's all-gather, or the allreduce of a dense bucket or step.
            gather = f"{self.names[index]}.ag"
            key = gather if self.trace.in_flight(gather) else self.names[index]
            self.trace.waited(key, began, time.perf_counter(), None)
        return result

    def poll(self) -> None:
        """Note in the trace which exchanges in flight have finished; never blocks."""
        if self.trace is None:
            return
        now = time.perf_counter()
        for name, handle in zip(self.names, self.handles):
            if handle is not None:
                self.trace.polled(name, handle.poll(), now)

    def views(self) -> list[BucketView]:
        """A read-only snapshot of every bucket, in plan order."""
        out = []
        for index, (name, reducer) in enumerate(zip(self.names, self.reducers)):
            last_kind = self.kinds[index] if self.kinds else None
            if isinstance(reducer, BucketReducer):
                step, boundaries = int(reducer.step), tuple(reducer.boundaries)
                flags = (bool(reducer.force_dense), bool(reducer.residual_clear))
            else:
                step, boundaries, flags = 0, (0, reducer.numel), (False, False)
            out.append(
                BucketView(
                    name,
                    isinstance(reducer, BucketReducer),
                    reducer.numel,
                    reducer.world_size,
                    step,
                    boundaries,
                    *flags,
                    last_kind,
                )
            )
        return out

    def record_step(self) -> None:
        """Keep every bucket's record of the finished step (no device read) and feed an
        automatic scheduler each sparse bucket's host seconds."""
        self.records = [(r, r.last_record) for r in self.reducers]
        self.finished_steps += 1
        every = self.progress_every
        if self.progress is not None and every and self.finished_steps % every == 0:
            self.progress(self.finished_steps, self.stats())  # reads the records' scalars
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
        schedule, scheduler timing), the boundaries, the scheduler's choice and the
        reused global threshold (whether the next step refreshes decides whether the
        radix select's allreduces run: ranks that disagree would hang)."""
        return {
            name: (
                int(r.step),
                list(r.boundaries),
                bool(r.force_dense),
                None if r.reused_threshold is None else _shared_part(r.reused_threshold, self.ops),
            )
            for name, r in zip(self.names, self.sparse)
        }

    def adopt_shared_state(self, theirs: SharedState) -> None:
        """Take another rank's :meth:`shared_state`, and decide again from it."""
        for name, reducer in zip(self.names, self.sparse):
            reducer.step, boundaries, _, threshold = theirs[name]
            reducer.boundaries = list(boundaries)
            if threshold is not None and reducer.reused_threshold is not None:
                # The row cap is this owner's own share, not shared; a rank that has
                # none yet (0) takes k for its next reused step.
                threshold = {**threshold, "cap": int(reducer.reused_threshold.row_cap)}
            reducer.restore_global_threshold(threshold)
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

    def checkpoint(self, rank: int, world_size: int, owner: str) -> dict[str, Any]:
        """What a checkpoint keeps of the buckets: each sparse bucket's state (copies,
        so the saved state does not change with later steps) and who saved it."""
        copy = self.ops.copy
        return {
            "rank": rank,
            "world_size": world_size,
            "owner": owner,
            "buckets": {
                name: {key: _copied(copy, value) for key, value in state.items()}
                for name, state in self.state_dict().items()
            },
        }

    def restore(self, saved: dict[str, Any], rank: int, world_size: int, owner: str) -> None:
        """Restore :meth:`checkpoint` by the residual policy of docs/design.md §6.

        Saved by this process (``owner``: elastic commit and restore) or by the same
        rank at the same world size: restored as saved. Otherwise each rank takes
        ``1 / world_size`` of the saved residual, so its mass counts once when every
        rank loads the same checkpoint, and a warning says that the other ranks'
        residuals at save time are not in it.
        """
        exact = saved.get("owner") == owner or (
            saved["rank"] == rank and saved["world_size"] == world_size
        )
        if not exact:
            warnings.warn(
                f"checkpoint residuals come from rank {saved['rank']} of "
                f"{saved['world_size']}; this is rank {rank} of {world_size}: each rank "
                f"takes 1/{world_size} of the saved residual, so its mass counts once when "
                "every rank loads this checkpoint; the other ranks' residuals at save time "
                "are not in it",
                stacklevel=3,
            )
        self.load_state_dict(saved["buckets"], 1.0 if exact else 1.0 / world_size)

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
            if self.masked[index] is not None:
                self.mask_with(index, self.masked[index])
        self.apply_schedule()
        self.records = []


def _copied(copy: Callable[[Tensor], Tensor], value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copied(copy, item) for key, item in value.items()}
    if isinstance(value, (int, float, str, bool, list, tuple)) or value is None:
        return value
    return copy(value)


def _as_sparse(reducer: Reducer) -> BucketReducer:
    assert isinstance(reducer, BucketReducer), "fusion members are sparse buckets"
    return reducer


def _shared_part(threshold: ReusedGlobalThreshold, ops: Backend) -> dict[str, Any]:
    """What every rank must agree on of a reused global threshold: its saved state
    without the row cap, which is each owner's own share."""
    return {key: value for key, value in threshold.state_dict(ops).items() if key != "cap"}
