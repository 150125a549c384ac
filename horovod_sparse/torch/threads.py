"""How many threads the plugin's own kernels take on the CPU (docs/design.md §12).

``horovodrun`` sets no thread count, so every rank's torch starts a thread per core;
with several ranks on a host they share the cores. A dense step hardly notices (its
work is Horovod's, one thread), but the sparse step's many short parallel kernels
(magnitudes, comparisons, index gathers of a few milliseconds each) then wait on
threads that another rank has preempted. Measured with 2 ranks on 2 cores,
``sparse_allreduce`` of 16M floats at density 0.01: 439 ms a call at torch's default
of 2 threads per rank against 98 ms at 1 (dense ``hvd.allreduce``: 150 ms either way).

So while the plugin's kernels run, torch's thread count is lowered to the cores this
process may run on divided by the ranks on its host (what ``torchrun`` sets for a
whole process), and set back afterwards. It is never raised: a user's lower setting
stands. On a GPU it changes nothing the kernels use.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from horovod_sparse.common.host_candidates import (
    cores_available,
    local_ranks_from_environment,
    threads_per_rank,
)

__all__ = [
    "LocalThreads",
    "cores_available",
    "local_ranks_from_environment",
    "warn_if_oversubscribed",
]

_WARNED = False


def warn_if_oversubscribed(threads: int, local_ranks: int, cores: int) -> None:
    """Warn once a process where the ranks on this host run torch at more threads than
    their share of the host's cores. The plugin lowers its own kernels' count, but the
    model's forward and backward keep torch's. Measured with 2 ranks at torch's default
    threads (docs/benchmarks.md, the step profile): dense Horovod's step 6-16x its
    one-thread time on 2 cores and 30x on 16, the sparse step 3-4x and 26x."""
    global _WARNED
    share = threads_per_rank(cores, local_ranks)
    if _WARNED or local_ranks <= 1 or threads <= share:
        return
    _WARNED = True
    warnings.warn(
        f"horovod_sparse: {local_ranks} ranks on this host each run torch at {threads} "
        f"threads on {cores} cores. The model's forward and backward then fight over the "
        f"cores (measured with 2 ranks: steps 3-30x slower than at one thread a rank, "
        f"dense Horovod's too). Call torch.set_num_threads({share}) in each rank, or set "
        f"OMP_NUM_THREADS={share} as torchrun does.",
        RuntimeWarning,
        stacklevel=3,
    )


class LocalThreads:
    """The thread count of the plugin's kernels on one host, found once.

    Args:
        local_ranks: how many ranks share this host (asked at the first use, when the
            launcher's world is up).
    """

    def __init__(self, local_ranks: Callable[[], int]) -> None:
        self._local_ranks = local_ranks
        self._threads: int | None = None
        self._oversubscribed = False

    @property
    def threads(self) -> int:
        """Cores available divided by the ranks on this host, at least 1. Found at the
        first use, which also warns once if torch's own count oversubscribes the host."""
        if self._threads is None:
            cores, ranks = cores_available(), self._local_ranks()
            self._threads = threads_per_rank(cores, ranks)
            self._oversubscribed = ranks > cores
            warn_if_oversubscribed(torch.get_num_threads(), ranks, cores)
        return self._threads

    @property
    def oversubscribed(self) -> bool:
        """Whether this host runs more ranks than it has cores (found with
        :attr:`threads`)."""
        _ = self.threads
        return self._oversubscribed

    def scope(self) -> AbstractContextManager[None]:
        """Run the body at :attr:`threads` when torch's current count is higher. Where it
        is not (one rank per host, a user's lower setting, a nested scope), nothing is
        set: the shared no-op context, no generator per call (``Engine.accumulate``
        enters it once per gradient tensor)."""
        current = torch.get_num_threads()
        if current <= self.threads:
            return _UNCHANGED
        return _lowered(self.threads, current)


_UNCHANGED = nullcontext()


@contextmanager
def _lowered(threads: int, restore_to: int) -> Iterator[None]:
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(restore_to)
