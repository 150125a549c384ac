"""Drop-in replacement for ``horovod.torch.DistributedOptimizer`` with sparse allreduce.

Gradients are copied into fusion buckets from post-accumulate-grad hooks; a bucket's
reduce-scatter (one alltoall) starts as soon as its last gradient arrives, while backward
continues on earlier layers. ``synchronize()`` finishes the owner reduction, global
selection and all-gather of every bucket and writes the result into ``p.grad``.
Tensors smaller than ``min_sparse_numel`` go through Horovod's dense allreduce.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import horovod.torch as hvd
import torch

from horovod_sparse.common.buckets import Bucket, plan_model
from horovod_sparse.common.classes import combined_class
from horovod_sparse.common.config import make_config, optimizer_scales, take_options
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.fusion import DenseFusion, FusedPart, FusionMember
from horovod_sparse.common.pipeline import (
    BucketReducer,
    DenseBucketReducer,
    GatherInFlight,
    ScatterInFlight,
)
from horovod_sparse.common.scheduler import AutoScheduler, TrialOutcome
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepKind
from horovod_sparse.common.trace import Trace
from horovod_sparse.common.validation import raise_on_any_rank, verdict_of
from horovod_sparse.torch.functions import BACKEND, op_name
from horovod_sparse.torch.momentum import Correction, make_correction
from horovod_sparse.torch.overlap import DeferredUpdates

__all__ = ["DistributedOptimizer", "SparseOptimizerMixin"]

_STATE_KEY = "horovod_sparse"


@dataclass
class _BucketSlot:
    """Run-time companion of a planned bucket: its flat buffer, members and reducer."""

    bucket: Bucket
    params: list[torch.Tensor]
    flat: torch.Tensor
    reducer: BucketReducer | DenseBucketReducer
    # Momentum correction's state over the bucket (e.g. "velocity"), flat like ``flat``.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    waiting: int = 0  # members whose gradient has not arrived this step
    stage: ScatterInFlight | GatherInFlight | None = None
    fusion_index: int | None = None  # position among the members of dense fusion
    kind: StepKind | None = None  # this step's kind, planned at its first gradient

    @property
    def sparse_reducer(self) -> BucketReducer:
        """``reducer`` of a sparse bucket, for what only sparse reducers have (a step
        count, a residual, dense steps, fusion)."""
        assert isinstance(self.reducer, BucketReducer), f"{self.bucket.name} is not sparse"
        return self.reducer


if TYPE_CHECKING:
    # What the mixin is combined with (combined_class): type checkers see the wrapped
    # optimizer's methods and attributes; at run time the mixin has no base of its own.
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object


class SparseOptimizerMixin(_OptimizerBase):
    """Mixin that turns a ``torch.optim.Optimizer`` class into a sparse-allreduce one.

    Combine it in front of any optimizer class (``class MyAdam(SparseOptimizerMixin,
    torch.optim.Adam)``) and pass the Horovod-style keywords; or wrap an existing
    optimizer with :func:`DistributedOptimizer`.
    """

    def __init__(
        self,
        params: Any,
        *args: Any,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Any = hvd.Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = hvd.global_process_set,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        # The sparse options (SparseConfig's fields) are taken out; the rest of the
        # keywords belong to the wrapped optimizer.
        options = take_options(kwargs)
        super().__init__(params, *args, **kwargs)
        self._setup_sparse(
            named_parameters=named_parameters,
            compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups,
            groups=groups,
            sparse_as_dense=sparse_as_dense,
            process_set=process_set,
            model=model,
            options=options,
        )

    # ------------------------------------------------------------------ setup
    def _setup_sparse(  # noqa: C901
        self,
        *,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        num_groups: int,
        groups: Any,
        sparse_as_dense: bool,
        process_set: Any,
        model: torch.nn.Module | None,
        options: dict[str, Any],
    ) -> None:
        if not process_set.included():
            self._setup_outside_process_set(named_parameters, backward_passes_per_step, process_set)
            return
        self._member = True
        # Validate locally, then share the verdict in the one validation collective, so
        # a problem on any rank is raised on every rank instead of leaving the others
        # waiting in a collective.
        problem: Exception | None = None
        named: list[tuple[str, torch.Tensor]] = []
        try:
            config = make_config(options)
            if int(backward_passes_per_step) < 1:
                raise ValueError(
                    f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
                )
            prescale, postscale = optimizer_scales(
                op_name(op), process_set.size(), float(gradient_predivide_factor)
            )
            named = self._name_parameters(named_parameters)
            # Only parameters of sparse buckets are corrected: a tensor that is always
            # reduced densely steps by the wrapped optimizer's own algorithm.
            can_be_sparse = config.density < 1.0 or config.warmup_steps > 0
            some_sparse_bucket = any(p.numel() >= config.min_sparse_numel for _, p in named)
            correction = make_correction(
                self, config.momentum_correction, can_be_sparse and some_sparse_bucket
            )
            if config.overlap_allgather and not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"overlap_allgather={config.overlap_allgather!r} needs model=<the "
                    "torch.nn.Module being trained>: its forward pre-hooks apply each "
                    "bucket's update just before use"
                )
        except (TypeError, ValueError) as error:
            problem = error
        self._validate_across_ranks(named, problem, process_set)

        # Hyperparameters.
        self.sparse_config = config
        self.compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._prescale, self._postscale = prescale, postscale
        self._world_size = process_set.size()
        self._parameter_names = {p: n for n, p in named}  # as Horovod's optimizer has it
        # Identifies this optimizer's own saved states (elastic commit/restore), whose
        # residuals belong to this process whatever its rank is now.
        self._owner_token = uuid.uuid4().hex

        # Internal state: sparse buckets for large tensors, dense buckets for small ones,
        # planned by the rule every framework shares.
        by_name = dict(named)
        plan = plan_model(
            describe_parameters(named),
            config.min_sparse_numel,
            config.bucket_bytes,
            self._group_names(groups),
            num_groups if not isinstance(groups, int) else groups,
        )
        self._correction: Correction | None = correction
        self._buckets: list[_BucketSlot] = []
        self._slot_of: dict[torch.Tensor, tuple[_BucketSlot, int]] = {}
        # Sparse buckets' buffers are views of arenas, so adjacent ones can be reduced
        # as one slice when their step is dense (common/fusion.py).
        arena_flats, members, self._arenas = _arena_layout(
            [[by_name[e.name] for e in bucket.entries] for bucket in plan.sparse]
        )
        for index, bucket in enumerate(plan.buckets):
            params = [by_name[e.name] for e in bucket.entries]
            if index < len(arena_flats):
                flat = arena_flats[index]
            else:
                flat = torch.zeros(bucket.numel, dtype=params[0].dtype, device=params[0].device)
            slot = _BucketSlot(bucket, params, flat, self._make_reducer(bucket, flat))
            self._buckets.append(slot)
            for entry, p in zip(bucket.entries, params):
                self._slot_of[p] = (slot, entry.offset)
            if self._correction is not None and bucket.kind == "sparse":
                slot.buffers = {n: torch.zeros_like(flat) for n in self._correction.buffer_names}
                self._mask_sent_entries(slot)
                for entry, p in zip(bucket.entries, params):
                    self._correction.attach(p, slot.buffers, entry.offset)
        if self._correction is not None and not self._correction.covered:
            self._correction = None  # no sparse bucket: nothing to correct
        self._fusion: DenseFusion | None = None
        no_compression = compression is None or compression is hvd.Compression.none
        if len(members) >= 2 and no_compression:
            # Lossy compression reduces a copy in the wire dtype, not the buffer in place.
            self._fusion = DenseFusion(members, config.dense_fusion_cap)
            for position, slot in enumerate(self._buckets[: len(members)]):
                slot.fusion_index = position
        self._kinds_planned = False
        self._passes_left = {p: self.backward_passes_per_step for _, p in named}
        # Sparse gradients (torch.nn.Embedding(sparse=True)) of this step: allgathered
        # as Horovod does, or, with sparse_as_dense, reduced densely and made sparse again.
        self._sparse_gathers: dict[torch.Tensor, _SparseGather] = {}
        self._back_to_sparse: set[torch.Tensor] = set()
        self._should_synchronize = True
        self._synchronized = False
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named
        ]
        self._deferred: DeferredUpdates | None = None
        if config.overlap_allgather:
            assert model is not None  # checked with the options
            self._deferred = DeferredUpdates(self, model, self._slot_of, self._apply_bucket)
        self._scheduler: AutoScheduler | None = None
        self._step_began: float | None = None  # host time the current step's backward began
        judge_overlap = config.overlap_allgather == "auto"
        if (config.scheduler == "auto" or judge_overlap) and self._sparse_slots():
            self._scheduler = AutoScheduler(
                BACKEND,
                "hvds.opt.schedule",
                process_set,
                [(s.bucket.numel, s.flat.element_size()) for s in self._sparse_slots()],
                config.density,
                every=config.scheduler_steps,
                choose_density=config.scheduler == "auto",
                # Starts overlapped; trials then judge it against waiting in step().
                overlap=True if judge_overlap else None,
            )
        # The step's decisions over all buckets (kinds, fusion runs, records, scheduler,
        # bucket state policy): common/engine.py.
        self._engine = Engine(
            BACKEND,
            [s.bucket.name for s in self._buckets],
            [s.reducer for s in self._buckets],
            self._fusion,
            self._scheduler,
        )
        self._trace: Trace | None = (
            Trace(config.trace, process_set.rank()) if config.trace is not None else None
        )
        self._begin_step()

    def _setup_outside_process_set(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        backward_passes_per_step: int,
        process_set: Any,
    ) -> None:
        """A rank outside the optimizer's process set steps the wrapped optimizer on its
        own gradients and takes part in no collective, as Horovod's optimizer does there."""
        self._member = False
        self.process_set = process_set
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._parameter_names = {p: n for n, p in self._name_parameters(named_parameters)}
        self._buckets = []
        self._correction = None
        self._deferred = None
        self._scheduler = None
        self._trace = None
        self._engine = Engine(BACKEND, [], [])
        self._sparse_gathers = {}
        self._should_synchronize = True
        self._synchronized = False

    def _make_reducer(
        self, bucket: Bucket, flat: torch.Tensor
    ) -> BucketReducer | DenseBucketReducer:
        """A reducer for ``bucket`` over the process set as it is now."""
        name = f"hvds.opt.{bucket.name}"
        if bucket.kind == "sparse":
            return BucketReducer(
                BACKEND,
                name,
                bucket.numel,
                flat,
                self.sparse_config,
                self.process_set,
                self.compression,
            )
        return DenseBucketReducer(
            BACKEND, name, bucket.numel, flat, self.process_set, self.compression
        )

    def _mask_sent_entries(self, slot: _BucketSlot) -> None:
        """Momentum factor masking: the reducer zeroes sent entries in this buffer too."""
        masked = self._correction.masked_buffer if self._correction is not None else None
        if masked is not None and isinstance(slot.reducer, BucketReducer):
            slot.reducer.velocity = slot.buffers[masked]

    def _follow_world_size(self) -> None:
        """Rebuild the reducers when the process set changed size (elastic Horovod).

        Each surviving rank keeps its own residual and velocity: they are mass this
        process still owes the sum, whatever its new rank. Owner regions are cut again
        for the new size; the step count and the selection state carry over. A removed
        rank's residual leaves with it, like its unreduced gradient of that step.
        """
        size = self.process_set.size()
        if size == self._world_size:
            return
        self._world_size = size
        self._prescale, self._postscale = optimizer_scales(
            op_name(self.op), size, self.gradient_predivide_factor
        )
        self._engine.follow_world_size(
            lambda index: self._make_reducer(self._buckets[index].bucket, self._buckets[index].flat)
        )
        for slot, reducer in zip(self._buckets, self._engine.reducers):
            slot.reducer = reducer
            self._mask_sent_entries(slot)

    def _name_parameters(
        self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
    ) -> list[tuple[str, torch.Tensor]]:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is None:
            # Horovod's names for unnamed parameters: group index, then position.
            named = [
                (f"allreduce.noname.{i}.{j}", p)
                for i, group in enumerate(self.param_groups)
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

    def _group_names(self, groups: Any) -> list[list[str]] | None:
        """Horovod's ``groups`` (lists of parameters) as lists of names; an int is
        ``num_groups`` and is passed on as such."""
        if groups is None or isinstance(groups, int):
            return None
        names = self._parameter_names
        return [[names[p] for p in group if p in names] for group in groups]

    def _validate_across_ranks(
        self, named: list[tuple[str, torch.Tensor]], problem: Exception | None, process_set: Any
    ) -> None:
        """One small collective: every rank must be valid and hold the same parameters.

        Raises on every rank: this rank's own error, another rank's error (named), or
        the first parameter that differs between ranks.
        """
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        everyone = allgather_object((verdict_of(problem), mine), "hvds.opt.validate", process_set)
        raise_on_any_rank(everyone, mine, problem, "parameter", "the optimizer")

    # ------------------------------------------------------------------ hooks
    def _begin_step(self) -> None:
        self._step_open = False
        self._kinds_planned = False
        for slot in self._buckets:
            slot.waiting = len(slot.params)
            slot.stage = None
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        self._back_to_sparse.clear()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (as Horovod's optimizer offers); counts
        restart for the current step."""
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = int(passes)
        if self._member:
            for p in self._passes_left:
                self._passes_left[p] = self.backward_passes_per_step

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._passes_left[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "optimizer.step() or synchronize(). Increase backward_passes_per_step to "
                "accumulate gradients locally."
            )
        if not self._step_open:
            self._step_open = True
            if self._deferred is not None:
                # Updates of the last step not yet applied by a forward pre-hook.
                self._deferred.apply_all(late=True)
            self._follow_world_size()
            if self._scheduler is not None:
                # Whole steps, from one backward's start to the next, judge trials.
                now = time.perf_counter()
                began, self._step_began = self._step_began, now
                seconds = None if began is None else now - began
                self._engine.reschedule(self._sparse_slots()[0].flat, seconds)
            if self._trace is not None:
                self._trace.backward_step(time.perf_counter())
        if self._trace is not None:
            self._poll_trace()
        self._passes_left[p] -= 1
        if self._passes_left[p] == 0:
            self._submit(p)

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the bucket reduces for ``p``; None when a sparse gradient is
        allgathered instead (the bucket then carries zeros for ``p``)."""
        grad = p.grad
        if grad is None:
            # A parameter unused on this rank still takes part, as zeros.
            p.grad = grad = torch.zeros_like(p)
        if not grad.is_sparse:
            return grad
        corrected = self._correction is not None and p in self._correction.covered
        if self.sparse_as_dense or corrected:
            # Reduced densely; made sparse again afterwards, as Horovod does, unless the
            # step applies a momentum-corrected direction, which is dense anyway.
            if not corrected:
                self._back_to_sparse.add(p)
            return grad.to_dense()
        name = f"hvds.opt.sparse.{self._parameter_names[p]}"
        scale = self._prescale * self._postscale
        self._sparse_gathers[p] = _SparseGather(grad, name, scale, self.process_set)
        return None

    def _reduced_grad(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """What ``p.grad`` becomes after the exchange, given the bucket's ``value`` for
        ``p``: the allgathered sparse gradient, ``value`` made sparse again
        (``sparse_as_dense``), or ``value`` itself."""
        gather = self._sparse_gathers.pop(p, None)
        if gather is not None:
            return gather.wait()
        if p in self._back_to_sparse:
            return value.to_sparse()
        return value

    def _submit(self, p: torch.Tensor) -> None:
        self._passes_left[p] = 0
        grad = self._dense_grad(p)
        if grad is not None and self._correction is not None and p in self._correction.covered:
            grad = self._correction.update(p, grad)
        slot, offset = self._slot_of[p]
        if not self._kinds_planned:
            self._plan_step_kinds()
        kind = slot.kind
        assert kind is not None, "planned above"
        # A dense step while the residual owes nothing reduces the bucket buffer; any
        # other step reduces the residual.
        in_buffer = slot.reducer.gradients_in_buffer(kind)
        if grad is None:
            # Allgathered on its own: the bucket carries nothing for it.
            if in_buffer:
                slot.flat[offset : offset + p.numel()].zero_()
        elif in_buffer:
            slot.flat[offset : offset + p.numel()].copy_(grad.reshape(-1))
        else:
            # Error feedback straight from p.grad into the residual: no bucket copy.
            slot.sparse_reducer.accumulate(grad, offset, self._prescale)
        slot.waiting -= 1
        if slot.waiting > 0:
            return
        # Last gradient of the bucket: start its exchange now, during backward.
        slot.stage = slot.reducer.launch(kind, slot.flat, self._prescale)
        if kind is StepKind.DENSE_FUSED:
            # Its allreduce is its run's, launched with the run's last bucket.
            assert self._fusion is not None and slot.fusion_index is not None
            run = self._fusion.complete(slot.fusion_index)
            if run is not None:
                self._launch_dense_run(self._fusion, run)
        elif self._trace is not None:
            label = "reduce-scatter" if isinstance(slot.stage, ScatterInFlight) else "allreduce"
            self._trace.launched(slot.bucket.name, slot.bucket.name, label, time.perf_counter())

    def _plan_step_kinds(self) -> None:
        """Each bucket's step kind, once per step: after the schedule and the density of
        the step are known, before any launch (dense-step fusion plans its runs here)."""
        self._kinds_planned = True
        for slot, kind in zip(self._buckets, self._engine.plan_step()):
            slot.kind = kind

    def _launch_dense_run(self, fusion: DenseFusion, run: list[int]) -> None:
        """One in-place allreduce over the arena slice of a run of dense buckets."""
        slots = [self._buckets[index] for index in run]
        arena, start, stop = fusion.span(run)
        name = f"hvds.opt.fused.{slots[0].bucket.name}-{slots[-1].bucket.name}"
        shared = DenseFusion.launch(
            BACKEND,
            self._arenas[arena][start:stop],
            stop - start,
            name,
            self.process_set,
        )
        now = time.perf_counter()
        for slot in slots:
            part = FusedPart(shared, slot.flat, slot.bucket.numel)
            slot.stage = slot.sparse_reducer.start_fused(part)
            if self._trace is not None:
                self._trace.launched(slot.bucket.name, slot.bucket.name, "allreduce (fused)", now)

    @property
    def fused_dense_runs(self) -> list[list[str]]:
        """Bucket names reduced together by one allreduce in the current (or, between
        steps, the last) step: runs of adjacent dense buckets (see
        :mod:`horovod_sparse.common.fusion`)."""
        return [[self._buckets[i].bucket.name for i in run] for run in self._engine.fusion_runs]

    # ------------------------------------------------------------------ public API
    def synchronize(self) -> None:
        """Finish every bucket's exchange and write the averaged gradients into ``p.grad``.

        Call it yourself before gradient clipping, then step inside
        :meth:`skip_synchronize`::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        if self._deferred is not None:
            raise RuntimeError(
                "synchronize() is not available with overlap_allgather=True: gradient "
                "clipping needs every averaged gradient before the step, but the all-gathers "
                "are deferred to the next forward pass. Turn overlap_allgather off to clip"
            )
        if not self._member:
            self._synchronized = True  # outside the process set: nothing to reduce
            return
        for slot, stage in self._launch_gathers():
            # The bucket buffer is free again: the result is written into it.
            result = self._finish_bucket(slot, stage)
            for entry, p in zip(slot.bucket.entries, slot.params):
                value = result[entry.offset : entry.offset + entry.numel].view_as(p)
                reduced = self._reduced_grad(p, value)
                grad = p.grad
                assert grad is not None, "_submit gives every parameter a gradient"
                if reduced is value and not grad.is_sparse:
                    grad.copy_(value)
                else:
                    # A sparse gradient's result; or a dense one for a sparse gradient
                    # (momentum correction), copied: the bucket buffer is reused.
                    p.grad = reduced if reduced is not value else value.clone()
        self._engine.record_step()
        self._end_step()
        self._synchronized = True

    def _launch_gathers(self) -> list[tuple[_BucketSlot, GatherInFlight]]:
        """Finish every reduce-scatter and launch every all-gather (waits for none)."""
        if not self._step_open:
            self._follow_world_size()
        # Parameters whose hook did not fire (unused this step) still take part.
        for p, left in self._passes_left.items():
            if left > 0:
                self._submit(p)
        trace = self._trace
        ended = time.perf_counter()
        if trace is not None:
            self._poll_trace()
            trace.backward_ended(ended)
        launched = []
        # Collectives run in launch order. With the all-gathers deferred to the next
        # forward, launch them in forward order (buckets are planned in backward
        # order), so the first layers' results arrive first.
        order = reversed(self._buckets) if self._deferred is not None else self._buckets
        for slot in order:
            began = time.perf_counter()
            assert slot.stage is not None, "_submit launched every bucket"
            was_scatter = isinstance(slot.stage, ScatterInFlight)
            stage = slot.reducer.reduce_and_gather(slot.stage)
            if trace is not None:
                name = slot.bucket.name
                trace.waited(name, began, time.perf_counter(), ended if was_scatter else None)
                if was_scatter:
                    trace.launched(f"{name}.ag", name, "all-gather", time.perf_counter())
            launched.append((slot, stage))
            slot.stage = None
        return launched

    def _finish_bucket(self, slot: _BucketSlot, stage: GatherInFlight) -> torch.Tensor:
        """Wait for one bucket's all-gather (or dense allreduce); the result, flat."""
        began = time.perf_counter()
        result = slot.reducer.finish(stage, slot.flat, self._postscale, out=slot.flat)
        if self._trace is not None:
            # A sparse step's all-gather, or the allreduce of a dense bucket or step.
            gather = f"{slot.bucket.name}.ag"
            key = gather if self._trace.in_flight(gather) else slot.bucket.name
            self._trace.waited(key, began, time.perf_counter(), None)
        return result

    def schedule(self) -> dict[str, dict[str, Any]]:
        """Per sparse bucket: the exchange the scheduler chose and its predictions.

        ``{"mode": "dense" | "sparse", "overlap": bool, "predicted_dense_s",
        "predicted_sparse_s", "local_s_per_element", "measured_dense_s",
        "measured_sparse_s"}`` (seconds per step; see
        :mod:`horovod_sparse.common.scheduler`). Before the first decision, or with
        ``scheduler="fixed"``, the mode is "sparse" and the figures are NaN. ``overlap``:
        whether the bucket's all-gather is left to the next forward pass (see
        :attr:`overlapping`).
        """
        return self._engine.schedule(self.overlapping)

    def schedule_trials(self) -> list[TrialOutcome]:
        """Every trial of the automatic scheduler so far: the modes before and tried
        (True: dense, per sparse bucket), the overlap before and tried (with
        ``overlap_allgather="auto"``), the median step seconds of each, and whether the
        tried setting was kept. Empty with ``scheduler="fixed"`` and no ``"auto"``
        overlap."""
        return self._engine.trials()

    def _end_step(self) -> None:
        self._begin_step()

    def _poll_trace(self) -> None:
        """Note reduce-scatters that finished (the trace's lifetimes); never blocks."""
        trace = self._trace
        assert trace is not None, "called only with a trace"
        now = time.perf_counter()
        for slot in self._buckets:
            if slot.stage is not None:
                done = BACKEND.poll(_handle_of(slot.stage))
                trace.polled(slot.bucket.name, done, now)

    def write_trace(self) -> str | None:
        """Write the Chrome trace (option ``trace``); returns its path, or None."""
        return self._trace.write() if self._trace is not None else None

    def trace_summary(self) -> dict[str, float]:
        """Reduce-scatter time hidden behind backward so far (option ``trace``)."""
        if self._trace is None:
            raise RuntimeError("pass trace=<path> to the optimizer to record a trace")
        hidden = self._trace.hidden
        return {
            "reduce_scatters": hidden.count,
            "lifetime_s": hidden.lifetime,
            "hidden_s": hidden.hidden,
            "hidden_fraction": hidden.fraction,
        }

    # ------------------------------------------------------------------ overlap
    def _step_deferred(self, closure: Any) -> Any:
        """``step()`` with overlap_allgather: launch the all-gathers and return; each
        bucket's update is applied before its parameters are next used."""
        if closure is not None:
            raise ValueError("step(closure) is not supported with overlap_allgather=True")
        deferred = self._deferred
        assert deferred is not None, "called only with overlap_allgather"
        deferred.apply_all()  # a step() with no forward since the last one
        deferred.defer(self._launch_gathers())
        if not self.overlapping:
            # overlap_allgather="auto" judged overlap slower: wait for the all-gathers
            # now, with the same per-bucket updates (the same trajectory).
            deferred.apply_all()
        self._end_step()
        return None

    @property
    def overlapping(self) -> bool:
        """Whether ``step()`` leaves the all-gathers to the next forward pass: always
        with ``overlap_allgather=True``, as the scheduler last chose with ``"auto"``
        (always, too, when no bucket is sparse: there is then no scheduler)."""
        if self._deferred is None:
            return False
        return self._scheduler is None or self._scheduler.overlap is not False

    def _apply_bucket(self, slot: _BucketSlot, stage: GatherInFlight) -> None:
        """Wait for ``slot``'s all-gather and step the wrapped optimizer over its parameters.

        ``p.grad`` holds the averaged gradient (a view of the bucket) during the step
        only; afterwards it is what it was (None after ``zero_grad()``), so the next
        backward accumulates into a clean gradient.
        """
        deferred = self._deferred
        assert deferred is not None, "called only with overlap_allgather"
        result = self._finish_bucket(slot, stage)
        saved = [p.grad for p in slot.params]
        for entry, p in zip(slot.bucket.entries, slot.params):
            p.grad = self._reduced_grad(
                p, result[entry.offset : entry.offset + entry.numel].view_as(p)
            )
        try:
            with deferred.only(slot.params):
                self._wrapped_step(None)
        finally:
            for p, grad in zip(slot.params, saved):
                p.grad = grad
        if not deferred.pending:
            self._engine.record_step()

    def flush(self) -> None:
        """Apply every update still waiting for its all-gather (``overlap_allgather``).

        Call it after the last ``step()`` when no forward pass follows; the optimizer's
        and the model's ``state_dict()`` call it too. A no-op without overlap.
        """
        if self._deferred is not None:
            self._deferred.apply_all()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make the next ``step()`` skip :meth:`synchronize` (already called by the user)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if not self._member:
            return self._local_step(closure)
        if _called_by_horovod_state_broadcast():
            # Horovod's broadcast_optimizer_state steps an optimizer whose state is
            # empty with zero gradients, on the ranks where it is empty only, to create
            # that state. Horovod's own optimizer then takes the wrapped optimizer's
            # local step; so does this one, or those ranks would wait in an exchange
            # that the others never join. Unlike Horovod's, it leaves the parameters as
            # they were: weight decay would otherwise move them on those ranks only,
            # after the user's broadcast_parameters.
            with torch.no_grad():
                params = [p for group in self.param_groups for p in group["params"]]
                before = [p.detach().clone() for p in params]
                try:
                    return self._local_step(closure)
                finally:
                    for p, value in zip(params, before):
                        p.copy_(value)
        if self._deferred is not None:
            if not self._should_synchronize:
                raise RuntimeError(
                    "skip_synchronize() is not available with overlap_allgather=True"
                )
            return self._step_deferred(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return self._wrapped_step(closure)

    def _wrapped_step(self, closure: Any) -> Any:
        if self._correction is None:
            return super().step(closure)
        return self._correction.step(super().step, closure)

    def _local_step(self, closure: Any) -> Any:
        """The wrapped optimizer's step on this rank's own ``p.grad``, with no exchange
        (momentum correction included: its state is created or advanced as a step
        would). ``p.grad`` is left as it was."""
        correction = self._correction
        if correction is None:
            return super().step(closure)
        saved = {}
        for p in correction.covered:
            if p.grad is not None:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                saved[p] = p.grad
                p.grad = correction.update(p, grad)
        try:
            return self._wrapped_step(closure)
        finally:
            for p, grad in saved.items():
                p.grad = grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(slot.stage is not None for slot in self._buckets):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return super().zero_grad(set_to_none=set_to_none)

    def stats(self) -> StepStats:
        """Statistics of the last synchronized step, summed over buckets and dense tensors."""
        return self._engine.stats()

    def residuals(self) -> dict[str, torch.Tensor]:
        """This rank's residual per bucket name (flat buffers; read-only views)."""
        return {slot.bucket.name: slot.sparse_reducer.residual for slot in self._sparse_slots()}

    def velocities(self) -> dict[str, torch.Tensor]:
        """This rank's SGD momentum-correction velocity per bucket name (flat buffers;
        read-only views); empty unless SGD momentum correction is on."""
        return {
            slot.bucket.name: slot.buffers["velocity"]
            for slot in self._buckets
            if "velocity" in slot.buffers
        }

    @property
    def momentum_correction(self) -> bool:
        """Whether the optimizer's momentum runs in front of the exchange for the
        parameters of sparse buckets (see :mod:`horovod_sparse.torch.momentum`)."""
        return self._correction is not None

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus, per sparse bucket, this rank's residual,
        step count, selection state (threshold) and partition boundaries.

        With momentum correction, the per-rank velocity or moments are the wrapped
        optimizer's own state entries (``momentum_buffer``; ``step``, ``exp_avg``,
        ``exp_avg_sq``), so Horovod's ``broadcast_optimizer_state`` and a plain torch
        optimizer read them as their own. Residuals are per rank: save one checkpoint
        per rank to resume exactly. See :meth:`load_state_dict` for loading on another
        rank or world size.
        """
        self.flush()
        root = _horovod_state_broadcast_root()
        if root is not None and self._member:
            self._take_shared_state_from(root)
        state = super().state_dict()
        if not self._member:
            return state
        state[_STATE_KEY] = {
            "rank": self.process_set.rank(),
            "world_size": self.process_set.size(),
            "owner": self._owner_token,
            "buckets": {
                name: _detached(state) for name, state in self._engine.state_dict().items()
            },
        }
        return state

    def _take_shared_state_from(self, root: int) -> None:
        """What every rank must agree on, taken from ``root`` (one small collective):
        each sparse bucket's step count (the density schedule, the scheduler's
        decisions) and partition boundaries.

        Horovod's ``broadcast_optimizer_state`` calls ``state_dict()`` first on every
        rank, then broadcasts the wrapped optimizer's state and hyperparameters only.
        After a restore on the root alone, the ranks would otherwise disagree on which
        steps are dense or when the scheduler decides, and wait in different collectives.
        """
        everyone = allgather_object(
            self._engine.shared_state(), "hvds.opt.shared_state", self.process_set
        )
        members = getattr(self.process_set, "ranks", None) or list(range(len(everyone)))
        self._engine.adopt_shared_state(everyone[members.index(root)])
        self._step_began = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Residuals and velocities follow this policy:

        - written by this optimizer (elastic ``commit``/``restore``), or by the same rank
          at the same world size (one checkpoint per rank): restored as saved;
        - written by another rank or at another world size: the saved residual is
          divided by this world size, so when every rank loads the same checkpoint its
          owed mass is counted exactly once; the velocity is loaded as saved. A
          warning says so, since the residuals the other ranks held at save time are
          not in this checkpoint. Owner regions are cut again for the new size.
        """
        state_dict = dict(state_dict)
        sparse_state = state_dict.pop(_STATE_KEY, None)
        super().load_state_dict(state_dict)
        if self._correction is not None:
            # The loaded entries are new tensors: their values go into the flat buffers,
            # which the exchange masks and the correction updates.
            self._correction.adopt_state()
        if not self._member:
            return
        # A step interrupted by a failure (elastic restore) leaves exchanges in flight
        # whose handles belong to the old world; the restored state replaces them, as
        # it replaces updates still deferred to the next forward.
        if self._deferred is not None:
            self._deferred.discard()
        self._begin_step()
        if sparse_state is None:
            return
        size = self.process_set.size()
        exact = sparse_state.get("owner") == self._owner_token or (
            sparse_state["rank"] == self.process_set.rank() and sparse_state["world_size"] == size
        )
        if not exact:
            warnings.warn(
                f"checkpoint residuals come from rank {sparse_state['rank']} of "
                f"{sparse_state['world_size']}; this is rank {self.process_set.rank()} of "
                f"{size}: each rank takes 1/{size} of the saved residual, so its mass counts "
                "once when every rank loads this checkpoint; the other ranks' residuals at "
                "save time are not in it",
                stacklevel=2,
            )
        # The residual policy above; the engine restores each bucket and lets the
        # scheduler decide again at the restored step, the same on every rank.
        self._engine.load_state_dict(sparse_state["buckets"], 1.0 if exact else 1.0 / size)
        self._step_began = None

    def _sparse_slots(self) -> list[_BucketSlot]:
        return [s for s in self._buckets if isinstance(s.reducer, BucketReducer)]


def _detached(state: dict[str, Any]) -> dict[str, Any]:
    """Copies of tensors, so a saved state does not change with later steps."""
    return {
        key: _detached(value)
        if isinstance(value, dict)
        else value.detach().clone()
        if isinstance(value, torch.Tensor)
        else value
        for key, value in state.items()
    }


class _SparseGather:
    """A sparse gradient's reduction as Horovod does it: two allgathers (its indices and
    its values), concatenated into one sparse tensor whose duplicates add up.

    Sends this rank's nnz rows of indices and values; receives every rank's.
    """

    def __init__(self, grad: torch.Tensor, name: str, scale: float, process_set: Any) -> None:
        grad = grad.coalesce()
        self._like = grad
        self._scale = scale
        # Allgather concatenates along the first dimension: one row per nonzero.
        self._indices = hvd.allgather_async(
            grad.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set
        )
        self._values = hvd.allgather_async(
            grad.values(), name=f"{name}.values", process_set=process_set
        )

    def wait(self) -> torch.Tensor:
        values = hvd.synchronize(self._values)
        indices = hvd.synchronize(self._indices)
        return torch.sparse_coo_tensor(
            indices.t(), values * self._scale, self._like.shape, dtype=self._like.dtype
        ).coalesce()


def _horovod_state_broadcast_root() -> int | None:
    """The root rank when ``state_dict()`` is the first call of Horovod's
    ``broadcast_optimizer_state``, which every rank makes; else None. (A second call
    follows a state-creating step on some ranks only, so it must send nothing.)"""
    frame: FrameType | None = sys._getframe(2)  # the caller of state_dict()
    for _ in range(3):
        if frame is None:
            return None
        if _is_horovod_state_broadcast(frame):
            if "state_dict" in frame.f_locals:  # its result of the first call
                return None
            return int(frame.f_locals["root_rank"])
        frame = frame.f_back
    return None


def _is_horovod_state_broadcast(frame: Any) -> bool:
    return frame.f_code.co_name == "broadcast_optimizer_state" and str(
        frame.f_globals.get("__name__", "")
    ).startswith("horovod.torch")


def _called_by_horovod_state_broadcast() -> bool:
    """Whether ``step()`` was called by Horovod's ``broadcast_optimizer_state`` (directly,
    or through a subclass's ``step``), which steps only the ranks whose state is empty."""
    frame: FrameType | None = sys._getframe(2)  # the caller of step()
    for _ in range(3):
        if frame is None:
            return False
        if _is_horovod_state_broadcast(frame):
            return True
        frame = frame.f_back
    return False


def allgather_object(obj: Any, name: str, process_set: Any) -> list[Any]:
    """Pickle-based allgather within ``process_set``.

    Horovod 0.28's ``allgather_object`` takes no process set. This version sends two
    small allgathers: the lengths, then the payloads.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = hvd.allgather(
        torch.tensor([payload.numel()], dtype=torch.int64),
        name=f"{name}.len",
        process_set=process_set,
    ).tolist()
    gathered = hvd.allgather(payload, name=f"{name}.data", process_set=process_set)
    out, start = [], 0
    for length in lengths:
        out.append(pickle.loads(gathered[start : start + length].numpy().tobytes()))
        start += length
    return out


def _handle_of(stage: ScatterInFlight | GatherInFlight) -> Any:
    if isinstance(stage, ScatterInFlight):
        return stage.sent.handle
    return stage.handle.pending if isinstance(stage.handle, FusedPart) else stage.handle


def _arena_layout(
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


def describe_parameters(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, int, str, int]]:
    """``(name, numel, dtype name, itemsize)`` per parameter, as the planner takes them."""
    return [(n, p.numel(), str(p.dtype).replace("torch.", ""), p.element_size()) for n, p in named]


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = hvd.Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = hvd.global_process_set,
    *,
    model: torch.nn.Module | None = None,
    **options: Any,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so its gradients are reduced by sparse allreduce.

    Accepts every argument of ``hvd.DistributedOptimizer`` with the same meaning, plus
    ``model`` (the module being trained; ``overlap_allgather`` needs it: its forward
    pre-hooks apply each bucket's deferred update, see :mod:`horovod_sparse.torch.overlap`)
    and the sparse options as keywords: ``density`` (fraction of entries exchanged per
    bucket, default 0.01), ``min_sparse_numel``, ``selection``, ``partition``,
    ``warmup_steps``, ``density_decay_steps``, ``momentum_correction``,
    ``overlap_allgather``, ``scheduler``, ``dense_fusion_bytes``, ``trace`` and the rest of
    :class:`~horovod_sparse.common.config.SparseConfig`, which documents each.

    With ``overlap_allgather`` on, :attr:`overlapping` says whether it is in force and
    ``synchronize()`` (clipping) is refused. With ``trace``, :meth:`write_trace` writes
    the Chrome trace and :meth:`trace_summary` says how much reduce-scatter time
    backward hid. :attr:`fused_dense_runs` says which dense buckets were fused.

    ``groups`` (lists of parameters) and ``num_groups`` define the fusion buckets.
    The returned object is an instance of ``Sparse<OptimizerClass>``, a subclass of both
    :class:`SparseOptimizerMixin` and ``type(optimizer)``; it adopts the optimizer's
    parameter groups and state.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> opt = DistributedOptimizer(opt, model.named_parameters(), density=0.01)
        >>> loss.backward(); opt.step()
        >>> opt.stats().bytes_sent
    """
    cls = combined_class(SparseOptimizerMixin, type(optimizer), __name__)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._setup_sparse(
        named_parameters=named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set,
        model=model,
        options=options,
    )
    return wrapped
