"""The one handle type of an exchange in flight (docs/design.md §3).

A bucket's exchange has up to two stages in flight: the reduce-scatter (a sparse step's
alltoall, launched by ``BucketReducer.start``) and then the all-gather or allreduce
(launched by ``reduce_and_gather``). :class:`BucketHandle` holds whichever is in flight
and knows how to move it on, so the optimizer, the deferred updates of
``overlap_allgather``, the functional ``sparse_allreduce_async`` and the trace all hold
the same kind of object: ``poll()`` (never blocks), ``advance()`` (finish the
reduce-scatter, launch the all-gather) and ``wait()`` (the result).

Sends nothing itself beyond what ``reduce_and_gather`` sends when it advances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.fusion import FusedPart
from horovod_sparse.common.inflight import GatherInFlight, KeptHere, OwnedSums, ScatterInFlight
from horovod_sparse.common.joined import JoinedPart
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.plan import Reducer

__all__ = ["BucketHandle"]


@dataclass
class BucketHandle:
    """One bucket's exchange in flight.

    Args:
        reducer: the bucket's reducer, which launched ``stage``.
        stage: the stage in flight.
        like: a tensor with the result's dtype and device.
        postscale: the factor applied to the sum (1/P for an average).
        out: where the result is written (the bucket buffer), or None for a new tensor.
    """

    reducer: Reducer
    stage: ScatterInFlight | GatherInFlight
    like: Tensor
    postscale: float = 1.0
    out: Tensor | None = None

    @property
    def ops(self) -> Backend:
        return self.reducer.ops

    @property
    def scattering(self) -> bool:
        """Whether the reduce-scatter is still the stage in flight."""
        return isinstance(self.stage, ScatterInFlight)

    @property
    def collective(self) -> Any:
        """The framework's handle of the collective in flight (None before a shared one
        is launched, and when no collective is left: the rows kept here, P = 2)."""
        stage = self.stage
        handle = stage.sent.handle if isinstance(stage, ScatterInFlight) else stage.handle
        if isinstance(handle, (FusedPart, JoinedPart)):
            return handle.pending  # the shared collective (None until it is launched)
        if isinstance(handle, KeptHere):
            return None
        return handle

    def poll(self) -> bool:
        """Whether the collective in flight has finished; never blocks."""
        if isinstance(self.stage, GatherInFlight) and isinstance(self.stage.handle, KeptHere):
            return True  # derived on this rank (P = 2): nothing in flight
        collective = self.collective
        return collective is not None and self.ops.poll(collective)

    def advance(self, received: tuple[OwnedSums, Tensor | None] | None = None) -> None:
        """Finish the reduce-scatter and launch the all-gather (a no-op once done).

        ``received``: the owner's sums and, when its radix select ran together with
        other buckets' (``plan.refresh_together``), the exact threshold key.
        """
        with self.ops.local_work():  # docs/design.md §12
            self._advance(received)

    def _advance(self, received: tuple[OwnedSums, Tensor | None] | None) -> None:
        if isinstance(self.stage, ScatterInFlight):
            if received is None:
                self.stage = self.reducer.reduce_and_gather(self.stage)
            else:
                owned, exact_key = received
                reducer = self.reducer
                assert isinstance(reducer, BucketReducer), "only a sparse step scatters"
                self.stage = reducer.gather(owned, exact_key)

    def wait(self) -> Tensor:
        """Block until the result is there and return it, flat (written into ``out``
        when given)."""
        with self.ops.local_work():
            self._advance(None)
            stage = self.stage
            assert isinstance(stage, GatherInFlight), "advanced above"
            return self.reducer.finish(stage, self.like, self.postscale, out=self.out)
