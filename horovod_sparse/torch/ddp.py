"""The sparse allreduce as a ``DistributedDataParallel`` communication hook.

    state = SparseState(density=0.01)
    model.register_comm_hook(state, sparse_allreduce_hook)

Named after PyTorch's ``PowerSGDState`` / ``powerSGD_hook``. Each DDP bucket is one
:class:`~horovod_sparse.common.pipeline.BucketReducer` (error feedback, threshold
selection, balanced partition, Spar-Reduce-Scatter, owner sums, global selection,
Spar-All-Gather) on :class:`~horovod_sparse.torch.distributed.DistributedBackend`'s
``torch.distributed`` collectives: Gloo on CPU, NCCL on GPUs. The hook's result is the
average over the process group, as DDP's default hook returns.

DDP rebuilds its buckets after the first iteration (in the order gradients became
ready), so the first iteration is a plain allreduce, as PowerSGD's warm-up is: it leaves
no residual behind, and from the second iteration on each bucket keeps its residual.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at
# register_comm_hook (``bucket: dist.GradBucket``), as objects, not strings.
from typing import Any

import torch
import torch.distributed as dist

from horovod_sparse.common.config import (
    PER_TENSOR_OPTIONS,
    SparseConfig,
    make_config,
    optimizer_scales,
)
from horovod_sparse.common.handle import BucketHandle
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.stats import StepStats, dense_allreduce_stats
from horovod_sparse.torch.distributed import DistributedBackend

__all__ = ["SparseState", "sparse_allreduce_hook"]

BACKEND = DistributedBackend()
# The per-tensor options, and min_sparse_numel: a DDP bucket smaller than it is averaged
# densely (DDP's buckets hold whole parameters, so small ones rarely get a bucket alone).
HOOK_OPTIONS = PER_TENSOR_OPTIONS | {"min_sparse_numel"}


class SparseState:
    """The hook's state: the options, one reducer (and residual) per DDP bucket, the
    iteration count and the bucket layout. Pickles and has ``state_dict`` /
    ``load_state_dict``, so a checkpoint of it resumes exactly.

    Args:
        density: the fraction of each bucket's entries the exchange keeps, in (0, 1].
        process_group: the group to reduce over (None: the default group).
        **options: the per-tensor options of
            :class:`~horovod_sparse.common.config.SparseConfig`: ``selection``,
            ``partition``, ``reestimate_steps``, ``repartition_steps``, ``warmup_steps``,
            ``density_decay_steps``, ``error_feedback``, ``global_selection``,
            ``refresh_steps``, and ``min_sparse_numel`` (smaller buckets are averaged
            densely; default 1024).

    Resuming: a new DDP instance reduces its first iteration in one bucket of every
    parameter (its buckets are rebuilt afterwards), where the checkpointed run had its
    rebuilt buckets. The layout is saved as each bucket's parameter positions in that
    first bucket, so the resumed first iteration cuts it into the saved buckets and
    reduces each with its own residual, as the uninterrupted run does.
    """

    def __init__(self, density: float = 0.01, process_group: Any = None, **options: Any) -> None:
        config = make_config(dict(options, density=density))
        config.unsupported("the DDP communication hook", HOOK_OPTIONS)
        self._begin(config, process_group)

    def _begin(self, config: SparseConfig, process_group: Any) -> None:
        self.config = config
        self.process_group = process_group
        self.iteration = 0
        self.reducers: dict[int, BucketReducer] = {}
        self._saved: dict[int, dict[str, Any]] = {}  # loaded, for buckets not yet reduced
        # Each bucket's parameters, as positions in the instance's first (whole) bucket.
        self.layout: dict[int, list[int]] = {}
        self._positions: dict[int, int] = {}  # id(parameter) -> position, this instance
        self._last: dict[int, StepStats | None] = {}  # per bucket: dense figures, or None

    def reducer(self, index: int, buffer: torch.Tensor) -> BucketReducer:
        """The reducer of DDP bucket ``index`` (created at its first sparse step)."""
        reducer = self.reducers.get(index)
        if reducer is not None and reducer.numel != buffer.numel():
            raise RuntimeError(
                f"DDP bucket {index} changed from {reducer.numel} to {buffer.numel()} entries "
                "after the hook kept a residual for it; its residual cannot be carried over"
            )
        if reducer is None:
            reducer = BucketReducer(
                BACKEND,
                f"hvds.ddp.{index}",
                buffer.numel(),
                buffer,
                self.config,
                self.process_group,
            )
            saved = self._saved.pop(index, None)
            if saved is not None:
                reducer.load_state_dict(saved)
            self.reducers[index] = reducer
        return reducer

    def stats(self) -> StepStats:
        """The last iteration's figures, summed over buckets (dense ones included)."""
        total = StepStats()
        for index, dense in self._last.items():
            total += dense if dense is not None else self.reducers[index].last_stats()
        return total

    def state_dict(self) -> dict[str, Any]:
        buckets = {index: r.state_dict() for index, r in self.reducers.items()}
        return {
            "iteration": self.iteration,
            "buckets": {**self._saved, **buckets},
            "layout": {index: list(p) for index, p in self.layout.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.reducers = {}
        self._saved = {int(i): s for i, s in state["buckets"].items()}
        self.layout = {int(i): [int(p) for p in ps] for i, ps in state["layout"].items()}
        self._positions = {}  # the next call is a new DDP instance's first

    def __getstate__(self) -> dict[str, Any]:
        # A process group does not pickle: the unpickled state reduces over the default
        # group unless one is set (as PowerSGDState does).
        return {"config": self.config, "saved": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._begin(state["config"], None)
        self.load_state_dict(state["saved"])

    # ---------------------------------------------------------------- one bucket
    def reduce(self, bucket: dist.GradBucket) -> torch.Tensor:
        buffer = bucket.buffer()
        parameters = bucket.parameters()
        if not self._positions:
            # A DDP instance's first iteration: one bucket of every parameter, rebuilt
            # after it. With a saved layout (a resumed run), the saved buckets are cut
            # out of it; else a dense average (the first iteration of a run, or a state
            # saved before any sparse step: no residual exists yet).
            if not (bucket.index() == 0 and bucket.is_last()):
                raise RuntimeError(
                    "the sparse hook expects DDP's first iteration in one bucket (DDP does "
                    "so unless find_unused_parameters=True, which this hook does not support)"
                )
            self._positions = {id(p): i for i, p in enumerate(parameters)}
            if self.layout:
                return self._replay(buffer, parameters)
            return self._dense(bucket.index(), buffer)
        self.layout[bucket.index()] = [self._positions[id(p)] for p in parameters]
        return self._sparse(bucket.index(), buffer)

    def _dense(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        size = dist.get_world_size(self.process_group)
        dist.all_reduce(buffer.div_(size), group=self.process_group)
        itemsize = buffer.element_size()
        self._last[index] = dense_allreduce_stats(buffer.numel(), size, itemsize, itemsize)
        return buffer

    def _sparse(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.numel() < self.config.min_sparse_numel:
            return self._dense(index, buffer)
        self._last[index] = None
        reducer = self.reducer(index, buffer)
        size = dist.get_world_size(self.process_group)
        prescale, postscale = optimizer_scales("average", size, 1.0)
        stage = reducer.start(buffer, prescale)
        return BucketHandle(reducer, stage, buffer, postscale, out=buffer).wait()

    def _replay(self, buffer: torch.Tensor, parameters: list[torch.Tensor]) -> torch.Tensor:
        """A resumed instance's first iteration: the whole bucket cut into the saved
        buckets, each reduced with its own residual, in the saved index order."""
        starts, offset = [], 0
        for p in parameters:
            starts.append(offset)
            offset += p.numel()
        for index in sorted(self.layout):
            pieces = [(starts[i], parameters[i].numel()) for i in self.layout[index]]
            flat = torch.cat([buffer[a : a + n] for a, n in pieces])
            result = self._sparse(index, flat)
            done = 0
            for a, n in pieces:
                buffer[a : a + n].copy_(result[done : done + n])
                done += n
        return buffer


def sparse_allreduce_hook(
    state: SparseState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sparse average of the bucket over the process group."""
    result = state.reduce(bucket)
    if bucket.is_last():
        state.iteration += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(result)
    return future
