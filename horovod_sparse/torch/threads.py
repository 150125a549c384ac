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

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from horovod_sparse.common.host_candidates import cores_available, local_ranks_from_environment

__all__ = ["LocalThreads", "cores_available", "local_ranks_from_environment"]


class LocalThreads:
    """The thread count of the plugin's kernels on one host, found once.

    Args:
        local_ranks: how many ranks share this host (asked at the first use, when the
            launcher's world is up).
    """

    def __init__(self, local_ranks: Callable[[], int]) -> None:
        self._local_ranks = local_ranks
        self._threads: int | None = None

    @property
    def threads(self) -> int:
        """Cores available divided by the ranks on this host, at least 1."""
        if self._threads is None:
            self._threads = max(1, cores_available() // max(1, self._local_ranks()))
        return self._threads

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
