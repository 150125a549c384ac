"""TF buckets run by the shared engine: each bucket's reducer and the TF variables that
carry its state between steps, and one exchange of all of them
(:meth:`~horovod_sparse.common.engine.Engine.reduce_all`).

The tape, the Keras optimizer and the functional API all reduce through
:class:`BucketSet`; none of them decides a step kind, advances a step count or builds a
step record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from horovod_sparse.common.engine import Engine
from horovod_sparse.common.fusion import DenseFusion
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepRecord
from horovod_sparse.tensorflow.backend import BACKEND
from horovod_sparse.tensorflow.correction import Corrected
from horovod_sparse.tensorflow.residual_variable import variable_of

__all__ = ["BucketSet", "BucketState", "make_counts_variable", "zeros_variable"]


@dataclass
class BucketState:
    """A reducer plus the TF variables that carry its state between steps.

    ``residual`` is checkpointable (``tf.Variable`` or Keras variable); ``counts`` holds
    the figures of the last step so :meth:`stats` works after a ``tf.function``.
    ``velocity`` (momentum correction) is this rank's SGD velocity over the bucket, or
    None; ``moments`` Adam's correction's (exp_avg, exp_avg_sq), or None.
    """

    reducer: BucketReducer | DenseBucketReducer
    residual: Any  # None for a dense bucket
    counts: tf.Variable
    velocity: Any = None
    momentum: float = 0.0
    nesterov: bool = False
    moments: tuple[Any, Any] | None = None
    # The sparse step's record as traced: its host fields (row widths) complete the
    # figures stored in ``counts``.
    traced: StepRecord = field(default_factory=StepRecord)

    def hand_in(self, velocity: tf.Tensor | None) -> None:
        """Give a sparse reducer its residual and this step's velocity."""
        if isinstance(self.reducer, BucketReducer):
            variable = variable_of(self.residual)
            residual = variable if variable is not None else tf.convert_to_tensor(self.residual)
            self.reducer.hand_in(residual, velocity)

    def store(self, result: tf.Tensor, velocity: tf.Tensor | None) -> tf.Tensor:
        """Write the step's residual, velocity (masked where a sparse bucket sent) and
        figures to the variables; the result, once they are written. Runs inside the
        branch that ran the step."""
        reducer = self.reducer
        record = reducer.last_record
        updates = [self.counts.assign(_counts_vector(record))]
        if isinstance(reducer, BucketReducer):
            if reducer.residual is not variable_of(self.residual):
                updates.append(self.residual.assign(reducer.residual))
            velocity = reducer.velocity
            if not record.dense:
                self.traced = StepRecord(
                    row_bytes=record.row_bytes, gather_row_bytes=record.gather_row_bytes
                )
        if self.velocity is not None and velocity is not None:
            updates.append(self.velocity.assign(velocity))
        with tf.control_dependencies(updates):
            return tf.identity(result)

    def stats(self, numbers: Sequence[float] | None = None) -> StepStats:
        """The last step's figures: ``numbers`` (the counts as read in a step), or the
        counts variable's."""
        values = self.counts.numpy().tolist() if numbers is None else numbers
        return self.reducer.stats_of(self.traced.with_numbers(values))


class BucketSet:
    """Buckets exchanged together each step by one :class:`Engine`.

    Args:
        names: bucket names, identical on every rank, in plan order (sparse first).
        states: one per bucket.
        fusion: dense-step fusion over the first sparse buckets, or None.
        prescale, postscale: the reduce op's factors.
    """

    def __init__(
        self,
        names: Sequence[str],
        states: Sequence[BucketState],
        fusion: DenseFusion | None,
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> None:
        self.states = list(states)
        # Eager calls of the functional API: its step traced, per scales and compression.
        self.traced: dict[Any, Any] = {}
        self.engine = Engine(BACKEND, names, [s.reducer for s in self.states], fusion)
        self.engine.prescale, self.engine.postscale = prescale, postscale

    def exchange(self, corrected: Sequence[Corrected]) -> list[tf.Tensor]:
        """Every bucket's step of ``corrected[i].flat``: the results, flat, once the
        buckets' variables hold their new state."""
        for state, part in zip(self.states, corrected):
            state.hand_in(part.velocity)

        def finished(index: int, result: tf.Tensor) -> tf.Tensor:
            return self.states[index].store(result, corrected[index].velocity)

        results = self.engine.reduce_all([part.flat for part in corrected], finished)
        done = []
        for result, part in zip(results, corrected):
            with tf.control_dependencies(part.updates):  # Adam's moments, outside any cond
                done.append(tf.identity(result))
        return done

    def stats(self) -> StepStats:
        """Statistics of the last exchange, summed over buckets."""
        total = StepStats()
        for state in self.states:
            total += state.stats()
        return total


def _counts_vector(record: StepRecord) -> tf.Tensor:
    return tf.stack([tf.cast(value, tf.float64) for value in record.numbers()])


def make_counts_variable() -> tf.Variable:
    with tf.init_scope():  # created eagerly even when first called inside tf.function
        return tf.Variable(tf.zeros([len(StepRecord.NUMBERS)], tf.float64), trainable=False)


def zeros_variable(kind: str, numel: int, dtype: tf.DType, name: str) -> tf.Variable:
    """A zero ``kind`` state variable (residual, velocity) outside any ``tf.function``."""
    with tf.init_scope():
        return tf.Variable(tf.zeros([numel], dtype), trainable=False, name=f"{kind}_{name}")
