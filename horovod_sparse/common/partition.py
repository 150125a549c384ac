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
    ``b[0] == 0`` and ``b[-1] == n``; rank j owns ``[b[j], b[j+1])``.
    ``follow_gathered`` is called after each sparse step's all-gather with the gathered
    indices, which every rank holds alike, and returns the next step's boundaries, so
    every rank moves them alike without a collective (``step`` may be a graph tensor:
    decide through ``ops.cond``).
    """

    def boundaries(self, numel: int, world_size: int) -> list[int]: ...

    def follow_gathered(
        self, ops: Backend, gathered: Tensor, current: Any, numel: int, world_size: int, step: Any
    ) -> Any:
        """The boundaries for the step after ``step``, from its gathered indices."""


class UniformPartition:
    """Equal-length regions: owner j gets ``[j*n//P, (j+1)*n//P)``. Sends nothing."""

    def boundaries(self, numel: int, world_size: int) -> list[int]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return [j * numel // world_size for j in range(world_size + 1)]

    def follow_gathered(
        self, ops: Backend, gathered: Tensor, current: Any, numel: int, world_size: int, step: Any
    ) -> Any:
        return current


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

    After the all-gather of every sparse step whose count is a multiple of
    ``repartition_steps`` (the first step, without warm-up), every rank histograms the
    gathered positions (the global selection: the same rows on every rank) into
    ``bins_per_rank * P`` equal bins and cuts the index space at the same bin edges
    (:func:`balanced_boundaries`). Owners then hold about the same share of what the
    global selection keeps, and of what the ranks send to the extent that the local
    selections follow the global one. Until the first such step the cut is uniform.

    Sends: nothing (Ok-Topk allreduces P-1 quantiles every 64 steps; the histogram of
    local selections this replaced allreduced 256 P int32 every 50).
    Keeps: the boundaries.
    """

    def __init__(self, repartition_steps: int = 50, bins_per_rank: int = 256) -> None:
        self.repartition_steps = repartition_steps
        self.bins_per_rank = bins_per_rank

    def boundaries(self, numel: int, world_size: int) -> list[int]:
        return UniformPartition().boundaries(numel, world_size)

    def follow_gathered(
        self, ops: Backend, gathered: Tensor, current: Any, numel: int, world_size: int, step: Any
    ) -> Any:
        bins = max(1, min(numel, self.bins_per_rank * world_size))

        def recut() -> Any:
            counts = ops.position_histogram(gathered, numel, bins)
            # Host arithmetic on counts every rank holds alike: the same cut everywhere.
            return ops.on_host(lambda host: balanced_boundaries(host, numel, world_size), counts)

        return ops.cond(step % self.repartition_steps == 0, recut, lambda: current)


def make_partitioner(method: str, repartition_steps: int = 50) -> Partitioner:
    """Partitioner for a :class:`~horovod_sparse.common.config.SparseConfig` ``partition``."""
    if method == "uniform":
        return UniformPartition()
    if method == "balanced":
        return BalancedPartition(repartition_steps=repartition_steps)
    raise ValueError(f"unknown partition method {method!r}")
