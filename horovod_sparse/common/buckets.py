"""Fusion buckets: which gradients are flattened together into one sparse exchange.

The plan is computed once from names, sizes and dtypes only, so every rank that holds
the same parameters computes the same plan, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["INT32_INDEX_LIMIT", "Bucket", "BucketEntry", "BucketPlan", "plan_buckets"]

# Indices travel as int32; the all-gather carries bucket-local indices, so a bucket
# (not the model) must stay below 2**31 elements.
INT32_INDEX_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class BucketEntry:
    """One tensor inside a bucket: elements ``[offset, offset + numel)`` of the flat buffer."""

    name: str
    numel: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of same-dtype tensors, exchanged as one unit."""

    index: int
    dtype: str
    entries: tuple[BucketEntry, ...]
    kind: str = "sparse"  # "sparse" or "dense": which exchange the bucket uses
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(e.numel for e in self.entries))

    @property
    def name(self) -> str:
        """Stable collective-name stem, identical on every rank."""
        return f"{self.kind}{self.index}.{self.dtype}"


@dataclass(frozen=True)
class BucketPlan:
    """The buckets, in readiness order."""

    buckets: tuple[Bucket, ...]


def plan_buckets(
    tensors: Sequence[tuple[str, int, str, int]],
    capacity_bytes: int,
    groups: Sequence[Sequence[str]] | None = None,
    kind: str = "sparse",
) -> BucketPlan:
    """Cut tensors into buckets of at most ``capacity_bytes`` (one tensor may exceed it).

    Args:
        tensors: ``(name, numel, dtype name, itemsize)`` in the order gradients are
            expected to become ready (reverse registration order for a typical model);
            the plan keeps that order so the first bucket fills first in backward.
        capacity_bytes: bucket capacity, like Horovod's fusion threshold.
        groups: optional explicit buckets as lists of names (Horovod's ``groups``); each
            group becomes its own bucket(s), split by dtype; tensors in no group are
            planned by capacity after them.
        kind: recorded on each bucket (``"sparse"`` or ``"dense"``); part of its name.

    Returns:
        The plan. It depends on its arguments only, so equal inputs on every rank give
        equal plans.

    Raises:
        ValueError: a tensor has 2**31 or more elements, or a name repeats.
    """
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor name {dup!r} appears more than once")
    info = {t[0]: t for t in tensors}
    for name, numel, _, _ in tensors:
        if numel > INT32_INDEX_LIMIT:
            raise ValueError(
                f"tensor {name!r} has {numel} elements; a single tensor must stay below 2**31 "
                "elements because bucket-local indices travel as int32"
            )

    buckets: list[Bucket] = []

    def emit(members: list[tuple[str, int, str, int]]) -> None:
        offset = 0
        entries = []
        for name, numel, _, _ in members:
            entries.append(BucketEntry(name, numel, offset))
            offset += numel
        buckets.append(Bucket(len(buckets), members[0][2], tuple(entries), kind))

    grouped: set[str] = set()
    for group in groups or ():
        by_dtype: dict[str, list[tuple[str, int, str, int]]] = {}
        for name in group:
            if name not in info:
                raise ValueError(f"group member {name!r} is not a parameter being reduced")
            if name in grouped:
                raise ValueError(f"parameter {name!r} appears in more than one group")
            grouped.add(name)
            by_dtype.setdefault(info[name][2], []).append(info[name])
        for members in by_dtype.values():
            emit(members)

    # Capacity planning per dtype, keeping readiness order; a bucket closes when the next
    # tensor would overflow it.
    open_buckets: dict[str, tuple[list[tuple[str, int, str, int]], int]] = {}
    for t in tensors:
        if t[0] in grouped:
            continue
        dtype, nbytes = t[2], t[1] * t[3]
        members, used = open_buckets.get(dtype, ([], 0))
        if members and (
            used + nbytes > capacity_bytes or sum(m[1] for m in members) + t[1] > INT32_INDEX_LIMIT
        ):
            emit(members)
            members, used = [], 0
        members.append(t)
        open_buckets[dtype] = (members, used + nbytes)
    for members, _ in open_buckets.values():
        if members:
            emit(members)
    return BucketPlan(tuple(buckets))
