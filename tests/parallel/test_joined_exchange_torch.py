"""One alltoall and one allgather for all the sparse buckets of a step (common/joined.py):
the count per step, the same results as one exchange per bucket, no mass lost."""

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds
from tests.buckets import sparse_buckets
from tests.parallel.test_global_reuse_torch import COLLECTIVES, SCATTERS, counted  # noqa: F401

hvd.init()

BUCKETS, SIDE = 16, 128  # 16 weights of 16K floats, each its own sparse bucket


def model_of(buckets: int = BUCKETS) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(SIDE, SIDE) for _ in range(buckets)]  # biases: dense
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])


def optimizer_of(net: torch.nn.Module, join: bool, name: str, **options):
    return hvds.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05),
        net.named_parameters(),
        density=0.01,
        fusion_threshold_bytes=SIDE * SIDE * 4,
        join_buckets=join,
        **options,
    )


def fresh_grads(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).double()


def test_a_reused_step_of_16_buckets_is_one_alltoall_and_one_allgather(counted):  # noqa: F811
    model = model_of()
    opt = optimizer_of(model, True, "joined.count")
    buckets = sparse_buckets(opt, model)
    assert len(buckets) == BUCKETS
    reused = refreshed = 0
    for step in range(12):
        fresh_grads(model, step)
        before = {b.name: r.double().clone() for b, r in zip(buckets, _residuals(opt, buckets))}
        grads = {b.name: flat(p.grad for p in b.params) for b in buckets}
        start = dict(counted)
        opt.synchronize()
        issued = {kind: counted[kind] - start[kind] for kind in COLLECTIVES}
        refreshes = opt.stats().global_refreshes
        dense = issued["allreduce_sum_async"] + issued["allreduce_sum_inplace_async"]
        assert issued["alltoall_async"] == SCATTERS and issued["allgather_async"] == 1, (
            step,
            issued,
        )
        if refreshes == 0:
            reused += 1
            assert dense <= 1, (step, issued)  # the biases' bucket
        else:
            refreshed += 1
            assert dense <= 1 + 4, (step, issued)  # + one radix select for all buckets
        # Invariant over every bucket's entries at once (one allreduce each side):
        # summed over ranks, residual_after + P * average == residual_before + gradient;
        # and every rank holds the same result.
        after = flat(_residuals(opt, buckets))
        result = flat(p.grad for b in buckets for p in b.params)
        tag = f"joined.{step}"
        lhs = hvd.allreduce(after, op=hvd.Sum, name=f"{tag}.l") + hvd.size() * result
        sent = flat(before[b.name] + grads[b.name] for b in buckets)
        rhs = hvd.allreduce(sent, op=hvd.Sum, name=f"{tag}.r")
        torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-4)
        everyone = hvd.allgather(result.view(1, -1), name=f"{tag}.o")
        assert all(torch.equal(row, result) for row in everyone)
        for bucket in buckets:  # every bucket delivered something
            assert int((flat(p.grad for p in bucket.params) != 0).sum()) > 0
        with opt.skip_synchronize():
            opt.step()
    # Both kinds of step were counted (refreshes are most frequent while the residuals
    # grow over the first steps; any of the 16 buckets refreshing makes a refresh step).
    assert reused >= 6 and refreshed >= 1, (reused, refreshed)


def _residuals(opt, buckets) -> list[torch.Tensor]:
    residuals = opt.residuals()
    return [residuals[b.name].clone() for b in buckets]


def test_training_joined_equals_one_exchange_per_bucket_bitwise():
    """Through backward's hooks (buckets launched as their gradients arrive) and with
    the all-gathers deferred to the next forward: the same parameters and residuals
    bit for bit as with one alltoall and one allgather per bucket."""
    runs = []
    for join in (True, False):
        model = model_of(6)
        opt = optimizer_of(model, join, f"joined.train.{join}", overlap_allgather=True, model=model)
        generator = torch.Generator().manual_seed(hvd.rank())
        for _ in range(12):
            x = torch.randn(8, SIDE, generator=generator)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        opt.flush()
        runs.append((model, opt))
    (joined_model, joined_opt), (alone_model, alone_opt) = runs
    for a, b in zip(joined_model.parameters(), alone_model.parameters()):
        assert torch.equal(a, b)
    for name, residual in joined_opt.residuals().items():
        assert torch.equal(residual, alone_opt.residuals()[name])
    assert joined_opt.stats().bytes_sent == alone_opt.stats().bytes_sent
    assert joined_opt.stats().bytes_received == alone_opt.stats().bytes_received
    everyone = hvd.allgather(flat(joined_model.parameters()).view(1, -1), name="joined.same")
    assert all(torch.equal(row, everyone[0]) for row in everyone)
