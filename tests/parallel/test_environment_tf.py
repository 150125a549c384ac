"""Environment assumptions the TensorFlow adapter relies on (docs/design.md §9)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()


def test_alltoall_with_splits_returns_received_splits():
    rank, size = hvd.rank(), hvd.size()
    splits = tf.constant([j + 1 for j in range(size)], dtype=tf.int32)
    rows = tf.fill([int(tf.reduce_sum(splits)), 2], float(rank))
    out, received = hvd.alltoall(rows, splits=splits, name="tfenv.alltoall")
    assert received.numpy().tolist() == [rank + 1] * size
    expected = tf.concat([tf.fill([rank + 1, 2], float(r)) for r in range(size)], axis=0)
    assert bool(tf.reduce_all(out == expected))


def test_allgather_different_length_per_rank():
    rank, size = hvd.rank(), hvd.size()
    out = hvd.allgather(tf.fill([rank + 1, 3], float(rank)), name="tfenv.allgather")
    assert out.shape[0] == size * (size + 1) // 2


def test_collectives_inside_tf_function():
    rank, size = hvd.rank(), hvd.size()

    @tf.function
    def step(x):
        summed = hvd.allreduce(x, op=hvd.Sum, name="tfenv.fn.sum")
        gathered = hvd.allgather(tf.reshape(x[:1], [1]), name="tfenv.fn.gather")
        return summed, gathered

    summed, gathered = step(tf.fill([4], float(rank)))
    assert summed.numpy().tolist() == [float(sum(range(size)))] * 4
    assert gathered.numpy().tolist() == [float(r) for r in range(size)]


def test_distributed_gradient_tape():
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(hvd.rank() + 1))
    tape = hvd.DistributedGradientTape(tape)
    (grad,) = tape.gradient(loss, [w])
    mean = sum(r + 1 for r in range(hvd.size())) / hvd.size()
    assert grad.numpy().tolist() == [mean, mean]
