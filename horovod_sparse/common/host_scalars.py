"""Step state on the host: a Python box for it, and the scalar arithmetic of a state
update in NumPy.

A backend whose every scalar op is a kernel (TensorFlow: a traced step runs about
16 µs of executor work a kernel) can run a whole update of a bucket's state in one host
call instead (:meth:`Backend.update_cells`): the update's own code, given
:data:`HOST_SCALARS` for its primitives and the cells' values as NumPy scalars. The
arithmetic is the backends' own, op for op in the same dtypes (int32 keys, int64
counts, float64 for the tail's extension), so every rank, which runs the same update on
the same gathered rows, derives the same state.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from horovod_sparse.common.host_candidates import numpy_indices_at_least, numpy_kth_largest
from horovod_sparse.common.host_counts import HostCounts

__all__ = ["HOST_SCALARS", "HostCell", "HostScalars"]


class HostCell:
    """A :class:`~horovod_sparse.common.backend.Cell` held by Python: right wherever
    every step runs the Python code."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value

    def set(self, value: Any) -> None:
        self.value = value


class HostScalars(HostCounts):
    """The primitives a state update calls (the reused global threshold's
    ``observe``, the local threshold selection), over NumPy arrays and 0-d arrays."""

    def cond(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        return then() if pred else otherwise()

    def select(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        return then() if pred else otherwise()

    def num_rows(self, values: np.ndarray) -> np.int64:
        return np.int64(values.shape[0])

    def magnitude_keys(self, values: np.ndarray) -> np.ndarray:
        keys: np.ndarray = np.abs(values).astype(np.float32).view(np.int32)
        return keys

    def kth_largest(self, values: np.ndarray, k: Any) -> np.ndarray:
        return numpy_kth_largest(values, int(k))

    def extrapolate_key(self, lowest: Any, middle: Any, count: Any, k: Any) -> np.ndarray:
        # TF's graph arithmetic (tensorflow/kernels.extrapolate_key), in NumPy.
        ratio = np.float64(k) / np.float64(count)
        below = np.float64(middle - lowest) * (np.log(ratio) / math.log(2.0))
        return np.asarray(np.round(np.maximum(np.float64(lowest) - below, 0.0)), np.int32)

    def shifted_key(self, key: Any, offset: Any, low: int, high: int) -> np.ndarray:
        total = np.int64(key) + np.int64(offset)
        return np.asarray(np.clip(total, low, high), np.asarray(key).dtype)

    # The local threshold selection's primitives (``ThresholdSelection.select_values``),
    # each the TF backend's kernel in NumPy: the same positions and the same values.

    def length(self, values: np.ndarray) -> int:
        return int(values.shape[0])

    def strided_sample_abs(self, values: np.ndarray, size: int, offset: Any) -> np.ndarray:
        stride = max(1, int(values.shape[0]) // size)
        start = int(offset) % stride
        sample: np.ndarray = np.abs(values[start : start + size * stride : stride])
        return sample

    def indices_at_least(self, values: np.ndarray, threshold: Any) -> np.ndarray:
        return numpy_indices_at_least(values, float(threshold))

    def topk_indices(self, values: np.ndarray, k: Any) -> np.ndarray:
        if int(k) >= values.shape[0]:
            return np.arange(values.shape[0], dtype=np.int64)
        return np.flatnonzero(numpy_top_k_mask(np.abs(values), int(k))).astype(np.int64)

    def top_of(self, values: np.ndarray, candidates: np.ndarray, k: Any) -> np.ndarray:
        mask = numpy_top_k_mask(np.abs(np.take(values, candidates)), int(k))
        chosen: np.ndarray = candidates[mask]
        return chosen

    def take(self, values: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return np.take(values, indices)


def numpy_top_k_mask(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Exactly the ``k`` largest ``magnitudes`` as a mask: ties by lower position, NaN
    counted as the largest (``tensorflow/kernels.top_k_mask``, as ``torch.topk``)."""
    magnitudes = np.where(np.isnan(magnitudes), magnitudes.dtype.type(np.inf), magnitudes)
    kth = numpy_kth_largest(magnitudes, k)
    above = magnitudes > kth
    at = magnitudes == kth
    room = k - int(np.count_nonzero(above))
    mask: np.ndarray = above | (at & (np.cumsum(at, dtype=np.int64) <= room))
    return mask


HOST_SCALARS = HostScalars()  # stateless
