"""A DDP hook checkpoint that one rank saves and every rank restores exactly
(docs/ddp.md, "Overlap with backward, and checkpoints saved by one rank").

``SparseState.state_dict()`` holds this rank's residuals only. A checkpoint written by
rank 0 alone (Accelerate's ``save_state``, Lightning's ``save_checkpoint``) then holds
rank 0's, and the residual policy of docs/design.md §6 shares them out: no mass counted
twice, but not the run that was interrupted. :class:`GatheredState` wraps the state so
that its ``state_dict()`` brings every rank's part to the process group's first rank,
and its ``load_state_dict()`` gives each rank its own part back.

Sends: one ``gather_object`` of each rank's state (residuals, velocities: about the
model's size a rank, on the CPU) to the group's first rank, per ``state_dict()``; it is
a collective, so every rank calls ``state_dict()`` (Accelerate and Lightning do; a rank-0
only ``torch.save(state.state_dict())`` keeps using ``SparseState`` itself). Keeps
nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from horovod_sparse.torch.ddp import SparseState

__all__ = ["GatheredState"]


class GatheredState:
    """``state`` as a checkpoint any one rank may save, e.g.
    ``accelerator.register_for_checkpointing(GatheredState(state))``.

    ``state_dict()`` (every rank calls it): on the group's first rank, ``{"world_size":
    P, "parts": {rank: SparseState.state_dict() of that rank}}``; on the others, their
    own part only. ``load_state_dict(saved)``: this rank's part when ``saved`` has it
    and was gathered at this world size, so every rank resumes exactly; otherwise the
    first part, by the residual policy of docs/design.md §6 (its mass counted once,
    with a warning).
    """

    def __init__(self, state: SparseState) -> None:
        self.state = state

    def _group(self) -> tuple[Any, int, int]:
        group = self.state.process_group
        return group, dist.get_rank(group), dist.get_world_size(group)

    def state_dict(self) -> dict[str, Any]:
        group, rank, size = self._group()
        own = _on_cpu(self.state.state_dict())
        parts: list[Any] | None = [None] * size if rank == 0 else None
        first = dist.get_global_rank(group, 0) if group is not None else 0
        dist.gather_object(own, parts, dst=first, group=group)
        gathered = dict(enumerate(parts)) if parts is not None else {rank: own}
        return {"world_size": size, "parts": gathered}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        _, rank, size = self._group()
        parts = {int(r): part for r, part in saved["parts"].items()}
        if int(saved["world_size"]) == size and rank in parts:
            self.state.load_state_dict(parts[rank])  # this rank's own: exact
        else:
            self.state.load_state_dict(parts[min(parts)])


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU (gather_object pickles its argument)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value
