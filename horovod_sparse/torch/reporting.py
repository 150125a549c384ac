"""What the sparse optimizer reports: statistics, buckets, schedule, trace, state.

Read-only views of the engine's state (:mod:`horovod_sparse.common.engine`) for users,
tests and tools; nothing here takes part in a step or sends anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from horovod_sparse.common.buckets import Bucket
from horovod_sparse.common.engine import BucketView, Engine
from horovod_sparse.common.scheduler import TrialOutcome
from horovod_sparse.common.stats import StepStats

if TYPE_CHECKING:
    from horovod_sparse.torch.momentum import Correction
    from horovod_sparse.torch.overlap import DeferredUpdates

__all__ = ["OptimizerReports"]


class OptimizerReports:
    """The reporting half of :class:`~horovod_sparse.torch.optimizer.SparseOptimizerMixin`."""

    engine: Engine
    _buckets: list[Bucket]
    _correction: Correction | None
    _deferred: DeferredUpdates | None

    @property
    def fused_dense_runs(self) -> list[list[str]]:
        """Bucket names reduced together by one allreduce in the current (or, between
        steps, the last) step: runs of adjacent dense buckets (see
        :mod:`horovod_sparse.common.fusion`)."""
        return [[self.engine.names[i] for i in run] for run in self.engine.fusion_runs]

    def pin_exchange(self, mode: str) -> None:
        """Exchange every sparse bucket ``"dense"``-ly or ``"sparse"``-ly from the next
        step on; ``scheduler="auto"`` decides no more. Call it on every rank at the same
        step (the ranks' collectives must match). A switch to dense sends each residual
        with its first dense step, so no gradient mass is lost."""
        if mode not in ("dense", "sparse"):
            raise ValueError(f"pin_exchange takes 'dense' or 'sparse', not {mode!r}")
        self.engine.pin(mode == "dense")

    def schedule(self) -> dict[str, dict[str, Any]]:
        """Per sparse bucket: the exchange the scheduler chose and its predictions.

        ``{"mode": "dense" | "sparse", "overlap": bool, "predicted_dense_s",
        "predicted_sparse_s", "local_s_per_element", "measured_dense_s",
        "measured_sparse_s"}`` (seconds per step; see
        :mod:`horovod_sparse.common.scheduler`). Before the first decision, or with
        ``scheduler="fixed"``, the mode is "sparse" and the figures are NaN. ``overlap``:
        whether the bucket's all-gather is left to the next forward pass (see
        :attr:`overlapping`).
        """
        return self.engine.schedule(self.overlapping)

    def schedule_trials(self) -> list[TrialOutcome]:
        """Every trial of the automatic scheduler so far: the modes before and tried
        (True: dense, per sparse bucket), the overlap before and tried (with
        ``overlap_allgather="auto"``), the median step seconds of each, and whether the
        tried setting was kept. Empty with ``scheduler="fixed"`` and no ``"auto"``
        overlap."""
        return self.engine.trials()

    def buckets(self) -> list[BucketView]:
        """A read-only snapshot of every bucket (name, kind, size, step, boundaries,
        the last step's kind), in plan order."""
        return self.engine.views()

    def bucket_parameters(self) -> dict[str, list[str]]:
        """Each bucket's parameter names, in the order of its buffer."""
        return {b.name: [e.name for e in b.entries] for b in self._buckets}

    def write_trace(self) -> str | None:
        """Write the Chrome trace (option ``trace``); returns its path, or None."""
        return self.engine.trace.write() if self.engine.trace is not None else None

    def trace_summary(self) -> dict[str, float]:
        """Reduce-scatter time hidden behind backward so far (option ``trace``)."""
        if self.engine.trace is None:
            raise RuntimeError("pass trace=<path> to the optimizer to record a trace")
        hidden = self.engine.trace.hidden
        return {
            "reduce_scatters": hidden.count,
            "lifetime_s": hidden.lifetime,
            "hidden_s": hidden.hidden,
            "hidden_fraction": hidden.fraction,
        }

    @property
    def overlapping(self) -> bool:
        """Whether ``step()`` leaves the all-gathers to the next forward pass: always
        with ``overlap_allgather=True``, as the scheduler last chose with ``"auto"``
        (always, too, when no bucket is sparse: there is then no scheduler)."""
        if self._deferred is None:
            return False
        scheduler = self.engine.scheduler
        return scheduler is None or scheduler.overlap is not False

    @property
    def pending_updates(self) -> int:
        """Bucket updates waiting for their all-gather (``overlap_allgather``); 0
        otherwise."""
        return len(self._deferred.pending) if self._deferred is not None else 0

    def stats(self) -> StepStats:
        """Statistics of the last synchronized step, summed over buckets and dense tensors."""
        return self.engine.stats()

    def residuals(self) -> dict[str, torch.Tensor]:
        """This rank's residual per bucket name (flat buffers; read-only views)."""
        return {n: r.residual for n, r in zip(self.engine.names, self.engine.sparse)}

    def velocities(self) -> dict[str, torch.Tensor]:
        """This rank's SGD momentum-correction velocity per bucket name (flat buffers;
        read-only views); empty unless SGD momentum correction is on."""
        buffers = self._correction.bucket_buffers if self._correction is not None else {}
        return {name: b["velocity"] for name, b in buffers.items() if "velocity" in b}

    @property
    def momentum_correction(self) -> bool:
        """Whether the optimizer's momentum runs in front of the exchange for the
        parameters of sparse buckets (see :mod:`horovod_sparse.torch.momentum`)."""
        return self._correction is not None
