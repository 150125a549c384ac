"""Horovod collectives the optimizer needs beyond the buckets' exchange.

A pickled allgather within a process set (Horovod 0.28's takes none), the allgather
of a sparse gradient as Horovod reduces ``torch.nn.Embedding(sparse=True)``
gradients, and how to tell that Horovod's ``broadcast_optimizer_state`` is the caller.
"""

from __future__ import annotations

import pickle
import sys
from types import FrameType
from typing import Any

import horovod.torch as hvd
import torch

__all__ = [
    "SparseGradientGather",
    "allgather_object",
    "called_by_horovod_state_broadcast",
    "horovod_state_broadcast_root",
]


def allgather_object(obj: Any, name: str, process_set: Any) -> list[Any]:
    """Pickle-based allgather within ``process_set``.

    Sends two small allgathers: the lengths, then the payloads.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = hvd.allgather(
        torch.tensor([payload.numel()], dtype=torch.int64),
        name=f"{name}.len",
        process_set=process_set,
    ).tolist()
    gathered = hvd.allgather(payload, name=f"{name}.data", process_set=process_set)
    out, start = [], 0
    for length in lengths:
        out.append(pickle.loads(gathered[start : start + length].numpy().tobytes()))
        start += length
    return out


class SparseGradientGather:
    """A sparse gradient's reduction as Horovod does it: two allgathers (its indices and
    its values), concatenated into one sparse tensor whose duplicates add up.

    Sends this rank's nnz rows of indices and values; receives every rank's.
    """

    def __init__(self, grad: torch.Tensor, name: str, scale: float, process_set: Any) -> None:
        grad = grad.coalesce()
        self._like = grad
        self._scale = scale
        # Allgather concatenates along the first dimension: one row per nonzero.
        self._indices = hvd.allgather_async(
            grad.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set
        )
        self._values = hvd.allgather_async(
            grad.values(), name=f"{name}.values", process_set=process_set
        )

    def wait(self) -> torch.Tensor:
        values = hvd.synchronize(self._values)
        indices = hvd.synchronize(self._indices)
        return torch.sparse_coo_tensor(
            indices.t(), values * self._scale, self._like.shape, dtype=self._like.dtype
        ).coalesce()


def horovod_state_broadcast_root() -> int | None:
    """Called from ``state_dict()``: the root rank when that is the first call of
    Horovod's ``broadcast_optimizer_state``, which every rank makes; else None. (A
    second call follows a state-creating step on some ranks only, so it must send
    nothing.)"""
    frame: FrameType | None = sys._getframe(2)  # the caller of state_dict()
    for _ in range(3):
        if frame is None:
            return None
        if _is_horovod_state_broadcast(frame):
            if "state_dict" in frame.f_locals:  # its result of the first call
                return None
            return int(frame.f_locals["root_rank"])
        frame = frame.f_back
    return None


def called_by_horovod_state_broadcast() -> bool:
    """Called from ``step()``: whether that was called by Horovod's
    ``broadcast_optimizer_state`` (directly, or through a subclass's ``step``), which
    steps only the ranks whose state is empty."""
    frame: FrameType | None = sys._getframe(2)  # the caller of step()
    for _ in range(3):
        if frame is None:
            return False
        if _is_horovod_state_broadcast(frame):
            return True
        frame = frame.f_back
    return False


def _is_horovod_state_broadcast(frame: Any) -> bool:
    return frame.f_code.co_name == "broadcast_optimizer_state" and str(
        frame.f_globals.get("__name__", "")
    ).startswith("horovod.torch")
