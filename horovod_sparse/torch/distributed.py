"""The collectives port on ``torch.distributed``: the same stages, on a process group.

:class:`DistributedBackend` is :class:`~horovod_sparse.torch.kernels.TorchKernels` with
``torch.distributed`` collectives (no Horovod is imported), so the DDP
communication hook (:mod:`horovod_sparse.torch.ddp`) runs the algorithm's one copy in
``horovod_sparse.common``. What each collective sends:

* alltoall (Spar-Reduce-Scatter): the rows per destination, after one ``all_to_all_single``
  of the P split sizes (Horovod exchanges them inside its alltoall; here they are
  an explicit 8·P-byte collective and one host read, which a size-dependent receive
  buffer needs anyway);
* allgather (Spar-All-Gather): each rank's row count (one ``all_gather`` of an int64),
  then the rows padded to the largest count, because ``all_gather`` takes equal sizes;
  the padding is cut off on receipt;
* allreduce and broadcast: as they are.

Process "sets" are process groups (``None``: the default group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from horovod_sparse.torch.kernels import TorchKernels
from horovod_sparse.torch.row_padding import RowPadding

__all__ = ["DistributedBackend", "FP16Values"]


@dataclass
class _Work:
    """Works in flight and how to turn their buffers into the result."""

    works: list[Any]
    finish: Callable[[], Any]


class FP16Values:
    """Value compression in Horovod's ``Compression`` interface: floating-point values
    travel as fp16 (half of fp32's value bytes; indices stay int32). The engine keeps
    what the rounding loses in the residual, so no gradient mass is dropped: values
    beyond fp16's range are clamped to it (an inf would turn the residual into NaN), and
    the excess stays behind too."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        if tensor.dtype in (torch.float32, torch.float64):
            largest = torch.finfo(torch.float16).max
            return tensor.clamp(-largest, largest).to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return tensor if dtype is None else tensor.to(dtype)


class DistributedBackend(RowPadding, TorchKernels):
    """Stateless; one shared instance serves every bucket of every process group.
    Value compression: None, or an object with ``compress``/``decompress`` such as
    :class:`FP16Values`."""

    pads_gathered_rows = False  # no response cache to serve a shape that repeats

    def rank(self, process_set: Any) -> int:
        return int(dist.get_rank(process_set))

    def size(self, process_set: Any) -> int:
        return int(dist.get_world_size(process_set))

    # ---- collectives
    def alltoall_async(self, rows: torch.Tensor, splits: list[int], name: str, group: Any) -> Any:
        # On the rows' device: NCCL groups take CUDA tensors only, Gloo CPU ones.
        sent = torch.tensor(splits, dtype=torch.int64, device=rows.device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        counts = received.tolist()
        out = rows.new_empty((sum(counts), *rows.shape[1:]))
        work = dist.all_to_all_single(
            out, rows.contiguous(), counts, list(splits), group=group, async_op=True
        )
        return _Work([work], lambda: (out, counts))

    def allgather_async(self, rows: torch.Tensor, name: str, group: Any) -> Any:
        size = dist.get_world_size(group)
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=group)
        lengths = torch.cat(counts).tolist()  # one host read for all P counts
        longest = max(lengths)
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[: rows.shape[0]].copy_(rows)
        gathered = [torch.empty_like(padded) for _ in range(size)]
        work = dist.all_gather(gathered, padded, group=group, async_op=True)
        return _Work([work], lambda: torch.cat([g[:n] for g, n in zip(gathered, lengths)]))

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str, group: Any) -> Any:
        out = tensor.clone()
        return self.allreduce_sum_inplace_async(out, name, group)

    def allreduce_sum_inplace_async(self, tensor: torch.Tensor, name: str, group: Any) -> Any:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _Work([work], lambda: tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str, group: Any) -> Any:
        out = tensor.clone()
        dist.broadcast(out, src=dist.get_global_rank(group, root) if group else root, group=group)
        return out

    def poll(self, pending: Any) -> bool:
        return all(work.is_completed() for work in pending.works)

    def wait(self, pending: Any) -> Any:
        for work in pending.works:
            work.wait()
        return pending.finish()


BACKEND = DistributedBackend()  # stateless: the hook's, its correction's and its flush's
