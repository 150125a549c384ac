"""The dense paths of a bucket's step (docs/design.md §3): one allreduce of the residual
plus the gradients, of the bucket buffer, or of a fused run's slice; and the bucket of
small tensors that is always dense (:class:`DenseBucketReducer`)."""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.fusion import FusedPart
from horovod_sparse.common.inflight import GatherInFlight, ScatterInFlight
from horovod_sparse.common.sparse_bucket import SparseBucket
from horovod_sparse.common.stats import StepStats, dense_allreduce_stats
from horovod_sparse.common.step import StepRecord

__all__ = ["DenseBucketReducer", "DenseStages"]


class DenseStages(SparseBucket):
    """A sparse bucket's dense steps (warm-up, density 1, a scheduler's choice)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dense_lost: Tensor | None = None  # compression rounding of a dense step
        self._dense_from_residual = False  # whether a dense step reduces the residual

    def start_dense(
        self, accumulator: Tensor, began: Any, from_residual: bool = True
    ) -> GatherInFlight:
        """Allreduce the whole accumulator: the residual (which holds this step's
        gradients), or the bucket buffer (``from_residual=False``, kind
        DENSE_IN_BUFFER: the residual is neither read nor written).

        Sends: one ring allreduce of n values. Keeps: only the rounding of lossy value
        compression; the residual is folded into this step, so the switch to sparse
        starts from it alone. Without compression the allreduce runs in place on the
        accumulator, which :meth:`finish_dense` clears if it is the residual: no
        n-element allocation per step.
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
        self.last_record = StepRecord.dense_allreduce(
            self.numel, self.world_size, ops.itemsize(wire), ops.clock() - began
        )
        return GatherInFlight(handle, 0, wire, ctx)

    def contribute_fused(self, buffer: Tensor, prescale: float, in_buffer: bool) -> Tensor:
        """A dense step whose allreduce is shared with adjacent buckets
        (:mod:`horovod_sparse.common.fusion`): this rank's contribution, prescaled.

        ``in_buffer``: the gradients were copied into ``buffer`` (the residual owes
        nothing); they are prescaled there. Otherwise they were added to the residual,
        which moves into ``buffer`` whole (no mass stays behind) and is cleared. An
        in-place backend writes ``buffer`` itself (a view of the run's arena); another
        returns a new tensor for the run to concatenate. Needs no compression.

        Sends: its share of the run's ring allreduce (n values). Keeps: nothing.
        """
        ops = self.ops
        if in_buffer:
            written = ops.scale(buffer, prescale) if prescale != 1.0 else buffer
        else:
            written = ops.assign(buffer, self.residual)
            self.residual = ops.zero_(self.residual)
            self.residual_clear = True
        if ops.in_place:
            assert written is buffer, "an in-place kernel returns the tensor it wrote"
        self.advance(True)
        self._dense_from_residual = False
        self._dense_lost = None
        self.last_record = StepRecord.dense_allreduce(
            self.numel, self.world_size, ops.itemsize(buffer)
        )
        return written

    def finish_dense(
        self, inflight: GatherInFlight, postscale: float, out: Tensor | None
    ) -> Tensor:
        """Wait for the allreduce (a fused run's share of it, or the bucket's own) and
        hand out ``postscale`` times the sum, written into ``out`` when given."""
        ops, record = self.ops, self.last_record
        if isinstance(inflight.handle, FusedPart):
            rows, waited = inflight.handle.wait(ops)
        else:
            began = ops.clock()
            rows = ops.wait(inflight.handle)
            waited = ops.clock(rows) - began
        record.seconds_exchange = record.seconds_exchange + waited
        summed = ops.decompress(rows, inflight.compression_ctx)
        if postscale != 1.0:
            summed = ops.scale(summed, postscale)
        if out is not None and summed is out:
            result = summed  # reduced in place in the caller's buffer
        else:
            # ``summed`` may be the residual buffer itself (in-place allreduce): copy it
            # out before the residual is cleared.
            result = ops.assign(out, summed) if out is not None else ops.copy(summed)
        if self._dense_from_residual:
            self.residual = ops.zero_(self.residual)
        if self._dense_lost is not None:
            self.residual = ops.add_scaled_(self.residual, self._dense_lost, 1.0)
        self.residual_clear = self._dense_lost is None
        return result


class DenseBucketReducer:
    """Dense allreduce of a flat buffer of small tensors; the interface of a bucket's step.

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
        self.last_record = StepRecord.dense_allreduce(
            self.numel, self.world_size, self._wire_itemsize, self.ops.clock() - began
        )
        return GatherInFlight(handle, 0, wire, ctx)

    def launch(self, grad: Tensor, prescale: float = 1.0) -> GatherInFlight:
        """Every step reduces the buffer of gradients (the kind DENSE_IN_BUFFER)."""
        return self.start(grad, prescale)

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
