"""TF's host kernels (the candidate pass, the bucket gather): NumPy on the host (eagerly
on a view of the tensor, traced through ``tf.numpy_function``) or TF's own ops, against
the plain definition, and when a process runs which; and the owner's merge of the
ranks' runs."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

import horovod_sparse.tensorflow.kernels as kernels
import horovod_sparse.tensorflow.row_sums as row_sums
from horovod_sparse.common.host_candidates import CANDIDATE_CHUNK
from horovod_sparse.tensorflow.backend import TFBackend


@pytest.mark.parametrize("host_pass", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_both_passes_equal_the_definition_over_several_chunks(monkeypatch, host_pass, dtype):
    monkeypatch.setattr(kernels, "HOST_PASS", host_pass)
    rng = np.random.default_rng(3)
    numel = 2 * CANDIDATE_CHUNK + 12_345  # three chunks, the last ragged
    values = rng.standard_normal(numel).astype(dtype)
    values[rng.choice(numel, 50, replace=False)] = np.nan
    values[rng.choice(numel, 50, replace=False)] = np.inf
    values[rng.choice(numel, 50, replace=False)] = -np.inf
    threshold = np.array(2.5, dtype)
    expected = np.flatnonzero(~(np.abs(values) < threshold))
    tensor, limit = tf.constant(values), tf.constant(threshold)
    traced = tf.function(kernels.indices_at_least)
    for got in (kernels.indices_at_least(tensor, limit), traced(tensor, limit)):
        assert got.dtype == tf.int64
        np.testing.assert_array_equal(got.numpy(), expected)


def test_the_host_pass_leaves_its_input_and_earlier_results_alone(monkeypatch):
    monkeypatch.setattr(kernels, "HOST_PASS", True)
    values = np.random.default_rng(4).standard_normal(5000).astype(np.float32)
    tensor = tf.constant(values)
    first = kernels.indices_at_least(tensor, tf.constant(1.0))
    kept = first.numpy().copy()
    second = kernels.indices_at_least(tensor, tf.constant(0.5))
    np.testing.assert_array_equal(first.numpy(), kept)
    assert second.shape[0] > first.shape[0]
    np.testing.assert_array_equal(tensor.numpy(), values)


@pytest.mark.parametrize(
    ("cores", "local_ranks", "intra_op", "expected"),
    [
        (2, 2, 0, True),  # 2 ranks sharing 2 cores
        (16, 2, 0, False),  # 8 cores a rank: TF's parallel ops
        (16, 2, 1, True),  # one intra-op thread set by the user
        (16, 8, 0, True),  # 2 cores a rank
    ],
)
def test_the_host_pass_serves_processes_with_at_most_two_threads(
    monkeypatch, cores, local_ranks, intra_op, expected
):
    monkeypatch.setattr(kernels, "HOST_PASS", None)
    monkeypatch.setattr(kernels, "cores_available", lambda: cores)
    monkeypatch.setattr(kernels, "local_ranks_from_environment", lambda: local_ranks)
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: intra_op)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: [])
    assert kernels.host_pass_fits(tf.zeros([4])) is expected
    # A GPU in TF's view: never.
    monkeypatch.setattr(kernels, "HOST_PASS", None)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: ["GPU:0"])
    assert kernels.host_pass_fits(tf.zeros([4])) is False
    # A dtype NumPy lacks: TF's ops, whatever the process.
    monkeypatch.setattr(kernels, "HOST_PASS", True)
    assert kernels.host_pass_fits(tf.zeros([4], tf.bfloat16)) is False


@pytest.mark.parametrize("host_pass", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_both_gathers_take_the_values_at_the_indices(monkeypatch, host_pass, dtype):
    monkeypatch.setattr(kernels, "HOST_PASS", host_pass)
    rng = np.random.default_rng(5)
    values = rng.standard_normal(CANDIDATE_CHUNK + 777).astype(dtype)
    values[[3, 10]] = [np.nan, -np.inf]
    for indices in (
        np.sort(rng.choice(values.size, 4000, replace=False)),
        np.array([3, 10, values.size - 1, 0]),  # not ascending, non-finite values
        np.array([], dtype=np.int64),
    ):
        tensor, at = tf.constant(values), tf.constant(indices.astype(np.int64))
        for got in (
            kernels.bucket_gather(tensor, at),
            tf.function(kernels.bucket_gather)(tensor, at),
        ):
            assert got.dtype == tensor.dtype
            np.testing.assert_array_equal(got.numpy(), values[indices])
        np.testing.assert_array_equal(tensor.numpy(), values)  # the input is left alone


@pytest.mark.parametrize("lengths", [(3, 0, 5), (0, 0), (4000, 3000, 5000, 100), (7,)])
def test_both_merges_give_the_distinct_indices_and_each_rows_position(lengths):
    rng = np.random.default_rng(sum(lengths))
    # Each run distinct and ascending (one rank's rows), the runs overlapping.
    runs = [np.sort(rng.choice(3 * max(lengths) + 1, n, replace=False)) for n in lengths]
    indices = np.concatenate(runs).astype(np.int64)
    expected_distinct, expected_position = np.unique(indices, return_inverse=True)
    known = tf.constant(np.array(lengths, dtype=np.int32))
    traced = tf.function(row_sums.unique_inverse)
    for distinct, position in (
        row_sums.unique_inverse(tf.constant(indices), known),
        traced(tf.constant(indices), known),
        row_sums.unique_inverse(tf.constant(indices), None),
    ):
        assert (distinct.dtype, position.dtype) == (tf.int64, tf.int64)
        np.testing.assert_array_equal(distinct.numpy(), expected_distinct)
        np.testing.assert_array_equal(position.numpy(), expected_position.ravel())


@pytest.mark.parametrize("host_pass", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("lengths", [(3, 0, 5), (0, 0), (4000, 3000, 5000, 100)])
def test_both_row_sums_add_each_index_in_row_order(monkeypatch, host_pass, dtype, lengths):
    monkeypatch.setattr(kernels, "HOST_PASS", host_pass)
    rng = np.random.default_rng(sum(lengths) + 7)
    runs = [np.sort(rng.choice(2 * max(lengths) + 1, n, replace=False)) for n in lengths]
    indices = np.concatenate(runs).astype(np.int64)
    values = rng.standard_normal(indices.size).astype(dtype)
    # The definition: each distinct index's rows added one by one, in row order, in
    # the bucket's dtype (so the sums are the same bits whichever kernel adds them).
    expected_distinct = np.unique(indices)
    expected = np.zeros(expected_distinct.size, dtype)
    where = np.searchsorted(expected_distinct, indices)
    for row, position in enumerate(where):
        expected[position] = dtype(expected[position] + values[row])
    like = tf.zeros([1], dtype)
    known = tf.constant(np.array(lengths, dtype=np.int64))

    def summed(i: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return TFBackend().sum_rows(i, v, like, known)

    traced = tf.function(summed)
    for distinct, sums in (
        summed(tf.constant(indices), tf.constant(values)),
        traced(tf.constant(indices), tf.constant(values)),
    ):
        assert (distinct.dtype, sums.dtype) == (tf.int64, tf.as_dtype(dtype))
        np.testing.assert_array_equal(distinct.numpy(), expected_distinct)
        np.testing.assert_array_equal(sums.numpy(), expected)


def _selection_inputs(numel: int, k: int) -> list[np.ndarray]:
    """Accumulators that take each path of the threshold selection in turn: a count in
    the band, above it (trimmed), below it (estimated again), and with a misleading
    sample (exact topk as the last resort), and NaN among the values."""
    rng = np.random.default_rng(8)
    plain = rng.standard_normal(numel).astype(np.float32)
    # Distinct small magnitudes (no ties, whose order topk leaves to the framework).
    misleading = rng.uniform(0.0, 1e-3, numel).astype(np.float32)
    stride = numel // 1280  # the sample's stride at this numel and k (sample_length)
    # The sample's offset is the call count: 3 at this, the fourth call, 4 when the
    # threshold is estimated again.
    misleading[np.arange(300) * stride + 3] = 1.0
    misleading[np.arange(300) * stride + 4] = 2.0
    with_nan = plain.copy()
    with_nan[rng.choice(numel, 7, replace=False)] = np.nan
    return [plain, 2.0 * plain, 0.1 * plain, misleading, plain[::-1].copy(), with_nan]


def _selections(ops, accumulators, k, reestimate_steps, step=None, convert=tf.constant):
    """Each call's (indices, values, state) of one ThresholdSelection over ``accumulators``."""
    from horovod_sparse.common.selection import ThresholdSelection

    selection = ThresholdSelection(reestimate_steps=reestimate_steps)
    selection.bind(ops, convert(accumulators[0]))

    def select(values):
        return selection.select_values(ops, values, k)

    calls = []
    for values in accumulators:
        indices, taken = (step or (lambda f: f))(select)(convert(values))
        state = {name: np.asarray(value) for name, value in selection.state_dict().items()}
        calls.append((np.asarray(indices), np.asarray(taken), state))
    return calls


