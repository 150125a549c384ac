"""One alltoall and one allgather for all the sparse buckets of a step
(docs/design.md §2, "One exchange per step").

Each collective costs a fixed latency (Horovod negotiates every request in its
background cycle) on top of its bytes. Sixteen buckets' reduce-scatters as sixteen
alltoalls cost 3.5x (P = 2) to 6.8x (P = 4) one alltoall of the same rows
(``benchmarks/negotiation.py``). So the buckets whose steps are sparse share one
:class:`JoinedExchange`: each member's stage hands its rows in instead of launching a
collective, and the last member's hand-in launches the collective for all of them.

Members' rows travel in one int32 index space: member m's index i becomes
``m * stride + i``, ``stride`` being the longest member, so each member's rows form one
contiguous range after sorting and the ranges are cut apart at host-known edges
(``Backend.cut_at``). A member's per-owner region index stays region-local as in a
bucket's own exchange, so the owner's sums and selections are the ones the bucket would
compute alone, in the same order: results are bitwise those of separate exchanges.

Sends: one alltoall (the members' rows, owner by owner) and one allgather (the members'
kept rows) per step, whatever the number of members; at P = 2 one allgather of the
members' selected rows alone (``common/pair_stages.py``). Keeps: nothing between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.exchange import ReduceScatterSent
from horovod_sparse.common.reduction import reduce_rows
from horovod_sparse.common.sparse_bucket import SparseBucket
from horovod_sparse.common.step import StepKind

__all__ = ["INDEX_LIMIT", "JoinedExchange", "JoinedPart", "join_sparse_steps"]

INDEX_LIMIT = 2**31  # the packed rows' int32 index


class JoinedPart:
    """What a member's stage holds in place of a collective's handle: its share of the
    joined collective (``collective`` is ``"scatter"`` or ``"gather"``)."""

    def __init__(self, exchange: JoinedExchange, collective: str, member: SparseBucket) -> None:
        self.exchange = exchange
        self.collective = collective
        self.member = member

    @property
    def pending(self) -> Any:
        """The joined collective's handle, or None before the last member is in."""
        if self.collective == "scatter":
            return self.exchange.scatter_handle
        return self.exchange.gather_handle

    def owned(self, like: Tensor, decode: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Any]:
        """This member's owner sums: ``(region-local indices, sums, rows received from
        the other ranks)``."""
        return self.exchange.owned(self.member, like, decode)

    def gathered(self) -> tuple[Tensor, Tensor]:
        """This member's all-gathered rows: ``(bucket-local indices, wire values)``."""
        return self.exchange.gathered(self.member)

    def summed(
        self, like: Tensor, decode: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        """At P = 2, both ranks' selected rows of this member summed: ``(distinct
        bucket-local indices, sums, rows the other rank sent)``."""
        return self.exchange.summed(self.member, like, decode)


class JoinedExchange:
    """The sparse buckets of one step that share one alltoall and one allgather.

    Args:
        ops: framework primitives.
        members: the buckets, in plan order (every rank the same), with one process set,
            dtype and compression; ``len(members) * stride`` below :data:`INDEX_LIMIT`.
    """

    def __init__(self, ops: Backend, members: Sequence[SparseBucket]) -> None:
        self.ops = ops
        self.members = list(members)
        self.stride = max(member.numel for member in self.members)
        self.edges = [m * self.stride for m in range(len(self.members) + 1)]
        first = self.members[0]
        self.name = f"{first.name}.joined{len(self.members)}"
        self.process_set = first.process_set
        self._position = {id(member): m for m, member in enumerate(self.members)}
        self._scatter_waits = set(range(len(self.members)))
        self._gather_waits = set(range(len(self.members)))
        self._sends: dict[int, tuple[Tensor, Any]] = {}
        self._own_rows: dict[int, Any] = {}  # rows a member sends to this rank itself
        self._kept: dict[int, Tensor] = {}
        self._wire_like: Tensor = None
        self.scatter_handle: Any = None
        self.gather_handle: Any = None
        self._owned: list[tuple[Tensor, Tensor, Any]] | None = None
        self._gathered: list[tuple[Tensor, Tensor]] | None = None
        self._kept_rows: dict[int, Any] = {}  # rows a member hands to the allgather
        self._summed: list[tuple[Tensor, Tensor, Any]] | None = None
        self._own_histogram: Tensor = None  # this rank's allgather rows per member (P = 2)
        self._capacity: dict[int, Any] = {}  # a member's padded rows (P = 2), or None
        self._padded = False  # whether the allgather's rows were padded

    def _base(self, member: SparseBucket) -> int:
        return self._position[id(member)] * self.stride

    def withdraw(self, member: SparseBucket) -> None:
        """``member``'s step went dense after all (its budget reached n): it sends no
        rows, and the others need not wait for it."""
        position = self._position[id(member)]
        self._scatter_waits.discard(position)
        self._gather_waits.discard(position)
        self._launch_scatter()
        self._launch_gather()

    def send_scatter(
        self, member: SparseBucket, indices: Tensor, wire: Tensor
    ) -> ReduceScatterSent:
        """Hand in ``member``'s selected rows (ascending bucket-local ``indices``, values
        in the wire dtype); the last member's hand-in launches the alltoall."""
        ops = self.ops
        splits = ops.region_counts(indices, member.boundaries)
        offsets = ops.region_offsets(indices, member.boundaries)
        position = self._position[id(member)]
        self._sends[position] = (ops.pack_rows(indices, offsets - self._base(member), wire), splits)
        self._own_rows[position] = splits[member.rank]
        self._wire_like = wire
        self._scatter_waits.discard(position)
        self._launch_scatter()
        return ReduceScatterSent(JoinedPart(self, "scatter", member), splits)

    def _launch_scatter(self) -> None:
        if self._scatter_waits or self.scatter_handle is not None or not self._sends:
            return
        rows, splits = self.ops.owner_major([self._sends[m] for m in sorted(self._sends)])
        self._sends = {}
        self.scatter_handle = self.ops.alltoall_async(
            rows, splits, f"{self.name}.rs", self.process_set
        )

    def owned(
        self, member: SparseBucket, like: Tensor, decode: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        """Wait for the alltoall (once for all members) and sum each member's rows."""
        if self._owned is None:
            self._check_launched(self.scatter_handle, self._scatter_waits, "reduce-scatter")
            ops = self.ops
            # Each rank's rows ascend: member by member, each at its own base.
            rows, per_rank = ops.wait(self.scatter_handle)
            indices, wire_values = ops.unpack_rows(rows, self._wire_like)
            # Rows per member from the other ranks, for the records: member m's
            # rows are the m-th of len(members) equal bins of the joined index.
            everyone = ops.position_histogram(indices, self.edges[-1], len(self.members))
            counts = [everyone[m] - self._own_rows.get(m, 0) for m in range(len(self.members))]
            distinct, sums = reduce_rows(ops, indices, decode(wire_values), like, per_rank)
            parts = ops.cut_at(distinct, sums, self.edges, ordered=True)
            self._owned = [(idx, part_sums, n) for (idx, part_sums), n in zip(parts, counts)]
        return self._owned[self._position[id(member)]]

    def send_gather(
        self, member: SparseBucket, bucket_indices: Tensor, wire: Tensor, capacity: Any = None
    ) -> JoinedPart:
        """Hand in ``member``'s globally kept rows (at P = 2 its selected rows, and the
        rows it pads them to, or None); the last launches the allgather."""
        position = self._position[id(member)]
        ops = self.ops
        self._kept[position] = ops.pack_rows(bucket_indices, -self._base(member), wire)
        self._kept_rows[position] = ops.num_rows(bucket_indices)
        self._capacity[position] = capacity
        if member.world_size == 2 and member.config.gather_selections:  # read by summed()
            joined_indices = ops.shift(bucket_indices, self._base(member))
            mine = ops.position_histogram(joined_indices, self.edges[-1], len(self.members))
            self._own_histogram = (
                mine if self._own_histogram is None else self._own_histogram + mine
            )
        self._wire_like = wire
        self._gather_waits.discard(position)
        self._launch_gather()
        return JoinedPart(self, "gather", member)

    def _launch_gather(self) -> None:
        if self._gather_waits or self.gather_handle is not None or not self._kept:
            return
        rows = self.ops.concat([self._kept[m] for m in sorted(self._kept)])
        capacities = [self._capacity[m] for m in sorted(self._kept)]
        self._padded = all(capacity is not None for capacity in capacities)
        if self._padded:  # the members' padding, at the end of this rank's rows
            rows = self.ops.pad_rows(rows, sum(capacities))
        self._kept = {}
        self.gather_handle = self.ops.allgather_async(rows, f"{self.name}.ag", self.process_set)

    def gathered(self, member: SparseBucket) -> tuple[Tensor, Tensor]:
        """Wait for the allgather (once for all members): this member's rows."""
        if self._gathered is None:
            self._check_launched(self.gather_handle, self._gather_waits, "all-gather")
            ops = self.ops
            indices, wire_values = ops.unpack_rows(ops.wait(self.gather_handle), self._wire_like)
            # Each rank's rows come in member order; across ranks they interleave.
            self._gathered = ops.cut_at(indices, wire_values, self.edges, ordered=False)
        return self._gathered[self._position[id(member)]]

    def summed(
        self, member: SparseBucket, like: Tensor, decode: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        """At P = 2 (``common/pair_stages.py``), where the allgather carries every
        member's selected rows: wait for it (once for all members), sum the two ranks'
        rows and cut the sums per member."""
        if self._summed is None:
            self._check_launched(self.gather_handle, self._gather_waits, "all-gather")
            ops = self.ops
            indices, wire_values = ops.unpack_rows(ops.wait(self.gather_handle), self._wire_like)
            if self._padded:
                indices, wire_values = ops.unpadded(indices, wire_values)
            # Each rank's rows ascend (member by member, each at its base): two runs,
            # in rank order, merged rather than sorted.
            own = sum(self._kept_rows.values())
            other = ops.num_rows(indices) - own
            runs = [own, other] if member.rank == 0 else [other, own]
            # Rows per member from the other rank, for the records: a histogram of all
            # rows by member, less this rank's.
            everyone = ops.position_histogram(indices, self.edges[-1], len(self.members))
            received = everyone - self._own_histogram
            counts = [received[m] for m in range(len(self.members))]
            distinct, sums = reduce_rows(ops, indices, decode(wire_values), like, runs)
            parts = ops.cut_at(distinct, sums, self.edges, ordered=True)
            self._summed = [(idx, part_sums, n) for (idx, part_sums), n in zip(parts, counts)]
        return self._summed[self._position[id(member)]]

    def _check_launched(self, handle: Any, waits: set[int], what: str) -> None:
        if handle is None:
            missing = ", ".join(self.members[m].name for m in sorted(waits))
            raise RuntimeError(
                f"the joined {what} of {self.name} was awaited before every member "
                f"handed its rows in (missing: {missing}); every sparse bucket of the "
                "step must be launched before any is finished"
            )


def join_sparse_steps(
    ops: Backend, reducers: Sequence[Any], kinds: Sequence[StepKind | None]
) -> list[JoinedExchange]:
    """Give the planned sparse steps of a step their joined exchanges (each bucket's
    ``joined``; None for the rest): one per process set, dtype and compression, in plan
    order, cut where the joined index would pass :data:`INDEX_LIMIT`. A group of one
    keeps its own exchange."""
    groups: dict[tuple[int, str, int], list[SparseBucket]] = {}
    for reducer, kind in zip(reducers, kinds):
        if not isinstance(reducer, SparseBucket):
            continue
        reducer.joined = None
        if kind is StepKind.SPARSE and reducer.config.join_buckets:
            key = (id(reducer.process_set), str(reducer.residual.dtype), id(reducer.compression))
            groups.setdefault(key, []).append(reducer)
    exchanges = []
    for members in groups.values():
        for chunk in _fitting(members):
            if len(chunk) < 2:
                continue
            exchange = JoinedExchange(ops, chunk)
            for member in chunk:
                member.joined = exchange
            exchanges.append(exchange)
    return exchanges


def _fitting(members: list[SparseBucket]) -> list[list[SparseBucket]]:
    """Consecutive runs of ``members`` whose joined index stays below INDEX_LIMIT."""
    runs: list[list[SparseBucket]] = []
    run: list[SparseBucket] = []
    for member in members:
        longest = max([member.numel] + [m.numel for m in run])
        if run and (len(run) + 1) * longest > INDEX_LIMIT:
            runs.append(run)
            run = []
        run.append(member)
    if run:
        runs.append(run)
    return runs
