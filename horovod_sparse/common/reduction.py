"""Owner reduction: sum what the ranks sent into this owner's region."""

from __future__ import annotations

from typing import Any, Callable

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["owner_reduce", "reduce_rows", "sum_rows_in_turn"]


def owner_reduce(
    ops: Backend,
    rows: Tensor,
    wire_like: Tensor,
    like: Tensor,
    decode: Callable[[Tensor], Tensor],
    runs: Any = None,
) -> tuple[Tensor, Tensor]:
    """Sum the received rows; duplicate indices from different ranks add up.

    Sends nothing. Keeps nothing beyond the call: the result is handed to global selection.

    Args:
        rows: the rows this owner received in the reduce-scatter (region-local indices).
        wire_like: a tensor in the dtype the values travelled in.
        like: a tensor with the bucket's dtype and device.
        decode: undoes the value compression (identity without one).
        runs: the rows received from each rank (the alltoall's received splits), or
            None. Each rank's rows arrive with distinct ascending indices, so a backend
            may merge these runs instead of sorting the rows.

    Returns:
        ``(indices, sums)``: the distinct region-local indices received, ascending, and
        the sum of the values received for each, in the bucket's dtype.
    """
    indices, wire_values = ops.unpack_rows(rows, wire_like)
    return reduce_rows(ops, indices, decode(wire_values), like, runs)


def reduce_rows(
    ops: Backend, indices: Tensor, values: Tensor, like: Tensor, runs: Any = None
) -> tuple[Tensor, Tensor]:
    """The distinct ``indices``, ascending, and the sum of ``values`` at each (in
    ``like``'s dtype), added in row order. ``runs``: as for :func:`owner_reduce`."""
    # Sum over the distinct received indices only: O(rows), not O(region length).
    # Rows are added in arrival (rank) order, so the sums do not depend on timing (the
    # torch backend avoids index_add_'s unordered atomics on CUDA for this).
    return ops.sum_rows(indices, values, like, runs)


def sum_rows_in_turn(
    ops: Backend, indices: Tensor, values: Tensor, like: Tensor, runs: Any = None
) -> tuple[Tensor, Tensor]:
    """``Backend.sum_rows`` from two kernels: ``unique_inverse``, then ``add_at`` into
    zeros (a backend with no kernel that does both takes this as its ``sum_rows``)."""
    distinct, position = ops.unique_inverse(indices, runs)
    return distinct, ops.add_at(ops.zeros(ops.num_rows(distinct), like), position, values)
