"""Horovod's TensorFlow contract: what ``hvd.DistributedGradientTape`` and
``hvd.keras.DistributedOptimizer`` users do works unchanged with
``horovod_sparse.tensorflow``.

Each behaviour runs under Horovod's tape and ours at density 1 (results to 1e-6), eagerly
and in a ``tf.function``: process sets (a rank outside gets its own gradients back, no
collective, no error; Horovod's ``test_distributed_gradient_tape_process_sets``),
local sources and variables (not reduced, divided by the set's size unless
``scale_local_gradients=False``, in no bucket), ``IndexedSlices`` gradients (allgathered
as ``hvd.allreduce`` does, in no bucket), and an Embedding model trained 200 steps.
Horovod's own Keras optimizer does not work on Keras 3, so the Keras optimizer is held
to a plain Keras optimizer stepping with Horovod's reduced gradients (``hvd.allreduce``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.keras as hvds_keras
from horovod_sparse.tensorflow.tape import gradient_reducer

# The even ranks. At world size 2 that is [0]: a process set equal to the global one
# cannot be registered.
_world = int(os.environ["HOROVOD_SPARSE_TEST_WORLD_SIZE"])
EVEN = list(range(0, _world, 2))
even = hvd.ProcessSet(EVEN)
hvd.init(process_sets=[even])
tf.config.threading.set_inter_op_parallelism_threads(2)

RTOL, ATOL = 1e-6, 1e-7
GRAPH = pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])


def run(fn, graph):
    return tf.function(fn)() if graph else fn()


def dense(grad):
    return tf.convert_to_tensor(grad).numpy()


def assert_close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(dense(a), dense(b), rtol=RTOL, atol=ATOL)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)  # the same weights on every rank
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    return model


def embedding_model(seed=0, vocab=200, dim=8):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(vocab, dim),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(4),
        ]
    )


def batch(step, n=6):
    rng = np.random.default_rng(1009 * step + hvd.rank())
    return (
        tf.constant(rng.standard_normal((n, 8)).astype(np.float32)),
        tf.constant(rng.standard_normal((n, 4)).astype(np.float32)),
    )


def tokens(step, n=8, vocab=200):
    rng = np.random.default_rng(7919 * step + hvd.rank())
    return (
        tf.constant(rng.integers(0, vocab, (n, 6)).astype(np.int32)),
        tf.constant(rng.integers(0, 4, n).astype(np.int32)),
    )


def mse(model, x, y):
    return tf.reduce_mean((model(x) - y) ** 2)


def xent(model, x, y):
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
    )


def tape_grads(make_tape, model, loss_fn, data, locals_=()):
    """Gradients of ``loss_fn`` through the tape ``make_tape`` wraps, with the sources
    as ``tf.Variable``s (Horovod's tape calls ``.ref()``, which Keras 3 variables lack)."""
    with tf.GradientTape() as tape:
        loss = loss_fn(model, *data)
    tape = make_tape(tape)
    for v in locals_:
        tape.register_local_source(v.value)
    return tape.gradient(loss, [v.value for v in model.trainable_variables])


# ---- 1. process sets


@GRAPH
@pytest.mark.parametrize("density", [1.0, 0.01])
def test_process_set_tape_as_horovods_own_test(graph, density):
    """Horovod's test_distributed_gradient_tape_process_sets, under both tapes."""

    def grads(wrap):
        x = tf.constant(float(hvd.rank()))
        with tf.GradientTape() as g:
            g.watch(x)
            y = x * x
        return wrap(g).gradient(y, [x])

    name = f"ps.{graph}.{density}"
    ours = run(
        lambda: grads(
            lambda g: hvds.DistributedGradientTape(g, process_set=even, density=density, name=name)
        ),
        graph,
    )
    theirs = run(lambda: grads(lambda g: hvd.DistributedGradientTape(g, process_set=even)), graph)
    (value,) = [float(v) for v in ours]
    if even.included():
        assert value == pytest.approx(2.0 * sum(EVEN) / len(EVEN))
    else:
        assert value == pytest.approx(2.0 * hvd.rank())
        with pytest.raises(KeyError):
            gradient_reducer(name)  # no buckets, no collective outside the set
    assert_close(ours, theirs)


@GRAPH
def test_process_set_keras_optimizer(graph):
    model, ref = mlp(), mlp()
    opt = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=even, density=1.0)
    ref_opt = keras.optimizers.SGD(0.1)

    def step():
        x, y = batch(1)
        for m, o, reduce in ((model, opt, False), (ref, ref_opt, True)):
            with tf.GradientTape() as tape:
                loss = mse(m, x, y)
            grads = tape.gradient(loss, m.trainable_variables)
            if reduce and even.included():
                grads = [
                    hvd.allreduce(g, process_set=even, name=f"kps.{i}") for i, g in enumerate(grads)
                ]
            o.apply_gradients(zip(grads, m.trainable_variables))

    run(step, graph)
    assert_close(model.trainable_variables, ref.trainable_variables)


