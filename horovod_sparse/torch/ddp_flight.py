"""The DDP hook's exchanges in flight, finished in bucket order (docs/design.md §10).

Every collective is issued from the hooks, in bucket order, so every rank issues the
same sequence (Gloo and NCCL need that): before bucket b+1 launches, every pending
bucket is moved past its reduce-scatter (:meth:`InFlight.advance`); the last bucket's
hook finishes every pending bucket (:meth:`InFlight.finish`). Waiting on a bucket's
future from Python finishes the pending buckets up to it, in the same order. No
collective is issued from a future's callback, whose thread and timing differ from rank
to rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from horovod_sparse.common.handle import BucketHandle

__all__ = ["BucketFuture", "DenseSlots", "InFlight", "Pending"]


class BucketFuture(torch.futures.Future[torch.Tensor]):
    """A DDP bucket's result, set when the bucket's exchange is finished: by a later
    bucket's hook, the last bucket's hook at the latest (DDP waits on it after that).
    ``wait()`` called from Python before then finishes the pending exchanges up to this
    bucket's, in bucket order (a hook that waits on it issues its collectives as every
    rank does). A future chained on it with ``then()`` completes when it does."""

    def __init__(self, finish_until: Callable[[BucketFuture], None]) -> None:
        super().__init__()
        self._finish_until = finish_until

    def wait(self) -> torch.Tensor:
        if not self.done():
            self._finish_until(self)
        return super().wait()


@dataclass
class DenseSlots:
    """The entries of a sparse bucket that are averaged densely (the parameters under
    ``min_sparse_numel``: biases, norms), as the Horovod optimizer reduces small tensors:
    their positions in the bucket, their values, in flight in an allreduce of their own."""

    positions: torch.Tensor
    values: torch.Tensor
    work: Any
    wait_work: Callable[[Any], torch.Tensor]
    poll_work: Callable[[Any], bool]

    def paste(self, result: torch.Tensor) -> None:
        """Wait for the average and write it into the bucket's result."""
        self.wait_work(self.work)
        result.index_copy_(0, self.positions, self.values)


@dataclass
class Pending:
    """Bucket ``index``'s exchange in flight: a sparse bucket's :class:`BucketHandle`,
    or the work of a dense allreduce in place; the future its result completes (None: a
    piece of a replayed bucket before its last); ``paste``: the whole first bucket that a
    replayed piece's result is copied into, at ``pieces`` (offset, numel); ``after``:
    what the result goes through first (``ddp_scaling.LossScaling``), after ``slots``
    are pasted in."""

    index: int
    handle: BucketHandle | None = None
    work: Any = None
    wait_work: Callable[[Any], torch.Tensor] | None = None
    poll_work: Callable[[Any], bool] | None = None
    future: BucketFuture | None = None
    paste: torch.Tensor | None = None
    pieces: list[tuple[int, int]] | None = None
    after: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to the result
    slots: DenseSlots | None = None  # a sparse bucket's densely averaged entries

    def advance(self) -> None:
        """Finish a sparse step's reduce-scatter and launch its all-gather (issues
        collectives; a no-op past that stage and for a dense allreduce)."""
        if self.handle is not None and self.handle.scattering:
            self.handle.advance()

    def ready(self) -> bool:
        """Whether the result can be taken without a collective or a wait."""
        if self.slots is not None and not self.slots.poll_work(self.slots.work):
            return False
        if self.handle is not None:
            return not self.handle.scattering and self.handle.poll()
        assert self.poll_work is not None, "a dense allreduce is polled by its backend"
        return bool(self.poll_work(self.work))

    def result(self) -> torch.Tensor:
        """Wait for the exchange and return its result (the bucket, written in place)."""
        if self.handle is not None:
            return self.handle.wait()
        assert self.wait_work is not None, "a dense allreduce is waited by its backend"
        return self.wait_work(self.work)

    def complete(self) -> None:
        """Take the result (pasted into the whole first bucket for a replayed piece) and
        set the future."""
        result = self.result()
        if self.slots is not None:
            self.slots.paste(result)
        if self.after is not None:
            result = self.after(result)
        if self.paste is not None and self.pieces is not None:
            done = 0
            for a, n in self.pieces:
                self.paste[a : a + n].copy_(result[done : done + n])
                done += n
            result = self.paste
        if self.future is not None:
            self.future.set_result(result)


class InFlight:
    """The hook's pending exchanges, in launch order."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.max_in_flight = 0

    def track(self, pending: Pending) -> BucketFuture:
        """Give the just launched ``pending`` its bucket's future."""
        pending.future = BucketFuture(self.finish)
        return pending.future

    def launched(self, pending: Pending) -> Pending:
        self.pending.append(pending)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return pending

    def advance(self) -> None:
        """Before a launch: move every pending sparse step past its reduce-scatter (in
        launch order), so that each rank issues the collectives in the same order."""
        for pending in self.pending:
            pending.advance()

    def finish(self, until: BucketFuture | None) -> None:
        """Finish the pending exchanges in launch order, through the one whose future is
        ``until`` (None: all of them). Issues the all-gathers not yet launched."""
        if until is not None and all(p.future is not until for p in self.pending):
            return
        try:
            while self.pending:
                pending = self.pending.pop(0)
                pending.complete()
                if until is not None and pending.future is until:
                    return
        except BaseException as error:
            self.fail(error)
            raise

    def finish_ready(self) -> None:
        """Finish the oldest pending exchanges whose last collective has completed:
        waits for nothing and issues nothing, so it may depend on timing."""
        while self.pending and self.pending[0].ready():
            self.pending.pop(0).complete()

    def fail(self, error: BaseException) -> None:
        """Abandon the pending exchanges: their futures carry ``error``."""
        pending, self.pending = self.pending, []
        for p in pending:
            if p.future is not None and not p.future.done():
                p.future.set_exception(error)  # type: ignore[arg-type]  # torch's stub: T
