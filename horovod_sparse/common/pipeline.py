"""One bucket's sparse allreduce, docs/design.md §2 steps 2-7, written once for every framework.

The work is split at the two collectives so an adapter can overlap them with
computation: :meth:`BucketReducer.start` launches the reduce-scatter,
:meth:`BucketReducer.reduce_and_gather` finishes it and launches the all-gather,
:meth:`BucketReducer.finish` returns the dense result.

Invariant (checked by the tests): for every step, summed over ranks,
``residual_after + result_sum == residual_before + prescale * grad``, where
``result_sum`` is the result before the post-scale (``op=Average`` divides it by P).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor, host_at_least
from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.exchange import (
    ReduceScatterSent,
    row_bytes,
    spar_all_gather_start,
    spar_reduce_scatter_start,
)
from horovod_sparse.common.fusion import FusedPart
from horovod_sparse.common.global_selection import (
    ReusedGlobalThreshold,
    global_threshold_key,
    histogram_bytes,
)
from horovod_sparse.common.partition import make_partitioner
from horovod_sparse.common.reduction import owner_reduce
from horovod_sparse.common.selection import make_selection
from horovod_sparse.common.stats import (
    StepStats,
    allgather_ring_bytes,
    allreduce_ring_bytes,
    dense_allreduce_stats,
)
from horovod_sparse.common.step import StepKind, StepRecord

__all__ = [
    "BucketReducer",
    "DenseBucketReducer",
    "GatherInFlight",
    "OwnedSums",
    "ScatterInFlight",
]


@dataclass
class ScatterInFlight:
    """State between :meth:`BucketReducer.start` and :meth:`BucketReducer.reduce_and_gather`."""

    sent: ReduceScatterSent
    wire_like: Tensor  # a tensor in the wire dtype, to decode the rows
    compression_ctx: Any


@dataclass
class GatherInFlight:
    """State between :meth:`BucketReducer.reduce_and_gather` and :meth:`BucketReducer.finish`."""

    handle: Any
    own_rows: int
    wire_like: Tensor
    compression_ctx: Any


@dataclass
class OwnedSums:
    """State between :meth:`BucketReducer.receive` and :meth:`BucketReducer.gather`:
    this owner's reduced region (distinct region-local indices, their sums, and the
    sums' magnitude keys) and the clock readings of the stage."""

    region_indices: Tensor
    sums: Tensor
    keys: Tensor
    began: Any
    received: Any
    reduced: Any


