"""scheduler="auto": one choice per bucket on every rank, visible in stats() and schedule()."""

import math

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.common.cost_model as cost_model
import horovod_sparse.torch as hvds
from horovod_sparse.common.bucket_choice import TRIAL_BLOCK_STEPS, TRIAL_ROUNDS
from horovod_sparse.common.cost_model import LinkModel
from horovod_sparse.common.step import StepKind
from tests.buckets import sparse_buckets

hvd.init()


def model_and_optimizer(**options):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        density=0.02,
        fusion_threshold_bytes=40_000,  # one sparse bucket per weight matrix
        scheduler="auto",
        scheduler_steps=4,
        **options,
    )
    return model, opt


def train(model, opt, steps):
    modes = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 17 + hvd.rank())
        x = torch.randn(8, 64, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        stats = opt.stats()
        modes.append((stats.dense_buckets, stats.sparse_buckets))
    return modes


def agree(values) -> bool:
    gathered = hvd.allgather_object(values, name=f"agree.{len(str(values))}")
    return all(v == gathered[0] for v in gathered)


def spread(model) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)).abs().max().item()


@pytest.mark.parametrize(
    "link, dense_tried",
    [(LinkModel(alpha=0.0, beta=0.0), True), (LinkModel(alpha=0.0, beta=1.0), False)],
    ids=["free-link-tries-dense", "bandwidth-bound-stays-sparse"],
)
def test_auto_tries_what_the_link_allows_and_every_rank_agrees(monkeypatch, link, dense_tried):
    # Replace the fitted link by an extreme one so the proposal is not in doubt.
    monkeypatch.setattr(cost_model, "fit_link", lambda samples, world: link)
    model, opt = model_and_optimizer()
    sparse_buckets = len(opt.residuals())
    assert sparse_buckets == 2
    ended = 10 + 2 * TRIAL_ROUNDS * TRIAL_BLOCK_STEPS  # a trial from step 10
    modes = train(model, opt, ended + 2)
    # Steps before the first decision (step 10) are sparse for both weight buckets.
    assert modes[:10] == [(1, 2)] * 10  # the biases' dense bucket, two sparse buckets
    trials = opt.engine.scheduler.trials
    if dense_tried:
        # A trial: blocks of TRIAL_BLOCK_STEPS steps dense and sparse in turn, from step
        # 10; then whole-step times kept dense or stayed sparse.
        dense_block, sparse_block = [(3, 0)] * TRIAL_BLOCK_STEPS, [(1, 2)] * TRIAL_BLOCK_STEPS
        assert modes[10:ended] == (dense_block + sparse_block) * TRIAL_ROUNDS
        (outcome,) = trials
        assert outcome.before == (False, False) and outcome.tried == (True, True)
        assert len(outcome.blocks) == 2 * TRIAL_ROUNDS + 1
        assert all(math.isfinite(s) for s in outcome.blocks)
        assert outcome.kept == (outcome.ratio < 1.0)
        final = "dense" if outcome.kept else "sparse"
    else:
        assert trials == []  # the model rules dense out: no trial
        final = "sparse"
    assert modes[-1] == ((3, 0) if final == "dense" else (1, 2))
    schedule = opt.schedule()
    assert {entry["mode"] for entry in schedule.values()} == {final}
    for entry in schedule.values():
        assert math.isfinite(entry["predicted_dense_s"])
        assert math.isfinite(entry["predicted_sparse_s"])
        assert entry["local_s_per_element"] > 0
        assert entry["measured_sparse_s"] > 0  # the sparse steps before the first decision
        if dense_tried:
            assert entry["measured_dense_s"] > 0
        else:
            assert math.isnan(entry["measured_dense_s"])
    assert agree(modes) and agree(sorted((k, v["mode"]) for k, v in schedule.items()))
    assert agree([(t.before, t.tried, t.blocks, t.ratio, t.kept) for t in trials])
    assert spread(model) == 0.0


def test_auto_with_the_measured_link_keeps_ranks_identical():
    model, opt = model_and_optimizer()
    modes = train(model, opt, 10 + 2 * TRIAL_ROUNDS * TRIAL_BLOCK_STEPS + 2)
    # Decisions at steps 10, 14, 18, ... without a trial; at 10 and at the trial's end
    # with one (its blocks switch without a decision).
    assert opt.engine.scheduler.decisions >= 2
    assert agree([opt.engine.scheduler.decisions, opt.engine.scheduler.next_decision])
    assert agree(modes) and agree([v["mode"] for v in opt.schedule().values()])
    assert all(dense + sparse == 3 for dense, sparse in modes)
    assert spread(model) == 0.0
    link = opt.engine.scheduler.link
    assert link.alpha >= 0 and link.beta >= 0


def test_switching_to_dense_folds_the_residual_in():
    """No mass lost at the switch: a dense step sends residual + gradient, and after it
    the residual is zero on every rank."""
    model, opt = model_and_optimizer()
    train(model, opt, 5)
    assert any(r.abs().sum() > 0 for r in opt.residuals().values())
    opt.pin_exchange("dense")  # what a dense decision sets, and no decision to undo it
    train(model, opt, 1)
    assert all(r.abs().sum() == 0 for r in opt.residuals().values())
    assert opt.stats().dense_buckets == 3


def test_dense_steps_after_the_switch_reduce_the_bucket_buffer_like_horovod():
    """Once the switch has folded the residual in, a dense bucket's step is Horovod's
    allreduce of the gradients, reduced in the bucket buffer; the residual stays zero.
    Switching back to sparse then conserves mass from a clear residual."""
    model, opt = model_and_optimizer()
    train(model, opt, 5)
    opt.pin_exchange("dense")
    train(model, opt, 1)  # the switch: residual + gradient, then a clear residual
    slots = sparse_buckets(opt, model)
    assert all(view.residual_clear and view.force_dense for view in opt.buckets() if view.sparse)
    for step in range(3):
        g = torch.Generator().manual_seed(1000 + step * 7 + hvd.rank())
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
        for n, p in model.named_parameters():
            dense = hvd.allreduce(local[n], name=f"buffer.{n}.{step}")
            torch.testing.assert_close(p.grad, dense, rtol=1e-6, atol=1e-7)
        with opt.skip_synchronize():
            opt.step()
        assert all(r.abs().sum() == 0 for r in opt.residuals().values())
        assert opt.stats().dense_buckets == 3
        assert all(
            view.last_kind in (StepKind.DENSE_IN_BUFFER, StepKind.DENSE_FUSED)  # the buffer
            for view in opt.buckets()
            if view.sparse
        )
    # Back to sparse: residual_after + P * result == residual_before + gradient, summed.
    opt.pin_exchange("sparse")
    g = torch.Generator().manual_seed(2000 + hvd.rank())
    opt.zero_grad()
    model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
    grads = {slot.name: torch.cat([p.grad.reshape(-1) for p in slot.params]) for slot in slots}
    opt.synchronize()
    for slot in slots:
        assert not slot.reducer.residual_clear
        result = torch.cat([p.grad.reshape(-1) for p in slot.params])
        owed = hvd.allreduce(slot.reducer.residual, op=hvd.Sum, name=f"owed.{slot.name}")
        sent = hvd.allreduce(grads[slot.name], op=hvd.Sum, name=f"g.{slot.name}")
        torch.testing.assert_close(owed + hvd.size() * result, sent, rtol=1e-5, atol=1e-6)
    assert opt.stats().sparse_buckets == 2
    assert spread(model) == 0.0


def test_bad_scheduler_is_refused_on_every_rank():
    model = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            scheduler="sometimes",
        )
