"""Fusion buckets: which gradients are flattened together into one sparse exchange.

The plan is computed once from names, sizes and dtypes only, so every rank that holds
the same parameters computes the same plan, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "INT32_INDEX_LIMIT",
    "Bucket",
    "BucketEntry",
    "BucketPlan",
    "ModelPlan",
    "plan_buckets",
    "plan_model",
]

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
    _check_tensors(tensors)
    buckets: list[Bucket] = []

    def emit(members: list[tuple[str, int, str, int]]) -> None:
        offset = 0
        entries = []
        for name, numel, _, _ in members:
            entries.append(BucketEntry(name, numel, offset))
            offset += numel
        buckets.append(Bucket(len(buckets), members[0][2], tuple(entries), kind))

    grouped = _group_members(tensors, groups or ())
    for members in grouped:
        emit(members)
    in_groups = {m[0] for members in grouped for m in members}
    for members in _capacity_members([t for t in tensors if t[0] not in in_groups], capacity_bytes):
        emit(members)
    return BucketPlan(tuple(buckets))


def _check_tensors(tensors: Sequence[tuple[str, int, str, int]]) -> None:
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor name {dup!r} appears more than once")
    for name, numel, _, _ in tensors:
        if numel > INT32_INDEX_LIMIT:
            raise ValueError(
                f"tensor {name!r} has {numel} elements; a single tensor must stay below 2**31 "
                "elements because bucket-local indices travel as int32"
            )


def _group_members(
    tensors: Sequence[tuple[str, int, str, int]], groups: Sequence[Sequence[str]]
) -> list[list[tuple[str, int, str, int]]]:
    """Explicit groups as bucket member lists, each group split by dtype."""
    info = {t[0]: t for t in tensors}
    seen: set[str] = set()
    out: list[list[tuple[str, int, str, int]]] = []
    for group in groups:
        by_dtype: dict[str, list[tuple[str, int, str, int]]] = {}
        for name in group:
            if name not in info:
                raise ValueError(f"group member {name!r} is not a parameter being reduced")
            if name in seen:
                raise ValueError(f"parameter {name!r} appears in more than one group")
            seen.add(name)
            by_dtype.setdefault(info[name][2], []).append(info[name])
        out.extend(by_dtype.values())
    return out


def _capacity_members(
    tensors: Sequence[tuple[str, int, str, int]], capacity_bytes: int
) -> list[list[tuple[str, int, str, int]]]:
    """Capacity planning per dtype, keeping readiness order; a bucket closes when the
    next tensor would overflow its bytes or the int32 index range."""
    closed: list[list[tuple[str, int, str, int]]] = []
    open_buckets: dict[str, tuple[list[tuple[str, int, str, int]], int, int]] = {}
    for t in tensors:
        dtype, nbytes = t[2], t[1] * t[3]
        members, used, numel = open_buckets.get(dtype, ([], 0, 0))
        if members and (used + nbytes > capacity_bytes or numel + t[1] > INT32_INDEX_LIMIT):
            closed.append(members)
            members, used, numel = [], 0, 0
        members.append(t)
        open_buckets[dtype] = (members, used + nbytes, numel + t[1])
    return closed + [members for members, _, _ in open_buckets.values() if members]


@dataclass(frozen=True)
class ModelPlan:
    """The buckets of one model: sparse buckets for large tensors, dense for small."""

    sparse: tuple[Bucket, ...]
    dense: tuple[Bucket, ...]

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """All buckets, sparse first, each kind in readiness order."""
        return self.sparse + self.dense


def plan_model(
    tensors: Sequence[tuple[str, int, str, int]],
    min_sparse_numel: int,
    capacity_bytes: int,
    groups: Sequence[Sequence[str]] | None = None,
    num_groups: int = 0,
) -> ModelPlan:
    """The bucket plan of a model, the same rule for every framework.

    Args:
        tensors: ``(name, numel, dtype name, itemsize)`` in registration order
            (``model.named_parameters()``, ``model.trainable_variables``). Gradients
            become ready in about the reverse order, so the plan runs in that order.
        min_sparse_numel: tensors with fewer elements go to dense buckets.
        capacity_bytes: bucket capacity.
        groups: Horovod's explicit ``groups`` as lists of names; names of small
            tensors are dropped from them (those go dense).
        num_groups: Horovod's ``num_groups``: the large tensors, in readiness order,
            cut into this many groups of about equal length (0: by capacity).

    Returns:
        Equal inputs give equal plans, on every rank and in every framework.
    """
    ready = list(reversed(tensors))
    large = [t for t in ready if t[1] >= min_sparse_numel]
    small = [t for t in ready if t[1] < min_sparse_numel]
    large_names = {t[0] for t in large}
    explicit: list[list[str]] | None = None
    if groups is not None:
        explicit = [[n for n in group if n in large_names] for group in groups]
    elif num_groups > 0 and large:
        size = -(-len(large) // num_groups)
        explicit = [[t[0] for t in large[i : i + size]] for i in range(0, len(large), size)]
    return ModelPlan(
        plan_buckets(large, capacity_bytes, explicit).buckets,
        plan_buckets(small, capacity_bytes, kind="dense").buckets,
    )
