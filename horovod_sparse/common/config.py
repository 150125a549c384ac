"""User-facing knobs of the sparse allreduce, validated once, plus the budget rule."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "DEFAULT_FUSION_THRESHOLD_BYTES",
    "OPTION_NAMES",
    "SparseConfig",
    "budget",
    "fusion_threshold_bytes",
    "make_config",
    "optimizer_scales",
    "reduction_scales",
    "take_options",
]

# Horovod's own default fusion buffer (HOROVOD_FUSION_THRESHOLD): 128 MiB.
DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024

SELECTION_METHODS = ("exact", "threshold")
GLOBAL_SELECTIONS = ("exact", "reuse")
PARTITION_METHODS = ("uniform", "balanced")
SCHEDULERS = ("fixed", "auto")
OVERLAP_SETTINGS = (False, True, "auto")


def fusion_threshold_bytes(override: int | None = None) -> int:
    """Bucket capacity in bytes: ``override``, else ``HOROVOD_FUSION_THRESHOLD``, else 128 MiB."""
    if override is not None:
        value = int(override)
    else:
        value = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD_BYTES))
    if value <= 0:
        # Horovod treats 0 as "no fusion"; one tensor per bucket is the equivalent here.
        return 1
    return value


def budget(numel: int, density: float) -> int:
    """Global budget k = ceil(density * numel), at least 1 and at most ``numel``."""
    return max(1, min(numel, math.ceil(density * numel)))


@dataclass(frozen=True)
class SparseConfig:
    """Every option of the sparse allreduce, defined and validated here once.

    Each adapter (the torch optimizer, DDP hook and ``sparse_allreduce``, the TF tape,
    Keras optimizer and ``sparse_allreduce``) takes these as keywords next to Horovod's
    own arguments and builds one :class:`SparseConfig` from them (:func:`make_config`), so
    adding an option is one edit here, its row of
    :data:`~horovod_sparse.common.options.OPTION_SUPPORT` (which adapters act on it; the
    others refuse it by name), plus the adapter code that acts on it.

    Attributes:
        density: target fraction of entries exchanged per bucket, in (0, 1].
        min_sparse_numel: tensors with fewer elements go through a dense allreduce
            (a sparse exchange of a bias vector costs more latency than it saves bytes).
        selection: local selection: ``"threshold"`` (a sampled threshold, estimated
            every ``reestimate_steps`` steps, then the top k of the few entries above it) or
            ``"exact"`` (``topk`` over the whole bucket).
        partition: owner regions: ``"uniform"`` (equal length) or ``"balanced"`` (equal
            expected rows, from the selected positions, every ``repartition_steps``).
        fusion_threshold_bytes: bucket capacity; ``None`` follows ``HOROVOD_FUSION_THRESHOLD``.
        reestimate_steps: tau, steps between threshold estimates (sooner on drift). The
            default, 1, samples every step: with error feedback the accumulator's scale
            drifts, and a stale threshold's extra candidates cost more to trim than a
            fresh sample (16M floats, one thread: median 23.2 ms a step against 30.7 ms
            with 10).
        repartition_steps: tau', steps between balanced-partition updates.
        warmup_steps: first steps exchanged densely (residuals folded in).
        density_decay_steps: after warm-up, steps over which the density decays
            geometrically from 1 to ``density`` (as in DGC); 0 jumps straight to it.
        dense_fusion_bytes: on a step where adjacent buckets are all dense (a
            scheduler's choice, warm-up, density 1), they are reduced as one allreduce of
            at most this many bytes (:mod:`~horovod_sparse.common.fusion`). ``None``
            follows ``HOROVOD_FUSION_THRESHOLD`` (Horovod's dense fusion, 128 MiB by
            default); 0 reduces each bucket alone.
        error_feedback: keep unsent entries in the residual for later steps. ``False``
            drops them at the end of every step; it exists for ablation studies and
            loses gradient mass by design.
        momentum_correction: run the optimizer's momentum on each rank's gradient before
            the exchange (DGC): ``None`` turns it on where it applies (a sparse exchange
            under SGD with momentum, or Adam/AdamW), ``True`` insists, ``False`` leaves
            the wrapped optimizer as it is.
        residual_lookahead: each rank's training forward and backward run at the
            shared parameters moved by the update still pending in the ranks'
            residuals, estimated from its own (``p = shared - lr * postscale * P *
            residual``), so its gradients are taken where the pending updates would
            have led; ``step()`` puts the shared values
            back (:mod:`horovod_sparse.torch.lookahead`). ``None`` turns it on where it
            applies (the PyTorch optimizer with error feedback, a sparse bucket, no
            ``overlap_allgather``, and plain SGD or momentum correction), ``True``
            insists, ``False`` takes gradients at the shared parameters.
        overlap_allgather: ``True`` defers each bucket's all-gather and update to a
            forward pre-hook of the next iteration; ``"auto"`` lets trials of whole-step
            time decide (the PyTorch optimizer; needs the model).
        scheduler: ``"fixed"`` (every large bucket sparse) or ``"auto"`` (dense or
            sparse per bucket, from measured costs; the PyTorch optimizer).
        scheduler_steps: steps between the automatic scheduler's decisions.
        trace: write a Chrome trace of the exchange to this path (``{rank}`` is
            replaced; the PyTorch optimizer).
        global_selection: how owners find the global top-k threshold: ``"reuse"`` (the
            threshold every rank derives alike from the last all-gather, refreshed
            exactly every ``refresh_steps`` steps and when the gathered count leaves
            the band; no collective on the other steps) or ``"exact"`` (a radix
            select, 4 histogram allreduces every sparse step).
        refresh_steps: steps between exact refreshes of a reused global threshold.
        join_buckets: the sparse buckets of a step share one alltoall and one
            allgather (:mod:`~horovod_sparse.common.joined`), launched once the last
            of them is selected; ``False`` gives each bucket its own two, launched as
            soon as it is ready (more overlap with backward, a collective's latency
            per bucket).
        gather_selections: at P = 2, send each rank's selection to both ranks in one
            all-gather and let each rank apply both owners' global selections
            (:mod:`~horovod_sparse.common.pair_stages`): one collective a step instead
            of two, about the same bytes, the same result; ``False`` keeps the reduce-scatter
            and the all-gather. No effect at other world sizes.
        log_every: print one line of the step's figures (density, bytes against dense,
            exchange seconds, refreshes) on the process set's first rank every this many
            steps; 0 prints nothing (the PyTorch and Keras optimizers and the TF tape).
    """

    density: float = 0.01
    min_sparse_numel: int = 1024
    selection: str = "threshold"
    partition: str = "uniform"
    fusion_threshold_bytes: int | None = None
    reestimate_steps: int = 1
    repartition_steps: int = 50
    warmup_steps: int = 0
    density_decay_steps: int = 0
    dense_fusion_bytes: int | None = None
    error_feedback: bool = True
    momentum_correction: bool | None = None
    residual_lookahead: bool | None = None
    overlap_allgather: bool | str = False
    scheduler: str = "fixed"
    scheduler_steps: int = 100
    trace: str | None = None
    global_selection: str = "reuse"
    refresh_steps: int = 32
    log_every: int = 0
    join_buckets: bool = True
    gather_selections: bool = True

    def __post_init__(self) -> None:
        _check_density(self.density)
        _check_choice("selection", self.selection, SELECTION_METHODS)
        _check_choice("partition", self.partition, PARTITION_METHODS)
        _check_choice("global_selection", self.global_selection, GLOBAL_SELECTIONS)
        _check_choice("scheduler", self.scheduler, SCHEDULERS)
        _check_choice("overlap_allgather", self.overlap_allgather, OVERLAP_SETTINGS)
        _check_choice("momentum_correction", self.momentum_correction, (None, True, False))
        _check_choice("join_buckets", self.join_buckets, (True, False))
        _check_choice("gather_selections", self.gather_selections, (True, False))
        _check_choice("residual_lookahead", self.residual_lookahead, (None, True, False))
        for knob in ("reestimate_steps", "repartition_steps", "scheduler_steps", "refresh_steps"):
            _check_at_least(knob, getattr(self, knob), 1)
        for knob in ("min_sparse_numel", "warmup_steps", "density_decay_steps", "log_every"):
            _check_at_least(knob, getattr(self, knob), 0)
        for knob in ("fusion_threshold_bytes", "dense_fusion_bytes"):
            if getattr(self, knob) is not None:
                _check_at_least(knob, getattr(self, knob), 0)

    def unsupported(self, where: str, supported: frozenset[str]) -> None:
        """Refuse an option set away from its default that ``where`` does not act on.

        Raises:
            ValueError: naming the option and where it does not apply.
        """
        for spec in fields(self):
            if spec.name not in supported and getattr(self, spec.name) != spec.default:
                raise ValueError(
                    f"{spec.name}={getattr(self, spec.name)!r} does not apply to {where}"
                )

    @property
    def bucket_bytes(self) -> int:
        """Bucket capacity in bytes after the environment default is applied."""
        return fusion_threshold_bytes(self.fusion_threshold_bytes)

    @property
    def dense_fusion_cap(self) -> int:
        """Largest run of dense buckets reduced as one allreduce, in bytes (see
        ``dense_fusion_bytes``); 1 when fusion is off, which no bucket fits."""
        return fusion_threshold_bytes(self.dense_fusion_bytes)

    def budget(self, numel: int) -> int:
        """k for a bucket of ``numel`` elements at the target density."""
        return budget(numel, self.density)

    def sparse_density_at(self, step: Any) -> float:
        """:meth:`density_at` for a step known to be past warm-up; reads ``step`` only
        while the density decays."""
        if not self.density_decay_steps:
            return float(self.density)
        return self.density_at(step)

    def density_at(self, step: Any) -> float:
        """Scheduled density of step ``step`` (0-based): 1 during warm-up, then a
        geometric decay to ``density`` over ``density_decay_steps``, then ``density``."""
        if not (self.warmup_steps or self.density_decay_steps):
            return float(self.density)  # no schedule: ``step`` is not read (it may be a tensor)
        if step < self.warmup_steps:
            return 1.0
        decayed = step - self.warmup_steps
        if decayed < self.density_decay_steps:
            return float(float(self.density) ** ((decayed + 1) / self.density_decay_steps))
        return float(self.density)


def reduction_scales(
    op: str, world_size: int, prescale: float = 1.0, postscale: float = 1.0
) -> tuple[float, float]:
    """Factors applied before and after the sum, for Horovod's ``op`` by name.

    ``"average"`` divides by the process-set size after the sum, as Horovod does; ``"sum"``
    does not. The residual invariant holds in the pre-scaled sum space either way.

    Raises:
        ValueError: for any other reduction (Adasum, Min, Max, Product).
    """
    if op == "average":
        return prescale, postscale / world_size
    if op == "sum":
        return prescale, postscale
    raise ValueError(
        f"sparse allreduce supports op=Average and op=Sum, got op={op}; "
        "use Horovod's dense allreduce for other reductions"
    )


def optimizer_scales(
    op: str, world_size: int, gradient_predivide_factor: float
) -> tuple[float, float]:
    """Horovod's optimizer split of the average: ``1/f`` before the sum, ``f/P`` after it."""
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if op == "average":
        return reduction_scales(
            op, world_size, 1.0 / gradient_predivide_factor, gradient_predivide_factor
        )
    return reduction_scales(op, world_size)


