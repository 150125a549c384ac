"""The PyTorch candidate pass on the CPU (chunked; torch's word-wise nonzero, or NumPy on
one or two threads) against the plain definition: every position whose magnitude
reaches the threshold, NaN included."""

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
