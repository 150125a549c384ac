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
this package imports Horovod only when one of its Horovod names is first used, which
raises the ImportError that says what to run if Horovod is missing.
"""

# ruff: noqa: E402  (the check below runs before anything else)

import importlib
from typing import TYPE_CHECKING, Any

from horovod_sparse.requirements import require_framework, require_horovod

require_framework("torch")  # a clear error when PyTorch itself is missing

from horovod_sparse.common.stats import StepStats
from horovod_sparse.torch.gathered import GatheredState

if TYPE_CHECKING:
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

# The names that need Horovod, and their modules: imported on first use, so that the
# DDP hook (horovod_sparse.torch.ddp) imports no Horovod, installed or not.
_HOROVOD_NAMES = {
    "DistributedOptimizer": "optimizer",
    "SparseOptimizerMixin": "optimizer",
    "SparseHandle": "functions",
    "reset_residuals": "functions",
    "residual": "functions",
    "sparse_allreduce": "functions",
    "sparse_allreduce_async": "functions",
    "stats": "functions",
    "synchronize": "functions",
}

__all__ = [  # StepStats, GatheredState and _HOROVOD_NAMES (a unit test checks they agree)
    "DistributedOptimizer",
    "GatheredState",
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
    module = _HOROVOD_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_horovod("torch")  # the ImportError that says what is missing and what to run
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later uses find it without this function
    return value
