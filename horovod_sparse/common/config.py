"""User-facing knobs of the sparse allreduce, validated once, plus the budget rule."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FUSION_THRESHOLD_BYTES",
    "SparseConfig",
    "budget",
    "fusion_threshold_bytes",
    "optimizer_scales",
    "reduction_scales",
]

# Horovod's own default fusion buffer (HOROVOD_FUSION_THRESHOLD): 128 MiB.
DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024

SELECTION_METHODS = ("exact", "threshold")
PARTITION_METHODS = ("uniform", "balanced")


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
    """Hyperparameters of the sparse allreduce.

    Attributes:
        density: target fraction of entries exchanged per bucket, in (0, 1].
        min_sparse_numel: tensors with fewer elements go through dense ``hvd.allreduce``
            (a sparse exchange of a bias vector costs more latency than it saves bytes).
        selection: local selection: ``"threshold"`` (a sampled threshold reused for
            ``reestimate_steps`` steps, then the top k of the few entries above it) or
            ``"exact"`` (``topk`` over the whole bucket).
        partition: owner regions: ``"uniform"`` (equal length) or ``"balanced"`` (equal
            expected rows, from the selected positions, every ``repartition_steps``).
        fusion_threshold_bytes: bucket capacity; ``None`` follows ``HOROVOD_FUSION_THRESHOLD``.
        reestimate_steps: tau, steps between threshold estimates (sooner on drift).
        repartition_steps: tau', steps between balanced-partition updates.
        warmup_steps: first steps exchanged densely (residuals folded in).
        density_decay_steps: after warm-up, steps over which the density decays
            geometrically from 1 to ``density`` (as in DGC); 0 jumps straight to it.
        dense_fusion_bytes: on a step where adjacent buckets are all dense (a
            scheduler's choice, warm-up, density 1), they are reduced as one allreduce of
            at most this many bytes (:mod:`~horovod_sparse.common.fusion`; PyTorch only).
            ``None`` follows ``HOROVOD_FUSION_THRESHOLD`` (Horovod's dense fusion, 128 MiB
            by default); 0 reduces each bucket alone.
        error_feedback: keep unsent entries in the residual for later steps. ``False``
            drops them at the end of every step; it exists for ablation studies and
            loses gradient mass by design.
    """

    density: float = 0.01
    min_sparse_numel: int = 1024
    selection: str = "threshold"
    partition: str = "uniform"
    fusion_threshold_bytes: int | None = None
    reestimate_steps: int = 10
    repartition_steps: int = 50
    warmup_steps: int = 0
    density_decay_steps: int = 0
    dense_fusion_bytes: int | None = None
    error_feedback: bool = True

    def __post_init__(self) -> None:
        density = self.density
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise TypeError(f"density must be a number in (0, 1], got {density!r}")
        if not (0.0 < float(density) <= 1.0) or math.isnan(float(density)):
            raise ValueError(
                f"density must be in (0, 1], got {density!r}; use 1.0 for a dense exchange "
                "or e.g. 0.01 to send 1% of the entries"
            )
        if int(self.min_sparse_numel) < 0:
            raise ValueError(f"min_sparse_numel must be >= 0, got {self.min_sparse_numel}")
        if self.selection not in SELECTION_METHODS:
            raise ValueError(
                f"selection must be one of {SELECTION_METHODS}, got {self.selection!r}"
            )
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"partition must be one of {PARTITION_METHODS}, got {self.partition!r}"
            )
        for knob in ("reestimate_steps", "repartition_steps"):
            if int(getattr(self, knob)) < 1:
                raise ValueError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        for knob in ("warmup_steps", "density_decay_steps"):
            if int(getattr(self, knob)) < 0:
                raise ValueError(f"{knob} must be >= 0, got {getattr(self, knob)}")
        for knob in ("fusion_threshold_bytes", "dense_fusion_bytes"):
            value = getattr(self, knob)
            if value is not None and int(value) < 0:
                raise ValueError(f"{knob} must be >= 0, got {value}")

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

    def density_at(self, step: int) -> float:
        """Scheduled density of step ``step`` (0-based): 1 during warm-up, then a
        geometric decay to ``density`` over ``density_decay_steps``, then ``density``."""
        if step < self.warmup_steps:
            return 1.0
        decayed = step - self.warmup_steps
        if decayed < self.density_decay_steps:
            return float(self.density) ** ((decayed + 1) / self.density_decay_steps)
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
