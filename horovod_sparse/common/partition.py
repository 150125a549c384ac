"""Partition of a bucket's index space [0, n) into P contiguous owner regions."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Partitioner", "UniformPartition", "make_partitioner"]


class Partitioner(Protocol):
    """Decides region boundaries; every rank must compute the same ones.

    ``boundaries(n, world_size)`` returns ``world_size + 1`` non-decreasing ints with
    ``b[0] == 0`` and ``b[-1] == n``; rank j owns ``[b[j], b[j+1])``. A balanced
    partition (boundaries from the ranks' selected positions) implements the same call.
    """

    def boundaries(self, numel: int, world_size: int) -> list[int]: ...


class UniformPartition:
    """Equal-size regions: owner j gets ``[j*n//P, (j+1)*n//P)``. Sends nothing."""

    def boundaries(self, numel: int, world_size: int) -> list[int]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return [j * numel // world_size for j in range(world_size + 1)]


def make_partitioner(method: str) -> Partitioner:
    """Partitioner for a :class:`~horovod_sparse.common.config.SparseConfig` ``partition``."""
    if method == "uniform":
        return UniformPartition()
    raise ValueError(f"unknown partition method {method!r}")
