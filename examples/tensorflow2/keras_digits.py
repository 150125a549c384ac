"""Keras 3 ``model.fit`` on scikit-learn's bundled 8x8 digits, with sparse or dense allreduce.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo \
        python examples/tensorflow2/keras_digits.py --density 0.01
    horovodrun -np 2 -H localhost:2 --gloo \
        python examples/tensorflow2/keras_digits.py --density 1.0

The Keras twin of ``examples/pytorch/digits_cnn.py``: the same fixed split (1437 training
and 360 test images), rank r trains on every P-th training image starting at r, the same
CNN, SGD with momentum 0.9 and the learning rate scaled by the number of ranks.

``--density 1.0`` still uses ``horovod_sparse.tensorflow.keras.DistributedOptimizer``, at
full density, which runs a dense allreduce: Horovod's own ``horovod.tensorflow.keras``
does not support Keras 3.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod_sparse.tensorflow.keras as hvds_keras
from horovod_sparse.common.stats import allreduce_ring_bytes


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train/test split, images scaled to [0, 1] as (N, 8, 8, 1) float32."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )

    def images(a: np.ndarray) -> np.ndarray:
        return (a / 16.0).astype(np.float32)[..., None]

    return images(x_train), y_train, images(x_test), y_test


def make_model() -> keras.Model:
    """Two 3x3 convolutions, a max-pool and two dense layers: 151,306 parameters."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPool2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class BatchLoss(keras.metrics.Metric):
    """Loss of the last batch, as digits_cnn.py reports (Keras's ``loss`` is a running mean)."""

    def __init__(self) -> None:
        super().__init__(name="batch_loss")
        self.value = self.add_variable((), initializer="zeros", name="value")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        self.value.assign(keras.ops.mean(losses))

    def result(self) -> Any:
        return self.value


class Monitor(keras.callbacks.Callback):
    """Bytes moved every step; rank-averaged loss and test accuracy every few steps."""

    def __init__(self, args: argparse.Namespace, mode: str, x_test: Any, y_test: Any) -> None:
        super().__init__()
        self.args, self.mode, self.x_test, self.y_test = args, mode, x_test, y_test
        self.step, self.moved, self.curve = 0, [], []
        self.began = time.perf_counter()
        self.evaluating = 0.0  # seconds spent evaluating: not training time

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.began = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        s = self.model.optimizer.stats()
        self.moved.append(s.bytes_sent + s.bytes_received)
        step, self.step = self.step, self.step + 1
        if step == self.args.steps - 1 and self.args.flush and self.args.density < 1.0:
            # The model this run keeps holds every rank's pending update too.
            flushed = self.model.optimizer.flush_residuals()
            self.moved[-1] += sum(allreduce_ring_bytes(flushed, hvd.size(), 4))
        if step % self.args.eval_every and step != self.args.steps - 1:
            return
        paused = time.perf_counter()
        seconds = paused - self.began - self.evaluating  # training time so far
        mine = tf.convert_to_tensor(logs["batch_loss"], tf.float32)
        loss = float(hvd.allreduce(mine, name="train_loss"))
        predicted = np.argmax(self.model(self.x_test, training=False), -1)
        acc = 100.0 * float(np.mean(predicted == self.y_test))
        self.curve.append({"step": step, "seconds": seconds, "train_loss": loss, "test_acc": acc})
        self.evaluating += time.perf_counter() - paused
        if hvd.rank() == 0:
            print(
                f"[{self.mode}] step {step:4d} loss {loss:.4f} "
                f"test acc {acc:.2f}% bytes/step {self.moved[-1]:,}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--no-error-feedback", action="store_true", help="ablation")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument(
        "--lr", type=float, default=None, help="per rank; scaled by P (SGD 0.02, Adam 0.001)"
    )
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument(
        "--no-flush", dest="flush", action="store_false", help="ablation: keep the residuals"
    )  # by default the last step applies every rank's pending update (flush_residuals)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--json", default=None, help="write the curves here (rank 0)")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)  # identical initial weights on every rank
    x_train, y_train, x_test, y_test = load_split()
    x_mine, y_mine = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    data = (
        tf.data.Dataset.from_tensor_slices((x_mine, y_mine))
        .shuffle(len(x_mine), seed=args.seed * 1000 + hvd.rank(), reshuffle_each_iteration=True)
        .batch(args.batch_size, drop_remainder=True)
        .repeat()
    )

    model = make_model()
    if args.optimizer == "adam":
        lr = 0.001 if args.lr is None else args.lr
        inner = keras.optimizers.Adam(learning_rate=lr * hvd.size())
    else:
        lr = 0.02 if args.lr is None else args.lr
        inner = keras.optimizers.SGD(learning_rate=lr * hvd.size(), momentum=0.9)
    optimizer = hvds_keras.DistributedOptimizer(
        inner,
        density=args.density,
        error_feedback=not args.no_error_feedback,
    )
    mode = f"density {args.density}" + (" no EF" if args.no_error_feedback else "")
    mode = "dense" if args.density >= 1.0 else mode
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[BatchLoss()],
    )
    numel = model.count_params()
    dense_bytes = sum(allreduce_ring_bytes(numel, hvd.size(), 4))

    monitor = Monitor(args, mode, x_test, y_test)
    began = time.perf_counter()
    model.fit(
        data, steps_per_epoch=args.steps, epochs=1, callbacks=[monitor], shuffle=False, verbose=0
    )
    # Every rank must hold the same parameters.
    flat = tf.concat([tf.reshape(w, [-1]) for w in model.weights], axis=0)
    high, low = (hvd.allreduce(flat, op=op, name=f"p{op}") for op in (hvd.Max, hvd.Min))
    summary = {
        "task": "keras_digits" if args.optimizer == "sgd" else "keras_digits_adam",
        "mode": mode,
        "density": args.density,
        "error_feedback": not args.no_error_feedback,
        "world_size": hvd.size(),
        "parameters": numel,
        "steps": args.steps,
        "seed": args.seed,
        "final_test_acc": monitor.curve[-1]["test_acc"],
        "final_train_loss": monitor.curve[-1]["train_loss"],
        "bytes_per_step": sum(monitor.moved) / len(monitor.moved),
        "dense_bytes_per_step": dense_bytes,
        "parameter_spread": float(tf.reduce_max(high - low)),
        "seconds": time.perf_counter() - began,
        "curve": monitor.curve,
    }
    if hvd.rank() == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
