"""Per-step statistics and the volume-accounting basis they use.

Basis: the payload that a bandwidth-optimal algorithm moves into and out of this rank,
in bytes, excluding Horovod's own metadata (sizes, splits):

* ring allreduce of n elements: 2n(P-1)/P elements out and as many in;
* alltoall: the rows addressed to other ranks out, the rows from other ranks in;
* ring allgather of blocks m_0..m_{P-1}: (total - m_own) in, (total - m_next) out,
  where next = (rank + 1) % P is the rank this one forwards to.

``dense_bytes`` is what a ring allreduce of the same gradients would move in and out:
4n(P-1)/P x itemsize.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "StepStats",
    "allgather_ring_bytes",
    "allreduce_ring_bytes",
    "alltoall_bytes",
    "dense_allreduce_stats",
    "progress_line",
    "settled_reuse",
]


def allreduce_ring_bytes(numel: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """``(sent, received)`` bytes of a ring allreduce of ``numel`` elements."""
    one_way = 2 * numel * (world_size - 1) * itemsize // world_size
    return one_way, one_way


def alltoall_bytes(
    send_splits: list[int], recv_splits: list[int], rank: int, row_bytes: int
) -> tuple[int, int]:
    """``(sent, received)`` bytes of an alltoall; rows to or from this rank itself are free."""
    sent = (sum(send_splits) - send_splits[rank]) * row_bytes
    received = (sum(recv_splits) - recv_splits[rank]) * row_bytes
    return sent, received


def allgather_ring_bytes(
    total_rows: int, own_rows: int, next_rows: int, row_bytes: int
) -> tuple[int, int]:
    """``(sent, received)`` bytes of a ring allgather (see the module docstring)."""
    return (total_rows - next_rows) * row_bytes, (total_rows - own_rows) * row_bytes


@dataclass
class StepStats:
    """What one step of sparse allreduce cost this rank.

    Attributes:
        bytes_sent: payload bytes this rank sent, all collectives of the step.
        bytes_received: payload bytes this rank received, all collectives of the step.
        dense_bytes: bytes a dense ring allreduce of the same gradients moves in and out.
        numel: gradient elements reduced this step.
        selected: elements in the result (the global selection plus dense tensors).
        density: achieved density, ``selected / numel``.
        seconds_select: host time in local and global selection.
        seconds_exchange: host time issuing and waiting for collectives.
        dense_buckets: buckets exchanged densely this step (small-tensor buckets,
            warm-up, or the automatic scheduler's choice).
        sparse_buckets: buckets exchanged sparsely this step.
        global_refreshes: sparse buckets whose global threshold came from the radix
            select this step (every sparse bucket with ``global_selection="exact"``).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    numel: int = 0
    selected: int = 0
    density: float = 0.0
    seconds_select: float = 0.0
    seconds_exchange: float = 0.0
    dense_buckets: int = 0
    sparse_buckets: int = 0
    global_refreshes: int = 0

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes`` over the bytes this rank actually moved (higher is better)."""
        moved = self.bytes_sent + self.bytes_received
        return self.dense_bytes / moved if moved else float("inf")

    def __iadd__(self, other: StepStats) -> StepStats:
        for f in fields(self):
            if f.name != "density":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.density = self.selected / self.numel if self.numel else 0.0
        return self


def dense_allreduce_stats(
    numel: int, world_size: int, wire_itemsize: int, grad_itemsize: int, seconds: float = 0.0
) -> StepStats:
    """What one dense ring allreduce of ``numel`` entries costs a rank: the wire's bytes
    against the gradients' (they differ under lossy value compression)."""
    sent, received = allreduce_ring_bytes(numel, world_size, wire_itemsize)
    dense_sent, dense_received = allreduce_ring_bytes(numel, world_size, grad_itemsize)
    return StepStats(
        bytes_sent=sent,
        bytes_received=received,
        dense_bytes=dense_sent + dense_received,
        numel=numel,
        selected=numel,
        density=1.0,
        seconds_exchange=seconds,
        dense_buckets=1,
    )


def progress_line(step: int, stats: StepStats, target_density: float) -> str:
    """One line of a step's figures, for ``log_every``: achieved against target density,
    bytes against a dense allreduce, the exchange's host seconds, refreshing buckets."""
    moved = stats.bytes_sent + stats.bytes_received
    versus_dense = moved / stats.dense_bytes if stats.dense_bytes else 0.0
    return (
        f"[horovod_sparse] step {step}: density {stats.density:.4f} (target "
        f"{target_density:g}), {moved:,} bytes ({versus_dense:.2%} of dense), exchange "
        f"{stats.seconds_exchange * 1e3:.1f} ms, {stats.sparse_buckets} sparse / "
        f"{stats.dense_buckets} dense buckets, {stats.global_refreshes} refreshed"
    )


def settled_reuse(refreshed: list[bool], kept: list[int], k: int, settled: int) -> dict[str, Any]:
    """How the reused global threshold behaved after the first ``settled`` steps:
    ``refresh_fraction`` (steps whose threshold refreshed), ``kept_over_k`` (the
    rows kept per step, over ``k``: min, mean, max) and ``within_tenth_of_k`` (the
    fraction of steps that kept k rows within 10 %). Empty when no step is left."""
    late = kept[settled:]
    if not late:
        return {}
    return {
        "refresh_fraction": sum(refreshed[settled:]) / len(late),
        "kept_over_k": [min(late) / k, sum(late) / len(late) / k, max(late) / k],
        "within_tenth_of_k": sum(abs(rows - k) <= 0.1 * k for rows in late) / len(late),
    }
