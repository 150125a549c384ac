"""The cross-rank verdict of construction-time validation, shared by every adapter.

Each rank allgathers ``(verdict, entries)`` once (the adapter's small collective);
:func:`raise_on_any_rank` then raises the same kind of error on every rank, so a
problem on one rank never leaves the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["raise_on_any_rank", "verdict_of"]


def verdict_of(problem: Exception | None) -> str | None:
    """What this rank sends about its own arguments: None, or its error as text."""
    return None if problem is None else f"{type(problem).__name__}: {problem}"


def raise_on_any_rank(
    everyone: Sequence[tuple[str | None, list[Any]]],
    mine: list[Any],
    problem: Exception | None,
    noun: str,
    what: str,
    comparable: Callable[[Any], Any] = lambda entry: entry,
) -> None:
    """Raise this rank's ``problem``, another rank's verdict, or the first entry (a
    ``noun``: "parameter", "variable") whose ``comparable`` part differs between ranks.
    Returns only when every rank is valid and all hold the same entries."""
    if problem is not None:
        raise problem
    for rank, (their_problem, _) in enumerate(everyone):
        if their_problem is not None:
            raise ValueError(f"rank {rank} could not build {what}: {their_problem}")
    key = [comparable(entry) for entry in mine]
    for rank, (_, theirs) in enumerate(everyone):
        if [comparable(entry) for entry in theirs] == key:
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if comparable(a) != comparable(b):
                raise ValueError(
                    f"{noun} {i} differs between this rank {a} and rank {rank} {b}; "
                    f"every rank must build the same model and {what}"
                )
        raise ValueError(
            f"this rank has {len(mine)} {noun}s and rank {rank} has {len(theirs)}; "
            f"every rank must build the same model and {what}"
        )
