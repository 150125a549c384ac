"""The automatic dense/sparse choice: the alpha-beta fit, the predictions, the decision."""

import math
import statistics

import pytest

from horovod_sparse.common.cost_model import (
    PROBE_REPEATS,
    LinkModel,
    dense_seconds,
    fit_link,
    probe_link,
    probe_numels,
    ring_terms,
    sparse_seconds,
)
from horovod_sparse.common.scheduler import AutoScheduler


def ring_time(link: LinkModel, numel: int, world: int) -> float:
    steps, volume = ring_terms(numel, 4, world)
    return link.alpha * steps + link.beta * volume


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_fit_recovers_alpha_and_beta(world):
    true = LinkModel(alpha=3e-3, beta=8e-9)  # about 1 Gbit/s with 3 ms per message
    samples = [(n, ring_time(true, n, world)) for n in (1, 1 << 20, 1 << 23)]
    fitted = fit_link(samples, world)
    assert fitted.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(true.beta, rel=1e-6)


def test_fit_never_returns_negative_costs():
    # Noisy probes where the large message looks faster than the small one.
    fitted = fit_link([(1, 2e-3), (1 << 18, 1e-3), (1 << 21, 1.5e-3)], 4)
    assert fitted.alpha >= 0 and fitted.beta >= 0


def test_predictions_follow_the_formulas():
    link, n, k, world = LinkModel(1e-4, 1e-9), 1_000_000, 10_000, 4
    assert dense_seconds(link, n, 4, world) == pytest.approx(6 * 1e-4 + 1.5 * n * 4 * 1e-9)
    local = 2e-9
    rows = k * 3 / 4
    histograms = 4 * (6 * 1e-4 + 1.5 * 256 * 4 * 1e-9)
    expected = local * n + 2 * (3 * 1e-4 + rows * 8 * 1e-9) + histograms
    assert sparse_seconds(link, n, k, world, local) == pytest.approx(expected)
    assert dense_seconds(link, n, 4, 1) == 0.0
    # P = 2: one allgather of the k selected rows (common/pair_stages.py).
    histograms = 4 * (2 * 1e-4 + 1.0 * 256 * 4 * 1e-9)
    expected = local * n + (1e-4 + k * 8 * 1e-9) + histograms
    assert sparse_seconds(link, n, k, 2, local) == pytest.approx(expected)


def test_slow_links_favour_sparse_and_fast_links_dense():
    n, k, world, local = 25_000_000, 250_000, 4, 2.5e-9  # measured: 60 ms per 25M pass
    one_gbit = LinkModel(alpha=3e-3, beta=8e-9)
    loopback = LinkModel(alpha=5e-5, beta=2e-10)
    assert sparse_seconds(one_gbit, n, k, world, local) < dense_seconds(one_gbit, n, 4, world)
    assert sparse_seconds(loopback, n, k, world, local) > dense_seconds(loopback, n, 4, world)
    # A small bucket pays the sparse latency (ten message steps per rank) for little.
    assert sparse_seconds(one_gbit, 4096, 41, world, local) > dense_seconds(
        one_gbit, 4096, 4, world
    )


class FakeOps:
    """One rank of ``world`` over a link ``link``: allreduce time from the ring model,
    read through ``clock``; the sums are those of ``world`` identical ranks."""

    def __init__(self, link: LinkModel, world: int) -> None:
        self.link, self.world, self.now = link, world, 0.0
        self.broadcasts = 0

    def size(self, process_set):
        return self.world

    def zeros(self, numel, like):
        return [0.0] * numel

    def clock(self, *after):
        return self.now

    def allreduce_sum_async(self, tensor, name, process_set):
        self.now += ring_time(self.link, len(tensor), self.world)
        return [self.world * v for v in tensor]

    def wait(self, handle):
        return handle

    def from_host(self, values, like):
        return list(values)

    def to_host_list(self, tensor):
        return list(tensor)

    def broadcast(self, tensor, root, name, process_set):
        self.broadcasts += 1
        return tensor


