"""Keras 3 ``model.fit`` with sparse allreduce on a synthetic teacher-student task.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo \
        python examples/tensorflow2/keras_synthetic.py --density 0.01

``--density 1.0`` still uses the sparse wrapper at full density, which equals a dense
average: Horovod's own ``horovod.tensorflow.keras`` does not support Keras 3.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np

import horovod_sparse.tensorflow.keras as hvds_keras


def make_data(rank: int, samples: int, features: int = 64, classes: int = 10):
    teacher = np.random.default_rng(1234)  # the same task on every rank
    w1 = teacher.standard_normal((features, 64))
    w2 = teacher.standard_normal((64, classes))
    rng = np.random.default_rng(100 + rank)  # each rank sees its own shard
    x = rng.standard_normal((samples, features)).astype(np.float32)
    y = (np.tanh(x @ w1) @ w2).argmax(-1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", default=None, help="write a summary here (rank 0)")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(0)  # identical initial weights on every rank
    x, y = make_data(hvd.rank(), 2048)
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9), density=args.density
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x, y, batch_size=64, epochs=args.epochs, verbose=2 if hvd.rank() == 0 else 0
    )
    s = optimizer.stats()
    summary = {
        "density": args.density,
        "world_size": hvd.size(),
        "final_loss": float(history.history["loss"][-1]),
        "final_accuracy": float(history.history["accuracy"][-1]),
        "bytes_per_step": s.bytes_sent + s.bytes_received,
        "dense_bytes_per_step": s.dense_bytes,
    }
    if hvd.rank() == 0:
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
