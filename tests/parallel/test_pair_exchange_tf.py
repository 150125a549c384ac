"""TensorFlow's steps at P = 2 in one all-gather (common/pair_stages.py): the results
and residuals of the reduce-scatter and all-gather bit for bit, eagerly and traced,
through ``sparse_allreduce`` and the tape's joined buckets. At other world sizes
``gather_selections`` changes nothing."""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from tests.parallel.test_joined_exchange_tf import assert_same_either_way

hvd.init()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("options", [{}, {"partition": "balanced", "repartition_steps": 3}])
def test_sparse_allreduce_is_the_same_in_one_collective(traced, options):
    rng = np.random.default_rng(5 + hvd.rank())
    tag = f"pair.tf.{traced}.{len(options)}"

    def setting(gather):
        def call(grad):
            return hvds.sparse_allreduce(
                grad, 0.01, name=f"{tag}.{gather}", gather_selections=gather, **options
            )

        return tf.function(call) if traced else call  # one trace each: its own variables

    ours_of, theirs_of = setting(True), setting(False)
    refreshes = []
    for step in range(12):
        # Growing for a while, then fresh: capped reused steps and refreshes both run.
        scale = 1.0 + 0.3 * (step % 5)
        grad = tf.constant(rng.standard_normal(40_000).astype(np.float32) * scale)
        ours, theirs = ours_of(grad), theirs_of(grad)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=f"step {step}")
        refreshes.append(hvds.stats(f"{tag}.True").global_refreshes)
    assert 0 < sum(refreshes) < len(refreshes), refreshes  # reused steps and refreshes
    residuals = hvds.residual_variables()
    np.testing.assert_array_equal(
        residuals[f"{tag}.True"].numpy(), residuals[f"{tag}.False"].numpy()
    )


def test_tape_with_joined_buckets_is_the_same_in_one_collective():
    assert_same_either_way("gather_selections")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_the_pair_all_gather_has_one_shape_and_counts_its_padding(traced, monkeypatch):
    """At P = 2 each rank's rows are padded to the most the selection returns
    (floor(1.25 k)), so Horovod's all-gather sees one shape on every step, reused or
    refreshed; the padding never reaches the sums (the results equal the two-collective
    step's bit for bit, and the residual conserves the mass) and its bytes are counted.
    At other world sizes no such all-gather runs, and the rest still holds."""
    pairs = hvd.size() == 2  # elsewhere no all-gather of both selections runs
    numel, density = 40_000, 0.01
    capacity = int(1.25 * math.ceil(density * numel))  # 500 rows
    shapes = []
    allgather = hvd.allgather

    def recording(tensor, *args, **kwargs):
        if kwargs.get("name", "").endswith(".selected"):
            if tf.executing_eagerly():
                shapes.append(int(tensor.shape[0]))
            else:  # each run of the traced step (sparse_allreduce traces its step)
                tf.py_function(lambda rows: shapes.append(int(rows)), [tf.shape(tensor)[0]], [])
        return allgather(tensor, *args, **kwargs)

    monkeypatch.setattr(hvd, "allgather", recording)
    tag = f"pair.padded.{traced}"
    rng = np.random.default_rng(11 + hvd.rank())

    def setting(gather):
        def call(grad):
            return hvds.sparse_allreduce(
                grad, density, name=f"{tag}.{gather}", gather_selections=gather
            )

        return tf.function(call) if traced else call

    ours_of, theirs_of = setting(True), setting(False)
    refreshes = []
    for step in range(10):
        scale = 1.0 + 0.3 * (step % 5)
        grad = tf.constant(rng.standard_normal(numel).astype(np.float32) * scale)
        before = hvds.residual_variables()[f"{tag}.True"].numpy().copy() if step else 0.0
        ours, theirs = ours_of(grad), theirs_of(grad)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=f"step {step}")
        # Mass: what this rank held plus its gradient is what it still holds plus its
        # share of the sum, summed over the ranks (op=Average: the sum over P).
        after = hvds.residual_variables()[f"{tag}.True"].numpy()
        held = hvd.allreduce(tf.constant(np.sum(before + grad.numpy() - after)), op=hvd.Sum)
        np.testing.assert_allclose(
            held.numpy(), hvd.size() * np.sum(ours.numpy()), rtol=1e-4, atol=1e-3
        )
        stats = hvds.stats(f"{tag}.True")
        refreshes.append(stats.global_refreshes)
        if pairs and not stats.global_refreshes:  # a reused step: the all-gather's bytes
            assert stats.bytes_sent == stats.bytes_received == capacity * 8, stats
    if pairs:
        assert len(shapes) == 10 and set(shapes) == {capacity}, shapes
    else:
        assert shapes == [], shapes
    assert 0 < sum(refreshes) < len(refreshes), refreshes
