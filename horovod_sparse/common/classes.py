"""Combining a framework's optimizer class with a sparse mixin, once per class."""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

__all__ = ["combined_class"]

M = TypeVar("M")

_COMBINED: dict[tuple[type, type], type[Any]] = {}


def combined_class(
    mixin: type[M], base: type, module: str, register: Callable[[type], type] | None = None
) -> type[M]:
    """``class Sparse<Base>(mixin, base)``, created once and cached.

    The class is a real subclass (zero-argument ``super()`` in the mixin reaches
    ``base``), named ``Sparse<Base>`` and published in ``module`` so pickle finds it.

    Args:
        mixin: the sparse mixin, placed first in the bases.
        base: the user's optimizer class.
        module: module name the class is published in.
        register: optional hook applied once to the new class (Keras serialization).
    """
    key = (mixin, base)
    if key not in _COMBINED:
        name = f"Sparse{base.__name__}"
        cls = type(name, (mixin, base), {"__module__": module, "__qualname__": name})
        if register is not None:
            cls = register(cls)
        _COMBINED[key] = cls
        vars(sys.modules[module]).setdefault(name, cls)
    return _COMBINED[key]
