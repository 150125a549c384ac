"""Glue that runs the common stages on TF gradients: buckets, flat buffers, variables.

The tape, the Keras optimizer and the functional API all reduce through
:class:`GradientReducer` / :func:`run_bucket`; none of them repeats a stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.buckets import Bucket, plan_buckets
from horovod_sparse.common.config import SparseConfig, optimizer_scales
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.backend import TFBackend

__all__ = ["BACKEND", "BucketState", "GradientReducer", "op_name", "run_bucket", "tf_config"]

BACKEND = TFBackend()
_COUNT_SLOTS = 10  # >= BucketReducer.NUM_COUNTS


def tf_config(**knobs: Any) -> SparseConfig:
    """A :class:`SparseConfig` for TF: exact selection and a uniform partition.

    The threshold selection and the balanced partition keep host-side state (a reused
    threshold, counts read on the host) that a ``tf.function`` traced once cannot
    update per call; TF uses the stateless stages, which run the same in eager and
    graph mode.
    """
    return SparseConfig(selection="exact", partition="uniform", **knobs)


def op_name(op: Any) -> str:
    """Horovod's reduce-op constant as the name :mod:`horovod_sparse.common` uses."""
    return {hvd.Average: "average", hvd.Sum: "sum"}.get(op, repr(op))


@dataclass
class BucketState:
    """A reducer plus the TF variables that carry its state between steps.

    ``residual`` is checkpointable (``tf.Variable`` or Keras variable); ``counts`` holds
    the raw figures of the last step so :meth:`stats` works after a ``tf.function``.
    ``velocity`` (momentum correction, see :class:`GradientReducer`) is this rank's SGD
    velocity over the bucket, or None.
    """

    reducer: BucketReducer | DenseBucketReducer
    residual: Any  # None for a dense bucket
    counts: tf.Variable
    velocity: Any = None
    momentum: float = 0.0
    nesterov: bool = False

    def stats(self) -> StepStats:
        values = self.counts.numpy().tolist()[: self.reducer.NUM_COUNTS]
        return self.reducer.stats_from_counts(values)


def make_counts_variable() -> tf.Variable:
    with tf.init_scope():  # created eagerly even when first called inside tf.function
        return tf.Variable(tf.zeros([_COUNT_SLOTS], tf.float64), trainable=False)


def run_bucket(state: BucketState, flat: tf.Tensor, prescale: float, postscale: float) -> tf.Tensor:
    """One exchange of ``flat``: read the residual, run the stages, write residual and counts.

    With a velocity (momentum correction) the exchange carries ``u = m * u + flat``
    (``flat + m * u`` for Nesterov) instead of ``flat``; in a sparse bucket the entries
    this rank selects are zeroed in ``u`` too (momentum factor masking), a dense bucket
    keeps all of ``u`` as dense momentum SGD does.
    """
    reducer = state.reducer
    sparse = state.residual is not None
    if sparse:
        reducer.residual = tf.convert_to_tensor(state.residual)
    velocity = None
    if state.velocity is not None:
        velocity = state.momentum * tf.convert_to_tensor(state.velocity) + flat
        flat = flat + state.momentum * velocity if state.nesterov else velocity
        if sparse:
            reducer.velocity = velocity
    inflight = reducer.start(flat, prescale)
    inflight = reducer.reduce_and_gather(inflight)
    result = reducer.finish(inflight, flat, postscale)
    counts = [tf.cast(c, tf.float64) for c in reducer.step_counts()]
    counts += [tf.constant(0.0, tf.float64)] * (_COUNT_SLOTS - len(counts))
    updates = [state.counts.assign(tf.stack(counts))]
    if sparse:
        updates.append(state.residual.assign(reducer.residual))
    if velocity is not None:
        updates.append(state.velocity.assign(reducer.velocity if sparse else velocity))
    with tf.control_dependencies(updates):
        return tf.identity(result)


