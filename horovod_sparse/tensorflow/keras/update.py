"""One update step's gradients through the Keras optimizer's exchange, under Horovod's
contract (:mod:`horovod_sparse.tensorflow.routing`): buckets for the shared variables,
allgathers for ``IndexedSlices``, nothing for local variables or outside the process
set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from horovod_sparse.tensorflow.reducer import GradientReducer
from horovod_sparse.tensorflow.routing import gather_slices, is_slices, scale_local

__all__ = ["exchange_update"]


def exchange_update(
    grads: dict[int, Any],
    variables: Sequence[Any],
    reducer: GradientReducer | None,
    local: set[int],
    options: dict[str, Any],
    scale_local_gradients: bool,
    name: str,
) -> tuple[dict[int, Any], set[int]]:
    """The exchanged gradients by variable index, and the indices Adam's or SGD's
    correction steps (by ``-lr`` times the result).

    Args:
        grads: gradient by index into ``variables`` (the optimizer's build order); a
            variable without a gradient is absent.
        variables: every trainable variable, in build order.
        reducer: the buckets of the variables not in ``local`` (None when there are
            none, or outside the process set).
        local: indices of the local variables.
        options: Horovod's arguments (``horovod_arguments``).
        scale_local_gradients: divide local gradients by the process set's size.
        name: prefix of the IndexedSlices allgathers' names.
    """
    process_set = options["process_set"]
    out = dict(grads)
    corrected: set[int] = set()
    shared = [i for i in range(len(variables)) if i not in local]
    if process_set.included():
        slices = [i for i in shared if is_slices(grads.get(i), options["sparse_as_dense"])]
        if reducer is not None:
            # An IndexedSlices variable's entry carries zeros: nothing is selected from
            # it, and no residual builds up there.
            inputs = [None if i in slices else grads.get(i) for i in shared]
            for i, g in zip(shared, reducer.reduce(inputs, [variables[i] for i in shared])):
                if i in grads:
                    out[i] = g
            corrected = {shared[p] for p in reducer.corrected_positions} - set(slices)
        for i in slices:
            out[i] = gather_slices(
                grads[i],
                options["op"],
                options["gradient_predivide_factor"],
                process_set,
                f"{name}.slices.{i}",
            )
    mine = [i for i in sorted(local) if i in grads]
    scaled = scale_local([grads[i] for i in mine], process_set.size(), scale_local_gradients)
    out.update(zip(mine, scaled))
    return out, corrected
