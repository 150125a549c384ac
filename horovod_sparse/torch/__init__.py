"""PyTorch adapter: sparse allreduce as a drop-in for ``horovod.torch``.

Example:
    >>> import horovod.torch as hvd
    >>> import horovod_sparse.torch as hvds
    >>> hvd.init()
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    >>> opt = hvds.DistributedOptimizer(
    ...     opt, named_parameters=model.named_parameters(), density=0.01
    ... )

The ``DistributedDataParallel`` hook, :mod:`horovod_sparse.torch.ddp`, needs no Horovod:
without it this package still imports, and the names below raise an ImportError that
says what to run when first used.
"""

# ruff: noqa: E402  (the checks below run before any import of Horovod)

from typing import Any

from horovod_sparse.requirements import horovod_error, require_framework

require_framework("torch")  # a clear error when PyTorch itself is missing
_HOROVOD_MISSING = horovod_error("torch")

from horovod_sparse.common.stats import StepStats

if _HOROVOD_MISSING is None:
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


def __getattr__(name: str) -> Any:
    # Reached only for names not defined above: without Horovod, its names.
    if name in __all__ and _HOROVOD_MISSING is not None:
        raise ImportError(str(_HOROVOD_MISSING)) from _HOROVOD_MISSING.__cause__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
