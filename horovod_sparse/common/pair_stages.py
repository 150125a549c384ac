"""A sparse step at P = 2 in one collective: each rank's selection to both ranks.

With two ranks the reduce-scatter and the all-gather move about the bytes of one
all-gather of the two selections (a rank sends its selected rows, about k, and receives
the other's, where the alltoall sends those of the other's region, about half, and the
all-gather this owner's kept rows, about k/2), but take two collectives one after the
other, each with its own latency. Once both selections are on both ranks, each rank
sums both regions, in the order the owner does (two addends an index: their sum does
not depend on the order), and applies
both owners' global selections: the same threshold, each owner's own cap (both derived
alike on every rank: ``ReusedGlobalThreshold.pair_caps``). So both ranks derive the
rows the all-gather would have brought, and the result is the one of the two-collective
step (``tests/parallel/test_pair_exchange.py`` checks it bitwise).

Sends: one all-gather of this rank's selected rows (bucket-local int32 index and
value), or its share of the step's joined all-gather; on a refresh step the radix
select's 4 histogram allreduces, as on any step. Keeps: as the two-collective step, in
this owner's residual only: the sums of its region below the global threshold. The
other owner keeps its own.
"""

from __future__ import annotations

from typing import Any, Callable

from horovod_sparse.common.backend import Tensor
from horovod_sparse.common.exchange import ReduceScatterSent
from horovod_sparse.common.global_selection import global_threshold_key
from horovod_sparse.common.inflight import GatherInFlight, KeptHere, OwnedSums, ScatterInFlight
from horovod_sparse.common.joined import JoinedPart
from horovod_sparse.common.reduction import reduce_rows
from horovod_sparse.common.sparse_bucket import SparseBucket

__all__ = ["PairStages"]


class PairStages(SparseBucket):
    """The P = 2 path of a sparse step (see the module docstring)."""

    @property
    def pairs(self) -> bool:
        """Whether this bucket's sparse steps take the P = 2 path."""
        return self.world_size == 2 and bool(self.config.gather_selections)

    def gathered_capacity(self) -> Any:
        """The rows each rank's all-gather carries for this bucket, padding included: the
        most the selection returns for this budget, so the collective's shape repeats
        while the budget does (``Backend.pads_gathered_rows``); None where unpadded."""
        if not self.ops.pads_gathered_rows:
            return None
        return self.selection.most_rows(self.ops, self.k)

    def send_to_both(self, indices: Tensor, wire: Tensor, capacity: Any) -> ReduceScatterSent:
        """Launch the all-gather of this rank's selected rows, padded to ``capacity``
        unless it is None (or hand them to the step's joined all-gather); no splits."""
        ops = self.ops
        if self.joined is not None:
            part = self.joined.send_gather(self, indices, wire, capacity)
            return ReduceScatterSent(part, None)
        rows = ops.pack_rows(indices, 0, wire)
        if capacity is not None:
            rows = ops.pad_rows(rows, capacity)
        handle = ops.allgather_async(rows, f"{self.name}.selected", self.process_set)
        return ReduceScatterSent(handle, None)

    def summed_from_both(
        self, inflight: ScatterInFlight, decode: Callable[[Tensor], Tensor]
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], Any]:
        """Wait for both ranks' selections and sum each owner's region as that owner
        does: ``(this owner's, the other's)``, each ``(distinct region-local indices,
        sums)``, and the rows the other rank sent."""
        ops, handle = self.ops, inflight.sent.handle
        if isinstance(handle, JoinedPart):
            distinct, sums, received = handle.summed(self.residual, decode)
        else:
            indices, wire_values = ops.unpack_rows(ops.wait(handle), inflight.wire_like)
            if ops.pads_gathered_rows:
                indices, wire_values = ops.unpadded(indices, wire_values)
            # Each rank's rows ascend: two runs, in rank order, merged rather than sorted.
            own = self.last_record.rows_sent
            received = ops.num_rows(indices) - own
            runs = [own, received] if self.rank == 0 else [received, own]
            distinct, sums = reduce_rows(ops, indices, decode(wire_values), self.residual, runs)
        regions = ops.cut_at(distinct, sums, self.boundaries, ordered=True)
        return regions[self.rank], regions[1 - self.rank], received

    def gather_both(self, owned: OwnedSums, exact_key: Tensor | None) -> GatherInFlight:
        """Both owners' global selections on this rank; the kept rows of both, as the
        all-gather would bring them (no collective)."""
        ops, record = self.ops, self.last_record
        assert owned.other is not None, "received from both ranks"
        other_indices, other_sums = owned.other
        keys = [owned.keys, ops.magnitude_keys(other_sums)]
        if self.rank == 1:
            keys.reverse()  # by owner

        def exact() -> Tensor:
            if exact_key is not None:
                return exact_key
            return global_threshold_key(ops, owned.keys, self.k, self.name, self.process_set)

        reuse = self.reused_threshold
        if reuse is None:
            threshold = exact()
            thresholds = [threshold, threshold]
            record.refreshed = 1
        else:
            thresholds = reuse.pair_thresholds(ops, keys, self.k, exact)
            record.refreshed = reuse.refreshed
        thresholded = ops.clock()
        regions = [(owned.region_indices, owned.sums), (other_indices, other_sums)]
        if self.rank == 1:
            regions.reverse()
        kept_indices, kept_wire = [], []
        own_rows: Any = 0
        for owner in range(2):
            indices, sums = regions[owner]
            mask = ops.mask_at_least(keys[owner], thresholds[owner])
            (kept_idx, kept_val), (drop_idx, drop_val) = ops.split_by_mask(mask, indices, sums)
            lo = self.boundaries[owner]
            wire, ctx, lost = ops.compress(kept_val, self.compression)
            bucket_idx = ops.shift(kept_idx, lo)
            if owner == self.rank:
                # Global residual collection, and the rounding of lossy compression:
                # this owner's alone, as in its own step.
                self.owe(ops.shift(drop_idx, lo), drop_val)
                if lost is not None:
                    self.owe(bucket_idx, lost)
                own_rows, own_ctx = ops.num_rows(bucket_idx), ctx
            kept_indices.append(bucket_idx)
            kept_wire.append(wire)
        self.settle_residual()
        selected = ops.clock()
        record.seconds_select = record.seconds_select + (selected - owned.received)
        record.seconds_local = (
            record.seconds_local + (owned.reduced - owned.received) + (selected - thresholded)
        )
        record.seconds_exchange = record.seconds_exchange + (owned.received - owned.began)
        record.gather_row_bytes = 0  # no second collective
        kept = KeptHere(ops.concat(kept_indices), ops.concat(kept_wire))
        return GatherInFlight(kept, own_rows, kept_wire[self.rank], own_ctx)
