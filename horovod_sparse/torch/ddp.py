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
Under ``find_unused_parameters=True`` DDP keeps its first buckets, and each is sparse
from the first iteration (``ddp_layout.BucketLayout``).

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
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.stats import StepStats, dense_allreduce_stats
from horovod_sparse.torch.ddp_correction import WHOLE, HookCorrection
from horovod_sparse.torch.ddp_flight import BucketFuture, InFlight, Pending
from horovod_sparse.torch.ddp_layout import BucketLayout
from horovod_sparse.torch.ddp_lookahead import HookLookahead
from horovod_sparse.torch.ddp_saving import StateSaving
from horovod_sparse.torch.ddp_scaling import LossScaling
from horovod_sparse.torch.ddp_small import SmallParameters
from horovod_sparse.torch.distributed import BACKEND, FP16Values
from horovod_sparse.torch.gathered import GatheredState

__all__ = ["GatheredState", "SparseState", "sparse_allreduce_hook"]


class SparseState(StateSaving):
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
        betas, eps: Adam's, run by the hook instead (``ddp_correction``): each rank keeps
            its own moments and the exchange carries Adam's direction, normalized for
            the average of the ranks' gradients
            (:func:`~horovod_sparse.common.correction.adam_direction`); the optimizer is
            ``SGD(params, lr, weight_decay=wd)``, whose decay is AdamW's decoupled one
            (default None: off).
        grad_scaler: the ``torch.amp.GradScaler`` of fp16 training: the hook works on
            unscaled gradients and undoes a step the scaler will skip (``ddp_scaling``).
        fp16_values: send the sparse buckets' values as fp16 (indices stay int32): 6
            bytes per kept entry instead of 8 in fp32. The rounding stays in the
            residual. The first iteration and buckets under ``min_sparse_numel`` go at
            the gradient's own precision; a sparse bucket's dense steps (warm-up,
            density 1) are fp16 allreduces, their rounding kept in the residual too.
        **options: the per-tensor options of
            :class:`~horovod_sparse.common.config.SparseConfig`: ``selection``,
            ``partition``, ``reestimate_steps``, ``repartition_steps``, ``warmup_steps``,
            ``density_decay_steps``, ``error_feedback``, ``global_selection``,
            ``refresh_steps``, and ``min_sparse_numel`` (smaller buckets, and a sparse
            bucket's smaller parameters, are averaged densely; default 1024).

    Resuming: the layout is saved as each bucket's parameter positions
    (``ddp_layout``); a resumed DDP instance's one first bucket is cut into the saved
    buckets, each reduced with its own residual, as the uninterrupted run does.
    """

    def __init__(
        self,
        density: float = 0.01,
        process_group: Any = None,
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        betas: tuple[float, float] | None = None,
        eps: float = 1e-8,
        fp16_values: bool = False,
        grad_scaler: Any = None,
        **options: Any,
    ) -> None:
        if not isinstance(fp16_values, bool):
            raise TypeError(f"fp16_values must be True or False, not {fp16_values!r}")
        correction = HookCorrection.checked(momentum, nesterov, betas, eps)
        config = make_config(dict(options, density=density))
        refuse_unsupported(config, Frontend.DDP_HOOK)
        self._begin(config, process_group, correction, fp16_values)
        self.scaling: LossScaling | None = None if grad_scaler is None else LossScaling(grad_scaler)

    def _begin(
        self, config: SparseConfig, group: Any, correction: HookCorrection, fp16_values: bool
    ) -> None:
        self.config = config
        self.process_group = group
        # SGD's momentum or Adam's moments per bucket index (WHOLE: the first iteration's).
        self.correction = correction
        self.fp16_values = fp16_values
        self.scaling = None  # a GradScaler's (ddp_scaling); not pickled
        self.iteration = 0
        self.reducers: dict[int, BucketReducer] = {}
        self._saved: dict[int, dict[str, Any]] = {}  # loaded, for buckets not yet reduced
        # Each bucket's parameters, as positions that survive a checkpoint.
        self.layout = BucketLayout()
        self._last: dict[int, StepStats | None] = {}  # per bucket: dense figures, or None
        # A sparse bucket's parameters under min_sparse_numel, averaged densely.
        self.small = SmallParameters(BACKEND, config.min_sparse_numel)
        self._engines: dict[int, Engine] = {}  # one engine of one bucket per DDP bucket
        self._saver: dict[str, Any] | None = None  # who saved the loaded state
        self._share: float | None = None  # of the loaded residuals, once agreed
        self._flight = InFlight()  # exchanges in flight, in launch order
        # A sparse whole bucket's residual, until the rebuilt buckets have taken it.
        self._whole_residual: torch.Tensor | None = None
        # Who saved a checkpoint of this state: the residual policy (docs/design.md §6).
        self._owner_token = uuid.uuid4().hex
        self._lookahead: HookLookahead | None = None  # residual_lookahead(); not pickled

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
            if self._whole_residual is not None:
                reducer.residual = self.layout.cut(self._whole_residual, index)
            engine = self._engines[index] = Engine(BACKEND, [f"ddp.{index}"], [reducer])
            size = dist.get_world_size(self.process_group)
            engine.prescale, engine.postscale = optimizer_scales("average", size, 1.0)
            self.reducers[index] = reducer
        return engine

    def postscale(self, index: int) -> float:
        """The factor that turns DDP bucket ``index``'s sum into the average."""
        return self._engines[index].postscale

    def residual_lookahead(self, optimizer: torch.optim.Optimizer) -> HookLookahead:
        """Run each training forward and backward where the update pending in this
        rank's residuals takes the parameters, around ``optimizer``'s steps (an ``SGD``
        without momentum: ``ddp_lookahead``). Returns it (``detach()`` ends it); a
        later call replaces it (a new optimizer)."""
        if self._lookahead is not None:
            self._lookahead.detach()
        self._lookahead = HookLookahead(self, optimizer)
        return self._lookahead

    def stats(self) -> StepStats:
        """The last iteration's figures, summed over buckets (dense ones included);
        complete once the backward pass has returned (the last bucket's hook finished
        every bucket)."""
        total = StepStats()
        for index, dense in self._last.items():
            if dense is not None:
                total += dense
            else:
                record = self.reducers[index].last_stats()
                total += record
                total += self.small.figures(index, record)
        return total

    @property
    def momentum(self) -> float:
        return self.correction.momentum

    @property
    def velocity(self) -> dict[int, torch.Tensor]:
        """SGD momentum correction's velocity per bucket index (-1: the whole first
        bucket's), this rank's."""
        return {key: kept[0] for key, kept in self.correction.kept.items() if self.momentum}

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
        layout = self.layout
        if not layout.started:
            # A DDP instance's first call. DDP puts its first iteration in one bucket of
            # every parameter and rebuilds the buckets after it, unless
            # find_unused_parameters=True (without static_graph): then its buckets are
            # fixed from the first iteration on, and each is sparse from the start.
            layout.start(fixed=not (bucket.index() == 0 and bucket.is_last()))
            if not layout.fixed and not layout.buckets:
                # A dense average: the first iteration of a run, or of a state saved
                # before any sparse step (no residual exists yet).
                layout.positions(parameters)
                after = self._scaled(WHOLE, buffer, None)
                self._correct(WHOLE, buffer)
                return self._flight.track(self._dense(bucket.index(), buffer, after))
        index = bucket.index()
        positions = layout.positions(parameters)
        if layout.whole_over_rebuilt(index, positions):
            # One bucket of every parameter where buckets were rebuilt (a resumed run's
            # first iteration; static_graph=True's second): cut into those buckets.
            return self._replay(buffer)
        if index == 0 and 0 in self.reducers and layout.rebuilt_from_whole(positions):
            self._spread_whole()
        if positions != layout.buckets.get(index, positions) and (
            index in self.reducers or self.correction.holds(index) or index in self._saved
        ):
            raise RuntimeError(
                f"DDP bucket {index} now holds other parameters than when the hook kept a "
                "residual or velocity for it; they cannot be carried over"
            )
        layout.buckets[index] = positions
        # The first rebuilt iteration: each bucket takes its parameters' part.
        self.correction.take_part(index, self.layout.cut)
        future = self._flight.track(self._sparse(index, buffer))
        if bucket.is_last():
            self.correction.drop_whole()  # every bucket has taken its part
            self._whole_residual = None
        return future

    def _spread_whole(self) -> None:
        """DDP rebuilt its buckets after an iteration whose one whole bucket was sparse
        (``static_graph=True`` rebuilds after its second iteration): the whole bucket's
        residual and velocity are cut into the new buckets, as they arrive."""
        self._engines.pop(0)
        self._whole_residual = self.reducers.pop(0).residual
        self.correction.rename(0, WHOLE)
        self.layout.buckets = {}

    def _correct(self, key: int, buffer: torch.Tensor) -> None:
        """Replace the gradient in ``buffer`` by this rank's SGD momentum or Adam
        direction, when the state has one (``ddp_correction.HookCorrection``)."""
        ranks = dist.get_world_size(self.process_group)
        self.correction.correct(key, buffer, self.iteration + 1, ranks)

    def _scaled(self, key: int, buffer: torch.Tensor, reducer: Any) -> Any:
        """With a GradScaler: ``buffer`` unscaled, and the completion that rescales the
        result and undoes the step where the scaler will skip it (``ddp_scaling``)."""
        if self.scaling is None:
            return None
        return self.scaling.begin(buffer, self.correction.tensors(key, buffer), reducer)

    def _dense(self, index: int, buffer: torch.Tensor, after: Any = None) -> Pending:
        """The first iteration's, or a small bucket's, average: an allreduce in place."""
        size = dist.get_world_size(self.process_group)
        self._flight.advance()  # the earlier buckets' collectives first
        work = BACKEND.allreduce_sum_inplace_async(
            buffer.div_(size), f"hvds.ddp.{index}.dense", self.process_group
        )
        itemsize = buffer.element_size()
        self._last[index] = dense_allreduce_stats(buffer.numel(), size, itemsize, itemsize)
        pending = Pending(index, work=work, wait_work=BACKEND.wait, poll_work=BACKEND.poll)
        pending.after = after
        return self._flight.launched(pending)

    def _sparse(self, index: int, buffer: torch.Tensor) -> Pending:
        """A sparse bucket's step, of the kind its engine's plan gives, launched on the
        bucket buffer (which the result is written into)."""
        positions = self.small.positions(index, self.layout, buffer.device)
        # A bucket of small parameters only is averaged densely, as a small bucket is,
        # unless it already keeps a residual (a state saved under another setting).
        kept = index in self.reducers or index in self._saved
        small = buffer.numel() < self.config.min_sparse_numel or (
            positions.numel() == buffer.numel() and not kept
        )
        engine = None if small else self._engine(index, buffer)
        after = self._scaled(index, buffer, None if engine is None else engine.sparse[0])
        self._correct(index, buffer)
        whole = self._whole_residual
        if engine is None:
            if whole is not None:
                buffer.add_(self.layout.cut(whole, index))  # its part goes now, densely
            return self._dense(index, buffer, after)
        self._last[index] = None
        # Momentum factor masking: the entries sent leave the velocity too.
        velocity = self.correction.masked(index)
        engine.mask_with(0, velocity)
        # Small parameters are averaged on their own (ddp_small): the exchange sees zeros.
        values = self.small.take(buffer, positions) if positions.numel() else None
        engine.begin_step()
        engine.open_step()
        if not engine.gradients_in_buffer(0):
            engine.accumulate(0, buffer, 0)  # error feedback, into the residual
            if values is not None:
                self.small.take_residual(engine.sparse[0].residual, positions, values)
        # Their velocity is not sent by the exchange: kept from its masking.
        kept_velocity = None if values is None or velocity is None else velocity[positions]
        self._flight.advance()  # the earlier buckets' collectives first
        handle = engine.launch(0, buffer)
        assert handle is not None, "one bucket: never a fused run"
        pending = Pending(index, handle=handle, after=after)
        if values is None:
            self.small.forget(index)
            return self._flight.launched(pending)
        if velocity is not None and kept_velocity is not None:
            velocity.index_copy_(0, positions, kept_velocity)
        pending.slots = self.small.launch(index, positions, values, self.process_group)
        return self._flight.launched(pending)

    def _replay(self, buffer: torch.Tensor) -> BucketFuture:
        """A resumed instance's first iteration: the whole bucket cut into the saved
        buckets, each reduced with its own residual, in the saved index order; each
        piece's result is copied back into ``buffer``, whose future the last completes."""
        cut = self.layout.cut
        pending = [self._sparse(index, cut(buffer, index)) for index in sorted(self.layout.buckets)]
        for piece in pending:
            piece.paste = buffer
            piece.pieces = self.layout.pieces_of(piece.index)
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
