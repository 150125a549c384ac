"""The state of one sparse bucket, and the only code that assigns it (docs/design.md §2, §3).

A sparse bucket keeps, between steps: its residual (what this rank still owes the sum),
its step count (the density schedule's position), the budget k of the current step, the
partition boundaries, the reused global threshold, the scheduler's choice and, with
momentum correction, the velocity whose sent entries are masked. The stage modules
(:mod:`~horovod_sparse.common.sparse_stages`, :mod:`~horovod_sparse.common.dense_stages`)
change it through the methods here; adapters hand tensors in and read results out.
"""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.global_selection import ReusedGlobalThreshold, histogram_bytes
from horovod_sparse.common.partition import make_partitioner
from horovod_sparse.common.selection import make_selection
from horovod_sparse.common.stats import StepStats, allgather_ring_bytes, allreduce_ring_bytes
from horovod_sparse.common.step import StepRecord

__all__ = ["SparseBucket"]


class SparseBucket:
    """One sparse bucket's state between steps.

    Args:
        ops: framework primitives.
        name: collective-name stem, identical on every rank.
        numel: buffer length n.
        like: a tensor with the buffer's dtype and device.
        config: hyperparameters (density, selection, partition).
        process_set: the ranks taking part (the adapter's process-set object).
        compression: the adapter's value compression (Horovod ``Compression``), or None.
    """

    def __init__(
        self,
        ops: Backend,
        name: str,
        numel: int,
        like: Tensor,
        config: SparseConfig,
        process_set: Any,
        compression: Any = None,
    ) -> None:
        self.ops = ops
        self.name = name
        self.numel = numel
        self.config = config
        self.process_set = process_set
        self.compression = compression
        self.rank = ops.rank(process_set)
        self.world_size = ops.size(process_set)
        self.selection = make_selection(config.selection, config.reestimate_steps)
        self.partitioner = make_partitioner(config.partition, config.repartition_steps)
        # Boundaries and the step count change from step to step: backend cells (host
        # values under PyTorch, variables under TensorFlow; see common/backend.py).
        self._boundaries = ops.cell(self.partitioner.boundaries(numel, self.world_size))
        self._step = ops.cell(0)
        self._residual = ops.zeros(numel, like)
        # Host-side knowledge that the residual holds only zeros (true at the start and
        # after a dense step without lossy compression). A dense step then needs nothing
        # from it, and the adapter can reduce the bucket buffer itself (the kind
        # DENSE_IN_BUFFER, common/plan.py). Assigning ``residual`` clears it.
        self.residual_clear = True
        # The positions this step sent, which the residual still holds, and what the
        # step owes the residual since: written together by settle_residual(), in one
        # pass over the bucket where the backend is not in place.
        self._unsettled: tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]] | None = None
        # The step's joined exchange (common/joined.py), which the engine's plan sets
        # on each step's sparse buckets; None: the bucket exchanges on its own.
        self.joined: Any = None
        # Momentum correction's velocity over the bucket, or None: entries this rank
        # selects are zeroed in it too (momentum factor masking).
        self.velocity: Tensor | None = None
        # Set by an automatic scheduler: exchange this bucket densely while True.
        self.force_dense = False
        # The global threshold derived from the last all-gather (global_selection="reuse").
        self.reused_threshold = (
            ReusedGlobalThreshold(config.refresh_steps)
            if config.global_selection == "reuse"
            else None
        )
        # Budget of the current step: a host int, or a graph scalar (Backend.sparse_budget).
        self.k: Any = config.budget(numel)
        self.last_record = StepRecord()  # what the last step did

    @property
    def step(self) -> Any:
        """Steps started; drives the density schedule and the partition updates."""
        return self._step.get()

    @property
    def boundaries(self) -> Any:
        """Owner regions: P + 1 host ints (a graph tensor of them under TensorFlow)."""
        return self._boundaries.get()

    @boundaries.setter
    def boundaries(self, value: Any) -> None:
        self._boundaries.set(value)

    @property
    def residual(self) -> Tensor:
        """What this rank still owes the sum, one flat buffer over the bucket."""
        return self._residual

    @residual.setter
    def residual(self, value: Tensor) -> None:
        # Whoever writes the residual may have written mass into it.
        self._residual = value
        self.residual_clear = False

    def keep_unsent(self, accumulator: Tensor, sent: Tensor, values: Tensor) -> None:
        """The accumulator becomes the residual, less its entries at ``sent`` (which are
        ``values``; zeroed by :meth:`settle_residual`: until then the residual still
        holds them)."""
        self.residual = accumulator
        self._unsettled = (sent, values, [])

    def owe(self, indices: Tensor, values: Tensor) -> None:
        """Add ``values`` at ``indices`` to the residual, after this step's other
        additions (by :meth:`settle_residual`)."""
        assert self._unsettled is not None, "owed within a sparse step"
        self._unsettled[2].append((indices, values))

    def settle_residual(self) -> None:
        """Zero the entries this step sent, then add what it owes, in order."""
        assert self._unsettled is not None, "settled once a sparse step"
        sent, values, owed = self._unsettled
        self._unsettled = None
        self.residual = self.ops.zero_then_add(self.residual, sent, values, owed)

    def clear_residual(self) -> None:
        """Zero the residual: its mass reached the parameters some other way (a flush)."""
        self.residual = self.ops.zero_(self.residual)
        self.residual_clear = True

    def hand_in(self, residual: Tensor, velocity: Tensor | None) -> None:
        """Take the residual and velocity an adapter keeps between steps (TensorFlow
        reads them from its variables at every step: a traced step cannot hold tensors
        from one call to the next)."""
        self.residual = residual
        self.velocity = velocity

    def tensors(self) -> tuple[Tensor, Tensor | None, bool]:
        """The residual, the velocity and whether the residual is clear: what a branch
        of a traced step changes (see :meth:`rewind`)."""
        assert self._unsettled is None, "taken between steps"
        return self._residual, self.velocity, self.residual_clear

    def rewind(self, tensors: tuple[Tensor, Tensor | None, bool]) -> None:
        """Start again from :meth:`tensors`: each branch of a ``tf.cond`` on the step's
        kind begins from the state before the cond, not from the other branch's."""
        self._residual, self.velocity, self.residual_clear = tensors
        self._unsettled = None

    def make_state_cells(self) -> None:
        """Make now the cells the selection and the reused global threshold otherwise
        make at the first step (TensorFlow: so that a checkpoint of an optimizer that
        has not stepped yet holds them, and restores into them)."""
        self.selection.bind(self.ops, self._residual)
        if self.reused_threshold is not None:
            keys = self.ops.magnitude_keys(self.ops.zeros(1, self._residual))
            self.reused_threshold.bind(self.ops, keys)

    def state_cells(self) -> dict[str, Any]:
        """Every cell of this bucket's state (variables under TensorFlow) by name: the
        step count, the boundaries, the selection's and the reused global threshold's
        (those made so far: see :meth:`make_state_cells`), for a framework checkpoint
        that tracks variables."""
        cells: dict[str, Any] = {"step": self._step, "boundaries": self._boundaries}
        cells.update({f"selection_{k}": c for k, c in self.selection.cells().items()})
        if self.reused_threshold is not None:
            threshold = self.reused_threshold.cells()
            cells.update({f"global_threshold_{k}": c for k, c in threshold.items()})
        return cells

    # ---------------------------------------------------------------- the schedule
    @property
    def dense_step(self) -> Any:
        """Whether the next step is dense: warm-up, density 1, or a scheduler's choice.

        It depends only on the step count and the schedule, which every rank shares (not
        on a residual restored on one rank only), so ranks agree on it. A host bool, or
        under TF a graph bool on the step variable.
        """
        scheduled = self.ops.scheduled_budget(self.numel, self.config, self.step)
        return self.force_dense or scheduled >= self.numel

    def advance(self, dense: Any) -> None:
        """Begin a step: its budget k (n for a dense step), and one more step counted.

        Every kind of step comes here, once, so the density schedule stays aligned.
        A sparse step's density reads the step count only while it decays; under TF
        that k is a graph scalar (``Backend.sparse_budget``).
        """
        if dense:
            self.k = self.numel
        else:
            self.k = self.ops.sparse_budget(self.numel, self.config, self.step)
        self._step.set(self.step + 1)

    # ---------------------------------------------------------------- stats
    def stats_of(self, record: StepRecord) -> StepStats:
        """:class:`StepStats` of a step from its record with host numbers
        (:meth:`StepRecord.on_host`)."""
        dense_sent, dense_received = allreduce_ring_bytes(
            self.numel, self.world_size, self.ops.itemsize(self._residual)
        )
        sent = received = int(record.extra_bytes)
        dense = int(record.dense)
        if not dense:
            ag_sent, ag_received = allgather_ring_bytes(
                int(record.gathered_rows),
                int(record.own_rows),
                int(record.next_rows),
                record.gather_row_bytes,
            )
            refreshed = int(record.refreshed)
            hist_sent, hist_received = histogram_bytes(self.world_size)
            hist_sent, hist_received = hist_sent * refreshed, hist_received * refreshed
            rows_out, rows_in = int(record.rows_sent), int(record.rows_received)
            if int(record.padded_rows):  # the padding travels too
                rows_out = rows_in = int(record.padded_rows)
            sent += rows_out * record.row_bytes + ag_sent + hist_sent
            received += rows_in * record.row_bytes + ag_received + hist_received
        return StepStats(
            bytes_sent=sent,
            bytes_received=received,
            dense_bytes=dense_sent + dense_received,
            numel=self.numel,
            selected=int(record.gathered_rows),
            density=int(record.gathered_rows) / self.numel,
            seconds_select=float(record.seconds_select),
            seconds_exchange=float(record.seconds_exchange),
            dense_buckets=dense,
            sparse_buckets=1 - dense,
            global_refreshes=0 if dense else int(record.refreshed),
        )

    def last_stats(self) -> StepStats:
        """Statistics of the most recent completed step (reads device scalars)."""
        return self.stats_of(self.last_record.on_host(self.ops))

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry to continue exactly: the residual (this rank's
        mass still owed), the step (the density schedule's position), the selection's
        state (a reused threshold), the reused global threshold and the partition
        boundaries."""
        state = {
            "residual": self.residual,
            "step": self.step,
            "selection": self.selection.state_dict(),
            "boundaries": list(self.boundaries),
            "world_size": self.world_size,
        }
        if self.reused_threshold is not None:
            state["global_threshold"] = self.reused_threshold.state_dict(self.ops)
        return state

    def load_state_dict(self, state: dict[str, Any], share: float = 1.0) -> None:
        """Restore :meth:`state_dict`, the residual multiplied by ``share`` (the
        checkpoint policy of docs/design.md §6).

        Boundaries and a reused global threshold are restored only when the world size
        is the same (otherwise the partitioner starts again from its initial cut, and
        the threshold from a refresh); a checkpoint without the threshold refreshes too.
        """
        self.take_shared(int(state["step"]), None, None)
        self.selection.load_state_dict(state["selection"])
        same_world = int(state["world_size"]) == self.world_size
        self.restore_global_threshold(state.get("global_threshold") if same_world else None)
        if same_world:
            self.boundaries = [int(b) for b in state["boundaries"]]
        self.residual = self.ops.add_scaled_(
            self.ops.scale(self.residual, 0.0), state["residual"], share
        )

    def keep_share(self, share: float) -> None:
        """Keep ``share`` of the residual (a loaded residual that several ranks loaded:
        the checkpoint policy of docs/design.md §6)."""
        if share != 1.0:
            self.residual = self.ops.scale(self.residual, share)

    def take_shared(self, step: int, boundaries: Any, threshold: dict[str, Any] | None) -> None:
        """Take what every rank must agree on from another rank: the step count and, when
        given, the boundaries and the reused threshold (None: leave them)."""
        self._step.set(step)
        if boundaries is not None:
            self.boundaries = list(boundaries)
            if threshold is not None and self.reused_threshold is not None:
                # The row cap is this owner's own share, not shared; a rank that has
                # none yet (0) takes k for its next reused step.
                threshold = {**threshold, "cap": int(self.reused_threshold.row_cap)}
            self.restore_global_threshold(threshold)

    def take_residual(self, previous: SparseBucket) -> None:
        """Owe what ``previous`` owed: the same tensor under a new configuration (the
        mass owed does not depend on the budget)."""
        self.residual = previous.residual

    def restore_global_threshold(self, saved: dict[str, Any] | None) -> None:
        """Take a reused global threshold's saved state; None: refresh at the next
        sparse step. A no-op with ``global_selection="exact"``."""
        reuse = self.reused_threshold
        if reuse is None:
            return
        if saved is None:
            reuse.restart()
            return
        like = self.ops.magnitude_keys(self.ops.zeros(1, self.residual))  # an int32 key
        reuse.load_state_dict(self.ops, saved, like)
