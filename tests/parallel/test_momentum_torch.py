"""Momentum correction: dense-equivalent at density 1, exact against the reference below it."""

import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.common.config import budget
from tests.reference import reference_step, uniform_boundaries

hvd.init()


def mlp() -> torch.nn.Module:
    torch.manual_seed(42)  # identical initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def train(model, opt, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(7919 * step + 31 * hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


SGD_SETTINGS = {
    "momentum": dict(momentum=0.9),
    "nesterov_wd": dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
    "dampening_maximize": dict(momentum=0.8, dampening=0.1, maximize=True),
}


@pytest.mark.parametrize("settings", SGD_SETTINGS.values(), ids=SGD_SETTINGS.keys())
def test_correction_at_density_one_equals_dense_momentum_sgd(settings):
    sparse_model, dense_model = mlp(), mlp()
    sparse_opt = hvds.DistributedOptimizer(
        torch.optim.SGD(sparse_model.parameters(), lr=0.05, **settings),
        sparse_model.named_parameters(),
        density=1.0,
        momentum_correction=True,
    )
    assert sparse_opt.momentum_correction
    dense_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(dense_model.parameters(), lr=0.05, **settings),
        dense_model.named_parameters(),
    )
    train(sparse_model, sparse_opt, 15)
    train(dense_model, dense_opt, 15)
    for p, q in zip(sparse_model.parameters(), dense_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # The wrapped SGD's own settings are back after every step.
    group = sparse_opt.param_groups[0]
    assert group["momentum"] == settings["momentum"]
    assert group["weight_decay"] == settings.get("weight_decay", 0.0)


def test_auto_turns_on_for_sparse_momentum_sgd_only():
    model = mlp()
    on = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    plain = hvds.DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1))
    rmsprop = hvds.DistributedOptimizer(torch.optim.RMSprop(mlp().parameters()))
    dense = hvds.DistributedOptimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9), density=1.0
    )
    off = hvds.DistributedOptimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9), momentum_correction=False
    )
    assert on.momentum_correction
    assert not any(o.momentum_correction for o in (plain, rmsprop, dense, off))


def test_corrected_updates_match_reference_and_mask_velocity():
    """The exchange carries m * velocity + grad; sent entries leave the velocity."""
    torch.manual_seed(1)
    model = torch.nn.Linear(100, 200, bias=False)  # one bucket of 20000
    density, numel, momentum = 0.02, 20_000, 0.9
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0, momentum=momentum),
        model.named_parameters(),
        density=density,
        selection="exact",
        global_selection="exact",  # the reference selects exactly
    )
    (name,) = opt.residuals()
    k = budget(numel, density)
    residual, velocity = torch.zeros(numel), torch.zeros(numel)
    masked_total = 0
    for step in range(6):
        g = torch.Generator().manual_seed(step * 17 + hvd.rank())
        x, c = torch.randn(8, 100, generator=g), torch.randn(8, 200, generator=g)
        opt.zero_grad()
        (model(x) * c).sum().backward()
        grad = (c.t() @ x).reshape(-1)
        update = grad.clone() if step == 0 else momentum * velocity + grad
        acc = residual + update
        everyone = hvd.allgather(acc.reshape(1, -1), name=f"mc.acc.{step}")
        opt.synchronize()
        ref = reference_step(
            [a.numpy() for a in everyone], k, uniform_boundaries(numel, hvd.size())
        )
        got = model.weight.grad.reshape(-1).numpy()
        np.testing.assert_array_equal(np.flatnonzero(got), ref.selected)
        np.testing.assert_allclose(got, ref.result_sum / hvd.size(), rtol=1e-5, atol=1e-6)
        residual = opt.residuals()[name].clone()
        np.testing.assert_allclose(
            residual.numpy(), ref.residuals[hvd.rank()], rtol=1e-5, atol=1e-5
        )
        # Momentum factor masking: this rank's locally selected entries leave the velocity.
        sent = np.argsort(-np.abs(acc.numpy()), kind="stable")[:k]
        expected_velocity = update.clone()
        expected_velocity[sent] = 0
        velocity = opt.velocities()[name].clone()
        np.testing.assert_allclose(
            velocity.numpy(), expected_velocity.numpy(), rtol=1e-6, atol=1e-6
        )
        masked_total += int((velocity == 0).sum())
        with opt.skip_synchronize():
            opt.step()
    assert masked_total >= 6 * k


