"""``flush_residuals()`` of the Keras optimizer: every rank's pending update reaches the
variables at once (:mod:`horovod_sparse.common.flush`; the PyTorch optimizer's is
:mod:`horovod_sparse.torch.flush`).

Call it eagerly on every rank after training (after ``model.fit`` returns, or in a
callback's ``on_train_end``), before the model is evaluated or saved for keeps.

Sends: one ring allreduce of the sparse buckets' residuals. Keeps: nothing.
"""

from __future__ import annotations

from typing import Any

import keras

from horovod_sparse.common.config import SparseConfig
from horovod_sparse.tensorflow.reducer import AdamSettings, GradientReducer

__all__ = ["KerasFlush"]


class KerasFlush:
    """``flush_residuals`` of :class:`~horovod_sparse.tensorflow.keras.SparseOptimizerMixin`."""

    _gradient_reducer: GradientReducer | None = None
    sparse_config: SparseConfig | None
    _adam_correction: AdamSettings | None
    _local_indices: set[int]
    _trainable_variables: list[Any]
    learning_rate: Any
    momentum: float

    def flush_residuals(self) -> int:
        """Sum every rank's residual with one allreduce, move each variable of a sparse
        bucket by the update it stands for (``-learning_rate * average``) and zero the
        residuals. Returns the number of values summed (0 outside the process set,
        before the optimizer is built, or without error feedback: nothing waits).

        Raises:
            ValueError: on every rank, before any collective, where the step is not
                linear in the exchanged tensor (SGD with momentum, or Adam, without
                momentum correction; other optimizers): the residual's update is then
                unknown.
        """
        reducer, config = self._gradient_reducer, self.sparse_config
        if reducer is None or config is None or not config.error_feedback:
            return 0
        plain_sgd = isinstance(self, keras.optimizers.SGD) and float(self.momentum) == 0.0
        if not plain_sgd and self._adam_correction is None:
            raise ValueError(
                "flush_residuals() needs a step that is linear in the averaged gradient: "
                "keras.optimizers.SGD without momentum, or momentum correction (SGD with "
                f"momentum, Adam, AdamW); got {type(self).__name__} without it"
            )
        variables = self._trainable_variables
        shared = [v for i, v in enumerate(variables) if i not in self._local_indices]
        return reducer.flush_residuals(shared, self.learning_rate)
