"""What the automatic scheduler knows of one bucket, and the record of one trial.

A :class:`BucketChoice` gathers a bucket's measured exchange seconds each way over a
window, holds the model's predictions, and proposes a mode by the rules written in
:mod:`horovod_sparse.common.scheduler`, which decides with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["TRIAL_FACTOR", "BucketChoice", "TrialOutcome"]

# A mode never measured is tried for a window unless the model predicts it at more than
# this many times the measured cost of the current mode: the model's error against
# measured steps on emulated 1 and 10 Gbit/s links reached 149% (benchmarks/scaling.py).
TRIAL_FACTOR = 2.5


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


@dataclass(frozen=True)
class TrialOutcome:
    """One trial: the modes before and tried (True: dense, per bucket), the median step
    seconds of each, and whether the tried modes were kept. ``overlap_before`` and
    ``overlap_tried``: the all-gather overlap before and during the trial, where the
    scheduler owns it (else None)."""

    before: tuple[bool, ...]
    tried: tuple[bool, ...]
    seconds_before: float
    seconds_tried: float
    kept: bool
    overlap_before: bool | None = None
    overlap_tried: bool | None = None
