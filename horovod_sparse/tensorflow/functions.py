"""Functional sparse allreduce for TF users who manage tensors themselves.

Residuals are ``tf.Variable``s kept per ``(name, process set)``; :func:`residual_variables`
returns them for a ``tf.train.Checkpoint``.
"""

from __future__ import annotations

from typing import Any, Callable

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.options import Frontend
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.registry import NamedReducers, per_tensor_call
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.backend import BACKEND
from horovod_sparse.tensorflow.buckets import (
    BucketSet,
    BucketState,
    make_counts_variable,
    zeros_variable,
)
from horovod_sparse.tensorflow.correction import Corrected
from horovod_sparse.tensorflow.reducer import op_name

__all__ = ["reset_residuals", "residual_variables", "sparse_allreduce", "stats"]


# The traces an eager call keeps under one name; calls with other scales or compression
# beyond them run op by op.
MOST_TRACES = 4


def _reducer_of(buckets: BucketSet) -> BucketReducer:
    reducer = buckets.states[0].reducer
    assert isinstance(reducer, BucketReducer)  # one tensor: always a sparse reducer
    return reducer


_STATES: NamedReducers[BucketSet] = NamedReducers(_reducer_of)


def _state_for(
    name: str, numel: int, dtype: tf.DType, config: SparseConfig, process_set: Any, compression: Any
) -> BucketSet:
    def create(previous: BucketSet | None) -> BucketSet:
        like = tf.zeros([0], dtype)
        reducer = BucketReducer(
            BACKEND, f"hvds.tf.{name}", numel, like, config, process_set, compression
        )
        residual = (
            previous.states[0].residual
            if previous
            else zeros_variable("residual", numel, dtype, name)
        )
        return BucketSet([name], [BucketState(reducer, residual, make_counts_variable())], None)

    buckets = _STATES.obtain(name, process_set, numel, config, create)
    _reducer_of(buckets).compression = compression
    return buckets


@tf.autograph.experimental.do_not_convert
def sparse_allreduce(
    tensor: tf.Tensor,
    density: float = 0.01,
    name: str | None = None,
    *,
    compression: Any = hvd.Compression.none,
    op: Any = hvd.Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = hvd.global_process_set,
    **options: Any,
) -> tf.Tensor:
    """Sparse allreduce of ``tensor`` with error feedback, eagerly or inside ``tf.function``.

    Sends one alltoall of about k(P-1)/P rows (8 bytes each for fp32, k = ceil(density*n)),
    four 1 KiB histogram allreduces and one allgather of about k(P-1)/P rows in.
    Keeps the unselected mass in the ``tf.Variable`` residual stored under ``name``.
    Called eagerly, the step runs as a ``tf.function`` traced at the first call under
    ``name`` (one trace per prescale, postscale and compression, up to four).
    ``options``: ``selection``, ``partition``, ``reestimate_steps``,
    ``repartition_steps``, ``warmup_steps``, ``density_decay_steps`` (k follows the
    step count, inside one trace too), ``error_feedback``, ``global_selection``,
    ``refresh_steps`` (see :class:`~horovod_sparse.common.config.SparseConfig`).

    Example:
        >>> out = sparse_allreduce(grad, density=0.01, name="w")
        >>> stats("w").bytes_sent
    """
    # Horovod's keywords, in the order of horovod.tensorflow.allreduce.
    scales = (prescale_factor, postscale_factor)
    call = per_tensor_call(name, density, options, Frontend.TF_ALLREDUCE)
    name, config, prescale, postscale = call.scaled(op_name(op), process_set, *scales)
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(
            f"sparse_allreduce({name!r}) takes a dense tensor; use tf.convert_to_tensor"
        )
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        raise TypeError(
            f"sparse_allreduce({name!r}) needs a floating-point tensor, got {tensor.dtype.name}"
        )
    if tensor.shape.num_elements() is None:
        raise ValueError(f"sparse_allreduce({name!r}) needs a statically known tensor size")
    numel = int(tensor.shape.num_elements())
    buckets = _state_for(name, numel, tensor.dtype, config, process_set, compression)
    flat = tf.reshape(tensor, [-1])
    if tf.executing_eagerly():
        result = _traced_step(buckets, prescale, postscale, compression)(flat)
    else:
        result = _step(buckets, prescale, postscale, flat)
    return tf.reshape(result, tf.shape(tensor))


def _step(buckets: BucketSet, prescale: float, postscale: float, flat: tf.Tensor) -> tf.Tensor:
    buckets.engine.prescale, buckets.engine.postscale = prescale, postscale
    (result,) = buckets.exchange([Corrected(flat, None, [])])
    return result


def _traced_step(
    buckets: BucketSet, prescale: float, postscale: float, compression: Any
) -> Callable[[tf.Tensor], tf.Tensor]:
    """The step of ``buckets`` as one ``tf.function``, traced at its first eager call
    with these scales and compression (host values the trace keeps), as Horovod runs
    its tape's eager allreduces: eagerly, each of the step's few hundred ops is
    dispatched from Python, one at a time."""
    key = (prescale, postscale, compression)
    if key not in buckets.traced:
        if len(buckets.traced) >= MOST_TRACES:
            # Scales that change from call to call (a schedule) would trace every call.
            return lambda flat: _step(buckets, prescale, postscale, flat)
        spec = tf.TensorSpec([_reducer_of(buckets).numel], buckets.states[0].residual.dtype)

        @tf.function(input_signature=[spec], autograph=False)
        def step(flat: tf.Tensor) -> tf.Tensor:
            return _step(buckets, prescale, postscale, flat)

        buckets.traced[key] = step
    traced: Callable[[tf.Tensor], tf.Tensor] = buckets.traced[key]
    return traced


def stats(name: str, process_set: Any = hvd.global_process_set) -> StepStats:
    """Statistics of the last :func:`sparse_allreduce` under ``name`` (call eagerly)."""
    return _STATES.find(name, process_set).stats()


def residual_variables(process_set: Any = hvd.global_process_set) -> dict[str, tf.Variable]:
    """Residual variable per name, e.g. ``tf.train.Checkpoint(**residual_variables())``."""
    return {name: buckets.states[0].residual for name, buckets in _STATES.items(process_set)}


def reset_residuals() -> None:
    """Forget every residual kept by the functional API."""
    _STATES.clear()
