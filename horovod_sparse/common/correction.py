"""Momentum correction's rules, written once on backend kernels (docs/design.md §4.7).

With error feedback, an entry that is not selected waits in the residual and arrives
later as one lump; an optimizer with momentum or adaptive moments mistreats such lumps.
The remedy (DGC's momentum correction, extended to Adam) computes the optimizer's
direction on each rank from its own gradient and exchanges that direction instead.
These functions are that computation; the adapters keep the state where their framework
keeps an optimizer's state, and step the parameters by ``-lr`` times the exchanged
direction (plus any decoupled weight decay, which the frameworks apply themselves).

Sends nothing. Keeps: the velocity (SGD) or the two moments (Adam) this rank computed,
which the caller stores.
"""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["CORRECTED_FAMILIES", "adam_direction", "correction_family", "sgd_direction"]

# Optimizer families whose direction the correction computes.
CORRECTED_FAMILIES = ("sgd", "adam")


def sgd_direction(
    ops: Backend,
    grad: Tensor,
    velocity: Tensor,
    momentum: float,
    dampening: float = 0.0,
    nesterov: bool = False,
) -> tuple[Tensor, Tensor]:
    """SGD's momentum step: ``u = m * u + (1 - dampening) * g``; the direction is ``u``,
    or ``g + m * u`` with Nesterov. Returns ``(direction, u)``; ``u`` is updated in place
    where the framework allows. Sums are linear, so at density 1 the exchanged average
    equals dense momentum SGD's direction up to rounding."""
    velocity = ops.momentum_update_(velocity, grad, momentum, 1.0 - dampening)
    direction = ops.add_scaled(grad, velocity, momentum) if nesterov else velocity
    return direction, velocity


def adam_direction(
    ops: Backend,
    grad: Tensor,
    first: Tensor,
    second: Tensor,
    betas: tuple[float, float],
    eps: float,
    step: Any,
    ranks: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Adam's bias-corrected step direction at ``step`` (1-based: a host number or a
    scalar tensor), normalized for the average of ``ranks`` ranks' gradients. Returns
    ``(direction, m, v)``; the moments are updated in place where the framework allows.

    Each rank keeps Adam's moments of its own gradient, but dense Horovod's Adam
    normalizes the average of ``ranks`` gradients, whose noise variance is ``1 /
    ranks`` of one rank's: where noise dominates a coordinate, dense's step is up to
    ``sqrt(ranks)`` times the per-rank direction's. The second moment of the average
    is estimated from this rank's moments alone, taking ``m_hat**2`` as the signal's
    square and the rest of ``v_hat`` as noise:
    ``v = v_hat / ranks + (1 - 1 / ranks) * min(m_hat**2, v_hat)`` (``v_hat`` where
    the signal dominates, ``v_hat / ranks`` where noise does). The direction is
    ``m_hat / (sqrt(v) + eps)``: Adam's own at ``ranks == 1``. It assumes the ranks'
    gradients are independent samples (data parallelism); where they are equal it
    steps up to ``sqrt(ranks)`` times further than Adam would."""
    beta1, beta2 = betas
    first = ops.moving_average_(first, grad, beta1)
    second = ops.moving_average_of_square_(second, grad, beta2)
    direction = ops.adam_ratio(first, second, 1.0 - beta1**step, 1.0 - beta2**step, eps, ranks)
    return direction, first, second


def correction_family(
    requested: bool | None,
    family: str | None,
    has_momentum: bool,
    sparse: bool,
    optimizer_name: str,
    supported: str,
) -> str | None:
    """Resolve the ``momentum_correction`` option, the same way in every framework.

    Args:
        requested: the option: ``None`` (on where it applies), ``True`` (insist),
            ``False`` (off).
        family: ``"sgd"`` or ``"adam"`` for an optimizer the correction knows, else None.
        has_momentum: whether that optimizer has momentum to correct (SGD with
            ``momentum > 0``; Adam always).
        sparse: whether some bucket can take a sparse step.
        optimizer_name, supported: for the error message.

    Returns:
        The family to correct, or None.

    Raises:
        ValueError: ``True`` for an optimizer the correction does not know.
    """
    if requested and family is None:
        raise ValueError(
            f"momentum_correction=True needs {supported} (or a subclass), got {optimizer_name}"
        )
    if requested is False or family is None:
        return None
    if requested is None and not (has_momentum and sparse):
        return None
    return family
