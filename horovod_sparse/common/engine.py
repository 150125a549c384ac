"""One step of all buckets, decided once and run the same way for every front-end
(docs/design.md §3).

:class:`Engine` makes the step plan (:func:`~horovod_sparse.common.plan.plan_step`) at a
step's start and runs it: :meth:`Engine.arrived` launches a bucket's exchange when its
last tensor is in (a fused run's allreduce when the run's last bucket is),
:meth:`Engine.launch_gathers` moves every exchange on to its all-gather (grouping the
threshold refreshes), :meth:`Engine.finish` waits for one, and :meth:`Engine.record_step`
keeps the records. A front-end whose gradients are all in at once (TensorFlow's tape and
Keras optimizer, the functional APIs) calls :meth:`Engine.reduce_all`, which runs the
same functions; there a decision that is a graph value becomes one ``Backend.cond``.
What the engine keeps across steps (scheduler, checkpoints, shared state) is in
:mod:`~horovod_sparse.common.engine_state`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from horovod_sparse.common.all_at_once import AllAtOnce, Finished
from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.engine_state import BucketView, EngineState, SharedState
from horovod_sparse.common.fusion import DenseFusion
from horovod_sparse.common.handle import BucketHandle
from horovod_sparse.common.inflight import OwnedSums, ScatterInFlight
from horovod_sparse.common.joined import join_sparse_steps
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.plan import Reducer, StepPlan, plan_step, refresh_together
from horovod_sparse.common.scheduler import AutoScheduler
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepKind, StepRecord
from horovod_sparse.common.trace import Trace

__all__ = ["BucketView", "Engine", "Reducer", "SharedState"]


class Engine(EngineState):
    """The decisions of one step over all buckets, and its run.

    Args:
        ops: framework primitives.
        names: bucket names, identical on every rank, in plan order.
        reducers: one per bucket: sparse buckets first (:class:`BucketReducer`), then
            dense ones, as ``plan_model`` orders them.
        fusion: dense-step fusion over the first ``len(fusion.members)`` sparse buckets,
            or None.
        scheduler: an automatic scheduler over the sparse buckets, or None.
        buffers: each bucket's flat buffer (a step run by :meth:`arrived`).
        arenas: the tensors whose slices the fused buckets' buffers are.
        members: tensors per bucket: :meth:`arrived` launches a bucket at its last.
        trace: a trace recorder, or None.

    Hyperparameters: ``prescale`` and ``postscale`` (the reduce op's factors), which
    the adapter sets and updates with the world size.
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
        self.kinds: list[StepKind | None] = []
        self.fusion_runs: list[list[int]] = []  # runs of the current (or last) step
        self.records: list[tuple[Reducer, StepRecord]] = []  # of the last finished step
        self.handles: list[BucketHandle | None] = []
        # Per bucket: a buffer whose entries the bucket sends are zeroed with the
        # residual's (momentum factor masking), or None.
        self.masked: list[Tensor | None] = [None] * len(self.reducers)
        self.plan: StepPlan | None = None
        self._waiting: list[int] = []
        self._fused_parts: dict[int, Tensor] = {}
        self.begin_step()

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """Forget the step in progress: nothing planned, nothing in flight, every
        bucket waiting for all of its tensors."""
        self.plan = None
        self._waiting = list(self.members)
        self.handles = [None] * len(self.reducers)
        self._fused_parts = {}

    def open_step(self, gradients_in_residual: bool = False) -> StepPlan:
        """Plan the step: call it once the schedule and the step's density are known
        and before any gradient is handed in (:func:`plan_step`).
        ``gradients_in_residual``: the caller has no bucket buffers to copy gradients
        into (a step run all at once), so every sparse bucket's go into its residual."""
        self.plan = plan_step(self.ops, self.reducers, self.fusion, gradients_in_residual)
        # The planned sparse steps share one alltoall and one allgather (common/joined.py).
        # Not the members of a run that fuses by a graph predicate: they step inside a
        # ``Backend.cond`` branch, which a collective shared with the rest cannot span.
        kinds = list(self.plan.kinds)
        for index in (i for run in self.plan.graph_runs for i in run):
            kinds[index] = None
        join_sparse_steps(self.ops, self.reducers, kinds)
        self.kinds = list(self.plan.kinds)
        self.fusion_runs = self.plan.fused_runs
        return self.plan

    def _planned(self) -> StepPlan:
        assert self.plan is not None, "open_step() plans the step before any gradient"
        return self.plan

    @property
    def busy(self) -> bool:
        """Whether some bucket's exchange of this step is in flight."""
        return any(handle is not None for handle in self.handles)

    def gradients_in_buffer(self, index: int) -> bool:
        """Whether this step's gradients of bucket ``index`` are copied into its buffer;
        else they are added to the residual (:meth:`accumulate`)."""
        return self._planned().in_buffer[index]

    def accumulate(self, index: int, grad: Tensor, offset: int) -> None:
        """Error feedback of one tensor, straight into the residual: no buffer copy."""
        with self.ops.local_work():  # every entry point: docs/design.md §12
            _as_sparse(self.reducers[index]).accumulate(grad, offset, self.prescale)

    def arrived(self, index: int) -> None:
        """One more tensor of bucket ``index`` is in; the last one launches the
        bucket's exchange now, during backward."""
        self._waiting[index] -= 1
        if self._waiting[index] == 0:
            self.launch(index, self.buffers[index])

    def launch(
        self,
        index: int,
        buffer: Tensor,
        kind: StepKind | None = None,
        result_in_buffer: bool = True,
    ) -> BucketHandle | None:
        """Start bucket ``index``'s step of ``kind`` (the plan's when None): a fused
        bucket's allreduce is its run's, launched with the run's last bucket.

        ``buffer``: the bucket buffer (gradients in it or in the residual, as planned),
        or for a step run all at once the residual (or, for a dense bucket, the
        gradients); the result is written into it if ``result_in_buffer``. Returns
        the bucket's handle (None for a fused bucket whose run is not complete)."""
        with self.ops.local_work():
            return self._launch(index, buffer, kind, result_in_buffer)

    def _launch(
        self, index: int, buffer: Tensor, kind: StepKind | None, result_in_buffer: bool
    ) -> BucketHandle | None:
        kind = kind if kind is not None else self._planned().kinds[index]
        assert kind is not None, "a graph-valued kind runs under reduce_all's cond"
        reducer = self.reducers[index]
        if kind is StepKind.DENSE_FUSED:
            self._fused_parts[index] = _as_sparse(reducer).contribute_fused(
                buffer, self.prescale, in_buffer=self._planned().in_buffer[index]
            )
            run = next(run for run in self._planned().fused_runs if index in run)
            if all(member in self._fused_parts for member in run):
                self._launch_run(run)
            return self.handles[index]
        if isinstance(reducer, BucketReducer):
            stage = reducer.launch(kind, buffer, self.prescale)
        else:
            stage = reducer.launch(buffer, self.prescale)
        out = buffer if result_in_buffer else None
        handle = BucketHandle(reducer, stage, buffer, self.postscale, out=out)
        self.handles[index] = handle
        if self.trace is not None:
            label = "reduce-scatter" if handle.scattering else "allreduce"
            name = self.names[index]
            self.trace.launched(name, name, label, time.perf_counter())
        return handle

    def _launch_run(self, run: list[int]) -> None:
        """One allreduce over a run of dense buckets (in place over the arena slice)."""
        arena_slice = None
        if self.fusion is not None and self.arenas:
            arena, start, stop = self.fusion.span(run)
            arena_slice = self.arenas[arena][start:stop]
        first = self.reducers[run[0]]
        parts = DenseFusion.launch(
            self.ops,
            [self._fused_parts.pop(index) for index in run],
            arena_slice,
            f"{first.name}.fused.{self.names[run[-1]]}",
            first.process_set,
        )
        now = time.perf_counter()
        for index, part in zip(run, parts):
            reducer = _as_sparse(self.reducers[index])
            like = self.buffers[index] if self.buffers else part.buffer
            out = self.buffers[index] if self.buffers else None
            stage = reducer.start_fused(part)
            self.handles[index] = BucketHandle(reducer, stage, like, self.postscale, out=out)
            if self.trace is not None:
                name = self.names[index]
                self.trace.launched(name, name, "allreduce (fused)", now)

    def launch_gathers(
        self, forward_order: bool = False, indices: Sequence[int] | None = None
    ) -> list[tuple[int, BucketHandle]]:
        """Finish every reduce-scatter and launch every all-gather (waits for none);
        every bucket's handle, in launch order, which the step no longer holds.

        Collectives run in launch order: ``forward_order`` launches the last planned
        bucket first (buckets are planned in backward order), so that with the
        all-gathers deferred to the next forward the first layers' results come first.
        ``indices``: the buckets of a part of the step (``reduce_all``); None: all.
        """
        with self.ops.local_work():
            return self._launch_gathers(forward_order, indices)

    def _launch_gathers(
        self, forward_order: bool, indices: Sequence[int] | None
    ) -> list[tuple[int, BucketHandle]]:
        trace = self.trace
        ended = time.perf_counter()
        if trace is not None:
            self.poll()
            trace.backward_ended(ended)
        order = list(range(len(self.handles)) if indices is None else indices)
        order = order[::-1] if forward_order else order
        received = self._refresh_together(order)
        launched = []
        for index in order:
            handle = self.handles[index]
            assert handle is not None, "every bucket was launched"
            began = time.perf_counter()
            was_scatter = handle.scattering
            handle.advance(received.get(index))
            if trace is not None:
                name = self.names[index]
                trace.waited(name, began, time.perf_counter(), ended if was_scatter else None)
                if was_scatter:
                    trace.launched(f"{name}.ag", name, "all-gather", time.perf_counter())
            launched.append((index, handle))
            self.handles[index] = None
        return launched

    def _refresh_together(self, order: list[int]) -> dict[int, tuple[OwnedSums, Tensor | None]]:
        """The sparse buckets in flight, grouped by process set (the allreduce's ranks),
        two or more to a group: their sums and grouped keys (:func:`refresh_together`)."""
        groups: dict[int, list[int]] = {}
        for index in order:
            handle = self.handles[index]
            if handle is not None and isinstance(handle.stage, ScatterInFlight):
                groups.setdefault(id(handle.reducer.process_set), []).append(index)
        received: dict[int, tuple[OwnedSums, Tensor | None]] = {}
        for group in groups.values():
            if len(group) < 2:
                continue
            reducers = [_as_sparse(self.reducers[index]) for index in group]
            stages = [self._scatter(index) for index in group]
            label = f"{self.names[group[0]]}.refresh"
            received.update(zip(group, refresh_together(self.ops, reducers, stages, label)))
        return received

    def _scatter(self, index: int) -> ScatterInFlight:
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

    # ------------------------------------------------------------------ all at once
    def reduce_all(self, flats: Sequence[Tensor], finished: Finished | None = None) -> list[Tensor]:
        """The whole step when every bucket's gradients are in at once: each bucket's
        result, flat, in plan order. ``finished(index, result)`` runs as each bucket's
        step ends (inside the branch that ran it) and returns the result to hand out.

        Buckets of known kinds run together through :meth:`launch`,
        :meth:`launch_gathers` and :meth:`finish` (their threshold refreshes grouped).
        A bucket whose kind is a graph value takes one ``Backend.cond`` between its
        dense and sparse step; a fused run whose fusing is one, a ``Backend.cond``
        between the run's allreduce and its members' own steps.
        """
        with self.ops.local_work():
            return self._reduce_all(flats, finished)

    def _reduce_all(self, flats: Sequence[Tensor], finished: Finished | None) -> list[Tensor]:
        plan = self.open_step(gradients_in_residual=True)
        step = AllAtOnce(self, flats, finished)
        graph_runs = plan.graph_runs
        in_graph_runs = {i for run in graph_runs for i in run}
        results: list[Any] = [None] * len(self.reducers)
        known = {i: kind for i, kind in enumerate(plan.kinds) if kind is not None}
        known = {i: kind for i, kind in known.items() if i not in in_graph_runs}
        for index, result in zip(known, step.run(list(known), list(known.values()))):
            results[index] = result
        for index, kind in enumerate(plan.kinds):
            if kind is None and index not in in_graph_runs:
                results[index] = step.alone(index)
        for members in graph_runs:
            outputs = self.ops.cond(plan.runs_fuse, step.together(members), step.apart(members))
            for index, result in zip(members, outputs):
                results[index] = result
        return results

    # ------------------------------------------------------------------ records
    def poll(self) -> None:
        """Note in the trace which exchanges in flight have finished; never blocks."""
        if self.trace is None:
            return
        now = time.perf_counter()
        for name, handle in zip(self.names, self.handles):
            if handle is not None:
                self.trace.polled(name, handle.poll(), now)

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


def _as_sparse(reducer: Reducer) -> BucketReducer:
    assert isinstance(reducer, BucketReducer), "a sparse bucket's step"
    return reducer
