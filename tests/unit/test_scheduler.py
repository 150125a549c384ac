"""The automatic dense/sparse choice: the alpha-beta fit, the predictions, the decision."""

import math
import statistics

import pytest

from horovod_sparse.common.bucket_choice import TRIAL_BLOCK_STEPS, TRIAL_ROUNDS
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
    # A trial's first block: the next decision, TRIAL_BLOCK_STEPS on, starts the next.
    block_end = 10 + TRIAL_BLOCK_STEPS
    assert [scheduler.due(s) for s in (block_end - 1, block_end)] == [False, True]
    big = scheduler.choices[1]
    assert scheduler.link.alpha == pytest.approx(link.alpha, rel=1e-6)
    assert big.local_per_element == pytest.approx(2.5e-9)
    assert big.predicted_sparse == pytest.approx(
        sparse_seconds(scheduler.link, big.numel, 250_000, 4, 2.5e-9)
    )


def run_block(scheduler: AutoScheduler, link: LinkModel, steps, step: int) -> list[bool]:
    """One block: each bucket's steps in its mode, the block's whole steps after the one
    that carries the switch or decision (not counted), then the decision at ``step``
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


def run_trial(scheduler: AutoScheduler, link: LinkModel, tried, before, step: int):
    """A trial's blocks, the first of which began at ``step``: tried and before in turn,
    each a switch's step (not counted) and one counted step of ``tried[i]`` or
    ``before[i]`` seconds. Returns the modes and overlap after each block's end."""
    assert len(tried) == len(before) == TRIAL_ROUNDS
    after = []
    for seconds in (s for pair in zip(tried, before) for s in pair):
        step += TRIAL_BLOCK_STEPS
        after.append((run_block(scheduler, link, [seconds], step), scheduler.overlap))
    return after


TRIAL_STEPS = 2 * TRIAL_ROUNDS * TRIAL_BLOCK_STEPS


@pytest.mark.parametrize("trial_step_s, kept", [(1.0, True), (3.0, False)])
def test_a_trial_alternates_and_is_kept_only_if_whole_steps_get_faster(trial_step_s, kept):
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10)
    assert start_bucket_trial(scheduler, link, [2.0] * 5) == [True, True]
    assert scheduler.step_seconds == pytest.approx(2.0)
    broadcasts, now = ops.broadcasts, ops.now
    tried, before = [trial_step_s] * TRIAL_ROUNDS, [2.0] * TRIAL_ROUNDS
    # Tried, before, tried, ...: one block of TRIAL_BLOCK_STEPS steps each.
    for index in range(2 * TRIAL_ROUNDS - 1):
        step = 10 + (index + 1) * TRIAL_BLOCK_STEPS
        seconds = (tried if index % 2 == 0 else before)[index // 2]
        modes = run_block(scheduler, link, [seconds], step)
        assert modes == ([False, False] if index % 2 == 0 else [True, True])
        assert scheduler.trials == []
        assert scheduler.next_decision == step + TRIAL_BLOCK_STEPS
    # Between blocks nothing is sent: every rank follows the same order.
    assert (ops.broadcasts, ops.now) == (broadcasts, now)
    modes = run_block(scheduler, link, [2.0], 10 + TRIAL_STEPS)
    assert ops.broadcasts == broadcasts + 1
    assert modes == ([True, True] if kept else [False, False])
    (outcome,) = scheduler.trials
    assert outcome.before == (False, False) and outcome.tried == (True, True)
    assert outcome.seconds_before == pytest.approx(2.0)
    assert outcome.seconds_tried == pytest.approx(trial_step_s)
    assert outcome.ratio == pytest.approx(trial_step_s / 2.0)
    assert outcome.blocks == pytest.approx((2.0,) + (trial_step_s, 2.0) * TRIAL_ROUNDS)
    assert outcome.kept == kept
    assert scheduler.step_seconds == pytest.approx(trial_step_s if kept else 2.0)
    # No trial pending: the regular interval, doubled after a rejected bucket trial.
    assert scheduler.next_decision == 10 + TRIAL_STEPS + (10 if kept else 20)
    assert scheduler.rejections == (0 if kept else 1)


@pytest.mark.parametrize(
    "drift, offset, kept",
    [
        # The machine speeds up by 0.5 s a block; the tried modes are 0.1 s slower than
        # the blocks around them. Judged against the window before it, the first tried
        # block (11.6 against 12.0) would keep them.
        (-0.5, 0.1, False),
        # It slows down by 0.5 s a block; the tried modes are 0.1 s faster. Judged
        # against the window before it, the first (4.4 against 4.0 s) would reject them.
        (0.5, -0.1, True),
    ],
    ids=["speeding-up", "slowing-down"],
)
def test_a_machine_that_drifts_during_a_trial_does_not_decide_it(drift, offset, kept):
    link = LinkModel(5e-5, 2e-10)
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], 0.01, every=10)
    start = 12.0 if drift < 0 else 4.0
    blocks = [start + drift * i + (offset if i % 2 else 0.0) for i in range(2 * TRIAL_ROUNDS + 1)]
    assert start_bucket_trial(scheduler, link, [blocks[0]] * 5) == [True]
    after = run_trial(scheduler, link, blocks[1::2], blocks[2::2], 10)
    assert after[-1][0] == [kept]
    (outcome,) = scheduler.trials
    assert outcome.blocks == pytest.approx(blocks)
    logs = [
        math.log(blocks[i] / statistics.mean(blocks[i - 1 : i + 2 : 2]))
        for i in range(1, len(blocks), 2)
    ]
    assert outcome.ratio == pytest.approx(math.exp(statistics.median(logs)))
    assert outcome.kept == kept


