"""Glue that runs the common stages on TF gradients: buckets, flat buffers, variables.

The tape, the Keras optimizer and the functional API all reduce through
:class:`GradientReducer` / :func:`run_bucket`; none of them repeats a stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.buckets import Bucket, plan_model
from horovod_sparse.common.config import SparseConfig, optimizer_scales
from horovod_sparse.common.correction import adam_direction, sgd_direction
from horovod_sparse.common.fusion import FusionMember, plan_dense_runs
from horovod_sparse.common.global_selection import grouped_threshold_keys
from horovod_sparse.common.pipeline import (
    BucketReducer,
    DenseBucketReducer,
    GatherInFlight,
    ScatterInFlight,
)
from horovod_sparse.common.stats import StepStats, allreduce_ring_bytes, progress_line
from horovod_sparse.common.step import StepRecord
from horovod_sparse.tensorflow.backend import TFBackend

__all__ = [
    "BACKEND",
    "AdamSettings",
    "BucketState",
    "GradientReducer",
    "describe_variables",
    "op_name",
    "run_bucket",
]

BACKEND = TFBackend()


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
    # Adam's correction: this rank's (exp_avg, exp_avg_sq) over the bucket, or None.
    moments: tuple[Any, Any] | None = None
    # The sparse step's record as traced: its host fields (row widths) complete the
    # figures stored in ``counts``.
    traced: StepRecord = field(default_factory=StepRecord)

    def stats(self, numbers: Sequence[float] | None = None) -> StepStats:
        """The last step's figures: ``numbers`` (the counts as read in a step), or the
        counts variable's."""
        values = self.counts.numpy().tolist() if numbers is None else numbers
        return self.reducer.stats_of(self.traced.with_numbers(values))


def make_counts_variable() -> tf.Variable:
    with tf.init_scope():  # created eagerly even when first called inside tf.function
        return tf.Variable(tf.zeros([len(StepRecord.NUMBERS)], tf.float64), trainable=False)


@dataclass(frozen=True)
class AdamSettings:
    """Adam's hyperparameters, for the Adam correction (see :class:`GradientReducer`)."""

    beta_1: float
    beta_2: float
    epsilon: float


# One bucket's step as the exchange hands it out: the result, the record's figures, the
# residual (None for a dense bucket) and the velocity (None without momentum correction).
Outputs = tuple[tf.Tensor, tf.Tensor, Any, Any]


def run_bucket(
    state: BucketState,
    flat: tf.Tensor,
    prescale: float,
    postscale: float,
    adam: AdamSettings | None = None,
    adam_step: Any = None,
) -> tf.Tensor:
    """One exchange of ``flat``: read the residual, run the stages, write residual and counts.

    With a velocity (momentum correction) the exchange carries ``u = m * u + flat``
    (``flat + m * u`` for Nesterov) instead of ``flat``; in a sparse bucket the entries
    this rank selects are zeroed in ``u`` too (momentum factor masking), a dense bucket
    keeps all of ``u`` as dense momentum SGD does.

    A sparse bucket's step is dense while the density schedule's budget reaches n
    (warm-up, density 1); in a graph both kinds are traced and a ``tf.cond`` on the step
    count (a variable) picks one per call. While the density decays the budget k itself
    follows the step count, in the graph (``TFBackend.sparse_budget``).
    """
    flat, velocity, updates = _correct(state, flat, adam, adam_step)
    return _store(state, _exchange_bucket(state, flat, velocity, prescale, postscale), updates)


def _correct(
    state: BucketState, flat: tf.Tensor, adam: AdamSettings | None, adam_step: Any
) -> tuple[tf.Tensor, tf.Tensor | None, list[Any]]:
    """Momentum correction in front of the exchange: what the exchange carries, this
    step's velocity (None without one) and the Adam moments' updates. The same whatever
    kind the step is, so it runs outside any ``tf.cond`` on the kind."""
    velocity = None
    updates: list[Any] = []
    if state.velocity is not None:
        u = tf.convert_to_tensor(state.velocity)
        flat, velocity = sgd_direction(BACKEND, flat, u, state.momentum, 0.0, state.nesterov)
    if state.moments is not None:
        assert adam is not None, "moments come with Adam's settings"
        first, second = (tf.convert_to_tensor(m) for m in state.moments)
        betas = (adam.beta_1, adam.beta_2)
        flat, first, second = adam_direction(
            BACKEND, flat, first, second, betas, adam.epsilon, adam_step
        )
        updates += [state.moments[0].assign(first), state.moments[1].assign(second)]
    return flat, velocity, updates


