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
from horovod_sparse.torch.row_padding import RowPadding  # noqa: E402
from horovod_sparse.torch.threads import LocalThreads, local_ranks_from_environment  # noqa: E402

__all__ = ["TorchBackend"]

# Horovod's ``synchronize`` waits by spinning (``std::this_thread::yield`` in a loop, the
# GIL dropped and taken each turn). Where a rank has one core of its own or less, that
# spin takes the core from the rank's own background thread, which runs the collective,
# and from the other ranks' local work. So such a rank polls, sleeping between polls
# from 20 us, doubling up to a longest sleep (the most a wait can overrun its
# collective). 2 ranks on 2 cores, medians of 5 alternating runs of 50 steps, ms a step
# (spinning against sleeping up to 500 us): 16 buckets of 256K through synchronize()
# 44.5 / 36.9 (run medians 42-54 / 35-42); the demo's MLP, whole training step 34.0 /
# 27.2 (30-37 / 26-28). The longest sleep, the demo's step with the cap changing from
# step to step in one run (each step against the one before, medians): at 2 ranks on 2
# cores 100 us took 0.966-0.986 of 500 us's step (four runs, 300-600 steps each); at 4
# ranks on 2 cores, where the extra wake-ups take a core some rank needs, 1.035-1.076.
_FIRST_SLEEP_S = 20e-6
_LONGEST_SLEEP_S = 100e-6
_LONGEST_SLEEP_OVERSUBSCRIBED_S = 500e-6


def _local_ranks() -> int:
    """Horovod's ranks on this host; the launcher's figure before ``hvd.init()``."""
    return hvd.local_size() if hvd.is_initialized() else local_ranks_from_environment()


@dataclass
class _Pending:
    """A Horovod async handle plus what ``wait`` must do with the result."""

    handle: int
    kind: str  # "alltoall" | "plain"


class TorchBackend(RowPadding, TorchKernels):
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
            oversubscribed = self.local_threads.oversubscribed
            longest = _LONGEST_SLEEP_OVERSUBSCRIBED_S if oversubscribed else _LONGEST_SLEEP_S
            _sleep_until_done(pending.handle, longest)
        result = hvd.synchronize(pending.handle)
        if pending.kind == "alltoall":
            rows, received_splits = result
            return rows, received_splits.tolist()
        return result


def _sleep_until_done(handle: int, longest: float) -> None:
    """Poll ``handle`` until Horovod marks it done, sleeping between polls (up to
    ``longest`` seconds)."""
    pause = _FIRST_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(pause)
        pause = min(2 * pause, longest)