@pytest.mark.parametrize(
    "before, tried, kept",
    [
        # One stalled tried block (a neighbour rank took the core): the tried modes are
        # 0.9x, but the geometric mean of the ratios would be 1.64 and reject them.
        ([2.0] * (TRIAL_ROUNDS + 1), [1.8] * (TRIAL_ROUNDS - 1) + [20.0], True),
        # A stall in the last block before: the tried modes are 1.25x, but the
        # geometric mean of the ratios would be 0.82 and keep them.
        ([2.0] * TRIAL_ROUNDS + [20.0], [2.5] * TRIAL_ROUNDS, False),
    ],
    ids=["stall-in-trial", "stall-before"],
)
def test_a_single_stalled_step_does_not_decide_a_trial(before, tried, kept):
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10)
    assert start_bucket_trial(scheduler, link, [2.0, 2.0, 9.0, 2.0, 2.0]) == [True, True]
    after = run_trial(scheduler, link, tried, before[1:], 10)
    assert after[-1][0] == ([True, True] if kept else [False, False])
    (outcome,) = scheduler.trials
    assert outcome.blocks[0] == pytest.approx(2.0)  # the window's stall: its median
    # The geometric mean of the ratios would have decided the other way.
    logs = [math.log(tried[i] / statistics.mean(before[i : i + 2])) for i in range(TRIAL_ROUNDS)]
    assert (statistics.mean(logs) < 0) != kept
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
    step = 10
    for index in range(2 * TRIAL_ROUNDS):
        dense = index % 2 == 0
        choice.observe(dense, 0.1, 0.1)  # the switch's first step: not counted
        if dense:
            choice.observe(True, 9.0)
        else:
            choice.observe(False, 5.0, 2.5e-9 * choice.numel)
        for seconds in (60.0, 10.0 if dense else 6.0):
            scheduler.observe_step(seconds)
        step += TRIAL_BLOCK_STEPS
        last = index == 2 * TRIAL_ROUNDS - 1
        assert scheduler.decide(like=None, step=step) == [False if last else not dense]
    assert scheduler.trials[0].kept is False  # steps were slower: sparse stays
    assert choice.measured_dense == pytest.approx(9.0)
    # With both modes measured, the bucket's own costs propose sparse; dense, measured
    # within TRIAL_FACTOR of it, is explored again after twice the interval (a rejection).
    assert scheduler.next_decision == step + 2 * scheduler.every
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
    assert scheduler.next_decision == 10 + TRIAL_BLOCK_STEPS
    tried, before = [off_step_s] * TRIAL_ROUNDS, [2.0] * TRIAL_ROUNDS
    after = run_trial(scheduler, link, tried, before, 10)
    # Overlap back on after each tried block, off after each block before.
    assert [overlap for _, overlap in after[:-1]] == [True, False] * (TRIAL_ROUNDS - 1) + [True]
    assert all(modes == [False] for modes, _ in after)
    assert scheduler.overlap is (not kept)
    (outcome,) = scheduler.trials
    assert outcome.before == outcome.tried == (False,)
    assert (outcome.overlap_before, outcome.overlap_tried) == (True, False)
    assert outcome.seconds_before == pytest.approx(2.0)
    assert outcome.seconds_tried == pytest.approx(off_step_s)
    assert outcome.kept == kept
    ended = 10 + TRIAL_STEPS
    assert scheduler.next_decision == ended + 10
    # The next regular decision tries the other setting again: conditions may change.
    run_block(scheduler, link, [off_step_s if kept else 2.0], ended + 10)
    assert scheduler.overlap is kept
    assert scheduler.next_decision == ended + 10 + TRIAL_BLOCK_STEPS


