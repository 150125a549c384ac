"""The DDP hook averages a sparse bucket's small parameters (under ``min_sparse_numel``:
biases, norms) densely, as the Horovod optimizer reduces small tensors, while the rest of
the bucket goes sparse; every entry's mass is kept. Under torchrun at 2, 3 and 4 ranks."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.common.stats import allreduce_ring_bytes
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
            # Their allreduce's ring bytes, and their entries, on top of the exchange's.
            exchange, stats = state.reducers[0].last_stats(), state.stats()
            sent, received = allreduce_ring_bytes(BIASES, SIZE, 4)
            assert stats.bytes_sent == exchange.bytes_sent + sent
            assert stats.bytes_received == exchange.bytes_received + received
            assert stats.selected == exchange.selected + BIASES <= stats.numel
        else:  # in the bucket's top-k with the weight: most bias entries wait
            assert np.count_nonzero(model.module.bias.grad.numpy()) < BIASES
        # Every entry: the residuals after plus P times the average are what was owed.
        owed = np.sum(gather(before + recorded.grads), axis=0)
        kept_and_sent = np.sum(gather(residual), axis=0) + SIZE * result
        np.testing.assert_allclose(kept_and_sent, owed, atol=1e-4)
        before = residual


def small_mask(sizes: list[int]) -> np.ndarray:
    return np.concatenate([np.full(n, n < 1024) for n in sizes])


def make(state: SparseState) -> tuple[DistributedDataParallel, Recorded]:
    model = DistributedDataParallel(WeightAndBias())
    recorded = Recorded()
    model.register_comm_hook(state, recorded.hook)
    return model, recorded


def in_parameter_order(vector, sizes: list[int]) -> np.ndarray:
    """A bucket-ordered vector as weight then bias (DDP's first iteration and its
    rebuilt bucket order the two parameters differently)."""
    vector = np.asarray(vector)
    return np.concatenate([vector[BIASES:], vector[:BIASES]]) if sizes[0] == BIASES else vector


def test_a_residual_kept_at_small_parameters_goes_with_their_average_once():
    """A state saved while the bias went through the top-k (``min_sparse_numel=1``)
    holds residual there; loaded where small parameters are averaged densely, that
    residual is sent with them at the next step, once, and none is left behind."""
    saving = SparseState(density=0.02, min_sparse_numel=1)
    model, recorded = make(saving)
    for step in range(3):
        model.zero_grad()
        model(local_grad(step)).backward()
    kept_order = recorded.sizes  # the residual's: the rebuilt bucket's
    before = in_parameter_order(saving.reducers[0].residual, kept_order)
    bias = np.arange(WEIGHTS + BIASES) >= WEIGHTS
    assert before[bias].any(), "expected residual at the bias"
    state = SparseState(density=0.02)
    state.load_state_dict(saving.state_dict())
    model, recorded = make(state)
    model.zero_grad()
    model(local_grad(3)).backward()
    residual = in_parameter_order(state.reducers[0].residual, kept_order)
    result = in_parameter_order(recorded.result, recorded.sizes)
    grads = in_parameter_order(recorded.grads, recorded.sizes)
    assert not residual[bias].any()
    owed = gather(torch.from_numpy(before + grads))
    np.testing.assert_allclose(result[bias], np.mean(owed, axis=0)[bias], atol=1e-5)
    np.testing.assert_allclose(model.module.bias.grad.numpy(), result[bias], atol=0)
    kept_and_sent = np.sum(gather(torch.from_numpy(residual)), axis=0) + SIZE * result
    np.testing.assert_allclose(kept_and_sent, np.sum(owed, axis=0), atol=1e-4)


@pytest.mark.parametrize("density", [0.02, 0.995])
def test_dense_steps_count_each_entry_once_and_the_bias_keeps_its_momentum(density):
    """Warm-up (dense steps of a sparse bucket), then sparse steps, with momentum in the
    hook: ``stats()`` never counts an entry twice, and the bias's velocity is momentum
    SGD's own, ``u = m u + g`` of its gradients, whatever the exchange selected (at
    density 0.995 the top-k must take some of the bias's zeros, whose velocity momentum
    factor masking would otherwise reset)."""
    momentum = 0.9
    state = SparseState(density=density, warmup_steps=2, momentum=momentum)
    model, recorded = make(state)
    velocity = np.zeros(BIASES, np.float32)
    kinds = set()
    for step in range(6):
        model.zero_grad()
        grad = local_grad(step)
        model(grad).backward()
        velocity = momentum * velocity + grad[WEIGHTS:].numpy()
        if step == 0:
            continue
        stats = state.stats()
        kinds.add(state.reducers[0].last_stats().sparse_buckets)
        assert stats.numel == WEIGHTS + BIASES and stats.selected <= stats.numel
        assert stats.density <= 1.0
        small = small_mask(recorded.sizes)
        bias_velocity = state.velocity[0].numpy()[small]
        np.testing.assert_allclose(bias_velocity, velocity, rtol=1e-5, atol=1e-5)
    assert kinds == {0, 1}, "expected dense and sparse steps"


class Biases(torch.nn.Module):
    """A bucket over ``min_sparse_numel`` made of small parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.biases = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(BIASES)) for _ in range(5)
        )

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return sum((b * g).sum() for b, g in zip(self.biases, grad.split(BIASES)))


def test_a_bucket_of_small_parameters_only_is_averaged_densely():
    state = SparseState(density=0.02)
    model = DistributedDataParallel(Biases())
    model.register_comm_hook(state, sparse_allreduce_hook)
    for step in range(3):
        model.zero_grad()
        grad = local_grad(step)[: 5 * BIASES]
        model(grad).backward()
        mean = np.mean(gather(grad), axis=0)
        got = torch.cat([b.grad for b in model.module.biases]).numpy()
        np.testing.assert_allclose(got, mean, atol=1e-6)
        assert state.stats().sparse_buckets == 0 and not state.reducers
