"""One bucket's step, written once for every framework (docs/design.md §2, §3).

:class:`BucketReducer` is a sparse bucket's state (:mod:`~.sparse_bucket`) with its two
paths: the sparse one (:mod:`~.sparse_stages`) and the dense ones (:mod:`~.dense_stages`).
A step of a given kind (chosen by the step plan, :mod:`~.plan`) is split at its
collectives so that an adapter can overlap them with computation: :meth:`launch`
starts it, :meth:`reduce_and_gather` finishes the reduce-scatter and launches the
all-gather, :meth:`finish` returns the dense result.
"""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Tensor, host_at_least
from horovod_sparse.common.dense_stages import DenseBucketReducer, DenseStages
from horovod_sparse.common.fusion import FusedPart
from horovod_sparse.common.inflight import GatherInFlight, OwnedSums, ScatterInFlight
from horovod_sparse.common.sparse_stages import SparseStages
from horovod_sparse.common.step import StepKind

__all__ = [
    "BucketReducer",
    "DenseBucketReducer",
    "GatherInFlight",
    "OwnedSums",
    "ScatterInFlight",
]


class BucketReducer(SparseStages, DenseStages):
    """Sparse allreduce of one flat buffer, with its error-feedback residual.

    Hyperparameters: ``config`` (density, selection, partition).
    Internal state: see :class:`~horovod_sparse.common.sparse_bucket.SparseBucket`.
    Statistics: ``last_stats()`` for the most recent step.
    """

    def accumulate(self, grad: Tensor, offset: int, prescale: float = 1.0) -> None:
        """Step 2 for one tensor of the bucket: ``residual[offset:] += prescale * grad``.

        Lets an adapter add each gradient as backward produces it, so the step needs no
        separate flat copy of the bucket.
        """
        self.residual = self.ops.add_scaled_at_(self.residual, offset, grad, prescale)

    def launch(self, kind: StepKind, buffer: Tensor, prescale: float = 1.0) -> Any:
        """Start a step of ``kind`` once all gradients are in (in ``buffer`` or in the
        residual, as the plan said): the in-flight state, or None for a fused step,
        whose contribution is then in ``buffer`` for its run's allreduce."""
        if kind is StepKind.DENSE_FUSED:
            self.contribute_fused(buffer, prescale, in_buffer=self.residual_clear)
            return None
        if kind is StepKind.DENSE_IN_BUFFER:
            began = self.ops.clock()
            self.advance(True)
            if prescale != 1.0:
                buffer = self.ops.scale(buffer, prescale)
            return self.start_dense(buffer, began, from_residual=False)
        return self.start(None, dense=kind is StepKind.DENSE_FROM_RESIDUAL)

    def start(
        self, grad: Tensor | None, prescale: float = 1.0, dense: Any = None
    ) -> ScatterInFlight | GatherInFlight:
        """Error feedback, then the dense allreduce of the accumulator or the local
        selection and reduce-scatter launch (steps 2-5).

        ``grad``: this step's gradients, or None when :meth:`accumulate` added them.
        ``dense``: the step's kind as the plan decided it (a traced TF step takes both
        kinds under a ``tf.cond`` on the step count); None: :attr:`dense_step`.
        """
        ops = self.ops
        began = ops.clock()
        if dense is None:
            dense = self.dense_step
        self.advance(dense)
        # Step 2: error feedback; the residual buffer becomes the accumulator in place.
        if grad is not None:
            self.residual = ops.add_scaled_(self.residual, grad, prescale)
        self.residual_clear = False  # the gradients are in it (see accumulate())
        if dense or host_at_least(self.k, self.numel):
            if self.joined is not None:  # planned sparse, but its budget reached n
                self.joined.withdraw(self)
            return self.start_dense(self.residual, began)
        return self.start_sparse(self.residual, began)

    def reduce_and_gather(self, inflight: ScatterInFlight | GatherInFlight) -> GatherInFlight:
        """Owner reduction, global selection, global residual collection, all-gather
        launch: :meth:`receive`, then :meth:`gather` (a no-op for a dense step)."""
        if isinstance(inflight, GatherInFlight):  # a dense step has no second stage
            return inflight
        return self.gather(self.receive(inflight))

    def start_fused(self, part: FusedPart) -> GatherInFlight:
        """The in-flight state of a fused step once its run's allreduce is launched."""
        return GatherInFlight(part, 0, part.buffer, None)

    def finish(
        self, inflight: GatherInFlight, like: Tensor, postscale: float = 1.0, out: Tensor = None
    ) -> Tensor:
        """Wait for the last collective and return ``postscale * sum`` as a flat buffer of
        length n, written into ``out`` when given (saves allocating n elements)."""
        if self.last_record.dense:
            return self.finish_dense(inflight, postscale, out)
        return self.finish_sparse(inflight, like, postscale, out)
