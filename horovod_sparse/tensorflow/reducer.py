"""Glue that runs the common step on TF gradients: buckets, flat buffers, variables.

The tape and the Keras optimizer reduce through :class:`GradientReducer`, which plans
the buckets by the rule torch shares (``plan_model``) and exchanges them through a
:class:`~horovod_sparse.tensorflow.buckets.BucketSet` (the shared engine's step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.buckets import Bucket, plan_model
from horovod_sparse.common.config import SparseConfig, optimizer_scales
from horovod_sparse.common.engine import BucketView
from horovod_sparse.common.flush import sum_over_ranks
from horovod_sparse.common.fusion import DenseFusion, FusionMember, plan_dense_runs
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.stats import StepStats, progress_line
from horovod_sparse.tensorflow.backend import BACKEND, VariableCell
from horovod_sparse.tensorflow.buckets import (
    BucketSet,
    BucketState,
    make_counts_variable,
    zeros_variable,
)
from horovod_sparse.tensorflow.correction import AdamSettings, correct

__all__ = [
    "HOROVOD_ARGUMENTS",
    "AdamSettings",
    "GradientReducer",
    "describe_variables",
    "horovod_arguments",
    "op_name",
]


# Horovod's own arguments of the tape and the Keras optimizer, as GradientReducer takes
# them (the same names in both signatures, as in hvd.DistributedGradientTape).
HOROVOD_ARGUMENTS = (
    "op",
    "gradient_predivide_factor",
    "compression",
    "sparse_as_dense",
    "process_set",
    "groups",
    "num_groups",
)


def horovod_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The :data:`HOROVOD_ARGUMENTS` of a front-end's call, from its arguments by name
    (the constructor's ``locals()``)."""
    return {name: arguments[name] for name in HOROVOD_ARGUMENTS}