# ---- 2. local sources and variables


@GRAPH
@pytest.mark.parametrize("density", [1.0, 0.01])
@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
def test_local_sources_as_horovods_tape(graph, density, scale):
    model = mlp()
    first = model.layers[0].kernel
    name = f"local.{graph}.{density}.{scale}"

    def ours():
        return tape_grads(
            lambda t: hvds.DistributedGradientTape(
                t, density=density, min_sparse_numel=16, scale_local_gradients=scale, name=name
            ),
            model,
            mse,
            batch(2),
            [first],
        )

    def theirs():
        return tape_grads(
            lambda t: hvd.DistributedGradientTape(t, scale_local_gradients=scale),
            model,
            mse,
            batch(2),
            [first],
        )

    got, want = run(ours, graph), run(theirs, graph)
    np.testing.assert_allclose(dense(got[0]), dense(want[0]), rtol=RTOL, atol=ATOL)
    if density == 1.0:
        assert_close(got, want)
    # The local kernel is in no bucket: the buckets hold the other variables only.
    numel = sum(v.numel for v in gradient_reducer(name).bucket_views())
    assert numel == sum(int(np.prod(v.shape)) for v in model.trainable_variables[1:])


@GRAPH
@pytest.mark.parametrize("density", [1.0, 0.01])
@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
def test_local_vars_of_the_keras_optimizer(graph, density, scale):
    model, ref = mlp(), mlp()
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1),
        density=density,
        min_sparse_numel=16,
        scale_local_gradients=scale,
    )
    opt.register_local_var(model.layers[0].kernel)
    ref_opt = keras.optimizers.SGD(0.1)
    size = float(hvd.size()) if scale else 1.0

    def step():
        x, y = batch(3)
        with tf.GradientTape() as tape:
            loss = mse(model, x, y)
        opt.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        with tf.GradientTape() as tape:
            loss = mse(ref, x, y)
        grads = tape.gradient(loss, ref.trainable_variables)
        reduced = [grads[0] / size] + [
            hvd.allreduce(g, name=f"klv.{i}") for i, g in enumerate(grads[1:])
        ]
        ref_opt.apply_gradients(zip(reduced, ref.trainable_variables))

    run(step, graph)
    np.testing.assert_allclose(
        model.trainable_variables[0].numpy(),
        ref.trainable_variables[0].numpy(),
        rtol=RTOL,
        atol=ATOL,
    )
    if density == 1.0:
        assert_close(model.trainable_variables, ref.trainable_variables)
    numel = sum(v.numel for v in opt.bucket_views())
    assert numel == sum(int(np.prod(v.shape)) for v in model.trainable_variables[1:])
    assert all(v.shape[0] != 8 * 16 for v in opt.residual_variables().values())


# ---- 3. get_config / from_config


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
        lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop"],
)
@pytest.mark.parametrize("density", [1.0, 0.01])
def test_get_config_round_trips(make, density):
    opt = hvds_keras.DistributedOptimizer(make(), density=density)
    config = opt.get_config()
    again = type(opt).from_config(config)
    assert again.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is type(opt) and restored.get_config() == config


# ---- 4. IndexedSlices


