"""Mixed precision under the DDP hook: ``torch.amp.GradScaler``'s scale and skipped steps.

With fp16 autocast and a ``GradScaler``, DDP's buckets hold the gradients times the
scale S, and S changes (halved after an overflow, doubled every ``growth_interval``
steps). The hook keeps residuals and velocities or moments across steps, so it works in
unscaled units: each bucket is divided by S before the hook's correction and error
feedback, and its result multiplied by S again, for the scaler to unscale as usual.

A step whose result holds an inf or NaN is one the scaler skips. Every rank sees it: a
non-finite entry is always selected, and the result is gathered to every rank. Each
bucket's residual and velocity or moments are then put back as they were before the
step, so nothing the step added or sent is lost or counted twice. All of it on the
device, with no host sync: the scale is the scaler's own tensor, the check a mask.

Sends nothing. Keeps, while a bucket's exchange is in flight, a copy of its residual
and velocity or moments.
"""

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LossScaling"]


class LossScaling:
    """The hook's side of ``scaler`` (a ``torch.amp.GradScaler``)."""

    def __init__(self, scaler: Any) -> None:
        if not (hasattr(scaler, "get_scale") and hasattr(scaler, "scale")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, not {scaler!r}")
        self.scaler = scaler

    def scale(self, like: torch.Tensor) -> torch.Tensor:
        """The scale this backward pass ran with, as a tensor on ``like``'s device."""
        # GradScaler keeps it as a tensor (made at its first scale() call): reading that,
        # not get_scale(), costs a CUDA job no host sync.
        scale = getattr(self.scaler, "_scale", None)
        if scale is None:
            scale = torch.tensor(float(self.scaler.get_scale()))  # disabled: 1
        return scale.to(device=like.device, dtype=like.dtype)

    def begin(
        self, buffer: torch.Tensor, kept: list[torch.Tensor], holder: Any
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Unscale ``buffer`` in place and remember what the step may change: the
        tensors ``kept`` (updated in place) and ``holder.residual`` (a reducer's, or
        None). Returns the step's completion: it puts them back if the result is not
        finite, and scales the result again."""
        scale = self.scale(buffer)
        buffer.div_(scale)
        saved_kept = [t.clone() for t in kept]
        saved_residual = None if holder is None else holder.residual.clone()

        def finish(result: torch.Tensor) -> torch.Tensor:
            skipped = ~torch.isfinite(result).all()
            for tensor, before in zip(kept, saved_kept):
                tensor.copy_(torch.where(skipped, before, tensor))
            if saved_residual is not None:
                holder.residual = torch.where(skipped, saved_residual, holder.residual)
            return result.mul_(scale)

        return finish
