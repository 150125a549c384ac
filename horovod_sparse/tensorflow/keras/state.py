"""The Keras optimizer's read-only view of its sparse state (statistics, variables,
buckets), for users, checkpoints and tests."""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.engine import BucketView
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.reducer import GradientReducer

__all__ = ["SparseStateAccess"]

_UNBUILT = (
    "the optimizer has not been built yet (or this rank is outside its process_set, "
    "or every variable is local: there are no buckets)"
)


class SparseStateAccess:
    """Accessors of :class:`~horovod_sparse.tensorflow.keras.SparseOptimizerMixin`."""

    _gradient_reducer: GradientReducer | None = None

    @property
    def fused_dense_runs(self) -> list[list[str]]:
        """Bucket names that share one allreduce on a step where they are all dense
        (empty before the first step)."""
        reducer = self._gradient_reducer
        return reducer.fused_dense_runs if reducer is not None else []

    def stats(self) -> StepStats:
        """Statistics of the last update step (call eagerly)."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.stats()

    def residual_variables(self) -> dict[str, Any]:
        """Residual variable per sparse bucket (also part of ``optimizer.variables``)."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.residuals()

    def moment_variables(self) -> dict[str, tuple[Any, Any]]:
        """This rank's Adam-correction ``(exp_avg, exp_avg_sq)`` per sparse bucket (also
        part of ``optimizer.variables``); empty unless Adam's correction is on."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.moments()

    def state_variables(self) -> dict[str, Any]:
        """Every sparse-state variable a resumed run needs, by ``"{kind}_{bucket}"``
        (residuals, velocities, moments, and each sparse bucket's step count, boundaries,
        selection and reused global threshold state); all part of
        ``optimizer.variables``, so saved with the optimizer's checkpoint."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.state_variables()

    def bucket_views(self) -> list[BucketView]:
        """A read-only snapshot of every bucket (step count, boundaries, ...), in plan
        order (call eagerly)."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.bucket_views()

    def velocity_variables(self) -> dict[str, Any]:
        """This rank's momentum-correction velocity per bucket (also part of
        ``optimizer.variables``); empty unless the correction is on."""
        if self._gradient_reducer is None:
            raise RuntimeError(_UNBUILT)
        return self._gradient_reducer.velocities()
