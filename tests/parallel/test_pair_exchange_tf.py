"""TensorFlow's steps at P = 2 in one all-gather (common/pair_stages.py): the results
and residuals of the reduce-scatter and all-gather bit for bit, eagerly and traced,
through ``sparse_allreduce`` and the tape's joined buckets. At other world sizes
``gather_selections`` changes nothing."""

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
