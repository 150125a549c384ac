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

from horovod_sparse.common.buckets import Bucket, plan_model
from horovod_sparse.common.config import SparseConfig, optimizer_scales
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.backend import TFBackend

__all__ = [
    "BACKEND",
    "TF_OPTIONS",
    "BucketState",
    "GradientReducer",
    "describe_variables",
    "op_name",
    "run_bucket",
]

BACKEND = TFBackend()
_COUNT_SLOTS = 10  # >= BucketReducer.NUM_COUNTS


# What the TF adapters act on; the other options are refused by name (see the README).
TF_OPTIONS = frozenset(
    (
        "density",
        "min_sparse_numel",
        "selection",
        "partition",
        "fusion_threshold_bytes",
        "reestimate_steps",
        "repartition_steps",
        "warmup_steps",
        "error_feedback",
        "momentum_correction",
    )
)


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
    # The sparse step's row widths, for stats(): host ints fixed when it is traced.
    row_widths: dict[str, Any] | None = None

    def stats(self) -> StepStats:
        values = self.counts.numpy().tolist()[: self.reducer.NUM_COUNTS]
        return self.reducer.stats_from_counts(values, self.row_widths)


def make_counts_variable() -> tf.Variable:
    with tf.init_scope():  # created eagerly even when first called inside tf.function
        return tf.Variable(tf.zeros([_COUNT_SLOTS], tf.float64), trainable=False)


def run_bucket(state: BucketState, flat: tf.Tensor, prescale: float, postscale: float) -> tf.Tensor:
    """One exchange of ``flat``: read the residual, run the stages, write residual and counts.

    With a velocity (momentum correction) the exchange carries ``u = m * u + flat``
    (``flat + m * u`` for Nesterov) instead of ``flat``; in a sparse bucket the entries
    this rank selects are zeroed in ``u`` too (momentum factor masking), a dense bucket
    keeps all of ``u`` as dense momentum SGD does.

    During warm-up (``warmup_steps``) a sparse bucket's step is dense; in a graph both
    kinds are traced and a ``tf.cond`` on the step count (a variable) picks one per call.
    """
    reducer = state.reducer
    velocity = None
    if state.velocity is not None:
        velocity = state.momentum * tf.convert_to_tensor(state.velocity) + flat
        flat = flat + state.momentum * velocity if state.nesterov else velocity
    if not isinstance(reducer, BucketReducer):
        result, counts = _exchange_dense_bucket(reducer, flat, prescale, postscale)
        residual = None
    else:
        residual = tf.convert_to_tensor(state.residual)

        def exchange(dense: bool) -> tuple[Any, ...]:
            return _exchange(state, reducer, flat, residual, velocity, dense, prescale, postscale)

        warmup = reducer.config.warmup_steps
        if warmup:
            result, counts, residual, masked = BACKEND.cond(
                reducer.step < warmup, lambda: exchange(True), lambda: exchange(False)
            )
        else:
            result, counts, residual, masked = exchange(False)
        velocity = masked if velocity is not None else None
    updates = [state.counts.assign(counts)]
    if residual is not None:
        updates.append(state.residual.assign(residual))
    if velocity is not None:
        updates.append(state.velocity.assign(velocity))
    with tf.control_dependencies(updates):
        return tf.identity(result)


def _exchange(
    state: BucketState,
    reducer: BucketReducer,
    flat: tf.Tensor,
    residual: tf.Tensor,
    velocity: tf.Tensor | None,
    dense: bool,
    prescale: float,
    postscale: float,
) -> tuple[Any, ...]:
    """One kind of step of a sparse bucket: ``(result, counts, residual, velocity)``,
    returned rather than left on the reducer, so a ``tf.cond`` branch can hand them out.
    (A branch without a velocity returns the residual in its place.)"""
    reducer.residual = residual
    reducer.velocity = velocity
    inflight = reducer.reduce_and_gather(reducer.start(flat, prescale, dense=dense))
    result = reducer.finish(inflight, flat, postscale)
    counts, accounting = reducer.step_record()
    if not dense:
        state.row_widths = {k: accounting[k] for k in ("row_bytes", "gather_row_bytes")}
    masked = reducer.velocity if velocity is not None else reducer.residual
    return result, _counts_vector(counts), reducer.residual, masked


def _exchange_dense_bucket(
    reducer: DenseBucketReducer, flat: tf.Tensor, prescale: float, postscale: float
) -> tuple[tf.Tensor, tf.Tensor]:
    inflight = reducer.reduce_and_gather(reducer.start(flat, prescale))
    result = reducer.finish(inflight, flat, postscale)
    return result, _counts_vector(reducer.step_counts())


def _counts_vector(counts: list[Any]) -> tf.Tensor:
    values = [tf.cast(c, tf.float64) for c in counts]
    values += [tf.constant(0.0, tf.float64)] * (_COUNT_SLOTS - len(values))
    return tf.stack(values)


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
        for v in variables:
            if not tf.as_dtype(v.dtype).is_floating:
                raise TypeError(
                    f"variable {_label(v)} has dtype {tf.as_dtype(v.dtype).name}; "
                    "gradients must be floating point"
                )
        # Positions name the variables: the plan is the rule torch shares (plan_model).
        position = {id(v): str(i) for i, v in enumerate(variables)}
        group_names = None
        if groups is not None and not isinstance(groups, int):
            group_names = [[position[id(v)] for v in g if id(v) in position] for g in groups]
        plan = plan_model(
            describe_variables(variables),
            config.min_sparse_numel,
            config.bucket_bytes,
            group_names,
            groups if isinstance(groups, int) else num_groups,
        )
        plans = plan.buckets
        self.buckets: list[tuple[Bucket, list[int], BucketState]] = []
        for bucket in plans:
            positions = [int(e.name) for e in bucket.entries]
            dtype = tf.as_dtype(variables[positions[0]].dtype)
            like = tf.zeros([0], dtype)
            stem = f"{name}.{bucket.name}"
            reducer: BucketReducer | DenseBucketReducer
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


def describe_variables(variables: Sequence[Any]) -> list[tuple[str, int, str, int]]:
    """``(position, numel, dtype name, itemsize)`` per variable, as the planner takes them."""
    return [
        (str(i), _numel(v), tf.as_dtype(v.dtype).name, tf.as_dtype(v.dtype).size)
        for i, v in enumerate(variables)
    ]


def _numel(variable: Any) -> int:
    # tf.Variable has a TensorShape, a Keras 3 variable a tuple.
    return int(np.prod(tuple(variable.shape), dtype=np.int64))


def _label(variable: Any) -> str:
    return repr(getattr(variable, "path", None) or getattr(variable, "name", "?"))
