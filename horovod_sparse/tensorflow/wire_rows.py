"""The wire rows of the TF backend: a little-endian int32 index, then the value's bytes.

Rows of 4-byte values are read as pairs of int32 words, not byte by byte: unpacking
170K rows took 0.7-1.0 ms against 2.6-4.6 ms sliced as bytes (one CPU thread, traced).
Where the NumPy kernels serve (:func:`~.kernels.host_kernels`), a record array packs
them: 1.1-1.3 ms against 2.2-3.7 ms for TF's concat of byte columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from horovod_sparse.tensorflow.kernels import host_pass_fits, on_host, split_by_mask

__all__ = ["WireRows", "pack_rows", "unpack_rows"]

_INDEX_BYTES = 4


def pack_rows(indices: tf.Tensor, offset: Any, values: tf.Tensor) -> tf.Tensor:
    """``Backend.pack_rows``: ``[count, 4 + itemsize]`` uint8 rows of ``indices - offset``
    (an int or a tensor of one offset per row) and ``values``."""
    width = _INDEX_BYTES + values.dtype.size
    if host_pass_fits(values):
        offsets = tf.cast(offset, tf.int64)
        (rows,) = on_host(_packed, [indices, offsets, values], [tf.uint8])
        return tf.reshape(rows, [-1, width])
    local = tf.cast(indices - offset, tf.int32)
    index_bytes = tf.reshape(tf.bitcast(local, tf.uint8), [-1, _INDEX_BYTES])
    value_bytes = tf.reshape(tf.bitcast(values, tf.uint8), [-1, values.dtype.size])
    return tf.concat([index_bytes, value_bytes], axis=1)


def _packed(indices: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray]:
    rows = np.empty(indices.shape[0], np.dtype([("index", "<i4"), ("value", values.dtype)]))
    np.subtract(indices, offsets, out=rows["index"], casting="unsafe")
    rows["value"] = values
    return (rows.view(np.uint8),)


def unpack_rows(rows: tf.Tensor, wire_like: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``Backend.unpack_rows``: the int64 indices and the values of ``rows``."""
    size = wire_like.dtype.size
    if size == _INDEX_BYTES:
        words = tf.bitcast(tf.reshape(rows, [-1, 2, _INDEX_BYTES]), tf.int32)
        index_words, value_words = tf.unstack(words, axis=1)
        return tf.cast(index_words, tf.int64), tf.bitcast(value_words, wire_like.dtype)
    rows = tf.reshape(rows, [-1, _INDEX_BYTES + size])  # static row width for bitcast
    indices = tf.cast(tf.bitcast(rows[:, :_INDEX_BYTES], tf.int32), tf.int64)
    values = tf.bitcast(rows[:, _INDEX_BYTES:], wire_like.dtype)
    return indices, tf.reshape(values, [-1])


class WireRows:
    """The TF backend's wire-row primitives (``Backend.pack_rows`` and the rest)."""

    # A TF all-gather whose shape changes from step to step negotiates again: the demo's
    # traced step at P = 2 measured 1.08-1.16x dense's with the rows padded, against
    # 1.21-1.24x without (docs/benchmarks.md, "Fixed shapes at P = 2").
    pads_gathered_rows = True

    def pack_rows(self, indices: tf.Tensor, offset: Any, values: tf.Tensor) -> tf.Tensor:
        return pack_rows(indices, offset, values)

    def unpack_rows(self, rows: tf.Tensor, wire_like: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return unpack_rows(rows, wire_like)

    def pad_rows(self, rows: tf.Tensor, capacity: Any) -> tf.Tensor:
        missing = tf.maximum(tf.cast(capacity, tf.int32) - tf.shape(rows)[0], 0)
        return tf.pad(rows, [[0, missing], [0, 0]], constant_values=255)

    def unpadded(self, indices: tf.Tensor, values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        (kept_indices, kept_values), _ = split_by_mask(indices >= 0, indices, values)
        return kept_indices, kept_values
