"""The step plan: every decision of one step over all buckets, made once, before any
launch (docs/design.md §3).

:func:`plan_step` gives each bucket's :class:`~horovod_sparse.common.step.StepKind` by
the one rule (:func:`kind_of`), where its gradients go, and the dense-step fusion runs.
Under PyTorch every decision is a host value. Under TensorFlow a bucket whose kind
follows the step count (warm-up, decaying density) has a graph predicate instead
(``StepPlan.dense``), which the run turns into one ``tf.cond`` through
``Backend.cond``. :func:`refresh_together` groups the global-threshold refreshes of the
buckets that refresh on the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.dense_stages import DenseBucketReducer
from horovod_sparse.common.fusion import DenseFusion
from horovod_sparse.common.global_selection import grouped_threshold_keys
from horovod_sparse.common.inflight import OwnedSums, ScatterInFlight
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.step import StepKind

__all__ = ["Reducer", "StepPlan", "kind_of", "plan_step", "refresh_together"]

Reducer = Union[BucketReducer, DenseBucketReducer]  # a runtime alias: Union for Python 3.9


def is_host_bool(value: Any) -> bool:
    """Whether a decision is known on the host (not a graph value)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def kind_of(
    reducer: Reducer, fused: bool, dense: Any, buffer_usable: bool = True
) -> StepKind | None:
    """The kind of a bucket's next step: the one rule (docs/design.md §3).

    ``fused``: dense-step fusion put it in a run; ``dense``: its schedule's flag
    (``SparseBucket.dense_step``); ``buffer_usable``: the gradients may go into a
    bucket buffer instead of the residual. None when ``dense`` is a graph value: the
    run then takes DENSE_FROM_RESIDUAL or SPARSE under a ``tf.cond`` on it.
    """
    if isinstance(reducer, DenseBucketReducer):
        return StepKind.DENSE_IN_BUFFER  # every step reduces the buffer of gradients
    if fused:
        return StepKind.DENSE_FUSED
    if not is_host_bool(dense):
        return None
    if dense and reducer.residual_clear and buffer_usable:
        return StepKind.DENSE_IN_BUFFER
    return StepKind.DENSE_FROM_RESIDUAL if dense else StepKind.SPARSE


@dataclass
class StepPlan:
    """One step's decisions, per bucket in plan order.

    ``kinds``: each bucket's kind, None where it is a graph predicate (``dense``).
    ``in_buffer``: whether the bucket's gradients are copied into its buffer (a dense
    step while the residual owes nothing) rather than added to its residual.
    ``fused_runs``: runs of sparse-bucket positions that share one allreduce.
    ``runs_fuse``: whether they do this step: True, or a graph predicate (every member
    dense by the schedule) under which the members otherwise take their own kinds.
    """

    kinds: list[StepKind | None]
    dense: list[Any]
    in_buffer: list[bool]
    fused_runs: list[list[int]] = field(default_factory=list)
    runs_fuse: Any = True

    @property
    def graph_runs(self) -> list[list[int]]:
        """The fused runs whose fusing is a graph predicate: their members step inside a
        ``Backend.cond`` branch (none when the runs fuse for certain)."""
        return [] if self.runs_fuse is True else self.fused_runs


def plan_step(
    ops: Backend,
    reducers: Sequence[Reducer],
    fusion: DenseFusion | None,
    gradients_in_residual: bool = False,
) -> StepPlan:
    """Decide the step: each bucket's kind, where its gradients go, the fused runs.
    ``gradients_in_residual``: no bucket buffer takes a sparse bucket's gradients.

    Dense-step fusion plans its runs from the schedule's dense flags, which every rank
    shares (a residual restored on one rank only does not change them). Where a flag is
    a graph value, the runs are planned as if every member were dense and fuse under
    the predicate that all of them are.
    """
    dense = [r.dense_step if isinstance(r, BucketReducer) else True for r in reducers]
    runs: list[list[int]] = []
    runs_fuse: Any = True
    if fusion is not None:
        flags = dense[: len(fusion.members)]
        if all(is_host_bool(flag) for flag in flags):
            runs = fusion.plan([bool(flag) for flag in flags])
        else:
            runs = fusion.plan([True] * len(flags))
            runs_fuse = ops.all_of([flags[i] for run in runs for i in run])
    fused = {i for run in runs for i in run}
    kinds: list[StepKind | None] = []
    in_buffer = []
    for index, (reducer, flag) in enumerate(zip(reducers, dense)):
        fused_now = index in fused and runs_fuse is True
        kind = kind_of(reducer, fused_now, flag, not gradients_in_residual)
        kinds.append(kind)
        clear = isinstance(reducer, DenseBucketReducer) or reducer.residual_clear
        in_buffer.append(
            kind is StepKind.DENSE_IN_BUFFER
            or (kind is StepKind.DENSE_FUSED and clear and not gradients_in_residual)
        )
    return StepPlan(kinds, dense, in_buffer, runs, runs_fuse)


def refresh_together(
    ops: Backend,
    reducers: Sequence[BucketReducer],
    stages: Sequence[ScatterInFlight],
    label: str,
) -> list[tuple[OwnedSums, Tensor | None]]:
    """The owner sums of sparse buckets whose reduce-scatters are in flight, each with the
    exact threshold key of a grouped refresh (None: the bucket selects by itself).

    The buckets whose global threshold refreshes this step run their radix selects
    together: one allreduce per digit for all of them, not four per bucket (the first
    sparse step and every ``refresh_steps``-th step refresh every bucket at once).
    Whether a bucket refreshes is known once its sums are in: a host bool under
    PyTorch (only the due buckets group, two or more of them), a graph bool under
    TensorFlow (one ``tf.cond`` on any of them runs the group's selects; each bucket
    uses its key only where its own threshold refreshes). ``reducers`` share one
    process set (the allreduces' ranks).

    Sends: on a step where two or more refresh, 4 allreduces of 1 KiB per bucket in all.
    """
    owned = [r.receive(stage) for r, stage in zip(reducers, stages)]
    due = [r.refresh_due(sums) for r, sums in zip(reducers, owned)]
    keys: list[Tensor | None] = [None] * len(owned)
    process_set = reducers[0].process_set

    def grouped(members: list[int]) -> list[Tensor]:
        return grouped_threshold_keys(
            ops,
            [owned[i].keys for i in members],
            [reducers[i].k for i in members],
            label,
            process_set,
        )

    if all(is_host_bool(flag) for flag in due):
        members = [i for i, flag in enumerate(due) if flag]
        if len(members) >= 2:
            for i, key in zip(members, grouped(members)):
                keys[i] = key
        return list(zip(owned, keys))
    everyone = list(range(len(owned)))

    def unused() -> list[Tensor]:  # no bucket refreshes: no key is read
        return [ops.radix_start(owned[i].keys, reducers[i].k)[0] for i in everyone]

    chosen = ops.cond(ops.any_of(due), lambda: grouped(everyone), unused)
    return list(zip(owned, chosen))
