"""The DDP hook's residual lookahead (``state.residual_lookahead(optimizer)``): each
training forward runs at the shared parameters moved by lr times the update pending in
this rank's residuals, the step puts the shared parameters back, and the ranks' shared
parameters stay identical (launched by torchrun, Gloo)."""

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
BETAS, LR, WD = (0.9, 0.999), 1e-2, 0.05


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


class Recorded:
    """The hook, recording each DDP bucket's parameters in buffer order."""

    def __init__(self) -> None:
        self.buckets: dict[int, list[torch.Tensor]] = {}

    def hook(
        self, state: SparseState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        self.buckets[bucket.index()] = list(bucket.parameters())
        return sparse_allreduce_hook(state, bucket)


def small_run(state: SparseState, lookahead: bool = True):
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallNet(), bucket_cap_mb=0.03)  # several buckets
    recorded = Recorded()
    model.register_comm_hook(state, recorded.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    if lookahead:
        state.residual_lookahead(optimizer)
    return model, optimizer, recorded


def step_once(model, optimizer, step: int) -> None:
    x, y = batch(step)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def expected_lookahead(state: SparseState, recorded: Recorded, lr: float) -> dict:
    """Each parameter of a sparse bucket moved by lr times its slice of the bucket's
    residual (P * postscale = 1 for the hook's average); the others unmoved."""
    moved = {}
    for index, params in recorded.buckets.items():
        reducer = state.reducers.get(index)
        offset = 0
        for p in params:
            if reducer is not None and not reducer.residual_clear:
                pending = reducer.residual[offset : offset + p.numel()].view_as(p)
                moved[p] = torch.sub(p.detach(), pending, alpha=lr)
            offset += p.numel()
    return moved


@pytest.mark.parametrize("correction", ["adam", "momentum"])
def test_each_forward_runs_where_the_pending_residual_takes_the_parameters(correction):
    options = {"betas": BETAS} if correction == "adam" else {"momentum": 0.9}
    state = SparseState(density=0.05, **options)
    model, optimizer, recorded = small_run(state)
    seen: dict = {}
    model.module.register_forward_pre_hook(
        lambda module, args: seen.update({p: p.detach().clone() for p in module.parameters()})
    )
    without, without_optimizer, _ = small_run(SparseState(density=0.05, **options), False)
    moved_somewhere = False
    for step in range(8):
        if step == 5:
            for group in (*optimizer.param_groups, *without_optimizer.param_groups):
                group["lr"] = LR / 2  # a scheduler: the lookahead takes the lr of its time
        lr = optimizer.param_groups[0]["lr"]
        shared = {p: p.detach().clone() for p in model.parameters()}
        expected = expected_lookahead(state, recorded, lr)
        step_once(model, optimizer, step)
        for p in model.parameters():
            want = expected.get(p, shared[p])
            assert torch.equal(seen[p], want), f"step {step}: {tuple(p.shape)}"
            moved_somewhere |= not torch.equal(want, shared[p])
        # The step put the shared parameters back first: identical on every rank.
        for row in gather(flat(model)):
            assert torch.equal(torch.from_numpy(row), flat(model))
        step_once(without, without_optimizer, step)
    assert moved_somewhere
    # Gradients taken elsewhere: the trajectory differs from the one without the lookahead.
    assert not torch.equal(flat(model), flat(without))


def test_with_gradients_that_do_not_depend_on_the_parameters_it_changes_nothing_shared():
    """Exact's gradient is the input whatever the weight: with and without the
    lookahead the shared parameters follow the same trajectory, bit for bit, while
    every training forward ran at the moved weight."""
    numel = 20_000
    runs = []
    for lookahead in (True, False):
        state = SparseState(density=0.02, momentum=0.9)
        model = DistributedDataParallel(Exact(numel))
        model.register_comm_hook(state, sparse_allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if lookahead:
            state.residual_lookahead(optimizer)
        inside = []
        model.module.register_forward_pre_hook(
            lambda module, args, inside=inside: inside.append(module.weight.detach().clone())
        )
        trajectory = []
        for step in range(6):
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + RANK))
            shared = model.module.weight.detach().clone()
            pending = None if 0 not in state.reducers else state.reducers[0].residual.clone()
            optimizer.zero_grad()
            model(grad).backward()
            optimizer.step()
            if lookahead and pending is not None:
                assert torch.equal(inside[-1], torch.sub(shared, pending, alpha=LR))
                assert not torch.equal(inside[-1], shared)
            else:
                assert torch.equal(inside[-1], shared)
            trajectory.append(model.module.weight.detach().clone())
        runs.append(trajectory)
    for with_lookahead, without in zip(*runs):
        assert torch.equal(with_lookahead, without)


