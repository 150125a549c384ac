"""Momentum correction: the optimizer's momentum runs in front of the exchange.

With error feedback, an entry that is not selected waits in the residual and arrives
later as one lump. An optimizer with momentum or adaptive moments then mistreats the
lumps:

- SGD's momentum amplifies every lump by about 1/(1 - m), ten times for m = 0.9, and
  late. Training oscillates or diverges (measured on
  ``examples/pytorch/train_synthetic.py``: final loss 1.04 against 0.078 for dense).
- Adam divides each entry by the root of its second moment, so a lump of 100 steps of
  gradient moves a weight about as far as one step would. Entries that are sent rarely
  learn slowly.

The remedy (DGC's momentum correction, extended to Adam) computes the optimizer's
direction on each rank from its own gradient and exchanges that direction instead:

- :class:`MomentumCorrection` (SGD): velocity ``u = m * u + (1 - dampening) * g``, with
  ``g`` including weight decay; the exchange carries ``u`` (Nesterov: ``g + m * u``). The
  wrapped SGD then steps with momentum and weight decay off. Sums are linear, so at
  density 1 this equals dense momentum SGD up to rounding. Entries a rank sent are
  zeroed in its velocity (momentum factor masking; applied by
  :class:`~horovod_sparse.common.pipeline.BucketReducer`).
- :class:`AdamCorrection` (Adam, AdamW): each rank keeps its own first and second
  moments and sends the bias-corrected ``m / (sqrt(v) + eps)``. The step is
  ``p -= lr * exchanged`` (and AdamW's decoupled decay ``p *= 1 - lr * wd``). Error
  feedback then conserves the direction's mass: a lump moves a weight as far as the
  steps it stands for would have.

Both keep their state in flat buffers over each bucket (views per parameter), saved
with the optimizer's ``state_dict``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AdamCorrection",
    "Correction",
    "MomentumCorrection",
    "SGDSettings",
    "make_correction",
]

_SGD_OFF = {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}


class Correction:
    """What the optimizer adapter needs of a correction.

    ``buffer_names``: the flat per-bucket state buffers to allocate; ``masked_buffer``:
    the one whose sent entries the reducer zeroes, or None.
    """

    buffer_names: tuple[str, ...] = ()
    masked_buffer: str | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.views: dict[str, dict[torch.Tensor, torch.Tensor]] = {
            name: {} for name in self.buffer_names
        }
        self.steps = 0  # corrected steps taken
        # The group dicts themselves: a scheduler changes their values in place.
        self._groups = {p: group for group in optimizer.param_groups for p in group["params"]}

    def attach(self, param: torch.Tensor, buffers: dict[str, torch.Tensor], offset: int) -> None:
        """Give ``param`` its slice of each of its bucket's flat state buffers."""
        for name in self.buffer_names:
            flat = buffers[name]
            self.views[name][param] = flat[offset : offset + param.numel()].view_as(param)

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The tensor this rank feeds into the exchange for ``param``; read it, do not
        keep or modify it (it may be a state buffer)."""
        raise NotImplementedError

    def end_step(self) -> None:
        self.steps += 1

    def step(self, wrapped_step: Callable[[Any], Any], closure: Any) -> Any:
        """Apply the exchanged directions now held in ``p.grad``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        return self._groups[param]


@dataclass(frozen=True)
class SGDSettings:
    """The SGD hyperparameters of one parameter group that the correction takes over."""

    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    maximize: bool

    @classmethod
    def of_group(cls, group: dict[str, Any]) -> SGDSettings:
        return cls(
            momentum=float(group.get("momentum", 0.0)),
            dampening=float(group.get("dampening", 0.0)),
            nesterov=bool(group.get("nesterov", False)),
            weight_decay=float(group.get("weight_decay", 0.0)),
            maximize=bool(group.get("maximize", False)),
        )


