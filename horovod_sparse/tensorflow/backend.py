"""TensorFlow implementation of the tensor primitives in ``horovod_sparse.common.backend``.

Every primitive is a TF op, so the common stages run eagerly and inside ``tf.function``
alike. Horovod's TF ops have no handles: "async" primitives return the op's output,
and independent ops in one graph run concurrently. Alltoall ``splits`` stay tensors
(Horovod's TF op takes them as a tensor input), so no step reads device data on the
host.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.backend import HorovodPrimitives
from horovod_sparse.common.config import SparseConfig
from horovod_sparse.tensorflow import kernels, residual_variable, row_sums, wire_rows
from horovod_sparse.tensorflow.kernels import VariableCell, scheduled_budget, top_k_mask

__all__ = ["BACKEND", "TFBackend", "VariableCell"]  # VariableCell: from kernels.py

# tf.math.round rounds half to even, as Python's round does on the host.
_ROUNDINGS = {"ceil": tf.math.ceil, "floor": tf.math.floor, "round": tf.math.round}


def _shape(buffer: tf.Tensor) -> tf.Tensor:
    return tf.shape(buffer, out_type=tf.int64)


def _rows(indices: tf.Tensor) -> tf.Tensor:
    """Flat indices as the ``[count, 1]`` int64 coordinates of a 1-D sparse tensor."""
    return tf.cast(indices, tf.int64)[:, None]


class TFBackend(wire_rows.WireRows, HorovodPrimitives):
    """Stateless; one shared instance serves every bucket (the wire rows' primitives:
    :mod:`.wire_rows`)."""

    no_compression = hvd.Compression.none
    in_place = False  # tensors are immutable: every kernel returns a new one

    # ---- state and control flow: variables and tf.cond, so a traced step keeps working
    def cell(self, initial: Any, like: tf.Tensor | None = None) -> VariableCell:
        if like is not None:
            dtype = like.dtype
        else:  # a flag, a count, or a list of boundaries
            dtype = tf.bool if isinstance(initial, bool) else tf.int64
        with tf.init_scope():  # made eagerly, even when first needed inside tf.function
            return VariableCell(tf.Variable(tf.constant(initial, dtype), trainable=False))

    def cond(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        if isinstance(pred, (bool, np.bool_)):
            return then() if pred else otherwise()
        return tf.cond(pred, then, otherwise)

    def update_cells(
        self,
        update: Callable[..., Any],
        cells: Sequence[Any],
        inputs: Any,
        unread: Any = (),
        returns: Any = (),
    ) -> Any:
        served, results = kernels.update_cells_on_host(update, cells, inputs, unread, returns)
        return results if served else update(self, [*cells, *unread], inputs)

    def select(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        if isinstance(pred, (bool, np.bool_)):
            return then() if pred else otherwise()
        # Both computed, one kept: a tf.cond would build two branch functions (about
        # nine ops and two function graphs to trace, instantiate and optimize).
        chosen, other = then(), otherwise()
        dtype = chosen.dtype if tf.is_tensor(chosen) else other.dtype
        return tf.where(pred, tf.cast(chosen, dtype), tf.cast(other, dtype))

    def all_of(self, flags: Sequence[Any]) -> Any:
        if all(isinstance(flag, (bool, np.bool_)) for flag in flags):
            return all(flags)
        return tf.reduce_all(tf.stack([tf.convert_to_tensor(flag) for flag in flags]))

    def any_of(self, flags: Sequence[Any]) -> Any:
        if all(isinstance(flag, (bool, np.bool_)) for flag in flags):
            return any(flags)
        return tf.reduce_any(tf.stack([tf.convert_to_tensor(flag) for flag in flags]))

    def on_host(self, function: Callable[[list[int]], list[int]], counts: tf.Tensor) -> Any:
        def call(host_counts: np.ndarray) -> np.ndarray:
            return np.asarray(function(host_counts.tolist()), np.int64)

        result = tf.numpy_function(call, [counts], tf.int64, stateful=False)
        return tf.ensure_shape(result, [None])

    # ---- budgets: k follows the step variable while the density decays
    def scheduled_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        return scheduled_budget(numel, config, step)

    def sparse_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        if not config.density_decay_steps:
            return super().sparse_budget(numel, config, step)  # a host int; step not read
        # A tensor eagerly too, so that eager and traced steps run the same code.
        return scheduled_budget(numel, config, step)

    def scaled_count(
        self,
        count: Any,
        numerator: float,
        denominator: int = 1,
        rounding: str = "floor",
        least: int | None = None,
        most: int | None = None,
    ) -> Any:
        if not tf.is_tensor(count):
            return super().scaled_count(count, numerator, denominator, rounding, least, most)
        # float64 as on the host: the same products and quotients, rounded alike.
        value = tf.cast(count, tf.float64) * numerator / denominator
        rounded = _ROUNDINGS[rounding](value)
        if most is not None:
            rounded = tf.minimum(rounded, float(most))
        if least is not None:
            rounded = tf.maximum(rounded, float(least))
        return tf.cast(rounded, tf.int64)

    # ---- dense arithmetic
    def zeros(self, numel: int, like: tf.Tensor) -> tf.Tensor:
        return tf.zeros([numel], dtype=like.dtype)

    def length(self, tensor: tf.Tensor) -> int:
        return int(tensor.shape[0])

    def num_rows(self, tensor: tf.Tensor) -> tf.Tensor:
        if tensor.shape.rank == 1:
            return tf.size(tensor, out_type=tf.int64)  # one op, where a slice takes five
        return tf.shape(tensor, out_type=tf.int64)[0]

    def itemsize(self, tensor: tf.Tensor) -> int:
        return tensor.dtype.size

    def add_scaled_(self, buffer: tf.Tensor, tensor: tf.Tensor, factor: float) -> tf.Tensor:
        flat = tf.cast(tf.reshape(tensor, [-1]), buffer.dtype)
        return residual_variable.add_to(buffer, flat if factor == 1.0 else flat * factor)

    def add_scaled_at_(
        self, buffer: tf.Tensor, offset: int, tensor: tf.Tensor, factor: float
    ) -> tf.Tensor:
        return kernels.add_scaled_into_slice(buffer, offset, tensor, factor)

    def add_scaled(self, tensor: tf.Tensor, other: tf.Tensor, factor: float) -> tf.Tensor:
        return tensor + factor * other

    def momentum_update_(
        self, buffer: tf.Tensor, value: tf.Tensor, momentum: float, weight: float
    ) -> tf.Tensor:
        return momentum * buffer + (value if weight == 1.0 else weight * value)

    def moving_average_(self, buffer: tf.Tensor, value: tf.Tensor, beta: float) -> tf.Tensor:
        return beta * buffer + (1.0 - beta) * value

    def moving_average_of_square_(
        self, buffer: tf.Tensor, value: tf.Tensor, beta: float
    ) -> tf.Tensor:
        return beta * buffer + (1.0 - beta) * tf.square(value)

    def adam_ratio(
        self,
        first: tf.Tensor,
        second: tf.Tensor,
        first_scale: Any,
        second_scale: Any,
        eps: float,
        ranks: int,
    ) -> tf.Tensor:
        first_hat = first / tf.cast(first_scale, first.dtype)
        second_hat = second / tf.cast(second_scale, second.dtype)
        if ranks > 1:  # the average's second moment (common.correction.adam_direction)
            signal = tf.minimum(tf.square(first_hat), second_hat)
            second_hat = signal * (1.0 - 1.0 / ranks) + second_hat * (1.0 / ranks)
        return first_hat / (tf.sqrt(second_hat) + eps)

    def copy(self, tensor: tf.Tensor) -> tf.Tensor:
        return tf.identity(tensor)

    def value_of(self, buffer: Any) -> tf.Tensor:
        return tf.convert_to_tensor(buffer)

    def assign(self, buffer: tf.Tensor, source: Any) -> tf.Tensor:
        return tf.cast(tf.reshape(tf.convert_to_tensor(source), tf.shape(buffer)), buffer.dtype)

    def scale(self, tensor: tf.Tensor, factor: float) -> tf.Tensor:
        return tensor * tf.cast(factor, tensor.dtype)

    def to_host_number(self, scalar: Any) -> float:
        if not tf.is_tensor(scalar):
            return scalar
        _eager_only("to_host_number")
        return scalar.numpy().item()

    def sum_except(self, counts: tf.Tensor, rank: int) -> tf.Tensor:
        counts = tf.cast(counts, tf.int64)
        return tf.reduce_sum(counts) - counts[rank]

    def clock(self, *after: tf.Tensor) -> Any:
        if tf.executing_eagerly():
            return time.perf_counter()
        # In a graph, a timestamp ordered after the tensors it measures.
        with tf.control_dependencies([a for a in after if tf.is_tensor(a)]):
            return tf.timestamp()

    # ---- selection
    def topk_indices(self, values: tf.Tensor, k: Any) -> tf.Tensor:
        numel = values.shape[0]
        if numel is not None and not tf.is_tensor(k) and k >= numel:
            return tf.range(numel, dtype=tf.int64)
        return tf.where(top_k_mask(tf.abs(values), k))[:, 0]

    def strided_sample_abs(self, values: tf.Tensor, size: int, offset: int) -> tf.Tensor:
        stride = max(1, int(values.shape[0]) // size)
        positions = tf.range(size, dtype=tf.int64) * stride + (offset % stride)
        return tf.abs(tf.gather(values, positions))

    def kth_largest(self, values: tf.Tensor, k: Any) -> tf.Tensor:
        if values.dtype.is_integer and kernels.host_kernels():  # the global selection's keys
            return kernels.host_kth_largest(values, k)
        return tf.raw_ops.NthElement(input=values, n=tf.cast(k - 1, tf.int32), reverse=True)

    def indices_at_least(self, values: tf.Tensor, threshold: tf.Tensor) -> tf.Tensor:
        return kernels.indices_at_least(values, threshold)

    def top_of(self, values: tf.Tensor, candidates: tf.Tensor, k: Any) -> tf.Tensor:
        magnitudes = tf.abs(kernels.bucket_gather(values, candidates))
        top = tf.cast(top_k_mask(magnitudes, k), tf.int32)
        return tf.dynamic_partition(candidates, top, 2)[1]

    def position_histogram(self, indices: tf.Tensor, numel: int, bins: int) -> tf.Tensor:
        which = indices * bins // numel
        return tf.math.unsorted_segment_sum(tf.ones_like(which, tf.int32), which, bins)

    def to_host_list(self, tensor: tf.Tensor) -> list:
        _eager_only("to_host_list")
        return tensor.numpy().tolist()

    def take(self, values: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
        return kernels.bucket_gather(values, indices)

    # The sparse-tensor kernels below beat tensor_scatter_nd_* on a bucket of 16M floats
    # with 1% of the entries addressed (CPU, one thread): 8.6 ms against 17.7 to zero
    # them, 5.5 against 28.8 to add to them, 2.9 against 26.4 to scatter into zeros.
    # They, and NthElement in top_k_mask, were chosen and measured on the CPU only;
    # under a GPU, TF places an op that has no GPU kernel on the host, with copies.

    def zero_at(self, buffer: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
        # A mask and a select, not a multiplication: inf and NaN entries become 0 too.
        hit = tf.sparse.to_dense(
            tf.SparseTensor(_rows(indices), tf.ones_like(indices, tf.bool), _shape(buffer)),
            default_value=False,
            validate_indices=False,
        )
        return tf.where(hit, tf.zeros([], buffer.dtype), buffer)

    def add_at(self, buffer: tf.Tensor, indices: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        # Duplicate indices add up, each in its turn.
        addend = tf.SparseTensor(_rows(indices), tf.cast(values, buffer.dtype), _shape(buffer))
        return tf.sparse.add(buffer, addend)

    def zero_then_add(self, buffer: Any, zeroed: Any, held: Any, adds: Any) -> tf.Tensor:
        return kernels.zero_then_add(buffer, zeroed, held, list(adds), self.zero_at, self.add_at)

    def shift(self, indices: tf.Tensor, offset: int) -> tf.Tensor:
        return indices + tf.cast(offset, tf.int64)

    # ---- partition and packing
    def region_counts(self, sorted_indices: tf.Tensor, boundaries: Any) -> tf.Tensor:
        edges = tf.cast(boundaries, tf.int64)
        positions = tf.searchsorted(sorted_indices, edges, side="left", out_type=tf.int32)
        return positions[1:] - positions[:-1]

    def region_offsets(self, sorted_indices: tf.Tensor, boundaries: Any) -> tf.Tensor:
        edges = tf.cast(boundaries, tf.int64)
        if edges.shape[0] == 2:  # one region
            return tf.zeros_like(sorted_indices)
        region = tf.searchsorted(edges[1:-1], sorted_indices, side="right")
        return tf.gather(edges, region)

    def unique_inverse(self, indices: tf.Tensor, runs: Any = None) -> tuple[tf.Tensor, tf.Tensor]:
        return row_sums.unique_inverse(indices, runs)

    def sum_rows(
        self, indices: tf.Tensor, values: tf.Tensor, like: tf.Tensor, runs: Any = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        return row_sums.sum_rows(self, indices, values, like, runs)

    # ---- global selection (radix select over fp32 magnitude bits)
    def magnitude_keys(self, values: tf.Tensor) -> tf.Tensor:
        return tf.bitcast(tf.cast(tf.abs(values), tf.float32), tf.int32)

    def radix_start(self, like: tf.Tensor, k: Any) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.zeros([], tf.int32), tf.cast(k, tf.int64)  # k: a host int or a graph scalar

    def digit_histogram(self, keys: tf.Tensor, prefix: tf.Tensor, shift: int) -> tf.Tensor:
        return kernels.digit_histogram(keys, prefix, shift)

    def choose_digit(
        self, histogram: tf.Tensor, remaining: tf.Tensor, prefix: tf.Tensor, shift: int
    ) -> tuple[tf.Tensor, tf.Tensor]:
        return kernels.choose_digit(histogram, remaining, prefix, shift)

    def mask_at_least(self, keys: tf.Tensor, threshold: tf.Tensor) -> tf.Tensor:
        return keys >= threshold

    def count_reaching(self, keys: tf.Tensor, threshold: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(tf.cast(keys >= threshold, tf.int64))

    def larger_key(self, key: tf.Tensor, other: tf.Tensor) -> tf.Tensor:
        return tf.maximum(key, tf.cast(other, key.dtype))

    def extrapolate_key(self, lowest: tf.Tensor, middle: tf.Tensor, count: Any, k: Any) -> Any:
        return kernels.extrapolate_key(lowest, middle, count, k)

    def shifted_key(self, key: tf.Tensor, offset: tf.Tensor, low: int, high: int) -> tf.Tensor:
        return kernels.shifted_key(key, offset, low, high)

    def concat(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat(list(tensors), axis=0)

    def chunks(self, tensor: tf.Tensor, count: int) -> list[tf.Tensor]:
        return list(tf.split(tensor, count))

    def split_by_mask(
        self, mask: tf.Tensor, *tensors: tf.Tensor
    ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        return kernels.split_by_mask(mask, *tensors)

    def owner_major(self, sends: Sequence[tuple[tf.Tensor, Any]]) -> tuple[tf.Tensor, Any]:
        return kernels.owner_major(list(sends))

    def cut_at(
        self, indices: tf.Tensor, values: tf.Tensor, edges: Any, ordered: bool
    ) -> list[tuple[tf.Tensor, tf.Tensor]]:
        return kernels.cut_at(indices, values, edges, ordered)

    def count_in_range(self, indices: tf.Tensor, lo: int, hi: int) -> tf.Tensor:
        inside = tf.logical_and(indices >= lo, indices < hi)
        return tf.reduce_sum(tf.cast(inside, tf.int64))

    def scatter_into(
        self, numel: int, like: tf.Tensor, indices: tf.Tensor, values: tf.Tensor, out: Any = None
    ) -> tf.Tensor:
        # TF tensors are immutable: ``out`` is ignored and a new tensor returned. The
        # indices are distinct and ascending (the all-gather's rows, owners in rank
        # order): SparseToDense checks it, the host scatter relies on it.
        values = tf.cast(values, like.dtype)
        if kernels.host_pass_fits(values):
            return kernels.scatter_on_host(numel, indices, values)
        return tf.sparse.to_dense(tf.SparseTensor(_rows(indices), values, [numel]))

    # ---- collectives: Horovod TF ops; the op's output stands in for the handle
    def alltoall_async(
        self, rows: tf.Tensor, splits: tf.Tensor, name: str, process_set: Any
    ) -> Any:
        return hvd.alltoall(rows, splits=splits, name=name, process_set=process_set)

    def allgather_async(self, rows: tf.Tensor, name: str, process_set: Any) -> Any:
        return hvd.allgather(rows, name=name, process_set=process_set)

    def allreduce_sum_async(self, tensor: tf.Tensor, name: str, process_set: Any) -> Any:
        return hvd.allreduce(tensor, op=hvd.Sum, name=name, process_set=process_set)

    def allreduce_sum_inplace_async(self, tensor: tf.Tensor, name: str, process_set: Any) -> Any:
        # TF tensors are immutable: the result is a new tensor either way.
        return self.allreduce_sum_async(tensor, name, process_set)

    def zero_(self, buffer: tf.Tensor) -> tf.Tensor:
        return tf.zeros_like(buffer)

    def from_host(self, values: list[float], like: tf.Tensor) -> tf.Tensor:
        return tf.constant(values, dtype=tf.float64)

    def broadcast(self, tensor: tf.Tensor, root: int, name: str, process_set: Any) -> tf.Tensor:
        return hvd.broadcast(tensor, root, name=name, process_set=process_set)

    def poll(self, handle: Any) -> bool:
        # TF collectives are ops whose result is the tensor itself: done when it exists.
        return True

    def wait(self, handle: Any) -> Any:
        return handle


BACKEND = TFBackend()  # stateless: one instance serves every bucket


def _eager_only(what: str) -> None:
    """A host read (``.numpy()``) is for eager code only: statistics, checkpoints."""
    if not tf.executing_eagerly():
        raise RuntimeError(f"{what} reads the host: call it eagerly, not in a tf.function")
