"""Partition of a bucket's index space [0, n) into P contiguous owner regions."""

from __future__ import annotations

from typing import Any, Protocol

from horovod_sparse.common.backend import Backend, Tensor

__all__ = [
    "BalancedPartition",
    "Partitioner",
    "UniformPartition",
    "balanced_boundaries",
    "make_partitioner",
]


class Partitioner(Protocol):
    """Decides region boundaries; every rank must compute the same ones.

    ``boundaries(n, P)`` returns the initial ``P + 1`` non-decreasing ints with
    ``b[0] == 0`` and ``b[-1] == n``; rank j owns ``[b[j], b[j+1])``. ``update`` is called
    every step with this rank's selected indices and the current boundaries and returns
    the boundaries to use; when it communicates, it must do so on the same steps on
    every rank (``step`` may be a graph tensor: decide through ``ops.cond``).
    """

    def boundaries(self, numel: int, world_size: int) -> list[int]: ...

    def update(
        self,
        ops: Backend,
        indices: Tensor,
        current: Any,
        numel: int,
        step: Any,
        name: str,
        process_set: Any,
    ) -> tuple[Any, Any]:
        """``(boundaries, payload bytes sent and received each way)``."""


class UniformPartition:
    """Equal-length regions: owner j gets ``[j*n//P, (j+1)*n//P)``. Sends nothing."""

    def boundaries(self, numel: int, world_size: int) -> list[int]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return [j * numel // world_size for j in range(world_size + 1)]

    def update(
        self,
        ops: Backend,
        indices: Tensor,
        current: Any,
        numel: int,
        step: Any,
        name: str,
        process_set: Any,
    ) -> tuple[Any, Any]:
        return current, 0


def balanced_boundaries(bin_counts: list[int], numel: int, world_size: int) -> list[int]:
    """Boundaries at bin edges that split the summed ``bin_counts`` into equal shares.

    Bin b holds the positions p with ``p*B//n == b``, which start at ``ceil(b*n/B)``; a
    cut after bin b-1 is placed there. Pure host arithmetic on the allreduced counts, so
    every rank gets the same answer.
    """
    bins = len(bin_counts)
    total = sum(bin_counts)
    if total == 0:
        return UniformPartition().boundaries(numel, world_size)
    edges = [0]
    running, b = 0, 0
    for j in range(1, world_size):
        target = total * j / world_size
        # Advance while taking the whole next bin keeps us at or below the target,
        # or brings us closer to it than stopping here.
        while b < bins and (
            running + bin_counts[b] <= target
            or abs(running + bin_counts[b] - target) < abs(running - target)
        ):
            running += bin_counts[b]
            b += 1
        edges.append(max(edges[-1], -(-b * numel // bins)))
    edges.append(numel)
    return edges


class BalancedPartition:
    """Regions holding about the same number of selected rows (Ok-Topk's balanced split).

    Every ``repartition_steps`` steps each rank histograms its selected positions into
    ``bins_per_rank * P`` equal bins; one allreduce sums them and every rank cuts the
    index space at the same bin edges (:func:`balanced_boundaries`).

    Sends: one allreduce of ``bins_per_rank * P`` int32 every ``repartition_steps``.
    Keeps: the boundaries.
    """

    def __init__(self, repartition_steps: int = 50, bins_per_rank: int = 256) -> None:
        self.repartition_steps = repartition_steps
        self.bins_per_rank = bins_per_rank

    def boundaries(self, numel: int, world_size: int) -> list[int]:
        return UniformPartition().boundaries(numel, world_size)

    def update(
        self,
        ops: Backend,
        indices: Tensor,
        current: Any,
        numel: int,
        step: Any,
        name: str,
        process_set: Any,
    ) -> tuple[Any, Any]:
        world_size = ops.size(process_set)
        bins = max(1, min(numel, self.bins_per_rank * world_size))
        one_way = 2 * bins * (world_size - 1) * 4 // world_size  # ring allreduce, int32

        def recut() -> tuple[Any, Any]:
            local = ops.position_histogram(indices, numel, bins)
            summed = ops.wait(ops.allreduce_sum_async(local, f"{name}.partition", process_set))
            # The cut is host arithmetic on the summed counts, the same on every rank.
            cut = ops.on_host(lambda counts: balanced_boundaries(counts, numel, world_size), summed)
            return cut, one_way

        chosen: tuple[Any, Any] = ops.cond(
            step % self.repartition_steps == 0, recut, lambda: (current, 0)
        )
        return chosen


def make_partitioner(method: str, repartition_steps: int = 50) -> Partitioner:
    """Partitioner for a :class:`~horovod_sparse.common.config.SparseConfig` ``partition``."""
    if method == "uniform":
        return UniformPartition()
    if method == "balanced":
        return BalancedPartition(repartition_steps=repartition_steps)
    raise ValueError(f"unknown partition method {method!r}")
