"""Spar-Reduce-Scatter and Spar-All-Gather: the two collectives of a sparse step.

Rows travel as one uint8 tensor per collective: an int32 index followed by the value's
bytes (8 bytes a row for fp32), so one collective carries both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["ReduceScatterSent", "row_bytes", "spar_all_gather_start", "spar_reduce_scatter_start"]


def row_bytes(value_itemsize: int) -> int:
    """Bytes of one packed row: int32 index + value."""
    return 4 + value_itemsize


@dataclass
class ReduceScatterSent:
    """An alltoall in flight, and the host-side splits it was sent with (None for the
    all-gather of the selections at P = 2, ``common/pair_stages.py``)."""

    handle: Any
    send_splits: list[int] | None


def spar_reduce_scatter_start(
    ops: Backend,
    indices: Tensor,
    values: Tensor,
    boundaries: list[int],
    name: str,
    process_set: Any,
) -> ReduceScatterSent:
    """Send each selected entry to the owner of its region, as one ``alltoall``.

    Sends: for each owner j, the rows whose index lies in ``[b[j], b[j+1])``, index made
    region-local (``index - b[j]``, int32, so buckets far beyond 2**31 elements in total
    stay exact). About k(P-1)/P rows leave this rank and as many arrive.
    Keeps: nothing; the caller already left the unselected entries in the residual.

    Args:
        indices: ascending bucket-local int64 indices of the selected entries.
        values: their values, already in the wire dtype.
        boundaries: region boundaries (P + 1 ints).
    """
    splits = ops.region_counts(indices, boundaries)  # host ints: Horovod wants CPU splits
    offsets = ops.region_offsets(indices, boundaries)
    rows = ops.pack_rows(indices, offsets, values)
    return ReduceScatterSent(ops.alltoall_async(rows, splits, f"{name}.rs", process_set), splits)


def spar_all_gather_start(
    ops: Backend, indices: Tensor, values: Tensor, name: str, process_set: Any
) -> Any:
    """Send this owner's globally selected rows to every rank, as one ``allgather``.

    Sends: this owner's kept rows with bucket-local int32 indices (regions are disjoint,
    so the gathered indices are distinct). About k(P-1)/P rows arrive at each rank.
    Keeps: nothing.
    """
    return ops.allgather_async(ops.pack_rows(indices, 0, values), f"{name}.ag", process_set)
