"""TensorFlow adapter: sparse allreduce as a drop-in for ``horovod.tensorflow``.

Example:
    >>> import horovod.tensorflow as hvd
    >>> import horovod_sparse.tensorflow as hvds
    >>> hvd.init()
    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvds.DistributedGradientTape(tape, density=0.01)
    >>> grads = tape.gradient(loss, model.trainable_variables)

The Keras 3 optimizer lives in :mod:`horovod_sparse.tensorflow.keras`.
"""

# ruff: noqa: E402  (the check below runs before any import of Horovod)

from horovod_sparse.requirements import require_horovod

require_horovod("tensorflow")  # a clear error, before any module imports horovod.tensorflow

from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.functions import (
    reset_residuals,
    residual_variables,
    sparse_allreduce,
    stats,
)
from horovod_sparse.tensorflow.tape import DistributedGradientTape

__all__ = [
    "DistributedGradientTape",
    "StepStats",
    "reset_residuals",
    "residual_variables",
    "sparse_allreduce",
    "stats",
]