def test_checkpoint_carries_velocities():
    def make():
        model = mlp()
        opt = hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model.named_parameters(),
            density=0.05,
        )
        return model, opt

    model_a, opt_a = make()
    train(model_a, opt_a, 5)
    # As with any torch optimizer, state_dict() holds the live state tensors (Horovod's
    # broadcast_optimizer_state writes into them): a snapshot is a copy.
    saved = copy.deepcopy(opt_a.state_dict())
    # The velocity is SGD's own momentum_buffer in the torch state: one per corrected
    # parameter, holding exactly the flat velocity's values.
    corrected = [p for p in model_a.parameters() if p.numel() >= 1024]
    assert corrected and opt_a.velocities()
    flat_velocity = torch.cat([v for _, v in sorted(opt_a.velocities().items())])
    buffers = [opt_a.state[p]["momentum_buffer"] for p in corrected]
    assert sorted(b.numel() for b in buffers) == sorted(p.numel() for p in corrected)
    assert sum(b.numel() for b in buffers) == flat_velocity.numel()
    index = {id(p): i for i, p in enumerate(opt_a.param_groups[0]["params"])}
    for p in corrected:
        assert torch.equal(
            saved["state"][index[id(p)]]["momentum_buffer"], opt_a.state[p]["momentum_buffer"]
        )
        view = opt_a.state[p]["momentum_buffer"]
        assert any(
            view.data_ptr() >= v.data_ptr()
            and view.data_ptr() < v.data_ptr() + v.numel() * v.element_size()
            for v in opt_a.velocities().values()
        )
    model_b, opt_b = make()
    model_b.load_state_dict(model_a.state_dict())
    opt_b.load_state_dict(saved)
    train(model_a, opt_a, 5)
    train(model_b, opt_b, 5)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_adam_correction_sends_adam_directions_and_steps_by_them():
    """AdamW: the exchange carries each rank's bias-corrected m_hat / (sqrt(v) + eps), v
    the P-rank average's second moment v_hat / P + (1 - 1/P) min(m_hat^2, v_hat); the
    step is the decoupled decay plus ``-lr`` times the exchanged direction."""
    torch.manual_seed(1)
    model = torch.nn.Linear(100, 200, bias=False)
    density, numel, lr, wd = 0.02, 20_000, 1e-3, 0.01
    (beta1, beta2), eps = (0.9, 0.999), 1e-8
    opt = hvds.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd),
        model.named_parameters(),
        density=density,
        selection="exact",
        global_selection="exact",  # ties at the exact threshold are all kept: >= k
    )
    assert opt.momentum_correction and not opt.velocities()
    (name,) = opt.residuals()
    k = budget(numel, density)
    residual, first, second = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    for step in range(5):
        g = torch.Generator().manual_seed(step * 17 + hvd.rank())
        x, c = torch.randn(8, 100, generator=g), torch.randn(8, 200, generator=g)
        opt.zero_grad()
        (model(x) * c).sum().backward()
        grad = model.weight.grad.reshape(-1).clone()
        first.mul_(beta1).add_(grad, alpha=1 - beta1)
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        t = step + 1
        m_hat, v_hat = first / (1 - beta1**t), second / (1 - beta2**t)
        ranks = hvd.size()
        v = v_hat / ranks + (1 - 1 / ranks) * torch.minimum(m_hat * m_hat, v_hat)
        direction = m_hat / (v.sqrt() + eps)
        acc = residual + direction
        with opt.shared_parameters():  # where the step starts (not the lookahead)
            before = model.weight.detach().clone().reshape(-1)
        opt.synchronize()
        got = model.weight.grad.reshape(-1)
        # Adam's directions cluster (all +-1 at the first step), so the top k is full of
        # exact ties that exact top-k may break either way: check what the exchange
        # carried through the invariant (no mass lost or created), and its sparsity.
        owed = hvd.allreduce(acc, op=hvd.Sum, name=f"adam.owed.{step}")
        kept = hvd.allreduce(opt.residuals()[name], op=hvd.Sum, name=f"adam.kept.{step}")
        torch.testing.assert_close(kept + got * hvd.size(), owed, rtol=1e-5, atol=1e-4)
        assert int((got != 0).sum()) >= k  # ties at the global threshold are all kept
        residual = opt.residuals()[name].clone()
        with opt.skip_synchronize():
            opt.step()
        expected = before * (1 - lr * wd) - lr * model.weight.grad.reshape(-1)
        torch.testing.assert_close(model.weight.detach().reshape(-1), expected)
