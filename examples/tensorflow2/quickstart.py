"""The README's TensorFlow / Keras 3 quickstart as a whole program (run it under horovodrun).

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2/quickstart.py

Fits a small MLP to a fixed random regression task with ``model.fit`` and the sparse
optimizer at density 0.01, then checks what a user relies on: the loss fell, every rank
holds the same weights, and the bytes sent were a few percent of a dense allreduce's.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow.keras as hvds_keras


def main() -> None:
    hvd.init()
    keras.utils.set_random_seed(0)  # the same task and initial weights on every rank
    inputs = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)
    weights = np.random.default_rng(1).standard_normal((64, 1)).astype(np.float32)
    targets = inputs @ weights
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)]
    )

    optimizer = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9), density=0.01
    )
    model.compile(optimizer=optimizer, loss="mse")
    shard = slice(hvd.rank(), None, hvd.size())  # each rank trains on its own rows
    history = model.fit(
        inputs[shard], targets[shard], batch_size=64, epochs=6, verbose=0, shuffle=False
    )

    stats = optimizer.stats()
    flat = tf.concat([tf.reshape(w, [-1]) for w in model.trainable_weights], 0)
    gathered = hvd.allgather(flat[None], name="quickstart.weights").numpy()
    losses = history.history["loss"]
    assert all(np.array_equal(gathered[0], row) for row in gathered), "ranks' weights differ"
    assert losses[-1] < 0.5 * losses[0], f"loss did not fall: {losses}"
    assert stats.compression_ratio > 10, stats
    if hvd.rank() == 0:
        print(
            f"quickstart OK: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{1 / stats.compression_ratio:.2%} of dense bytes, "
            f"weights identical on {hvd.size()} ranks"
        )


if __name__ == "__main__":
    main()
