"""The optimizer's sparse buckets as tests look at them, through its public API."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SparseBucket:
    name: str
    params: list[torch.Tensor]  # in the order of the bucket's buffer
    reducer: Any  # the engine's reducer (its public state)


def sparse_buckets(opt: Any, model: torch.nn.Module) -> list[SparseBucket]:
    """``opt``'s sparse buckets, in plan order, with ``model``'s parameters."""
    by_name = dict(model.named_parameters())
    members = opt.bucket_parameters()
    return [
        SparseBucket(view.name, [by_name[n] for n in members[view.name]], reducer)
        for view, reducer in zip(opt.buckets(), opt.engine.reducers)
        if view.sparse
    ]
