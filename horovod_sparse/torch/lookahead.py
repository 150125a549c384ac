"""Residual lookahead: each rank computes its gradients where the pending update has taken it.

With error feedback, what a rank did not send waits in its residual; the shared
parameters move by it only when it is sent, about 1/density steps later. A rank that
computes its next gradients at the shared parameters therefore works with the last
~1/density steps of update missing. At density 0.01 that staleness costs more than the
other ranks' gradients bring: the char LM (AdamW, 500 steps, P = 2) ends worse than a
single rank training alone (2.59 against 2.53 validation loss).

With ``residual_lookahead`` a rank's training forward and backward run at the shared
parameters moved by the update pending in every rank's residual, estimated from its
own (every rank's taken equal to it)::

    p = shared - lr * postscale * P * residual

the error-feedback "virtual iterate" (the parameters had every rank sent everything)
as far as this rank can tell. Moving by its own share alone (``P`` left out) was worse
on the char LM at P = 4 (docs/accuracy.md). It needs a step that is linear in the
exchanged tensor, ``p -= lr * exchanged``: plain SGD, or momentum correction (SGD with
momentum, Adam, AdamW).

When: a forward pre-hook on every module (``register_module_forward_pre_hook``) takes
the lookahead at the first call, after a ``step()``, of a module in training mode that
holds one of the optimizer's parameters, with grad enabled: the model itself, or the
wrapper ``torch.compile`` returns, whose hooks run before its compiled graph. ``step()``
puts the shared values back before the optimizer applies the exchanged update (each
parameter's ``data`` is swapped back to the untouched shared tensor, so they stay
bit-identical on every rank). Between a step and the next training forward, evaluation
and checkpoints see the shared parameters.

Costs: a second buffer per parameter of the sparse buckets, and one elementwise pass a
step. Sends nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from horovod_sparse.common.buckets import Bucket
from horovod_sparse.common.engine import Engine
from horovod_sparse.torch.flush import engine_owed

__all__ = ["Lookahead", "ResidualLookahead", "lookahead_supported", "plain_sgd"]


def plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps ``p -= lr * (gradient + decay)``: SGD without momentum."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        group.get("momentum", 0.0) == 0.0 for group in optimizer.param_groups
    )


def lookahead_supported(
    optimizer: torch.optim.Optimizer, corrected: bool, what: str = "residual_lookahead=True"
) -> str | None:
    """Why ``residual_lookahead`` (or ``what``, another use of the pending update) cannot
    apply to ``optimizer``, or None if it can.

    The lookahead moves a parameter by ``lr`` times its pending exchanged tensor, which
    is where the step would take it only when the step is ``p -= lr * exchanged``.
    """
    if corrected or plain_sgd(optimizer):
        return None
    return (
        f"{what} needs a step that is linear in the averaged gradient: "
        "torch.optim.SGD without momentum, or momentum correction (SGD with momentum, "
        f"Adam, AdamW); got {type(optimizer).__name__} without momentum correction"
    )


def _unchanged(param: torch.Tensor, seen: tuple[int, int]) -> bool:
    """Whether ``param`` holds the storage it held, unwritten, when ``seen`` was taken
    (its address and version counter)."""
    return (param.data_ptr(), param._version) == seen


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class Lookahead:
    """Swaps each parameter between the shared values and the values moved by its
    pending update; a subclass says where the pending update is (:meth:`_pending`).

    Args:
        optimizer: the optimizer that steps the parameters (its groups give each
            parameter's ``lr``).
        params: the parameters that may move; the lookahead is taken at the first
            training forward of a module holding one of them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
        # The group dicts themselves: a learning-rate scheduler changes their values.
        self._groups = {p: group for group in optimizer.param_groups for p in group["params"]}
        # Per parameter, the one of its two buffers it does not hold now: while the
        # lookahead is applied, the exact shared values; otherwise the buffer the next
        # lookahead is written into. Swapping ``param.data`` between the two costs no
        # pass over memory, so a step pays one elementwise pass, not three.
        self._spare: dict[torch.Tensor, torch.Tensor] = {}
        # Each moved parameter's storage and version counter right after the move:
        # a parameter written since (a loaded checkpoint) is taken as the shared value.
        self._moved: dict[torch.Tensor, tuple[int, int]] = {}
        self._due = False  # a lookahead is taken at the next training forward
        owner = weakref.ref(self)
        mine = {id(param) for param in params}

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                # Inside a graph being traced: the module that holds this compiled
                # code (``torch.compile``'s wrapper) ran this hook eagerly already.
                return
            lookahead = owner()
            if lookahead is None or not lookahead._due or not module.training:
                return
            # The outermost module called that holds one of these parameters: this
            # optimizer's model (or a compiled or DDP wrapper of it), before it runs.
            if torch.is_grad_enabled() and any(id(p) in mine for p in module.parameters()):
                lookahead.apply()

        # Global: the optimizer does not know the model. Removed with this object.
        handle = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
        weakref.finalize(self, handle.remove)

    def _pending(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        """Per parameter with a pending update: the parameter, its pending residual (a
        view shaped like it) and the factor that turns that residual into the pending
        update over ``lr``."""
        raise NotImplementedError

    def lr(self, param: torch.Tensor) -> float:
        """The learning rate that steps ``param`` now (its group's)."""
        return float(self._groups[param]["lr"])

    @property
    def applied(self) -> bool:
        return bool(self._moved)

    def take_at_next_forward(self) -> None:
        """Take the lookahead, from the residual as it is then, at the next training
        forward."""
        self._due = True

    @torch.no_grad()
    def apply(self) -> None:
        """Move each parameter by the pending update; keep the shared values aside."""
        self.remove()
        self._due = False
        for param, pending, scale in self._pending():
            ahead = self._spare.get(param)
            if ahead is None or not _same_layout(ahead, param):  # or moved or cast since
                ahead = torch.empty_like(param)
            alpha = self.lr(param) * scale
            torch.sub(param.data, pending.to(param.dtype), alpha=alpha, out=ahead)
            self._spare[param] = param.data
            param.data = ahead
            self._moved[param] = (param.data_ptr(), param._version)

    @torch.no_grad()
    def remove(self) -> None:
        """Put the shared values back (the parameters as every rank holds them)."""
        for param, moved in self._moved.items():
            if _unchanged(param, moved):
                self._swap(param)
            # else: written since (a load); its values are the shared ones now.
        self._moved.clear()

    def _swap(self, param: torch.Tensor) -> None:
        """Exchange the tensor ``param`` holds with its spare (no pass over memory)."""
        held = param.data
        param.data = self._spare[param]
        self._spare[param] = held

    def forget(self) -> None:
        """Take the parameters as they are now as the shared ones (after a broadcast)."""
        self._moved.clear()

    @contextmanager
    def removed(self) -> Iterator[None]:
        """The shared parameters inside the block; the same lookahead again after it
        (the residual may have taken new gradients since: it is not recomputed)."""
        swapped = [param for param, moved in self._moved.items() if _unchanged(param, moved)]
        self.remove()
        shared = {param: (param.data_ptr(), param._version) for param in swapped}
        try:
            yield
        finally:
            for param, state in shared.items():
                if _unchanged(param, state):  # not written inside the block
                    self._swap(param)
                    self._moved[param] = (param.data_ptr(), param._version)


class ResidualLookahead(Lookahead):
    """The sparse optimizer's: moves each parameter of its sparse buckets by the pending
    update, estimated from this rank's residual.

    Args:
        optimizer: the sparse optimizer.
        engine: whose sparse reducers hold the residuals and whose ``postscale`` turns
            a sum into the average.
        buckets, params: the engine's buckets and each bucket's parameters.
        ranks: the ranks whose residuals are pending (the optimizer sets
            :attr:`ranks` again when the world size changes).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        buckets: Sequence[Bucket],
        params: Sequence[Sequence[torch.Tensor]],
        ranks: int,
    ) -> None:
        self.engine = engine
        self.ranks = ranks
        self._buckets, self._params = buckets, params
        mine = [
            p
            for index, bucket in enumerate(buckets)
            if bucket.kind == "sparse"
            for p in params[index]
        ]
        super().__init__(optimizer, mine)

    def _pending(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        for owed in engine_owed(self.engine, self._buckets, self._params):
            if not owed.reducer.residual_clear:  # else nothing pending (no sparse step yet)
                # Every rank's residual taken equal to this one's: P times this rank's share.
                yield owed.param, owed.residual, owed.share * self.ranks