@GRAPH
@pytest.mark.parametrize("density", [1.0, 0.01])
def test_indexed_slices_as_horovods_tape(graph, density):
    model = embedding_model()
    name = f"slices.{graph}.{density}"

    def ours():
        return tape_grads(
            lambda t: hvds.DistributedGradientTape(t, density=density, name=name),
            model,
            xent,
            tokens(0),
        )

    def theirs():
        return tape_grads(hvd.DistributedGradientTape, model, xent, tokens(0))

    got, want = run(ours, graph), run(theirs, graph)
    assert isinstance(got[0], tf.IndexedSlices)
    np.testing.assert_allclose(dense(got[0]), dense(want[0]), rtol=RTOL, atol=ATOL)
    if density == 1.0:
        assert_close(got, want)
    # The embedding is in no bucket.
    numel = sum(v.numel for v in gradient_reducer(name).bucket_views())
    assert numel == sum(int(np.prod(v.shape)) for v in model.trainable_variables[1:])
    # Its bytes per step: the rows this rank touched, values and indices, at any density.
    rows = int(got[0].indices.shape[0]) // hvd.size()
    print(f"embedding rows sent per rank: {rows}, bytes {rows * (8 * 4 + 4)}")


@GRAPH
def test_sparse_as_dense_keeps_its_meaning(graph):
    model = embedding_model()
    name = f"sad.{graph}"

    def ours():
        return tape_grads(
            lambda t: hvds.DistributedGradientTape(t, sparse_as_dense=True, density=1.0, name=name),
            model,
            xent,
            tokens(1),
        )

    def theirs():
        return tape_grads(
            lambda t: hvd.DistributedGradientTape(t, sparse_as_dense=True), model, xent, tokens(1)
        )

    got, want = run(ours, graph), run(theirs, graph)
    assert not isinstance(got[0], tf.IndexedSlices)
    assert_close(got, want)
    numel = sum(v.numel for v in gradient_reducer(name).bucket_views())
    assert numel == sum(int(np.prod(v.shape)) for v in model.trainable_variables)


@GRAPH
def test_indexed_slices_keras_optimizer(graph):
    model, ref = embedding_model(), embedding_model()
    opt = hvds_keras.DistributedOptimizer(keras.optimizers.Adam(0.01), density=1.0)
    ref_opt = keras.optimizers.Adam(0.01)

    def step():
        x, y = tokens(2)
        with tf.GradientTape() as tape:
            loss = xent(model, x, y)
        opt.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        with tf.GradientTape() as tape:
            loss = xent(ref, x, y)
        grads = tape.gradient(loss, ref.trainable_variables)
        reduced = [hvd.allreduce(g, name=f"kis.{i}") for i, g in enumerate(grads)]
        ref_opt.apply_gradients(zip(reduced, ref.trainable_variables))

    run(step, graph)
    assert_close(model.trainable_variables, ref.trainable_variables)


# ---- 5. training


def test_embedding_model_trains_as_under_horovods_tape():
    """200 steps of an Embedding model, default options at density 1: the loss follows
    Horovod's tape's to 1%."""
    losses = {}
    for which in ("ours", "theirs"):
        model = embedding_model(seed=3)
        opt = keras.optimizers.SGD(0.5)
        variables = [v.value for v in model.trainable_variables]

        @tf.function
        def step(x, y, which=which, model=model, opt=opt, variables=variables):
            with tf.GradientTape() as tape:
                loss = xent(model, x, y)
            if which == "ours":
                tape = hvds.DistributedGradientTape(tape, density=1.0, name="train")
            else:
                tape = hvd.DistributedGradientTape(tape)
            opt.apply_gradients(zip(tape.gradient(loss, variables), model.trainable_variables))
            return loss

        # A learnable task: the label is the first token's class.
        rng = np.random.default_rng(hvd.rank())
        trace = []
        for _ in range(200):
            x = rng.integers(0, 200, (16, 6)).astype(np.int32)
            trace.append(float(step(tf.constant(x), tf.constant(x[:, 0] % 4))))
        losses[which] = (np.mean(trace[:20]), np.mean(trace[-20:]))
    assert losses["ours"][1] == pytest.approx(losses["theirs"][1], rel=0.01)
    assert losses["ours"][1] < losses["ours"][0]  # it learned
