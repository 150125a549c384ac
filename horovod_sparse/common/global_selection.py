"""Global selection at the owners: keep the global top-k of the reduced values.

The owners hold disjoint regions, so the global top-k is "every reduced entry whose
magnitude is at least the k-th largest magnitude over all owners". That threshold is
found exactly by a radix select over the int32 bit pattern of the fp32 magnitude
(monotone for non-negative floats): four passes of one 8-bit digit each, every pass
one allreduce of a 256-bin histogram.

Sends: 4 allreduces of 256 int32 (1 KiB each), whatever k and n are.
Keeps: nothing; the caller routes the entries below the threshold to the owner's residual.

Ties at the threshold are all kept, so the count is k, or more only when magnitudes tie
exactly (zeros in a very sparse bucket, for instance). When fewer than k entries exist
over all owners, all are kept.
"""

from __future__ import annotations

from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.stats import allreduce_ring_bytes

__all__ = ["RADIX_BITS", "RADIX_SHIFTS", "global_threshold_key", "histogram_bytes"]

RADIX_BITS = 8
RADIX_SHIFTS = (24, 16, 8, 0)  # most significant digit first
HISTOGRAM_BINS = 1 << RADIX_BITS


def global_threshold_key(ops: Backend, keys: Tensor, k: Any, name: str, process_set: Any) -> Tensor:
    """Key (fp32 magnitude bits) of the k-th largest magnitude over all owners.

    Args:
        ops: framework primitives.
        keys: this owner's ``ops.magnitude_keys(reduced_values)``.
        k: global budget: a host int, or a graph scalar (a decaying density under TF).
        name: collective-name stem, identical on every rank.
        process_set: the ranks taking part.

    Returns:
        A device scalar; ``keys >= it`` selects this owner's share of the global top-k.
    """
    prefix, remaining = ops.radix_start(keys, k)
    for shift in RADIX_SHIFTS:
        # Step 1: count, per value of this digit, the candidates still in the running.
        local = ops.digit_histogram(keys, prefix, shift)
        # Step 2: the same counts over all owners.
        total = ops.wait(ops.allreduce_sum_async(local, f"{name}.radix{shift}", process_set))
        # Step 3: fix this digit of the threshold; go on inside that bin.
        prefix, remaining = ops.choose_digit(total, remaining, prefix, shift)
    return prefix


def histogram_bytes(world_size: int) -> tuple[int, int]:
    """``(sent, received)`` payload bytes of the radix passes, ring-allreduce basis."""
    sent, received = allreduce_ring_bytes(HISTOGRAM_BINS, world_size, 4)
    return sent * len(RADIX_SHIFTS), received * len(RADIX_SHIFTS)
