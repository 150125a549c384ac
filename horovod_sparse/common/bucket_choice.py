"""What the automatic scheduler knows of one bucket, a trial in progress, and its record.

A :class:`BucketChoice` gathers a bucket's measured exchange seconds each way over a
window, holds the model's predictions, and proposes a mode by the rules written in
:mod:`horovod_sparse.common.scheduler`, which decides with them. A :class:`Trial` holds
the blocks of a trial that runs the tried setting and the one before it in turn, and
judges them; a :class:`TrialOutcome` is what is kept of it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = [
    "TRIAL_BLOCK_STEPS",
    "TRIAL_FACTOR",
    "TRIAL_ROUNDS",
    "BucketChoice",
    "Trial",
    "TrialOutcome",
]

# A mode never measured is tried for a window unless the model predicts it at more than
# this many times the measured cost of the current mode: the model's error against
# measured steps on emulated 1 and 10 Gbit/s links reached 149% (benchmarks/scaling.py).
TRIAL_FACTOR = 2.5
# Steps each block of a trial runs. The first step after a switch carries its one-off
# costs (the fold of the residual into a dense step, a threshold refresh) and is not
# counted. Shorter blocks blur the modes: with the demo's exchange switched every 2 steps
# (2 ranks on 2 cores, benchmarks/trial_noise.py) sparse measured 1.00-1.07x dense over
# whole runs, every 5 steps 1.17-1.18x, and trials of 2-step blocks fell on the wrong
# side of 1 in a third of windows or more.
TRIAL_BLOCK_STEPS = 5
# Blocks of the tried setting in one trial, each followed by a block of the setting
# before. In the same runs trials of two 5-step blocks of each fell on the wrong side of
# 1 in 5-17 % of windows, of four in 0-11 %.
TRIAL_ROUNDS = 4

# A setting a trial compares: the mode of each sparse bucket (True: dense) and the
# all-gather overlap (None where the scheduler does not own it).
Setting = tuple[tuple[bool, ...], bool | None]


@dataclass
class _Window:
    """Sums of one measured quantity since the last decision."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def take(self) -> tuple[float, int]:
        out = (self.total, self.count)
        self.total, self.count = 0.0, 0
        return out


@dataclass
class BucketChoice:
    """The scheduler's view of one bucket: what it measured, predicted and chose.

    ``measured_*``: mean over ranks of the host seconds a step of this bucket spent in
    its exchange (selection, collectives launched and waited for), from the latest
    window in which the bucket ran that way; NaN until then.
    """

    numel: int
    itemsize: int
    dense: bool = False
    local_per_element: float = math.nan  # sparse local work; NaN until measured
    predicted_dense: float = math.nan
    predicted_sparse: float = math.nan
    measured_dense: float = math.nan
    measured_sparse: float = math.nan
    # The first step in a mode carries one-off costs (the first threshold estimate, the
    # fold of the residual at a switch to dense) and is not counted.
    _settling: bool = True
    _local: _Window = field(default_factory=_Window)
    _dense: _Window = field(default_factory=_Window)
    _sparse: _Window = field(default_factory=_Window)

    def observe(self, dense: bool, seconds: float, local_seconds: float = 0.0) -> None:
        """One step of this bucket: its exchange seconds, and for a sparse step the
        local work (no collective waits) in it."""
        if self._settling:
            self._settling = False
            return
        if dense:
            self._dense.add(seconds)
        else:
            self._sparse.add(seconds)
            self._local.add(local_seconds / self.numel)

    def take_windows(self) -> list[float]:
        """(sum, count) of local work, dense and sparse seconds; windows restart."""
        return [x for window in (self._local, self._dense, self._sparse) for x in window.take()]

    def switch(self, dense: bool) -> None:
        """Run this bucket dense or sparse from now on; a change of mode makes the next
        step a settling one."""
        self._settling = self._settling or self.dense != dense
        self.dense = dense

    def proposal(self, explore: bool = False) -> bool:
        """The mode this bucket's own costs suggest (True: dense). ``explore``: also
        the other mode where it was measured slower, but within ``TRIAL_FACTOR`` of
        this one (its exchange seconds may mislead: see :mod:`horovod_sparse.common.scheduler`)."""
        current = self.measured_dense if self.dense else self.measured_sparse
        other = self.measured_sparse if self.dense else self.measured_dense
        predicted_other = self.predicted_sparse if self.dense else self.predicted_dense
        if math.isnan(current):
            return self.dense  # nothing measured in this mode yet: keep it
        if math.isnan(other):
            # Try the other mode unless the model puts it far behind.
            if not math.isnan(predicted_other) and predicted_other <= TRIAL_FACTOR * current:
                return not self.dense
            return self.dense
        if other < current or (explore and other <= TRIAL_FACTOR * current):
            return not self.dense
        return self.dense


