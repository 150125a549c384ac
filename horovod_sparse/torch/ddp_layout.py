"""Which parameters each DDP bucket holds, in positions that survive a checkpoint.

A parameter's position is the order in which a DDP instance first hands it to the hook:
the same in every run of the same model and DDP options. DDP either puts its first
iteration in one bucket of every parameter and rebuilds its buckets after it (the
default, and ``static_graph=True``), or keeps its first buckets for good
(``find_unused_parameters=True``); the two number the parameters differently, so a
saved layout says which it was.
"""

from typing import Any

import torch

__all__ = ["BucketLayout"]


class BucketLayout:
    """Per DDP bucket index, its parameters' positions (``buckets``, saved in
    checkpoints); per DDP instance, the positions and each one's ``(offset, numel)`` in
    the concatenation of the parameters in position order (a whole first bucket)."""

    def __init__(self) -> None:
        self.buckets: dict[int, list[int]] = {}
        # Whether DDP keeps its first iteration's buckets; None until the first call.
        self.fixed: bool | None = None
        self.new_instance()

    def new_instance(self) -> None:
        """Forget this instance's parameters: the next call is a new DDP instance's."""
        self._positions: dict[int, int] = {}  # id(parameter) -> position
        self.pieces: list[tuple[int, int]] = []  # per position: (offset, numel)

    @property
    def started(self) -> bool:
        """Whether this DDP instance has handed the hook any parameter yet."""
        return bool(self._positions)

    def start(self, fixed: bool) -> None:
        """The instance's first call: record whether its buckets stay fixed, refusing a
        saved layout of the other kind (its positions would name other parameters)."""
        if self.buckets and self.fixed is not None and self.fixed != fixed:
            raise RuntimeError(
                "this SparseState was saved from a DDP model whose buckets were "
                f"{_kind(self.fixed)}, and is loaded into one whose buckets are "
                f"{_kind(fixed)}: construct DistributedDataParallel with the same "
                "find_unused_parameters and static_graph as the run that saved it"
            )
        self.fixed = fixed

    def positions(self, parameters: list[torch.Tensor]) -> list[int]:
        """The parameters' positions, numbering the ones this instance has not seen."""
        for p in parameters:
            if id(p) not in self._positions:
                offset = sum(self.pieces[-1]) if self.pieces else 0
                self._positions[id(p)] = len(self.pieces)
                self.pieces.append((offset, p.numel()))
        return [self._positions[id(p)] for p in parameters]

    def position_of(self, param: torch.Tensor) -> int | None:
        """``param``'s position in this instance, or None if it has not handed it over."""
        return self._positions.get(id(param))

    def whole_over_rebuilt(self, index: int, positions: list[int]) -> bool:
        """Whether bucket ``index`` holds every parameter while the layout has other
        buckets (DDP hands the whole bucket again before using its rebuilt ones)."""
        whole = list(range(len(self.pieces)))
        if self.fixed or index != 0 or positions != whole:
            return False
        return self.buckets not in ({}, {0: whole})

    def rebuilt_from_whole(self, positions: list[int]) -> bool:
        """Whether bucket 0 held every parameter and now holds ``positions``, others."""
        whole = list(range(len(self.pieces)))
        return self.buckets.get(0) == whole and positions != whole

    def pieces_of(self, index: int) -> list[tuple[int, int]]:
        """Bucket ``index``'s parameters' ``(offset, numel)`` in a whole first bucket."""
        return [self.pieces[i] for i in self.buckets[index]]

    def small_slots(self, index: int, below: int) -> list[int]:
        """The entries of bucket ``index`` that belong to parameters of fewer than
        ``below`` entries (biases, norms), as positions in the bucket."""
        slots: list[int] = []
        start = 0
        for _, numel in self.pieces_of(index):
            if numel < below:
                slots.extend(range(start, start + numel))
            start += numel
        return slots

    def cut(self, whole: torch.Tensor, index: int) -> torch.Tensor:
        """Bucket ``index``'s entries of a tensor laid out as the whole first bucket."""
        return torch.cat([whole[a : a + n] for a, n in self.pieces_of(index)])

    def state_dict(self) -> dict[str, Any]:
        return {
            "layout": {index: list(p) for index, p in self.buckets.items()},
            "fixed_buckets": self.fixed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buckets = {int(i): [int(p) for p in ps] for i, ps in state["layout"].items()}
        # States saved before fixed buckets existed came from rebuilt buckets.
        self.fixed = state.get("fixed_buckets", False if self.buckets else None)
        self.new_instance()


def _kind(fixed: bool) -> str:
    return "fixed" if fixed else "rebuilt after the first iteration"