class RecordingOps(FakeOps):
    """FakeOps that records each allreduce's buffer and name."""

    def __init__(self, link: LinkModel, world: int) -> None:
        super().__init__(link, world)
        self.allreduces: list[tuple[list, str]] = []  # (buffer, name), buffers kept alive

    def allreduce_sum_async(self, tensor, name, process_set):
        self.allreduces.append((tensor, name))
        return super().allreduce_sum_async(tensor, name, process_set)


def test_probes_stop_at_the_largest_bucket():
    assert probe_numels(1_180_672) == (1, 1 << 20, 1_180_672)
    assert probe_numels(1 << 24) == (1, 1 << 20, 1 << 23)
    assert probe_numels(1000) == (1, 1000)


def test_a_probe_size_repeats_one_buffer_under_one_name():
    """After its first, a size's repeats meet Horovod's response cache, as a step's
    recurring collectives do; the fit still recovers the link."""
    link = LinkModel(4e-4, 1.5e-9)
    ops = RecordingOps(link, 2)
    numels = probe_numels(1_180_672)
    fitted = probe_link(ops, None, 2, "s", None, numels)
    assert len(ops.allreduces) == PROBE_REPEATS * len(numels)
    for index, numel in enumerate(numels):
        size_calls = ops.allreduces[PROBE_REPEATS * index : PROBE_REPEATS * (index + 1)]
        assert {name for _, name in size_calls} == {f"s.probe{numel}"}
        first = size_calls[0][0]
        assert all(buffer is first for buffer, _ in size_calls)
    assert fitted.alpha == pytest.approx(link.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(link.beta, rel=1e-6)


def observe_in_current_modes(scheduler: AutoScheduler, link: LinkModel, steps: int = 3) -> None:
    """``steps`` steps of each bucket in the mode it runs, taking what the model predicts."""
    for choice in scheduler.choices:
        k = math.ceil(0.01 * choice.numel)
        for _ in range(steps):
            if choice.dense:
                choice.observe(True, dense_seconds(link, choice.numel, 4, 4))
            else:
                seconds = sparse_seconds(link, choice.numel, k, 4, 2.5e-9)
                choice.observe(False, seconds, 2.5e-9 * choice.numel)


@pytest.mark.parametrize(
    "link, proposed",
    [
        # 1 Gbit/s: dense 25M floats (~1.2 s) is beyond 2.5x sparse (~0.18 s): not tried.
        (LinkModel(3e-3, 8e-9), [True, False]),
        (LinkModel(5e-5, 2e-10), [True, True]),
    ],
    ids=["1gbit", "loopback"],
)
def test_first_decision_tries_dense_where_the_model_allows(link, proposed):
    ops = FakeOps(link, 4)
    buckets = [(4096, 4), (25_000_000, 4)]
    scheduler = AutoScheduler(ops, "s", None, buckets, density=0.01, every=10, first=5)
    assert [scheduler.due(s) for s in (0, 9, 10)] == [False, False, True]
    observe_in_current_modes(scheduler, link)
    assert scheduler.decide(like=None, step=10) == proposed
    assert ops.broadcasts == 1
    # A trial of `first` steps: the next decision ends it.
    assert [scheduler.due(s) for s in (14, 15)] == [False, True]
    big = scheduler.choices[1]
    assert scheduler.link.alpha == pytest.approx(link.alpha, rel=1e-6)
    assert big.local_per_element == pytest.approx(2.5e-9)
    assert big.predicted_sparse == pytest.approx(
        sparse_seconds(scheduler.link, big.numel, 250_000, 4, 2.5e-9)
    )


def run_block(scheduler: AutoScheduler, link: LinkModel, steps, step: int) -> list[bool]:
    """One block of a trial: each bucket's steps in its mode, the block's whole steps
    after the one that carries the decision (not counted), then the decision at ``step``
    that ends the block."""
    observe_in_current_modes(scheduler, link)
    for seconds in (60.0, *steps):
        scheduler.observe_step(seconds)
    return scheduler.decide(like=None, step=step)


def start_bucket_trial(scheduler: AutoScheduler, link: LinkModel, before) -> list[bool]:
    """Sparse steps up to the first decision (step 10), which starts a bucket trial."""
    observe_in_current_modes(scheduler, link)
    for seconds in (60.0, 30.0, 9.0, 9.0, 9.0, *before):  # the start is not counted
        scheduler.observe_step(seconds)
    return scheduler.decide(like=None, step=10)


@pytest.mark.parametrize("trial_step_s, kept", [(1.0, True), (3.0, False)])
def test_a_trial_alternates_and_is_kept_only_if_whole_steps_get_faster(trial_step_s, kept):
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10)
    assert start_bucket_trial(scheduler, link, [2.0] * 5) == [True, True]
    assert scheduler.step_seconds == pytest.approx(2.0)
    # Tried, before, tried, before: a block of `first` = 5 steps each.
    tried, before = [trial_step_s] * 4, [2.0] * 4
    assert run_block(scheduler, link, tried, 15) == [False, False]
    assert scheduler.trials == [] and scheduler.next_decision == 20
    assert run_block(scheduler, link, before, 20) == [True, True]
    assert run_block(scheduler, link, tried, 25) == [False, False]
    assert scheduler.trials == [] and scheduler.next_decision == 30
    modes = run_block(scheduler, link, before, 30)
    assert modes == ([True, True] if kept else [False, False])
    (outcome,) = scheduler.trials
    assert outcome.before == (False, False) and outcome.tried == (True, True)
    assert outcome.seconds_before == pytest.approx(2.0)
    assert outcome.seconds_tried == pytest.approx(trial_step_s)
    assert outcome.ratio == pytest.approx(trial_step_s / 2.0)
    assert outcome.blocks == pytest.approx((2.0, trial_step_s, 2.0, trial_step_s, 2.0))
    assert outcome.kept == kept
    assert scheduler.step_seconds == pytest.approx(trial_step_s if kept else 2.0)
    # No trial pending: the regular interval, doubled after a rejected bucket trial.
    assert scheduler.next_decision == (40 if kept else 50)
    assert scheduler.rejections == (0 if kept else 1)


