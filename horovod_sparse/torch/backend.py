"""Horovod's collectives on :class:`~horovod_sparse.torch.kernels.TorchKernels`: the
backend of the Horovod optimizer and of ``sparse_allreduce``.

Horovod takes an alltoall's ``splits`` on the CPU and returns the received splits with
the rows, so a sparse bucket's size exchange happens inside Horovod's own op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from horovod_sparse.requirements import require_horovod

require_horovod("torch")  # the clear error, for a direct import of this module too

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from horovod_sparse.torch.kernels import TorchKernels  # noqa: E402
from horovod_sparse.torch.threads import LocalThreads, local_ranks_from_environment  # noqa: E402

__all__ = ["TorchBackend"]

# Horovod's ``synchronize`` waits by spinning (``std::this_thread::yield`` in a loop, the
# GIL dropped and taken each turn). Where a rank has one core of its own or less, that
# spin takes the core from the rank's own background thread, which runs the collective,
# and from the other ranks' local work. So such a rank polls, sleeping between polls
# from 20 us, doubling up to 500 us (the most a wait can overrun its collective). 2
# ranks on 2 cores, medians of 5 alternating runs of 50 steps, ms a step (spinning
# against sleeping): 16 buckets of 256K through synchronize() 44.5 / 36.9 (run medians
# 42-54 / 35-42); the demo's MLP, whole training step 34.0 / 27.2 (30-37 / 26-28).
_FIRST_SLEEP_S = 20e-6
_LONGEST_SLEEP_S = 500e-6


def _local_ranks() -> int:
    """Horovod's ranks on this host; the launcher's figure before ``hvd.init()``."""
    return hvd.local_size() if hvd.is_initialized() else local_ranks_from_environment()


@dataclass
class _Pending:
    """A Horovod async handle plus what ``wait`` must do with the result."""

    handle: int
    kind: str  # "alltoall" | "plain"


class TorchBackend(TorchKernels):
    """Stateless; one shared instance serves every bucket."""

    no_compression = hvd.Compression.none
    local_threads = LocalThreads(_local_ranks)

    # ---- collectives
    def alltoall_async(
        self, rows: torch.Tensor, splits: list[int], name: str, process_set: Any
    ) -> _Pending:
        split_tensor = torch.tensor(splits, dtype=torch.int32)
        handle = hvd.alltoall_async(rows, splits=split_tensor, name=name, process_set=process_set)
        return _Pending(handle, "alltoall")

    def allgather_async(self, rows: torch.Tensor, name: str, process_set: Any) -> _Pending:
        return _Pending(hvd.allgather_async(rows, name=name, process_set=process_set), "plain")

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str, process_set: Any) -> _Pending:
        handle = hvd.allreduce_async(tensor, name=name, op=hvd.Sum, process_set=process_set)
        return _Pending(handle, "plain")

    def allreduce_sum_inplace_async(
        self, tensor: torch.Tensor, name: str, process_set: Any
    ) -> _Pending:
        handle = hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=process_set)
        return _Pending(handle, "plain")

    def broadcast(self, tensor: torch.Tensor, root: int, name: str, process_set: Any) -> Any:
        return hvd.broadcast(tensor, root_rank=root, name=name, process_set=process_set)

    def poll(self, pending: _Pending) -> bool:
        """Whether the collective finished (never blocks)."""
        return bool(hvd.poll(pending.handle))

    def wait(self, pending: _Pending) -> Any:
        if self.local_threads.threads <= 1:  # the ranks on this host share its cores
            _sleep_until_done(pending.handle)
        result = hvd.synchronize(pending.handle)
        if pending.kind == "alltoall":
            rows, received_splits = result
            return rows, received_splits.tolist()
        return result


def _sleep_until_done(handle: int) -> None:
    """Poll ``handle`` until Horovod marks it done, sleeping between polls."""
    pause = _FIRST_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_SLEEP_S)
