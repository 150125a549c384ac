"""residual_lookahead: each rank's training forward and backward run at the shared
parameters moved by its own pending update; the shared parameters, held between a step
and the next training forward, follow the sparse step exactly and agree on every rank."""

import copy

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

hvd.init()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 31 * hvd.rank())
    return torch.randn(8, 100, generator=g), torch.randn(8, 200, generator=g)


def linear() -> torch.nn.Module:
    torch.manual_seed(3)  # identical initial weights on every rank
    return torch.nn.Linear(100, 200, bias=False)  # one sparse bucket of 20,000


def make_adamw(model: torch.nn.Module, **options) -> torch.optim.Optimizer:
    return hvds.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        model.named_parameters(),
        density=0.02,
        **options,
    )


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, c = batch(step)
    return (torch.tanh(model(x)) * c).sum()


def shared_weights_agree(model: torch.nn.Module, name: str) -> None:
    for p in model.parameters():
        everyone = hvd.allgather(p.detach().reshape(1, -1), name=name)
        assert torch.equal(everyone, p.detach().reshape(1, -1).expand_as(everyone))


@pytest.mark.parametrize("lr_change", [False, True], ids=["constant_lr", "scheduled_lr"])
def test_gradients_taken_at_the_lookahead_and_shared_parameters_follow_the_step(lr_change):
    """Against a reference built from the definition on a twin model: before each
    forward, the twin's weight is moved by -lr times its optimizer's residual (this
    rank's share, -lr/P times it, for each of the P ranks), and put back before the
    step."""
    model, twin = linear(), linear()
    opt = make_adamw(model)  # the default: on, for AdamW's corrected step
    ref = make_adamw(twin, residual_lookahead=False)
    (name,) = ref.residuals()
    moved_steps = 0
    for step in range(8):
        lr = ref.param_groups[0]["lr"]  # the lookahead's: the groups' at the forward
        shared = twin.weight.detach().clone()
        with torch.no_grad():
            twin.weight.sub_(ref.residuals()[name].view_as(twin.weight), alpha=lr)
        assert torch.equal(model.weight, shared)  # between steps: the shared parameters
        with torch.no_grad():
            model(batch(step)[0])  # no lookahead for a forward without gradients
        assert torch.equal(model.weight, shared)
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.synchronize()
        assert torch.equal(model.weight, twin.weight)  # the lookahead, from the definition
        moved_steps += int(not torch.equal(model.weight, shared))
        assert torch.equal(model.weight.grad, twin.weight.grad)
        with torch.no_grad():
            twin.weight.copy_(shared)
        for o in (opt, ref):
            with o.skip_synchronize():
                o.step()
        assert torch.equal(model.weight, twin.weight)
        shared_weights_agree(model, f"la.shared.{lr_change}.{step}")
        # Residual mass is conserved the same way with or without the lookahead.
        assert torch.equal(opt.residuals()[name], ref.residuals()[name])
        if lr_change and step == 3:  # a scheduler steps after the optimizer
            for o in (opt, ref):
                o.param_groups[0]["lr"] = 3e-3
    assert moved_steps >= 6  # the residual is non-zero after the first step


def test_density_one_is_dense_adamw_with_or_without_lookahead():
    a, b = linear(), linear()
    dense_a = hvds.DistributedOptimizer(
        torch.optim.AdamW(a.parameters(), lr=1e-2),
        a.named_parameters(),
        density=1.0,
        residual_lookahead=True,
    )
    dense_b = hvds.DistributedOptimizer(
        torch.optim.AdamW(b.parameters(), lr=1e-2), b.named_parameters(), density=1.0
    )
    for step in range(4):
        for m, o in ((a, dense_a), (b, dense_b)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.step()
        assert torch.equal(a.weight, b.weight)  # nothing pending: nothing moved


def test_checkpoint_saved_after_a_step_resumes_exactly():
    model_a = linear()
    opt_a = make_adamw(model_a, residual_lookahead=True)

    def train(model, opt, first, steps):
        for step in range(first, first + steps):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()

    train(model_a, opt_a, 0, 5)
    saved_model = copy.deepcopy(model_a.state_dict())  # after step(): the shared values
    saved_opt = copy.deepcopy(opt_a.state_dict())
    train(model_a, opt_a, 5, 4)

    model_b = linear()
    opt_b = make_adamw(model_b, residual_lookahead=True)
    train(model_b, opt_b, 100, 2)  # somewhere else, with a lookahead of its own
    model_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    train(model_b, opt_b, 5, 4)
    assert torch.equal(model_a.weight, model_b.weight)
    shared_weights_agree(model_b, "la.resumed")
    lookaheads = []
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):  # one at a time: same names
        opt.zero_grad()
        loss_of(model, 9).backward()  # each model takes its own optimizer's lookahead
        lookaheads.append(model.weight.detach().clone())
        with opt.shared_parameters():
            shared_weights_agree(model, f"la.resumed.shared.{len(lookaheads)}")
        opt.step()
    assert torch.equal(lookaheads[0], lookaheads[1])  # the lookaheads agree too
    assert torch.equal(model_a.weight, model_b.weight)


