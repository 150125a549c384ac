"""Momentum correction in front of a TF bucket's exchange (docs/design.md §4.7): the
rules of :mod:`horovod_sparse.common.correction` on the bucket's TF variables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from horovod_sparse.common.correction import adam_direction, sgd_direction
from horovod_sparse.tensorflow.backend import BACKEND

__all__ = ["AdamSettings", "Corrected", "correct"]


@dataclass(frozen=True)
class AdamSettings:
    """Adam's hyperparameters, for the Adam correction (see ``GradientReducer``)."""

    beta_1: float
    beta_2: float
    epsilon: float


@dataclass
class Corrected:
    """What a bucket's exchange carries this step, this step's velocity (None without
    SGD's correction) and the Adam moments' variable updates."""

    flat: tf.Tensor
    velocity: tf.Tensor | None
    updates: list[Any]


def correct(
    flat: tf.Tensor,
    velocity: Any,
    momentum: float,
    nesterov: bool,
    moments: tuple[Any, Any] | None,
    adam: AdamSettings | None,
    adam_step: Any,
    ranks: int,
) -> Corrected:
    """SGD's momentum direction ``u = m * u + flat`` (``flat + m * u`` for Nesterov) from
    the velocity variable, or Adam's bias-corrected direction (normalized for the
    average of ``ranks`` ranks) from the moments' variables; ``flat`` itself without
    either. The same whatever kind the step is, so
    it runs outside any ``tf.cond`` on the kind."""
    updated = None
    updates: list[Any] = []
    if velocity is not None:
        u = tf.convert_to_tensor(velocity)
        flat, updated = sgd_direction(BACKEND, flat, u, momentum, 0.0, nesterov)
    if moments is not None:
        assert adam is not None, "moments come with Adam's settings"
        first, second = (tf.convert_to_tensor(m) for m in moments)
        betas = (adam.beta_1, adam.beta_2)
        flat, first, second = adam_direction(
            BACKEND, flat, first, second, betas, adam.epsilon, adam_step, ranks
        )
        updates += [moments[0].assign(first), moments[1].assign(second)]
    return Corrected(flat, updated, updates)
