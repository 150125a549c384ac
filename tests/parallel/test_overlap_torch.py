"""All-gather overlapped with the next forward: same trajectory as without overlap."""

import json

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.common.bucket_choice import TRIAL_BLOCK_STEPS, TRIAL_ROUNDS

hvd.init()

# Small enough that every weight matrix has a bucket of its own and the biases share
# a dense one: several buckets, applied by several pre-hooks.
BUCKET_BYTES = 20_000


def mlp() -> torch.nn.Module:
    torch.manual_seed(42)  # identical initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(32, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 20),
    )


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "sgd_nesterov_wd": lambda params: torch.optim.SGD(
        params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05),
}


def build(make_opt, overlap: bool, **options):
    model = mlp()
    opt = hvds.DistributedOptimizer(
        make_opt(model.parameters()),
        model.named_parameters(),
        density=0.05,
        fusion_threshold_bytes=BUCKET_BYTES,
        overlap_allgather=overlap,
        model=model if overlap else None,
        # Overlap defers the update into the next forward, so it takes no lookahead;
        # the trajectories compared are those without it.
        residual_lookahead=False,
        **options,
    )
    return model, opt


TEACHER = torch.randn(32, 20, generator=torch.Generator().manual_seed(5))


def batch(step: int):
    g = torch.Generator().manual_seed(7919 * step + 31 * hvd.rank())
    x = torch.randn(16, 32, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)  # a learnable task: the loss falls


def train(model, opt, steps, scheduler=None, evaluate_every=7):
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()  # changes lr before the deferred update is applied
        if step % evaluate_every == 0:
            with torch.no_grad():  # an evaluation forward in between applies updates too
                model(x)
        losses.append(loss.item())
    return losses


def spread(model) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    high = hvd.allreduce(flat, op=hvd.Max, name="spread.max")
    low = hvd.allreduce(flat, op=hvd.Min, name="spread.min")
    return (high - low).abs().max().item()


@pytest.mark.parametrize("name", OPTIMIZERS.keys())
def test_overlap_trajectory_equals_no_overlap(name):
    plain_model, plain_opt = build(OPTIMIZERS[name], overlap=False)
    model, opt = build(OPTIMIZERS[name], overlap=True)
    assert len(opt.buckets()) >= 4  # three sparse weight buckets and a dense one
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=5, gamma=0.7)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    plain_losses = train(plain_model, plain_opt, 30, plain_sched)
    losses = train(model, opt, 30, sched)
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    # Training makes progress (averaged over ranks, so every rank agrees).
    first, last = hvd.allreduce(torch.tensor([plain_losses[:5], plain_losses[-5:]]), name="loss")
    assert last.sum() < 0.98 * first.sum()
    # The last step's updates are still pending: the model's state_dict applies them.
    assert opt.pending_updates
    state = model.state_dict()
    assert not opt.pending_updates
    for key, value in plain_model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)
    # Optimizer state (momentum buffers or Adam moments) matches too.
    plain_state, overlap_state = plain_opt.state_dict(), opt.state_dict()
    for index, slots in plain_state["state"].items():
        for key, value in slots.items():
            torch.testing.assert_close(overlap_state["state"][index][key], value)
    residuals, plain_residuals = opt.residuals(), plain_opt.residuals()
    for bucket, residual in plain_residuals.items():
        torch.testing.assert_close(residuals[bucket], residual, rtol=1e-6, atol=1e-7)
    assert spread(model) == 0.0
    # Group hyperparameters are the scheduler's, not the deferred step's snapshot.
    assert opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]


def test_flush_applies_the_last_update():
    plain_model, plain_opt = build(OPTIMIZERS["sgd_momentum"], overlap=False)
    model, opt = build(OPTIMIZERS["sgd_momentum"], overlap=True)
    train(plain_model, plain_opt, 5)
    train(model, opt, 5, evaluate_every=1000)
    before = [p.detach().clone() for p in model.parameters()]
    opt.flush()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    opt.flush()  # nothing pending: no change
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_grad_after_deferred_update_is_what_zero_grad_left():
    model, opt = build(OPTIMIZERS["adam"], overlap=True)
    train(model, opt, 2)
    opt.zero_grad()
    model(batch(9)[0])  # pre-hooks apply the pending updates
    assert all(p.grad is None for p in model.parameters())


