"""Automatic dense or sparse exchange per bucket, from an alpha-beta model of the link.

The model, its probes and its fit are :mod:`horovod_sparse.common.cost_model`.

Each decision weighs a bucket's cost both ways: the host seconds its steps actually
spent in the exchange when it last ran that way (measured, mean over ranks), else the
model's prediction. Measured times win because they include what the model leaves out
(contention for cores, waits behind other buckets, the copies around a collective).

A bucket starts sparse. At its first decision only the sparse side is measured, so
unless the model puts the dense side beyond ``TRIAL_FACTOR`` times the measured sparse
cost, the bucket is proposed dense. (The model alone chose wrongly both ways on
emulated links: its error against measured steps reached 149%.) Once both sides are
measured, the cheaper one is proposed. Where no bucket's cheaper side differs from its
current one, a decision explores: it proposes the other side of every bucket measured
slower, but within ``TRIAL_FACTOR`` of the current one, because per-bucket seconds
mislead where ranks share cores (on the demo's model sparse measured 3.4-7.5 ms a bucket
against dense's 3.8-5.9 ms, while whole steps favoured dense).

Per-bucket exchange seconds do not see everything either: where ranks share cores, one
bucket's selection or background copy slows everyone's backward. So a proposal that
changes any bucket's mode is a trial, judged by whole training steps (each step's time
averaged over ranks). It runs the tried modes and the modes before it in turn, blocks of
``TRIAL_BLOCK_STEPS`` (5) steps, ``TRIAL_ROUNDS`` (4) of each (tried, before, tried, ...),
and compares each tried block's median step with the mean of the before blocks either
side of it (the first one: the median of the last ``2 * first`` steps before the trial).
The first step of each block carries the switch (a fold of the residual, a threshold
refresh) and is not counted. The tried modes are kept only if the median of those
ratios is below 1; otherwise the modes before it, which the trial ends in, stay. In
turn, because a machine shared with other work drifts: on the demo's model (2 ranks on
2 cores) 5-step medians of the same modes ranged 17.2-42.7 ms within one trial. Four
rounds, not two: with the exchange switched every 5 steps for whole runs, trials of two
ratios fell on the wrong side of 1 in 5-17 % of windows, of four in 0-11 %
(``benchmarks/trial_noise.py``). Shorter blocks blur the modes (every 2 steps, sparse
measured 1.00-1.07x dense over whole runs where every 5 steps measured 1.17-1.18x).
Medians, not means: where ranks share cores single steps stall for several times the
usual step (3 s steps with 7 s and 12 s among them, 4 ranks on 2 cores), and one such
stall would decide a trial by itself. Every rank switches blocks at the same steps on
its own, with no collective; the blocks' steps are shared once, at the trial's end, and
rank 0's verdict is broadcast. A rejected proposal may be tried again at a later
decision, every ``every`` steps; each
bucket trial rejected in a row doubles that wait, up to ``2 ** BACKOFF_DOUBLINGS``
times ``every``, and one kept resets it. Whole steps are counted from step ``first``
on, so the first decision comes at step ``2 * first``: the first steps of training run
slower (allocations, connections, first threshold estimates) and would favour any
trial. The first step after each decision is not counted either (it carries the
probes, any fold of the residual at a switch to dense and a threshold refresh at a
switch to sparse).

The same trials can judge the all-gather overlap (``overlap_allgather="auto"``): where
the overlapped all-gather and the next forward compete for the same cores instead of
using idle ones, overlap can make steps slower. On 4 ranks sharing 2 cores it took
0.69-1.31x the step without overlap with the ranks free to migrate between cores, and
0.86-0.95x with each rank pinned to one core. Then the scheduler also owns one more
setting, overlap on or off, and tries the other one at every decision that starts no
bucket trial, and right after each bucket trial (the better overlap setting may differ
once modes have changed). The rule is the same: the two settings alternate block by
block, and the tried one is kept only if whole steps get faster. Both settings follow
the same trajectory; only when the all-gathers are waited for differs.

A decision probes the link only while the model can still decide something: while a
bucket has a mode never measured, and again if the process set's size changes. Once
every bucket has run both ways, measured times decide, and a decision sends two small
collectives. The probes stop at the largest bucket's size: on the demo's model (one
1.19M-value bucket, 2 ranks on 2 cores) probing up to 2^23 values made a decision's step
185-210 ms against a 10-13 ms step, about 1.9 ms a step at ``every`` = 100. Rank 0's
decision is broadcast, so every rank exchanges each bucket the same way and decides at
the same steps. Both sides only need numbers: the probes and the broadcast run through
the framework backend.
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.bucket_choice import (
    TRIAL_BLOCK_STEPS,
    BucketChoice,
    Setting,
    Trial,
    TrialOutcome,
)
from horovod_sparse.common.cost_model import (
    LinkModel,
    dense_seconds,
    probe_link,
    probe_numels,
    sparse_seconds,
)

__all__ = ["AutoScheduler", "BucketChoice", "TrialOutcome"]

# A bucket trial rejected doubles the steps to the next decision, up to this many times.
BACKOFF_DOUBLINGS = 3
# What a decision starts, as broadcast from rank 0: nothing, a bucket trial or an
# overlap trial.
NO_TRIAL, BUCKET_TRIAL, OVERLAP_TRIAL = 0.0, 1.0, 2.0


class AutoScheduler:
    """Dense or sparse per bucket, revisited every ``every`` steps; same on every rank.

    Args:
        ops: framework primitives (timed allreduces, one broadcast).
        name: collective-name stem.
        process_set: the ranks taking part.
        buckets: (numel, bytes per value) of each sparse bucket, in bucket order.
        density: the density a sparse step uses (k = ceil(density * n)).
        every: steps between decisions (the first one at step ``2 * first``).
        first: the steps at the start of training whose whole-step times are not
            counted; the window before a trial is the last ``2 * first`` steps.
        choose_density: propose dense or sparse per bucket (False: every bucket keeps
            the mode it starts in, and the link is not probed).
        overlap: the all-gather overlap to start with, which trials then judge; None
            where the scheduler does not own it.

    The adapter reports each bucket's steps (``choices[i].observe``) and each whole
    training step (:meth:`observe_step`), asks :meth:`due` at every step and calls
    :meth:`decide` when it is.
    """

    def __init__(
        self,
        ops: Backend,
        name: str,
        process_set: Any,
        buckets: list[tuple[int, int]],
        density: float,
        every: int = 100,
        first: int = 5,
        choose_density: bool = True,
        overlap: bool | None = None,
    ) -> None:
        if int(every) < 1:
            raise ValueError(f"scheduler_steps must be >= 1, got {every}")
        self.ops = ops
        self.name = name
        self.process_set = process_set
        self.density = float(density)
        self.every = int(every)
        self.first = int(first)
        self.choose_density = bool(choose_density)
        self.overlap = overlap
        self.choices = [BucketChoice(n, size) for n, size in buckets]
        self.link: LinkModel | None = None
        self._link_world = 0  # the process set's size when the link was probed
        self.decisions = 0
        self.next_decision = 2 * self.first  # the step at which the next decision is due
        # Median seconds of a whole step under the current modes (NaN until measured).
        self.step_seconds = math.nan
        self.trials: list[TrialOutcome] = []  # every trial so far, for the adapter to show
        # Bucket trials rejected in a row: each doubles the wait before the next decision
        # (up to 2**BACKOFF_DOUBLINGS times ``every``), as each makes one more unlikely to pay.
        self.rejections = 0
        self._trial: Trial | None = None  # the trial in progress
        self._step_times: list[float] = []  # this rank's whole steps since the last block
        self._steps_to_skip = self.first  # whole steps not counted: start of training

    def due(self, step: int) -> bool:
        return step >= self.next_decision

    def observe_step(self, seconds: float) -> None:
        """One whole training step took ``seconds`` on this rank."""
        if self._steps_to_skip > 0:
            self._steps_to_skip -= 1
            return
        self._step_times.append(seconds)

    def hold(self) -> None:
        """Decide no more (the modes were pinned by hand), with no trial in progress."""
        self.next_decision = sys.maxsize
        self._trial = None

    def restart(self, step: int) -> None:
        """After a restored checkpoint: decide at ``step``, with no trial in progress."""
        self.next_decision = step
        self._trial = None
        self._step_times = []
        self._steps_to_skip = 1

    def decide(self, like: Tensor, step: int | None = None) -> list[bool]:
        """Probe the link where needed, share the measurements, and choose; returns
        dense flags.

        While a trial runs and blocks are left: start the next block (the other
        setting), on this rank alone, since every rank follows the same order. After
        its last block: share every block's steps and keep the tried setting or stay
        with the one before (:meth:`Trial.outcome`); where the scheduler owns the
        overlap, a bucket trial is followed at once by a trial of the other overlap
        setting. Otherwise: propose each bucket's mode from its own costs, and start a
        trial if that changes any; if none changes, try the other overlap setting
        (where owned). ``step`` (default: the step this decision was due at) sets when
        the next one is due: after ``TRIAL_BLOCK_STEPS`` steps while a trial runs, else
        after ``every`` steps. :attr:`overlap` holds the overlap setting chosen.

        Sends: nothing between a trial's blocks. Otherwise, where it probes
        (:meth:`_needs_probe`), ``PROBE_REPEATS`` allreduces per probe size (up to 32
        MiB, no larger than the largest bucket); then one allreduce of 6 values per
        bucket and one per whole step counted (the window before a trial, or a
        trial's blocks), one broadcast of one value per bucket and two more.
        """
        now = self.next_decision if step is None else step
        trial = self._trial
        following = None
        if trial is not None:
            following = trial.advance(self._step_times)
            self._step_times = []
        if following is not None:
            self._apply(*following)
            self._steps_to_skip = 1  # the switch's step
            self.next_decision = now + TRIAL_BLOCK_STEPS
            return [choice.dense for choice in self.choices]
        world = self.ops.size(self.process_set)
        medians = self._share_measurements(like)
        link = self.link
        if self._needs_probe(world):
            largest = max(choice.numel for choice in self.choices)
            link = probe_link(
                self.ops, like, world, self.name, self.process_set, probe_numels(largest)
            )
            self._link_world = world
        if link is not None and self.choose_density:
            for choice in self.choices:
                self._predict(choice, link, world)
        current = tuple(choice.dense for choice in self.choices)
        if trial is not None:
            modes, overlap, kind = self._end_trial(trial, medians)
        else:
            modes, overlap, kind = self._propose(current, medians[0])
        flags, overlap, kind = self._broadcast_choice(modes, overlap, kind, like)
        self._start(current, flags, overlap, kind)
        if kind != NO_TRIAL:
            interval = TRIAL_BLOCK_STEPS
        else:
            interval = self.every << min(self.rejections, BACKOFF_DOUBLINGS)
        self._steps_to_skip = 1  # the next step carries this decision's probes
        self.link = link
        self.decisions += 1
        self.next_decision = now + interval
        return [choice.dense for choice in self.choices]

    def _needs_probe(self, world: int) -> bool:
        """Whether this decision probes the link: only while a prediction can decide
        something, that is while a bucket has a mode never measured (once both are,
        measured times decide), and again if the process set's size changed. The same
        on every rank: every rank holds the same means over ranks."""
        if not self.choose_density:
            return False
        if self.link is None or self._link_world != world:
            return True
        return any(
            math.isnan(choice.measured_dense) or math.isnan(choice.measured_sparse)
            for choice in self.choices
        )

    def _share_measurements(self, like: Tensor) -> list[float]:
        """Means over ranks of what each bucket measured since the last decision, into
        its :class:`BucketChoice`; returns, per block of whole steps, the median over
        its steps of their mean over ranks (NaN for a block without steps): after a
        trial each of its blocks, else one, the window before the next trial. Every
        rank counts the same steps: they are collective."""
        ops = self.ops
        windows = [x for choice in self.choices for x in choice.take_windows()]
        if self._trial is not None:
            blocks = self._trial.steps
        else:
            # The steps just before a trial are its baseline: a machine shared with other
            # work drifts over a whole window (medians of 10.0 and 13.0 ms for the same
            # modes a hundred steps apart on the demo's model).
            blocks = [self._step_times[-2 * self.first :]]
        self._step_times = []
        summed = ops.to_host_list(
            ops.wait(
                ops.allreduce_sum_async(
                    ops.from_host(windows + [s for block in blocks for s in block], like),
                    f"{self.name}.measured",
                    self.process_set,
                )
            )
        )
        for index, choice in enumerate(self.choices):
            self._update_choice(choice, summed[6 * index : 6 * index + 6])
        world = ops.size(self.process_set)
        medians, offset = [], len(windows)
        for block in blocks:
            steps = summed[offset : offset + len(block)]
            offset += len(block)
            medians.append(statistics.median(steps) / world if steps else math.nan)
        return medians

    @staticmethod
    def _update_choice(choice: BucketChoice, sums: list[float]) -> None:
        """One bucket's summed windows (local work, dense and sparse seconds, each as
        sum and count) into its measured costs."""
        local, n_local, dense_s, n_dense, sparse_s, n_sparse = sums
        if n_local:
            choice.local_per_element = local / n_local
        if n_dense:
            choice.measured_dense = dense_s / n_dense
        if n_sparse:
            choice.measured_sparse = sparse_s / n_sparse

    def _predict(self, choice: BucketChoice, link: LinkModel, world: int) -> None:
        """The model's seconds of a dense and a sparse step of ``choice`` over ``link``."""
        choice.predicted_dense = dense_seconds(link, choice.numel, choice.itemsize, world)
        if not math.isnan(choice.local_per_element):
            k = max(1, math.ceil(self.density * choice.numel))
            choice.predicted_sparse = sparse_seconds(
                link, choice.numel, k, world, choice.local_per_element
            )

    def _end_trial(
        self, trial: Trial, medians: list[float]
    ) -> tuple[tuple[bool, ...], bool | None, float]:
        """A trial's blocks have run: its verdict. Returns the modes, overlap and trial
        kind this rank proposes: after a bucket trial, where the overlap is owned, a
        trial of the other overlap setting (it may pay under the modes now chosen)."""
        trial.blocks.extend(medians)
        outcome = trial.outcome()
        self.trials.append(outcome)
        if outcome.kept:
            (modes, overlap), settled = trial.tried, outcome.seconds_tried
        else:
            (modes, overlap), settled = trial.before, outcome.seconds_before
        bucket_trial = trial.before[0] != trial.tried[0]
        if bucket_trial:
            self.rejections = 0 if outcome.kept else self.rejections + 1
        # The kept setting's steps in the trial are the next trial's window before it.
        self.step_seconds = settled
        kind = NO_TRIAL
        if overlap is not None and bucket_trial:
            overlap, kind = not overlap, OVERLAP_TRIAL
        return modes, overlap, kind

    def _propose(
        self, current: tuple[bool, ...], step_seconds: float
    ) -> tuple[tuple[bool, ...], bool | None, float]:
        """No trial in progress: each bucket's mode from its own costs (a bucket trial
        if that changes any), else the other overlap setting (where owned). Returns the
        modes, overlap and trial kind this rank proposes."""
        modes, overlap, trial = current, self.overlap, NO_TRIAL
        if not math.isnan(step_seconds):
            self.step_seconds = step_seconds
        if self.choose_density:
            modes = tuple(choice.proposal() for choice in self.choices)
        if modes != current:
            trial = BUCKET_TRIAL
        elif overlap is not None:
            overlap, trial = not overlap, OVERLAP_TRIAL
        elif self.choose_density:
            modes = tuple(choice.proposal(explore=True) for choice in self.choices)
            trial = BUCKET_TRIAL if modes != current else NO_TRIAL
        return modes, overlap, trial

    def _broadcast_choice(
        self, modes: tuple[bool, ...], overlap: bool | None, trial: float, like: Tensor
    ) -> tuple[list[bool], bool | None, float]:
        """Rank 0's modes, overlap, trial kind and count of bucket trials rejected in a
        row (which set the next decision's step) for everyone: float rounding can never
        split the ranks."""
        ops = self.ops
        choice = [float(d) for d in modes] + [float(bool(overlap)), trial, float(self.rejections)]
        *flags, overlap_flag, trial, rejections = ops.to_host_list(
            ops.broadcast(ops.from_host(choice, like), 0, f"{self.name}.choice", self.process_set)
        )
        self.rejections = int(rejections)
        chosen_overlap = bool(overlap_flag) if self.overlap is not None else None
        return [bool(flag) for flag in flags], chosen_overlap, trial

    def _start(
        self, current: tuple[bool, ...], flags: list[bool], overlap: bool | None, trial: float
    ) -> None:
        """Apply the broadcast choice. A new trial's first block is judged against the
        last window measured under the setting it leaves: the modes before a bucket
        trial, the other overlap setting for an overlap trial."""
        tried: Setting = (tuple(flags), overlap)
        if trial == BUCKET_TRIAL:
            self._trial = Trial((current, self.overlap), tried, [self.step_seconds])
        elif trial == OVERLAP_TRIAL:
            before = not overlap if overlap is not None else None
            self._trial = Trial((tuple(flags), before), tried, [self.step_seconds])
        else:
            self._trial = None
        self._apply(tuple(flags), overlap)

    def _apply(self, modes: tuple[bool, ...], overlap: bool | None) -> None:
        """Run each bucket in ``modes`` (True: dense) and the all-gather overlap
        ``overlap`` from the next step on."""
        self.overlap = overlap
        for choice, flag in zip(self.choices, modes):
            choice.switch(flag)
