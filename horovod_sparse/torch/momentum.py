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
  moments and sends the bias-corrected ``m / (sqrt(v) + eps)``, ``v`` normalized for
  the average of the ranks' gradients
  (:func:`~horovod_sparse.common.correction.adam_direction`). The step is
  ``p -= lr * exchanged`` (and AdamW's decoupled decay ``p *= 1 - lr * wd``). Error
  feedback then conserves the direction's mass: a lump moves a weight as far as the
  steps it stands for would have.

Only the parameters of sparse buckets are corrected: a parameter that is always reduced
densely (a tensor under ``min_sparse_numel``) steps by the wrapped optimizer's own
algorithm. The state lives where the wrapped optimizer keeps its own, under its own
names (SGD's ``momentum_buffer``; Adam's ``step``, ``exp_avg``, ``exp_avg_sq``), as views
of flat buffers over each bucket. So ``optimizer.state_dict()`` is complete, Horovod's
``broadcast_optimizer_state`` broadcasts it in place, and a checkpoint loads into the
plain torch optimizer too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from horovod_sparse.common.correction import adam_direction, correction_family, sgd_direction
from horovod_sparse.torch.backend import TorchBackend

__all__ = [
    "AdamCorrection",
    "Correction",
    "MomentumCorrection",
    "SGDSettings",
    "make_correction",
    "narrowed",
]

_OPS = TorchBackend()
_SGD_OFF = {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}


@contextlib.contextmanager
def narrowed(optimizer: torch.optim.Optimizer, keep: Iterable[torch.Tensor]) -> Iterator[None]:
    """The optimizer's groups restricted to the parameters in ``keep``; restored after."""
    members = {id(p) for p in keep}
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in members]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


