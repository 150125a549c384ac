"""The PyTorch candidate pass on the CPU (chunked; torch's word-wise nonzero, or NumPy on
one or two threads) against the plain definition: every position whose magnitude
reaches the threshold, NaN included."""

import threading

import numpy as np
import pytest
import torch

import horovod_sparse.torch.candidates as candidates
import horovod_sparse.torch.kernels as torch_kernels


@pytest.mark.parametrize("chunk", [8, 24, 1 << 20])  # many chunks, a ragged last one, one
@pytest.mark.parametrize("numel", [1, 7, 64, 1003, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("numpy_threads", [0, 1 << 10])  # torch's pass; NumPy's (not bf16)
def test_cpu_candidates_equal_the_definition(monkeypatch, chunk, numel, dtype, numpy_threads):
    monkeypatch.setattr(candidates, "_CANDIDATE_CHUNK", chunk)
    monkeypatch.setattr(candidates, "_NUMPY_CHUNK", chunk)
    monkeypatch.setattr(candidates, "_NUMPY_CANDIDATE_THREADS", numpy_threads)
    rng = np.random.default_rng(numel + chunk)
    values = torch.from_numpy(rng.standard_normal(numel)).to(dtype)
    values[:: max(1, numel // 5)] = float("nan")
    if numel > 3:
        values[3] = -float("inf")
    if numel > 5:
        values[4], values[5] = 1.0, -1.0  # exactly at the threshold: selected
    threshold = torch.tensor(1.0, dtype=dtype)
    calls = []
    numpy_pass = candidates._numpy_indices_at_least
    monkeypatch.setattr(
        candidates, "_numpy_indices_at_least", lambda *a: calls.append(1) or numpy_pass(*a)
    )
    got = torch_kernels.TorchKernels().indices_at_least(values, threshold)
    assert len(calls) == (numpy_threads > 0 and dtype != torch.bfloat16)
    magnitudes = values.abs()
    expected = ((magnitudes >= threshold) | torch.isnan(values)).nonzero().view(-1)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


def test_nonzero_by_words_equals_nonzero():
    rng = np.random.default_rng(0)
    for density in (0.0, 0.01, 0.5, 1.0):
        mask = torch.from_numpy(rng.random(8 * 1000) < density)
        assert torch.equal(candidates._nonzero_by_words(mask), mask.nonzero().view(-1))


@pytest.mark.parametrize("numpy_threads", [0, 1 << 10])
def test_kept_scratch_leaves_earlier_results_alone(monkeypatch, numpy_threads):
    """The pass keeps its scratch between calls: buckets of other sizes and dtypes, and
    other threads, still get the definition's answer, and a result is never overwritten
    by a later call."""
    monkeypatch.setattr(candidates, "_CANDIDATE_CHUNK", 64)
    monkeypatch.setattr(candidates, "_NUMPY_CHUNK", 64)
    monkeypatch.setattr(candidates, "_NUMPY_CANDIDATE_THREADS", numpy_threads)
    kernels = torch_kernels.TorchKernels()
    rng = np.random.default_rng(7)
    threshold = 1.0

    def expected(values):
        return ((values.abs() >= threshold) | torch.isnan(values)).nonzero().view(-1)

    calls = []
    for numel, dtype in [(40, torch.float32), (200, torch.float32), (16, torch.float64)] * 2:
        values = torch.from_numpy(rng.standard_normal(numel)).to(dtype)
        got = kernels.indices_at_least(values, torch.tensor(threshold, dtype=dtype))
        calls.append((values, got, got.clone()))
    for values, got, copy in calls:
        assert torch.equal(got, copy)  # not overwritten by any later call
        assert torch.equal(got, expected(values))

    results = {}

    def in_thread(seed):
        values = torch.from_numpy(np.random.default_rng(seed).standard_normal(500)).float()
        for _ in range(20):
            got = kernels.indices_at_least(values, torch.tensor(threshold))
            assert torch.equal(got, expected(values))
        results[seed] = True

    threads = [threading.Thread(target=in_thread, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1, 2, 3]
