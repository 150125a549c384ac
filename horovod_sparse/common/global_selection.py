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

import functools
from collections.abc import Callable, Sequence
from typing import Any

from horovod_sparse.common.backend import Backend, Cell, Tensor
from horovod_sparse.common.stats import allreduce_ring_bytes

__all__ = [
    "RADIX_BITS",
    "RADIX_SHIFTS",
    "ReusedGlobalThreshold",
    "global_threshold_key",
    "grouped_threshold_keys",
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
    return grouped_threshold_keys(ops, [keys], [k], name, process_set)[0]


def grouped_threshold_keys(
    ops: Backend, keys: Sequence[Tensor], ks: Sequence[Any], name: str, process_set: Any
) -> list[Tensor]:
    """:func:`global_threshold_key` of several buckets at once (the buckets of one step
    whose thresholds refresh together): each radix pass allreduces all their
    histograms as one tensor, so m buckets cost 4 dependent allreduces, not 4m.

    Sends: 4 allreduces of 256 m int32 (1 KiB per bucket each).
    """
    started = [ops.radix_start(bucket_keys, k) for bucket_keys, k in zip(keys, ks)]
    prefixes = [prefix for prefix, _ in started]
    remaining = [left for _, left in started]
    for shift in RADIX_SHIFTS:
        # Step 1: count, per value of this digit, the candidates still in the running.
        local = [ops.digit_histogram(k_, p, shift) for k_, p in zip(keys, prefixes)]
        # Step 2: the same counts over all owners, every bucket's in one allreduce.
        joined = local[0] if len(local) == 1 else ops.concat(local)
        total = ops.wait(ops.allreduce_sum_async(joined, f"{name}.radix{shift}", process_set))
        totals = [total] if len(local) == 1 else ops.chunks(total, len(local))
        # Step 3: fix this digit of each threshold; go on inside that bin.
        for i, counts in enumerate(totals):
            prefixes[i], remaining[i] = ops.choose_digit(counts, remaining[i], prefixes[i], shift)
    return prefixes


def histogram_bytes(world_size: int) -> tuple[int, int]:
    """``(sent, received)`` payload bytes of the radix passes, ring-allreduce basis."""
    sent, received = allreduce_ring_bytes(HISTOGRAM_BINS, world_size, 4)
    return sent * len(RADIX_SHIFTS), received * len(RADIX_SHIFTS)


# The reused key's drift takes in a quarter of the mean of each two misses and stays at
# or below 0 (``ReusedGlobalThreshold.observe``); sums of keys are clamped to the int32
# range, so nothing wraps.
DRIFT_GAIN = 4
KEY_LIMIT = 2**31 - 1


class ReusedGlobalThreshold:
    """The global threshold without a collective on most steps (``global_selection="reuse"``).

    After the all-gather every rank holds the same gathered rows, so each derives the
    next step's threshold from them alike (the same rows, the same arithmetic): the
    k-th largest gathered magnitude when at least k rows came back; otherwise (the
    threshold was too high) the gathered magnitudes' tail extended down to k rows
    (:meth:`Backend.extrapolate_key`, from their lowest and median keys); either
    lowered by the drift, what the reused key was too high by, learned over steps
    (:meth:`observe`). An exact
    radix select (:func:`global_threshold_key`) refreshes it at the first sparse step,
    every ``refresh_steps`` steps, at the step after the gathered count fell below
    ``band[0] * k`` (too few rows for their tail to say where k rows lie; at 0.5 k
    instead of 0.25 k, the char LM refreshed on 4-9 % of its steps after step 50
    rather than 3 %, for the same loss and bytes), on a step
    whose k differs from the last step's (a decaying density), and at the first step
    of a new reducer (another world size). A count at the cap (below) does not refresh:
    the k-th largest gathered magnitude is known then. (Refreshing there too, the demo's
    model refreshed on 24-35 % of its steps after step 50, alternating a refresh and a
    capped step while its gradients grew or shrank by more than a quarter a step; without
    it, 3 %: only the ``refresh_steps`` ones.)

    Owners keep what reaches the threshold, at most their share of ``band[1] * k`` rows
    each (:meth:`capped`): the share is the fraction of the last gathered rows that
    were theirs (smoothed by one row, so an owner that sent none may still send),
    counted over at least ``share_floor * k`` rows, so the rows of one step stay below
    ``band[1] * k + band[1] * k (P - 1) / (share_floor * k + 1) + P`` in total however
    stale the threshold is (about ``band[1] * k``; over the gathered count alone, a
    step that gathered few rows would give each owner a large share). What an owner
    does not keep goes to its residual as on any step.
    With the accumulator growing from step to step (the same gradient added every
    call), a cap of k per owner let a reused step send up to P * k rows.

    Sends: nothing on a reuse step; the radix select's 4 histogram allreduces on a
    refresh. Keeps, in backend cells (host values and device scalars under PyTorch,
    variables under TensorFlow, so a traced step updates them on every call): the
    threshold key, whether the next step refreshes, the steps since the last refresh,
    the k the key was derived for, this owner's row cap, the drift and the last miss.
    The decisions read only row counts, which the all-gather already brought to the
    host under PyTorch: no added device read.

    At P = 2 (``common/pair_stages.py``) each rank also applies the other owner's
    selection, so both owners' caps are kept too, by owner, derived alike on every rank
    from the gathered rows and shared as the key is (``pair_caps``).
    """

    def __init__(
        self,
        refresh_steps: int,
        band: tuple[float, float] = (0.25, 1.25),
        share_floor: float = 0.5,
    ) -> None:
        self.refresh_steps = refresh_steps
        self.band = band
        self.share_floor = share_floor
        # (key, due, age, k, cap, cap of owner 0, cap of owner 1, drift, last miss),
        # made at the first call, when the backend and a key are known.
        self._cells: tuple[Cell, ...] | None = None
        # Whether the current step refreshed: a host bool, or a graph bool under TF.
        self.refreshed: Any = True

    def bind(self, ops: Backend, keys: Tensor) -> None:
        """Make the cells if this is the first step (``keys``: a bucket's magnitude keys,
        for the key's type and device), so that :meth:`due_for` reads them: in a traced
        TF step, a graph value of the due flag rather than the first trace's True."""
        self._state(ops, keys)

    def cells(self) -> dict[str, Cell]:
        """The state's cells by name (none before :meth:`bind`), for a framework
        checkpoint that tracks variables."""
        if self._cells is None:
            return {}
        names = ("key", "due", "age", "k", "cap", "cap_owner0", "cap_owner1", "drift", "miss")
        return dict(zip(names, self._cells))

    def _state(self, ops: Backend, keys: Tensor) -> tuple[Cell, ...]:
        if self._cells is None:
            key, due = ops.cell(0, keys), ops.cell(True)
            drift, miss = ops.cell(0, keys), ops.cell(0, keys)
            self._cells = (key, due, *(ops.cell(0) for _ in range(5)), drift, miss)
        return self._cells

    @property
    def key(self) -> Tensor | None:
        """The threshold key the next step reuses (None before the first step)."""
        return None if self._cells is None else self._cells[0].get()

    @property
    def due(self) -> Any:
        """Whether the next sparse step refreshes exactly."""
        return True if self._cells is None else self._cells[1].get()

    @due.setter
    def due(self, value: bool) -> None:
        assert self._cells is not None, "set after the first step"
        self._cells[1].set(value)

    @property
    def row_cap(self) -> Any:
        """The most rows this owner keeps on the next reused step (0 before the first
        step)."""
        return 0 if self._cells is None else self._cells[4].get()

    def due_for(self, k: Any) -> Any:
        """Whether this step (budget ``k``) refreshes: when due, and when ``k`` is not the
        k the key was derived for (a decaying density). A host bool under PyTorch."""
        if self._cells is None:
            return True
        _, due, _, derived_for, *_ = self._cells
        return due.get() | (derived_for.get() != k)

    def threshold(self, ops: Backend, keys: Tensor, k: Any, exact: Callable[[], Tensor]) -> Tensor:
        """This step's threshold key: ``exact()`` (the radix select: this bucket's alone,
        or its share of one grouped with other buckets') when refreshing, else the
        reused key, raised where this owner would keep more than its cap (:meth:`capped`).
        A refresh is never capped: its count is k (more only on ties)."""
        key, _, age, _, cap, *_ = self._state(ops, keys)
        self.refreshed = self.due_for(k)
        chosen = ops.cond(
            self.refreshed, exact, lambda: self.capped(ops, keys, key.get(), cap.get())
        )
        # A refresh restarts the count of steps since the last one (0 * age: the
        # count's own type, a host int or an int64 variable).
        age.set(ops.select(self.refreshed, lambda: 0 * age.get(), age.get))
        return chosen

    def pair_thresholds(
        self, ops: Backend, keys: Sequence[Tensor], k: Any, exact: Callable[[], Tensor]
    ) -> list[Tensor]:
        """:meth:`threshold` of both owners at P = 2 on one rank: ``keys`` by owner, each
        capped by that owner's cap (``pair_caps``) on a reuse step; ``exact()`` once."""
        cells = self._state(ops, keys[0])
        key, age, caps = cells[0], cells[2], cells[5:7]
        self.refreshed = self.due_for(k)
        shared = ops.cond(self.refreshed, exact, key.get)

        # A refresh is never capped: each owner takes one decision, raise or keep.
        chosen = [
            self.capped(ops, owner_keys, shared, cap.get(), uncapped=self.refreshed)
            for owner_keys, cap in zip(keys, caps)
        ]
        age.set(ops.select(self.refreshed, lambda: 0 * age.get(), age.get))
        return chosen

    @staticmethod
    def capped(
        ops: Backend, keys: Tensor, threshold: Tensor, cap: Any, uncapped: Any = False
    ) -> Tensor:
        """``threshold`` raised, where needed, so that at most about ``cap`` of this
        owner's ``keys`` reach it (ties at the cut all pass); as it is where
        ``uncapped`` holds.

        The cap-th largest key changes which keys reach the threshold only when more
        than ``cap`` do, so those are counted first (where the backend counts without a
        host wait). In a 16M i.i.d. call at P = 2 an owner's keys, both ranks' selections
        in its region, are about 1.6 caps, of which about 0.8 caps reach a reused
        threshold; finding that key among 170K took 1.4 ms (one CPU thread), counting
        them 0.1."""
        over = ops.select(
            uncapped, lambda: False, lambda: ops.count_reaching(keys, threshold) > cap
        )
        return ops.cond(
            over, lambda: ops.larger_key(threshold, ops.kth_largest(keys, cap)), lambda: threshold
        )

    def observe(
        self, ops: Backend, gathered: Tensor, k: Any, own_rows: Any, rank: int | None = None
    ) -> None:
        """After the all-gather: the next threshold, whether the next step refreshes and
        this owner's next row cap, from this step's gathered values (identical on every
        rank) and ``own_rows``, how many of them this owner sent. ``rank``: this owner's
        rank at P = 2, where both owners' caps (``pair_caps``) are derived too. One
        :meth:`Backend.update_cells`: under TF with the NumPy kernels one host call, not
        about 60 scalar kernels and 20 variable reads and writes."""
        assert self._cells is not None, "observe follows threshold()"
        key, due, age, derived_for, cap, *pair_caps, drift, miss = self._cells
        written = [due, derived_for, cap, *(pair_caps if rank is not None else [])]
        inputs = [gathered, k, own_rows, self.refreshed]
        update = functools.partial(self._derive, rank=rank)
        ops.update_cells(update, [key, age, drift, miss], inputs, unread=written)

    def _derive(
        self, ops: Backend, cells: Sequence[Cell], inputs: Sequence[Any], rank: int | None
    ) -> None:
        """:meth:`observe`'s update of ``cells`` (those it reads, then those it only
        sets) from the gathered values, k, own rows and whether this step refreshed."""
        gathered, k, own_rows, refreshed = inputs
        key, age, drift, last_miss, due, derived_for, cap, *pair_caps = cells
        derived_for.set(k)
        count = ops.num_rows(gathered)
        # ceil(band[1] * k * (own_rows + 1) / (shared + 1)) in integers (host ints, or
        # int64 graph scalars alike): at least 1, and about band[1] * k over all owners.
        # ``shared``: the gathered count, at least share_floor * k (0 * count + floor:
        # the count's own type, so both branches of a graph cond agree).
        floor = ops.scaled_count(k, self.share_floor, rounding="ceil")
        shared = ops.select(count < floor, lambda: 0 * count + floor, lambda: count)
        margin_num, margin_den = self.band[1].as_integer_ratio()
        share_den = margin_den * (shared + 1)

        def cap_of(rows: Any) -> Any:
            return (margin_num * k * (rows + 1) + share_den - 1) // share_den

        cap.set(cap_of(own_rows))
        if rank is not None:
            rows = [own_rows, count - own_rows]  # this owner's, the other's
            pair_caps[rank].set(cap_of(rows[0]))
            pair_caps[1 - rank].set(cap_of(rows[1]))
        steps = age.get() + 1
        age.set(steps)

        def from_count() -> Tensor:
            # Fewer rows than k: the threshold was too high. Every rank holds the
            # gathered magnitudes above it, so it extends their tail down to k rows.
            # (Scaling the magnitude by count / k, as if the count were proportional
            # to it, overshot: in a 4M i.i.d. run a count of 0.996 k became 1.09 k,
            # then 0.98 k and 1.25 k, the cap, and a refresh.)
            def extrapolated() -> Tensor:
                keys = ops.magnitude_keys(gathered)
                lowest = ops.kth_largest(keys, count)
                middle = ops.kth_largest(keys, count // 2)
                return ops.extrapolate_key(lowest, middle, count, k)

            return ops.cond(count > 1, extrapolated, key.get)

        # Where k rows lay this step, as far as the gathered rows tell.
        this_step = ops.cond(
            count >= k, lambda: ops.kth_largest(ops.magnitude_keys(gathered), k), from_count
        )
        # The next step's key is not this step's: sending the top rows empties the
        # residual where the accumulator was largest, and a converging model's
        # gradients shrink step after step. So the key is lowered by how far the
        # reused key was too high (the drift: a quarter of the mean of each two misses
        # added in, in key units, about 2^23 per halving of the magnitude). The drift
        # never raises the key: a count at or above k shows only that the k-th row lay
        # above the key (every gathered row reached it), so a miss that way is a
        # bound, not a measure; it takes the drift back towards 0, and the cap bounds
        # such steps. The demo's model at 300 steps (P = 2), after step 50: without the
        # drift, 51 of 250 steps kept under 0.5k rows and 11 % refreshed (a refresh and
        # a step of 0.1k rows in turn, once its loss fell below 0.01); with it, none
        # and 3 % (the periodic ones), 78 % of the steps within 10 % of k against 36 %.
        # A refresh's key is exact: no miss to learn from.
        miss = this_step - key.get()

        def drifted() -> Tensor:
            # The mean of this miss and the last: a count that swings above and below
            # k from step to step (i.i.d. gradients at P = 3: 0.90k and 1.14k in turn)
            # misses both ways, and a drift that took each miss in would swing with
            # it (0.88k and 1.18k); the mean of two takes in only what persists.
            paired = (miss // 2 + last_miss.get() // 2) // DRIFT_GAIN
            return ops.shifted_key(drift.get(), paired, -KEY_LIMIT, 0)

        drift.set(ops.select(refreshed, drift.get, drifted))
        last_miss.set(ops.select(refreshed, last_miss.get, lambda: miss))
        key.set(ops.shifted_key(this_step, drift.get(), 0, KEY_LIMIT))
        low = ops.scaled_count(k, self.band[0], rounding="ceil")
        # Fewer than 2 rows have no tail to extend: the key stayed, so refresh.
        due.set((steps >= self.refresh_steps) | (count < low) | (count < 2))

    def restart(self) -> None:
        """Refresh at the next sparse step (a new world size)."""
        if self._cells is not None:
            self._cells[1].set(True)

    def state_dict(self, ops: Backend) -> dict[str, Any]:
        """What a checkpoint needs to continue with the same thresholds (host numbers:
        the key is read from the device, once per checkpoint)."""
        if self._cells is None:
            empty = {"key": None, "due": True, "age": 0, "k": 0, "cap": 0, "pair_caps": [0, 0]}
            return {**empty, "drift": 0, "miss": 0}
        key, due, age, k, cap, *pair_caps, drift, miss = (cell.get() for cell in self._cells)
        host_key = int(ops.to_host_number(key))
        return {
            "key": host_key,
            "due": bool(due),
            "age": int(age),
            "k": int(k),
            "cap": int(cap),
            "pair_caps": [int(c) for c in pair_caps],
            "drift": int(ops.to_host_number(drift)),
            "miss": int(ops.to_host_number(miss)),
        }

    def load_state_dict(self, ops: Backend, state: dict[str, Any], like: Tensor) -> None:
        """Restore :meth:`state_dict`; ``like``: an int32 tensor on the keys' device."""
        if state["key"] is None:
            self.restart()
            return
        # No drift saved (a checkpoint from before it): 0, the key as it was derived.
        key, drift, miss = (
            ops.cell(int(state.get(name, 0)), like) for name in ("key", "drift", "miss")
        )
        if self._cells is None:
            self._cells = (key, ops.cell(True), *(ops.cell(0) for _ in range(5)), drift, miss)
        else:
            for cell, saved in zip((self._cells[0], *self._cells[7:]), (key, drift, miss)):
                cell.set(saved.get())
        self._cells[1].set(bool(state["due"]))
        self._cells[2].set(int(state["age"]))
        self._cells[3].set(int(state.get("k", 0)))  # none saved: refresh
        # No cap of this owner's own (a checkpoint from before the share cap, or a rank
        # adopting another's state before its first step): k rows, as it then was.
        self._cells[4].set(int(state.get("cap") or state.get("k", 0)))
        # Both owners' caps at P = 2, shared like the key; none saved (a checkpoint from
        # before them): k rows each.
        k_rows = int(state.get("k", 0))
        for cell, saved in zip(self._cells[5:7], state.get("pair_caps", [k_rows, k_rows])):
            cell.set(int(saved))
