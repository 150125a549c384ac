"""Pure stages of horovod_sparse.common: no framework, no Horovod."""

import math

import pytest

from horovod_sparse.common.buckets import INT32_INDEX_LIMIT, plan_buckets
from horovod_sparse.common.config import SparseConfig, budget, fusion_threshold_bytes
from horovod_sparse.common.partition import UniformPartition
from horovod_sparse.common.stats import (
    StepStats,
    allgather_ring_bytes,
    allreduce_ring_bytes,
    alltoall_bytes,
    settled_reuse,
)


def tensors(*sizes, dtype="float32"):
    return [(f"t{i}", n, dtype, 4) for i, n in enumerate(sizes)]


def test_plan_respects_capacity_and_order():
    plan = plan_buckets(tensors(10, 10, 10, 30, 5), capacity_bytes=80)
    assert [[e.name for e in b.entries] for b in plan.buckets] == [
        ["t0", "t1"],
        ["t2"],
        ["t3"],
        ["t4"],
    ]
    assert [b.numel for b in plan.buckets] == [20, 10, 30, 5]
    assert [e.offset for e in plan.buckets[0].entries] == [0, 10]


def test_plan_is_deterministic_and_splits_dtypes():
    ts = [*tensors(4, 4), ("h", 8, "float16", 2), ("t9", 4, "float32", 4)]
    a, b = plan_buckets(ts, 1 << 20), plan_buckets(list(ts), 1 << 20)
    assert a == b
    assert {bk.dtype for bk in a.buckets} == {"float32", "float16"}
    assert [e.name for e in a.buckets[0].entries] == ["t0", "t1", "t9"]


def test_plan_groups_become_buckets():
    plan = plan_buckets(tensors(4, 4, 4, 4), 1 << 20, groups=[["t3", "t0"]])
    assert [[e.name for e in b.entries] for b in plan.buckets] == [["t3", "t0"], ["t1", "t2"]]
    with pytest.raises(ValueError, match="more than one group"):
        plan_buckets(tensors(4, 4), 1 << 20, groups=[["t0"], ["t0"]])
    with pytest.raises(ValueError, match="not a parameter"):
        plan_buckets(tensors(4), 1 << 20, groups=[["nope"]])


def test_plan_refuses_tensor_beyond_int32_and_duplicate_names():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        plan_buckets([("huge", INT32_INDEX_LIMIT + 1, "float32", 4)], 1 << 20)
    with pytest.raises(ValueError, match="more than once"):
        plan_buckets([("a", 1, "float32", 4), ("a", 2, "float32", 4)], 1 << 20)


def test_plan_keeps_each_bucket_below_int32_elements():
    half = INT32_INDEX_LIMIT // 2 + 1
    plan = plan_buckets(tensors(half, half, dtype="int8"), capacity_bytes=1 << 62)
    assert len(plan.buckets) == 2


def test_fusion_threshold_follows_horovod_env(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    assert fusion_threshold_bytes() == 1048576
    assert fusion_threshold_bytes(4096) == 4096
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD")
    assert fusion_threshold_bytes() == 128 * 1024 * 1024


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_config_rejects_bad_density(density):
    with pytest.raises((ValueError, TypeError), match="density"):
        SparseConfig(density=density)


def test_budget():
    assert budget(1000, 0.01) == 10
    assert budget(1001, 0.01) == 11
    assert budget(5, 0.0001) == 1
    assert budget(5, 1.0) == 5


@pytest.mark.parametrize("n,p", [(10, 3), (7, 4), (1_000_003, 4), (2, 3)])
def test_uniform_partition_covers_index_space(n, p):
    b = UniformPartition().boundaries(n, p)
    assert len(b) == p + 1 and b[0] == 0 and b[-1] == n
    assert all(x <= y for x, y in zip(b, b[1:]))
    assert max(y - x for x, y in zip(b, b[1:])) - min(y - x for x, y in zip(b, b[1:])) <= 1


def test_volume_formulas():
    assert allreduce_ring_bytes(1000, 4, 4) == (6000, 6000)  # 2n(P-1)/P x 4 bytes each way
    sent, recv = allreduce_ring_bytes(1000, 2, 4)
    assert sent + recv == 4 * 1000 * (2 - 1) / 2 * 4
    assert alltoall_bytes([3, 5, 7], [1, 2, 4], rank=1, row_bytes=8) == ((3 + 7) * 8, (1 + 4) * 8)
    assert allgather_ring_bytes(total_rows=10, own_rows=3, next_rows=4, row_bytes=8) == (48, 56)


def test_stats_accumulate():
    total = StepStats()
    total += StepStats(10, 20, 300, numel=100, selected=1)
    total += StepStats(1, 2, 30, numel=100, selected=3)
    assert (total.bytes_sent, total.bytes_received, total.dense_bytes) == (11, 22, 330)
    assert math.isclose(total.density, 0.02)
    assert math.isclose(total.compression_ratio, 330 / 33)


def test_combined_class_is_a_cached_real_subclass():
    import pickle

    from horovod_sparse.common.classes import combined_class

    class Mixin:
        def hello(self):
            return "mixin+" + super().hello()

    cls = combined_class(Mixin, Base, __name__)
    assert cls is combined_class(Mixin, Base, __name__)
    assert cls.__name__ == "SparseBase" and issubclass(cls, Mixin) and issubclass(cls, Base)
    assert cls().hello() == "mixin+base"
    assert globals()["SparseBase"] is cls  # published, so pickle can find it
    assert type(pickle.loads(pickle.dumps(cls()))) is cls


class Base:
    def hello(self):
        return "base"


def test_settled_reuse_counts_only_the_steps_after_the_settled_ones():
    refreshed = [True, True, False, True, False, False]
    kept = [50, 10, 8, 12, 10, 10]
    summary = settled_reuse(refreshed, kept, k=10, settled=2)
    assert summary["refresh_fraction"] == 0.25  # 1 of the last 4 steps
    assert summary["kept_over_k"] == [0.8, 1.0, 1.2]
    assert summary["within_tenth_of_k"] == 0.5  # 10 and 10 of 8, 12, 10, 10
    assert settled_reuse(refreshed, kept, k=10, settled=6) == {}
