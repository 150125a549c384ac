"""The optimizer's parameters as the planner and the bucket buffers see them.

Names (Horovod's for unnamed parameters), the checks every rank runs before the one
validation collective, what the shared planner takes (:func:`describe_parameters`) and
the buffers of the sparse buckets, laid out as views of arenas so that dense-step
fusion reduces a run of buckets as one slice (:mod:`horovod_sparse.common.fusion`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from horovod_sparse.common.fusion import FusionMember

__all__ = ["arena_layout", "describe_parameters", "group_names", "name_parameters"]


def name_parameters(
    param_groups: list[dict[str, Any]],
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for every parameter of ``param_groups`` that requires a
    gradient, in the groups' order.

    Raises:
        ValueError: duplicate names, a parameter missing from ``named_parameters``, or
            no parameter at all.
        TypeError: a parameter that is not floating point, or is bfloat16.
    """
    params = [p for group in param_groups for p in group["params"] if p.requires_grad]
    if named_parameters is None:
        # Horovod's names for unnamed parameters: group index, then position.
        named = [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
            if p.requires_grad
        ]
    else:
        named = [(n, p) for n, p in named_parameters]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters contains duplicate names")
        known = {p for _, p in named}
        unnamed = [p for p in params if p not in known]
        if unnamed:
            raise ValueError(
                f"{len(unnamed)} optimizer parameter(s) are missing from named_parameters; "
                "pass model.named_parameters() of the model the optimizer was built for"
            )
        in_opt = set(params)
        named = [(n, p) for n, p in named if p in in_opt]
    if not named:
        raise ValueError("the optimizer has no parameters that require gradients")
    for n, p in named:
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {n!r} has dtype {p.dtype}; gradients must be floating point"
            )
        if p.dtype == torch.bfloat16:
            raise TypeError(
                f"parameter {n!r} is bfloat16, which Horovod's torch bindings do not support; "
                "keep float32 master weights for the optimizer"
            )
    return named


def group_names(groups: Any, names: dict[torch.Tensor, str]) -> list[list[str]] | None:
    """Horovod's ``groups`` (lists of parameters) as lists of names; None for no groups
    or an int (``num_groups``, passed on as such)."""
    if groups is None or isinstance(groups, int):
        return None
    return [[names[p] for p in group if p in names] for group in groups]


def describe_parameters(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, int, str, int]]:
    """``(name, numel, dtype name, itemsize)`` per parameter, as the planner takes them."""
    return [(n, p.numel(), str(p.dtype).replace("torch.", ""), p.element_size()) for n, p in named]


def arena_layout(
    params_per_bucket: list[list[torch.Tensor]],
) -> tuple[list[torch.Tensor], list[FusionMember], list[torch.Tensor]]:
    """Buffers for the sparse buckets: views of one zeroed arena per stretch of adjacent
    buckets with the same dtype and device. Returns each bucket's view, its place for
    :class:`~horovod_sparse.common.fusion.DenseFusion`, and the arenas."""
    flats: list[torch.Tensor] = []
    members: list[FusionMember] = []
    arenas: list[torch.Tensor] = []
    stretch: list[int] = []  # bucket sizes of the arena being laid out

    def close(like: torch.Tensor) -> None:
        arena = torch.zeros(sum(stretch), dtype=like.dtype, device=like.device)
        offset = 0
        for numel in stretch:
            flats.append(arena[offset : offset + numel])
            members.append(FusionMember(len(arenas), offset, numel, arena.element_size()))
            offset += numel
        arenas.append(arena)
        stretch.clear()

    previous: torch.Tensor | None = None
    for params in params_per_bucket:
        first = params[0]
        if previous is not None and (first.dtype, first.device) != (
            previous.dtype,
            previous.device,
        ):
            close(previous)
        stretch.append(sum(p.numel() for p in params))
        previous = first
    if previous is not None:
        close(previous)
    return flats, members, arenas
