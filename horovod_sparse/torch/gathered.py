"""A checkpoint that one rank saves and every rank restores exactly, for the DDP hook's
``SparseState`` and for ``horovod_sparse.torch.DistributedOptimizer`` (docs/ddp.md,
"Overlap with backward, and checkpoints saved by one rank"; docs/pytorch.md).

Their ``state_dict()`` holds this rank's residuals only. A checkpoint written by rank 0
alone (Accelerate's ``save_state``, Lightning's ``save_checkpoint``, Horovod's
``if hvd.rank() == 0: torch.save(...)``) then holds rank 0's, and the residual policy of
docs/design.md §6 shares them out: no mass counted twice, but not the run that was
interrupted. :class:`GatheredState` wraps the state so that its ``state_dict()`` brings
every rank's part to the group's first rank, and its ``load_state_dict()`` gives each
rank its own part back.

Sends, per ``state_dict()``: each rank's state (residuals, velocities or moments, the
optimizer's own state: about the model's size a rank, on the CPU) to the group's first
rank: one ``gather_object`` (``torch.distributed``), or one pickled allgather within the
optimizer's Horovod process set, which has no gather. It is a collective, so every rank
calls ``state_dict()`` (Accelerate and Lightning do; code that saves on rank 0 alone
calls it on every rank first). Keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GatheredState"]

# (this rank, world size, a gather of one object per rank to the first: a list there)
_Group = tuple[int, int, Callable[[Any], "list[Any] | None"]]


class GatheredState:
    """``state`` as a checkpoint any one rank may save, e.g.
    ``accelerator.register_for_checkpointing(GatheredState(state))``.

    ``state``: the DDP hook's ``SparseState`` (over its process group), or a
    ``horovod_sparse.torch.DistributedOptimizer`` (over its process set).
    ``state_dict()`` (every rank calls it): on the group's first rank, ``{"world_size":
    P, "parts": {rank: state.state_dict() of that rank}}``; on the others, their own part
    only. ``load_state_dict(saved)``: this rank's part when ``saved`` has it and was
    gathered at this world size, so every rank resumes exactly; otherwise the first part,
    by the residual policy of docs/design.md §6 (its mass counted once, with a warning).
    """

    def __init__(self, state: Any) -> None:
        self.state = state

    def _group(self) -> _Group:
        process_set = getattr(self.state, "process_set", None)
        if process_set is not None:  # the Horovod optimizer
            from horovod_sparse.torch.collectives import allgather_object

            rank = process_set.rank()

            def allgather(own: Any) -> list[Any] | None:
                everyone = allgather_object(own, "hvds.gathered_state", process_set)
                return everyone if rank == 0 else None

            return rank, process_set.size(), allgather
        import torch.distributed as dist

        group = self.state.process_group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        first = dist.get_global_rank(group, 0) if group is not None else 0

        def gather(own: Any) -> list[Any] | None:
            parts: list[Any] | None = [None] * size if rank == 0 else None
            dist.gather_object(own, parts, dst=first, group=group)
            return parts

        return rank, size, gather

    def state_dict(self) -> dict[str, Any]:
        rank, size, gather = self._group()
        own = _on_cpu(self.state.state_dict())
        parts = gather(own)
        gathered = dict(enumerate(parts)) if parts is not None else {rank: own}
        return {"world_size": size, "parts": gathered}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        rank, size, _ = self._group()
        parts = {int(r): part for r, part in saved["parts"].items()}
        if int(saved["world_size"]) == size and rank in parts:
            self.state.load_state_dict(parts[rank])  # this rank's own: exact
        else:
            self.state.load_state_dict(parts[min(parts)])


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU (the gathers pickle their argument)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value
