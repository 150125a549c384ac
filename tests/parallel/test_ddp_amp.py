"""The DDP hook under mixed precision: bf16 autocast, and fp16 autocast with a
``GradScaler`` whose scale the hook takes out of its state and whose skipped steps it
undoes (launched by torchrun, Gloo, on the CPU)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook
from tests.ddp_models import SmallNet, gather

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


class Recorded:
    """Each bucket's gradient as it came to the hook, and its result."""

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self.results: dict[int, torch.Tensor] = {}

    def hook(self):
        def recording_hook(
            state: SparseState, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            index = bucket.index()
            self.grads[index] = bucket.buffer().clone()

            def keep(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self.results[index] = future.value().clone()
                return future.value()

            return sparse_allreduce_hook(state, bucket).then(keep)

        return recording_hook


def residuals(state: SparseState) -> dict[int, torch.Tensor]:
    return {index: r.residual.clone() for index, r in state.reducers.items()}


def make(state: SparseState):
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallNet(), bucket_cap_mb=0.03)
    recorded = Recorded()
    model.register_comm_hook(state, recorded.hook())
    return model, recorded, torch.optim.SGD(model.parameters(), lr=0.05)


def assert_mass_kept(before, after, recorded, scale: float) -> None:
    """Per sparse bucket, over ranks: residuals after + P * average == residuals before +
    gradients, in unscaled units."""
    for index, residual in after.items():
        grad = recorded.grads[index] / scale
        owed = np.sum(gather(before.get(index, torch.zeros_like(residual)) + grad), axis=0)
        sent = SIZE * (recorded.results[index] / scale).numpy()
        kept = np.sum(gather(residual), axis=0)
        np.testing.assert_allclose(kept + sent, owed, rtol=1e-5, atol=1e-4)


def test_bf16_autocast_trains_with_finite_losses_and_keeps_the_mass():
    state = SparseState(density=0.05, min_sparse_numel=1000)
    model, recorded, optimizer = make(state)
    for step in range(8):
        x, y = batch(step)
        before = residuals(state)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        if step:  # the first iteration is DDP's dense average
            assert_mass_kept(before, residuals(state), recorded, 1.0)
        optimizer.step()
    assert state.stats().sparse_buckets >= 2
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for row in gather(flat):
        np.testing.assert_array_equal(row, flat.numpy())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fp16_grad_scaler_steps_unscaled_and_an_overflow_changes_nothing(momentum):
    """Without momentum correction the mass invariant holds in unscaled units every
    step; with it, the velocity is put back on the overflow step too."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = SparseState(density=0.05, momentum=momentum, min_sparse_numel=1000, grad_scaler=scaler)
    model, recorded, optimizer = make(state)
    overflow = 5
    for step in range(10):
        x, y = batch(step)
        model.module.poison = step == overflow and RANK == 0  # one rank overflows
        before, velocity = residuals(state), {k: v.clone() for k, v in state.velocity.items()}
        parameters = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == overflow:
            # Every rank skipped the step, and the hook put its state back exactly.
            assert scaler.get_scale() == scale / 2
            assert all(torch.equal(a, p) for a, p in zip(parameters, model.parameters()))
            after = residuals(state)
            assert after.keys() == before.keys()
            assert all(torch.equal(after[k], before[k]) for k in before)
            assert all(torch.equal(state.velocity[k], v) for k, v in velocity.items())
            assert bool(velocity) == bool(momentum)
        else:
            assert torch.isfinite(loss)
            if step and not momentum:  # (with it, the direction enters, not the gradient)
                assert_mass_kept(before, residuals(state), recorded, scale)
                for r in residuals(state).values():
                    assert torch.isfinite(r).all()
    assert state.stats().sparse_buckets >= 2
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.isfinite(flat).all()
    for row in gather(flat):
        np.testing.assert_array_equal(row, flat.numpy())