def _exchange_bucket(
    state: BucketState,
    flat: tf.Tensor,
    velocity: tf.Tensor | None,
    prescale: float,
    postscale: float,
) -> Outputs:
    reducer = state.reducer
    if not isinstance(reducer, BucketReducer):
        result, counts = _exchange_dense_bucket(reducer, flat, prescale, postscale)
        return result, counts, None, velocity
    result, counts, residual, masked = _exchange_sparse_bucket(
        state, reducer, flat, velocity, prescale, postscale
    )
    return result, counts, residual, masked if velocity is not None else None


def _exchange_sparse_bucket(
    state: BucketState,
    reducer: BucketReducer,
    flat: tf.Tensor,
    velocity: tf.Tensor | None,
    prescale: float,
    postscale: float,
) -> tuple[Any, ...]:
    """A sparse bucket's step, of the kind the density schedule gives
    (``BucketReducer.dense_step``): ``(result, counts, residual, velocity or residual)``, all
    tensors, so that a ``tf.cond`` can carry them."""
    residual = tf.convert_to_tensor(state.residual)

    def exchange(dense: bool) -> tuple[Any, ...]:
        return _exchange(state, reducer, flat, residual, velocity, dense, prescale, postscale)

    return BACKEND.cond(reducer.dense_step, lambda: exchange(True), lambda: exchange(False))


def _store(state: BucketState, outputs: Outputs, updates: list[Any]) -> tf.Tensor:
    """Write a step's residual, velocity and figures to the bucket's variables; the
    result, once they are written."""
    result, counts, residual, velocity = outputs
    updates = [*updates, state.counts.assign(counts)]
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
    stage = _begin(reducer, flat, residual, velocity, dense, prescale)
    return _end(state, reducer, reducer.reduce_and_gather(stage), flat, velocity, postscale)


def _begin(
    reducer: BucketReducer,
    flat: tf.Tensor,
    residual: tf.Tensor,
    velocity: tf.Tensor | None,
    dense: bool,
    prescale: float,
) -> ScatterInFlight | GatherInFlight:
    """The first stage of a sparse bucket's step of one kind, from ``residual``."""
    reducer.residual = residual
    reducer.velocity = velocity
    return reducer.start(flat, prescale, dense=dense)


def _end(
    state: BucketState,
    reducer: BucketReducer,
    inflight: GatherInFlight,
    flat: tf.Tensor,
    velocity: tf.Tensor | None,
    postscale: float,
) -> tuple[Any, ...]:
    """The result of a sparse bucket's step once its all-gather (or dense allreduce) is
    launched: ``(result, counts, residual, velocity)`` as :func:`_exchange` hands out."""
    result = reducer.finish(inflight, flat, postscale)
    record = reducer.last_record
    if not record.dense:
        state.traced = StepRecord(
            row_bytes=record.row_bytes, gather_row_bytes=record.gather_row_bytes
        )
    masked = reducer.velocity if velocity is not None else reducer.residual
    return result, _counts_vector(record), reducer.residual, masked


def _exchange_sparse_together(
    items: Sequence[tuple[BucketState, BucketReducer, tf.Tensor, tf.Tensor | None]],
    prescale: float,
    postscale: float,
) -> list[tuple[Any, ...]]:
    """The sparse steps of buckets that are sparse on every step (no warm-up, no decay,
    so no ``tf.cond`` on their kind), with their global-threshold refreshes grouped:
    every reduce-scatter is received first, then one ``tf.cond`` on whether any of them
    refreshes runs all their radix selects together (one allreduce of every bucket's
    histogram per digit, :func:`grouped_threshold_keys`), and each bucket takes its key
    where its own threshold refreshes. A step where none refreshes runs none of it.

    Sends: per bucket one alltoall and one allgather; 4 allreduces in all on a step
    where any bucket refreshes. Per bucket, as :func:`_exchange` hands it out.
    """
    stages = [
        _begin(reducer, flat, tf.convert_to_tensor(state.residual), velocity, False, prescale)
        for state, reducer, flat, velocity in items
    ]
    reducers = [reducer for _, reducer, _, _ in items]
    owned = []
    for reducer, stage in zip(reducers, stages):
        assert isinstance(stage, ScatterInFlight), "a sparse step scatters"
        owned.append(reducer.receive(stage))
    due = [tf.convert_to_tensor(r.refresh_due(sums)) for r, sums in zip(reducers, owned)]

    def grouped() -> list[tf.Tensor]:
        keys = grouped_threshold_keys(
            BACKEND,
            [sums.keys for sums in owned],
            [reducer.k for reducer in reducers],
            f"{reducers[0].name}.refresh",
            reducers[0].process_set,
        )
        return [tf.cast(key, sums.keys.dtype) for key, sums in zip(keys, owned)]

    def unused() -> list[tf.Tensor]:  # no bucket refreshes: no key is read
        return [tf.zeros([], sums.keys.dtype) for sums in owned]

    keys = BACKEND.cond(tf.reduce_any(tf.stack(due)), grouped, unused)
    return [
        _end(state, reducer, reducer.gather(sums, key), flat, velocity, postscale)
        for (state, reducer, flat, velocity), sums, key in zip(items, owned, keys)
    ]


