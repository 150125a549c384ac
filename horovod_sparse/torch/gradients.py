"""Where each parameter's gradient goes before the exchange, and what comes back.

:class:`GradientRouting` counts ``backward_passes_per_step`` per parameter, hands the
engine each gradient when its last pass is in (copied into the bucket buffer, or added
to the residual: the engine says which), allgathers sparse gradients as Horovod does
(or reduces them densely with ``sparse_as_dense``), runs momentum correction's update
in front of the exchange, and turns a bucket's flat result back into gradients.

Sends: the two allgathers of each sparse gradient (:class:`SparseGradientGather`);
the buckets' exchanges are the engine's. Keeps: nothing between steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from horovod_sparse.common.buckets import Bucket
from horovod_sparse.common.engine import Engine
from horovod_sparse.torch.collectives import SparseGradientGather
from horovod_sparse.torch.momentum import Correction

__all__ = ["GradientRouting"]


class GradientRouting:
    """Per-parameter side of one optimizer's step.

    Args:
        engine: the step's engine (bucket buffers, kinds, launches).
        buckets: the planned buckets, in the engine's order.
        params: each bucket's parameters, in its entries' order.
        names: parameter -> name (collective names of sparse gradients).
        passes: ``backward_passes_per_step``.
        sparse_as_dense: reduce sparse gradients densely, then make them sparse again.
        process_set: the ranks taking part.
    """

    def __init__(
        self,
        engine: Engine,
        buckets: list[Bucket],
        params: list[list[torch.Tensor]],
        names: dict[torch.Tensor, str],
        passes: int,
        sparse_as_dense: bool,
        process_set: Any,
    ) -> None:
        self.engine = engine
        self.buckets = buckets
        self.params = params
        self.names = names
        self.passes = passes
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.correction: Correction | None = None
        self.place = {
            p: (index, entry.offset)
            for index, (bucket, members) in enumerate(zip(buckets, params))
            for entry, p in zip(bucket.entries, members)
        }
        self.passes_left = dict.fromkeys(self.place, passes)
        self.step_open = False  # a gradient of this step has arrived
        # Sparse gradients (torch.nn.Embedding(sparse=True)) of this step: allgathered
        # as Horovod does, or, with sparse_as_dense, reduced densely and made sparse again.
        self._gathers: dict[torch.Tensor, SparseGradientGather] = {}
        self._back_to_sparse: set[torch.Tensor] = set()

    def begin_step(self) -> None:
        self.step_open = False
        self.passes_left = dict.fromkeys(self.place, self.passes)
        self._back_to_sparse.clear()

    def set_passes(self, passes: int) -> None:
        """Change ``backward_passes_per_step``; counts restart for the current step."""
        self.passes = passes
        self.passes_left = dict.fromkeys(self.place, passes)

    def arrived(self, p: torch.Tensor) -> bool:
        """One backward pass of ``p`` is in; whether it was the step's last."""
        if self.passes_left[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "optimizer.step() or synchronize(). Increase backward_passes_per_step to "
                "accumulate gradients locally."
            )
        self.passes_left[p] -= 1
        return self.passes_left[p] == 0

    def submit_unused(self) -> None:
        """Parameters whose hook did not fire this step (unused) still take part."""
        for p, left in self.passes_left.items():
            if left > 0:
                self.submit(p)

    def submit(self, p: torch.Tensor) -> None:
        """Hand ``p``'s gradient to its bucket; the bucket's last launches its exchange."""
        self.passes_left[p] = 0
        grad = self._dense_grad(p)
        correction = self.correction
        if grad is not None and correction is not None and p in correction.covered:
            grad = correction.update(p, grad)
        index, offset = self.place[p]
        engine = self.engine
        if engine.gradients_in_buffer(index):
            piece = engine.buffers[index][offset : offset + p.numel()]
            if grad is None:
                piece.zero_()  # allgathered on its own: the bucket carries nothing for it
            else:
                piece.copy_(grad.reshape(-1))
        elif grad is not None:
            engine.accumulate(index, grad, offset)
        engine.arrived(index)

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the bucket reduces for ``p``; None when a sparse gradient is
        allgathered instead (the bucket then carries zeros for ``p``)."""
        grad = p.grad
        if grad is None:
            # A parameter unused on this rank still takes part, as zeros.
            p.grad = grad = torch.zeros_like(p)
        if not grad.is_sparse:
            return grad
        corrected = self.correction is not None and p in self.correction.covered
        if self.sparse_as_dense or corrected:
            # Reduced densely; made sparse again afterwards, as Horovod does, unless the
            # step applies a momentum-corrected direction, which is dense anyway.
            if not corrected:
                self._back_to_sparse.add(p)
            return grad.to_dense()
        name = f"hvds.opt.sparse.{self.names[p]}"
        scale = self.engine.prescale * self.engine.postscale
        self._gathers[p] = SparseGradientGather(grad, name, scale, self.process_set)
        return None

    def reduced(self, index: int, result: torch.Tensor) -> Iterator[tuple[torch.Tensor, Any]]:
        """``(p, its reduced gradient)`` for bucket ``index``'s flat ``result``: a view
        of ``result``, the allgathered sparse gradient, or the view made sparse again
        (``sparse_as_dense``)."""
        for entry, p in zip(self.buckets[index].entries, self.params[index]):
            value = result[entry.offset : entry.offset + entry.numel].view_as(p)
            gather = self._gathers.pop(p, None)
            if gather is not None:
                yield p, gather.wait()
            elif p in self._back_to_sparse:
                yield p, value.to_sparse()
            else:
                yield p, value

    def write(self, index: int, result: torch.Tensor) -> None:
        """Hand bucket ``index``'s result to its parameters as ``p.grad``: views of
        ``result`` (the bucket buffer, which the engine writes again only when the next
        step's exchange of this bucket finishes), not copies of it."""
        for p, reduced in self.reduced(index, result):
            grad = p.grad
            assert grad is not None, "submit gives every parameter a gradient"
            if reduced.is_sparse or grad.is_sparse:
                p.grad = reduced if reduced.is_sparse else reduced.clone()
            elif reduced.dtype == grad.dtype and reduced.device == grad.device:
                # A pass over the bucket saved: the demo's 1.18M-float bucket, 2 ranks
                # on 2 cores, 0.8-1.2 ms a step.
                p.grad = reduced
            else:
                grad.copy_(reduced)
