"""How large a traced TensorFlow step is, and what its first calls cost: the graph a
``DistributedGradientTape`` step builds for N sparse buckets, and a Keras ``model.fit``.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/trace_size.py --buckets 2,4,16

For each bucket count, the tape's exchange (an eager ``gradient()`` traces it at its first
call) of N buckets of 128x128 floats at density 0.01: the ops of its graph and of every
branch function in it, the ``tf.cond``s among them, the first call (trace, graph
optimization, the step) and the median of the next five. Then ``model.fit`` of a 3-layer
MLP (3 sparse buckets, SGD momentum) for one epoch of 4 steps, twice: the first fit
traces the training step (twice: Keras builds its optimizer inside the first trace), the
second runs it. Op counts are the same on every run of one version; times are not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.keras as hvds_keras
from horovod_sparse.tensorflow.tape import gradient_reducer

SIDE = 128  # each bucket: SIDE x SIDE floats, one bucket per variable


def graph_ops(graph: Any, types: Counter[str]) -> None:
    """Count the op types of ``graph`` and of every function graph it holds (the
    branches of its conds, nested)."""
    for op in graph.get_operations():
        types[op.type] += 1
    for function in getattr(graph, "_functions", {}).values():
        inner = getattr(function, "graph", None)
        if inner is not None:
            graph_ops(inner, types)


def tape_trace(buckets: int) -> dict[str, Any]:
    shapes = [(SIDE, SIDE)] * buckets
    sources = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    name = f"trace_size.{buckets}"
    rng = np.random.default_rng(1000 + hvd.rank())
    seconds = []
    for _ in range(6):
        grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        start = time.perf_counter()
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(s * g) for s, g in zip(sources, grads)])
        dtape = hvds.DistributedGradientTape(
            tape, name=name, density=0.01, fusion_threshold_bytes=SIDE * SIDE * 4
        )
        results = dtape.gradient(loss, sources)
        _ = [r.numpy() for r in results]
        seconds.append(time.perf_counter() - start)
    traced = gradient_reducer(name)._traced  # the exchange, traced at the first call
    types: Counter[str] = Counter()
    for concrete in traced._list_all_concrete_functions():
        graph_ops(concrete.graph, types)
    return {
        "buckets": buckets,
        "ops": sum(types.values()),
        "conds": types["If"] + types["StatelessIf"],
        "first_call_s": round(seconds[0], 3),
        "later_call_ms": round(1e3 * statistics.median(seconds[1:]), 2),
    }


def keras_fit() -> dict[str, Any]:
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    optimizer = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), density=0.01
    )
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(hvd.rank()).standard_normal((64, 32)).astype(np.float32)
    fits = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(x, x[:, :4], batch_size=16, epochs=1, verbose=0)
        fits.append(round(time.perf_counter() - start, 3))
    return {"first_fit_s": fits[0], "second_fit_s": fits[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="2,4,16", help="bucket counts, comma-separated")
    parser.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = parser.parse_args()
    hvd.init()
    rows = [tape_trace(int(count)) for count in args.buckets.split(",")]
    fit = keras_fit()
    if hvd.rank() != 0:
        return
    print(f"{hvd.size()} ranks, tape: N buckets of {SIDE}x{SIDE} floats at density 0.01\n")
    print("| buckets | ops | tf.conds | first call | later calls (median) |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['buckets']} | {row['ops']:,} | {row['conds']} | "
            f"{row['first_call_s']:.2f} s | {row['later_call_ms']:.1f} ms |"
        )
    print(
        f"\nKeras model.fit, 3 sparse buckets, 4 steps: first fit {fit['first_fit_s']:.2f} s, "
        f"second {fit['second_fit_s']:.2f} s"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"world_size": hvd.size(), "tape": rows, "keras": fit}, out, indent=1)


if __name__ == "__main__":
    main()