def test_horovod_broadcasts_after_a_restore_leave_every_rank_on_the_same_parameters():
    """Elastic Horovod's reset: each rank restores what it committed (here the model
    outside shared_parameters(), so each rank its own lookahead), then the parameters
    and the optimizer's state are broadcast from rank 0."""
    model = linear()
    opt = make_adamw(model, residual_lookahead=True)

    def train(first, steps):
        for step in range(first, first + steps):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()

    train(0, 4)
    opt.zero_grad()
    loss_of(model, 4).backward()  # the forward took this rank's lookahead
    committed_model = copy.deepcopy(model.state_dict())
    committed_opt = copy.deepcopy(opt.state_dict())
    everyone = hvd.allgather(model.weight.detach().reshape(1, -1), name="la.committed")
    assert not torch.equal(everyone[0], everyone[-1])  # the ranks' lookaheads differ
    opt.step()
    train(5, 2)
    opt.zero_grad()
    loss_of(model, 7).backward()  # a reset comes in the middle of a step
    model.load_state_dict(committed_model)
    opt.load_state_dict(committed_opt)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    shared_weights_agree(model, "la.synced")
    train(8, 3)
    shared_weights_agree(model, "la.after_sync")


def test_plain_sgd_looks_ahead_by_the_pending_gradient():
    model = linear()
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        density=0.02,
        residual_lookahead=True,
    )
    (name,) = opt.residuals()
    for step in range(4):
        shared = model.weight.detach().clone()
        # lr * postscale * P is 0.1 exactly here, so the same one subtraction.
        expected = torch.sub(shared, opt.residuals()[name].view_as(shared), alpha=0.1)
        opt.zero_grad()
        loss_of(model, step).backward()
        assert torch.equal(model.weight.detach(), expected)
        with opt.shared_parameters():
            assert torch.equal(model.weight, shared)
        assert torch.equal(model.weight.detach(), expected)
        opt.step()
    assert not torch.equal(expected, shared)


@pytest.mark.parametrize(
    "make, options, message",
    [
        (lambda p: torch.optim.RMSprop(p), {}, "RMSprop without momentum correction"),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            {"momentum_correction": False},
            "SGD without momentum correction",
        ),
        (lambda p: torch.optim.SGD(p, lr=0.1), {"error_feedback": False}, "error_feedback"),
    ],
    ids=["rmsprop", "sgd_momentum_uncorrected", "no_error_feedback"],
)
def test_refused_where_the_step_is_not_linear_in_the_exchange(make, options, message):
    model = linear()
    with pytest.raises(ValueError, match=message):
        hvds.DistributedOptimizer(
            make(model.parameters()),
            model.named_parameters(),
            residual_lookahead=True,
            **options,
        )


def test_refused_with_overlap_allgather():
    model = linear()
    with pytest.raises(ValueError, match="overlap_allgather"):
        hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            residual_lookahead=True,
            overlap_allgather=True,
            model=model,
        )


def test_default_is_on_where_the_step_is_linear_and_off_where_it_is_not():
    """The default (None) looks ahead with AdamW's corrected step, and takes the
    gradients at the shared parameters, without an error, where it cannot apply."""

    def moved_at_the_forward(make, **options) -> bool:
        model = linear()
        opt = hvds.DistributedOptimizer(
            make(model.parameters()), model.named_parameters(), density=0.02, **options
        )
        moved = False
        for step in range(3):
            shared = model.weight.detach().clone()
            opt.zero_grad()
            loss_of(model, step).backward()
            moved = moved or not torch.equal(model.weight, shared)
            opt.step()
        return moved

    assert moved_at_the_forward(lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert moved_at_the_forward(lambda p: torch.optim.SGD(p, lr=0.1))
    assert not moved_at_the_forward(
        lambda p: torch.optim.AdamW(p, lr=1e-2), residual_lookahead=False
    )
    assert not moved_at_the_forward(lambda p: torch.optim.RMSprop(p, lr=1e-3))
    assert not moved_at_the_forward(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), momentum_correction=False
    )
    assert not moved_at_the_forward(lambda p: torch.optim.SGD(p, lr=0.1), error_feedback=False)


def test_a_compiled_model_takes_the_lookahead_before_its_graph_runs():
    """``torch.compile``'s wrapper runs the hook eagerly; inside the traced graph it does
    nothing. The aot_eager backend runs the same kernels as eager: bitwise equal."""
    torch._dynamo.reset()
    eager, compiled = linear(), linear()
    opt_eager, opt_compiled = make_adamw(eager), make_adamw(compiled)
    forward = torch.compile(compiled, backend="aot_eager")
    moved_steps = 0
    for step in range(6):
        shared = eager.weight.detach().clone()
        for run, opt in ((eager, opt_eager), (forward, opt_compiled)):
            opt.zero_grad()
            x, c = batch(step)
            (torch.tanh(run(x)) * c).sum().backward()
            opt.synchronize()  # one exchange in flight at a time: the same names
        assert torch.equal(compiled.weight, eager.weight)  # the same lookahead
        assert torch.equal(compiled.weight.grad, eager.weight.grad)
        moved_steps += int(not torch.equal(eager.weight, shared))
        for opt in (opt_eager, opt_compiled):
            with opt.skip_synchronize():
                opt.step()
        assert torch.equal(compiled.weight, eager.weight)
        shared_weights_agree(compiled, f"la.compiled.{step}")
    assert moved_steps >= 4
