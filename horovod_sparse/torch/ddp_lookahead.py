"""Residual lookahead for the DDP hook: each rank's forward and backward run where the
update pending in the hook's residuals takes the parameters.

    state = SparseState(density=0.01, betas=(0.9, 0.999))  # Adam's correction
    model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, weight_decay=0.01)
    state.residual_lookahead(optimizer)

The same lookahead as the sparse optimizer's (:mod:`horovod_sparse.torch.lookahead`):
``p = shared - lr * P * postscale * residual`` from a training forward to the
optimizer's step, with every rank's residual taken equal to this one's. A hook sees
gradients, not the optimizer, so the user hands it the optimizer; its ``step()`` is
wrapped by the optimizer's step hooks: the pre-hook puts the shared parameters back
before the step, the post-hook marks the lookahead due at the next training forward.

Sends nothing. Keeps a second buffer per parameter of the sparse DDP buckets.
"""

# No ``from __future__ import annotations``, as in ddp.py.
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from horovod_sparse.torch.distributed import BACKEND
from horovod_sparse.torch.flush import Owed, flush_owed
from horovod_sparse.torch.lookahead import Lookahead, plain_sgd

if TYPE_CHECKING:
    from horovod_sparse.torch.ddp import SparseState

__all__ = ["HookLookahead"]


class HookLookahead(Lookahead):
    """Moves each parameter of the hook's sparse DDP buckets by the pending update of
    its bucket's residual, around ``optimizer``'s steps.

    Raises:
        ValueError: where the step would not go where the lookahead moves: the
            optimizer must be ``torch.optim.SGD`` without momentum (the hook runs SGD's
            momentum or Adam's moments itself: ``SparseState(momentum=...)`` or
            ``betas=...``), and the state must keep a residual (error feedback).
    """

    def __init__(self, state: "SparseState", optimizer: torch.optim.Optimizer) -> None:
        if not plain_sgd(optimizer):
            raise ValueError(
                "the hook's residual lookahead needs torch.optim.SGD without momentum, "
                "whose step is p -= lr * (averaged gradient): run SGD's momentum or "
                "Adam in the hook (SparseState(momentum=...) or SparseState(betas=...)) "
                f"and step with SGD(params, lr, weight_decay=...); got {type(optimizer).__name__}"
                + (" with momentum" if isinstance(optimizer, torch.optim.SGD) else "")
            )
        if not state.config.error_feedback:
            raise ValueError("the hook's residual lookahead needs error_feedback=True")
        self.state = state
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__(optimizer, self._params)
        self.take_at_next_forward()  # made between steps: the next forward takes one
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.remove()  # the step moves the shared parameters, as every rank holds them

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.take_at_next_forward()

    def detach(self) -> None:
        """Put the shared parameters back and stop looking ahead."""
        self.remove()
        self._due = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def shared_parameters(self) -> Any:
        """A context manager holding the shared parameters inside (for evaluation or a
        checkpoint between a training forward and the step)."""
        return self.removed()

    def _pending(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        ranks = dist.get_world_size(self.state.process_group)
        for owed in self._owed():
            if not owed.reducer.residual_clear:  # else nothing pending yet
                # Every rank's residual taken equal to this one's: P times this rank's share.
                yield owed.param, owed.residual, owed.share * ranks

    def _owed(self) -> Iterator[Owed]:
        """Each parameter's part of its DDP bucket's residual, in bucket order."""
        state, layout = self.state, self.state.layout
        by_position: dict[int, torch.Tensor] = {}
        for param in self._params:
            position = layout.position_of(param)
            if position is not None:
                by_position[position] = param
        for index, reducer in sorted(state.reducers.items()):
            positions = layout.buckets.get(index)
            if positions is None:
                continue
            offset = 0
            for position in positions:
                numel = layout.pieces[position][1]
                param = by_position.get(position)
                if param is not None:
                    yield Owed(param, reducer, offset, state.postscale(index))
                offset += numel

    def flush_residuals(self) -> int:
        """Apply every rank's pending update to the parameters and clear the hook's
        residuals, with one dense allreduce over the hook's process group
        (:mod:`horovod_sparse.torch.flush`). Call it on every rank where training ends,
        before the model is evaluated or saved for keeps. Returns the number of values
        summed."""
        self.remove()  # the flush moves the shared parameters
        return flush_owed(self._owed(), self.lr, BACKEND, self.state.process_group)
