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

__all__ = [
    "RADIX_BITS",
    "RADIX_SHIFTS",
    "ReusedGlobalThreshold",
    "global_threshold_key",
    "histogram_bytes",
]

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


class ReusedGlobalThreshold:
    """The global threshold without a collective on most steps (``global_selection="reuse"``).

    After the all-gather every rank holds the same gathered rows, so each derives the
    next step's threshold from them alike (the same rows, the same arithmetic): the
    k-th largest gathered magnitude when at least k rows came back; otherwise the
    threshold used, scaled by count / k (fewer rows than k: it was too high). An exact
    radix select (:func:`global_threshold_key`) refreshes it at the first sparse step,
    every ``refresh_steps`` steps, and at the step after the gathered count left
    ``band`` (as multiples of k); a new reducer (another world size) or a restored one
    starts with a refresh. Owners keep what reaches the threshold, at most ``k`` rows
    each (:meth:`capped`), so a stale threshold cannot send the whole bucket; what they
    do not keep goes to their residual as on any step.

    Sends: nothing on a reuse step; the radix select's 4 histogram allreduces on a
    refresh. Keeps: the threshold key (a device scalar), the steps since the last
    refresh and whether the next step refreshes (host values: the decisions are made
    from the host-known gathered count, so they add no device read).
    """

    def __init__(self, refresh_steps: int, band: tuple[float, float] = (0.8, 1.25)) -> None:
        self.refresh_steps = refresh_steps
        self.band = band
        self.key: Tensor | None = None  # the threshold key the next step reuses
        self.due = True  # whether the next sparse step refreshes exactly
        self.age = 0  # sparse steps since the last refresh
        self.refreshed = False  # whether the current step refreshed

    def threshold(self, ops: Backend, keys: Tensor, k: int, name: str, process_set: Any) -> Tensor:
        """This step's threshold key: an exact refresh when due, else the reused one."""
        self.refreshed = self.due or self.key is None
        if self.refreshed:
            self.key = global_threshold_key(ops, keys, k, name, process_set)
            self.age = 0
        assert self.key is not None
        return self.key

    @staticmethod
    def capped(ops: Backend, keys: Tensor, threshold: Tensor, cap: int) -> Tensor:
        """``threshold`` raised, where needed, so that at most about ``cap`` of this
        owner's ``keys`` reach it (ties at the cut all pass)."""
        if ops.num_rows(keys) <= cap:
            return threshold
        return ops.larger_key(threshold, ops.kth_largest(keys, cap))

    def observe(self, ops: Backend, gathered: Tensor, k: int) -> None:
        """After the all-gather: the next threshold and whether the next step refreshes,
        from this step's gathered values (identical on every rank)."""
        assert self.key is not None, "observe follows threshold()"
        count = ops.num_rows(gathered)
        self.age += 1
        if count >= k:
            self.key = ops.kth_largest(ops.magnitude_keys(gathered), k)
        elif count > 0:
            self.key = ops.scale_key(self.key, count / k)
        low, high = self.band[0] * k, self.band[1] * k
        self.due = self.age >= self.refresh_steps or not low <= count <= high

    def restart(self) -> None:
        """Refresh at the next sparse step (a restore, a new world size)."""
        self.due = True
