"""A Keras run resumed from a checkpoint continues exactly as the run that was not
interrupted: the density schedule (warm-up, decay), the partition, the selection and
the reused global threshold resume where they were, not from the start."""

import os
import pickle

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow.keras as hvds_keras

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)

# Steps before the checkpoint (past warm-up, inside the decay, one after a refresh) and
# after it (past the decay's end, across a refresh and a repartition).
SAVED_AT, RESUMED_FOR = 7, 6
BATCH = 16
OPTIONS = dict(
    density=0.05,
    warmup_steps=3,
    density_decay_steps=6,
    global_selection="reuse",
    refresh_steps=3,
    selection="threshold",
    reestimate_steps=2,
    partition="balanced",
    repartition_steps=4,
)


def make_model():
    keras.utils.set_random_seed(5)  # identical initial weights on every rank
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(5),
        ]
    )


def compiled():
    model = make_model()
    optimizer = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **OPTIONS)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model, optimizer


def fit(model, first, steps):
    """``steps`` updates on this rank's batches ``first``, ``first + 1``, ..."""
    xs, ys = [], []
    for step in range(first, first + steps):
        rng = np.random.default_rng(7919 * step + 31 * hvd.rank())
        xs.append(rng.standard_normal((BATCH, 20)).astype(np.float32))
        ys.append(rng.integers(0, 5, BATCH))
    x, y = np.concatenate(xs), np.concatenate(ys)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def sparse_steps(optimizer):
    return [view.step for view in optimizer.bucket_views() if view.sparse]


def assert_identical(variables, name):
    flat = tf.concat([tf.reshape(v, [-1]) for v in variables], axis=0)
    everyone = hvd.allgather(tf.reshape(flat, [1, -1]), name=f"resume.ident.{name}").numpy()
    for r in range(hvd.size()):
        np.testing.assert_array_equal(everyone[r], flat.numpy(), err_msg=f"rank {r} differs")


@pytest.mark.parametrize("route", ["keras_file", "tf_checkpoint"])
def test_keras_resume_is_exact(route, tmp_path_factory):
    model, optimizer = compiled()
    fit(model, 0, SAVED_AT)
    steps = sparse_steps(optimizer)
    assert steps and steps == [SAVED_AT] * len(steps)
    saved = {name: v.numpy().copy() for name, v in optimizer.state_variables().items()}
    # Every kind of state is an optimizer variable, so the checkpoint carries it.
    kinds = {name.rsplit("_sparse", 1)[0] for name in saved}
    assert {"step", "boundaries", "selection_threshold", "global_threshold_key"} <= kinds
    assert {"global_threshold_due", "global_threshold_age", "global_threshold_cap"} <= kinds
    for variable in optimizer.state_variables().values():
        assert any(variable is v for v in optimizer.variables)
    directory = tmp_path_factory.mktemp(f"resume_{route}_{hvd.rank()}")
    if route == "keras_file":
        path = str(directory / "model.keras")
        model.save(path)
    else:
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(directory / "ckpt"))

    fit(model, SAVED_AT, RESUMED_FOR)  # the run that goes on
    assert sparse_steps(optimizer) == [SAVED_AT + RESUMED_FOR] * len(steps)

    if route == "keras_file":
        restored = keras.models.load_model(path)
        restored_optimizer = restored.optimizer
    else:
        restored, restored_optimizer = compiled()
        restored_optimizer.build(restored.trainable_variables)  # as load_model does
        status = tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(path)
        status.assert_existing_objects_matched()
    assert isinstance(restored_optimizer, hvds_keras.SparseOptimizerMixin)
    assert int(restored_optimizer.iterations) == SAVED_AT
    assert sparse_steps(restored_optimizer) == steps
    for name, variable in restored_optimizer.state_variables().items():
        np.testing.assert_array_equal(variable.numpy(), saved[name], err_msg=name)

    fit(restored, SAVED_AT, RESUMED_FOR)  # the resumed run: the same steps, same data
    assert sparse_steps(restored_optimizer) == sparse_steps(optimizer)
    assert restored_optimizer.stats().selected == optimizer.stats().selected
    for a, b in zip(restored.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert_identical(restored.trainable_variables, route)


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam"])
def test_rank_zeros_keras_file_with_the_gathered_state_resumes_exactly(
    optimizer_name, tmp_path_factory
):
    """Horovod's Keras pattern: rank 0 alone writes the ``.keras`` file, with every
    rank's sparse state gathered next to it (``hvds_keras.GatheredState``, a collective);
    every rank loads that file, takes its own residuals, velocities or moments and local
    thresholds back, and the run goes on bit for bit as the uninterrupted one."""
    wrapped = (
        keras.optimizers.SGD(0.05, momentum=0.9)
        if optimizer_name == "sgd_momentum"
        else keras.optimizers.Adam(1e-3)
    )
    model = make_model()
    optimizer = hvds_keras.DistributedOptimizer(wrapped, **OPTIONS)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    fit(model, 0, SAVED_AT)
    gathered = hvds_keras.GatheredState(optimizer).state_dict()  # every rank
    folder = str(tmp_path_factory.mktemp("gathered")) if hvd.rank() == 0 else None
    folder = hvd.broadcast_object(folder, root_rank=0, name=f"gathered.dir.{optimizer_name}")
    if hvd.rank() == 0:
        assert sorted(gathered["parts"]) == list(range(hvd.size()))
        model.save(f"{folder}/model.keras")
        with open(f"{folder}/sparse_state.pkl", "wb") as out:
            pickle.dump(gathered, out)
    else:
        assert sorted(gathered["parts"]) == [hvd.rank()]
    hvd.allreduce(tf.zeros([1]), name=f"gathered.saved.{optimizer_name}")  # files written
    fit(model, SAVED_AT, RESUMED_FOR)

    restored = keras.models.load_model(f"{folder}/model.keras")  # rank 0's, on every rank
    with open(f"{folder}/sparse_state.pkl", "rb") as saved:
        hvds_keras.GatheredState(restored.optimizer).load_state_dict(pickle.load(saved))
    mine = gathered["parts"][hvd.rank()]  # this rank's own state at the save, not rank 0's
    for name, variable in restored.optimizer.state_variables().items():
        np.testing.assert_array_equal(variable.numpy(), mine[name], err_msg=name)
    fit(restored, SAVED_AT, RESUMED_FOR)
    for a, b in zip(restored.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert_identical(restored.trainable_variables, f"gathered.{optimizer_name}")