def test_a_forward_without_grad_or_in_eval_mode_does_not_move_the_parameters():
    state = SparseState(density=0.05, betas=BETAS)
    model, optimizer, _ = small_run(state)
    for step in range(3):
        step_once(model, optimizer, step)
    shared = flat(model).clone()
    # A forward under no_grad or in eval() mode does not take the lookahead.
    with torch.no_grad():
        model(batch(9)[0])
    assert torch.equal(flat(model), shared)
    model.eval()
    model(batch(9)[0])
    assert torch.equal(flat(model), shared)
    model.train()
    model(batch(9)[0])  # a training forward: the lookahead was still due
    assert not torch.equal(flat(model), shared)


def test_shared_parameters_and_detach():
    state = SparseState(density=0.05, betas=BETAS)
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallNet(), bucket_cap_mb=0.03)
    model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    lookahead = state.residual_lookahead(optimizer)
    for step in range(3):
        step_once(model, optimizer, step)
    shared = flat(model).clone()
    x, y = batch(3)
    loss = torch.nn.functional.cross_entropy(model(x), y)  # takes the lookahead
    ahead = flat(model).clone()
    assert not torch.equal(ahead, shared)
    with lookahead.shared_parameters():
        assert torch.equal(flat(model), shared)
    assert torch.equal(flat(model), ahead)
    loss.backward()
    optimizer.step()
    lookahead.detach()
    after = flat(model).clone()
    step_once(model, optimizer, 4)  # no lookahead any more: the forward sees the shared
    for row in gather(flat(model)):
        assert torch.equal(torch.from_numpy(row), flat(model))
    assert not torch.equal(after, flat(model))


def test_a_second_call_replaces_the_first():
    state = SparseState(density=0.05, momentum=0.9)
    model, optimizer, recorded = small_run(state)
    for step in range(3):
        step_once(model, optimizer, step)
    state.residual_lookahead(optimizer)  # the first one detached: one move, not two
    expected = expected_lookahead(state, recorded, LR)
    shared = {p: p.detach().clone() for p in model.parameters()}
    model(batch(3)[0])
    for p in model.parameters():
        assert torch.equal(p.detach(), expected.get(p, shared[p]))
    assert any(not torch.equal(expected[p], shared[p]) for p in expected)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), "with momentum"),
        (lambda ps: torch.optim.AdamW(ps, lr=LR), "got AdamW"),
    ],
)
def test_an_optimizer_whose_step_is_not_linear_is_refused(make, match):
    state = SparseState(density=0.05)
    model = DistributedDataParallel(SmallNet())
    model.register_comm_hook(state, sparse_allreduce_hook)
    with pytest.raises(ValueError, match=match):
        state.residual_lookahead(make(model.parameters()))


def test_no_residual_no_lookahead():
    state = SparseState(density=0.05, error_feedback=False)
    model = DistributedDataParallel(SmallNet())
    with pytest.raises(ValueError, match="error_feedback=True"):
        state.residual_lookahead(torch.optim.SGD(model.parameters(), lr=LR))


def test_flush_residuals_lands_where_dense_sgd_does():
    """Exact's gradients do not depend on the weight: after the flush, plain SGD's
    weight is the dense reference p0 - lr * sum over steps of the ranks' mean gradient;
    before it, the residuals still held part of that."""
    numel, steps = 20_000, 6
    state = SparseState(density=0.02)
    model = DistributedDataParallel(Exact(numel))
    model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    lookahead = state.residual_lookahead(optimizer)

    def grad(step: int, rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + rank))

    for step in range(steps):
        optimizer.zero_grad()
        model(grad(step, RANK)).backward()
        optimizer.step()
    dense = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        dense -= LR * sum(grad(step, r).double() for r in range(SIZE)) / SIZE
    weight = model.module.weight
    assert (weight.detach().double() - dense).abs().max() > 1e-3  # owed before the flush
    assert lookahead.flush_residuals() == numel
    torch.testing.assert_close(weight.detach().double(), dense, rtol=0, atol=1e-6)
    assert not state.reducers[0].residual.any()
    for row in gather(weight.detach()):
        assert torch.equal(torch.from_numpy(row), weight.detach())


def test_flush_residuals_moves_by_every_ranks_residual_with_adam_in_the_hook():
    state = SparseState(density=0.05, betas=BETAS)
    model, optimizer, recorded = small_run(state, lookahead=False)
    lookahead = state.residual_lookahead(optimizer)
    for step in range(4):
        step_once(model, optimizer, step)
    gathered = {i: gather(r.residual) for i, r in state.reducers.items()}
    assert any(row.any() for rows in gathered.values() for row in rows)
    before = {p: p.detach().double().clone() for p in model.parameters()}
    lookahead.flush_residuals()
    for index, params in recorded.buckets.items():
        offset = 0
        summed = torch.from_numpy(sum(gathered[index])).double()
        for p in params:
            piece = summed[offset : offset + p.numel()].view_as(p)
            expected = before[p] - LR * state.postscale(index) * piece
            torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-6)
            offset += p.numel()
        assert not state.reducers[index].residual.any()
    for row in gather(flat(model)):
        assert torch.equal(torch.from_numpy(row), flat(model))
    step_once(model, optimizer, 9)  # training goes on from the flushed parameters
    for row in gather(flat(model)):
        assert torch.equal(torch.from_numpy(row), flat(model))