class MomentumCorrection(Correction):
    """SGD: per-rank velocities; the wrapped SGD steps with momentum and decay off."""

    buffer_names = ("velocity",)
    masked_buffer = "velocity"

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        s = SGDSettings.of_group(self._group_of(param))
        g = -grad if s.maximize else grad
        if s.weight_decay != 0.0:
            g = g.add(param.detach(), alpha=s.weight_decay)
        if s.momentum == 0.0:
            return g
        velocity = self.views["velocity"][param]
        if self.steps == 0:
            velocity.copy_(g)  # as torch.optim.SGD starts its momentum buffer
        else:
            velocity.mul_(s.momentum).add_(g, alpha=1.0 - s.dampening)
        if s.nesterov:
            return g.add(velocity, alpha=s.momentum)
        return velocity

    def step(self, wrapped_step: Callable[[Any], Any], closure: Any) -> Any:
        with self._plain_sgd():
            return wrapped_step(closure)

    @contextlib.contextmanager
    def _plain_sgd(self) -> Iterator[None]:
        """The wrapped SGD as ``p -= lr * p.grad``: the update already holds the
        momentum and the weight decay."""
        keys = (*_SGD_OFF, "maximize")
        saved = [{key: group.get(key) for key in keys} for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group.update(_SGD_OFF)
            group["maximize"] = False
        try:
            yield
        finally:
            for group, values in zip(self.optimizer.param_groups, saved):
                group.update(values)


class AdamCorrection(Correction):
    """Adam and AdamW: per-rank moments; the exchange carries Adam's direction."""

    buffer_names = ("exp_avg", "exp_avg_sq")
    masked_buffer = None

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        group = self._group_of(param)
        beta1, beta2 = group["betas"]
        g = -grad if group.get("maximize", False) else grad
        if group["weight_decay"] != 0.0 and not _decoupled(self.optimizer, group):
            g = g.add(param.detach(), alpha=group["weight_decay"])
        first, second = self.views["exp_avg"][param], self.views["exp_avg_sq"][param]
        first.mul_(beta1).add_(g, alpha=1.0 - beta1)
        second.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        t = self.steps + 1
        denominator = (second / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
        return (first / (1.0 - beta1**t)).div_(denominator)

    def step(self, wrapped_step: Callable[[Any], Any], closure: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                lr = group["lr"]
                decay = group["weight_decay"] if _decoupled(self.optimizer, group) else 0.0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if decay != 0.0:
                        p.mul_(1.0 - lr * decay)
                    p.add_(p.grad, alpha=-lr)
        return loss


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def make_correction(
    optimizer: torch.optim.Optimizer, requested: bool | None, sparse: bool
) -> Correction | None:
    """Resolve the ``momentum_correction`` option to a correction, or None.

    ``None`` (the default) turns it on when some step is sparse, for ``torch.optim.SGD``
    with momentum in any group and for ``torch.optim.Adam`` / ``AdamW``; ``True``
    insists on it (those optimizers only); ``False`` keeps the wrapped optimizer as it is.
    """
    if isinstance(optimizer, torch.optim.Adam):
        if any(group.get("amsgrad", False) for group in optimizer.param_groups):
            if requested:
                raise ValueError("momentum_correction does not support Adam(amsgrad=True)")
            return None
        kind: type[Correction] | None = AdamCorrection
        has_momentum = True
    elif isinstance(optimizer, torch.optim.SGD):
        kind = MomentumCorrection
        has_momentum = any(float(g.get("momentum", 0.0)) > 0 for g in optimizer.param_groups)
    else:
        kind, has_momentum = None, False
    if requested is None:
        return kind(optimizer) if kind is not None and has_momentum and sparse else None
    if not requested:
        return None
    if kind is None:
        raise ValueError(
            f"momentum_correction=True needs torch.optim.SGD, Adam or AdamW (or a subclass), "
            f"got {type(optimizer).__name__}"
        )
    return kind(optimizer)