def _exchange_dense_bucket(
    reducer: DenseBucketReducer, flat: tf.Tensor, prescale: float, postscale: float
) -> tuple[tf.Tensor, tf.Tensor]:
    inflight = reducer.reduce_and_gather(reducer.start(flat, prescale))
    result = reducer.finish(inflight, flat, postscale)
    return result, _counts_vector(reducer.last_record)


def _counts_vector(record: StepRecord) -> tf.Tensor:
    return tf.stack([tf.cast(value, tf.float64) for value in record.numbers()])


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
        self.fused_runs = self._plan_fusion(compression)
        # log_every: reductions counted in a variable (a traced step counts too); rank 0
        # of the process set prints every log_every-th.
        self._reductions: tf.Variable | None = None
        self._prints = process_set.rank() == 0
        if config.log_every:
            with tf.init_scope():
                self._reductions = tf.Variable(0, dtype=tf.int64, trainable=False)

    def _plan_fusion(self, compression: Any) -> list[list[int]]:
        """Dense-step fusion (:mod:`~horovod_sparse.common.fusion`): runs of adjacent
        sparse buckets (positions in :attr:`buckets`) that share one allreduce on a step
        where all of them are dense (warm-up, density 1), planned by the rule torch
        uses, ``plan_dense_runs``, within ``dense_fusion_cap`` bytes.

        TF buckets are separate tensors, not views of one arena: a run's buffers are
        concatenated. They are laid out as torch lays out its arenas (one per stretch
        of adjacent sparse buckets of one dtype), so the same model gets the same runs.
        Off with lossy compression, as in torch (its rounding would have to be kept per
        bucket), and with ``dense_fusion_bytes=0``.
        """
        if compression is not None and compression is not hvd.Compression.none:
            return []
        sparse = [i for i, (bucket, _, _) in enumerate(self.buckets) if bucket.kind == "sparse"]
        members: list[FusionMember] = []
        arena, offset, dtype = -1, 0, None
        for i in sparse:
            bucket = self.buckets[i][0]
            if bucket.dtype != dtype:
                arena, offset, dtype = arena + 1, 0, bucket.dtype
            members.append(
                FusionMember(arena, offset, bucket.numel, tf.as_dtype(bucket.dtype).size)
            )
            offset += bucket.numel
        if len(members) < 2:
            return []
        runs = plan_dense_runs(members, [True] * len(members), self.config.dense_fusion_cap)
        return [[sparse[m] for m in run] for run in runs]

    @property
    def fused_dense_runs(self) -> list[list[str]]:
        """Bucket names that share one allreduce on a step where they are all dense."""
        return [[self.buckets[i][0].name for i in run] for run in self.fused_runs]

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Reduced gradients, in the order of ``grads``. ``None`` gradients count as zeros."""
        dense = [self._dense(g, v) for g, v in zip(grads, variables)]
        out: list[Any] = list(dense)
        adam_step = None
        if self._adam_step is not None:
            adam_step = self._adam_step.assign_add(tf.ones([1], tf.float32))[0]
        corrected = [
            _correct(
                state,
                tf.concat([tf.reshape(dense[p], [-1]) for p in positions], axis=0),
                self.adam,
                adam_step,
            )
            for _, positions, state in self.buckets
        ]
        outputs = self._exchange_all(corrected)
        for (bucket, positions, state), (_, _, updates), done in zip(
            self.buckets, corrected, outputs
        ):
            result = _store(state, done, updates)
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

    def _exchange_all(self, corrected: list[tuple[Any, Any, list[Any]]]) -> list[Outputs]:
        """Every bucket's step. Buckets that are sparse on every step exchange together
        (:func:`_exchange_sparse_together`: their threshold refreshes share their
        allreduces). Otherwise the buckets of :attr:`fused_runs` take one ``tf.cond`` on
        the schedule: on a step where all of them are dense, one allreduce per run
        (:meth:`_exchange_run`); otherwise each its own step, dense or sparse."""
        outputs: list[Any] = [None] * len(self.buckets)
        together = self._always_sparse()
        # A run's members share the config and the step count: all of them are sparse
        # on every step (and exchanged together below), or none is.
        fused = [i for run in self.fused_runs for i in run if i not in together]
        for i, ((_, _, state), (flat, velocity, _)) in enumerate(zip(self.buckets, corrected)):
            if i not in fused and i not in together:
                outputs[i] = _exchange_bucket(state, flat, velocity, self.prescale, self.postscale)
        if together:
            items = [
                (self.buckets[i][2], self._sparse_reducer(i), *corrected[i][:2]) for i in together
            ]
            done = _exchange_sparse_together(items, self.prescale, self.postscale)
            for i, (result, counts, residual, masked) in zip(together, done):
                velocity = corrected[i][1]
                outputs[i] = (result, counts, residual, masked if velocity is not None else None)
        if not fused:
            return outputs

        def apart() -> list[tuple[Any, ...]]:
            return [
                _exchange_sparse_bucket(
                    self.buckets[i][2],
                    self._sparse_reducer(i),
                    corrected[i][0],
                    corrected[i][1],
                    self.prescale,
                    self.postscale,
                )
                for i in fused
            ]

        runs = [run for run in self.fused_runs if run[0] in fused]

        def run_together() -> list[tuple[Any, ...]]:
            return [part for run in runs for part in self._exchange_run(run, corrected)]

        # The runs' members share the config and the step count, so they are dense on
        # the same steps; every rank takes the same branch (its collectives must match).
        flags = [self._sparse_reducer(i).dense_step for i in fused]
        if all(isinstance(f, (bool, np.bool_)) for f in flags):
            all_dense: Any = all(flags)
        else:
            all_dense = tf.reduce_all(tf.stack([tf.convert_to_tensor(f) for f in flags]))
        for i, (result, counts, residual, masked) in zip(
            fused, BACKEND.cond(all_dense, run_together, apart)
        ):
            velocity = corrected[i][1]
            outputs[i] = (result, counts, residual, masked if velocity is not None else None)
        return outputs

    def _exchange_run(
        self, run: list[int], corrected: list[tuple[Any, Any, list[Any]]]
    ) -> list[tuple[Any, ...]]:
        """The dense step of a run's buckets as one allreduce of their concatenated
        contributions. Per bucket, as :func:`_exchange_sparse_bucket` hands it out.

        Each contribution is ``residual + prescale * grad``, as a dense step from the
        residual computes it: a residual that owes mass (restored from a checkpoint on
        one rank, say) moves into the allreduce whole and is cleared, so no mass stays
        behind, and a clear one adds zeros. Each bucket's record is a dense step's,
        with the bytes of an allreduce of its own share and its share of the wait.

        Sends: one ring allreduce of the run's values (the same bytes as one per bucket).
        """
        states = [self.buckets[i][2] for i in run]
        residuals = [tf.convert_to_tensor(state.residual) for state in states]
        parts = [
            BACKEND.add_scaled_(residual, corrected[i][0], self.prescale)
            for i, residual in zip(run, residuals)
        ]
        began = BACKEND.clock(*parts)
        first, last = self.buckets[run[0]][0].name, self.buckets[run[-1]][0].name
        summed = BACKEND.wait(
            BACKEND.allreduce_sum_async(
                tf.concat(parts, axis=0), f"{self.name}.fused.{first}-{last}", self.process_set
            )
        )
        waited = BACKEND.clock(summed) - began
        sizes = [self.buckets[i][0].numel for i in run]
        done = []
        for i, residual, numel, piece in zip(run, residuals, sizes, tf.split(summed, sizes)):
            reducer = self._sparse_reducer(i)
            reducer.advance(True)  # every kind of step advances the schedule
            if self.postscale != 1.0:
                piece = BACKEND.scale(piece, self.postscale)
            record = StepRecord(
                dense=1,
                gathered_rows=numel,
                own_rows=numel,
                next_rows=numel,
                extra_bytes=allreduce_ring_bytes(
                    numel, reducer.world_size, BACKEND.itemsize(residual)
                )[0],
                seconds_exchange=waited * numel / sum(sizes),
            )
            cleared = BACKEND.zero_(residual)
            velocity = corrected[i][1]
            done.append(
                (piece, _counts_vector(record), cleared, cleared if velocity is None else velocity)
            )
        return done

    def _always_sparse(self) -> list[int]:
        """The sparse buckets whose every step is sparse (their ``dense_step`` is a host
        False: no warm-up, no decay, no density 1), when there are two or more of them:
        their threshold refreshes are grouped (:func:`_exchange_sparse_together`), and
        dense-step fusion has no dense step to fuse."""
        members = [
            i
            for i, (_, _, state) in enumerate(self.buckets)
            if isinstance(state.reducer, BucketReducer) and state.reducer.dense_step is False
        ]
        return members if len(members) >= 2 else []

    def _sparse_reducer(self, position: int) -> BucketReducer:
        reducer = self.buckets[position][2].reducer
        assert isinstance(reducer, BucketReducer), "fusion runs hold sparse buckets"
        return reducer

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

    def moments(self) -> dict[str, tuple[Any, Any]]:
        """Adam-correction ``(exp_avg, exp_avg_sq)`` per sparse bucket (empty when off)."""
        return {b.name: s.moments for b, _, s in self.buckets if s.moments is not None}


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
