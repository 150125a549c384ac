"""A step whose gradients are all in at once (docs/design.md §1): the run of
:meth:`~horovod_sparse.common.engine.Engine.reduce_all`, split as the plan splits it.

Buckets of known kinds run together through the engine's run functions; a bucket
whose kind is a graph value runs under one ``Backend.cond`` (its dense or its sparse
step), a fused run whose fusing is one under another (the run's allreduce, or its
members' own steps). Each branch starts from the buckets' state before the cond.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from horovod_sparse.common.backend import Tensor
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.step import StepKind

if TYPE_CHECKING:
    from horovod_sparse.common.engine import Engine

__all__ = ["AllAtOnce", "Finished"]

# Called with a bucket's index and result once its step is done; returns the result
# (TensorFlow stores the bucket's state in its variables there).
Finished = Callable[[int, Tensor], Tensor]


class AllAtOnce:
    """The run of :meth:`Engine.reduce_all`: parts of the step, as the plan splits it."""

    def __init__(self, engine: Engine, flats: Sequence[Tensor], finished: Finished | None):
        self.engine = engine
        self.flats = flats
        self.finished = finished

    def run(self, indices: list[int], kinds: list[StepKind]) -> list[Tensor]:
        """The steps of ``indices``, of known ``kinds``, launched in order, then their
        gathers (threshold refreshes grouped), then their results."""
        engine = self.engine
        for index, kind in zip(indices, kinds):
            reducer = engine.reducers[index]
            if not isinstance(reducer, BucketReducer):
                engine.launch(index, self.flats[index], kind, result_in_buffer=False)
                continue
            # Error feedback: the gradients join what the residual owes.
            reducer.accumulate(self.flats[index], 0, engine.prescale)
            # A fused step's contribution is written over the gradients' tensor (a new
            # tensor: a run all at once fuses only on a backend that is not in place).
            buffer = self.flats[index] if kind is StepKind.DENSE_FUSED else reducer.residual
            engine.launch(index, buffer, kind, result_in_buffer=False)
        results = []
        for index, handle in engine.launch_gathers(indices=indices):
            result = engine.finish(index, handle)
            results.append(self.finished(index, result) if self.finished else result)
        return results

    def alone(self, index: int) -> Tensor:
        """A bucket whose kind is a graph value: one cond on its dense flag. Each branch
        starts from the bucket's state before the cond (a branch's trace changes the
        Python-side tensors; what lives in variables each branch reads afresh)."""
        reducer = _as_sparse(self.engine.reducers[index])
        before = reducer.tensors()

        def dense() -> Tensor:
            reducer.rewind(before)
            return self.run([index], [StepKind.DENSE_FROM_RESIDUAL])[0]

        def sparse() -> Tensor:
            reducer.rewind(before)
            return self.run([index], [StepKind.SPARSE])[0]

        plan = self.engine.plan
        assert plan is not None, "planned by reduce_all"
        return self.engine.ops.cond(plan.dense[index], dense, sparse)

    def together(self, members: list[int]) -> Callable[[], list[Tensor]]:
        """A fused run's branch: one allreduce for the run."""
        reducers = [_as_sparse(self.engine.reducers[index]) for index in members]
        before = [reducer.tensors() for reducer in reducers]

        def fused() -> list[Tensor]:
            for reducer, tensors in zip(reducers, before):
                reducer.rewind(tensors)
            return self.run(members, [StepKind.DENSE_FUSED] * len(members))

        return fused

    def apart(self, members: list[int]) -> Callable[[], list[Tensor]]:
        """A fused run's other branch: each member's own step."""
        reducers = [_as_sparse(self.engine.reducers[index]) for index in members]
        before = [reducer.tensors() for reducer in reducers]

        def each() -> list[Tensor]:
            for reducer, tensors in zip(reducers, before):
                reducer.rewind(tensors)  # not from the fused branch's trace
            return [self.alone(index) for index in members]

        return each


def _as_sparse(reducer: object) -> BucketReducer:
    assert isinstance(reducer, BucketReducer), "a sparse bucket's step"
    return reducer
