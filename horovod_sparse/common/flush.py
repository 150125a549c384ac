"""Flushing the residuals: what every rank still owes the sum, summed now.

With error feedback a sparse step leaves each rank's unsent values in its residual, and
an owner keeps the sums it dropped: about the last 1/density steps of update, which the
shared parameters lack. A flush sums every rank's residuals and hands the sums to the
front-end, which moves each parameter by the update they stand for (``lr * postscale *
sum`` where the step is ``p -= lr * exchanged``) and clears the residuals: the
parameters then hold every gradient the ranks computed. The front-ends call it where
training ends (torch: ``torch/flush.py``; Keras: ``tensorflow/keras/flush.py``).

Sends: one ring allreduce of the residuals' values per dtype (what a dense step sends
for those buckets). Keeps: nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor

__all__ = ["sum_over_ranks"]


def sum_over_ranks(
    ops: Backend, tensors: Sequence[Tensor], process_set: Any, name: str
) -> list[Tensor]:
    """Each 1-D tensor summed over the ranks, with one allreduce per dtype of the tensors
    laid end to end.

    Every rank must pass tensors of the same lengths and dtypes in the same order (the
    buckets are the same on every rank); the allreduces are named ``{name}.{i}``, ``i``
    counting the dtypes in sorted order (a TF op name cannot hold a dtype's repr).
    """
    by_dtype: dict[str, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(str(tensor.dtype), []).append(index)
    sums: list[Tensor] = list(tensors)
    for number, dtype in enumerate(sorted(by_dtype)):  # the same order on every rank
        members = by_dtype[dtype]
        flat = ops.concat([tensors[i] for i in members])
        total = ops.wait(ops.allreduce_sum_async(flat, f"{name}.{number}", process_set))
        offset = 0
        for i in members:
            length = ops.length(tensors[i])
            sums[i] = total[offset : offset + length]
            offset += length
    return sums
