"""Dense-step fusion: adjacent dense buckets reduced by one allreduce, with the result
of separate allreduces and of Horovod's dense allreduce, on every rank alike."""

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds
from tests.buckets import sparse_buckets

hvd.init()

# 3 sparse buckets (one per weight matrix: 64x96, 96x64 and 64x48 floats are 24 KiB,
# 24 KiB and 12 KiB) and one dense bucket of biases.
BUCKET_BYTES = 30_000
WARMUP = 4  # dense steps (density 1), each one fused


def mlp() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.Tanh(),
        torch.nn.Linear(96, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 48),
    )


def build(optimizer: str = "sgd", overlap: bool = False, **options):
    model = mlp()
    if optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif optimizer == "plain":  # no momentum correction: p.grad is what is sent
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        # eps bounds how far Adam's m / (sqrt(v) + eps) magnifies last-bit differences
        # of the averaged gradient: the biases step by Adam's own algorithm on it (no
        # correction for a dense bucket), and an entry that nearly cancels across 4
        # ranks turned one summation order's last bits into 2.2e-7 at eps=1e-8.
        inner = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    opt = hvds.DistributedOptimizer(
        inner,
        model.named_parameters(),
        density=0.05,
        fusion_threshold_bytes=BUCKET_BYTES,
        warmup_steps=WARMUP,
        overlap_allgather=overlap,
        model=model if overlap else None,
        **options,
    )
    return model, opt


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(13 * step + hvd.rank()))


def loss_of(model, step):
    return model(batch(step)).pow(2).mean()


def train(model, opt, steps):
    runs = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        runs.append(opt.fused_dense_runs)
    opt.flush()
    return runs


def spread(model) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)).abs().max().item()


SPARSE = ["sparse0.float32", "sparse1.float32", "sparse2.float32"]


@pytest.mark.parametrize(
    "optimizer, overlap", [("sgd", False), ("adam", False), ("sgd", True), ("adam", True)]
)
def test_fused_dense_steps_follow_the_trajectory_of_separate_allreduces(optimizer, overlap):
    fused_model, fused = build(optimizer, overlap)
    alone_model, alone = build(optimizer, overlap, dense_fusion_bytes=0)
    steps = WARMUP + 4
    fused_runs, alone_runs = train(fused_model, fused, steps), train(alone_model, alone, steps)
    # Warm-up steps: the three sparse buckets in one allreduce; sparse steps: none.
    assert fused_runs == [[SPARSE]] * WARMUP + [[]] * (steps - WARMUP)
    assert alone_runs == [[]] * steps
    # With 2 ranks every sum is a + b whatever the layout: the trajectories are equal.
    # With more, one ring allreduce over the three buckets adds some entries in another
    # order than three allreduces do (last-bit differences); Adam, dividing by
    # sqrt(v), carries them into the sparse steps' residuals (2e-6 apart at 3 ranks).
    exact = hvd.size() == 2
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-6, atol=1e-7)
    for p, q in zip(fused_model.parameters(), alone_model.parameters()):
        torch.testing.assert_close(p, q, **tolerance)
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
    for name, residual in alone.residuals().items():
        torch.testing.assert_close(fused.residuals()[name], residual, **tolerance)
    assert spread(fused_model) == 0.0


def test_a_fused_step_is_horovods_dense_allreduce_and_conserves_mass_after():
    model, opt = build("plain")
    for step in range(WARMUP + 1):
        opt.zero_grad()
        loss_of(model, step).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
        if step < WARMUP:
            assert opt.fused_dense_runs == [SPARSE]
            for n, p in model.named_parameters():
                dense = hvd.allreduce(local[n], name=f"fused.ref.{n}.{step}")
                torch.testing.assert_close(p.grad, dense, rtol=1e-6, atol=1e-7)
            assert all(r.abs().sum() == 0 for r in opt.residuals().values())
        else:
            # First sparse step: residual_after + P * result == gradient, summed over ranks.
            assert opt.fused_dense_runs == []
            for slot in sparse_buckets(opt, model):
                sent = torch.cat([local[n].reshape(-1) for n in opt.bucket_parameters()[slot.name]])
                result = torch.cat([p.grad.reshape(-1) for p in slot.params])
                owed = hvd.allreduce(slot.reducer.residual, op=hvd.Sum, name=f"owed.{step}")
                total = hvd.allreduce(sent, op=hvd.Sum, name=f"sent.{step}")
                torch.testing.assert_close(owed + hvd.size() * result, total, rtol=1e-5, atol=1e-6)
        with opt.skip_synchronize():
            opt.step()
    assert opt.stats().sparse_buckets == 3
    assert spread(model) == 0.0


def test_a_residual_owed_on_one_rank_only_joins_the_fused_allreduce():
    """Runs are planned from the dense step, which every rank agrees on, not from a
    clear residual, which one rank may lack (say, a checkpoint restored on rank 0
    only): that rank moves its residual into the fused allreduce, no mass left out."""
    model, opt = build("plain")
    train(model, opt, 1)  # a fused warm-up step: residuals clear
    slots = sparse_buckets(opt, model)
    owed = {}
    for slot in slots:
        owed[slot.name] = torch.full_like(slot.reducer.residual, 0.01 * (hvd.rank() == 0))
        if hvd.rank() == 0:
            slot.reducer.residual = slot.reducer.residual + owed[slot.name]
    assert [slot.reducer.residual_clear for slot in slots] == [hvd.rank() != 0] * 3
    opt.zero_grad()
    loss_of(model, 1).backward()
    local = {p: p.grad.clone() for p in model.parameters()}
    opt.synchronize()
    assert opt.fused_dense_runs == [SPARSE]
    for slot in slots:
        sent = torch.cat([local[p].reshape(-1) for p in slot.params]) + owed[slot.name]
        total = hvd.allreduce(sent, op=hvd.Sum, name=f"owed.sent.{slot.name}")
        result = torch.cat([p.grad.reshape(-1) for p in slot.params])
        torch.testing.assert_close(hvd.size() * result, total, rtol=1e-5, atol=1e-6)
        assert slot.reducer.residual_clear and slot.reducer.residual.abs().sum() == 0
    with opt.skip_synchronize():
        opt.step()
    assert spread(model) == 0.0


def test_the_cap_splits_the_run():
    # 24 KiB + 24 KiB fit in 50 000 bytes; the third bucket would not.
    model, opt = build(dense_fusion_bytes=50_000)
    runs = train(model, opt, 1)
    assert runs == [[SPARSE[:2]]]
    assert spread(model) == 0.0


def test_a_bad_fusion_cap_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="dense_fusion_bytes must be >= 0"):
        build(dense_fusion_bytes=-1)
