"""Budget arithmetic on host ints, which a backend inherits (see
:mod:`horovod_sparse.common.backend`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from horovod_sparse.common.config import budget

if TYPE_CHECKING:
    from horovod_sparse.common.config import SparseConfig

__all__ = ["HostCounts", "host_at_least"]


_ROUNDINGS: dict[str, Callable[[float], int]] = {
    "ceil": math.ceil,
    "floor": math.floor,
    "round": round,  # half to even, as tf.math.round
}


def host_at_least(count: Any, bound: int) -> bool:
    """Whether ``count`` is a host number of at least ``bound``.

    A graph scalar (a budget that follows a TF step variable) is never known here: its
    caller settles the comparison in the graph (a ``tf.cond`` on the schedule takes the
    dense step whenever the budget reaches n, so a graph budget is below n).
    """
    return isinstance(count, (int, float)) and count >= bound


class HostCounts:
    """Budget arithmetic on host ints: right wherever the step count is a host value.

    A backend whose step count can be a graph value (TF's ``tf.Variable`` under
    ``tf.function``) overrides both methods, so that a budget that follows the step
    count (``density_decay_steps``) is computed in the graph.
    """

    def sparse_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        """k of a sparse step (past any warm-up) at ``step``:
        ``budget(numel, config.sparse_density_at(step))``. Reads ``step`` only while the
        density decays."""
        return budget(numel, config.sparse_density_at(step))

    def scheduled_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        """k by the density schedule at ``step``, warm-up included (n while warm):
        ``budget(numel, config.density_at(step))``."""
        return budget(numel, config.density_at(step))

    def all_of(self, flags: Sequence[Any]) -> Any:
        """Whether every decision holds (a graph bool where one of them is)."""
        return all(flags)

    def any_of(self, flags: Sequence[Any]) -> Any:
        """Whether some decision holds (a graph bool where one of them is)."""
        return any(flags)

    def scaled_count(
        self,
        count: Any,
        numerator: float,
        denominator: int = 1,
        rounding: str = "floor",
        least: int | None = None,
        most: int | None = None,
    ) -> Any:
        """``rounding`` (``"ceil"``, ``"floor"``, or ``"round"``: half to even) of
        ``count * numerator / denominator``, then at most ``most`` and at least
        ``least`` where given; evaluated in that order, in float64, so that every
        backend gets the same integer from the same count."""
        value = _ROUNDINGS[rounding](count * numerator / denominator)
        if most is not None:
            value = min(most, value)
        if least is not None:
            value = max(least, value)
        return value
