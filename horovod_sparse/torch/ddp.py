"""The sparse allreduce as a ``DistributedDataParallel`` communication hook.

    state = SparseState(density=0.01, momentum=0.9)  # SGD's momentum, run by the hook
    model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # so: no momentum here

Named after PyTorch's ``PowerSGDState`` / ``powerSGD_hook``. Each DDP bucket is one
:class:`~horovod_sparse.common.pipeline.BucketReducer` (error feedback, threshold
selection, balanced partition, Spar-Reduce-Scatter, owner sums, global selection,
Spar-All-Gather) on :class:`~horovod_sparse.torch.distributed.DistributedBackend`'s
``torch.distributed`` collectives: Gloo on CPU, NCCL on GPUs. The hook's result is the
average over the process group, as DDP's default hook returns.

DDP rebuilds its buckets after the first iteration (in the order gradients became
ready), so the first iteration is a plain allreduce, as PowerSGD's warm-up is: it leaves
no residual behind, and from the second iteration on each bucket keeps its residual.

The exchanges overlap the backward pass: the hook launches its bucket's first collective
(a sparse step's reduce-scatter, or the allreduce of a dense step) and returns the
bucket's future without waiting. Every collective is issued from the hooks, in bucket
order, so every rank issues the same sequence (Gloo and NCCL need that): bucket b+1's
hook first finishes bucket b's reduce-scatter and launches its all-gather, then launches
its own; the last bucket's hook finishes every pending bucket, in bucket order, and
completes their futures before DDP waits on them. Waiting on a bucket's future from
Python (a wrapper hook that waits) finishes the pending buckets up to it, in the same
order. No collective is issued from a future's callback, whose thread and timing differ
from rank to rank.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at
# register_comm_hook (``bucket: dist.GradBucket``), as objects, not strings.
import uuid
from typing import Any

import torch
import torch.distributed as dist

from horovod_sparse.common.config import (
    SparseConfig,
    make_config,
    optimizer_scales,
)
from horovod_sparse.common.correction import sgd_direction
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.engine_state import residual_share_among
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.stats import StepStats, dense_allreduce_stats
from horovod_sparse.torch.ddp_checkpoint import GatheredState
from horovod_sparse.torch.ddp_flight import BucketFuture, InFlight, Pending
from horovod_sparse.torch.distributed import DistributedBackend, FP16Values

__all__ = ["GatheredState", "SparseState", "sparse_allreduce_hook"]

BACKEND = DistributedBackend()
# The velocity key of the instance's first iteration, whose one bucket holds everything.
WHOLE = -1


class SparseState:
    """The hook's state: the options, one reducer (and residual) per DDP bucket, the
    iteration count and the bucket layout. Pickles and has ``state_dict`` /
    ``load_state_dict``, so a checkpoint of it resumes exactly.

    Args:
        density: the fraction of each bucket's entries the exchange keeps, in (0, 1].
        process_group: the group to reduce over (None: the default group); DDP's own
            process group. It does not pickle: an unpickled state reduces over the
            default group (as PowerSGDState's does).
        momentum, nesterov: SGD momentum run by the hook on each rank's gradient before
            the exchange (DGC's momentum correction, with momentum factor masking); the
            optimizer is then built without momentum (``SGD(params, lr)``), and steps by
            the exchanged direction. At density 1 this is momentum SGD up to rounding.
            Without it, error feedback's late lumps meet the optimizer's momentum, which
            amplifies them (default 0: off; a hook cannot see the optimizer).
        fp16_values: send the sparse buckets' values as fp16 (indices stay int32): 6
            bytes per kept entry instead of 8 in fp32. The rounding stays in the
            residual. The first iteration and buckets under ``min_sparse_numel`` go at
            the gradient's own precision; a sparse bucket's dense steps (warm-up,
            density 1) are fp16 allreduces, their rounding kept in the residual too.
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

    def __init__(
        self,
        density: float = 0.01,
        process_group: Any = None,
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        fp16_values: bool = False,
        **options: Any,
    ) -> None:
        for name, flag in (("fp16_values", fp16_values), ("nesterov", nesterov)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, not {flag!r}")
        if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), not {momentum!r}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        config = make_config(dict(options, density=density))
        refuse_unsupported(config, Frontend.DDP_HOOK)
        self._begin(config, process_group, float(momentum), nesterov, fp16_values)

    def _begin(
        self,
        config: SparseConfig,
        process_group: Any,
        momentum: float,
        nesterov: bool,
        fp16_values: bool,
    ) -> None:
        self.config = config
        self.process_group = process_group
        self.momentum = momentum
        self.nesterov = nesterov
        self.fp16_values = fp16_values
        self.iteration = 0
        self.reducers: dict[int, BucketReducer] = {}
        self._saved: dict[int, dict[str, Any]] = {}  # loaded, for buckets not yet reduced
        # Each bucket's parameters, as positions in the instance's first (whole) bucket.
        self.layout: dict[int, list[int]] = {}
        self._positions: dict[int, int] = {}  # id(parameter) -> position, this instance
        self._pieces: list[tuple[int, int]] = []  # per position: (offset, numel) in it
        self._last: dict[int, StepStats | None] = {}  # per bucket: dense figures, or None
        # Momentum correction's velocity per bucket index (WHOLE: the first iteration's).
        self.velocity: dict[int, torch.Tensor] = {}
        self._engines: dict[int, Engine] = {}  # one engine of one bucket per DDP bucket
        self._saver: dict[str, Any] | None = None  # who saved the loaded state
        self._share: float | None = None  # of the loaded residuals, once agreed
        self._flight = InFlight()  # exchanges in flight, in launch order
        # Who saved a checkpoint of this state: the residual policy (docs/design.md §6).
        self._owner_token = uuid.uuid4().hex

    @property
    def max_in_flight(self) -> int:
        """The most buckets whose exchanges were in flight at once, since this state
        was made (2 or more: bucket b's all-gather was still running when bucket b+1's
        reduce-scatter was launched; 1: each bucket was done before the next began, as
        under a hook that waits on each bucket's future)."""
        return self._flight.max_in_flight

    def reducer(self, index: int, buffer: torch.Tensor) -> BucketReducer:
        """The reducer of DDP bucket ``index`` (created at its first sparse step)."""
        return self._engine(index, buffer).sparse[0]

    def _engine(self, index: int, buffer: torch.Tensor) -> Engine:
        """The engine of DDP bucket ``index``'s steps (created at its first sparse step,
        from a loaded checkpoint's state by the residual policy, docs/design.md §6)."""
        engine = self._engines.get(index)
        if engine is not None and engine.sparse[0].numel != buffer.numel():
            raise RuntimeError(
                f"DDP bucket {index} changed from {engine.sparse[0].numel} to "
                f"{buffer.numel()} entries after the hook kept a residual for it; its "
                "residual cannot be carried over"
            )
        if engine is None:
            reducer = BucketReducer(
                BACKEND,
                f"hvds.ddp.{index}",
                buffer.numel(),
                buffer,
                self.config,
                self.process_group,
                FP16Values if self.fp16_values else None,
            )
            share = self._residual_share()  # a collective: before any bucket's exchange
            saved = self._saved.pop(index, None)
            if saved is not None:
                reducer.load_state_dict(saved, share)
            engine = self._engines[index] = Engine(BACKEND, [f"ddp.{index}"], [reducer])
            size = dist.get_world_size(self.process_group)
            engine.prescale, engine.postscale = optimizer_scales("average", size, 1.0)
            self.reducers[index] = reducer
        return engine

    def _residual_share(self) -> float:
        """The share of its loaded residuals this rank takes (docs/design.md §6,
        ``residual_share_among``): every rank says whose residuals it loaded, in one
        ``all_gather_object`` at the first sparse step after the state was made or
        loaded (every rank runs it there, loaded or not), so that a checkpoint saved by
        one rank and loaded by all (as Accelerate and Lightning save) counts its mass
        once, and per-rank checkpoints restore exactly."""
        if self._share is None:
            saver = self._saver
            mine = None if saver is None else (int(saver["rank"]), str(saver["owner"]))
            everyone: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(everyone, mine, group=self.process_group)
            self._share = residual_share_among(mine, everyone)
        return self._share

    def stats(self) -> StepStats:
        """The last iteration's figures, summed over buckets (dense ones included);
        complete once the backward pass has returned (the last bucket's hook finished
        every bucket)."""
        total = StepStats()
        for index, dense in self._last.items():
            total += dense if dense is not None else self.reducers[index].last_stats()
        return total

    def state_dict(self) -> dict[str, Any]:
        """Residuals, steps, layout and velocities (references, as torch optimizers'
        state), and who saved them (rank, world size, this process), so that a
        checkpoint saved by one rank and loaded by all counts its residual once."""
        buckets = {index: r.state_dict() for index, r in self.reducers.items()}
        initialized = dist.is_available() and dist.is_initialized()
        return {
            "rank": dist.get_rank(self.process_group) if initialized else 0,
            "world_size": dist.get_world_size(self.process_group) if initialized else 1,
            "owner": self._owner_token,
            "iteration": self.iteration,
            "buckets": {**self._saved, **buckets},
            "layout": {index: list(p) for index, p in self.layout.items()},
            "velocity": dict(self.velocity),  # references, as torch optimizers' state
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; each bucket's residual is taken at its next step
        by the residual policy of docs/design.md §6 (a warning when this rank loads
        another rank's residuals)."""
        self.iteration = int(state["iteration"])
        self._saver = (
            {k: state[k] for k in ("rank", "world_size", "owner")} if "owner" in state else None
        )
        self.reducers, self._engines, self._share = {}, {}, None
        self._saved = {int(i): s for i, s in state["buckets"].items()}
        self.layout = {int(i): [int(p) for p in ps] for i, ps in state["layout"].items()}
        self.velocity = {int(i): v.clone() for i, v in state.get("velocity", {}).items()}
        self._positions, self._pieces = {}, []  # the next call is a new DDP instance's first
        self._last = {}

    def __getstate__(self) -> dict[str, Any]:
        # A process group does not pickle: the unpickled state reduces over the default
        # group unless one is set (as PowerSGDState does).
        return {
            "config": self.config,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "fp16_values": self.fp16_values,
            "saved": self.state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        names = {"momentum": 0.0, "nesterov": False, "fp16_values": False}
        options = (state.get(name, default) for name, default in names.items())
        self._begin(state["config"], None, *options)
        self.load_state_dict(state["saved"])

    # ---------------------------------------------------------------- one bucket
    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Launch ``bucket``'s exchange and return the future of its average; the last
        bucket's call finishes every bucket's (see the module's docstring)."""
        try:
            future = self._launch_bucket(bucket)
            if bucket.is_last():
                self._flight.finish(None)
            else:
                self._flight.finish_ready()
        except BaseException as error:
            self._flight.fail(error)
            raise
        return future

    def _launch_bucket(self, bucket: dist.GradBucket) -> BucketFuture:
        buffer = bucket.buffer()
        parameters = bucket.parameters()
        if bucket.index() == 0 and self._flight.pending:
            # Only an error ends a backward pass before its last bucket's hook.
            self._flight.fail(
                RuntimeError("the previous backward pass ended before its last bucket")
            )
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
            offset = 0
            for p in parameters:
                self._pieces.append((offset, p.numel()))
                offset += p.numel()
            if self.layout:
                return self._replay(buffer)
            self._correct(WHOLE, buffer)
            return self._flight.track(self._dense(bucket.index(), buffer))
        index = bucket.index()
        positions = [self._positions[id(p)] for p in parameters]
        if positions != self.layout.get(index, positions) and (
            index in self.reducers or index in self.velocity
        ):
            raise RuntimeError(
                f"DDP bucket {index} now holds other parameters than when the hook kept a "
                "residual or velocity for it; they cannot be carried over"
            )
        self.layout[index] = positions
        whole = self.velocity.get(WHOLE)
        if whole is not None and index not in self.velocity:
            # The first rebuilt iteration: each bucket takes its parameters' velocity.
            self.velocity[index] = self._cut(whole, index)
        future = self._flight.track(self._sparse(index, buffer))
        if bucket.is_last():
            self.velocity.pop(WHOLE, None)  # every bucket has taken its part
        return future

    def _cut(self, whole: torch.Tensor, index: int) -> torch.Tensor:
        """Bucket ``index``'s entries of a tensor laid out as the first (whole) bucket."""
        pieces = [self._pieces[i] for i in self.layout[index]]
        return torch.cat([whole[a : a + n] for a, n in pieces])

    def _correct(self, key: int, buffer: torch.Tensor) -> None:
        """With ``momentum``, replace the gradient in ``buffer`` by this rank's SGD
        momentum direction (DGC's momentum correction), updating the velocity."""
        if not self.momentum:
            return
        velocity = self.velocity.get(key)
        if velocity is None:
            velocity = self.velocity[key] = torch.zeros_like(buffer)  # u starts as g
        elif velocity.numel() != buffer.numel():
            raise RuntimeError(
                f"DDP bucket {key} changed from {velocity.numel()} to {buffer.numel()} "
                "entries after the hook kept a velocity for it; it cannot be carried over"
            )
        elif velocity.device != buffer.device or velocity.dtype != buffer.dtype:
            velocity = self.velocity[key] = velocity.to(buffer)  # e.g. loaded on the CPU
        direction, _ = sgd_direction(BACKEND, buffer, velocity, self.momentum, 0.0, self.nesterov)
        buffer.copy_(direction)

    def _dense(self, index: int, buffer: torch.Tensor) -> Pending:
        """The first iteration's, or a small bucket's, average: an allreduce in place."""
        size = dist.get_world_size(self.process_group)
        self._flight.advance()  # the earlier buckets' collectives first
        work = BACKEND.allreduce_sum_inplace_async(
            buffer.div_(size), f"hvds.ddp.{index}.dense", self.process_group
        )
        itemsize = buffer.element_size()
        self._last[index] = dense_allreduce_stats(buffer.numel(), size, itemsize, itemsize)
        pending = Pending(index, work=work, wait_work=BACKEND.wait, poll_work=BACKEND.poll)
        return self._flight.launched(pending)

    def _sparse(self, index: int, buffer: torch.Tensor) -> Pending:
        """A sparse bucket's step, of the kind its engine's plan gives, launched on the
        bucket buffer (which the result is written into)."""
        self._correct(index, buffer)
        if buffer.numel() < self.config.min_sparse_numel:
            return self._dense(index, buffer)
        self._last[index] = None
        engine = self._engine(index, buffer)
        # Momentum factor masking: the entries sent leave the velocity too.
        engine.mask_with(0, self.velocity.get(index))
        engine.begin_step()
        engine.open_step()
        if not engine.gradients_in_buffer(0):
            engine.accumulate(0, buffer, 0)  # error feedback, into the residual
        self._flight.advance()  # the earlier buckets' collectives first
        handle = engine.launch(0, buffer)
        assert handle is not None, "one bucket: never a fused run"
        return self._flight.launched(Pending(index, handle=handle))

    def _replay(self, buffer: torch.Tensor) -> BucketFuture:
        """A resumed instance's first iteration: the whole bucket cut into the saved
        buckets, each reduced with its own residual, in the saved index order; each
        piece's result is copied back into ``buffer``, whose future the last completes."""
        pending = [self._sparse(index, self._cut(buffer, index)) for index in sorted(self.layout)]
        for piece in pending:
            piece.paste = buffer
            piece.pieces = [self._pieces[i] for i in self.layout[piece.index]]
        return self._flight.track(pending[-1])


def sparse_allreduce_hook(
    state: SparseState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sparse average of the bucket over the process group.

    Returns without waiting for the exchange: the future completes once a later
    bucket's hook, or this one if the bucket is the last, has finished it (see the
    module's docstring); ``state.max_in_flight`` tells how many overlapped."""
    future = state.reduce(bucket)
    if bucket.is_last():
        state.iteration += 1
    return future
