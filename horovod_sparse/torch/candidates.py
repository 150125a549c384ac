"""The candidate pass of the threshold selection on the CPU: the ascending positions whose
magnitude reaches the threshold, NaN included (``TorchKernels.indices_at_least``).

Chunked, so the bucket is read once and no bucket-sized temporary is made; in NumPy at
one or two threads (:mod:`horovod_sparse.common.host_candidates`), in torch's parallel
kernels above that.
"""

from __future__ import annotations

import torch

from horovod_sparse.common.host_candidates import (
    CANDIDATE_CHUNK,
    HOST_PASS_THREADS,
    numpy_indices_at_least,
    thread_scratch,
)

__all__ = ["cpu_indices_at_least", "numpy_serves"]

# Floats per chunk of torch's pass: it serves more than HOST_PASS_THREADS threads,
# where each kernel is a parallel region whose start and join a smaller chunk would pay
# more often; it keeps the 1M that both passes used before NumPy's went to 128K
# (host_candidates.CANDIDATE_CHUNK; not measured above two cores).
_CANDIDATE_CHUNK = 1 << 20
# Floats per chunk of the NumPy pass.
_NUMPY_CHUNK = CANDIDATE_CHUNK


def _nonzero_by_words(mask: torch.Tensor) -> torch.Tensor:
    """``mask.nonzero()`` for a CPU bool mask whose length is a multiple of 8, ascending.

    Reads the mask as int64 words of 8 flags: only the words holding a set flag are
    expanded and tested. At density 0.01, one word in 13 is set, so this is about 2x
    faster than ``nonzero`` on the flags (5.4 vs 11.6 ms at 16M, one thread).
    """
    words = mask.view(torch.int64).nonzero().view(-1)
    word_and_flag = mask.view(-1, 8).index_select(0, words).nonzero()
    return words.index_select(0, word_and_flag[:, 0]).mul_(8).add_(word_and_flag[:, 1])


def _torch_indices_at_least(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Ascending positions of ``values`` whose magnitude is at least ``threshold`` (NaN
    included), one chunk at a time into reused scratch: one read of the bucket, and no
    bucket-sized temporary."""
    numel = values.numel()
    chunk = min(numel, _CANDIDATE_CHUNK)
    magnitudes, flags = thread_scratch(
        "torch",
        chunk,
        values.dtype,
        lambda length: (
            torch.empty(length, dtype=values.dtype),
            torch.empty(length, dtype=torch.bool),
        ),
    )
    found = []
    for start in range(0, numel, chunk):
        part = values[start : start + chunk]
        width = part.numel()
        below = torch.lt(torch.abs(part, out=magnitudes[:width]), threshold, out=flags[:width])
        # NaN compares false, so "not below" selects it: it reaches the result, as it
        # would with dense Horovod.
        keep = below.logical_not_()
        positions = _nonzero_by_words(keep) if width % 8 == 0 else keep.nonzero().view(-1)
        found.append(positions.add_(start) if start else positions)
    return found[0] if len(found) == 1 else torch.cat(found)


# The host kernels run at up to this many torch threads (host_candidates.HOST_PASS_THREADS).
_NUMPY_CANDIDATE_THREADS = HOST_PASS_THREADS


def numpy_serves(tensor: torch.Tensor) -> bool:
    """Whether the NumPy host kernels (``common/host_candidates``) take ``tensor``: on
    the CPU, with torch at up to ``HOST_PASS_THREADS`` threads (above, torch's parallel
    kernels)."""
    return tensor.device.type == "cpu" and torch.get_num_threads() <= _NUMPY_CANDIDATE_THREADS


# The dtypes NumPy has (host_candidates.HOST_DTYPES); bfloat16 stays in torch.
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def _numpy_indices_at_least(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """:func:`_torch_indices_at_least` in NumPy (one thread), on a view of the same memory:
    the same positions, as int64."""
    array = values.detach().numpy()
    return torch.from_numpy(numpy_indices_at_least(array, threshold.item(), _NUMPY_CHUNK))


def cpu_indices_at_least(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of the CPU tensor ``values`` whose magnitude is at least
    ``threshold`` (a value of its dtype), NaN included."""
    if values.dtype in _NUMPY_DTYPES and numpy_serves(values):
        return _numpy_indices_at_least(values, threshold)
    return _torch_indices_at_least(values, threshold)
