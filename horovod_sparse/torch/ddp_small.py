"""A sparse DDP bucket's small parameters, averaged densely (docs/design.md §10).

The Horovod optimizer reduces tensors under ``min_sparse_numel`` (biases, norms) in dense
buckets of their own; DDP puts them in the same buckets as the matrices. The hook takes
their entries out of a sparse bucket before its exchange, with any residual a state
saved under another ``min_sparse_numel`` kept there, and averages them by an allreduce of
their own, issued right after the bucket's first collective; the average is pasted back
into the bucket's result (``ddp_flight.DenseSlots``). Their velocity, which the
exchange's momentum factor masking would zero wherever it selected their (zero) entries,
is put back as the correction left it.

Sends: one allreduce of the small parameters' entries per sparse bucket that has any, at
the gradient's precision. Keeps: each bucket's positions (per layout) and the figures of
its last allreduce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from horovod_sparse.common.stats import StepStats, allreduce_ring_bytes
from horovod_sparse.torch.ddp_flight import DenseSlots
from horovod_sparse.torch.ddp_layout import BucketLayout
from horovod_sparse.torch.distributed import DistributedBackend

__all__ = ["SmallParameters"]


class SmallParameters:
    """The entries of parameters under ``min_numel`` in each sparse DDP bucket."""

    def __init__(self, backend: DistributedBackend, min_numel: int) -> None:
        self.backend = backend
        self.min_numel = min_numel
        self._positions: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._figures: dict[int, StepStats] = {}

    def positions(self, index: int, layout: BucketLayout, device: Any) -> torch.Tensor:
        """Their positions in bucket ``index`` (possibly none), built once per layout."""
        cached = self._positions.get(index)
        if cached is None or cached[0] != layout.buckets[index] or cached[1].device != device:
            slots = layout.small_slots(index, self.min_numel)
            cached = (
                list(layout.buckets[index]),
                torch.tensor(slots, dtype=torch.long, device=device),
            )
            self._positions[index] = cached
        return cached[1]

    def take(self, buffer: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Their entries of ``buffer``, which keeps zeros there: the exchange, error
        feedback included, sees none of them."""
        values = buffer.index_select(0, positions)
        buffer.index_fill_(0, positions, 0.0)
        return values

    @staticmethod
    def take_residual(
        residual: torch.Tensor, positions: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Move what the residual holds at their positions (a state saved while they went
        sparse) into ``values``: it is sent with them, once."""
        values.add_(residual.index_select(0, positions))
        residual.index_fill_(0, positions, 0.0)

    def launch(
        self, index: int, positions: torch.Tensor, values: torch.Tensor, group: Any
    ) -> DenseSlots:
        """Launch their average: an allreduce of their entries alone."""
        backend = self.backend
        size = dist.get_world_size(group)
        name = f"hvds.ddp.{index}.small"
        work = backend.allreduce_sum_inplace_async(values.div_(size), name, group)
        sent, received = allreduce_ring_bytes(values.numel(), size, values.element_size())
        self._figures[index] = StepStats(
            bytes_sent=sent, bytes_received=received, selected=values.numel()
        )
        return DenseSlots(positions, values, work, backend.wait, backend.poll)

    def forget(self, index: int) -> None:
        """Bucket ``index``'s step sends none of them."""
        self._figures.pop(index, None)

    def figures(self, index: int, record: StepStats) -> StepStats:
        """What their allreduce adds to bucket ``index``'s ``record``: its bytes, and
        its entries as selected, up to the entries the exchange left (none after a dense
        step; fewer where its top-k took some of their zeros, when the bucket had fewer
        nonzeros than k)."""
        figures = self._figures.get(index)
        if figures is None:
            return StepStats()
        left = record.numel - record.selected if record.sparse_buckets else 0
        return replace(figures, selected=max(0, min(figures.selected, left)))
