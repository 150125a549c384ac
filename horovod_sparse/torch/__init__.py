"""PyTorch adapter: sparse allreduce as a drop-in for ``horovod.torch``.

Example:
    >>> import horovod.torch as hvd
    >>> import horovod_sparse.torch as hvds
    >>> hvd.init()
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    >>> opt = hvds.DistributedOptimizer(
    ...     opt, named_parameters=model.named_parameters(), density=0.01
    ... )
"""

# ruff: noqa: E402  (the check below runs before any import of Horovod)

from horovod_sparse.requirements import require_horovod

require_horovod("torch")  # a clear error, before any module imports horovod.torch

from horovod_sparse.common.stats import StepStats
from horovod_sparse.torch.functions import (
    SparseHandle,
    reset_residuals,
    residual,
    sparse_allreduce,
    sparse_allreduce_async,
    stats,
    synchronize,
)
from horovod_sparse.torch.optimizer import DistributedOptimizer, SparseOptimizerMixin

__all__ = [
    "DistributedOptimizer",
    "SparseHandle",
    "SparseOptimizerMixin",
    "StepStats",
    "reset_residuals",
    "residual",
    "sparse_allreduce",
    "sparse_allreduce_async",
    "stats",
    "synchronize",
]
