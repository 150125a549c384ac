"""The TF tape's step plan shares the joined exchange (common/joined.py): one alltoall
and one allgather for 16 sparse buckets, eager and in a tf.function, the same results
as one exchange per bucket, no mass lost."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from tests.parallel.test_tensorflow import (  # noqa: F401
    COLLECTIVES,
    assert_identical,
    assert_mass_kept,
    by_bucket,
    collective_counts,
    residuals_by_bucket,
    tape_reducer,
)

hvd.init()

SHAPES = [(128, 128)] * 16 + [(128,)]  # 16 sparse buckets and a small dense one
BUCKET_BYTES = 128 * 128 * 4


def grads_of(step: int) -> list[tf.Tensor]:
    rng = np.random.default_rng(7 * step + 1000 * hvd.rank())
    return [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in SHAPES]


def tape_step(name: str, graph: bool, join: bool):
    """A tape step whose gradients are the given tensors exactly (d/ds sum(s * g) = g)."""
    sources = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]

    def step(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(s * g) for s, g in zip(sources, grads)])
        dtape = hvds.DistributedGradientTape(
            tape, name=name, density=0.01, fusion_threshold_bytes=BUCKET_BYTES, join_buckets=join
        )
        return dtape.gradient(loss, sources)

    return tf.function(step) if graph else step


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_a_reused_step_of_16_buckets_is_one_alltoall_and_one_allgather(
    graph,
    collective_counts,  # noqa: F811
):
    name = f"joined.count.{graph}"
    step_fn = tape_step(name, graph, join=True)
    before, reused, refreshed = None, 0, 0
    for step in range(24):
        grads = grads_of(step)
        start = {kind: int(count.numpy()) for kind, count in collective_counts.items()}
        out = step_fn(*grads)
        issued = {kind: int(c.numpy()) - start[kind] for kind, c in collective_counts.items()}
        reducer = tape_reducer(name)
        if before is None:
            assert len(by_bucket(reducer, grads)) == 16
            before = {
                bucket: np.zeros_like(flat) for bucket, flat in by_bucket(reducer, grads).items()
            }
        assert issued["alltoall_async"] == 1 and issued["allgather_async"] == 1, (step, issued)
        refreshes = reducer.stats().global_refreshes
        if refreshes == 0:
            reused += 1
            assert issued["allreduce_sum_async"] <= 1, (step, issued)  # the dense bucket
        else:
            refreshed += 1
            assert issued["allreduce_sum_async"] <= 1 + 4, (step, issued)
        before = assert_mass_kept(reducer, before, grads, out, f"{name}.{step}")
        assert_identical(out, f"{name}.{step}")
    # Both kinds of step were counted (any of 16 buckets refreshing makes a refresh step).
    assert reused >= 4 and refreshed >= 1, (reused, refreshed)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_joined_equals_one_exchange_per_bucket_bitwise(graph):
    outs = {}
    for join in (True, False):
        name = f"joined.same.{graph}.{join}"
        step_fn = tape_step(name, graph, join)
        outs[join] = [step_fn(*grads_of(step)) for step in range(12)]
        outs[join, "residuals"] = residuals_by_bucket(tape_reducer(name))
    for joined, alone in zip(outs[True], outs[False]):
        for a, b in zip(joined, alone):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    for bucket, residual in outs[True, "residuals"].items():
        np.testing.assert_array_equal(residual, outs[False, "residuals"][bucket])