def test_clipping_is_refused_with_a_clear_error():
    model, opt = build(OPTIMIZERS["sgd_momentum"], overlap=True)
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="clipping"):
        opt.synchronize()
    with pytest.raises(RuntimeError, match="skip_synchronize"):
        with opt.skip_synchronize():
            opt.step()
    opt.step()  # the step itself still works after the refusals
    opt.flush()
    assert spread(model) == 0.0


@pytest.mark.parametrize(
    "setting, with_model, error, match",
    [
        (True, False, TypeError, "model="),
        ("auto", False, TypeError, "model="),
        ("sometimes", True, ValueError, "overlap_allgather must be one of"),
    ],
    ids=["true-without-model", "auto-without-model", "bad-setting"],
)
def test_bad_overlap_options_are_refused_on_every_rank(setting, with_model, error, match):
    model = mlp()
    with pytest.raises(error, match=match):
        hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            overlap_allgather=setting,
            model=model if with_model else None,
        )


def test_load_state_dict_drops_pending_updates():
    model, opt = build(OPTIMIZERS["sgd_momentum"], overlap=True)
    train(model, opt, 3)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    train(model, opt, 2, evaluate_every=1000)  # leaves step 5's update pending
    assert opt.pending_updates
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert not opt.pending_updates
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved_model[key], rtol=0, atol=0)


def test_trace_reports_hidden_reduce_scatter(tmp_path):
    path = str(tmp_path / "trace.{rank}.json")
    model, opt = build(OPTIMIZERS["sgd_momentum"], overlap=True, trace=path)
    train(model, opt, 6)
    summary = opt.trace_summary()
    # Three sparse buckets per step, each with one reduce-scatter.
    assert summary["reduce_scatters"] == 3 * 6
    assert 0.0 <= summary["hidden_s"] <= summary["lifetime_s"]
    assert 0.0 <= summary["hidden_fraction"] <= 1.0
    written = opt.write_trace()
    with open(written) as f:
        trace = json.load(f)
    names = {event["name"] for event in trace["traceEvents"] if event["ph"] == "X"}
    assert {"backward", "reduce-scatter", "all-gather", "allreduce"} <= names
    assert trace["otherData"]["reduce_scatters"] == 18


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_auto_overlap_switches_without_changing_the_trajectory(name):
    plain_model, plain_opt = build(OPTIMIZERS[name], overlap=False)
    model, opt = build(OPTIMIZERS[name], overlap="auto", scheduler_steps=3)
    assert opt.overlapping  # starts overlapped
    # A trial from step 10 (overlap off and on in turn, every TRIAL_BLOCK_STEPS steps),
    # its verdict, the next trial three steps later, and its verdict.
    trial_steps = 2 * TRIAL_ROUNDS * TRIAL_BLOCK_STEPS
    steps = 10 + 2 * trial_steps + 3 + 1
    plain_losses = train(plain_model, plain_opt, steps)
    losses = train(model, opt, steps)
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    trials = opt.schedule_trials()
    # The first trial ran with overlap off first, whatever the timings; density stays
    # fixed (every bucket sparse throughout).
    assert len(trials) >= 2
    assert (trials[0].overlap_before, trials[0].overlap_tried) == (True, False)
    assert all(t.before == t.tried == (False, False, False) for t in trials)
    outcomes = [(t.overlap_before, t.overlap_tried, t.kept) for t in trials]
    gathered = hvd.allgather_object(outcomes, name="auto_overlap.trials")
    assert all(g == outcomes for g in gathered)
    assert all(entry["overlap"] == opt.overlapping for entry in opt.schedule().values())
    state = model.state_dict()  # applies what is pending, if the last step overlapped
    assert not opt.pending_updates
    for key, value in plain_model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)
    assert spread(model) == 0.0
