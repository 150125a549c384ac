"""Dense-step fusion: adjacent buckets whose step is dense share one allreduce.

A scheduler's choice, a warm-up or density 1 can make several neighbouring sparse
buckets dense in the same step. Each would then be its own ring allreduce, launched as
its bucket completes. Horovod fuses dense gradients into buffers of up to
``HOROVOD_FUSION_THRESHOLD`` (128 MiB) instead, and on a fast link the per-collective
cost shows: 4 pinned ranks on loopback, 100 MB of gradients, ``scheduler="auto"``
choosing dense everywhere took 0.54 s/step as five 20 MiB allreduces and 0.45 s/step
as one 128 MiB bucket (Horovod's own dense step: 0.51-0.57 s).

The adapter lays the buffers of adjacent buckets out as views of one arena, so a run of
dense buckets is one contiguous slice of it, reduced in place with no copy. A run's
allreduce starts when its last bucket completes during backward, so fusing trades the
overlap of the earlier buckets' allreduces for fewer, larger collectives, exactly as
Horovod's fusion buffer does; the cap on a run's bytes is the knob (0: no fusion).

Sends: one ring allreduce of the run's values (the same bytes as the separate
allreduces). Keeps: nothing. A bucket whose residual still owes mass (the switch to
dense, or a residual restored on one rank only) moves it into its slice before the
launch, so the runs, planned from
:attr:`~horovod_sparse.common.sparse_bucket.SparseBucket.dense_step`, are the same on every
rank and no mass stays behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["DenseFusion", "FusedPart", "FusionMember", "SharedAllreduce", "plan_dense_runs"]


@dataclass(frozen=True)
class FusionMember:
    """Where one bucket's buffer lies: ``numel`` elements from ``offset`` of arena ``arena``."""

    arena: int
    offset: int
    numel: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def plan_dense_runs(
    members: Sequence[FusionMember], dense: Sequence[bool], cap_bytes: int
) -> list[list[int]]:
    """Runs of two or more adjacent members, all dense this step, to reduce together.

    Members of a run lie back to back in one arena (so the run is one slice of it) and
    total at most ``cap_bytes``; a longer stretch is cut greedily, in member order, into
    several runs. A member that fits no run keeps its own allreduce. The result depends
    on the arguments alone, so every rank that agrees on ``dense`` agrees on the runs
    (their collectives must match).
    """
    runs: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0

    def close() -> None:
        if len(current) >= 2:
            runs.append(list(current))
        current.clear()

    for index, (member, is_dense) in enumerate(zip(members, dense)):
        if not is_dense or member.nbytes > cap_bytes:
            close()
            continue
        if current:
            last = members[current[-1]]
            adjacent = last.arena == member.arena and last.offset + last.numel == member.offset
            if not adjacent or current_bytes + member.nbytes > cap_bytes:
                close()
        if not current:
            current_bytes = 0
        current.append(index)
        current_bytes += member.nbytes
    close()
    return runs


@dataclass
class SharedAllreduce:
    """One allreduce over a run's contributions; waited on once, by whichever member
    finishes first. The wait's seconds are shared among the members by size, so each
    bucket's measured exchange time stays comparable with an allreduce of its own."""

    handle: Any
    numel: int
    waited_s: float | None = None
    summed: Any = None

    def wait(self, ops: Backend) -> float:
        if self.waited_s is None:
            began = ops.clock()
            self.summed = ops.wait(self.handle)
            self.waited_s = ops.clock() - began
        return self.waited_s


@dataclass
class FusedPart:
    """One member's share of a :class:`SharedAllreduce`: the handle its dense step holds.

    ``buffer`` is the member's contribution: with an in-place backend its own view of
    the arena, which holds its part of the sum once the allreduce is waited for; else
    the member's part is the run's sum from ``offset``."""

    shared: SharedAllreduce
    buffer: Tensor
    numel: int
    offset: int = 0

    def wait(self, ops: Backend) -> tuple[Tensor, float]:
        """The member's part of the sum and its share of the wait, in seconds."""
        seconds = self.shared.wait(ops)
        share = seconds * self.numel / self.shared.numel
        if ops.in_place:
            return self.buffer, share
        return self.shared.summed[self.offset : self.offset + self.numel], share

    @property
    def pending(self) -> Any:
        """The underlying collective's handle (to poll it)."""
        return self.shared.handle


@dataclass
class DenseFusion:
    """Which buckets wait for their run this step, and when each run is complete.

    Call :meth:`plan` at the start of every step with each member's dense flag (the same
    on every rank), then :meth:`complete` as each member's gradients are all in: it
    returns a run once all of its members are complete, for the adapter to launch with
    :meth:`launch`.
    """

    members: list[FusionMember]
    cap_bytes: int
    _run_of: dict[int, list[int]] = field(default_factory=dict)
    _left: dict[int, int] = field(default_factory=dict)

    def plan(self, dense: Sequence[bool]) -> list[list[int]]:
        runs = plan_dense_runs(self.members, dense, self.cap_bytes)
        self._run_of = {index: run for run in runs for index in run}
        self._left = {run[0]: len(run) for run in runs}
        return runs

    def fused(self, index: int) -> bool:
        """Whether member ``index`` waits for its run this step."""
        return index in self._run_of

    def complete(self, index: int) -> list[int] | None:
        """Member ``index`` has all its gradients; its run, if that completes the run."""
        run = self._run_of[index]
        self._left[run[0]] -= 1
        return run if self._left[run[0]] == 0 else None

    def span(self, run: list[int]) -> tuple[int, int, int]:
        """The run's arena and its element range ``[start, stop)`` there."""
        first, last = self.members[run[0]], self.members[run[-1]]
        return first.arena, first.offset, last.offset + last.numel

    @staticmethod
    def launch(
        ops: Backend,
        contributions: Sequence[Tensor],
        arena_slice: Tensor | None,
        name: str,
        process_set: Any,
    ) -> list[FusedPart]:
        """Start the run's allreduce and hand each member its part.

        ``contributions``: each member's prescaled contribution
        (``BucketReducer.contribute_fused``). An in-place backend wrote them into the
        run's ``arena_slice``, which is reduced in place with no copy; another backend's
        contributions are concatenated (one copy) and reduced.
        """
        sizes = [ops.length(part) for part in contributions]
        if ops.in_place:
            assert arena_slice is not None, "an in-place run reduces its arena slice"
            handle = ops.allreduce_sum_inplace_async(arena_slice, name, process_set)
        else:
            handle = ops.allreduce_sum_async(ops.concat(contributions), name, process_set)
        shared = SharedAllreduce(handle, sum(sizes))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return [
            FusedPart(shared, part, numel, offset)
            for part, numel, offset in zip(contributions, sizes, offsets)
        ]
