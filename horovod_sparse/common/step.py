"""What one step of a bucket is and what it did: the kind chosen before it starts, the
record its stages leave (docs/design.md §3 and §2)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from horovod_sparse.common.backend import Backend
from horovod_sparse.common.stats import allreduce_ring_bytes

__all__ = ["StepKind", "StepRecord"]


class StepKind(enum.Enum):
    """Which exchange a bucket's step takes (docs/design.md §3), chosen in one place:
    :func:`horovod_sparse.common.plan.kind_of`."""

    SPARSE = "sparse"  # selection, reduce-scatter, global selection, all-gather
    DENSE_FROM_RESIDUAL = "dense from the residual"  # allreduce of residual + gradients
    DENSE_IN_BUFFER = "dense in the buffer"  # allreduce of the gradients; residual clear
    DENSE_FUSED = "dense, fused"  # one allreduce with adjacent dense buckets

    @property
    def dense(self) -> bool:
        return self is not StepKind.SPARSE


@dataclass
class StepRecord:
    """What one bucket's step did, as its stages measured it.

    Figures are host numbers or device scalars (a traced TF step keeps them as graph
    tensors); making a record reads nothing from the device. ``stats_of`` (of the reducer
    that made it) turns a host copy (:meth:`on_host`) into :class:`StepStats`; an
    automatic scheduler reads ``dense``, ``seconds_select + seconds_exchange`` and
    ``seconds_local``. A reducer makes a new record every step, so a caller may keep one.
    """

    dense: Any = 0  # 1 for a dense step
    rows_sent: Any = 0  # alltoall rows this rank sent to the other ranks
    rows_received: Any = 0  # alltoall rows it received from them
    gathered_rows: Any = 0  # rows in the result (n for a dense step)
    own_rows: Any = 0  # of which this owner's
    next_rows: Any = 0  # of which the next rank's (ring accounting)
    seconds_select: Any = 0.0  # local and global selection
    seconds_exchange: Any = 0.0  # issuing and waiting for collectives
    extra_bytes: Any = 0  # one way: the partition histogram, or a dense step's allreduce
    refreshed: Any = 0  # 1 when the global threshold came from the radix select
    seconds_local: Any = 0.0  # local work only, no waits: the scheduler's cost model
    send_splits: Any = None  # alltoall rows per destination rank
    recv_splits: Any = None  # alltoall rows per source rank
    row_bytes: int = 0  # alltoall row width, fixed by the dtypes
    gather_row_bytes: int = 0  # all-gather row width
    # P = 2 in one all-gather, padded (pair_stages.py): the rows each rank sends and
    # receives, padding included, in place of rows_sent and rows_received; else 0.
    padded_rows: Any = 0

    # The figures a traced step stores in a variable, in this order (see numbers()).
    NUMBERS: ClassVar[tuple[str, ...]] = (
        "dense",
        "rows_sent",
        "rows_received",
        "gathered_rows",
        "own_rows",
        "next_rows",
        "seconds_select",
        "seconds_exchange",
        "extra_bytes",
        "refreshed",
        "padded_rows",
    )

    @classmethod
    def dense_allreduce(
        cls, numel: int, world_size: int, wire_itemsize: int, seconds: Any = 0.0
    ) -> StepRecord:
        """The record of a dense step: one ring allreduce of the bucket's n values (its
        bytes counted one way in ``extra_bytes``), every entry in the result."""
        return cls(
            dense=1,
            gathered_rows=numel,
            own_rows=numel,
            next_rows=numel,
            extra_bytes=allreduce_ring_bytes(numel, world_size, wire_itemsize)[0],
            seconds_exchange=seconds,
            send_splits=[0] * world_size,
            recv_splits=[0] * world_size,
        )

    def numbers(self) -> list[Any]:
        """The :attr:`NUMBERS` figures, in order."""
        return [getattr(self, name) for name in self.NUMBERS]

    def with_numbers(self, values: Sequence[float]) -> StepRecord:
        """A copy whose :attr:`NUMBERS` figures are ``values`` (read back from storage)."""
        figures: dict[str, Any] = dict(zip(self.NUMBERS, values))
        return dataclasses.replace(self, **figures)

    def on_host(self, ops: Backend) -> StepRecord:
        """A copy with host numbers (reads any device scalar: call it for statistics)."""
        return self.with_numbers([ops.to_host_number(v) for v in self.numbers()])
