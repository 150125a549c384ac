"""The DDP hook averages a sparse bucket's small parameters (under ``min_sparse_numel``:
biases, norms) densely, as the Horovod optimizer reduces small tensors, while the rest of
the bucket goes sparse; every entry's mass is kept. Under torchrun at 2, 3 and 4 ranks."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook
from tests.ddp_models import gather

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
WEIGHTS, BIASES = 20_000, 300


class WeightAndBias(torch.nn.Module):
    """Gradients chosen exactly: a large weight and a small bias in one DDP bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(WEIGHTS))
        self.bias = torch.nn.Parameter(torch.zeros(BIASES))

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad[:WEIGHTS]).sum() + (self.bias * grad[WEIGHTS:]).sum()


def local_grad(step: int) -> torch.Tensor:
    rng = np.random.default_rng(1000 * step + RANK)
    return torch.from_numpy(rng.standard_normal(WEIGHTS + BIASES).astype(np.float32))


class Recorded:
    """The bucket as the hook received it, its parameters' sizes in bucket order, and
    the average it returned."""

    def hook(self, state: SparseState, bucket: dist.GradBucket):
        self.grads = bucket.buffer().clone()
        self.sizes = [p.numel() for p in bucket.parameters()]

        def keep(future):
            self.result = future.value().clone()
            return future.value()

        return sparse_allreduce_hook(state, bucket).then(keep)


@pytest.mark.parametrize("min_sparse_numel", [1024, 1])
def test_small_parameters_of_a_sparse_bucket_are_averaged_densely(min_sparse_numel):
    state = SparseState(density=0.02, min_sparse_numel=min_sparse_numel)
    model = DistributedDataParallel(WeightAndBias())
    recorded = Recorded()
    model.register_comm_hook(state, recorded.hook)
    before = torch.zeros(WEIGHTS + BIASES)
    for step in range(5):
        model.zero_grad()
        grad = local_grad(step)
        model(grad).backward()
        bias_mean = np.mean(gather(grad[WEIGHTS:]), axis=0)
        if step == 0:  # DDP's first iteration: the plain average, nothing kept
            continue
        assert state.stats().sparse_buckets == 1
        small = np.concatenate([np.full(n, n < min_sparse_numel) for n in recorded.sizes])
        result, residual = recorded.result.numpy(), state.reducers[0].residual.clone()
        assert np.count_nonzero(result[~small]) < (~small).sum()  # the weight: sparse
        if min_sparse_numel > BIASES:
            # The bias: every rank's entries, averaged, as DDP's allreduce; nothing kept.
            np.testing.assert_allclose(model.module.bias.grad.numpy(), bias_mean, atol=1e-6)
            np.testing.assert_allclose(result[small], bias_mean, atol=1e-6)
            assert small.sum() == BIASES and not residual.numpy()[small].any()
            assert state.stats().selected >= BIASES
        else:  # in the bucket's top-k with the weight: most bias entries wait
            assert np.count_nonzero(model.module.bias.grad.numpy()) < BIASES
        # Every entry: the residuals after plus P times the average are what was owed.
        owed = np.sum(gather(before + recorded.grads), axis=0)
        kept_and_sent = np.sum(gather(residual), axis=0) + SIZE * result
        np.testing.assert_allclose(kept_and_sent, owed, atol=1e-4)
        before = residual
