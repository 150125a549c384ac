"""All-gather overlapped with the next forward pass (DeAR's second half).

With ``overlap_allgather=True`` the optimizer's ``step()`` does not wait for the
all-gathers: it finishes every bucket's reduce-scatter, launches every all-gather and
returns. Each bucket's update is applied later, just before its parameters are used:

* a forward pre-hook on every module that directly owns parameters waits for the
  all-gather of each bucket holding one of them, then steps the wrapped optimizer over
  that bucket's parameters only, with the hyperparameters the groups had when
  ``step()`` was called (a learning-rate scheduler may have changed them since);
* whatever is still pending is applied by :meth:`DeferredUpdates.apply_all`, which the
  optimizer calls at the first gradient of the next backward pass, from
  ``optimizer.state_dict()``, ``model.state_dict()`` and ``optimizer.flush()``, so no
  update is lost at the end of training and checkpoints hold every step.

With ``overlap_allgather="auto"`` the optimizer's scheduler may switch the overlap
off for a while; ``step()`` then applies every pending update at once, through the
same per-bucket path, so the trajectory is the same either way.

Stepping a subset of parameters relies on the wrapped optimizer treating parameters
independently (per-parameter state, as SGD, Adam, AdamW, RMSprop, Adagrad do).
Sends nothing itself: it only waits for the all-gathers the reducers launched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["DeferredUpdates"]


class DeferredUpdates:
    """Pending bucket updates of one optimizer, applied when their parameters are used.

    Args:
        optimizer: the sparse optimizer (its ``param_groups`` are narrowed per bucket).
        model: the module whose forward uses the optimizer's parameters.
        slot_of: parameter -> its bucket slot.
        apply_bucket: ``apply_bucket(slot, stage)`` waits for ``stage`` and steps ``slot``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        slot_of: dict[torch.Tensor, Any],
        apply_bucket: Callable[[Any, Any], None],
    ) -> None:
        self.optimizer = optimizer
        self._apply_bucket = apply_bucket
        # slot id -> (slot, in-flight all-gather), in launch order.
        self.pending: dict[int, tuple[Any, Any]] = {}
        self.hyperparameters: list[dict[str, Any]] = []
        self._handles = []
        covered: set[int] = set()
        for module in model.modules():
            slots = {
                id(slot_of[p][0]): slot_of[p][0]
                for p in module.parameters(recurse=False)
                if p in slot_of
            }
            if slots:
                covered.update(slots)
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(list(slots.values())))
                )
        missing = {id(slot) for slot, _ in slot_of.values()} - covered
        if missing:
            raise ValueError(
                f"{len(missing)} bucket(s) hold parameters that are not in the model passed "
                "as model=; pass the module whose parameters the optimizer updates"
            )
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self.apply_all()))

    def _pre_hook(self, slots: list[Any]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for slot in slots:
                if id(slot) in self.pending:
                    self._apply(slot)

        return hook

    # ------------------------------------------------------------------ queue
    def defer(self, slots_and_stages: list[tuple[Any, Any]]) -> None:
        """Queue one step's all-gathers; remember the groups' hyperparameters now."""
        self.hyperparameters = [
            {key: value for key, value in group.items() if key != "params"}
            for group in self.optimizer.param_groups
        ]
        self.pending = {id(slot): (slot, stage) for slot, stage in slots_and_stages}

    def apply_all(self, late: bool = False) -> None:
        """Apply every pending update, in launch order.

        ``late`` marks a call from the next backward pass: a bucket still pending
        then had its parameters used in forward before the update (a parameter
        used outside the modules that own it), so the result differs from
        ``overlap_allgather=False``; say so once.
        """
        if late and self.pending:
            warnings.warn(
                f"{len(self.pending)} bucket update(s) were still pending when backward "
                "began: their parameters were used in forward without a pre-hook of a "
                "module that owns them, so forward saw the previous values",
                stacklevel=3,
            )
        for slot, _ in list(self.pending.values()):
            self._apply(slot)

    def discard(self) -> None:
        """Wait for pending all-gathers and drop their updates (a checkpoint is
        being loaded, which replaces the state they would have changed)."""
        for slot, stage in list(self.pending.values()):
            slot.reducer.finish(stage, slot.flat, 1.0, out=slot.flat)
        self.pending = {}

    def _apply(self, slot: Any) -> None:
        _, stage = self.pending.pop(id(slot))
        self._apply_bucket(slot, stage)

    # ------------------------------------------------------------------ stepping
    @contextmanager
    def only(self, params: list[torch.Tensor]) -> Iterator[None]:
        """The optimizer's groups restricted to ``params``, with the hyperparameters of
        the deferred step; everything restored afterwards."""
        members = {id(p) for p in params}
        groups = self.optimizer.param_groups
        saved = [dict(group) for group in groups]
        for group, then in zip(groups, self.hyperparameters):
            group.update(then)
            group["params"] = [p for p in group["params"] if id(p) in members]
        try:
            yield
        finally:
            for group, before in zip(groups, saved):
                group.clear()
                group.update(before)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
