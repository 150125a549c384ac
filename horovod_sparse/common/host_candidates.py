"""The candidate pass of the threshold selection in NumPy, on the host: the ascending
positions whose magnitude reaches the threshold, NaN included; and the owner's distinct
received indices (:func:`numpy_unique_inverse`) and the k-th largest of the global
selection's integer magnitude keys or of the local threshold's float sample
(:func:`numpy_kth_largest`).

Both backends run it on CPU buckets where their kernels have at most
:data:`HOST_PASS_THREADS` threads: torch on a view of the tensor's memory
(``horovod_sparse.torch.candidates``), TF on a view of an eager tensor or, in a
``tf.function``, through ``tf.numpy_function`` (``horovod_sparse.tensorflow.kernels``).
One thread, chunked: each chunk's magnitudes and flags stay in cache between the two
kernels that read them, and no bucket-sized temporary is made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "CANDIDATE_CHUNK",
    "HOST_DTYPES",
    "HOST_PASS_THREADS",
    "cores_available",
    "local_ranks_from_environment",
    "numpy_indices_at_least",
    "numpy_kth_largest",
    "numpy_unique_inverse",
    "thread_scratch",
    "threads_per_rank",
]

# Floats per chunk of the pass: a chunk's magnitudes (512 KB in fp32) and flags stay in
# the core's cache (2 MB of L2 here) between the kernels that read them. Chunks against
# whole-bucket temporaries, 16M floats, one thread: 13.4 against 25.4 ms (fresh pages
# alone cost a third of that). 128K against 1M floats a chunk, medians of 15 alone:
# 1.19M floats 1.38 against 1.68 ms, 16M 23.8 against 27.7 (64K and 256K within 0.7 ms
# of 128K); in the demo's training step (2 ranks on 2 cores, the chunk changing from
# step to step in one run, 50 calls each, two runs) 1.89-1.96 against 2.31-2.38 ms,
# 32K 2.01-2.06 and 8K 3.15-3.22.
CANDIDATE_CHUNK = 1 << 17

# At one or two threads the NumPy pass beats the frameworks' own (2 cores, 2.1 % of the
# entries above the threshold, ms). torch's ``lt`` and ``nonzero``: 256K floats 0.10
# against 0.34 (one thread); 1.19M 0.70 against 1.64 (one thread) and 1.43 (two); 16M
# 11.6 against 24.3 and 18.1. TF's two comparisons and ``where``, 16M: eagerly 8.9-10.1
# against 15.0-15.5, in a tf.function 9.6-10.0 against 12.3-13.6 (one and two threads).
# Above two threads the frameworks' parallel kernels are kept (not measured here).
HOST_PASS_THREADS = 2
HOST_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def cores_available() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_rank(cores: int, local_ranks: int) -> int:
    """Each of ``local_ranks`` ranks' share of a host's ``cores``, at least 1 (what
    ``torchrun`` sets for a whole process)."""
    return max(1, cores // max(1, local_ranks))


def local_ranks_from_environment() -> int:
    """Ranks on this host as the launcher says (``torchrun``, ``horovodrun``, Open MPI),
    else 1."""
    for variable in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(variable)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


# Each thread's scratch (magnitudes and flags) is kept between calls, one per dtype,
# grown to the largest chunk seen: fresh chunk-sized arrays cost page faults on every
# call. The demo's 1.19M-float bucket in a training step (2 ranks, one thread each, 2
# cores): 2.1-2.4 ms a pass with fresh arrays, 1.0-1.2 ms with kept ones.
_SCRATCH = threading.local()


ScratchPair = tuple[Any, Any]


def thread_scratch(
    kind: str, chunk: int, dtype: Any, make: Callable[[int], ScratchPair]
) -> ScratchPair:
    """This thread's scratch pair of ``dtype`` for at least ``chunk`` entries, kept under
    ``kind`` (``make(length)`` makes a pair); callers slice it to the chunk."""
    kept: dict[Any, ScratchPair] = _SCRATCH.__dict__.setdefault(kind, {})
    pair = kept.get(dtype)
    if pair is None or len(pair[0]) < chunk:
        pair = kept[dtype] = make(chunk)
    return pair


def numpy_indices_at_least(
    array: np.ndarray, threshold: float, chunk: int = CANDIDATE_CHUNK
) -> np.ndarray:
    """Ascending int64 positions of the 1-D ``array`` (read only) whose magnitude is at
    least ``threshold`` (rounded to the array's dtype), NaN included."""
    limit = array.dtype.type(threshold)
    numel = array.size
    chunk = max(1, min(numel, chunk))
    magnitudes, below = thread_scratch(
        "numpy",
        chunk,
        array.dtype,
        lambda length: (np.empty(length, array.dtype), np.empty(length, np.bool_)),
    )
    found = []
    for start in range(0, numel, chunk):
        part = array[start : start + chunk]
        width = part.size
        np.less(np.abs(part, out=magnitudes[:width]), limit, out=below[:width])
        # NaN compares false, so "not below" selects it: it reaches the result, as it
        # would with dense Horovod.
        positions = np.flatnonzero(np.logical_not(below[:width], out=below[:width]))
        if start:
            positions += start
        found.append(positions)
    if not found:
        return np.zeros(0, np.int64)
    flat = found[0] if len(found) == 1 else np.concatenate(found)
    return flat.astype(np.int64, copy=False)


def numpy_unique_inverse(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct values ascending, position of each input among them)`` of the 1-D int
    array ``indices``, both int64: ``np.unique(indices, return_inverse=True)``.

    A stable argsort: NumPy's for 64-bit integers is a timsort, which finds the runs
    an owner receives (each rank's rows ascend) and merges them instead of sorting.
    2 runs, one thread: 24K indices 0.35 against 1.7 ms for ``torch.unique``'s sort;
    340K 5.7-6.7 against 20 ms.
    """
    if indices.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(indices, kind="stable")
    ascending = indices[order]
    starts = np.empty(ascending.size, np.bool_)
    starts[0] = True
    np.not_equal(ascending[1:], ascending[:-1], out=starts[1:])
    group = np.cumsum(starts, dtype=np.int64)
    group -= 1
    inverse = np.empty(indices.size, np.int64)
    inverse[order] = group
    return ascending[starts].astype(np.int64, copy=False), inverse


def numpy_kth_largest(keys: np.ndarray, k: int) -> np.ndarray:
    """The ``k``-th largest of the 1-D integer or float array ``keys`` (1 <= k <= its
    length), a 0-d array of its dtype. ``np.partition``'s selection (SIMD where the CPU
    has it) beat both frameworks' (one thread, int32, medians of 30): 24K keys, k = 12K:
    0.016 ms against 0.22 for ``torch.topk``; 170K keys, k = 100: 0.07 against 0.55;
    340K, k = 168K: 0.19 against 6.0. A float32 sample of 25.6K, k = 256: 0.04 against
    0.16 (medians of 300)."""
    count = keys.size
    if not 1 <= k <= count:
        raise ValueError(f"the {k}-th largest of {count} keys")
    return np.asarray(np.partition(keys, count - k)[count - k])
