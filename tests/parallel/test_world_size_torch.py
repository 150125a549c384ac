"""Changing world size: checkpoints loaded elsewhere, and the optimizer following a
process set that shrinks (what elastic Horovod does after a worker is removed)."""

import os
import warnings

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

_world = int(os.environ["HOROVOD_SPARSE_TEST_WORLD_SIZE"])
# All ranks but the last: a smaller world (one rank at world size 2).
SMALLER = list(range(_world - 1))
smaller = hvd.ProcessSet(SMALLER)
hvd.init(process_sets=[smaller])


def mlp() -> torch.nn.Module:
    torch.manual_seed(42)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(model, opt, steps, seed, process_set=hvd.global_process_set):
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 7919 * step + 31 * process_set.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def make(process_set=hvd.global_process_set):
    model = mlp()
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        density=0.05,
        process_set=process_set,
    )
    return model, opt


def assert_identical(model, name, process_set):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for row in hvd.allgather(flat.reshape(1, -1), name=name, process_set=process_set):
        assert torch.equal(row, flat)


def residual_mass(opt) -> dict[str, torch.Tensor]:
    return {name: r.clone() for name, r in opt.residuals().items()}


def test_own_state_restores_exactly_even_after_a_rank_change():
    """An optimizer's own saved state (elastic commit/restore) keeps its residuals."""
    model, opt = make()
    train(model, opt, 4, seed=1)
    saved = opt.state_dict()
    before = residual_mass(opt)
    assert any(r.abs().sum() > 0 for r in before.values())
    saved["horovod_sparse"]["rank"] = (hvd.rank() + 1) % hvd.size()  # as after renumbering
    train(model, opt, 2, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)
    for name, r in opt.residuals().items():
        assert torch.equal(r, before[name])


def test_checkpoint_from_another_world_size_counts_its_mass_once():
    """Rank 0's checkpoint loaded on every rank of a smaller world: residual shared out."""
    model, opt = make()
    train(model, opt, 5, seed=3)
    # Named: the default name is the object's type, which differs on rank 0.
    mine = opt.state_dict() if hvd.rank() == 0 else None
    saved = hvd.broadcast_object(mine, root_rank=0, name="fold.state")
    saved_model = hvd.broadcast_object(model.state_dict(), root_rank=0, name="fold.model")
    try:
        if hvd.rank() in SMALLER:
            model_b, opt_b = make(smaller)
            model_b.load_state_dict(saved_model)
            opt_b.load_state_dict(saved)
            # What the next step's first gradient runs first: every rank says whose
            # residuals it loaded, and keeps its share.
            if len(SMALLER) > 1:
                with pytest.warns(UserWarning, match=f"each takes 1/{len(SMALLER)} of them"):
                    opt_b._settle_loads()
            else:  # one rank loaded it: it keeps all of it
                opt_b._settle_loads()
            for name, r in opt_b.residuals().items():
                total = hvd.allreduce(r, op=hvd.Sum, name=f"fold.{name}", process_set=smaller)
                torch.testing.assert_close(
                    total, saved["horovod_sparse"]["buckets"][name]["residual"]
                )
            train(model_b, opt_b, 3, seed=4, process_set=smaller)
            assert_identical(model_b, "fold.params", smaller)
    finally:
        hvd.barrier()


def test_rank_zeros_checkpoint_loaded_by_every_rank_counts_its_mass_once():
    """The usual Horovod checkpoint: rank 0 saves, every rank loads, same world size.
    Rank 0's residuals are shared out at the next step (before: rank 0 kept all of its
    own and every other rank took 1/P, (2P - 1)/P of the mass), training goes on with
    identical parameters, and the invariant holds across that step."""
    model, opt = make()
    train(model, opt, 5, seed=7)
    mine = opt.state_dict() if hvd.rank() == 0 else None
    saved = hvd.broadcast_object(mine, root_rank=0, name="rank0.state")
    saved_model = hvd.broadcast_object(model.state_dict(), root_rank=0, name="rank0.model")
    model_b, opt_b = make()
    model_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved)
    owed = saved["horovod_sparse"]["buckets"]
    assert any(bucket["residual"].abs().sum() > 0 for bucket in owed.values())
    context = (
        pytest.warns(UserWarning, match=f"{hvd.size()} ranks loaded")
        if hvd.size() > 1
        else warnings.catch_warnings()
    )
    with context:
        train(model_b, opt_b, 1, seed=8)  # the step after the load settles the shares
    train(model_b, opt_b, 2, seed=9)
    assert_identical(model_b, "rank0.params", hvd.global_process_set)


def test_loaded_residuals_are_shared_before_the_next_exchange():
    """Summed over ranks, the residuals after the settling equal rank 0's saved ones
    (a checkpoint of one rank loaded by all), and equal each rank's own when each
    loads its own checkpoint (restored exactly)."""
    model, opt = make()
    train(model, opt, 4, seed=10)
    own = opt.state_dict()
    own["horovod_sparse"]["owner"] = "another process"  # as if saved by an earlier run
    rank0 = hvd.broadcast_object(own if hvd.rank() == 0 else None, 0, name="share.state")
    for saved, expect_own in ((own, True), (rank0, False)):
        _, fresh = make()
        fresh.load_state_dict(saved)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if not expect_own else "error")
            fresh._settle_loads()  # what the next step's first gradient runs first
        for name, residual in fresh.residuals().items():
            saved_residual = saved["horovod_sparse"]["buckets"][name]["residual"]
            if expect_own:
                assert torch.equal(residual, saved_residual)
            else:
                total = hvd.allreduce(residual, op=hvd.Sum, name=f"share.{name}")
                torch.testing.assert_close(total, saved_residual)


def test_optimizer_follows_a_shrinking_process_set():
    """The rebuild elastic training relies on: same residuals, new regions, same params."""
    model, opt = make()
    train(model, opt, 4, seed=5)
    try:
        if hvd.rank() in SMALLER:
            before = residual_mass(opt)
            velocity = {name: v.clone() for name, v in opt.velocities().items()}
            opt.process_set = smaller  # what a reset of the global set looks like to it
            opt.zero_grad()
            # Reduce a zero gradient once: the update is 0.9 * velocity (momentum
            # correction), and residual + update must come out of the new world exactly
            # as the invariant says.
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.synchronize()
            (bucket,) = [v for v in opt.buckets() if v.name in before]
            assert bucket.world_size == len(SMALLER)
            assert len(bucket.boundaries) == len(SMALLER) + 1
            name = bucket.name
            params = dict(model.named_parameters())
            result = torch.cat([params[n].grad.reshape(-1) for n in opt.bucket_parameters()[name]])
            sent = result * (len(SMALLER) if opt.op == hvd.Average else 1)
            lhs = (
                hvd.allreduce(
                    opt.residuals()[name], op=hvd.Sum, name="shrink.after", process_set=smaller
                )
                + sent
            )
            owed = before[name] + 0.9 * velocity[name]
            rhs = hvd.allreduce(owed, op=hvd.Sum, name="shrink.before", process_set=smaller)
            torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-6)
            with opt.skip_synchronize():
                opt.step()
            train(model, opt, 3, seed=6, process_set=smaller)
            assert_identical(model, "shrink.params", smaller)
    finally:
        hvd.barrier()
