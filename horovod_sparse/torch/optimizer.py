"""Drop-in replacement for ``horovod.torch.DistributedOptimizer`` with sparse allreduce.

Gradients are copied into fusion buckets from post-accumulate-grad hooks; a bucket's
reduce-scatter (one alltoall) starts as soon as its last gradient arrives, while backward
continues on earlier layers. ``synchronize()`` finishes the owner reduction, global
selection and all-gather of every bucket and writes the result into ``p.grad``.
Tensors smaller than ``min_sparse_numel`` go through Horovod's dense allreduce.

The step's decisions and its run over all buckets are the engine's
(:mod:`horovod_sparse.common.engine`); this adapter keeps PyTorch's side: hooks,
parameter views, ``backward_passes_per_step``, ``synchronize``/``skip_synchronize`` and
``state_dict`` (docs/design.md §3). This module sets the optimizer up and holds its hooks;
``synchronize`` and ``step`` are :mod:`horovod_sparse.torch.stepping`'s, ``state_dict``
:mod:`horovod_sparse.torch.checkpoint`'s and the reports :mod:`horovod_sparse.torch.reporting`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import torch

from horovod_sparse.common.buckets import Bucket
from horovod_sparse.common.classes import combined_class
from horovod_sparse.common.config import SparseConfig, make_config, optimizer_scales, take_options
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.common.validation import raise_on_any_rank, verdict_of
from horovod_sparse.torch.assembly import attach_correction, build_engine, make_reducer
from horovod_sparse.torch.checkpoint import OptimizerCheckpoint
from horovod_sparse.torch.collectives import allgather_object
from horovod_sparse.torch.functions import BACKEND, op_name
from horovod_sparse.torch.gradients import GradientRouting
from horovod_sparse.torch.lookahead import ResidualLookahead, lookahead_supported
from horovod_sparse.torch.momentum import Correction, make_correction
from horovod_sparse.torch.overlap import DeferredUpdates
from horovod_sparse.torch.parameters import (
    name_parameters,
)
from horovod_sparse.torch.reporting import OptimizerReports
from horovod_sparse.torch.stepping import OptimizerStep

__all__ = ["DistributedOptimizer", "SparseOptimizerMixin"]


class SparseOptimizerMixin(OptimizerStep, OptimizerCheckpoint, OptimizerReports):
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
    def _setup_sparse(
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
        self.process_set = process_set
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._member = bool(process_set.included())
        self._should_synchronize = True
        self._synchronized = False
        self._deferred: DeferredUpdates | None = None
        self._correction: Correction | None = None
        self._lookahead: ResidualLookahead | None = None
        self._looks_ahead = False  # residual_lookahead, resolved with the options
        self._step_began: float | None = None  # host time the current step's backward began
        # Identifies this optimizer's own saved states (elastic commit/restore), whose
        # residuals belong to this process whatever its rank is now.
        self._owner_token = uuid.uuid4().hex
        if not self._member:
            # Outside the process set: the wrapped optimizer steps on this rank's own
            # gradients, with no collective, as Horovod's optimizer does there.
            self._parameter_names = {
                p: n for n, p in name_parameters(self.param_groups, named_parameters)
            }
            self.backward_passes_per_step = int(backward_passes_per_step)
            self.engine = Engine(BACKEND, [], [])
            self._buckets: list[Bucket] = []
            self._bucket_params: list[list[torch.Tensor]] = []
            return
        config, named = self._validated(named_parameters, options, model)
        self.sparse_config = config
        self._world_size = process_set.size()
        self._parameter_names = {p: n for n, p in named}  # as Horovod's optimizer has it
        self.engine, self._buckets, params = build_engine(
            named, config, groups, num_groups, process_set, compression
        )
        self._bucket_params = params
        self._set_scales()
        self._routing = GradientRouting(
            self.engine,
            self._buckets,
            params,
            self._parameter_names,
            self.backward_passes_per_step,
            sparse_as_dense,
            process_set,
        )
        self._correction = attach_correction(self._correction, self.engine, self._buckets, params)
        self._routing.correction = self._correction
        if self._looks_ahead:
            self._lookahead = ResidualLookahead(
                self, self.engine, self._buckets, params, self.process_set.size()
            )
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if config.overlap_allgather:
            assert model is not None  # checked with the options
            self._deferred = DeferredUpdates(
                self, model, self.engine, self._routing, lambda: self._wrapped_step(None)
            )

    def _validated(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        options: dict[str, Any],
        model: torch.nn.Module | None,
    ) -> tuple[SparseConfig, list[tuple[str, torch.Tensor]]]:
        """Check the arguments locally, then share the verdict in the one validation
        collective, so a problem on any rank is raised on every rank instead of leaving
        the others waiting in a collective; every rank must hold the same parameters."""
        problem: Exception | None = None
        named: list[tuple[str, torch.Tensor]] = []
        config = SparseConfig()
        try:
            config = make_config(options)
            refuse_unsupported(config, Frontend.TORCH_OPTIMIZER)
            self.backward_passes_per_step = int(self.backward_passes_per_step)
            self.gradient_predivide_factor = float(self.gradient_predivide_factor)
            if self.backward_passes_per_step < 1:
                raise ValueError(
                    f"backward_passes_per_step must be >= 1, got {self.backward_passes_per_step}"
                )
            optimizer_scales(
                op_name(self.op), self.process_set.size(), self.gradient_predivide_factor
            )
            named = name_parameters(self.param_groups, named_parameters)
            # Resolve momentum correction now: a bad request is an error like the others.
            self._correction = make_correction(
                self, config.momentum_correction, _can_be_sparse(config, named)
            )
            self._looks_ahead = _resolve_lookahead(self, config, named, self._correction)
            if config.overlap_allgather and not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"overlap_allgather={config.overlap_allgather!r} needs model=<the "
                    "torch.nn.Module being trained>: its forward pre-hooks apply each "
                    "bucket's update just before use"
                )
        except (TypeError, ValueError) as error:
            problem = error
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        everyone = allgather_object(
            (verdict_of(problem), mine), "hvds.opt.validate", self.process_set
        )
        raise_on_any_rank(everyone, mine, problem, "parameter", "the optimizer")
        return config, named

    def _set_scales(self) -> None:
        self.engine.prescale, self.engine.postscale = optimizer_scales(
            op_name(self.op), self.process_set.size(), self.gradient_predivide_factor
        )
        if self._correction is not None:
            self._correction.ranks = self.process_set.size()
        if self._lookahead is not None:
            self._lookahead.ranks = self.process_set.size()

    def _follow_world_size(self) -> None:
        """Rebuild the reducers when the process set changed size (elastic Horovod);
        the policy is the engine's (each surviving rank keeps its residual)."""
        if self.process_set.size() == self._world_size:
            return
        # The lookahead is left alone: this step's forward may have taken it already
        # (after elastic Horovod's broadcasts, which made the parameters the shared
        # ones), and step() must put those shared values back.
        self._world_size = self.process_set.size()
        self._set_scales()
        buckets, buffers, config = self._buckets, self.engine.buffers, self.sparse_config
        self.engine.follow_world_size(
            lambda i: make_reducer(
                buckets[i], buffers[i], config, self.process_set, self.compression
            )
        )

    # ------------------------------------------------------------------ hooks
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (as Horovod's optimizer offers); counts
        restart for the current step."""
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = int(passes)
        if self._member:
            self._routing.set_passes(self.backward_passes_per_step)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        routing = self._routing
        if not routing.step_open:
            routing.step_open = True
            self._open_step()
        self.engine.poll()
        if routing.arrived(p):
            routing.submit(p)

    def _open_step(self) -> None:
        """At a step's first gradient: pending updates, the world size, the scheduler."""
        if self._deferred is not None:
            # Updates of the last step not yet applied by a forward pre-hook.
            self._deferred.apply_all(late=True)
        self._follow_world_size()
        self._settle_loads()
        now = time.perf_counter()
        if self.engine.scheduler is not None:
            # Whole steps, from one backward's start to the next, judge trials.
            began, self._step_began = self._step_began, now
            self.engine.reschedule(self.engine.buffers[0], None if began is None else now - began)
        if self.engine.trace is not None:
            self.engine.trace.backward_step(now)
        self.engine.open_step()


def _resolve_lookahead(
    optimizer: torch.optim.Optimizer,
    config: SparseConfig,
    named: list[tuple[str, torch.Tensor]],
    correction: Correction | None,
) -> bool:
    """Whether ``residual_lookahead`` applies: ``None`` where the step goes where it
    looks, ``True`` insists (refused otherwise), ``False`` never.

    Raises:
        ValueError: ``residual_lookahead=True`` where the step would not go where it
            looks.
    """
    if config.residual_lookahead is False or not _can_be_sparse(config, named):
        return False
    if config.overlap_allgather:
        problem: str | None = (
            "residual_lookahead=True does not apply with overlap_allgather: the deferred "
            "updates step the parameters inside the next forward pass"
        )
    elif not config.error_feedback:
        problem = "residual_lookahead=True needs error_feedback=True (a residual)"
    else:
        problem = lookahead_supported(optimizer, correction is not None)
    if problem is not None and config.residual_lookahead:
        raise ValueError(problem)
    return problem is None


def _can_be_sparse(config: SparseConfig, named: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether some bucket can take a sparse step: a tensor large enough for a sparse
    bucket, and a density or warm-up that is not always dense."""
    schedule = config.density < 1.0 or config.warmup_steps > 0
    return schedule and any(p.numel() >= config.min_sparse_numel for _, p in named)


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
