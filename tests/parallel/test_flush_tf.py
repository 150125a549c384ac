"""The Keras optimizer's ``flush_residuals()``: every rank's pending update reaches the
variables with one allreduce, the residuals are zeroed and the ranks agree; plain SGD
with chosen gradients then lands where dense SGD does."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow.keras as hvds_keras

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
NUMEL, LR = 20_000, 0.1


def gradient(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(NUMEL).astype(np.float32)


def train(optimizer, variable: tf.Variable, steps: int) -> None:
    for step in range(steps):
        optimizer.apply_gradients([(tf.constant(gradient(step, RANK)), variable)])


def identical_on_every_rank(values: np.ndarray, name: str) -> None:
    rows = hvd.allgather(tf.reshape(values, [1, -1]), name=name).numpy()
    for row in rows:
        np.testing.assert_array_equal(row, values.reshape(-1))


def test_plain_sgd_lands_where_dense_sgd_does():
    """The dense reference: v0 - lr * the sum over steps of the ranks' mean gradient."""
    steps = 6
    variable = tf.Variable(tf.zeros(NUMEL), name="flush_sgd")
    optimizer = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(LR), density=0.02)
    train(optimizer, variable, steps)
    dense = np.zeros(NUMEL)
    for step in range(steps):
        dense -= LR * sum(gradient(step, r).astype(np.float64) for r in range(SIZE)) / SIZE
    assert np.abs(variable.numpy() - dense).max() > 0.1  # owed before the flush
    assert optimizer.flush_residuals() == NUMEL
    np.testing.assert_allclose(variable.numpy(), dense, rtol=0, atol=1e-5)
    for residual in optimizer.residual_variables().values():
        assert not np.any(residual.numpy())
    identical_on_every_rank(variable.numpy(), "flush.tf.sgd")
    train(optimizer, variable, 2)  # training goes on from the flushed variable
    identical_on_every_rank(variable.numpy(), "flush.tf.sgd.after")


@pytest.mark.parametrize(
    "make",
    [lambda: keras.optimizers.SGD(LR, momentum=0.9), lambda: keras.optimizers.Adam(1e-2)],
    ids=["sgd_momentum", "adam"],
)
def test_corrected_steps_move_by_every_ranks_residual(make):
    variable = tf.Variable(tf.zeros(NUMEL), name="flush_corrected")
    optimizer = hvds_keras.DistributedOptimizer(make(), density=0.02)
    train(optimizer, variable, 5)
    (residual,) = optimizer.residual_variables().values()
    rows = hvd.allgather(tf.reshape(residual, [1, -1]), name="flush.tf.res").numpy()
    assert np.abs(rows).sum() > 0
    before = variable.numpy().astype(np.float64)
    lr = float(optimizer.learning_rate)
    optimizer.flush_residuals()
    expected = before - lr * rows.astype(np.float64).sum(0) / SIZE  # postscale: the average
    np.testing.assert_allclose(variable.numpy(), expected, rtol=0, atol=1e-6)
    assert not np.any(residual.numpy())
    identical_on_every_rank(variable.numpy(), "flush.tf.corrected")


def test_a_step_that_is_not_linear_is_refused_before_any_collective():
    variable = tf.Variable(tf.zeros(NUMEL), name="flush_refused")
    optimizer = hvds_keras.DistributedOptimizer(
        keras.optimizers.Adam(1e-2), density=0.02, momentum_correction=False
    )
    train(optimizer, variable, 2)
    before = variable.numpy()
    with pytest.raises(ValueError, match="flush_residuals"):
        optimizer.flush_residuals()
    np.testing.assert_array_equal(variable.numpy(), before)
    train(optimizer, variable, 1)  # every rank refused alike: the ranks still step together
    identical_on_every_rank(variable.numpy(), "flush.tf.refused")
