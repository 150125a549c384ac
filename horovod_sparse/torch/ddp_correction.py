"""The optimizer's direction, computed by the DDP hook before the exchange (momentum
correction, docs/design.md §4.7 and §10).

A hook sees gradients, not the optimizer, so the state is told which direction to
compute, and the optimizer steps by the exchanged direction with plain SGD:

- SGD with momentum: ``SparseState(momentum=m, nesterov=...)``, then ``SGD(params, lr)``.
- Adam and AdamW: ``SparseState(betas=(b1, b2), eps=e)``, then ``SGD(params, lr,
  weight_decay=wd)``. Plain SGD's weight decay, ``p -= lr * (d + wd * p)``, is AdamW's
  decoupled decay, so at density 1 this is ``AdamW(params, lr, (b1, b2), e, wd)`` up to
  rounding (``wd = 0``: Adam).

Sends nothing. Keeps, per DDP bucket (key ``WHOLE``: a DDP instance's first iteration,
whose one bucket holds every parameter), this rank's velocity (SGD) or first and second
moments (Adam).
"""

from collections.abc import Callable
from typing import Any

import torch

from horovod_sparse.common.correction import adam_direction, sgd_direction
from horovod_sparse.torch.distributed import BACKEND

__all__ = ["WHOLE", "HookCorrection"]

WHOLE = -1
_OPS = BACKEND


class HookCorrection:
    """SGD's momentum (``momentum > 0``), Adam's moments (``betas`` given), or nothing."""

    def __init__(
        self, momentum: float, nesterov: bool, betas: tuple[float, float] | None, eps: float
    ) -> None:
        self.momentum, self.nesterov, self.betas, self.eps = momentum, nesterov, betas, eps
        self.kept: dict[int, list[torch.Tensor]] = {}

    @classmethod
    def checked(cls, momentum: Any, nesterov: Any, betas: Any, eps: Any) -> "HookCorrection":
        """The correction of ``SparseState``'s options, refusing bad ones."""
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be True or False, not {nesterov!r}")
        if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), not {momentum!r}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        if not isinstance(eps, (int, float)) or not eps > 0.0:
            raise ValueError(f"eps must be a number > 0, not {eps!r}")
        if betas is None:
            return cls(float(momentum), nesterov, None, float(eps))
        if momentum:
            raise ValueError("momentum is SGD's and betas Adam's: give one of them")
        try:
            beta1, beta2 = (float(b) for b in betas)
        except (TypeError, ValueError):
            beta1 = beta2 = -1.0
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must be two numbers in [0, 1), not {betas!r}")
        return cls(0.0, False, (beta1, beta2), float(eps))

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors kept per bucket, under torch's optimizers' state names."""
        if self.betas is not None:
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.momentum else ()

    def correct(self, key: int, buffer: torch.Tensor, step: int, ranks: int) -> None:
        """Replace the gradient in ``buffer`` by this rank's direction at ``step``
        (1-based) for an average over ``ranks`` ranks, updating what is kept for
        ``key``."""
        if not self.names:
            return
        kept = self.tensors(key, buffer)
        if self.betas is not None:
            first, second = kept
            direction, _, _ = adam_direction(
                _OPS, buffer, first, second, self.betas, self.eps, step, ranks
            )
        else:
            direction, _ = sgd_direction(_OPS, buffer, kept[0], self.momentum, 0.0, self.nesterov)
        buffer.copy_(direction)

    def tensors(self, key: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        """What is kept for ``key`` (made as zeros at its first use; none without a
        correction), on ``buffer``'s device and dtype."""
        if not self.names:
            return []
        kept = self.kept.get(key)
        if kept is None:
            # Zeros: the velocity then starts as g, and the moments as Adam's do.
            kept = self.kept[key] = [torch.zeros_like(buffer) for _ in self.names]
        elif kept[0].numel() != buffer.numel():
            raise RuntimeError(
                f"DDP bucket {key} changed from {kept[0].numel()} to {buffer.numel()} "
                f"entries after the hook kept its {self.names[0]}; it cannot be carried over"
            )
        elif kept[0].device != buffer.device or kept[0].dtype != buffer.dtype:
            kept = self.kept[key] = [t.to(buffer) for t in kept]  # e.g. loaded on the CPU
        return kept

    def masked(self, key: int) -> torch.Tensor | None:
        """The tensor whose sent entries are zeroed (DGC's momentum factor masking): the
        velocity; Adam's moments are not masked, as in the Horovod optimizer."""
        kept = self.kept.get(key)
        return kept[0] if kept is not None and self.betas is None else None

    def holds(self, key: int) -> bool:
        return key in self.kept

    def take_part(self, index: int, cut: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """The first rebuilt iteration: bucket ``index`` takes its parameters' part of
        the whole first bucket's tensors."""
        whole = self.kept.get(WHOLE)
        if whole is not None and index not in self.kept:
            self.kept[index] = [cut(t, index) for t in whole]

    def rename(self, key: int, new_key: int) -> None:
        if key in self.kept:
            self.kept[new_key] = self.kept.pop(key)

    def drop_whole(self) -> None:
        self.kept.pop(WHOLE, None)

    def state_dict(self) -> dict[str, Any]:
        # References, as torch optimizers' state; SGD's under the key states had before
        # Adam's existed.
        if self.betas is not None:
            return {"adam_moments": {key: list(kept) for key, kept in self.kept.items()}}
        return {"velocity": {key: kept[0] for key, kept in self.kept.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        moments, velocity = state.get("adam_moments") or {}, state.get("velocity") or {}
        held = "Adam's moments" if moments else "a momentum velocity" if velocity else None
        wanted = {(): None, ("momentum_buffer",): "a momentum velocity"}.get(
            self.names, "Adam's moments"
        )
        if held is not None and held != wanted:
            raise ValueError(
                f"this SparseState was saved with {held}; load it into a SparseState "
                "built with the same momentum or betas"
            )
        if moments:
            self.kept = {int(k): [t.clone() for t in ts] for k, ts in moments.items()}
        else:
            self.kept = {int(k): [v.clone()] for k, v in velocity.items()}