def test_a_bucket_trial_is_followed_by_an_overlap_trial():
    link = LinkModel(5e-5, 2e-10)  # loopback: the model lets both buckets try dense
    ops = FakeOps(link, 4)
    scheduler = AutoScheduler(
        ops, "s", None, [(4096, 4), (25_000_000, 4)], 0.01, every=10, overlap=True
    )
    # The bucket proposal goes first, with the overlap unchanged.
    assert start_bucket_trial(scheduler, link, [2.0] * 5) == [True, True]
    assert scheduler.overlap is True
    after = run_trial(scheduler, link, [1.0] * TRIAL_ROUNDS, [2.0] * TRIAL_ROUNDS, 10)
    assert all(overlap is True for _, overlap in after[:-1])
    # Dense is kept, and overlap off is tried at once under the new modes.
    assert after[-1] == ([True, True], False)
    ended = 10 + TRIAL_STEPS
    assert scheduler.next_decision == ended + TRIAL_BLOCK_STEPS
    after = run_trial(scheduler, link, [1.2] * TRIAL_ROUNDS, [1.0] * TRIAL_ROUNDS, ended)
    assert all(modes == [True, True] for modes, _ in after)
    assert [overlap for _, overlap in after[:-1]] == [True, False] * (TRIAL_ROUNDS - 1) + [True]
    assert scheduler.overlap is True  # overlap off was slower: back on
    bucket_trial, overlap_trial = scheduler.trials
    assert bucket_trial.tried == (True, True) and bucket_trial.kept
    assert (bucket_trial.overlap_before, bucket_trial.overlap_tried) == (True, True)
    assert overlap_trial.before == overlap_trial.tried == (True, True)
    assert (overlap_trial.overlap_before, overlap_trial.overlap_tried) == (True, False)
    # Its first block is judged against the bucket trial's dense blocks.
    assert overlap_trial.blocks == pytest.approx((1.0,) + (1.2, 1.0) * TRIAL_ROUNDS)
    assert overlap_trial.seconds_before == pytest.approx(1.0)
    assert not overlap_trial.kept
    assert scheduler.step_seconds == pytest.approx(1.0)
    assert scheduler.next_decision == ended + TRIAL_STEPS + 10


def test_without_overlap_ownership_trials_leave_it_alone():
    link = LinkModel(5e-5, 2e-10)
    scheduler = AutoScheduler(FakeOps(link, 4), "s", None, [(25_000_000, 4)], 0.01, every=10)
    start_bucket_trial(scheduler, link, [2.0])
    after = run_trial(scheduler, link, [1.0] * TRIAL_ROUNDS, [2.0] * TRIAL_ROUNDS, 10)
    assert all(overlap is None for _, overlap in after)
    assert scheduler.trials[0].kept and scheduler.trials[0].overlap_before is None
    assert scheduler.next_decision == 10 + TRIAL_STEPS + 10