@pytest.mark.parametrize("reestimate_steps", [1, 3])
@pytest.mark.parametrize("traced", [False, True])
def test_the_one_host_call_selection_equals_the_kernels_call_by_call(
    monkeypatch, reestimate_steps, traced
):
    """TF's one host call against TF's kernels and torch's selection (the reference): the
    same indices, values and state at every call. With a NaN in the estimate's sample
    TF's ``NthElement`` orders it as it happens to (here two more candidates than torch);
    the host call counts it the largest, as torch does, so that call (the last: the
    state it leaves differs too) is checked against torch alone."""
    import torch

    from horovod_sparse.torch.backend import TorchBackend

    numel, k = 10_000, 2000
    accumulators = _selection_inputs(numel, k)
    reference = _selections(
        TorchBackend(), accumulators, k, reestimate_steps, convert=torch.from_numpy
    )
    runs = {}
    for host_pass in (False, True):
        monkeypatch.setattr(kernels, "HOST_PASS", host_pass)
        step = tf.function if traced else None
        runs[host_pass] = _selections(TFBackend(), accumulators, k, reestimate_steps, step)
    for call, values in enumerate(accumulators):
        expected = [reference[call]] + ([] if np.isnan(values).any() else [runs[False][call]])
        host_indices, host_values, host_state = runs[True][call]
        for indices, taken, state in expected:
            np.testing.assert_array_equal(host_indices, indices, err_msg=f"call {call}")
            np.testing.assert_array_equal(host_values, taken, err_msg=f"call {call}")
            for name in state:
                np.testing.assert_array_equal(host_state[name], state[name], err_msg=name)
        # Within the band (exactly k where the last resort ran), ascending, the values
        # those of the accumulator.
        assert 0.8 * k <= host_indices.size <= 1.25 * k
        assert np.all(np.diff(host_indices) > 0)
        np.testing.assert_array_equal(host_values, values[host_indices])
    # The misleading sample reached the exact topk: its 600 large entries and the
    # largest small ones, k in all.
    misleading = runs[True][3][0]
    assert misleading.size == k
    assert np.count_nonzero(accumulators[3][misleading] >= 1.0) == 600
