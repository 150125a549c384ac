"""The step half of the sparse optimizer: ``synchronize``, ``step`` and around them.

``synchronize()`` finishes every bucket's exchange and writes the result into ``p.grad``;
``step()`` synchronizes (unless inside ``skip_synchronize()``) and runs the wrapped
optimizer's step, with momentum correction where it is on. With ``overlap_allgather``,
``step()`` launches the all-gathers and leaves each bucket's update to the next forward
(:mod:`horovod_sparse.torch.overlap`); ``flush()`` applies what is still waiting. Outside
the process set, and when Horovod's ``broadcast_optimizer_state`` steps an empty state,
the wrapped optimizer takes a local step with no exchange.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from horovod_sparse.common.buckets import Bucket
from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.engine import Engine
from horovod_sparse.torch.collectives import called_by_horovod_state_broadcast
from horovod_sparse.torch.flush import engine_owed, flush_owed
from horovod_sparse.torch.lookahead import lookahead_supported

if TYPE_CHECKING:
    from horovod_sparse.torch.gradients import GradientRouting
    from horovod_sparse.torch.lookahead import ResidualLookahead
    from horovod_sparse.torch.momentum import Correction
    from horovod_sparse.torch.overlap import DeferredUpdates

    # What the mixins are combined with (combined_class): type checkers see the wrapped
    # optimizer's methods and attributes; at run time a mixin has no base of its own.
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object

__all__ = ["OptimizerStep"]


class OptimizerStep(_OptimizerBase):
    """``synchronize``/``step`` of
    :class:`~horovod_sparse.torch.optimizer.SparseOptimizerMixin`."""

    engine: Engine
    _member: bool
    _routing: GradientRouting
    _should_synchronize: bool
    _synchronized: bool
    _correction: Correction | None
    _deferred: DeferredUpdates | None
    _lookahead: ResidualLookahead | None
    _buckets: list[Bucket]
    _bucket_params: list[list[torch.Tensor]]
    sparse_config: SparseConfig
    process_set: Any

    if TYPE_CHECKING:  # the optimizer's own, which the step needs

        @property
        def overlapping(self) -> bool: ...

        def _follow_world_size(self) -> None: ...
        def _settle_loads(self) -> None: ...

    def _begin_step(self) -> None:
        self.engine.begin_step()
        self._routing.begin_step()

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
        for index, handle in self._launch_gathers():
            # The bucket buffer is free again: the result is written into it.
            self._routing.write(index, self.engine.finish(index, handle))
        self.engine.record_step()
        self._begin_step()
        self._synchronized = True

    def _launch_gathers(self) -> list[tuple[int, Any]]:
        """Finish every reduce-scatter and launch every all-gather (waits for none)."""
        if not self._routing.step_open:
            self._follow_world_size()
            self._settle_loads()
            self.engine.open_step()
        self._routing.submit_unused()
        # With the all-gathers deferred to the next forward, launch them in forward order.
        return self.engine.launch_gathers(forward_order=self._deferred is not None)

    def flush(self) -> None:
        """Apply every update still waiting for its all-gather (``overlap_allgather``).

        Call it after the last ``step()`` when no forward pass follows; the optimizer's
        and the model's ``state_dict()`` call it too. A no-op without overlap.
        """
        if self._deferred is not None:
            self._deferred.apply_all()

    def flush_residuals(self) -> int:
        """Apply every rank's pending update to the parameters and clear the residuals.

        With error feedback the parameters lack what the ranks have not sent yet (about
        the last 1/density steps of update). This sums the residuals with one dense
        allreduce and moves each parameter by the update they stand for
        (:mod:`horovod_sparse.torch.flush`). Call it on every rank where training ends,
        before the model is evaluated or saved for keeps; training may go on after it.
        Returns the number of values summed (0 without error feedback: nothing waits).

        Raises:
            ValueError: on every rank, before any collective, where the step is not
                linear in the exchanged tensor (Adam or SGD with momentum without
                momentum correction): the residual's update is then unknown.
            RuntimeError: between a backward pass and its ``step()``.
        """
        if not self._member or not self.sparse_config.error_feedback:
            return 0
        problem = lookahead_supported(self, self._correction is not None, "flush_residuals()")
        if problem is not None:
            raise ValueError(problem)
        if self.engine.busy:
            raise RuntimeError(
                "flush_residuals() was called between a backward pass and its step()"
            )
        self.flush()  # overlap_allgather's waiting updates belong to the shared parameters
        if self._lookahead is not None:
            self._lookahead.remove()  # the flush moves the shared parameters
        lr = {p: group["lr"] for group in self.param_groups for p in group["params"]}
        owed = engine_owed(self.engine, self._buckets, self._bucket_params)
        return flush_owed(owed, lambda p: float(lr[p]), self.engine.ops, self.process_set)

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
        if called_by_horovod_state_broadcast():
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
        lookahead = self._lookahead
        if lookahead is None:
            return self._wrapped_step(closure)
        # The exchanged update applies to the shared parameters; the next training
        # forward looks ahead anew.
        lookahead.remove()
        try:
            return self._wrapped_step(closure)
        finally:
            lookahead.take_at_next_forward()

    @contextlib.contextmanager
    def shared_parameters(self) -> Iterator[None]:
        """The parameters as every rank holds them, inside the block.

        With ``residual_lookahead`` (on by default where it applies) each rank holds,
        from its training forward to its ``step()``, the shared parameters moved by the
        pending update as its residual estimates it. Inside this block they are the
        shared ones (identical on every rank), as they are anyway between a ``step()``
        and the next training forward; the lookahead returns after it. Without the
        lookahead this does nothing.
        """
        if self._lookahead is None:
            yield
            return
        with self._lookahead.removed():
            yield

    def _step_deferred(self, closure: Any) -> Any:
        """``step()`` with overlap_allgather: launch the all-gathers and return; each
        bucket's update is applied before its parameters are next used (torch/overlap.py)."""
        deferred = self._deferred
        assert deferred is not None, "called only with overlap_allgather"
        if not self._should_synchronize:
            raise RuntimeError("skip_synchronize() is not available with overlap_allgather=True")
        if closure is not None:
            raise ValueError("step(closure) is not supported with overlap_allgather=True")
        deferred.apply_all()  # a step() with no forward since the last one
        deferred.defer(self._launch_gathers())
        if not self.overlapping:
            # overlap_allgather="auto" judged overlap slower: wait for the all-gathers
            # now, with the same per-bucket updates (the same trajectory).
            deferred.apply_all()
        self._begin_step()
        return None

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
        if self.engine.busy:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return super().zero_grad(set_to_none=set_to_none)
