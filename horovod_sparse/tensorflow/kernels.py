"""TensorFlow pieces of the backend that stand on their own, with no Horovod.

Exact top-k as a mask (:func:`top_k_mask`, the selection kernel), the budget k as a graph
value while the density decays (:func:`scheduled_budget`), and the
:class:`~horovod_sparse.common.backend.Cell` in a ``tf.Variable`` (:class:`VariableCell`),
so a traced step keeps its state, and the kernels a CPU-only process at one or two threads runs
in NumPy (:func:`host_kernels`, :func:`on_host`: the candidate pass, the bucket
gather, the k-th largest key and the dense result, :func:`scatter_on_host`).
:class:`~horovod_sparse.tensorflow.backend.TFBackend` builds its primitives on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from horovod_sparse.common.config import SparseConfig, budget
from horovod_sparse.common.host_candidates import (
    HOST_DTYPES,
    HOST_PASS_THREADS,
    cores_available,
    local_ranks_from_environment,
    numpy_indices_at_least,
    numpy_kth_largest,
    threads_per_rank,
)
from horovod_sparse.common.host_scalars import HOST_SCALARS, HostCell
from horovod_sparse.tensorflow import residual_variable

__all__ = [
    "VariableCell",
    "add_scaled_into_slice",
    "bucket_gather",
    "choose_digit",
    "cut_at",
    "digit_histogram",
    "extrapolate_key",
    "host_kernels",
    "host_kth_largest",
    "indices_at_least",
    "on_host",
    "owner_major",
    "scatter_on_host",
    "scheduled_budget",
    "shifted_key",
    "split_by_mask",
    "top_k_mask",
    "update_cells_on_host",
    "zero_then_add",
]


def add_scaled_into_slice(
    buffer: tf.Tensor, offset: int, tensor: tf.Tensor, factor: float
) -> tf.Tensor:
    """``buffer`` with ``factor * tensor.flatten()`` added at ``[offset:offset + numel]``."""
    flat = tf.cast(tf.reshape(tensor, [-1]), buffer.dtype)
    if factor != 1.0:
        flat = flat * factor
    numel, whole = flat.shape.num_elements(), buffer.shape.num_elements()
    if offset == 0 and numel is not None and numel == whole:
        return residual_variable.add_to(buffer, flat)
    # Slices and one concat: tensor_scatter_nd_add over a range of positions copies the
    # buffer and scatters element by element (0.53 s for 16M floats on one CPU thread,
    # against 0.02 s for this).
    end = offset + tf.size(flat)
    return tf.concat([buffer[:offset], buffer[offset:end] + flat, buffer[end:]], 0)


def indices_at_least(values: tf.Tensor, threshold: tf.Tensor) -> tf.Tensor:
    """``Backend.indices_at_least``: ascending int64 positions of the 1-D ``values``
    outside ``(-threshold, threshold)`` (NaN included, as dense would pass it).

    In a process whose TF sees no GPU and whose kernels have at most
    ``HOST_PASS_THREADS`` threads, the NumPy pass of ``common/host_candidates`` runs on
    the tensor's memory: eagerly on a view of it, in a trace through
    ``tf.numpy_function`` (16M floats, one or two threads: 8.9-10.1 against 15.0-15.5 ms
    eagerly, 9.6-10.0 against 12.3-13.6 ms traced). Elsewhere two comparisons of the
    values themselves, not of their magnitudes: one 16M pass fewer (14 against 18.5 ms,
    one CPU thread).
    """
    threshold = tf.cast(threshold, values.dtype)
    if host_pass_fits(values):
        return on_host(_host_pass, [values, threshold], [tf.int64])[0]
    inside = tf.logical_and(values < threshold, values > -threshold)
    return tf.where(tf.logical_not(inside))[:, 0]


def _host_pass(array: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray]:
    return (numpy_indices_at_least(array, float(threshold)),)


# Whether the NumPy kernels serve this process (None: not decided yet; tests set it).
HOST_PASS: bool | None = None


def host_kernels() -> bool:
    """Whether this process runs the NumPy kernels (the candidate pass and the bucket
    gather): TF sees no GPU and its kernels run on at most
    ``HOST_PASS_THREADS`` threads (TF's intra-op setting, 0 for every core, and the
    cores available shared by the ranks on this host). Decided once a process."""
    global HOST_PASS
    if HOST_PASS is None:
        cores = cores_available()
        threads = tf.config.threading.get_intra_op_parallelism_threads() or cores
        threads = min(threads, threads_per_rank(cores, local_ranks_from_environment()))
        HOST_PASS = threads <= HOST_PASS_THREADS and not tf.config.list_logical_devices("GPU")
    return HOST_PASS


def host_pass_fits(values: tf.Tensor) -> bool:
    """Whether the NumPy kernels serve ``values``: a dtype NumPy has (not bfloat16), in
    a process that runs them (:func:`host_kernels`)."""
    return values.dtype.as_numpy_dtype in HOST_DTYPES and host_kernels()


def on_host(
    function: Callable[..., tuple[np.ndarray, ...]],
    inputs: list[tf.Tensor],
    dtypes: list[tf.DType],
) -> list[tf.Tensor]:
    """The 1-D results of ``function`` over NumPy arrays of ``inputs``: eagerly on views
    of the tensors' memory (``.numpy()`` would copy: 31 ms for 16M floats), in a trace
    through ``tf.numpy_function``, which holds Python's GIL while it runs and which no
    XLA compiles."""
    if tf.executing_eagerly():
        arrays = function(*(np.asarray(tensor) for tensor in inputs))
        return [tf.convert_to_tensor(array) for array in arrays]
    results = tf.numpy_function(function, inputs, dtypes, stateful=False)
    for result in results:
        result.set_shape([None])
    return list(results)


def host_kth_largest(keys: tf.Tensor, k: Any) -> tf.Tensor:
    """The ``k``-th largest of the integer ``keys`` by ``np.partition`` (through
    :func:`on_host`): 16M floats at P = 2, each owner's cap and the next threshold
    pick among about 170K keys, which ``NthElement`` took 2.2-2.9 ms for in the step."""
    (kth,) = on_host(_kth_largest, [keys, tf.cast(k, tf.int64)], [keys.dtype])
    return tf.reshape(kth, [])


def _kth_largest(keys: np.ndarray, k: np.ndarray) -> tuple[np.ndarray]:
    return (numpy_kth_largest(keys, int(k)).reshape(1),)


def update_cells_on_host(
    update: Callable[[Any, Sequence[Any], Sequence[Any]], Any],
    cells: Sequence[VariableCell],
    inputs: Sequence[Any],
    unread: Sequence[VariableCell] = (),
    returns: Sequence[Any] = (),
) -> tuple[bool, Any]:
    """``Backend.update_cells`` as one host call, where the NumPy kernels serve every
    float input (:func:`host_pass_fits`): ``(True, the update's 1-D results or None)``;
    ``(False, None)``, having done nothing, where they do not. Eagerly on the values; in
    a trace one ``tf.numpy_function`` between the cells' reads and their assigns."""
    floats = [x for x in inputs if tf.is_tensor(x) and x.dtype.is_floating]
    if not host_kernels() or not all(host_pass_fits(x) for x in floats):
        return False, None
    places = [place for place, x in enumerate(inputs) if tf.is_tensor(x)]
    written = [*cells, *unread]
    dtypes = [tf.as_dtype(cell.variable.dtype) for cell in written]  # Keras: a name
    result_dtypes = [tf.int64 if isinstance(kind, str) else kind.dtype for kind in returns]

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        held = [HostCell(value) for value in arrays[: len(cells)]]
        held += [HostCell(None) for _ in unread]
        given = list(inputs)  # host values as they are, tensors as their arrays
        for place, array in zip(places, arrays[len(cells) :]):
            given[place] = array
        made = update(HOST_SCALARS, held, given)
        states = [np.asarray(cell.get(), dtype.as_numpy_dtype) for cell, dtype in zip(held, dtypes)]
        outputs = [np.asarray(x, d.as_numpy_dtype) for x, d in zip(made or (), result_dtypes)]
        return states + outputs

    values = [cell.get() for cell in cells] + [inputs[place] for place in places]
    if tf.executing_eagerly():
        results: list[Any] = call(*(np.asarray(value) for value in values))
        made = [tf.convert_to_tensor(array) for array in results[len(written) :]]
    else:
        results = tf.numpy_function(call, values, dtypes + result_dtypes, stateful=False)
        made = list(results[len(written) :])
        for result in results[: len(written)]:
            result.set_shape([])
        for result in made:
            result.set_shape([None])
    for cell, result in zip(written, results):
        cell.set(result)
    return True, (tuple(made) if returns else None)


def split_by_mask(mask: tf.Tensor, *tensors: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """``Backend.split_by_mask``: one partition a tensor, not two boolean masks (an
    index and a value tensor of 336K rows, CPU, one thread: 1.6 against 8.6 ms eagerly,
    0.9 against 2.3-3.0 traced)."""
    partitions = tf.cast(mask, tf.int32)
    parts = [tf.dynamic_partition(t, partitions, 2) for t in tensors]
    return [part[1] for part in parts], [part[0] for part in parts]


def top_k_mask(magnitudes: tf.Tensor, k: Any) -> tf.Tensor:
    """Exactly the k largest ``magnitudes`` (ties by lower position, NaN counted as the
    largest, as ``torch.topk`` counts it), as a mask, so the positions stay ascending.

    One selection (``NthElement``, std::nth_element) and three passes: on 16M floats
    with k of 1% it takes a fraction of ``tf.math.top_k``'s time (its k-heap and the
    sort of its indices); on 235k candidates, 5.1 ms against 23.1 ms (CPU, one thread).
    """
    magnitudes = tf.where(tf.math.is_nan(magnitudes), tf.cast(np.inf, magnitudes.dtype), magnitudes)
    kth = tf.raw_ops.NthElement(input=magnitudes, n=tf.cast(k - 1, tf.int32), reverse=True)
    above = magnitudes > kth
    at = tf.equal(magnitudes, kth)
    room = k - tf.reduce_sum(tf.cast(above, tf.int64))
    return above | (at & (tf.cumsum(tf.cast(at, tf.int64)) <= room))


_HISTOGRAM_BINS = 256


def digit_histogram(keys: tf.Tensor, prefix: tf.Tensor, shift: int) -> tf.Tensor:
    """``Backend.digit_histogram``: the keys still in the running by their digit at
    ``shift``."""
    digit = tf.bitwise.bitwise_and(tf.bitwise.right_shift(keys, shift), _HISTOGRAM_BINS - 1)
    if shift + 8 < 32:
        high = shift + 8
        active = tf.equal(tf.bitwise.right_shift(keys, high), tf.bitwise.right_shift(prefix, high))
        digit = tf.where(active, digit, _HISTOGRAM_BINS)  # bin 256: not in the running
    counts = tf.math.unsorted_segment_sum(tf.ones_like(digit), digit, _HISTOGRAM_BINS + 1)
    return counts[:_HISTOGRAM_BINS]


def choose_digit(
    histogram: tf.Tensor, remaining: tf.Tensor, prefix: tf.Tensor, shift: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """``Backend.choose_digit``: the digit at ``shift`` of the key ``remaining`` keys down."""
    counts = tf.cast(histogram, tf.int64)
    at_least = tf.cumsum(counts, reverse=True)  # #digits >= d
    digit = tf.maximum(tf.reduce_sum(tf.cast(at_least >= remaining, tf.int64)) - 1, 0)
    greater = tf.gather(at_least, digit) - tf.gather(counts, digit)
    new_prefix = tf.bitwise.bitwise_or(
        prefix, tf.bitwise.left_shift(tf.cast(digit, tf.int32), shift)
    )
    return new_prefix, remaining - greater


def extrapolate_key(lowest: tf.Tensor, middle: tf.Tensor, count: Any, k: Any) -> tf.Tensor:
    """``Backend.extrapolate_key``: the count doubles every ``middle - lowest`` keys down."""
    ratio = tf.cast(k, tf.float64) / tf.cast(count, tf.float64)
    below = tf.cast(middle - lowest, tf.float64) * (tf.math.log(ratio) / math.log(2.0))
    return tf.cast(tf.round(tf.maximum(tf.cast(lowest, tf.float64) - below, 0.0)), tf.int32)


def shifted_key(key: tf.Tensor, offset: tf.Tensor, low: int, high: int) -> tf.Tensor:
    """``Backend.shifted_key``: ``key + offset`` in int64, clamped, in ``key``'s dtype."""
    total = tf.cast(key, tf.int64) + tf.cast(offset, tf.int64)
    return tf.cast(tf.clip_by_value(total, low, high), key.dtype)


def scheduled_budget(numel: int, config: SparseConfig, step: Any) -> Any:
    """``budget(numel, config.density_at(step))`` for a step count that may be a graph
    value: a host int when the density does not depend on the step, else an int64
    scalar computed in the graph (n during warm-up).

    The budgets of the decay (``density_decay_steps`` + 1 of them: the last is the
    target density's) are computed on the host by the one rule, ``density_at``, and
    looked up by the step, so the graph's k is the host's exactly: no float power in
    the graph whose last bit could move a ceil. The cost is a constant of that many
    int64 per bucket.
    """
    warmup, decay = config.warmup_steps, config.density_decay_steps
    if not (warmup or decay):
        return budget(numel, config.density)
    table = [budget(numel, config.density_at(warmup + i)) for i in range(decay + 1)]
    step = tf.cast(step, tf.int64)
    k = tf.gather(tf.constant(table, tf.int64), tf.clip_by_value(step - warmup, 0, decay))
    return tf.where(step < warmup, tf.constant(numel, tf.int64), k) if warmup else k


class VariableCell:
    """A :class:`~horovod_sparse.common.backend.Cell` in a ``tf.Variable``."""

    def __init__(self, variable: tf.Variable) -> None:
        self.variable = variable

    def get(self) -> tf.Tensor:
        return tf.convert_to_tensor(self.variable)

    def set(self, value: Any) -> None:
        self.variable.assign(tf.cast(value, self.variable.dtype))


def owner_major(sends: list[tuple[tf.Tensor, tf.Tensor]]) -> tuple[tf.Tensor, tf.Tensor]:
    """Several alltoall sends as one, owner by owner (``Backend.owner_major``)."""
    owners = int(sends[0][1].shape[0])
    pieces = [tf.split(rows, splits, num=owners) for rows, splits in sends]
    joined = [piece[owner] for owner in range(owners) for piece in pieces]
    return tf.concat(joined, axis=0), tf.add_n([splits for _, splits in sends])


def bucket_gather(values: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """``values[indices]`` from a bucket. Where the NumPy kernels serve (see
    :func:`host_kernels`), ``np.take``: 2.5-4x faster than TF's gather (168K
    ascending indices into 16M floats just written, one thread: 1.3 against 5.1 ms
    eagerly; traced, 1.2 against 3.0-3.6 ms). Elsewhere ``tf.gather`` with int32
    indices where they fit, 3x faster eagerly than int64 (1.0 against 3.1 ms)."""
    if host_pass_fits(values):
        return on_host(_take, [values, indices], [values.dtype])[0]
    numel = values.shape[0]
    if numel is not None and numel < 2**31:
        indices = tf.cast(indices, tf.int32)
    return tf.gather(values, indices)


def _take(values: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray]:
    return (np.take(values, indices),)


# TF uses a NumPy result's memory as it is when it is this aligned, and copies it if not.
_TF_ALIGNMENT = 64


def scatter_on_host(numel: int, indices: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """Zeros of length ``numel`` with ``values`` at ``indices``, written by NumPy into
    memory TF uses without a copy. TF faults a fresh output in 4 KiB pages, and
    ``SparseToDense`` takes 60-75 ms for 16M floats with 170K entries (one thread, a
    virtual machine); NumPy backs 4 MiB or more with huge pages: 11-17 ms. A trace's
    ``tf.numpy_function`` shares an aligned result, and eagerly DLPack does
    (``tf.convert_to_tensor`` copies: 85-95 ms)."""
    if tf.executing_eagerly():
        array = _scattered(numel, np.asarray(indices), np.asarray(values))
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())

    def scatter(positions: np.ndarray, entries: np.ndarray) -> np.ndarray:
        return _scattered(numel, positions, entries)

    result = tf.numpy_function(scatter, [indices, values], values.dtype, stateful=False)
    result.set_shape([numel])
    return result


def _scattered(numel: int, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    spare = _TF_ALIGNMENT // values.itemsize
    memory = np.zeros(numel + spare, values.dtype)  # untouched pages stay zero: no fill
    start = (-memory.ctypes.data % _TF_ALIGNMENT) // values.itemsize
    array = memory[start : start + numel]
    array[indices] = values
    return array


def zero_then_add(
    buffer: tf.Tensor,
    zeroed: tf.Tensor,
    held: tf.Tensor,
    adds: list[tuple[tf.Tensor, tf.Tensor]],
    zero_at: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
    add_at: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor],
) -> tf.Tensor:
    """``Backend.zero_then_add`` in one pass over the buffer: one ``SparseAdd`` of the
    negated ``held`` at ``zeroed`` (``x + -x`` is exactly 0), then of ``adds``, in that
    order (16M floats, 84K zeroed and 40K added, one thread: 12.4 against 19.6 ms for
    a select and an add, of which 7.8 ms is the step around them). An infinite or NaN
    entry does not cancel: then ``zero_at`` and ``add_at`` in turn. A residual kept in
    its variable is written in place instead (:mod:`.residual_variable`)."""
    if residual_variable.kept(buffer):
        return residual_variable.zero_then_add(buffer, zeroed, held, adds)
    taken = tf.cast(held, buffer.dtype)
    positions = tf.concat([zeroed] + [tf.cast(i, tf.int64) for i, _ in adds], 0)
    values = tf.concat([-taken] + [tf.cast(v, buffer.dtype) for _, v in adds], 0)
    entries = tf.SparseTensor(tf.reshape(positions, [-1, 1]), values, tf.shape(buffer, tf.int64))

    def in_turn() -> tf.Tensor:
        result = zero_at(buffer, zeroed)
        for indices, added in adds:
            result = add_at(result, indices, added)
        return result

    finite = tf.reduce_all(tf.math.is_finite(taken))
    return tf.cond(finite, lambda: tf.sparse.add(buffer, entries), in_turn)


def cut_at(
    indices: tf.Tensor, values: tf.Tensor, edges: Any, ordered: bool
) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """Entries per part ``[edges[p], edges[p+1])``, ascending (``Backend.cut_at``);
    ``edges``: host ints, or an int64 tensor of them (a partition's boundaries)."""
    if not ordered:
        order = tf.argsort(indices)
        indices, values = tf.gather(indices, order), tf.gather(values, order)
    edges = tf.cast(edges, tf.int64)
    positions = tf.searchsorted(indices, edges, out_type=tf.int32)
    sizes = positions[1:] - positions[:-1]
    parts = int(edges.shape[0]) - 1
    cut = zip(tf.split(indices, sizes, num=parts), tf.split(values, sizes, num=parts))
    return [(part - edges[p], part_values) for p, (part, part_values) in enumerate(cut)]
