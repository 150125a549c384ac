"""The DDP hook's Adam correction (``SparseState(betas=..., eps=...)`` with
``SGD(params, lr, weight_decay=wd)``): against AdamW's decay and the averaged Adam
direction from their definition where every rank has the same gradient, against each
rank's own direction with the mass invariant where they differ, and through a
checkpoint (launched by torchrun, Gloo)."""

import io
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook
from tests.ddp_models import Exact, SmallNet, gather

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
BETAS, EPS, LR, WD = (0.9, 0.999), 1e-8, 1e-2, 0.05


def batch(step: int, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + (0 if same else RANK))
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def make_run(state):
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallNet(), bucket_cap_mb=0.03)  # several buckets
    model.register_comm_hook(state, sparse_allreduce_hook)
    return model, torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)


def train(model, optimizer, steps, same=False):
    for step in steps:
        x, y = batch(step, same)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def averaged_adam_direction(first, second, t):
    """Adam's bias-corrected direction normalized for the average of SIZE ranks'
    gradients: m_hat / (sqrt(v) + eps), v = v_hat / P + (1 - 1/P) min(m_hat^2, v_hat)."""
    m_hat, v_hat = first / (1 - BETAS[0] ** t), second / (1 - BETAS[1] ** t)
    v = v_hat / SIZE + (1 - 1 / SIZE) * torch.minimum(m_hat * m_hat, v_hat)
    return m_hat / (v.sqrt() + EPS)


def test_at_density_one_with_one_gradient_on_every_rank_it_is_the_averaged_adamw():
    """At density 1 with the same gradient on every rank, each parameter follows AdamW's
    decoupled decay (SGD's weight decay) plus -lr times the averaged Adam direction,
    from its definition, across DDP's first iteration and its bucket rebuild."""
    torch.manual_seed(0)
    reference = SmallNet()  # make_run's initial weights
    moments = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in reference.parameters()}
    state = SparseState(density=1.0, betas=BETAS, eps=EPS, min_sparse_numel=0)
    hooked, sgd = make_run(state)
    for step in range(6):
        x, y = batch(step, same=True)
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        with torch.no_grad():
            for p, (first, second) in moments.items():
                first.mul_(BETAS[0]).add_(p.grad, alpha=1 - BETAS[0])
                second.mul_(BETAS[1]).addcmul_(p.grad, p.grad, value=1 - BETAS[1])
                p.mul_(1 - LR * WD).sub_(LR * averaged_adam_direction(first, second, step + 1))
        train(hooked, sgd, [step], same=True)
        torch.testing.assert_close(flat(hooked), flat(reference), rtol=1e-5, atol=1e-6)
    moments = state.state_dict()["adam_moments"]  # cut from the whole first bucket's
    assert len(moments) >= 2 and -1 not in moments


def test_the_exchange_carries_each_ranks_adam_direction_and_keeps_its_mass():
    numel, density = 20_000, 0.02
    state = SparseState(density=density, betas=BETAS, eps=EPS)
    model = DistributedDataParallel(Exact(numel))
    model.register_comm_hook(state, sparse_allreduce_hook)
    first, second = torch.zeros(numel), torch.zeros(numel)
    residual = np.zeros(numel, np.float32)
    for step in range(6):
        rng = np.random.default_rng(1000 * step + RANK)
        grad = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
        first.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
        second.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
        t = step + 1
        direction = averaged_adam_direction(first, second, t)
        model.zero_grad()
        model(grad).backward()
        got = model.module.weight.grad.detach().numpy().copy()
        if step == 0:  # DDP's first iteration: the plain average of the directions
            mean = np.mean(gather(direction), axis=0)
            np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-6)
            continue
        after = state.reducers[0].residual.numpy().copy()
        owed = np.sum(gather(torch.from_numpy(residual) + direction), axis=0)
        kept = np.sum(gather(torch.from_numpy(after)), axis=0)
        np.testing.assert_allclose(kept + SIZE * got, owed, rtol=1e-5, atol=1e-4)
        assert 0 < np.count_nonzero(got) < numel // 4
        for row in gather(torch.from_numpy(got)):
            np.testing.assert_array_equal(row, got)
        residual = after


@pytest.mark.parametrize("restore", ["state_dict", "pickle"])
def test_a_checkpoint_of_the_moments_resumes_exactly(restore):
    state = SparseState(density=0.05, betas=BETAS, eps=EPS, min_sparse_numel=5000)
    model, optimizer = make_run(state)
    train(model, optimizer, range(4))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, saved)
    pickled = pickle.dumps(state)
    assert {len(m) for m in state.state_dict()["adam_moments"].values()} == {2}
    train(model, optimizer, range(4, 8))
    uninterrupted = flat(model)

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    if restore == "pickle":
        resumed_state = pickle.loads(pickled)
    else:
        resumed_state = SparseState(density=0.05, betas=BETAS, eps=EPS, min_sparse_numel=5000)
        resumed_state.load_state_dict(checkpoint["hook"])
    resumed, resumed_optimizer = make_run(resumed_state)
    resumed.load_state_dict(checkpoint["model"])
    train(resumed, resumed_optimizer, range(4, 8))  # plain SGD: no state of its own
    assert torch.equal(flat(resumed), uninterrupted)

    with pytest.raises(ValueError, match="saved with Adam's moments"):
        SparseState(density=0.05, momentum=0.9).load_state_dict(checkpoint["hook"])


def test_bad_adam_options_are_refused():
    for bad in ((0.9,), (0.9, 1.0), "ab", 0.9, (0.9, -0.1)):
        with pytest.raises(ValueError, match="betas"):
            SparseState(betas=bad)
    with pytest.raises(ValueError, match="give one of them"):
        SparseState(momentum=0.9, betas=BETAS)
    with pytest.raises(ValueError, match="eps"):
        SparseState(betas=BETAS, eps=0.0)
