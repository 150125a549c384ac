"""common/flush.py on one process: one allreduce per dtype, the tensors laid end to end
in the same order on every rank, and each tensor's sum handed back in its place."""

import torch

from horovod_sparse.common.flush import sum_over_ranks
from tests.unit.test_backends import OneRank, _torch_backend


def test_one_allreduce_per_dtype_and_each_sum_in_its_place():
    ops, _, _ = _torch_backend()
    calls = []
    plain = ops.allreduce_sum_async

    def recorded(tensor, name, process_set):
        calls.append((name, tensor.dtype, tensor.numel()))
        return plain(tensor * 2, name, process_set)  # as if two ranks held the same

    ops.allreduce_sum_async = recorded
    tensors = [
        torch.arange(3, dtype=torch.float32),
        torch.arange(4, dtype=torch.float64),
        torch.arange(5, dtype=torch.float32) + 10,
    ]
    sums = sum_over_ranks(ops, tensors, OneRank(), "flush")
    assert sorted(calls) == [("flush.0", torch.float32, 8), ("flush.1", torch.float64, 4)]
    for tensor, total in zip(tensors, sums):
        assert total.dtype == tensor.dtype
        assert torch.equal(total, tensor * 2)
