"""Framework-free core of horovod_sparse.

Everything here is plain Python: the algorithm's decisions (bucket plan, budget k,
partition boundaries, the global-threshold rule, volume accounting) and the stage
orchestration, written once against the small tensor-primitive interface of
:class:`~horovod_sparse.common.backend.Backend`. The ``torch`` and ``tensorflow``
packages only implement that interface.
"""

from horovod_sparse.common.buckets import Bucket, BucketEntry, BucketPlan, plan_buckets
from horovod_sparse.common.config import SparseConfig, budget
from horovod_sparse.common.partition import Partitioner, UniformPartition
from horovod_sparse.common.stats import StepStats

__all__ = [
    "Bucket",
    "BucketEntry",
    "BucketPlan",
    "Partitioner",
    "SparseConfig",
    "StepStats",
    "UniformPartition",
    "budget",
    "plan_buckets",
]
