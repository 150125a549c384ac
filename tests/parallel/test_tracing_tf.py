"""Inside a ``tf.function``, the plugin's Python runs as written: AutoGraph converts the
user's function, not the plugin's (``do_not_convert`` on the entry points), and the
traced step equals the eager one. An eager ``sparse_allreduce`` runs its own trace,
made once per name, scale and compression.

The engine makes every decision on a tensor through ``Backend.cond`` (a ``tf.cond``), so
AutoGraph's rewriting of its Python has nothing to add; converting it cost about 10 s at
the first trace in a process (docs/tensorflow.md, "Tracing").
"""

import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.tensorflow.backend import BACKEND

hvd.init()

GENERATED = "__autograph_generated"  # the files AutoGraph writes its conversions to


@pytest.fixture
def converted_callers(monkeypatch):
    """The AutoGraph-converted functions on the stack whenever the plugin starts a
    collective of a sparse step, one set per collective."""
    seen: list[set[str]] = []

    def probe(name):
        original = getattr(BACKEND, name)

        def recording(*args, **kwargs):
            stack = inspect.stack(context=0)
            seen.append({frame.function for frame in stack if GENERATED in frame.filename})
            return original(*args, **kwargs)

        monkeypatch.setattr(BACKEND, name, recording)

    for name in ("alltoall_async", "allgather_async"):
        probe(name)
    return seen


def local_grad(step: int, numel: int) -> tf.Tensor:
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return tf.constant(rng.standard_normal(numel).astype(np.float32))


def test_sparse_allreduce_is_traced_unconverted_and_equals_eager(converted_callers):
    hvds.reset_residuals()

    @tf.function
    def step(x):
        return hvds.sparse_allreduce(x, density=0.02, name="trace.fn")

    for s in range(4):
        grad = local_grad(s, 5000)
        traced = step(grad)
        eager = hvds.sparse_allreduce(grad, density=0.02, name="trace.eager")
        np.testing.assert_array_equal(traced.numpy(), eager.numpy())
    traced_calls = [names for names in converted_callers if names]
    assert traced_calls, "the traced step started a collective while tracing"
    # The test's own function is converted; nothing of the plugin's below it.
    assert all(names == {"tf__step"} for names in traced_calls), traced_calls


def test_tape_is_traced_unconverted_and_equals_eager(converted_callers):
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(4)])

    def gradients(model, x, name):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        tape = hvds.DistributedGradientTape(tape, density=0.05, name=name)
        return tape.gradient(loss, model.trainable_variables)

    models = make(), make()

    @tf.function
    def step(x):
        return gradients(models[0], x, "trace.tape.fn")

    for s in range(3):
        x = tf.reshape(local_grad(s, 8 * 16), [8, 16])
        traced = step(x)
        eager = gradients(models[1], x, "trace.tape.eager")
        for t, e in zip(traced, eager):
            np.testing.assert_array_equal(t.numpy(), e.numpy())
    traced_calls = [names for names in converted_callers if names]
    assert traced_calls, "the traced step started a collective while tracing"
    # AutoGraph converts the test's step and the helper it calls; not the tape.
    assert all(names == {"tf__step", "tf__gradients"} for names in traced_calls), traced_calls


def test_an_eager_call_runs_one_trace_a_name_and_scale():
    """An eager ``sparse_allreduce`` runs its step as a ``tf.function`` traced at the
    first call (per prescale, postscale and compression, host values the trace keeps):
    later calls do not retrace, and a call with another op under the same name takes
    its own trace with that op's scale."""
    hvds.reset_residuals()
    name = "trace.ops"
    first_traces = {}  # each step's tracing count after its first call
    for step in range(6):
        op = hvd.Sum if step % 3 == 2 else hvd.Average
        grad = local_grad(step, 3000)
        sparse = hvds.sparse_allreduce(grad, density=1.0, name=name, op=op)
        dense = hvd.allreduce(grad, op=op, name=f"{name}.dense.{step}")
        np.testing.assert_allclose(sparse.numpy(), dense.numpy(), rtol=1e-6, atol=1e-6)
        traced = hvds.functions._STATES.find(name, hvd.global_process_set).traced
        for key, function in traced.items():
            first_traces.setdefault(key, function.experimental_get_tracing_count())
    assert len(traced) == 2, list(traced)  # one step for Average, one for Sum
    now = {key: function.experimental_get_tracing_count() for key, function in traced.items()}
    assert now == first_traces


def test_eager_calls_with_ever_new_scales_stop_tracing_and_stay_right():
    """Past ``MOST_TRACES`` traces under a name, a call with a new prescale runs op by op
    (a scale schedule would otherwise trace every call), with its own scale."""
    hvds.reset_residuals()
    name = "trace.scales"
    for step in range(hvds.functions.MOST_TRACES + 2):
        scale = 1.0 + step
        grad = local_grad(step, 3000)
        sparse = hvds.sparse_allreduce(grad, density=1.0, name=name, prescale_factor=scale)
        dense = hvd.allreduce(grad, name=f"{name}.dense.{step}", prescale_factor=scale)
        np.testing.assert_allclose(sparse.numpy(), dense.numpy(), rtol=1e-6, atol=1e-6)
    traced = hvds.functions._STATES.find(name, hvd.global_process_set).traced
    assert len(traced) == hvds.functions.MOST_TRACES


def test_an_eager_tape_runs_its_exchange_traced_once():
    """The tape's eager ``gradient()`` runs the exchange as one ``tf.function``, traced
    at the first call and not again; its gradients are those of a traced step."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(4)])
    counts = []
    for s in range(4):
        x = tf.reshape(local_grad(s, 8 * 16), [8, 16])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        tape = hvds.DistributedGradientTape(tape, density=0.05, name="trace.tape.eager.once")
        tape.gradient(loss, model.trainable_variables)
        counts.append(tape._reducer._traced.experimental_get_tracing_count())
    assert counts == counts[:1] * 4, counts
