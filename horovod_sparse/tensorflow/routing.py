"""Horovod's TF contract around the buckets: which gradients skip them, and how.

``hvd.DistributedGradientTape`` and Horovod's Keras optimizer treat three kinds of
gradient outside their allreduce; the tape and the Keras optimizer here do the same:

- **A rank outside the process set** gets every gradient back as computed: Horovod's
  ``_allreduce_cond`` takes its identity branch there, so no collective runs and
  nothing is raised.
- **Local sources** (``register_local_source``, ``register_local_var``) are never
  reduced. Their gradients are divided by the process set's size unless
  ``scale_local_gradients=False`` (Horovod's pull/3695). They take no part in any
  bucket: no budget, no residual.
- **IndexedSlices** (an ``Embedding``'s gradient) without ``sparse_as_dense`` are
  exchanged as ``hvd.allreduce`` exchanges them: one allgather of the values and one of
  the indices within the process set, the values divided by its size under
  ``hvd.Average``. Only the rows a rank touched travel, at every density.

Everything else goes through the buckets (:class:`~horovod_sparse.tensorflow.reducer.
GradientReducer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

__all__ = ["gather_slices", "is_slices", "scale_local", "source_keys"]


def source_keys(source: Any) -> set[int]:
    """The identities a registered source is matched by: itself and, for a Keras 3
    variable, the ``tf.Variable`` it holds (Horovod's tape is passed either)."""
    keys = {id(source)}
    if isinstance(source, keras.Variable):
        keys.add(id(source.value))
    return keys


def is_slices(grad: Any, sparse_as_dense: bool) -> bool:
    """Whether ``grad`` is exchanged by :func:`gather_slices` rather than in a bucket."""
    return isinstance(grad, tf.IndexedSlices) and not sparse_as_dense


def scale_local(grads: Sequence[Any], size: int, scale: bool) -> list[Any]:
    """Local gradients as Horovod returns them: divided by ``size`` when ``scale``."""
    if not scale:
        return list(grads)
    out: list[Any] = []
    for grad in grads:
        if grad is None:
            out.append(None)
        elif isinstance(grad, tf.IndexedSlices):
            out.append(tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape))
        else:
            out.append(grad / size)
    return out


def gather_slices(
    grad: tf.IndexedSlices, op: Any, gradient_predivide_factor: float, process_set: Any, name: str
) -> tf.IndexedSlices:
    """``hvd.allreduce`` of an ``IndexedSlices``: the values and the indices allgathered
    within ``process_set``, the values divided by its size under ``hvd.Average``.

    Raises NotImplementedError where Horovod does: another op, or a
    ``gradient_predivide_factor`` (pre/postscale factors) other than 1.
    """
    if op not in (hvd.Average, hvd.Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if op == hvd.Average and float(gradient_predivide_factor) != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = hvd.allgather(grad.values, name=f"{name}.values", process_set=process_set)
    indices = hvd.allgather(grad.indices, name=f"{name}.indices", process_set=process_set)
    if op == hvd.Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=grad.dense_shape)