@pytest.mark.parametrize(
    "blocks, kept",
    [
        # The machine speeds up by 0.5 s a block; the tried modes are 0.1 s slower than
        # the blocks around them. Judged against the window before it, the first tried
        # block (3.6 against 4.0) would keep them.
        ((4.0, 3.6, 3.0, 2.6, 2.0), False),
        # It slows down by 0.5 s a block; the tried modes are 0.1 s faster. Judged
        # against the window before it, the first (4.0 against 3.5 s) would reject them.
        ((3.5, 3.9, 4.5, 4.9, 5.5), True),
    ],
    ids=["speeding-up", "slowing-down"],
)
def test_a_machine_that_drifts_during_a_trial_does_not_decide_it(blocks, kept):
    link = LinkModel(5e-5, 2e-10)
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], 0.01, every=10)
    assert start_bucket_trial(scheduler, link, [blocks[0]] * 5) == [True]
    for index, seconds in enumerate(blocks[1:]):
        modes = run_block(scheduler, link, [seconds] * 4, 15 + 5 * index)
    assert modes == [kept]
    (outcome,) = scheduler.trials
    assert outcome.blocks == pytest.approx(blocks)
    ratios = [
        blocks[1] / statistics.mean(blocks[0:3:2]),
        blocks[3] / statistics.mean(blocks[2:5:2]),
    ]
    assert outcome.ratio == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    assert outcome.kept == kept


@pytest.mark.parametrize(
    "before, tried, kept",
    [
        # One stalled step (a neighbour rank took the core) would make the mean 3.0.
        ((2.0, 2.0, 2.0, 2.0, 2.0), (1.0, 9.0, 1.0, 1.0), True),
        # A stall before the trial would make the mean 3.4 and keep a slower trial.
        ((2.0, 2.0, 9.0, 2.0, 2.0), (2.5, 2.5, 2.5, 2.5), False),
    ],
    ids=["stall-in-trial", "stall-before"],
)
def test_a_single_stalled_step_does_not_decide_a_trial(before, tried, kept):
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10)
    assert start_bucket_trial(scheduler, link, before) == [True, True]
    for step, steps in ((15, tried), (20, before[1:]), (25, tried), (30, before[1:])):
        modes = run_block(scheduler, link, steps, step)
    assert modes == ([True, True] if kept else [False, False])
    (outcome,) = scheduler.trials
    assert outcome.seconds_before == pytest.approx(statistics.median(before))
    assert outcome.seconds_tried == pytest.approx(statistics.median(tried))
    assert outcome.kept == kept


