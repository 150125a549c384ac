"""A sparse step of one bucket, docs/design.md §2 steps 2-8, split at its two collectives.

:meth:`SparseStages.start_sparse` selects and launches the reduce-scatter,
:meth:`SparseStages.receive` reduces this owner's region, :meth:`SparseStages.gather`
selects globally and launches the all-gather, :meth:`SparseStages.finish_sparse`
writes the dense result.

Invariant (checked by the tests): for every step, summed over ranks,
``residual_after + result_sum == residual_before + prescale * grad``, where
``result_sum`` is the result before the post-scale (``op=Average`` divides it by P).
"""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Tensor
from horovod_sparse.common.exchange import (
    row_bytes,
    spar_all_gather_start,
    spar_reduce_scatter_start,
)
from horovod_sparse.common.global_selection import global_threshold_key
from horovod_sparse.common.inflight import GatherInFlight, KeptHere, OwnedSums, ScatterInFlight
from horovod_sparse.common.joined import JoinedPart
from horovod_sparse.common.pair_stages import PairStages
from horovod_sparse.common.reduction import owner_reduce
from horovod_sparse.common.step import StepRecord

__all__ = ["SparseStages"]


class SparseStages(PairStages):
    """The sparse path of a bucket's step (state in
    :class:`~horovod_sparse.common.sparse_bucket.SparseBucket`; at P = 2 in one
    collective: :class:`~horovod_sparse.common.pair_stages.PairStages`)."""

    def start_sparse(self, accumulator: Tensor, began: Any) -> ScatterInFlight:
        """Local selection and the reduce-scatter launch, from the accumulator (the
        residual buffer, which already holds this step's gradients).

        Sends: one alltoall of about k(P-1)/P rows (see
        :func:`~horovod_sparse.common.exchange.spar_reduce_scatter_start`), or hands
        them to the step's joined alltoall (:mod:`~horovod_sparse.common.joined`).
        Keeps: the unselected entries as the new residual (plus the rounding of lossy
        value compression), the selected ones zeroed when the step settles its
        residual (:meth:`gather`).
        """
        ops = self.ops
        # Step 3: local selection; what is not selected stays in the residual.
        current = ops.value_of(accumulator)
        indices, values = self.selection.select_values(ops, current, self.k)
        self.keep_unsent(accumulator, indices, values)
        if self.velocity is not None:
            self.velocity = ops.zero_at(self.velocity, indices)
        wire, ctx, lost = ops.compress(values, self.compression)
        if lost is not None:
            # Lossy compression: the rounding stays here instead of vanishing.
            self.owe(indices, lost)
        selected = ops.clock(wire)
        # Step 4: partition, the boundaries every rank holds alike (a balanced partition
        # moves them after an all-gather: see finish_sparse()).
        # Step 5: Spar-Reduce-Scatter, alone or in the step's joined alltoall; at P = 2
        # the selection to both ranks instead (pair_stages.py).
        padded_rows: Any = 0
        if self.pairs:
            capacity = self.gathered_capacity()
            sent = self.send_to_both(indices, wire, capacity)
            rows_sent = ops.num_rows(indices)
            padded_rows = 0 if capacity is None else capacity
        else:
            if self.joined is not None:
                sent = self.joined.send_scatter(self, indices, wire)
            else:
                sent = spar_reduce_scatter_start(
                    ops, indices, wire, self.boundaries, self.name, self.process_set
                )
            rows_sent = ops.sum_except(sent.send_splits, self.rank)
        self.last_record = StepRecord(
            seconds_select=selected - began,
            seconds_local=selected - began,
            seconds_exchange=ops.clock() - selected,
            send_splits=sent.send_splits,
            rows_sent=rows_sent,
            padded_rows=padded_rows,
            row_bytes=row_bytes(ops.itemsize(wire)),
        )
        return ScatterInFlight(sent, wire, ctx, to_everyone=self.pairs)

    def receive(self, inflight: ScatterInFlight) -> OwnedSums:
        """Wait for the reduce-scatter; step 6a: the owner's sums. Sends nothing more."""
        ops, record = self.ops, self.last_record
        began = ops.clock()
        handle = inflight.sent.handle

        def decode(wire: Tensor) -> Tensor:
            return ops.decompress(wire, inflight.compression_ctx)

        other = None
        if inflight.to_everyone:
            # Step 6a for both owners' regions, from both ranks' selections (P = 2).
            (region_indices, sums), other, record.rows_received = self.summed_from_both(
                inflight, decode
            )
            received = ops.clock(sums)
        elif isinstance(handle, JoinedPart):
            # Step 6a for every member of the joined alltoall at once (the first asks).
            region_indices, sums, record.rows_received = handle.owned(self.residual, decode)
            received = ops.clock(sums)
        else:
            rows, recv_splits = ops.wait(handle)
            received = ops.clock(rows)
            record.recv_splits = recv_splits
            record.rows_received = ops.sum_except(recv_splits, self.rank)
            # Step 6a: owner reduction (duplicates from different ranks add up).
            region_indices, sums = owner_reduce(
                ops, rows, inflight.wire_like, self.residual, decode, recv_splits
            )
        keys = ops.magnitude_keys(sums)
        return OwnedSums(region_indices, sums, keys, began, received, ops.clock(keys), other)

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

        ``exact_key``: this bucket's radix-select key when the plan ran the selects of
        several buckets together (``plan.refresh_together``); None: its own select runs
        here when :meth:`refresh_due`.

        Sends: 4 histogram allreduces of 1 KiB when the threshold refreshes here, then
        one allgather of this owner's share of the global top-k (about k/P rows).
        Keeps: the reduced entries of this owner's region below the global threshold,
        added to ``residual`` (global residual collection: no mass is dropped).
        """
        if owned.other is not None:
            return self.gather_both(owned, exact_key)  # P = 2: no all-gather
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
        self.owe(ops.shift(drop_idx, lo), drop_val)
        selected = ops.clock(kept_val)
        # Step 7: Spar-All-Gather of the kept rows with bucket-local indices.
        wire, ctx, lost = ops.compress(kept_val, self.compression)
        bucket_idx = ops.shift(kept_idx, lo)
        if lost is not None:
            self.owe(bucket_idx, lost)
        if self.joined is not None:
            handle = self.joined.send_gather(self, bucket_idx, wire)
        else:
            handle = spar_all_gather_start(ops, bucket_idx, wire, self.name, self.process_set)
        self.settle_residual()  # while the all-gather travels
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

    def finish_sparse(
        self, inflight: GatherInFlight, like: Tensor, postscale: float, out: Tensor | None
    ) -> Tensor:
        """Step 8: wait for the all-gather and write ``postscale`` times the kept sums
        into a dense buffer of length n (zeros elsewhere), ``out`` when given."""
        ops, record = self.ops, self.last_record
        began = ops.clock()
        if isinstance(inflight.handle, KeptHere):  # P = 2: derived here, no all-gather
            indices, wire_values = inflight.handle.indices, inflight.handle.wire_values
        elif isinstance(inflight.handle, JoinedPart):
            indices, wire_values = inflight.handle.gathered()
        else:
            indices, wire_values = ops.unpack_rows(ops.wait(inflight.handle), inflight.wire_like)
        record.seconds_exchange = record.seconds_exchange + (ops.clock(wire_values) - began)
        values = ops.decompress(wire_values, inflight.compression_ctx)
        if self.reused_threshold is not None:
            # Every rank gathered the same rows: each derives the next threshold alike.
            pair_rank = self.rank if self.world_size == 2 else None  # both owners' caps
            self.reused_threshold.observe(ops, values, self.k, inflight.own_rows, pair_rank)
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