class Correction:
    """What the optimizer adapter needs of a correction.

    ``buffer_names``: the flat per-bucket buffers to allocate; ``masked_buffer``: the one
    whose sent entries the reducer zeroes, or None; ``state_keys``: the wrapped
    optimizer's state names the buffers appear under, per buffer.
    """

    buffer_names: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()
    masked_buffer: str | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # Ranks whose directions are averaged: Adam's normalization follows it (the
        # optimizer sets it, and again when the world size changes).
        self.ranks = 1
        self.views: dict[str, dict[torch.Tensor, torch.Tensor]] = {
            name: {} for name in self.buffer_names
        }
        self.covered: set[torch.Tensor] = set()  # parameters of sparse buckets
        # Per sparse bucket (by name): its flat buffers (by buffer name).
        self.bucket_buffers: dict[str, dict[str, torch.Tensor]] = {}
        # The group dicts themselves: a scheduler (or a broadcast) changes their values
        # in place, and every update reads them afresh.
        self._groups = {p: group for group in optimizer.param_groups for p in group["params"]}

    def cover(
        self, bucket: str, params: list[torch.Tensor], offsets: list[int], like: torch.Tensor
    ) -> torch.Tensor | None:
        """Correct the parameters of sparse bucket ``bucket`` (laid out like ``like`` at
        ``offsets``): allocate its flat buffers. Returns the one whose sent entries the
        reducer zeroes (momentum factor masking), or None."""
        buffers = {name: torch.zeros_like(like) for name in self.buffer_names}
        self.bucket_buffers[bucket] = buffers
        for param, offset in zip(params, offsets):
            self.attach(param, buffers, offset)
        return buffers[self.masked_buffer] if self.masked_buffer is not None else None

    def attach(self, param: torch.Tensor, buffers: dict[str, torch.Tensor], offset: int) -> None:
        """Correct ``param``, with its slice of each of its bucket's flat buffers."""
        self.covered.add(param)
        for name in self.buffer_names:
            flat = buffers[name]
            self.views[name][param] = flat[offset : offset + param.numel()].view_as(param)

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The tensor this rank feeds into the exchange for ``param``; read it, do not
        keep or modify it (it may be a state buffer)."""
        raise NotImplementedError

    def step(self, wrapped_step: Callable[[Any], Any], closure: Any) -> Any:
        """Apply the exchanged directions now held in ``p.grad``: the wrapped
        optimizer's own step for parameters that are not corrected, the corrected rule
        for the others."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        native = [p for p in stepped if p not in self.covered]
        if native:
            with narrowed(self.optimizer, native):
                wrapped_step(None)
        if len(native) < len(stepped):
            with narrowed(self.optimizer, self.covered):
                self._step_corrected(wrapped_step)
        return loss

    def _step_corrected(self, wrapped_step: Callable[[Any], Any]) -> None:
        raise NotImplementedError

    def adopt_state(self) -> None:
        """Make the wrapped optimizer's state entries of corrected parameters views of the
        flat buffers again, taking their values (after ``load_state_dict`` replaced them).

        ``load_state_dict`` also replaces the group dicts: hyperparameters are read from
        the new ones from now on."""
        self._groups = {p: group for group in self.optimizer.param_groups for p in group["params"]}
        for param in self.covered:
            state = self.optimizer.state.get(param)
            if state:
                for name, key in zip(self.buffer_names, self.state_keys):
                    self._bind(state, key, self.views[name][param])

    @staticmethod
    def _bind(state: dict[str, Any], key: str, view: torch.Tensor) -> None:
        """``state[key]`` becomes ``view``, holding the value it had, if it had one."""
        value = state.get(key)
        if value is view:
            return
        if value is None:
            view.zero_()
        else:
            view.copy_(value)
        state[key] = view

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
    state_keys = ("momentum_buffer",)
    masked_buffer = "velocity"

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        s = SGDSettings.of_group(self._group_of(param))
        g = -grad if s.maximize else grad
        if s.weight_decay != 0.0:
            g = g.add(param.detach(), alpha=s.weight_decay)
        if s.momentum == 0.0:
            return g
        velocity = self.views["velocity"][param]
        state = self.optimizer.state[param]
        dampening = s.dampening
        if state.get("momentum_buffer") is None:
            # As torch.optim.SGD starts its momentum buffer: u = g, undamped
            # (m * 0 + 1 * g is g exactly).
            velocity.zero_()
            state["momentum_buffer"] = velocity
            dampening = 0.0
        else:
            self._bind(state, "momentum_buffer", velocity)
        direction, _ = sgd_direction(_OPS, g, velocity, s.momentum, dampening, s.nesterov)
        return direction

    def _step_corrected(self, wrapped_step: Callable[[Any], Any]) -> None:
        with self._plain_sgd():
            wrapped_step(None)

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
    state_keys = ("exp_avg", "exp_avg_sq")
    masked_buffer = None

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        group = self._group_of(param)
        beta1, beta2 = group["betas"]
        g = -grad if group.get("maximize", False) else grad
        if group["weight_decay"] != 0.0 and not _decoupled(self.optimizer, group):
            g = g.add(param.detach(), alpha=group["weight_decay"])
        first, second = self.views["exp_avg"][param], self.views["exp_avg_sq"][param]
        state = self.optimizer.state[param]
        if "step" not in state:
            # As torch.optim.Adam starts its state; the step count stays on the host
            # (a CPU tensor, as torch keeps it), so reading it costs no device sync.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for name, key in zip(self.buffer_names, self.state_keys):
            self._bind(state, key, self.views[name][param])
        state["step"] += 1
        t = float(state["step"])
        direction, _, _ = adam_direction(
            _OPS, g, first, second, (beta1, beta2), group["eps"], t, self.ranks
        )
        return direction

    def _step_corrected(self, wrapped_step: Callable[[Any], Any]) -> None:
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


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def make_correction(
    optimizer: torch.optim.Optimizer, requested: bool | None, sparse: bool
) -> Correction | None:
    """Resolve the ``momentum_correction`` option to a correction, or None.

    ``None`` (the default) turns it on when some step is sparse, for ``torch.optim.SGD``
    with momentum in any group and for ``torch.optim.Adam`` / ``AdamW``; ``True``
    insists on it (those optimizers only); ``False`` keeps the wrapped optimizer as it is.
    ``sparse``: whether some bucket can take a sparse step (a parameter large enough for
    a sparse bucket, and a density or warm-up that is not always dense).
    """
    family: str | None = None
    has_momentum = False
    if isinstance(optimizer, torch.optim.Adam):
        if any(group.get("amsgrad", False) for group in optimizer.param_groups):
            if requested:
                raise ValueError("momentum_correction does not support Adam(amsgrad=True)")
            return None
        family, has_momentum = "adam", True
    elif isinstance(optimizer, torch.optim.SGD):
        family = "sgd"
        has_momentum = any(float(g.get("momentum", 0.0)) > 0 for g in optimizer.param_groups)
    chosen = correction_family(
        requested,
        family,
        has_momentum,
        sparse,
        type(optimizer).__name__,
        "torch.optim.SGD, Adam or AdamW",
    )
    if chosen is None:
        return None
    return AdamCorrection(optimizer) if chosen == "adam" else MomentumCorrection(optimizer)
