"""What an :class:`~horovod_sparse.common.engine.Engine` keeps across steps: the
automatic scheduler's choices, the state every rank must share, checkpoints and their
residual policy (docs/design.md §6), and elastic world-size changes."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.global_selection import ReusedGlobalThreshold
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.plan import Reducer
from horovod_sparse.common.scheduler import AutoScheduler, TrialOutcome
from horovod_sparse.common.step import StepKind

__all__ = ["BucketView", "EngineState", "SharedState", "residual_share_among"]

# Per sparse bucket: step, boundaries, the scheduler's choice, the reused global
# threshold's state (None with global_selection="exact").
SharedState = dict[str, tuple[int, list[int], bool, dict[str, Any] | None]]


@dataclass(frozen=True)
class BucketView:
    """A read-only snapshot of one bucket, for users and tests (:meth:`EngineState.views`).

    ``step``, ``boundaries`` and the flags are those of a sparse bucket (a dense bucket
    has no step count: 0, its one owner region, and False).
    """

    name: str
    sparse: bool
    numel: int
    world_size: int
    step: int
    boundaries: tuple[int, ...]
    force_dense: bool
    residual_clear: bool
    last_kind: StepKind | None


def residual_share_among(
    saved_by: tuple[int, str] | None,
    loaded: Sequence[tuple[int, str] | None],
    holders: Collection[str] = (),
) -> float:
    """The checkpoint policy where every rank's load is known (a collective after the
    load, as the DDP hook runs in its first step): each rank takes ``1 / m`` of the
    residual it loaded, m being the number of ranks that loaded the residual saved by
    the same rank of the same process (``saved_by``: its rank and owner token; None:
    nothing loaded), unless the process that saved it is among the ranks and still
    holds it (its owner token in ``holders``), when the copies take none of it.
    Per-rank checkpoints restore exactly (m = 1); one checkpoint
    loaded by every rank counts its mass once, with a warning that the other ranks'
    residuals at save time are not in it.
    """
    if saved_by is None:
        return 1.0
    if saved_by[1] in holders:
        # The process that saved it still holds that residual (Horovod's pattern of
        # loading rank 0's state on the other ranks only): the copies owe nothing.
        return 0.0
    loaders = sum(1 for other in loaded if other == saved_by)
    if loaders > 1:
        warnings.warn(
            f"{loaders} ranks loaded the residuals that rank {saved_by[0]} saved: each takes "
            f"1/{loaders} of them, so their mass counts once; the other ranks' residuals at "
            "save time are not in the checkpoint",
            stacklevel=3,
        )
    return 1.0 / loaders


class EngineState:
    """The across-steps half of :class:`~horovod_sparse.common.engine.Engine`."""

    # Whose residuals this engine loaded from another process (rank, owner token), not
    # yet shared out; and whether every rank has agreed on its share since the engine
    # was made or last loaded (docs/design.md §6).
    loaded_by: tuple[int, str] | None = None
    loads_settled: bool = False

    ops: Backend
    names: list[str]
    reducers: list[Reducer]
    scheduler: AutoScheduler | None
    kinds: list[StepKind | None]
    masked: list[Tensor | None]
    records: list[Any]

    @property
    def sparse(self) -> list[BucketReducer]:
        """The sparse buckets' reducers, in plan order."""
        return [r for r in self.reducers if isinstance(r, BucketReducer)]

    @property
    def step(self) -> int:
        """Steps taken: every sparse bucket takes one each step (0 without any)."""
        sparse = self.sparse
        return int(sparse[0].step) if sparse else 0

    def mask_with(self, index: int, buffer: Tensor | None) -> None:
        """Zero ``buffer`` where sparse bucket ``index`` sends (momentum factor masking)."""
        self.masked[index] = buffer
        _as_sparse(self.reducers[index]).velocity = buffer

    def views(self) -> list[BucketView]:
        """A read-only snapshot of every bucket, in plan order."""
        out = []
        for index, (name, reducer) in enumerate(zip(self.names, self.reducers)):
            last_kind = self.kinds[index] if self.kinds else None
            if isinstance(reducer, BucketReducer):
                step, boundaries = int(reducer.step), tuple(reducer.boundaries)
                flags = (bool(reducer.force_dense), bool(reducer.residual_clear))
            else:
                step, boundaries, flags = 0, (0, reducer.numel), (False, False)
            out.append(
                BucketView(
                    name,
                    isinstance(reducer, BucketReducer),
                    reducer.numel,
                    reducer.world_size,
                    step,
                    boundaries,
                    *flags,
                    last_kind,
                )
            )
        return out

    # ------------------------------------------------------------------ scheduler
    def reschedule(self, like: Tensor, step_seconds: float | None) -> None:
        """At a step's start: report the last whole step's seconds, and every
        ``scheduler_steps`` steps let the scheduler decide (the same on every rank)."""
        scheduler = self.scheduler
        if scheduler is None or not self.sparse:
            return
        if step_seconds is not None:
            scheduler.observe_step(step_seconds)
        step = self.step
        if scheduler.due(step):
            scheduler.decide(like, step)
            self.apply_schedule()

    def apply_schedule(self) -> None:
        if self.scheduler is not None:
            for choice, reducer in zip(self.scheduler.choices, self.sparse):
                reducer.force_dense = choice.dense

    def pin(self, dense: bool) -> None:
        """Exchange every sparse bucket densely (or sparsely) from the next step on; an
        automatic scheduler decides no more. The switch to dense folds each residual
        into its first dense step (docs/design.md §3), so no mass is lost."""
        if self.scheduler is not None:
            self.scheduler.hold()
            for choice in self.scheduler.choices:
                choice.switch(dense)
        for reducer in self.sparse:
            reducer.force_dense = dense

    def restart_scheduler(self) -> None:
        """Decide again from the current step (after a restore or a shared state)."""
        if self.scheduler is not None and self.sparse:
            self.scheduler.restart(self.step)

    def schedule(self, overlapping: bool) -> dict[str, dict[str, Any]]:
        """Per sparse bucket: the chosen exchange and the scheduler's predictions
        (NaN before the first decision or without a scheduler)."""
        nan = float("nan")
        choices = self.scheduler.choices if self.scheduler is not None else []
        out = {}
        for index, (name, reducer) in enumerate(zip(self.names, self.sparse)):
            choice = choices[index] if choices else None
            out[name] = {
                "mode": "dense" if reducer.force_dense else "sparse",
                "overlap": overlapping,
                "predicted_dense_s": choice.predicted_dense if choice else nan,
                "predicted_sparse_s": choice.predicted_sparse if choice else nan,
                "local_s_per_element": choice.local_per_element if choice else nan,
                "measured_dense_s": choice.measured_dense if choice else nan,
                "measured_sparse_s": choice.measured_sparse if choice else nan,
            }
        return out

    def trials(self) -> list[TrialOutcome]:
        return list(self.scheduler.trials) if self.scheduler is not None else []

    # ------------------------------------------------------------------ state
    def shared_state(self) -> SharedState:
        """What every rank must agree on: per sparse bucket, the step count (density
        schedule, scheduler timing), the boundaries, the scheduler's choice and the
        reused global threshold (whether the next step refreshes decides whether the
        radix select's allreduces run: ranks that disagree would hang)."""
        return {
            name: (
                int(r.step),
                list(r.boundaries),
                bool(r.force_dense),
                None if r.reused_threshold is None else _shared_part(r.reused_threshold, self.ops),
            )
            for name, r in zip(self.names, self.sparse)
        }

    def adopt_shared_state(self, theirs: SharedState) -> None:
        """Take another rank's :meth:`shared_state`, and decide again from it."""
        for name, reducer in zip(self.names, self.sparse):
            step, boundaries, _, threshold = theirs[name]
            reducer.take_shared(step, boundaries, threshold)
        if self.scheduler is not None:
            for choice, name in zip(self.scheduler.choices, self.names):
                choice.switch(theirs[name][2])
            self.apply_schedule()
        self.restart_scheduler()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each sparse bucket's state (residual, step, selection, boundaries) by name."""
        return {name: r.state_dict() for name, r in zip(self.names, self.sparse)}

    def load_state_dict(self, buckets: dict[str, dict[str, Any]], share: float = 1.0) -> None:
        """Restore :meth:`state_dict`; each residual is multiplied by ``share`` (the
        checkpoint policy: ``1 / P`` when every rank loads another rank's residuals).

        Raises:
            ValueError: a bucket has no matching state (another model or plan).
        """
        for name, reducer in zip(self.names, self.sparse):
            saved = buckets.get(name)
            if saved is None or self.ops.length(saved["residual"]) != reducer.numel:
                raise ValueError(f"checkpoint has no state matching bucket {name}")
            reducer.load_state_dict(saved, share)
        self.restart_scheduler()

    def checkpoint(self, rank: int, world_size: int, owner: str) -> dict[str, Any]:
        """What a checkpoint keeps of the buckets: each sparse bucket's state (copies,
        so the saved state does not change with later steps) and who saved it."""
        copy = self.ops.copy
        return {
            "rank": rank,
            "world_size": world_size,
            "owner": owner,
            "buckets": {
                name: {key: _copied(copy, value) for key, value in state.items()}
                for name, state in self.state_dict().items()
            },
        }

    def restore(self, saved: dict[str, Any], owner: str) -> None:
        """Restore :meth:`checkpoint`. Saved by this process (``owner``: elastic commit
        and restore): exactly. Otherwise the residuals load as saved and the share this
        rank keeps waits for :meth:`settle_loaded`, once every rank has said whose
        residuals it loaded (:attr:`loaded_by`): a checkpoint saved by one rank and
        loaded by all must count its mass once, per-rank checkpoints restore exactly."""
        self.load_state_dict(saved["buckets"])
        if saved.get("owner") != owner:
            self.loaded_by = (int(saved["rank"]), str(saved["owner"]))
            self.loads_settled = False

    def settle_loaded(
        self, loaded: Sequence[tuple[int, str] | None], holders: Collection[str] = ()
    ) -> None:
        """Keep this rank's share of what it loaded (:func:`residual_share_among`), given
        every rank's :attr:`loaded_by` and the owner tokens of the ranks that loaded
        nothing from another process (``holders``); nothing is pending afterwards."""
        share = residual_share_among(self.loaded_by, loaded, holders)
        for reducer in self.sparse:
            reducer.keep_share(share)
        self.loaded_by = None
        self.loads_settled = True

    def follow_world_size(self, make_reducer: Callable[[int], Reducer]) -> None:
        """Rebuild every reducer for a new process-set size (elastic Horovod).

        Each surviving rank keeps its own residual: mass this process still owes the
        sum, whatever its new rank. Owner regions are cut again for the new size; the
        step count and the selection state carry over.
        """
        for index, old in enumerate(self.reducers):
            fresh = make_reducer(index)
            if isinstance(old, BucketReducer) and isinstance(fresh, BucketReducer):
                fresh.load_state_dict(old.state_dict())  # boundaries: re-cut
            self.reducers[index] = fresh
            if self.masked[index] is not None:
                self.mask_with(index, self.masked[index])
        self.apply_schedule()
        self.records = []


def _copied(copy: Callable[[Tensor], Tensor], value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copied(copy, item) for key, item in value.items()}
    if isinstance(value, (int, float, str, bool, list, tuple)) or value is None:
        return value
    return copy(value)


def _as_sparse(reducer: Reducer) -> BucketReducer:
    assert isinstance(reducer, BucketReducer), "fusion members are sparse buckets"
    return reducer


def _shared_part(threshold: ReusedGlobalThreshold, ops: Backend) -> dict[str, Any]:
    """What every rank must agree on of a reused global threshold: its saved state
    without the row cap, which is each owner's own share."""
    return {key: value for key, value in threshold.state_dict(ops).items() if key != "cap"}
