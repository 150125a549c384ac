"""Keras 3 integration: ``horovod_sparse.tensorflow.keras.DistributedOptimizer``."""

from horovod_sparse.tensorflow.keras.gathered import GatheredState
from horovod_sparse.tensorflow.keras.optimizer import DistributedOptimizer, SparseOptimizerMixin

__all__ = ["DistributedOptimizer", "GatheredState", "SparseOptimizerMixin"]
