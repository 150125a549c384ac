"""How the torch optimizer's exchange is put together from its parameters.

The plan (the rule every framework shares, :func:`~horovod_sparse.common.buckets.plan_model`),
the bucket buffers (sparse buckets as views of arenas, so dense-step fusion reduces a
run as one slice), one reducer per bucket, the automatic scheduler when asked for, the
engine over all of them, and momentum correction's buffers over the sparse buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch

from horovod_sparse.common.buckets import Bucket, plan_model
from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.engine import Engine, Reducer
from horovod_sparse.common.fusion import DenseFusion
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.scheduler import AutoScheduler
from horovod_sparse.common.stats import StepStats, progress_line
from horovod_sparse.common.trace import Trace
from horovod_sparse.torch.functions import BACKEND
from horovod_sparse.torch.momentum import Correction
from horovod_sparse.torch.parameters import arena_layout, describe_parameters, group_names

__all__ = ["attach_correction", "build_engine", "make_reducer"]


def build_engine(
    named: list[tuple[str, torch.Tensor]],
    config: SparseConfig,
    groups: Any,
    num_groups: int,
    process_set: Any,
    compression: Any,
) -> tuple[Engine, list[Bucket], list[list[torch.Tensor]]]:
    """The engine over the planned buckets; the buckets; each bucket's parameters."""
    by_name = dict(named)
    names = {p: n for n, p in named}
    plan = plan_model(
        describe_parameters(named),
        config.min_sparse_numel,
        config.bucket_bytes,
        group_names(groups, names),
        num_groups if not isinstance(groups, int) else groups,
    )
    buckets = list(plan.buckets)
    params = [[by_name[e.name] for e in bucket.entries] for bucket in buckets]
    flats, members, arenas = arena_layout(params[: len(plan.sparse)])
    flats += [
        torch.zeros(b.numel, dtype=ps[0].dtype, device=ps[0].device)
        for b, ps in zip(buckets[len(flats) :], params[len(flats) :])
    ]
    # Lossy compression reduces a copy in the wire dtype, not the buffer in place.
    no_compression = compression is None or compression is hvd.Compression.none
    fused = len(members) >= 2 and no_compression
    engine = Engine(
        BACKEND,
        [b.name for b in buckets],
        [make_reducer(b, f, config, process_set, compression) for b, f in zip(buckets, flats)],
        DenseFusion(members, config.dense_fusion_cap) if fused else None,
        make_scheduler(list(plan.sparse), flats, config, process_set),
        buffers=flats,
        arenas=arenas,
        members=[len(ps) for ps in params],
        trace=Trace(config.trace, process_set.rank()) if config.trace is not None else None,
        progress=_printer(config.density) if process_set.rank() == 0 else None,
        progress_every=config.log_every,
    )
    return engine, buckets, params


def _printer(target_density: float) -> Callable[[int, StepStats], None]:
    """``log_every``'s output: one line per logged step on stdout, flushed at once so
    that ``horovodrun`` shows it as it happens."""

    def show(step: int, stats: StepStats) -> None:
        print(progress_line(step, stats, target_density), flush=True)

    return show


def make_reducer(
    bucket: Bucket, flat: torch.Tensor, config: SparseConfig, process_set: Any, compression: Any
) -> Reducer:
    """A reducer for ``bucket`` over ``process_set`` as it is now."""
    name = f"hvds.opt.{bucket.name}"
    if bucket.kind == "sparse":
        return BucketReducer(BACKEND, name, bucket.numel, flat, config, process_set, compression)
    return DenseBucketReducer(BACKEND, name, bucket.numel, flat, process_set, compression)


def make_scheduler(
    sparse: list[Bucket], flats: list[torch.Tensor], config: SparseConfig, process_set: Any
) -> AutoScheduler | None:
    """The automatic scheduler over the sparse buckets, when ``scheduler="auto"`` or
    ``overlap_allgather="auto"`` asks for one."""
    judge_overlap = config.overlap_allgather == "auto"
    if not sparse or not (config.scheduler == "auto" or judge_overlap):
        return None
    return AutoScheduler(
        BACKEND,
        "hvds.opt.schedule",
        process_set,
        [(b.numel, f.element_size()) for b, f in zip(sparse, flats)],
        config.density,
        every=config.scheduler_steps,
        choose_density=config.scheduler == "auto",
        # Starts overlapped; trials then judge it against waiting in step().
        overlap=True if judge_overlap else None,
    )


def attach_correction(
    correction: Correction | None,
    engine: Engine,
    buckets: list[Bucket],
    params: list[list[torch.Tensor]],
) -> Correction | None:
    """Correct the parameters of sparse buckets (a tensor that is always reduced
    densely steps by the wrapped optimizer's own algorithm); None when no bucket is
    sparse: there is nothing to correct."""
    if correction is None:
        return None
    for index, (bucket, members) in enumerate(zip(buckets, params)):
        if bucket.kind == "sparse":
            offsets = [e.offset for e in bucket.entries]
            masked = correction.cover(bucket.name, members, offsets, engine.buffers[index])
            engine.mask_with(index, masked)
    return correction if correction.covered else None