class BucketReducer:
    """Sparse allreduce of one flat buffer, with its error-feedback residual.

    Hyperparameters: ``config`` (density, selection, partition).
    Internal state: ``residual`` (what this rank still owes the sum: entries it did not
    select, plus, for its own region, reduced entries the global selection dropped);
    the selection and partition objects (stateful methods keep their state there).
    Statistics: ``last_stats()`` for the most recent step.

    Args:
        ops: framework primitives.
        name: collective-name stem, identical on every rank.
        numel: buffer length n.
        like: a tensor with the buffer's dtype and device.
        config: hyperparameters.
        process_set: the ranks taking part (the adapter's process-set object).
        compression: the adapter's value compression (Horovod ``Compression``), or None.
    """

    def __init__(
        self,
        ops: Backend,
        name: str,
        numel: int,
        like: Tensor,
        config: SparseConfig,
        process_set: Any,
        compression: Any = None,
    ) -> None:
        self.ops = ops
        self.name = name
        self.numel = numel
        self.config = config
        self.process_set = process_set
        self.compression = compression
        self.rank = ops.rank(process_set)
        self.world_size = ops.size(process_set)
        self.selection = make_selection(config.selection, config.reestimate_steps)
        self.partitioner = make_partitioner(config.partition, config.repartition_steps)
        # Boundaries and the step count change from step to step: backend cells (host
        # values under PyTorch, variables under TensorFlow; see common/backend.py).
        self._boundaries = ops.cell(self.partitioner.boundaries(numel, self.world_size))
        self._step = ops.cell(0)
        self.residual = ops.zeros(numel, like)
        # Host-side knowledge that the residual holds only zeros (true at the start and
        # after a dense step without lossy compression). A dense step then needs nothing
        # from it, and the adapter can reduce the bucket buffer itself: see
        # :attr:`dense_in_buffer`. Assigning ``residual`` clears it.
        self.residual_clear = True
        # An adapter's momentum-correction velocity over the bucket, or None: entries this
        # rank selects are zeroed in it too (momentum factor masking).
        self.velocity: Tensor | None = None
        # Set by an automatic scheduler: exchange this bucket densely while True.
        self.force_dense = False
        # The global threshold derived from the last all-gather (global_selection="reuse").
        self.reused_threshold = (
            ReusedGlobalThreshold(config.refresh_steps)
            if config.global_selection == "reuse"
            else None
        )
        # Budget of the current step: a host int, or a graph scalar (Backend.sparse_budget).
        self.k: Any = config.budget(numel)
        self._dense_lost: Tensor | None = None  # compression rounding of a dense step
        self._dense_from_residual = False  # whether a dense step reduces the residual
        self.last_record = StepRecord()  # what the last step did

    @property
    def step(self) -> Any:
        """Steps started; drives the density schedule and the partition updates."""
        return self._step.get()

    @step.setter
    def step(self, value: Any) -> None:
        self._step.set(value)

    @property
    def boundaries(self) -> Any:
        """Owner regions: P + 1 host ints (a graph tensor of them under TensorFlow)."""
        return self._boundaries.get()

    @boundaries.setter
    def boundaries(self, value: Any) -> None:
        self._boundaries.set(value)

    @property
    def residual(self) -> Tensor:
        """What this rank still owes the sum, one flat buffer over the bucket."""
        return self._residual

    @residual.setter
    def residual(self, value: Tensor) -> None:
        # Whoever writes the residual may have written mass into it.
        self._residual = value
        self.residual_clear = False

    # ---------------------------------------------------------------- stage 1
    def accumulate(self, grad: Tensor, offset: int, prescale: float = 1.0) -> None:
        """Step 2 for one tensor of the bucket: ``residual[offset:] += prescale * grad``.

        Lets an adapter add each gradient as backward produces it, so :meth:`start`
        (with ``grad=None``) needs no separate flat copy of the bucket.
        """
        self.residual = self.ops.add_scaled_at_(self.residual, offset, grad, prescale)

    @property
    def dense_in_buffer(self) -> bool:
        """Whether the next step is dense (warm-up, density 1, or a scheduler's choice)
        while the residual owes nothing.

        Such a step is a plain allreduce of the gradients, exactly as a dense bucket's:
        the adapter copies each gradient into the bucket buffer instead of adding it to
        the residual, and calls :meth:`start_in_buffer`. That saves three passes over
        the bucket per step (add into the residual, copy out of it, clear it).
        """
        return self.residual_clear and self.dense_step

    @property
    def dense_step(self) -> bool:
        """Whether the next step is dense: warm-up, density 1, or a scheduler's choice.

        Unlike :attr:`dense_in_buffer`, it depends on nothing a single rank may hold
        alone (a residual restored on one rank only), so ranks that agree on the step
        and the schedule agree on it; dense-step fusion plans its collectives from it.
        """
        # A host bool, or under TF a graph bool on the step variable (the backend's
        # budget follows the step there), so a traced step decides it per call.
        scheduled = self.ops.scheduled_budget(self.numel, self.config, self.step)
        return self.force_dense or scheduled >= self.numel

    def step_kind(self, fused: bool = False) -> StepKind:
        """The kind of the next step: ``fused`` when dense-step fusion put this bucket in
        a run (:mod:`~horovod_sparse.common.fusion`, planned from :attr:`dense_step`);
        otherwise from the schedule and whether the residual owes anything."""
        if fused:
            return StepKind.DENSE_FUSED
        if self.dense_in_buffer:
            return StepKind.DENSE_IN_BUFFER
        if self.dense_step:
            return StepKind.DENSE_FROM_RESIDUAL
        return StepKind.SPARSE

    def gradients_in_buffer(self, kind: StepKind) -> bool:
        """Whether this step's gradients are copied into the bucket buffer (a dense step
        while the residual owes nothing) rather than added to the residual."""
        return kind is StepKind.DENSE_IN_BUFFER or (
            kind is StepKind.DENSE_FUSED and self.residual_clear
        )

    def launch(self, kind: StepKind, buffer: Tensor, prescale: float = 1.0) -> Any:
        """Start a step of ``kind`` once all gradients are in (see
        :meth:`gradients_in_buffer`): the in-flight state, or None for a fused step,
        whose run's allreduce the adapter launches (:meth:`start_fused`)."""
        if kind is StepKind.DENSE_FUSED:
            self.prepare_fused(buffer, prescale)
            return None
        if kind is StepKind.DENSE_IN_BUFFER:
            return self.start_in_buffer(buffer, prescale)
        return self.start(None, dense=kind is StepKind.DENSE_FROM_RESIDUAL)

    def start(
        self, grad: Tensor | None, prescale: float = 1.0, dense: bool | None = None
    ) -> ScatterInFlight | GatherInFlight:
        """Error feedback, local selection, and the reduce-scatter launch.

        Sends: one alltoall of about k(P-1)/P rows (see
        :func:`~horovod_sparse.common.exchange.spar_reduce_scatter_start`).
        Keeps: the unselected entries of ``residual + prescale * grad`` as the new
        residual (plus the rounding of lossy value compression).

        ``dense``: the step's kind when the caller decided it (a traced TF step takes
        both kinds under a ``tf.cond`` on the step count); ``None``: :attr:`dense_step`.
        """
        ops = self.ops
        began = ops.clock()
        if dense is None:
            dense = self.dense_step
        # A sparse step is past any warm-up: its density reads the step count only while
        # it decays. The backend computes that k: a host int, or, where the step count
        # is a graph value (TF), a graph scalar, below n since a tf.cond on the same
        # schedule takes the dense kind whenever the budget reaches n.
        self.k = self.numel if dense else ops.sparse_budget(self.numel, self.config, self.step)
        self.step = self.step + 1
        # Step 2: error feedback; the residual buffer becomes the accumulator in place
        # (already done tensor by tensor through accumulate() when grad is None).
        if grad is not None:
            self.residual = ops.add_scaled_(self.residual, grad, prescale)
        self.residual_clear = False  # the gradients are in it (see accumulate())
        accumulator = self.residual
        if dense or host_at_least(self.k, self.numel):
            return self._start_dense(accumulator, began)
        # Step 3: local selection; what is not selected stays in the residual.
        indices = self.selection.select(ops, accumulator, self.k)
        values = ops.take(accumulator, indices)
        self.residual = ops.zero_at(accumulator, indices)
        if self.velocity is not None:
            self.velocity = ops.zero_at(self.velocity, indices)
        wire, ctx, lost = ops.compress(values, self.compression)
        if lost is not None:
            # Lossy compression: the rounding stays here instead of vanishing.
            self.residual = ops.add_at(self.residual, indices, lost)
        selected = ops.clock(wire)
        # Step 4: partition, the boundaries every rank holds alike (a balanced partition
        # moves them after an all-gather: see finish()).
        boundaries = self.boundaries
        # Step 5: Spar-Reduce-Scatter.
        sent = spar_reduce_scatter_start(
            ops, indices, wire, boundaries, self.name, self.process_set
        )
        self.last_record = StepRecord(
            seconds_select=selected - began,
            seconds_local=selected - began,
            seconds_exchange=ops.clock() - selected,
            send_splits=sent.send_splits,
            rows_sent=ops.sum_except(sent.send_splits, self.rank),
            row_bytes=row_bytes(ops.itemsize(wire)),
        )
        return ScatterInFlight(sent, wire, ctx)

    def start_in_buffer(self, buffer: Tensor, prescale: float = 1.0) -> GatherInFlight:
        """A dense step while :attr:`dense_in_buffer`: allreduce ``buffer``, which holds
        this step's gradients (the adapter copied them there), in place.

        Sends: one ring allreduce of n values. Keeps: only the rounding of lossy value
        compression. The residual (all zeros) is neither read nor written.
        """
        began = self.ops.clock()
        self.k = self.numel
        self.step += 1
        if prescale != 1.0:
            buffer = self.ops.scale(buffer, prescale)
        return self._start_dense(buffer, began, from_residual=False)

    def _start_dense(
        self, accumulator: Tensor, began: Any, from_residual: bool = True
    ) -> GatherInFlight:
        """A dense step (warm-up, density 1, a scheduler's choice): allreduce the whole
        accumulator (the residual, or the bucket buffer of :meth:`start_in_buffer`).

        Sends: one ring allreduce of n values. Keeps: only the rounding of lossy value
        compression; the residual is folded into this step, so the switch to sparse
        starts from it alone. Without compression the allreduce runs in place on the
        accumulator, which :meth:`finish` clears if it is the residual: no n-element
        allocation per step.
        """
        ops = self.ops
        self._dense_from_residual = from_residual
        wire, ctx, lost = ops.compress(accumulator, self.compression)
        name = f"{self.name}.warm"
        if wire is accumulator:
            handle = ops.allreduce_sum_inplace_async(wire, name, self.process_set)
        else:
            handle = ops.allreduce_sum_async(wire, name, self.process_set)
        self._dense_lost = lost
        self.last_record = self._dense_record(ops.itemsize(wire), ops.clock() - began)
        return GatherInFlight(handle, 0, wire, ctx)

    def prepare_fused(self, buffer: Tensor, prescale: float = 1.0) -> None:
        """A :attr:`dense_step` whose allreduce is shared with adjacent buckets
        (:mod:`horovod_sparse.common.fusion`), before the adapter launches it: leave
        this rank's prescaled contribution in ``buffer``.

        With a clear residual the adapter copied the gradients into ``buffer``; they are
        prescaled here. Otherwise it added them to the residual, which moves into
        ``buffer`` whole (no mass stays behind) and is cleared. Needs no compression.

        Sends: its share of the run's ring allreduce (n values). Keeps: nothing.
        """
        ops = self.ops
        # The run's allreduce reduces the arena slice that ``buffer`` is a view of, so
        # this rank's contribution must be written there: only an in-place backend
        # fuses this way (the TF adapter concatenates its runs instead).
        assert ops.in_place, "dense-step fusion writes into the adapter's arena"
        written = buffer
        if not self.dense_in_buffer:
            written = ops.assign(buffer, self.residual)
            self.residual = ops.zero_(self.residual)
            self.residual_clear = True
        elif prescale != 1.0:
            written = ops.scale(buffer, prescale)
        assert written is buffer, "an in-place kernel returns the tensor it wrote"
        self.k = self.numel
        self.step += 1
        self._dense_from_residual = False
        self._dense_lost = None
        self.last_record = self._dense_record(ops.itemsize(buffer), 0.0)

    def start_fused(self, part: FusedPart) -> GatherInFlight:
        """The in-flight state of a :meth:`prepare_fused` step once its run's allreduce
        is launched over ``part.buffer`` and its neighbours. Launches nothing."""
        return GatherInFlight(part, 0, part.buffer, None)

    def _dense_record(self, wire_itemsize: int, exchange_s: Any) -> StepRecord:
        return StepRecord(
            dense=1,
            extra_bytes=allreduce_ring_bytes(self.numel, self.world_size, wire_itemsize)[0],
            seconds_exchange=exchange_s,
            send_splits=[0] * self.world_size,
            recv_splits=[0] * self.world_size,
        )

    # ---------------------------------------------------------------- stage 2
    def reduce_and_gather(self, inflight: ScatterInFlight | GatherInFlight) -> GatherInFlight:
        """Owner reduction, global selection, global residual collection, all-gather
        launch: :meth:`receive`, then :meth:`gather`."""
        if isinstance(inflight, GatherInFlight):  # a dense step has no second stage
            return inflight
        return self.gather(self.receive(inflight))

    def receive(self, inflight: ScatterInFlight) -> OwnedSums:
        """Wait for the reduce-scatter; step 6a: the owner's sums. Sends nothing more."""
        ops, record = self.ops, self.last_record
        began = ops.clock()
        rows, recv_splits = ops.wait(inflight.sent.handle)
        received = ops.clock(rows)
        record.recv_splits = recv_splits
        record.rows_received = ops.sum_except(recv_splits, self.rank)
        # Step 6a: owner reduction (duplicates from different ranks add up).
        region_indices, sums = owner_reduce(
            ops,
            rows,
            inflight.wire_like,
            self.residual,
            decode=lambda wire: ops.decompress(wire, inflight.compression_ctx),
        )
        keys = ops.magnitude_keys(sums)
        return OwnedSums(region_indices, sums, keys, began, received, ops.clock(keys))

    def refresh_due(self, owned: OwnedSums | None = None) -> Any:
        """Whether this step's global threshold comes from the exact radix select: every
        step with ``global_selection="exact"``, on refresh steps with ``"reuse"``.

        ``owned``: this step's owner sums, when received; the reused threshold's state
        is then made first if this is the first step, so that under TF the answer is a
        graph value read from its cells (a host True without them)."""
        reuse = self.reused_threshold
        if reuse is None:
            return True
        if owned is not None:
            reuse.bind(self.ops, owned.keys)
        return reuse.due_for(self.k)

    def gather(self, owned: OwnedSums, exact_key: Tensor | None = None) -> GatherInFlight:
        """Global selection, global residual collection and the all-gather launch.

        ``exact_key``: this bucket's radix-select key when the caller ran the selects of
        several buckets together (:func:`grouped_threshold_keys`); None: its own select
        runs here when :meth:`refresh_due`.

        Sends: 4 histogram allreduces of 1 KiB when the threshold refreshes here, then
        one allgather of this owner's share of the global top-k (about k/P rows).
        Keeps: the reduced entries of this owner's region below the global threshold,
        added to ``residual`` (global residual collection: no mass is dropped).
        """
        ops, record, keys = self.ops, self.last_record, owned.keys
        lo = self.boundaries[self.rank]  # start of this owner's region

        def exact() -> Tensor:
            if exact_key is not None:
                return exact_key
            return global_threshold_key(ops, keys, self.k, self.name, self.process_set)

        # Step 6b: global selection by the global k-th magnitude: exact (a radix select),
        # or reused from the last all-gather, at most k rows per owner.
        reuse = self.reused_threshold
        if reuse is None:
            threshold = exact()
            record.refreshed = 1
        else:
            threshold = reuse.threshold(ops, keys, self.k, exact)
            record.refreshed = reuse.refreshed
        thresholded = ops.clock()
        kept_mask = ops.mask_at_least(keys, threshold)
        (kept_idx, kept_val), (drop_idx, drop_val) = ops.split_by_mask(
            kept_mask, owned.region_indices, owned.sums
        )
        # Step 6c: global residual collection: dropped sums go back to this owner's residual.
        self.residual = ops.add_at(self.residual, ops.shift(drop_idx, lo), drop_val)
        selected = ops.clock(kept_val)
        # Step 7: Spar-All-Gather of the kept rows with bucket-local indices.
        wire, ctx, lost = ops.compress(kept_val, self.compression)
        bucket_idx = ops.shift(kept_idx, lo)
        if lost is not None:
            self.residual = ops.add_at(self.residual, bucket_idx, lost)
        handle = spar_all_gather_start(ops, bucket_idx, wire, self.name, self.process_set)
        record.seconds_select = record.seconds_select + (selected - owned.received)
        # Local work only (no collective waits), for an automatic scheduler's cost model.
        record.seconds_local = (
            record.seconds_local + (owned.reduced - owned.received) + (selected - thresholded)
        )
        record.seconds_exchange = (
            record.seconds_exchange + (owned.received - owned.began) + (ops.clock() - selected)
        )
        record.gather_row_bytes = row_bytes(ops.itemsize(wire))
        return GatherInFlight(handle, ops.num_rows(bucket_idx), wire, ctx)

    # ---------------------------------------------------------------- stage 3
    def finish(
        self, inflight: GatherInFlight, like: Tensor, postscale: float = 1.0, out: Tensor = None
    ) -> Tensor:
        """Wait for the all-gather and write the dense result (zeros elsewhere).

        Sends nothing more. Returns ``postscale * sum`` as a flat buffer of length n,
        written into ``out`` when given (saves allocating n elements every step).
        """
        ops, record = self.ops, self.last_record
        if isinstance(inflight.handle, FusedPart):
            rows, waited = inflight.handle.wait(ops)
        else:
            began = ops.clock()
            rows = ops.wait(inflight.handle)
            waited = ops.clock(rows) - began
        record.seconds_exchange = record.seconds_exchange + waited
        if record.dense:
            summed = ops.decompress(rows, inflight.compression_ctx)
            record.gathered_rows = record.own_rows = record.next_rows = self.numel
            if postscale != 1.0:
                summed = ops.scale(summed, postscale)
            if out is not None and summed is out:
                result = summed  # reduced in place in the caller's buffer
            else:
                # ``summed`` may be the residual buffer itself (in-place allreduce): copy
                # it out before the residual is cleared.
                result = ops.assign(out, summed) if out is not None else ops.copy(summed)
            if self._dense_from_residual:
                self.residual = ops.zero_(self.residual)
            if self._dense_lost is not None:
                self.residual = ops.add_scaled_(self.residual, self._dense_lost, 1.0)
            self.residual_clear = self._dense_lost is None
            return result
        indices, wire_values = ops.unpack_rows(rows, inflight.wire_like)
        values = ops.decompress(wire_values, inflight.compression_ctx)
        if self.reused_threshold is not None:
            # Every rank gathered the same rows: each derives the next threshold alike.
            self.reused_threshold.observe(ops, values, self.k, inflight.own_rows)
        if postscale != 1.0:
            values = ops.scale(values, postscale)  # scale the k kept values, not all n
        result = ops.scatter_into(self.numel, like, indices, values, out)
        nxt = (self.rank + 1) % self.world_size
        record.gathered_rows = ops.num_rows(indices)
        record.own_rows = inflight.own_rows
        record.next_rows = ops.count_in_range(
            indices, self.boundaries[nxt], self.boundaries[nxt + 1]
        )
        # Every rank gathered the same indices: a balanced partition re-cuts from them.
        self.boundaries = self.partitioner.follow_gathered(
            ops, indices, self.boundaries, self.numel, self.world_size, self.step - 1
        )
        if not self.config.error_feedback:
            # Ablation only: what was not sent this step is forgotten.
            self.residual = ops.scale(self.residual, 0.0)
        return result

    # ---------------------------------------------------------------- stats
    def stats_of(self, record: StepRecord) -> StepStats:
        """:class:`StepStats` of a step from its record with host numbers
        (:meth:`StepRecord.on_host`)."""
        dense_sent, dense_received = allreduce_ring_bytes(
            self.numel, self.world_size, self.ops.itemsize(self.residual)
        )
        sent = received = int(record.extra_bytes)
        dense = int(record.dense)
        if not dense:
            ag_sent, ag_received = allgather_ring_bytes(
                int(record.gathered_rows),
                int(record.own_rows),
                int(record.next_rows),
                record.gather_row_bytes,
            )
            refreshed = int(record.refreshed)
            hist_sent, hist_received = histogram_bytes(self.world_size)
            hist_sent, hist_received = hist_sent * refreshed, hist_received * refreshed
            sent += int(record.rows_sent) * record.row_bytes + ag_sent + hist_sent
            received += int(record.rows_received) * record.row_bytes + ag_received + hist_received
        return StepStats(
            bytes_sent=sent,
            bytes_received=received,
            dense_bytes=dense_sent + dense_received,
            numel=self.numel,
            selected=int(record.gathered_rows),
            density=int(record.gathered_rows) / self.numel,
            seconds_select=float(record.seconds_select),
            seconds_exchange=float(record.seconds_exchange),
            dense_buckets=dense,
            sparse_buckets=1 - dense,
            global_refreshes=0 if dense else int(record.refreshed),
        )

    def last_stats(self) -> StepStats:
        """Statistics of the most recent completed step (reads device scalars)."""
        return self.stats_of(self.last_record.on_host(self.ops))

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry to continue exactly: the residual (this rank's
        mass still owed), the step (the density schedule's position), the selection's
        state (a reused threshold), the reused global threshold and the partition
        boundaries."""
        state = {
            "residual": self.residual,
            "step": self.step,
            "selection": self.selection.state_dict(),
            "boundaries": list(self.boundaries),
            "world_size": self.world_size,
        }
        if self.reused_threshold is not None:
            state["global_threshold"] = self.reused_threshold.state_dict(self.ops)
        return state

    def load_state_dict(self, state: dict[str, Any], residual: bool = True) -> None:
        """Restore :meth:`state_dict`; ``residual=False`` keeps the current residual.

        Boundaries and a reused global threshold are restored only when the world size
        is the same (otherwise the partitioner starts again from its initial cut, and
        the threshold from a refresh); a checkpoint without the threshold refreshes too.
        """
        self.step = int(state["step"])
        self.selection.load_state_dict(state["selection"])
        same_world = int(state["world_size"]) == self.world_size
        self.restore_global_threshold(state.get("global_threshold") if same_world else None)
        if same_world:
            self.boundaries = [int(b) for b in state["boundaries"]]
        if residual:
            self.residual = self.ops.add_scaled_(
                self.ops.scale(self.residual, 0.0), state["residual"], 1.0
            )

    def restore_global_threshold(self, saved: dict[str, Any] | None) -> None:
        """Take a reused global threshold's saved state; None: refresh at the next
        sparse step. A no-op with ``global_selection="exact"``."""
        reuse = self.reused_threshold
        if reuse is None:
            return
        if saved is None:
            reuse.restart()
            return
        like = self.ops.magnitude_keys(self.ops.zeros(1, self.residual))  # an int32 key
        reuse.load_state_dict(self.ops, saved, like)


class DenseBucketReducer:
    """Dense allreduce of a flat buffer of small tensors; the interface of :class:`BucketReducer`.

    Small tensors (biases, norms) cost more in latency than they save in bytes when sent
    sparsely. They are fused into a buffer whose layout we choose, so the reduction order
    is the same every run (Horovod's own run-time fusion depends on timing, and with
    P > 2 a different fusion layout changes float rounding).

    Sends: one ring allreduce of n values (2n(P-1)/P each way). Keeps: nothing.
    """

    def __init__(
        self,
        ops: Backend,
        name: str,
        numel: int,
        like: Tensor,
        process_set: Any,
        compression: Any = None,
    ) -> None:
        self.ops = ops
        self.name = name
        self.numel = numel
        self.process_set = process_set
        self.compression = compression
        self.world_size = ops.size(process_set)
        self._grad_itemsize = ops.itemsize(like)
        self._wire_itemsize = self._grad_itemsize
        self.last_record = StepRecord(dense=1)

    def start(self, grad: Tensor, prescale: float = 1.0) -> GatherInFlight:
        began = self.ops.clock()
        scaled = self.ops.scale(self.ops.copy(grad), prescale) if prescale != 1.0 else grad
        wire, ctx, _ = self.ops.compress(scaled, self.compression)
        self._wire_itemsize = self.ops.itemsize(wire)
        handle = self.ops.allreduce_sum_async(wire, f"{self.name}.dense", self.process_set)
        self.last_record = StepRecord(
            dense=1,
            gathered_rows=self.numel,
            own_rows=self.numel,
            next_rows=self.numel,
            seconds_exchange=self.ops.clock() - began,
        )
        return GatherInFlight(handle, 0, wire, ctx)

    def step_kind(self, fused: bool = False) -> StepKind:
        # Every step reduces the buffer of gradients; never fused (not in an arena).
        return StepKind.DENSE_IN_BUFFER

    def gradients_in_buffer(self, kind: StepKind) -> bool:
        return True

    def launch(self, kind: StepKind, buffer: Tensor, prescale: float = 1.0) -> Any:
        return self.start(buffer, prescale)

    def reduce_and_gather(self, inflight: ScatterInFlight | GatherInFlight) -> GatherInFlight:
        assert isinstance(inflight, GatherInFlight)  # a dense bucket has one stage
        return inflight

    def finish(
        self, inflight: GatherInFlight, like: Tensor, postscale: float = 1.0, out: Tensor = None
    ) -> Tensor:
        # ``out`` is accepted for interface parity; the allreduce has its own output.
        began = self.ops.clock()
        summed = self.ops.decompress(self.ops.wait(inflight.handle), inflight.compression_ctx)
        record = self.last_record
        record.seconds_exchange = record.seconds_exchange + (self.ops.clock(summed) - began)
        return self.ops.scale(summed, postscale) if postscale != 1.0 else summed

    def stats_of(self, record: StepRecord) -> StepStats:
        """:class:`StepStats` of a step from its record with host numbers."""
        return dense_allreduce_stats(
            self.numel,
            self.world_size,
            self._wire_itemsize,
            self._grad_itemsize,
            float(record.seconds_exchange),
        )

    def last_stats(self) -> StepStats:
        return self.stats_of(self.last_record.on_host(self.ops))
