"""TF bad input: a clear error on every rank before any collective of a step, never a hang.

The Keras optimizer validates when it is built and the tape when it first builds its
reducer for a list of sources: one allgather of a small pickled verdict per rank.
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.keras as hvds_keras
import horovod_sparse.tensorflow.keras.optimizer as keras_optimizer_module
import horovod_sparse.tensorflow.tape as tape_module

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)

LAST = hvd.size() - 1


def expect_error_everywhere(run, match, tag):
    start = time.monotonic()
    with pytest.raises((ValueError, TypeError), match=match) as raised:
        run()
    elapsed = time.monotonic() - start
    print(f"rank {hvd.rank()} {tag} {elapsed:.1f}s: {raised.value}")  # shown with pytest -s
    assert elapsed < 30
    # Every rank got here: this collective would hang if one had not, and a stale
    # collective left behind by the failure would answer it wrongly.
    total = hvd.allreduce(tf.ones([1]), op=hvd.Sum, name=f"after.{tag}")
    assert float(total[0]) == hvd.size()


def sgd(**kwargs):
    return hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def dense_model(width, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(1)])


def fit_data(seed, n=32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 1)).astype(
        np.float32
    )


def assert_identical(variables, name):
    flat = tf.concat([tf.reshape(v, [-1]) for v in variables], axis=0)
    everyone = hvd.allgather(tf.reshape(flat, [1, -1]), name=f"ident.{name}").numpy()
    for r in range(hvd.size()):
        np.testing.assert_array_equal(everyone[r], flat.numpy(), err_msg=f"rank {r} differs")


def count_validations(monkeypatch, module):
    calls = []
    real = module.validate_across_ranks

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "validate_across_ranks", counting)
    return calls


# ---------------------------------------------------------------- Keras optimizer
def test_keras_fit_different_layer_width_on_one_rank():
    model = dense_model(9 if hvd.rank() == 1 else 8)
    model.compile(optimizer=sgd(density=0.5), loss="mse")
    x, y = fit_data(0)
    expect_error_everywhere(
        lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0), "differs between", "width"
    )


def test_keras_build_inside_tf_function_different_width_on_one_rank():
    model = dense_model(9 if hvd.rank() == 1 else 8)
    opt = sgd(density=0.5)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    expect_error_everywhere(lambda: step(fit_data(1)[0]), "differs between", "fn_width")


@pytest.mark.parametrize("bad", [1.5, 0.0, math.nan])
def test_keras_density_out_of_range_on_one_rank_only(bad):
    model = dense_model(8)
    opt = sgd(density=bad if hvd.rank() == LAST else 0.01)  # no error before the build
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    expect_error_everywhere(
        lambda: opt.apply_gradients(zip(grads, model.trainable_variables)),
        "density",
        f"density.{bad}",
    )


def test_keras_bad_op_on_one_rank_only():
    op = hvd.Adasum if hvd.rank() == LAST else hvd.Average
    opt = sgd(op=op)
    expect_error_everywhere(lambda: opt.build(dense_model(8).trainable_variables), "op=", "op")


def test_keras_refuses_by_name_options_tf_does_not_act_on():
    opt = sgd(scheduler="auto")  # no error before the build
    expect_error_everywhere(
        lambda: opt.build(dense_model(8).trainable_variables),
        "scheduler='auto' does not apply to the Keras optimizer",
        "k_scheduler",
    )


def test_keras_empty_variable_list():
    expect_error_everywhere(lambda: sgd().build([]), "no variables", "empty")


def test_keras_integer_variable():
    variables = [
        keras.Variable(np.zeros((4, 4), np.float32)),
        keras.Variable(np.zeros(3, np.int32)),
    ]
    expect_error_everywhere(lambda: sgd().build(variables), "floating point", "int")


def test_keras_integer_variable_on_one_rank_only():
    dtype = np.int32 if hvd.rank() == LAST else np.float32
    variables = [keras.Variable(np.zeros(3, dtype))]
    expect_error_everywhere(lambda: sgd().build(variables), "floating point", "int1")


def test_keras_bfloat16_is_refused_with_advice():
    variables = [keras.Variable(np.zeros(3, np.float32), dtype="bfloat16")]
    expect_error_everywhere(lambda: sgd().build(variables), "bfloat16", "bf16")


def test_keras_different_variable_count_on_one_rank():
    variables = [keras.Variable(np.zeros(3, np.float32)) for _ in range(2 if hvd.rank() else 3)]
    expect_error_everywhere(lambda: sgd().build(variables), "3 variables|has 3", "count")


# ---------------------------------------------------------------- gradient tape
def tape_gradient(sources, name, **kwargs):
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(tf.cast(s, tf.float32)) for s in sources])
    return hvds.DistributedGradientTape(tape, name=name, **kwargs).gradient(loss, sources)


def test_tape_mismatched_source_shapes_on_one_rank():
    sources = [tf.Variable(tf.ones([4, 9 if hvd.rank() == 1 else 8])), tf.Variable(tf.ones([3]))]
    expect_error_everywhere(
        lambda: tape_gradient(sources, "v_shapes"), "differs between", "tape_shapes"
    )


def test_tape_mismatched_source_shapes_inside_tf_function():
    source = tf.Variable(tf.ones([2000 if hvd.rank() == LAST else 2001]))

    @tf.function
    def step():
        return tape_gradient([source], "v_fn_shapes", density=0.1)

    expect_error_everywhere(step, "differs between", "tape_fn_shapes")


def test_tape_mismatched_dtype_on_one_rank():
    dtype = tf.float64 if hvd.rank() == 1 else tf.float32
    sources = [tf.Variable(tf.ones([5], dtype))]
    expect_error_everywhere(
        lambda: tape_gradient(sources, "v_dtype"), "differs between", "tape_dtype"
    )


def test_tape_density_out_of_range_on_one_rank_only():
    sources = [tf.Variable(tf.ones([5]))]
    density = 1.5 if hvd.rank() == LAST else 0.01
    expect_error_everywhere(
        lambda: tape_gradient(sources, "v_density", density=density), "density", "tape_density"
    )


def test_tape_refuses_by_name_options_tf_does_not_act_on():
    sources = [tf.Variable(tf.ones([5]))]
    expect_error_everywhere(
        lambda: tape_gradient(sources, "v_overlap", overlap_allgather=True),
        "overlap_allgather=True does not apply to DistributedGradientTape",
        "tape_overlap",
    )


def test_tape_empty_sources():
    with tf.GradientTape() as tape:
        loss = tf.constant(1.0)
    dtape = hvds.DistributedGradientTape(tape, name="v_empty")
    expect_error_everywhere(lambda: dtape.gradient(loss, []), "no variables", "tape_empty")


def test_tape_integer_source():
    sources = [tf.Variable(tf.ones([5])), tf.Variable(tf.zeros([3], tf.int32))]
    expect_error_everywhere(lambda: tape_gradient(sources, "v_int"), "floating point", "tape_int")


# ---------------------------------------------------------------- still working afterwards
def test_tape_and_optimizer_inside_tf_function_validate_once(monkeypatch):
    # Both build while the function is traced (TF traces twice when variables are
    # created); each validates once, eagerly. Small variables: dense buckets, quick trace.
    tape_calls = count_validations(monkeypatch, tape_module)
    opt_calls = count_validations(monkeypatch, keras_optimizer_module)
    model = dense_model(16)
    opt = sgd(density=0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvds.DistributedGradientTape(tape, density=0.1, name="v_ok")
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(*fit_data(hvd.rank(), n=8))  # traces: CPU-bound, slow on a busy machine
    start = time.monotonic()
    for s in range(1, 5):
        step(*fit_data(100 * s + hvd.rank(), n=8))
    assert time.monotonic() - start < 30
    assert len(tape_calls) == 1 and len(opt_calls) == 1
    assert int(opt.iterations) == 5
    assert_identical(model.trainable_variables, "tape_ok")


def test_valid_optimizer_after_failures_validates_once_and_stays_identical(monkeypatch):
    calls = count_validations(monkeypatch, keras_optimizer_module)
    model = dense_model(64)
    opt = sgd(density=0.1, min_sparse_numel=100)  # the 4x64 kernel goes sparse
    model.compile(optimizer=opt, loss="mse")
    x, y = fit_data(7 + hvd.rank(), n=40)
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # builds and traces
    start = time.monotonic()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert time.monotonic() - start < 30
    assert int(opt.iterations) == 10
    assert len(calls) == 1  # once per optimizer, not per step or per fit
    assert 0 < opt.stats().selected < opt.stats().numel
    moved = sum(
        float(np.abs(v.numpy() - b).sum()) for v, b in zip(model.trainable_variables, before)
    )
    assert moved > 0
    assert_identical(model.trainable_variables, "fit_ok")
