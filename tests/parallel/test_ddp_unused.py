"""The DDP hook under DDP's other graph modes: ``find_unused_parameters=True`` (DDP keeps
its first buckets, so the hook is sparse from the first iteration) and
``static_graph=True``, against DDP's own allreduce; exact resume; and a layout saved in
one mode refused by the other (launched by torchrun, Gloo)."""

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook
from tests.ddp_models import gather

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
# One weight per bucket (each over bucket_cap_mb), told apart by its size; the last is
# never used, as a model with a frozen or skipped branch has.
SIZES = (8000, 9000, 10000, 11000)
UNUSED = 3


class ExactWeights(torch.nn.Module):
    """d(loss)/d(weights[i]) is the given tensor exactly, for every weight but the
    unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in SIZES)

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        terms = [(w * g).sum() for i, (w, g) in enumerate(zip(self.weights, grads)) if i != UNUSED]
        return torch.stack(terms).sum()


def local_grads(step: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(1000 * step + RANK)
    return [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in SIZES]


def make_model(state, **ddp_options) -> DistributedDataParallel:
    model = DistributedDataParallel(ExactWeights(), bucket_cap_mb=0.03, **ddp_options)
    if state is not None:
        model.register_comm_hook(state, sparse_allreduce_hook)
    return model


def reduced(model: DistributedDataParallel, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad()
    model(grads).backward()
    return [
        torch.zeros(n) if w.grad is None else w.grad.detach().clone()
        for n, w in zip(SIZES, model.module.weights)
    ]


@pytest.mark.parametrize("graph", ["find_unused_parameters", "static_graph"])
def test_density_one_equals_ddp_default_allreduce(graph):
    default = make_model(None, **{graph: True})
    hooked = make_model(SparseState(density=1.0, min_sparse_numel=0), **{graph: True})
    for step in range(4):
        grads = local_grads(step)
        for got, expected in zip(reduced(hooked, grads), reduced(default, grads)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_find_unused_parameters_is_sparse_from_the_first_iteration_and_keeps_the_mass():
    state = SparseState(density=0.02, min_sparse_numel=0)
    model = make_model(state, find_unused_parameters=True)
    before = {n: np.zeros(n, np.float32) for n in SIZES}
    for step in range(5):
        grads = local_grads(step)
        got = reduced(model, grads)
        stats = state.stats()
        assert stats.sparse_buckets == len(SIZES) and stats.dense_buckets == 0, stats
        residuals = {r.numel: r.residual.numpy().copy() for r in state.reducers.values()}
        assert sorted(residuals) == sorted(SIZES)
        for i, n in enumerate(SIZES):
            sent = np.zeros(n, np.float32) if i == UNUSED else grads[i].numpy()
            owed = np.sum(gather(torch.from_numpy(before[n] + sent)), axis=0)
            after = np.sum(gather(torch.from_numpy(residuals[n])), axis=0)
            # Every rank: residuals after plus P times the average is what was owed.
            np.testing.assert_allclose(after + SIZE * got[i].numpy(), owed, atol=1e-4)
            if i == UNUSED:
                assert not residuals[n].any() and not got[i].any()
            else:
                assert 0 < np.count_nonzero(got[i].numpy()) < n // 4
            for row in gather(got[i]):
                np.testing.assert_array_equal(row, got[i].numpy())  # every rank alike
        before = residuals


@pytest.mark.parametrize("graph", ["find_unused_parameters", "static_graph"])
def test_a_checkpoint_resumes_exactly_and_refuses_the_other_mode(graph):
    def run(state, steps, model=None):
        model = model or make_model(state, **{graph: True})
        results = [reduced(model, local_grads(step)) for step in steps]
        return model, results

    state = SparseState(density=0.02, min_sparse_numel=0, momentum=0.9)
    model, _ = run(state, range(3))
    saved = io.BytesIO()
    torch.save(state.state_dict(), saved)
    _, uninterrupted = run(state, range(3, 6), model)

    saved.seek(0)
    resumed = SparseState(density=0.02, min_sparse_numel=0, momentum=0.9)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    _, again = run(resumed, range(3, 6))
    for want, got in zip(uninterrupted, again):
        for a, b in zip(want, got):
            assert torch.equal(a, b)

    saved.seek(0)
    other = SparseState(density=0.02, min_sparse_numel=0, momentum=0.9)
    other.load_state_dict(torch.load(saved, weights_only=True))
    # (Not the default mode: its first backward never completes a bucket when a
    # parameter is unused.)
    other_graph = {"find_unused_parameters": "static_graph"}.get(graph, "find_unused_parameters")
    flipped = {other_graph: True}
    with pytest.raises(RuntimeError, match="same find_unused_parameters and static_graph"):
        reduced(make_model(other, **flipped), local_grads(3))


@pytest.mark.parametrize("graph", ["find_unused_parameters", "static_graph"])
def test_no_mass_is_lost_across_the_bucket_rebuilds(graph):
    """Positive gradients, so that any mass dropped or counted twice shows in the sum:
    static_graph's whole bucket goes sparse in its second iteration and its residual is
    cut into the rebuilt buckets at the third."""
    state = SparseState(density=0.02, min_sparse_numel=0)
    model = make_model(state, **{graph: True})
    owed_before = 0.0
    for step in range(6):
        grads = [g.abs() + 0.1 for g in local_grads(step)]
        got = reduced(model, grads)
        sent = sum(float(g.sum()) for i, g in enumerate(grads) if i != UNUSED)
        kept = sum(float(r.residual.sum()) for r in state.reducers.values())
        out = SIZE * sum(float(g.sum()) for g in got)
        totals = torch.tensor([owed_before + sent, kept], dtype=torch.float64)
        dist.all_reduce(totals)
        owed, kept_everywhere = totals.tolist()
        assert abs(kept_everywhere + out - owed) <= 1e-5 * owed, (step, kept_everywhere, out, owed)
        owed_before = kept
    assert len(state.reducers) == len(SIZES)  # rebuilt (static_graph) or fixed: one each