def test_a_bucket_never_measured_keeps_its_mode():
    ops = FakeOps(LinkModel(5e-5, 2e-10), 2)
    scheduler = AutoScheduler(ops, "s", None, [(10_000, 4)], density=0.01)
    assert scheduler.decide(like=None) == [False]
    assert math.isnan(scheduler.choices[0].measured_sparse)
    assert scheduler.trials == []


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="scheduler_steps"):
        AutoScheduler(FakeOps(LinkModel(0, 0), 2), "s", None, [(10, 4)], 0.1, every=0)


def test_a_mode_the_model_rules_out_is_not_tried():
    link = LinkModel(3e-3, 8e-9)  # 1 Gbit/s: dense 25M floats ~ 1.2 s at P = 4
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], density=0.01)
    choice = scheduler.choices[0]
    for _ in range(2):  # sparse measured at 0.2 s (the first step is not counted)
        choice.observe(False, 0.2, 0.1)
    assert scheduler.decide(like=None, step=5) == [False]
    assert math.isnan(choice.measured_dense)
    assert scheduler.next_decision == 5 + scheduler.every


def test_measured_bucket_times_overrule_the_model():
    link = LinkModel(3e-3, 8e-9)  # the model says sparse for a 25M bucket
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(ops, "s", None, [(25_000_000, 4)], density=0.01)
    choice = scheduler.choices[0]
    choice.observe(False, 60.0, 1.0)  # the first step in a mode is not counted
    choice.observe(False, 5.0, 2.5e-9 * choice.numel)  # but sparse steps took 5 s
    for seconds in (60.0, 60.0, 60.0, 60.0, 60.0, 6.0):  # the first 5 are not counted
        scheduler.observe_step(seconds)
    assert scheduler.decide(like=None, step=10) == [True]  # so dense is tried
    assert choice.measured_sparse == pytest.approx(5.0)
    assert choice.predicted_sparse < choice.predicted_dense < choice.measured_sparse
    # The trial's blocks: dense (each bucket's first step in a mode is not counted),
    # measured slower still, then sparse, in turn; the last decision ends the trial.
    blocks = ((15, True, [False]), (20, False, [True]), (25, True, [False]), (30, False, [False]))
    for step, dense, modes in blocks:
        choice.observe(dense, 0.1, 0.1)  # the switch's first step: not counted
        if dense:
            choice.observe(True, 9.0)
        else:
            choice.observe(False, 5.0, 2.5e-9 * choice.numel)
        for seconds in (60.0, 10.0 if dense else 6.0):
            scheduler.observe_step(seconds)
        assert scheduler.decide(like=None, step=step) == modes
    assert scheduler.trials[0].kept is False  # steps were slower: sparse stays
    assert choice.measured_dense == pytest.approx(9.0)
    # With both modes measured, the bucket's own costs propose sparse; dense, measured
    # within TRIAL_FACTOR of it, is explored again after twice the interval (a rejection).
    assert scheduler.next_decision == 30 + 2 * scheduler.every
    choice.observe(False, 5.0, 2.5e-9 * choice.numel)
    assert scheduler.decide(like=None, step=scheduler.next_decision) == [True]
    assert len(scheduler.trials) == 1


def test_a_mode_measured_far_slower_is_not_explored():
    link = LinkModel(5e-5, 2e-10)
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], density=0.01)
    choice = scheduler.choices[0]
    for seconds in (60.0, 1.0):  # sparse: the first step is not counted
        choice.observe(False, seconds, 2.5e-9 * choice.numel)
    choice.measured_dense = 2.6  # dense measured beyond TRIAL_FACTOR (2.5) times sparse
    assert scheduler.decide(like=None, step=10) == [False]
    assert scheduler.trials == [] and scheduler.next_decision == 10 + scheduler.every