OPTION_NAMES = frozenset(spec.name for spec in fields(SparseConfig))


def take_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """Remove the :class:`SparseConfig` options from ``keywords`` (an adapter's
    ``**kwargs``, which may also hold the wrapped optimizer's own) and return them."""
    return {name: keywords.pop(name) for name in list(keywords) if name in OPTION_NAMES}


def make_config(options: dict[str, Any]) -> SparseConfig:
    """A validated :class:`SparseConfig`; an unknown keyword is named in the error.

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a value out of range.
    """
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; the sparse options are "
            f"{', '.join(sorted(OPTION_NAMES))}"
        )
    return SparseConfig(**options)


def _check_density(density: Any) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number in (0, 1], got {density!r}")
    if not (0.0 < float(density) <= 1.0) or math.isnan(float(density)):
        raise ValueError(
            f"density must be in (0, 1], got {density!r}; use 1.0 for a dense exchange "
            "or e.g. 0.01 to send 1% of the entries"
        )


def _check_choice(knob: str, value: Any, choices: tuple[Any, ...]) -> None:
    # ``is``/type-exact match: 1 must not pass for True, nor 0 for False.
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"{knob} must be one of {choices}, got {value!r}")


def _check_at_least(knob: str, value: Any, least: int) -> None:
    if int(value) < least:
        raise ValueError(f"{knob} must be >= {least}, got {value}")