def op_name(op: Any) -> str:
    """Horovod's reduce-op constant as the name :mod:`horovod_sparse.common` uses."""
    return {hvd.Average: "average", hvd.Sum: "sum"}.get(op, repr(op))


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
        make_state_variable: ``(initial, name) -> variable`` holding the tensor
            ``initial``: lets the Keras optimizer own the rest of a sparse bucket's state
            too (step count, boundaries, selection and reused global threshold: the
            ``state_cells`` of :class:`~horovod_sparse.common.sparse_bucket.SparseBucket`,
            all made at construction), so a restored run resumes its schedule. None: keep
            the backend's ``tf.Variable`` objects (:meth:`state_variables`).
        momentum, nesterov: momentum correction (DGC) for an SGD whose own momentum is
            off: with ``momentum > 0`` every bucket keeps a per-rank velocity
            ``u = momentum * u + grad`` (a ``make_variable`` variable, like the
            residual), the exchange carries ``u`` (``grad + momentum * u`` for Nesterov)
            and a sparse bucket zeroes the entries it sent in ``u``. The reduced result
            is then the step direction: the caller applies ``-lr`` times it.
        adam: Adam's correction: every sparse bucket keeps this rank's first and second
            moments (``make_variable`` kinds ``"exp_avg"`` and ``"exp_avg_sq"``) and
            the exchange carries Adam's bias-corrected direction
            (:func:`~horovod_sparse.common.correction.adam_direction`). The caller
            applies ``-lr`` times the result to the variables of
            :attr:`corrected_positions` and Adam's own update to the others (dense
            buckets).
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
        make_state_variable: Callable[[tf.Tensor, str], Any] | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        adam: AdamSettings | None = None,
    ) -> None:
        if not process_set.included():
            raise ValueError("this rank is not in the process_set")
        self.config = config
        self.name = name
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self.prescale, self.postscale = optimizer_scales(
            op_name(op), process_set.size(), float(gradient_predivide_factor)
        )
        make_variable = make_variable or zeros_variable
        self.momentum = float(momentum)
        self.adam = adam
        # Adam's step count t (bias correction), saved with the caller's variables.
        self._adam_step = make_variable("step", 1, tf.float32, "adam") if adam else None
        self.corrected_positions: set[int] = set()  # variables stepped by -lr * result
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
                _own_state(reducer, bucket.name, make_state_variable)
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
            if adam is not None and bucket.kind == "sparse":
                state.moments = (
                    make_variable("exp_avg", bucket.numel, dtype, bucket.name),
                    make_variable("exp_avg_sq", bucket.numel, dtype, bucket.name),
                )
                self.corrected_positions.update(positions)
            if self.momentum > 0:
                self.corrected_positions.update(positions)
            self.buckets.append((bucket, positions, state))
        members = self._fusion_members(compression)
        cap = config.dense_fusion_cap
        fusion = DenseFusion(members, cap) if len(members) >= 2 else None
        self.fused_runs = plan_dense_runs(members, [True] * len(members), cap) if fusion else []
        self.bucket_set = BucketSet(
            [bucket.name for bucket, _, _ in self.buckets],
            [state for _, _, state in self.buckets],
            fusion,
            self.prescale,
            self.postscale,
        )
        self._traced: Any = None  # the eager exchange, traced (see reduce())
        # log_every: reductions counted in a variable (a traced step counts too); rank 0
        # of the process set prints every log_every-th.
        self._reductions: tf.Variable | None = None
        self._prints = process_set.rank() == 0
        if config.log_every:
            with tf.init_scope():
                self._reductions = tf.Variable(0, dtype=tf.int64, trainable=False)

    def _fusion_members(self, compression: Any) -> list[FusionMember]:
        """Dense-step fusion's members (:mod:`~horovod_sparse.common.fusion`): the sparse
        buckets, laid out as torch lays out its arenas (one arena per stretch of adjacent
        sparse buckets of one dtype), so the same model gets the same runs. TF buckets
        are separate tensors: a run's contributions are concatenated. None with lossy
        compression (its rounding would have to be kept per bucket); with
        ``dense_fusion_bytes=0`` no run fits its cap."""
        if compression is not None and compression is not hvd.Compression.none:
            return []
        members: list[FusionMember] = []
        arena, offset, dtype = -1, 0, None
        for bucket, _, _ in self.buckets:
            if bucket.kind != "sparse":
                break  # sparse buckets come first (plan_model)
            if bucket.dtype != dtype:
                arena, offset, dtype = arena + 1, 0, bucket.dtype
            members.append(
                FusionMember(arena, offset, bucket.numel, tf.as_dtype(bucket.dtype).size)
            )
            offset += bucket.numel
        return members

    @property
    def fused_dense_runs(self) -> list[list[str]]:
        """Bucket names that share one allreduce on a step where they are all dense."""
        return [[self.buckets[i][0].name for i in run] for run in self.fused_runs]

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Reduced gradients, in the order of ``grads``. ``None`` gradients count as zeros.

        Called eagerly (the tape's ``gradient()`` outside a ``tf.function``), the
        exchange runs as one ``tf.function`` traced at the first call, as Horovod runs
        its tape's eager allreduces: eagerly, each of its ops would be dispatched from
        Python one at a time."""
        dense = [self._dense(g, v) for g, v in zip(grads, variables)]
        if not tf.executing_eagerly():
            return self._reduce_dense(dense)
        if self._traced is None:
            self._traced = tf.function(self._reduce_dense, autograph=False)
        return list(self._traced(dense))

    def _reduce_dense(self, dense: list[tf.Tensor]) -> list[Any]:
        out: list[Any] = list(dense)
        adam_step = None
        if self._adam_step is not None:
            adam_step = self._adam_step.assign_add(tf.ones([1], tf.float32))[0]
        corrected = [
            correct(
                tf.concat([tf.reshape(dense[p], [-1]) for p in positions], axis=0),
                state.velocity,
                state.momentum,
                state.nesterov,
                state.moments,
                self.adam,
                adam_step,
                self.process_set.size(),
            )
            for _, positions, state in self.buckets
        ]
        results = self.bucket_set.exchange(corrected)
        for (bucket, positions, _), result in zip(self.buckets, results):
            pieces = tf.split(result, [e.numel for e in bucket.entries])
            for p, piece in zip(positions, pieces):
                out[p] = tf.reshape(piece, tf.shape(dense[p]))
        if self._reductions is not None:
            self._log_progress(self._reductions.assign_add(1))
        return out

    def _log_progress(self, step: tf.Tensor) -> None:
        """Print :func:`progress_line` on every ``log_every``-th reduction. The step's
        counts go in as inputs, so they are read after this step stored them."""
        counts = [state.counts.read_value() for _, _, state in self.buckets]

        def show(step: tf.Tensor, *numbers: tf.Tensor) -> tf.Tensor:
            total = StepStats()
            for (_, _, state), values in zip(self.buckets, numbers):
                total += state.stats(values.numpy().tolist())
            if self._prints:
                print(progress_line(int(step), total, self.config.density), flush=True)
            return step

        # Stateful, so a traced step runs it though nothing reads the result.
        tf.cond(
            tf.equal(step % self.config.log_every, 0),
            lambda: tf.py_function(show, [step, *counts], tf.int64),
            lambda: step,
        )

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
        return self.bucket_set.stats()

    def flush_residuals(self, variables: Sequence[Any], learning_rate: Any) -> int:
        """Every rank's residuals summed (:mod:`horovod_sparse.common.flush`), each
        variable of a sparse bucket moved by ``-learning_rate * postscale`` times its
        part, the residuals zeroed; for a step ``v -= lr * result``. ``variables``: the
        ones this reducer was made with. Eager. Returns the number of values summed."""
        sparse = [(b, p, s) for b, p, s in self.buckets if s.residual is not None]
        residuals = [tf.convert_to_tensor(s.residual) for _, _, s in sparse]
        sums = sum_over_ranks(BACKEND, residuals, self.process_set, f"{self.name}.flush")
        for (bucket, positions, state), residual, total in zip(sparse, residuals, sums):
            for entry, position in zip(bucket.entries, positions):
                v = variables[position]
                part = tf.reshape(total[entry.offset : entry.offset + entry.numel], v.shape)
                v.assign_sub(tf.cast(learning_rate * self.postscale, v.dtype) * part)
            state.residual.assign(tf.zeros_like(residual))
        return sum(bucket.numel for bucket, _, _ in sparse)

    def residuals(self) -> dict[str, Any]:
        """Residual variable per sparse bucket."""
        return {b.name: s.residual for b, _, s in self.buckets if s.residual is not None}

    def velocities(self) -> dict[str, Any]:
        """Momentum-correction velocity variable per bucket (empty when it is off)."""
        return {b.name: s.velocity for b, _, s in self.buckets if s.velocity is not None}

    def moments(self) -> dict[str, tuple[Any, Any]]:
        """Adam-correction ``(exp_avg, exp_avg_sq)`` per sparse bucket (empty when off)."""
        return {b.name: s.moments for b, _, s in self.buckets if s.moments is not None}

    def state_variables(self) -> dict[str, Any]:
        """Every variable a resumed run needs, by ``"{kind}_{bucket}"``: residuals,
        velocities, Adam's moments and step, and each sparse bucket's step count,
        boundaries, selection and reused global threshold state; e.g.
        ``tf.train.Checkpoint(tape_state=...)``."""
        out: dict[str, Any] = {}
        if self._adam_step is not None:
            out["adam_step"] = self._adam_step
        for bucket, _, state in self.buckets:
            named = {"residual": state.residual, "velocity": state.velocity}
            if state.moments is not None:
                named["exp_avg"], named["exp_avg_sq"] = state.moments
            if isinstance(state.reducer, BucketReducer):
                named.update({k: _variable_of(c) for k, c in state.reducer.state_cells().items()})
            out.update({f"{k}_{bucket.name}": v for k, v in named.items() if v is not None})
        return out

    def bucket_views(self) -> list[BucketView]:
        """A read-only snapshot of every bucket (step count, boundaries, ...), in plan
        order, with host ints (call eagerly)."""
        return [
            replace(view, step=int(view.step), boundaries=tuple(int(b) for b in view.boundaries))
            for view in self.bucket_set.engine.views()
        ]


def _variable_of(cell: Any) -> Any:
    assert isinstance(cell, VariableCell), cell
    return cell.variable


def _own_state(
    reducer: BucketReducer, name: str, make: Callable[[tf.Tensor, str], Any] | None
) -> None:
    """Make every state cell of ``reducer`` now and, given ``make``, move each into a
    variable ``make`` creates (holding the same value), before any step reads it."""
    reducer.make_state_cells()
    if make is None:
        return
    for key, cell in reducer.state_cells().items():
        assert isinstance(cell, VariableCell), cell
        cell.variable = make(cell.get(), f"{key}_{name}")


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