class GradientReducer:
    """Reduces a fixed list of gradients (same variables every call) through buckets.

    Args:
        variables: the variables whose gradients are reduced, in a fixed order.
        config: sparse hyperparameters.
        op, gradient_predivide_factor, compression, sparse_as_dense, process_set,
        groups, num_groups: as in ``hvd.DistributedGradientTape``.
        name: prefix of collective names (distinct per reducer, identical on every rank).
        make_variable: ``(kind, numel, dtype, name) -> zero variable``, ``kind`` being
            ``"residual"`` or ``"velocity"``; lets the Keras optimizer own the residuals
            and velocities so they are saved with its checkpoint.
        momentum, nesterov: momentum correction (DGC) for an SGD whose own momentum is
            off: with ``momentum > 0`` every bucket keeps a per-rank velocity
            ``u = momentum * u + grad`` (a ``make_variable`` variable, like the
            residual), the exchange carries ``u`` (``grad + momentum * u`` for Nesterov)
            and a sparse bucket zeroes the entries it sent in ``u``. The reduced result
            is then the step direction: the caller applies ``-lr`` times it.
    """

    def __init__(
        self,
        variables: Sequence[Any],
        config: SparseConfig,
        *,
        op: Any = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        compression: Any = hvd.Compression.none,
        sparse_as_dense: bool = False,
        process_set: Any = hvd.global_process_set,
        groups: Any = None,
        num_groups: int = 0,
        name: str = "hvds.tf",
        make_variable: Callable[[str, int, tf.DType, str], Any] | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if not process_set.included():
            raise ValueError("this rank is not in the process_set")
        self.config = config
        self.sparse_as_dense = sparse_as_dense
        self.prescale, self.postscale = optimizer_scales(
            op_name(op), process_set.size(), float(gradient_predivide_factor)
        )
        make_variable = make_variable or zeros_variable
        self.momentum = float(momentum)
        names = [f"{i}" for i in range(len(variables))]
        for v in variables:
            if not tf.as_dtype(v.dtype).is_floating:
                raise TypeError(
                    f"variable {_label(v)} has dtype {tf.as_dtype(v.dtype).name}; "
                    "gradients must be floating point"
                )
        described = [
            (n, _numel(v), tf.as_dtype(v.dtype).name, tf.as_dtype(v.dtype).size)
            for n, v in zip(names, variables)
        ]
        large = [d for d in described if d[1] >= config.min_sparse_numel]
        small = [d for d in described if d[1] < config.min_sparse_numel]
        index_of = {id(v): i for i, v in enumerate(variables)}
        group_names = None
        if groups is not None and not isinstance(groups, int):
            large_names = {d[0] for d in large}
            group_names = [
                [names[index_of[id(v)]] for v in g if names[index_of[id(v)]] in large_names]
                for g in groups
            ]
        elif num_groups or isinstance(groups, int):
            count = groups if isinstance(groups, int) else num_groups
            size = -(-len(large) // count) if large else 1
            group_names = [[d[0] for d in large[i : i + size]] for i in range(0, len(large), size)]
        plans = (
            plan_buckets(large, config.bucket_bytes, group_names).buckets
            + plan_buckets(small, config.bucket_bytes, kind="dense").buckets
        )
        self.buckets: list[tuple[Bucket, list[int], BucketState]] = []
        for bucket in plans:
            positions = [int(e.name) for e in bucket.entries]
            dtype = tf.as_dtype(variables[positions[0]].dtype)
            like = tf.zeros([0], dtype)
            stem = f"{name}.{bucket.name}"
            if bucket.kind == "sparse":
                reducer = BucketReducer(
                    BACKEND, stem, bucket.numel, like, config, process_set, compression
                )
                residual = make_variable("residual", bucket.numel, dtype, bucket.name)
            else:
                reducer = DenseBucketReducer(
                    BACKEND, stem, bucket.numel, like, process_set, compression
                )
                residual = None
            velocity = (
                make_variable("velocity", bucket.numel, dtype, bucket.name)
                if self.momentum > 0
                else None
            )
            state = BucketState(
                reducer, residual, make_counts_variable(), velocity, self.momentum, nesterov
            )
            self.buckets.append((bucket, positions, state))

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Reduced gradients, in the order of ``grads``. ``None`` gradients count as zeros."""
        dense = [self._dense(g, v) for g, v in zip(grads, variables)]
        out: list[Any] = list(dense)
        for bucket, positions, state in self.buckets:
            flat = tf.concat([tf.reshape(dense[p], [-1]) for p in positions], axis=0)
            result = run_bucket(state, flat, self.prescale, self.postscale)
            pieces = tf.split(result, [e.numel for e in bucket.entries])
            for p, piece in zip(positions, pieces):
                out[p] = tf.reshape(piece, tf.shape(dense[p]))
        return out

    def _dense(self, grad: Any, variable: Any) -> tf.Tensor:
        if grad is None:
            # A variable with no gradient on this rank still takes part, as zeros.
            return tf.zeros(variable.shape, variable.dtype)
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(
                    f"variable {_label(variable)} has an IndexedSlices (sparse) gradient; pass "
                    "sparse_as_dense=True to reduce it as a dense tensor"
                )
            return tf.convert_to_tensor(grad)
        return grad

    def stats(self) -> StepStats:
        """Statistics of the last reduction, summed over buckets."""
        total = StepStats()
        for _, _, state in self.buckets:
            total += state.stats()
        return total

    def residuals(self) -> dict[str, Any]:
        """Residual variable per sparse bucket."""
        return {b.name: s.residual for b, _, s in self.buckets if s.residual is not None}

    def velocities(self) -> dict[str, Any]:
        """Momentum-correction velocity variable per bucket (empty when it is off)."""
        return {b.name: s.velocity for b, _, s in self.buckets if s.velocity is not None}


def zeros_variable(kind: str, numel: int, dtype: tf.DType, name: str) -> tf.Variable:
    """A zero ``kind`` state variable (residual, velocity) outside any ``tf.function``."""
    with tf.init_scope():
        return tf.Variable(tf.zeros([numel], dtype), trainable=False, name=f"{kind}_{name}")


def _numel(variable: Any) -> int:
    # tf.Variable has a TensorShape, a Keras 3 variable a tuple.
    return int(np.prod(tuple(variable.shape), dtype=np.int64))


def _label(variable: Any) -> str:
    return repr(getattr(variable, "path", None) or getattr(variable, "name", "?"))
