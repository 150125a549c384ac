"""A ``tf.GradientTape`` custom training loop with sparse allreduce.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo \
        python examples/tensorflow2/tape_synthetic.py --density 0.01

``--density 1.0`` uses Horovod's own ``hvd.DistributedGradientTape`` (dense allreduce).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for keras_synthetic

import horovod.tensorflow as hvd
import keras
import tensorflow as tf
from keras_synthetic import make_data

import horovod_sparse.tensorflow as hvds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(0)
    x, y = make_data(hvd.rank(), 2048)
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    variables = [v.value for v in model.trainable_variables]  # tf.Variables for either tape
    optimizer = keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        if args.density >= 1.0:
            tape = hvd.DistributedGradientTape(tape)
        else:
            tape = hvds.DistributedGradientTape(tape, density=args.density)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return hvd.allreduce(loss, name="loss")

    batch = 64
    for step in range(args.steps):
        lo = (step * batch) % len(x)
        loss = train_step(x[lo : lo + batch], y[lo : lo + batch])
        if hvd.rank() == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"[density={args.density}] step {step:4d} loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
