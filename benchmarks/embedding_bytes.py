"""Bytes a rank sends per step for an Embedding's gradient through the TF tape.

By default an ``IndexedSlices`` gradient is allgathered as Horovod does (only the rows
this rank looked up travel, at any density); with ``sparse_as_dense=True`` it joins the
buckets and is sparsified like any other gradient. One step of each setting, at density
0.01 and 1, on a 10,000 x 64 embedding with 32 x 20 lookups a rank. The allgather's
bytes are counted from the gathered rows (rows x (dim x 4 + index bytes)), the buckets'
from the tape's ``stats()``.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/embedding_bytes.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.tensorflow.tape import gradient_reducer

VOCAB, DIM, BATCH, LENGTH = 10_000, 64, 32, 20


def main() -> None:
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(4),
        ]
    )
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32))
    y = tf.constant(rng.integers(0, 4, BATCH))
    for as_dense in (False, True):
        for density in (0.01, 1.0):
            name = f"embedding.{as_dense}.{density}"
            with tf.GradientTape() as tape:
                logits = model(x)
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                )
            dtape = hvds.DistributedGradientTape(
                tape, density=density, sparse_as_dense=as_dense, name=name
            )
            grads = dtape.gradient(loss, [v.value for v in model.trainable_variables])
            buckets = gradient_reducer(name).stats()
            gathered = 0
            if isinstance(grads[0], tf.IndexedSlices):
                rows = int(grads[0].indices.shape[0]) // hvd.size()
                gathered = rows * (DIM * 4 + grads[0].indices.dtype.size)
            if hvd.rank() == 0:
                print(
                    f"sparse_as_dense={as_dense} density={density}: buckets sent "
                    f"{buckets.bytes_sent:,} B ({buckets.numel:,} entries), embedding "
                    f"allgather sent {gathered:,} B, total {buckets.bytes_sent + gathered:,} B",
                    flush=True,
                )


if __name__ == "__main__":
    main()
