"""``optimizer.flush_residuals()``: every rank's pending update reaches the parameters
with one dense allreduce, the residuals are cleared, and the ranks' parameters stay
identical; with gradients that do not depend on the parameters, plain SGD then lands
where dense SGD does."""

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
NUMEL, LR = 20_000, 0.1


class Exact(torch.nn.Module):
    """d(loss)/d(weight) is the given tensor whatever the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUMEL))
        self.bias = torch.nn.Parameter(torch.zeros(10))  # small: averaged densely

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad).sum() + (self.bias * grad[:10]).sum()


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(optimizer: torch.optim.Optimizer, model: Exact, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        model(gradient(step, RANK)).backward()
        optimizer.step()


def plain_sgd(model: Exact, **options) -> torch.optim.Optimizer:
    return hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model.named_parameters(),
        density=0.02,
        **options,
    )


def identical_on_every_rank(tensor: torch.Tensor, name: str) -> None:
    everyone = hvd.allgather(tensor.detach().reshape(1, -1), name=name)
    assert torch.equal(everyone, tensor.detach().reshape(1, -1).expand_as(everyone))


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no_lookahead"])
def test_plain_sgd_lands_where_dense_sgd_does(lookahead):
    """The dense reference: p0 - lr * sum over steps of the ranks' mean gradient. Before
    the flush the sparse parameters lack the residuals' mass; after it they hold it."""
    steps = 6
    model = Exact()
    optimizer = plain_sgd(model, residual_lookahead=lookahead)
    train(optimizer, model, steps)
    dense = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(steps):
        dense -= LR * sum(gradient(step, r).double() for r in range(SIZE)) / SIZE
    owed = (model.weight.detach().double() - dense).abs().max().item()
    assert owed > 0.1  # what the flush must move: many steps of update per entry
    summed = optimizer.flush_residuals()
    assert summed == NUMEL  # the one sparse bucket (the bias went dense)
    torch.testing.assert_close(model.weight.detach().double(), dense, rtol=0, atol=1e-5)
    for residual in optimizer.residuals().values():
        assert not residual.any()
    identical_on_every_rank(model.weight, f"flush.sgd.{lookahead}")
    # Training goes on from the flushed parameters; a second flush right away moves nothing.
    train(optimizer, model, 2)
    before = model.weight.detach().clone()
    optimizer.flush_residuals()
    assert not torch.equal(model.weight, before)
    flushed = model.weight.detach().clone()
    optimizer.flush_residuals()
    assert torch.equal(model.weight, flushed)
    identical_on_every_rank(model.weight, f"flush.again.{lookahead}")


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
        lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
    ],
    ids=["adamw", "sgd_momentum"],
)
def test_corrected_steps_move_by_every_ranks_residual(make):
    """Momentum correction's step is p -= lr * exchanged: the flush moves each
    parameter by lr * postscale * (the sum of every rank's residual), measured from the
    residuals gathered before it, and leaves the residuals zero."""
    model = Exact()
    optimizer = hvds.DistributedOptimizer(
        make(model.parameters()), model.named_parameters(), density=0.02
    )
    train(optimizer, model, 5)
    (name,) = optimizer.residuals()
    residuals = hvd.allgather(optimizer.residuals()[name].reshape(1, -1), name="flush.res")
    assert residuals.abs().sum() > 0
    before = model.weight.detach().double().clone()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.flush_residuals()
    expected = before - lr * residuals.double().sum(0) / SIZE  # postscale: the average
    torch.testing.assert_close(model.weight.detach().double(), expected, rtol=0, atol=1e-6)
    assert not optimizer.residuals()[name].any()
    identical_on_every_rank(model.weight, "flush.corrected")
    train(optimizer, model, 2)  # the step goes on from there
    identical_on_every_rank(model.weight, "flush.corrected.after")


def test_a_step_that_is_not_linear_is_refused_before_any_collective():
    model = Exact()
    optimizer = hvds.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model.named_parameters(),
        density=0.02,
        momentum_correction=False,
    )
    train(optimizer, model, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="flush_residuals"):
        optimizer.flush_residuals()
    assert torch.equal(model.weight, before)
    train(optimizer, model, 1)  # every rank refused alike: the ranks still step together
    identical_on_every_rank(model.weight, "flush.refused")


def test_without_error_feedback_nothing_waits():
    model = Exact()
    optimizer = plain_sgd(model, error_feedback=False)
    train(optimizer, model, 2)
    before = model.weight.detach().clone()
    assert optimizer.flush_residuals() == 0
    assert torch.equal(model.weight, before)


def test_between_backward_and_step_it_is_refused():
    model = Exact()
    optimizer = plain_sgd(model)
    train(optimizer, model, 1)
    optimizer.zero_grad()
    model(gradient(9, RANK)).backward()
    with pytest.raises(RuntimeError, match="between a backward pass and its step"):
        optimizer.flush_residuals()
    optimizer.step()
    optimizer.flush_residuals()
    identical_on_every_rank(model.weight, "flush.after_refusal")
