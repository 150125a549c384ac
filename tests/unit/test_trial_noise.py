"""benchmarks/trial_noise.py: blocks, ratios and trial verdicts are read off a run's steps
as a trial of scheduler="auto" forms them (each block's first step not counted)."""

import math

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def noise():
    return load_script("benchmarks/trial_noise.py")


def test_a_block_is_the_median_of_its_steps_after_the_first(noise):
    dense = [True] * 3 + [False] * 3 + [True] * 3 + [False] * 2
    # Switch steps of 9 s are not counted; the last block is cut off by the run's end.
    seconds = [9.0, 1.0, 3.0, 9.0, 2.0, 2.0, 9.0, 1.0, 1.0, 9.0, 5.0]
    assert noise.block_times(seconds, dense, warmup=0) == [(True, 2.0), (False, 2.0), (True, 1.0)]
    # The warm-up's steps are left out, and a block cut by it has no step counted.
    assert noise.block_times(seconds, dense, warmup=4) == [(False, 2.0), (True, 1.0)]


def test_a_ratio_is_a_sparse_block_over_the_dense_blocks_either_side(noise):
    blocks = [(True, 2.0), (False, 3.0), (True, 4.0), (False, 6.0), (True, 4.0), (False, 1.0)]
    assert noise.ratios(blocks) == pytest.approx([1.0, 1.5])


def test_verdicts_by_median_and_geometric_mean(noise):
    values = [0.5, 0.5, 8.0, 2.0]
    assert noise.verdicts(values, 3, "median") == pytest.approx([0.5, 2.0])
    # (0.5 * 0.5 * 8 * 2) ** (1 / 4)
    assert noise.verdicts(values, 4, "geometric mean") == pytest.approx([math.sqrt(2.0)])


def test_windows_on_the_wrong_side_of_the_whole_run_are_counted(noise):
    # Sparse blocks at 1.2 s between dense ones at 1.0 s, but one slow dense block
    # (2.0 s) makes the two ratios beside it 0.8: windows that hold them fall below 1.
    dense_s = [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    seconds, flags = [], []
    for d in dense_s:
        seconds += [9.0, d, 9.0, 1.2]
        flags += [True, True, False, False]
    seconds += [9.0, 1.0, 9.0]  # the last dense block, ended by a switch
    flags += [True, True, False]
    result = {"block": 2, "seconds": seconds, "dense": flags, "warmup": 0}
    rows = {(r["rule"], r["trial_ratios"]): r for r in noise.summarize(result)}
    median_2 = rows[("median", 2)]
    assert median_2["ratios"] == 6
    assert median_2["whole_run"] == pytest.approx(1.2)
    # Ratios 1.2, 0.8, 0.8, 1.2, 1.2, 1.2: of the five windows of two, (1.2, 0.8),
    # (0.8, 0.8) and (0.8, 1.2) fall below 1 (the median of two: their geometric mean).
    assert median_2["lowest"] == pytest.approx(0.8)
    assert median_2["wrong_side"] == pytest.approx(3 / 5)
    assert rows[("median", 4)]["lowest"] == pytest.approx(math.sqrt(0.8 * 1.2))
