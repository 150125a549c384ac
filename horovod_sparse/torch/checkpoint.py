"""The checkpoint half of the sparse optimizer: ``state_dict`` and ``load_state_dict``.

The wrapped optimizer's state travels as it is; the buckets' state (residuals, step
counts, selection and partition state) is the engine's, under one key, with the
residual policy of :meth:`~horovod_sparse.common.engine.Engine.restore`. Horovod's
``broadcast_optimizer_state`` is recognised, so the state every rank must agree on is
shared before it broadcasts the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from horovod_sparse.common.engine import Engine
from horovod_sparse.torch.collectives import allgather_object, horovod_state_broadcast_root

if TYPE_CHECKING:
    import torch

    from horovod_sparse.torch.lookahead import ResidualLookahead
    from horovod_sparse.torch.momentum import Correction
    from horovod_sparse.torch.overlap import DeferredUpdates

    # What the mixins are combined with (combined_class): type checkers see the wrapped
    # optimizer's methods and attributes; at run time a mixin has no base of its own.
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object

__all__ = ["OptimizerCheckpoint"]

_STATE_KEY = "horovod_sparse"


class OptimizerCheckpoint(_OptimizerBase):
    """``state_dict``/``load_state_dict`` of
    :class:`~horovod_sparse.torch.optimizer.SparseOptimizerMixin`."""

    engine: Engine
    process_set: Any
    _member: bool
    _owner_token: str
    _step_began: float | None
    _correction: Correction | None
    _deferred: DeferredUpdates | None
    _lookahead: ResidualLookahead | None

    if TYPE_CHECKING:  # the optimizer's own, which the checkpoint needs

        def flush(self) -> None: ...

        def _begin_step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus, per sparse bucket, this rank's residual,
        step count, selection state (threshold) and partition boundaries.

        With momentum correction, the per-rank velocity or moments are the wrapped
        optimizer's own state entries (``momentum_buffer``; ``step``, ``exp_avg``,
        ``exp_avg_sq``), so Horovod's ``broadcast_optimizer_state`` and a plain torch
        optimizer read them as their own. Residuals are per rank: save one checkpoint
        per rank to resume exactly. See :meth:`load_state_dict` for loading on another
        rank or world size.
        """
        self.flush()
        root = horovod_state_broadcast_root()
        if root is not None and self._member:
            self._take_shared_state_from(root)
            if self._lookahead is not None:
                # Horovod broadcasts the parameters with the optimizer's state (its
                # examples, elastic sync): they are now the shared ones on every rank.
                self._lookahead.forget()
        state = super().state_dict()
        if self._member:
            rank, size = self.process_set.rank(), self.process_set.size()
            state[_STATE_KEY] = self.engine.checkpoint(rank, size, self._owner_token)
        return state

    def _take_shared_state_from(self, root: int) -> None:
        """What every rank must agree on, taken from ``root`` (one small collective):
        each sparse bucket's step count (the density schedule, the scheduler's
        decisions) and partition boundaries.

        Horovod's ``broadcast_optimizer_state`` calls ``state_dict()`` first on every
        rank, then broadcasts the wrapped optimizer's state and hyperparameters only.
        After a restore on the root alone, the ranks would otherwise disagree on which
        steps are dense or when the scheduler decides, and wait in different collectives.
        """
        mine = (self.engine.shared_state(), self.engine.loaded_by, self._owner_token)
        everyone = allgather_object(mine, "hvds.opt.shared_state", self.process_set)
        members = getattr(self.process_set, "ranks", None) or list(range(len(everyone)))
        self.engine.adopt_shared_state(everyone[members.index(root)][0])
        # Every rank is here: the loads are settled too (a rank 0 that loaded a
        # checkpoint before the broadcast keeps all of it; a worker that joined an
        # elastic job, made since the others' last agreement, joins none).
        self._settle_among([(loaded_by, token) for _, loaded_by, token in everyone])
        self._step_began = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Residuals and velocities follow this policy:

        - written by this optimizer (elastic ``commit``/``restore``): restored as saved;
        - otherwise loaded as saved, and at the next step every rank says whose
          residuals it loaded (one ``allgather_object``): m ranks that loaded what the
          same rank saved each keep 1/m of it, so one checkpoint saved by rank 0 and
          loaded by every rank counts its mass once (with a warning: the other ranks'
          residuals at save time are not in it), and one checkpoint per rank restores
          exactly, at any world size. The velocity is loaded as saved. Owner regions
          are cut again for a new world size.

        Load on every rank of the process set, or on some ranks before the first
        step or before ``hvd.broadcast_optimizer_state``: the agreement is a
        collective of the step after a load (or of that broadcast).
        """
        state_dict = dict(state_dict)
        sparse_state = state_dict.pop(_STATE_KEY, None)
        if self._lookahead is not None:
            # Back to the shared parameters, except those a load has just written; the
            # next training forward looks ahead from the loaded residual.
            self._lookahead.remove()
        super().load_state_dict(state_dict)
        if self._correction is not None:
            # The loaded entries are new tensors: their values go into the flat buffers,
            # which the exchange masks and the correction updates.
            self._correction.adopt_state()
        if not self._member:
            return
        # A step interrupted by a failure (elastic restore) leaves exchanges in flight
        # whose handles belong to the old world; the restored state replaces them, as
        # it replaces updates still deferred to the next forward.
        if self._deferred is not None:
            self._deferred.discard()
        self._begin_step()
        if sparse_state is not None:
            self.engine.restore(sparse_state, self._owner_token)
            self._step_began = None
        if self._lookahead is not None:
            self._lookahead.take_at_next_forward()

    def _settle_loads(self) -> None:
        """At the first step after the engine was made or loaded from another process
        (every rank gets here, loaded or not): every rank says whose residuals it
        loaded, in one ``allgather_object``, and keeps its share of them
        (docs/design.md §6)."""
        if self.engine.loads_settled:
            return
        mine = (self.engine.loaded_by, self._owner_token)
        self._settle_among(allgather_object(mine, "hvds.opt.loaded_by", self.process_set))

    def _settle_among(self, everyone: list[Any]) -> None:
        """Keep this rank's share of what it loaded, from every rank's ``(loaded_by,
        owner token)``: a rank that loaded nothing still holds what it saved."""
        holders = {token for loaded_by, token in everyone if loaded_by is None}
        self.engine.settle_loaded([loaded_by for loaded_by, _ in everyone], holders)
