"""All-gather overlapped with the next forward pass (DeAR's second half).

With ``overlap_allgather=True`` the optimizer's ``step()`` does not wait for the
all-gathers: it finishes every bucket's reduce-scatter, launches every all-gather and
returns. Each bucket's update is applied later, just before its parameters are used:

* a forward pre-hook on every module that directly owns parameters waits for the
  all-gather of each bucket holding one of them, then steps the wrapped optimizer over
  that bucket's parameters only, with the hyperparameters the groups had when
  ``step()`` was called (a learning-rate scheduler may have changed them since);
* whatever is still pending is applied by :meth:`DeferredUpdates.apply_all`, which the
  optimizer calls at the first gradient of the next backward pass, from
  ``optimizer.state_dict()``, ``model.state_dict()`` and ``optimizer.flush()``, so no
  update is lost at the end of training and checkpoints hold every step.

With ``overlap_allgather="auto"`` the optimizer's scheduler may switch the overlap
off for a while; ``step()`` then applies every pending update at once, through the
same per-bucket path, so the trajectory is the same either way.

Stepping a subset of parameters relies on the wrapped optimizer treating parameters
independently (per-parameter state, as SGD, Adam, AdamW, RMSprop, Adagrad do).
Sends nothing itself: it only waits for the all-gathers the reducers launched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from horovod_sparse.common.engine import Engine
from horovod_sparse.common.handle import BucketHandle
from horovod_sparse.torch.gradients import GradientRouting

__all__ = ["DeferredUpdates"]


class DeferredUpdates:
    """Pending bucket updates of one optimizer, applied when their parameters are used.

    Args:
        optimizer: the sparse optimizer (its ``param_groups`` are narrowed per bucket).
        model: the module whose forward uses the optimizer's parameters.
        engine: the step's engine, whose handles are deferred here.
        routing: turns a bucket's result into its parameters' gradients.
        step: the wrapped optimizer's own step (momentum correction included).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        engine: Engine,
        routing: GradientRouting,
        step: Callable[[], Any],
    ) -> None:
        self.optimizer = optimizer
        self.engine = engine
        self.routing = routing
        self.step = step
        # bucket index -> its all-gather in flight, in launch order.
        self.pending: dict[int, BucketHandle] = {}
        self.hyperparameters: list[dict[str, Any]] = []
        self._handles = []
        covered: set[int] = set()
        for module in model.modules():
            buckets = sorted(
                {
                    routing.place[p][0]
                    for p in module.parameters(recurse=False)
                    if p in routing.place
                }
            )
            if buckets:
                covered.update(buckets)
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(buckets)))
        missing = set(range(len(routing.buckets))) - covered
        if missing:
            raise ValueError(
                f"{len(missing)} bucket(s) hold parameters that are not in the model passed "
                "as model=; pass the module whose parameters the optimizer updates"
            )
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self.apply_all()))

    def _pre_hook(self, buckets: list[int]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for index in buckets:
                if index in self.pending:
                    self._apply(index)

        return hook

    # ------------------------------------------------------------------ queue
    def defer(self, launched: list[tuple[int, BucketHandle]]) -> None:
        """Queue one step's all-gathers; remember the groups' hyperparameters now."""
        self.hyperparameters = [
            {key: value for key, value in group.items() if key != "params"}
            for group in self.optimizer.param_groups
        ]
        self.pending = dict(launched)

    def apply_all(self, late: bool = False) -> None:
        """Apply every pending update, in launch order.

        ``late`` marks a call from the next backward pass: a bucket still pending
        then had its parameters used in forward before the update (a parameter
        used outside the modules that own it), so the result differs from
        ``overlap_allgather=False``; say so once.
        """
        if late and self.pending:
            warnings.warn(
                f"{len(self.pending)} bucket update(s) were still pending when backward "
                "began: their parameters were used in forward without a pre-hook of a "
                "module that owns them, so forward saw the previous values",
                stacklevel=3,
            )
        for index in list(self.pending):
            self._apply(index)

    def discard(self) -> None:
        """Wait for pending all-gathers and drop their updates (a checkpoint is
        being loaded, which replaces the state they would have changed)."""
        for handle in self.pending.values():
            handle.wait()
        self.pending = {}

    def _apply(self, index: int) -> None:
        """Wait for bucket ``index``'s all-gather and step the wrapped optimizer over its
        parameters. ``p.grad`` holds the averaged gradient (a view of the bucket) during
        the step only; afterwards it is what it was (None after ``zero_grad()``), so the
        next backward accumulates into a clean gradient."""
        result = self.engine.finish(index, self.pending.pop(index))
        params = self.routing.params[index]
        saved = [p.grad for p in params]
        for p, reduced in self.routing.reduced(index, result):
            p.grad = reduced
        try:
            with self.only(params):
                self.step()
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad
        if not self.pending:
            self.engine.record_step()

    # ------------------------------------------------------------------ stepping
    @contextmanager
    def only(self, params: list[torch.Tensor]) -> Iterator[None]:
        """The optimizer's groups restricted to ``params``, with the hyperparameters of
        the deferred step; everything restored afterwards."""
        members = {id(p) for p in params}
        groups = self.optimizer.param_groups
        saved = [dict(group) for group in groups]
        for group, then in zip(groups, self.hyperparameters):
            group.update(then)
            group["params"] = [p for p in group["params"] if id(p) in members]
        try:
            yield
        finally:
            for group, before in zip(groups, saved):
                group.clear()
                group.update(before)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