@dataclass
class Trial:
    """A trial in progress. ``blocks``: the median whole-step seconds (mean over ranks)
    of the window before the trial, under ``before``; once the trial's blocks have run,
    then each block's, in order: ``tried`` and ``before`` in turn, ``TRIAL_ROUNDS``
    blocks of each. ``steps``: this rank's counted step seconds in each block ended so
    far (the trial's blocks are shared over ranks at its end).

    Each tried block is compared with the mean of the before blocks either side of it,
    so that a machine whose speed drifts moves both sides of every ratio alike (5-step
    medians of the same modes measured 17.2-42.7 ms within one trial on the demo's
    model, 2 ranks on 2 cores)."""

    before: Setting
    tried: Setting
    blocks: list[float]
    steps: list[list[float]] = field(default_factory=list)

    def advance(self, ended: list[float]) -> Setting | None:
        """A block ended, with this rank's counted step seconds ``ended``: the setting
        the next block runs (tried first, then before, in turn); None once every block
        has run."""
        self.steps.append(ended)
        if len(self.steps) >= 2 * TRIAL_ROUNDS:
            return None
        return self.tried if len(self.steps) % 2 == 0 else self.before

    def ratio(self) -> float:
        """The median over tried blocks of the block's seconds over the mean of the
        before blocks either side (those measured); NaN if no block has both. The
        median, so that a step that stalled (where ranks share cores single steps take
        several times the usual) cannot decide a trial by itself."""
        logs = []
        for index in range(1, len(self.blocks), 2):
            sides = [s for s in self.blocks[index - 1 : index + 2 : 2] if not math.isnan(s)]
            tried = self.blocks[index]
            if sides and tried > 0 and not math.isnan(tried):
                logs.append(math.log(tried / statistics.mean(sides)))
        return math.exp(statistics.median(logs)) if logs else math.nan

    def outcome(self) -> TrialOutcome:
        """The record of this trial: kept where the tried blocks ran faster than the
        blocks around them (``ratio`` below 1), or where nothing could be compared."""
        ratio = self.ratio()
        tried = [s for s in self.blocks[1::2] if not math.isnan(s)]
        before = [s for s in self.blocks[0::2] if not math.isnan(s)]
        return TrialOutcome(
            self.before[0],
            self.tried[0],
            statistics.median(before) if before else math.nan,
            statistics.median(tried) if tried else math.nan,
            math.isnan(ratio) or ratio < 1.0,
            self.before[1],
            self.tried[1],
            ratio,
            tuple(self.blocks),
        )


@dataclass(frozen=True)
class TrialOutcome:
    """One trial: the modes before and tried (True: dense, per bucket), the median over
    each setting's blocks of their median step seconds, and whether the tried modes were
    kept. ``overlap_before`` and ``overlap_tried``: the all-gather overlap before and
    during the trial, where the scheduler owns it (else None). ``ratio``: what decided
    (:meth:`Trial.ratio`); ``blocks``: every block's median seconds, in order."""

    before: tuple[bool, ...]
    tried: tuple[bool, ...]
    seconds_before: float
    seconds_tried: float
    kept: bool
    overlap_before: bool | None = None
    overlap_tried: bool | None = None
    ratio: float = math.nan
    blocks: tuple[float, ...] = ()