@pytest.mark.parametrize("off_step_s, kept", [(1.5, True), (2.5, False)])
def test_overlap_alone_is_judged_by_whole_steps(off_step_s, kept):
    link = LinkModel(5e-5, 2e-10)
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(
        ops, "s", None, [(25_000_000, 4)], 0.01, every=10, choose_density=False, overlap=True
    )
    observe_in_current_modes(scheduler, link)
    for seconds in (60.0, 60.0, 60.0, 60.0, 60.0, 2.0, 2.0, 2.0, 2.0, 2.0):
        scheduler.observe_step(seconds)
    # Buckets keep their mode; the other overlap setting is tried, in turn with this one.
    assert scheduler.decide(like=None, step=10) == [False]
    assert scheduler.overlap is False
    # No density choice: no probes (only the measurements, far below one 1M-value probe).
    assert scheduler.link is None and ops.now < ring_time(ops.link, 1 << 20, 4)
    assert scheduler.next_decision == 15
    for step, steps, overlap in ((15, [off_step_s] * 4, True), (20, [2.0] * 4, False)):
        assert run_block(scheduler, link, steps, step) == [False]
        assert scheduler.overlap is overlap
    run_block(scheduler, link, [off_step_s] * 4, 25)
    assert run_block(scheduler, link, [2.0] * 4, 30) == [False]
    assert scheduler.overlap is (not kept)
    (outcome,) = scheduler.trials
    assert outcome.before == outcome.tried == (False,)
    assert (outcome.overlap_before, outcome.overlap_tried) == (True, False)
    assert outcome.seconds_before == pytest.approx(2.0)
    assert outcome.seconds_tried == pytest.approx(off_step_s)
    assert outcome.kept == kept
    assert scheduler.next_decision == 40
    # The next regular decision tries the other setting again: conditions may change.
    run_block(scheduler, link, [off_step_s if kept else 2.0], 40)
    assert scheduler.overlap is kept and scheduler.next_decision == 45


def test_a_bucket_trial_is_followed_by_an_overlap_trial():
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(
        ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10, overlap=True
    )
    # The bucket proposal goes first, with the overlap unchanged.
    assert start_bucket_trial(scheduler, link, [2.0] * 5) == [True, True]
    assert scheduler.overlap is True
    for step, steps in ((15, [1.0] * 4), (20, [2.0] * 4), (25, [1.0] * 4)):
        run_block(scheduler, link, steps, step)
        assert scheduler.overlap is True
    # Dense is kept, and overlap off is tried at once under the new modes.
    assert run_block(scheduler, link, [2.0] * 4, 30) == [True, True]
    assert scheduler.overlap is False
    assert scheduler.next_decision == 35
    for step, steps, overlap in ((35, 1.2, True), (40, 1.0, False), (45, 1.2, True)):
        assert run_block(scheduler, link, [steps] * 4, step) == [True, True]
        assert scheduler.overlap is overlap
    assert run_block(scheduler, link, [1.0] * 4, 50) == [True, True]
    assert scheduler.overlap is True  # overlap off was slower: back on
    bucket_trial, overlap_trial = scheduler.trials
    assert bucket_trial.tried == (True, True) and bucket_trial.kept
    assert (bucket_trial.overlap_before, bucket_trial.overlap_tried) == (True, True)
    assert overlap_trial.before == overlap_trial.tried == (True, True)
    assert (overlap_trial.overlap_before, overlap_trial.overlap_tried) == (True, False)
    # Its first block is judged against the bucket trial's last dense block.
    assert overlap_trial.blocks == pytest.approx((1.0, 1.2, 1.0, 1.2, 1.0))
    assert overlap_trial.seconds_before == pytest.approx(1.0)
    assert not overlap_trial.kept
    assert scheduler.step_seconds == pytest.approx(1.0)
    assert scheduler.next_decision == 60


def test_without_overlap_ownership_trials_leave_it_alone():
    link = LinkModel(5e-5, 2e-10)
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], 0.01, every=10)
    start_bucket_trial(scheduler, link, [2.0])
    for step in (15, 20, 25, 30):
        run_block(scheduler, link, [1.0 if step % 10 else 2.0], step)
        assert scheduler.overlap is None
    assert scheduler.trials[0].kept and scheduler.trials[0].overlap_before is None
    assert scheduler.next_decision == 40
