"""What a bucket's step holds between its stages (docs/design.md §2).

A sparse step has two collectives in flight one after the other: the reduce-scatter
(:class:`ScatterInFlight`) and the all-gather (:class:`GatherInFlight`); a dense step has
one allreduce (a :class:`GatherInFlight` with no rows of its own). Between the two, the
owner's reduced region is an :class:`OwnedSums`. At P = 2 the first collective is an
all-gather of both ranks' selections (``common/pair_stages.py``) and the second none: the
kept rows are then :class:`KeptHere`. These records carry tensors and handles only; the
bucket's state stays on the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Tensor
from horovod_sparse.common.exchange import ReduceScatterSent

__all__ = ["GatherInFlight", "KeptHere", "OwnedSums", "ScatterInFlight"]


@dataclass
class ScatterInFlight:
    """A sparse step between its launch and its owner reduction."""

    sent: ReduceScatterSent
    wire_like: Tensor  # a tensor in the wire dtype, to decode the rows
    compression_ctx: Any
    # The rows went to every rank in an all-gather (P = 2), not to their owner.
    to_everyone: bool = False


@dataclass
class GatherInFlight:
    """A step whose last collective (all-gather, or a dense step's allreduce) is in flight."""

    handle: Any
    own_rows: int
    wire_like: Tensor
    compression_ctx: Any


@dataclass
class OwnedSums:
    """This owner's reduced region between the owner reduction and the all-gather:
    distinct region-local indices, their sums, the sums' magnitude keys, and the clock
    readings of the stage."""

    region_indices: Tensor
    sums: Tensor
    keys: Tensor
    began: Any
    received: Any
    reduced: Any
    # At P = 2 after an all-gather of the selections: the other owner's region too
    # (region-local indices, sums), which this rank reduced as that owner does.
    other: tuple[Tensor, Tensor] | None = None


@dataclass
class KeptHere:
    """The all-gather's result when every rank derived it itself (P = 2): the kept rows
    of both owners, owner 0's first, with bucket-local indices and wire values."""

    indices: Tensor
    wire_values: Tensor
