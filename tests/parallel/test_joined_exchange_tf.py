"""The TF tape's and Keras optimizer's step plan shares the joined exchange
(common/joined.py): one alltoall and one allgather for 16 sparse buckets (eagerly) and
for 3 under ``model.fit`` (traced), the same results as one exchange per bucket, no
mass lost."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.keras as hvds_keras
from tests.parallel.test_tensorflow import (  # noqa: F401
    COLLECTIVES,
    SCATTERS,
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
FEWER = SHAPES[:5] + SHAPES[-1:]  # 5 sparse buckets and the dense one


def grads_of(step: int, shapes=SHAPES) -> list[tf.Tensor]:
    rng = np.random.default_rng(7 * step + 1000 * hvd.rank())
    return [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]


def tape_step(name: str, shapes=SHAPES, **options):
    """A tape step whose gradients are the given tensors exactly (d/ds sum(s * g) = g)."""
    sources = [tf.Variable(tf.zeros(shape)) for shape in shapes]

    def step(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(s * g) for s, g in zip(sources, grads)])
        dtape = hvds.DistributedGradientTape(
            tape, name=name, density=0.01, fusion_threshold_bytes=BUCKET_BYTES, **options
        )
        return dtape.gradient(loss, sources)

    return step


def assert_same_either_way(option: str) -> None:
    """Eight tape steps of 5 sparse buckets with ``option`` on and off: the gradients
    and residuals bit for bit."""
    outs = {}
    for on in (True, False):
        name = f"same.{option}.{on}"
        step_fn = tape_step(name, FEWER, **{option: on})
        outs[on] = [step_fn(*grads_of(step, FEWER)) for step in range(8)]
        outs[on, "residuals"] = residuals_by_bucket(tape_reducer(name))
    for ours, theirs in zip(outs[True], outs[False]):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    for bucket, residual in outs[True, "residuals"].items():
        np.testing.assert_array_equal(residual, outs[False, "residuals"][bucket])


def mass_kept_in_all(reducer, before, grads, out, tag):
    """``assert_mass_kept`` over every bucket's entries at once (one allreduce a side)."""
    after = residuals_by_bucket(reducer)
    names = sorted(after)
    sent, result = by_bucket(reducer, grads), by_bucket(reducer, out)
    lhs = hvd.allreduce(np.concatenate([after[n] for n in names]), op=hvd.Sum, name=f"{tag}.l")
    lhs = lhs.numpy() + hvd.size() * np.concatenate([result[n] for n in names])
    owed = np.concatenate([before[n] + sent[n] for n in names])
    rhs = hvd.allreduce(owed, op=hvd.Sum, name=f"{tag}.r").numpy()
    np.testing.assert_allclose(lhs, rhs, rtol=0, atol=1e-4)
    return after


def test_a_reused_step_of_16_buckets_is_one_alltoall_and_one_allgather(
    collective_counts,  # noqa: F811
):
    """Eagerly: tracing 16 buckets' step costs 35 s a job. Traced steps count the same
    through the same plan at 3 buckets: ``test_keras_fit_joins_the_buckets_and_keeps_
    the_mass`` below and ``test_tensorflow.py::test_buckets_refreshing_together_share_
    four_allreduces[tf_function-*]``."""
    name = "joined.count"
    step_fn = tape_step(name, join_buckets=True)
    before, reused, refreshed = None, 0, 0
    for step in range(10):
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
        assert issued["alltoall_async"] == SCATTERS and issued["allgather_async"] == 1, (
            step,
            issued,
        )
        refreshes = reducer.stats().global_refreshes
        if refreshes == 0:
            reused += 1
            assert issued["allreduce_sum_async"] <= 1, (step, issued)  # the dense bucket
        else:
            refreshed += 1
            assert issued["allreduce_sum_async"] <= 1 + 4, (step, issued)
        before = mass_kept_in_all(reducer, before, grads, out, f"{name}.{step}")
        assert_identical(out, f"{name}.{step}")
    # Both kinds of step were counted (any of 16 buckets refreshing makes a refresh step).
    assert reused >= 4 and refreshed >= 1, (reused, refreshed)


def test_joined_equals_one_exchange_per_bucket_bitwise():
    assert_same_either_way("join_buckets")


class MassCheck(keras.callbacks.Callback):
    """Around each step of ``model.fit``: the batch's gradients (an eager tape on the
    same weights and batch), the collectives issued, and the invariant after it."""

    def __init__(self, x, y, batch_size, counts):
        super().__init__()
        self.x, self.y, self.batch_size, self.counts = x, y, batch_size, counts
        self.before = None
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        rows = slice(batch * self.batch_size, (batch + 1) * self.batch_size)
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(self.y[rows], self.model(self.x[rows]))
        self.grads = tape.gradient(loss, variables)
        self.weights = [v.numpy().astype(np.float64) for v in variables]
        self.start = {kind: int(c.numpy()) for kind, c in self.counts.items()}

    def on_train_batch_end(self, batch, logs=None):
        issued = {kind: int(c.numpy()) - self.start[kind] for kind, c in self.counts.items()}
        assert issued["alltoall_async"] == SCATTERS and issued["allgather_async"] == 1, (
            batch,
            issued,
        )
        variables = self.model.trainable_variables
        applied = [w - v.numpy().astype(np.float64) for w, v in zip(self.weights, variables)]
        reducer = self.model.optimizer._gradient_reducer
        if self.before is None:
            self.before = {
                b: np.zeros_like(flat) for b, flat in by_bucket(reducer, self.grads).items()
            }
            assert len(self.before) == 3
        self.before = assert_mass_kept(
            reducer, self.before, self.grads, applied, f"keras.fit.{batch}"
        )
        self.steps += 1


def test_keras_fit_joins_the_buckets_and_keeps_the_mass(collective_counts):  # noqa: F811
    """``model.fit`` with the sparse Keras optimizer (SGD, lr 1): one alltoall and one
    allgather for its 3 sparse buckets each step, and, summed over ranks,
    residual_after + P * applied == residual_before + gradient. (Its state variables,
    partition boundaries included, once started at zero under ``fit``, whose build an
    ``assign`` did not survive: every alltoall sent no rows and the selected mass was
    lost.)"""
    keras.utils.set_random_seed(11)  # identical initial weights on every rank
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(96, activation="tanh"),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(48),
        ]
    )
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(1.0), density=0.05, fusion_threshold_bytes=30_000
    )
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(3 + hvd.rank())
    x = rng.standard_normal((16 * 6, 64)).astype(np.float32)
    y = rng.standard_normal((16 * 6, 48)).astype(np.float32)
    check = MassCheck(x, y, 16, collective_counts)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[check])
    assert check.steps == 6
    assert opt.stats().bytes_sent > 0
    assert_identical(model.trainable_variables, "keras.fit")
