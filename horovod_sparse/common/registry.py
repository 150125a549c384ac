"""State of the functional APIs, kept per (name, process set) across calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Generic, NamedTuple, TypeVar

from horovod_sparse.common.config import SparseConfig, make_config, reduction_scales
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.common.pipeline import BucketReducer

__all__ = ["NamedReducers", "PerTensorCall", "PerTensorOptions", "per_tensor_call"]

State = TypeVar("State")


class NamedReducers(Generic[State]):
    """One state per ``(name, process set)``: the residual owed under a name persists.

    Args:
        reducer_of: the :class:`BucketReducer` inside a state (the state itself for
            torch; a reducer plus its TF variables for TensorFlow).
    """

    def __init__(self, reducer_of: Callable[[State], BucketReducer]) -> None:
        self._reducer_of = reducer_of
        self._states: dict[tuple[str, int], State] = {}

    def obtain(
        self,
        name: str,
        process_set: Any,
        numel: int,
        config: SparseConfig,
        create: Callable[[State | None], State],
    ) -> State:
        """The state for ``name``; ``create(previous)`` builds a new one when there is none
        or the configuration changed (it should adopt ``previous``'s residual: the mass
        owed does not depend on the budget).

        Raises:
            ValueError: the tensor under ``name`` changed size.
        """
        key = (name, id(process_set))
        state = self._states.get(key)
        if state is not None and self._reducer_of(state).numel != numel:
            raise ValueError(
                f"sparse_allreduce({name!r}): size changed from "
                f"{self._reducer_of(state).numel} to {numel}; use a new name for a new tensor"
            )
        if state is None or self._reducer_of(state).config != config:
            state = create(state)
            self._states[key] = state
        return state

    def find(self, name: str, process_set: Any) -> State:
        """The state under ``name``, or a KeyError that says so."""
        key = (name, id(process_set))
        if key not in self._states:
            raise KeyError(f"no sparse_allreduce has run under name {name!r}")
        return self._states[key]

    def __getitem__(self, key: tuple[str, int]) -> State:
        return self._states[key]

    def items(self, process_set: Any) -> Iterator[tuple[str, State]]:
        """``(name, state)`` pairs of one process set."""
        return ((n, s) for (n, ps), s in self._states.items() if ps == id(process_set))

    def clear(self) -> None:
        self._states.clear()


class PerTensorCall(NamedTuple):
    """A validated functional call: its name, options and Average/Sum scales."""

    name: str
    config: SparseConfig
    prescale: float
    postscale: float


class PerTensorOptions(NamedTuple):
    """A functional call's validated name and options (:func:`per_tensor_call`), before
    its reduction is known."""

    name: str
    config: SparseConfig

    def scaled(
        self, op: str, process_set: Any, prescale_factor: float, postscale_factor: float
    ) -> PerTensorCall:
        """The whole call, once this rank is known to be in ``process_set`` and ``op``
        is Average or Sum.

        Raises:
            ValueError: a rank outside the process set, or another op.
        """
        if not process_set.included():
            raise ValueError(
                f"sparse_allreduce({self.name!r}): this rank is not in the process set"
            )
        prescale, postscale = reduction_scales(
            op, process_set.size(), prescale_factor, postscale_factor
        )
        return PerTensorCall(self.name, self.config, prescale, postscale)


def per_tensor_call(
    name: str | None,
    density: float,
    options: dict[str, Any],
    frontend: Frontend,
) -> PerTensorOptions:
    """The checks every framework's ``sparse_allreduce`` makes before any collective,
    on its name and options; :meth:`PerTensorOptions.scaled` checks the rest.

    Raises:
        ValueError: no name (residuals are kept per name), or an option out of range or
            not acted on by ``frontend``.
        TypeError: an unknown option.
    """
    if name is None:
        raise ValueError(
            "sparse_allreduce needs a name: residuals are kept per name, so the same logical "
            "tensor must be passed under the same name every step"
        )
    config = make_config(dict(options, density=density))
    refuse_unsupported(config, frontend)
    return PerTensorOptions(name, config)
