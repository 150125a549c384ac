"""horovod_sparse.torch.ddp: the sparse allreduce as a DDP communication hook, on
torch.distributed with Gloo (launched by torchrun), against DDP's own allreduce and the
shared NumPy reference."""

import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.common.config import budget
from horovod_sparse.torch.ddp import GatheredState, SparseState, sparse_allreduce_hook
from tests.ddp_models import Exact, gather
from tests.reference import reference_step, uniform_boundaries

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


def local_grad(step: int, numel: int) -> torch.Tensor:
    rng = np.random.default_rng(1000 * step + RANK)
    return torch.from_numpy(rng.standard_normal(numel).astype(np.float32))


def reduced_grad(model: DistributedDataParallel, grad: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(grad).backward()
    return model.module.weight.grad.detach().clone()


def test_density_one_equals_ddp_default_allreduce():
    numel = 5000
    default = DistributedDataParallel(Exact(numel))
    hooked = DistributedDataParallel(Exact(numel))
    hooked.register_comm_hook(SparseState(density=1.0), sparse_allreduce_hook)
    for step in range(4):
        grad = local_grad(step, numel)
        expected, got = reduced_grad(default, grad), reduced_grad(hooked, grad)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("partition", ["uniform", "balanced"])
def test_exact_selection_matches_reference_and_keeps_every_entry(partition):
    numel, density = 20_000, 0.02
    k = budget(numel, density)
    state = SparseState(
        density=density, selection="exact", global_selection="exact", partition=partition
    )
    model = DistributedDataParallel(Exact(numel))
    model.register_comm_hook(state, sparse_allreduce_hook)
    first = local_grad(0, numel)  # iteration 0: DDP's plain average, no residual
    mean = np.mean(gather(first), axis=0)
    np.testing.assert_allclose(reduced_grad(model, first).numpy(), mean, rtol=1e-6, atol=1e-6)
    before = np.zeros(numel, np.float32)
    for step in range(1, 6):
        grad = local_grad(step, numel)
        accumulators = gather(torch.from_numpy(before) + grad)
        boundaries = state.reducers[0].boundaries if step > 1 else uniform_boundaries(numel, SIZE)
        got = reduced_grad(model, grad).numpy()
        after = state.reducers[0].residual.numpy().copy()
        if partition == "uniform":
            expected = reference_step(accumulators, k, boundaries)
            np.testing.assert_array_equal(np.flatnonzero(got), expected.selected)
            np.testing.assert_allclose(got * SIZE, expected.result_sum, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(after, expected.residuals[RANK], rtol=1e-6, atol=1e-6)
        # Every rank: residuals after plus P times the average is what was owed plus sent.
        owed_after = np.sum(gather(torch.from_numpy(after)), axis=0) + SIZE * got
        np.testing.assert_allclose(owed_after, np.sum(accumulators, axis=0), atol=1e-4)
        assert np.count_nonzero(got) <= k + SIZE, np.count_nonzero(got)
        before = after
    assert state.stats().sparse_buckets == 1 and state.iteration == 6


def test_no_sync_accumulation_reduces_the_summed_micro_batches_and_keeps_their_mass():
    """Gradient accumulation: the first micro-batch under ``no_sync`` (DDP calls no hook,
    the gradient stays local), the second reduced. The hook reduces the sum of both: at
    density 1 it equals DDP's own allreduce; sparse, the residuals plus P times the result
    are what every rank owed plus both micro-batches, every step."""
    numel = 20_000
    default, dense_hook, sparse = (DistributedDataParallel(Exact(numel)) for _ in range(3))
    dense_hook.register_comm_hook(SparseState(density=1.0), sparse_allreduce_hook)
    state = SparseState(density=0.02)
    sparse.register_comm_hook(state, sparse_allreduce_hook)

    def accumulated(model: DistributedDataParallel, step: int) -> torch.Tensor:
        model.zero_grad()
        with model.no_sync():
            model(local_grad(step, numel)).backward()
        model(local_grad(100 + step, numel)).backward()
        return model.module.weight.grad.detach().clone()

    before = torch.zeros(numel)
    for step in range(5):
        expected = accumulated(default, step)
        torch.testing.assert_close(accumulated(dense_hook, step), expected, rtol=0, atol=1e-6)
        got = accumulated(sparse, step)
        if step == 0:  # DDP's first iteration: the plain average, nothing kept
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            continue
        owed = np.sum(gather(before + local_grad(step, numel) + local_grad(100 + step, numel)), 0)
        after = state.reducers[0].residual.clone()
        assert 0 < np.count_nonzero(got.numpy()) < numel  # sparse, not dense
        kept_and_sent = np.sum(gather(after), axis=0) + SIZE * got.numpy()
        np.testing.assert_allclose(kept_and_sent, owed, atol=1e-4)
        before = after
    assert state.iteration == 5


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 128)
        self.b = torch.nn.Linear(128, 128)
        self.b2 = torch.nn.Linear(128, 128)
        self.c = torch.nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(torch.tanh(self.b2(hidden)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def train(model, optimizer, steps):
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def make_run(state):
    torch.manual_seed(0)
    # Small buckets: the model's gradients fill several, each with its own residual.
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.03)
    model.register_comm_hook(state, sparse_allreduce_hook)
    # With the hook's momentum correction, the optimizer has none of its own.
    momentum = 0.0 if state is not None and state.momentum else 0.9
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_state_saved_before_any_sparse_step_resumes_densely(momentum):
    """Saved after DDP's first (dense) iteration, the state has no bucket layout yet: the
    resumed instance's first iteration is a dense average, then sparse steps follow.
    With momentum correction, the first iteration's velocity is carried and cut."""
    state = SparseState(density=0.05, min_sparse_numel=5000, momentum=momentum)
    model, optimizer = make_run(state)
    train(model, optimizer, range(1))
    resumed_state = pickle.loads(pickle.dumps(state))
    assert resumed_state.iteration == 1 and resumed_state.layout.buckets == {}
    resumed, resumed_optimizer = make_run(resumed_state)
    resumed.load_state_dict(model.state_dict())
    train(resumed, resumed_optimizer, range(1, 4))
    assert resumed_state.stats().sparse_buckets >= 2 and resumed_state.iteration == 4
    if momentum:
        assert -1 not in resumed_state.velocity  # the whole bucket's, cut into buckets
        assert set(resumed_state.velocity) == set(resumed_state.layout.buckets)
    flat = flat_parameters(resumed)
    for row in gather(flat):
        np.testing.assert_array_equal(row, flat.numpy())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_parameters_identical_and_a_checkpoint_resumes_exactly(momentum):
    state = SparseState(density=0.05, min_sparse_numel=5000, momentum=momentum)
    model, optimizer = make_run(state)
    train(model, optimizer, range(4))
    saved = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "hook": state.state_dict(),
        },
        saved,
    )
    pickled = pickle.dumps(state)  # the hook state pickles too (PowerSGDState does)
    assert len(state.reducers) >= 2, "expected several sparse DDP buckets"
    stats = state.stats()
    numel = sum(p.numel() for p in model.parameters())
    assert stats.numel == numel and stats.dense_buckets >= 1  # a bucket under 5000
    assert stats.sparse_buckets == len(state.reducers)
    assert (stats.bytes_sent + stats.bytes_received) < 0.5 * stats.dense_bytes, stats
    train(model, optimizer, range(4, 8))
    uninterrupted = flat_parameters(model)
    for row in gather(uninterrupted):
        np.testing.assert_array_equal(row, uninterrupted.numpy())  # every rank alike

    for restore in ("state_dict", "pickle"):
        saved.seek(0)
        checkpoint = torch.load(saved, weights_only=True)  # plain tensors and containers
        resumed_state = SparseState(density=0.05, min_sparse_numel=5000, momentum=momentum)
        if restore == "state_dict":
            resumed_state.load_state_dict(checkpoint["hook"])
        else:
            resumed_state = pickle.loads(pickled)
        resumed, resumed_optimizer = make_run(resumed_state)
        resumed.load_state_dict(checkpoint["model"])
        resumed_optimizer.load_state_dict(checkpoint["optimizer"])
        train(resumed, resumed_optimizer, range(4, 8))
        assert torch.equal(flat_parameters(resumed), uninterrupted), restore


def test_a_checkpoint_saved_by_rank_zero_counts_its_residuals_once():
    """Accelerate and Lightning save the hook's state from rank 0 only, and every rank
    loads it. Each rank then takes 1/P of rank 0's residuals, with a warning, so that
    their mass counts once: summed over ranks, the loaded residuals are rank 0's."""
    state = SparseState(density=0.05, min_sparse_numel=5000)
    model, optimizer = make_run(state)
    train(model, optimizer, range(3))
    saved = io.BytesIO()
    torch.save({"hook": state.state_dict()}, saved)
    shipped = [saved.getvalue()]
    dist.broadcast_object_list(shipped, src=0)  # rank 0's checkpoint, on every rank
    checkpoint = torch.load(io.BytesIO(shipped[0]), weights_only=True)
    assert checkpoint["hook"]["rank"] == 0
    resumed = SparseState(density=0.05, min_sparse_numel=5000)
    resumed.load_state_dict(checkpoint["hook"])
    buckets = checkpoint["hook"]["buckets"]
    assert len(buckets) >= 2, "expected several sparse DDP buckets"
    with pytest.warns(UserWarning, match="each takes"):
        for index in sorted(buckets):
            owed = buckets[index]["residual"]
            assert owed.abs().sum() > 0
            loaded = resumed.reducer(index, torch.zeros_like(owed)).residual.clone()
            dist.all_reduce(loaded)  # summed over ranks
            torch.testing.assert_close(loaded, owed, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_gathered_checkpoint_saved_by_rank_zero_resumes_exactly(momentum):
    """Accelerate and Lightning save from rank 0 only. GatheredState brings every rank's
    residuals and velocities into rank 0's checkpoint, and each rank loads its own part:
    the resumed run is bit for bit the uninterrupted one, with no sharing warning."""
    state = SparseState(density=0.05, min_sparse_numel=5000, momentum=momentum)
    model, optimizer = make_run(state)
    train(model, optimizer, range(4))
    hook = GatheredState(state).state_dict()  # a collective: every rank calls it
    saved = io.BytesIO()
    if RANK == 0:
        assert sorted(hook["parts"]) == list(range(SIZE))
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(dict(checkpoint, hook=hook), saved)
    else:
        assert list(hook["parts"]) == [RANK]  # its own part: only rank 0's is saved
    shipped = [saved.getvalue()]
    dist.broadcast_object_list(shipped, src=0)  # rank 0's file, read by every rank
    train(model, optimizer, range(4, 8))
    uninterrupted = flat_parameters(model)
    checkpoint = torch.load(io.BytesIO(shipped[0]), weights_only=True)
    resumed_state = SparseState(density=0.05, min_sparse_numel=5000, momentum=momentum)
    GatheredState(resumed_state).load_state_dict(checkpoint["hook"])
    resumed, resumed_optimizer = make_run(resumed_state)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own residuals: nothing to share out
        train(resumed, resumed_optimizer, range(4, 8))
    assert torch.equal(flat_parameters(resumed), uninterrupted)


def test_fp16_values_send_fewer_bytes_and_keep_every_entry():
    """fp16 values on the first sparse iteration: nearly the same entries as fp32 (the
    global selection ranks owner sums of rounded values, so an entry at the threshold
    may change), equal values to fp16 rounding, fewer bytes (rows of 6 bytes instead of
    8; the global threshold's histogram allreduces are the same size, so the total is
    about 0.89x here, not 0.75x). The rounding stays in the residuals, so the invariant
    holds at every iteration as tightly as without fp16."""
    numel, density = 20_000, 0.02
    options = dict(density=density, selection="exact", global_selection="exact")
    runs = {}
    for fp16 in (False, True):
        state = SparseState(fp16_values=fp16, **options)
        model = DistributedDataParallel(Exact(numel))
        model.register_comm_hook(state, sparse_allreduce_hook)
        reduced_grad(model, local_grad(0, numel))  # iteration 0: dense
        runs[fp16] = (state, model)
    grad = local_grad(1, numel)
    full, half = (reduced_grad(runs[fp16][1], grad) for fp16 in (False, True))
    chosen_half, chosen_full = np.flatnonzero(half.numpy()), np.flatnonzero(full.numpy())
    common = np.intersect1d(chosen_half, chosen_full)
    assert len(common) >= 0.98 * max(len(chosen_half), len(chosen_full)), (
        len(common),
        len(chosen_half),
        len(chosen_full),
    )
    torch.testing.assert_close(half[common], full[common], rtol=2e-3, atol=1e-6)
    assert not torch.equal(half, full)  # fp16 did round something
    full_stats, half_stats = (runs[fp16][0].stats() for fp16 in (False, True))
    assert half_stats.bytes_sent <= 0.9 * full_stats.bytes_sent, (
        half_stats.bytes_sent,
        full_stats.bytes_sent,
    )

    state, model = runs[True]
    before = state.reducers[0].residual.numpy().copy()
    for step in range(2, 6):
        grad = local_grad(step, numel)
        owed = np.sum(gather(torch.from_numpy(before) + grad), axis=0)
        got = reduced_grad(model, grad).numpy()
        after = state.reducers[0].residual.numpy().copy()
        owed_after = np.sum(gather(torch.from_numpy(after)), axis=0) + SIZE * got
        np.testing.assert_allclose(owed_after, owed, atol=1e-4)
        before = after
    restored = pickle.loads(pickle.dumps(state))
    assert restored.fp16_values and restored.reducers == {}
    with pytest.raises(TypeError, match="fp16_values"):
        SparseState(fp16_values="yes")


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_at_density_one_equals_momentum_sgd(nesterov):
    """The hook's momentum with a momentum-free SGD steps as DDP's default allreduce with
    SGD's own momentum, over several buckets and steps (momentum is linear)."""
    torch.manual_seed(0)
    default = DistributedDataParallel(Net(), bucket_cap_mb=0.03)
    plain = torch.optim.SGD(default.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
    state = SparseState(density=1.0, momentum=0.9, nesterov=nesterov)
    hooked, corrected = make_run(state)
    assert corrected.param_groups[0]["momentum"] == 0.0
    train(default, plain, range(6))
    train(hooked, corrected, range(6))
    torch.testing.assert_close(
        flat_parameters(hooked), flat_parameters(default), rtol=1e-6, atol=1e-6
    )


def test_momentum_velocity_of_the_first_iteration_survives_a_checkpoint():
    """Saved after DDP's first iteration, the only velocity is the whole bucket's. At
    density 1 (momentum SGD up to rounding) the resumed run must follow the
    uninterrupted one: a lost velocity would differ by m·u in every entry."""
    state = SparseState(density=1.0, momentum=0.9)
    model, optimizer = make_run(state)
    train(model, optimizer, range(1))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, saved)
    train(model, optimizer, range(1, 4))
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed_state = SparseState(density=1.0, momentum=0.9)
    resumed_state.load_state_dict(checkpoint["hook"])
    assert set(resumed_state.velocity) == {-1}
    resumed, resumed_optimizer = make_run(resumed_state)
    resumed.load_state_dict(checkpoint["model"])
    train(resumed, resumed_optimizer, range(1, 4))
    torch.testing.assert_close(
        flat_parameters(resumed), flat_parameters(model), rtol=1e-6, atol=1e-6
    )


def test_momentum_correction_exchanges_the_velocity_and_masks_what_it_sent():
    """Exact selection with momentum: each rank's accumulator is residual + m·u + g (u
    the masked velocity); the result equals tests/reference.py on those accumulators;
    the velocity is zero exactly at the rank's local top-k and m·u + g elsewhere."""
    numel, density, momentum = 20_000, 0.02, 0.9
    k = budget(numel, density)
    state = SparseState(
        density=density, selection="exact", global_selection="exact", momentum=momentum
    )
    model = DistributedDataParallel(Exact(numel))
    model.register_comm_hook(state, sparse_allreduce_hook)
    first = local_grad(0, numel)
    np.testing.assert_allclose(
        reduced_grad(model, first).numpy(), np.mean(gather(first), axis=0), rtol=1e-6, atol=1e-6
    )
    before, velocity = np.zeros(numel, np.float32), first.numpy().copy()
    for step in range(1, 5):
        grad = local_grad(step, numel).numpy()
        direction = momentum * velocity + grad
        accumulator = before + direction
        accumulators = gather(torch.from_numpy(accumulator))
        boundaries = state.reducers[0].boundaries if step > 1 else uniform_boundaries(numel, SIZE)
        got = reduced_grad(model, torch.from_numpy(grad)).numpy()
        expected = reference_step(accumulators, k, boundaries)
        np.testing.assert_array_equal(np.flatnonzero(got), expected.selected)
        np.testing.assert_allclose(got * SIZE, expected.result_sum, rtol=1e-5, atol=1e-5)
        after = state.reducers[0].residual.numpy().copy()
        np.testing.assert_allclose(after, expected.residuals[RANK], rtol=1e-6, atol=1e-6)
        sent = np.argpartition(-np.abs(accumulator), k)[:k]
        masked = direction.copy()
        masked[sent] = 0.0
        np.testing.assert_allclose(state.velocity[0].numpy(), masked, rtol=1e-6, atol=1e-6)
        before, velocity = after, state.velocity[0].numpy().copy()


def waiting_hook(state, bucket):
    """The hook made to wait for each bucket before returning, as the hook once did."""
    future = torch.futures.Future()
    future.set_result(sparse_allreduce_hook(state, bucket).wait())
    return future


def train_accumulating(model, optimizer, steps):
    """Two micro-batches per step, the first under no_sync (DDP calls no hook for it)."""
    for step in steps:
        optimizer.zero_grad()
        with model.no_sync():
            x, y = batch(step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        x, y = batch(1000 + step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize(
    "momentum, fp16_values, accumulate",
    [(0.0, False, False), (0.9, True, False), (0.9, False, True)],
)
def test_overlapping_buckets_equal_waiting_for_each(momentum, fp16_values, accumulate):
    """The hook returns each bucket's future unfinished, so buckets' exchanges are in
    flight together; the parameters are bitwise those of the hook waiting on each bucket
    (every rank alike), over sparse steps of several buckets, one of them dense; with
    gradient accumulation under no_sync too."""
    options = dict(density=0.05, min_sparse_numel=5000, momentum=momentum, fp16_values=fp16_values)
    runs = {}
    for hook in (sparse_allreduce_hook, waiting_hook):
        state = SparseState(**options)
        torch.manual_seed(0)
        model = DistributedDataParallel(Net(), bucket_cap_mb=0.03)
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 - momentum)
        (train_accumulating if accumulate else train)(model, optimizer, range(6))
        runs[hook] = (state, model)
    overlapped, waited = runs[sparse_allreduce_hook], runs[waiting_hook]
    assert len(overlapped[0].reducers) >= 2, "expected several sparse DDP buckets"
    assert overlapped[0].stats().dense_buckets >= 1
    assert overlapped[0].max_in_flight >= 2 and waited[0].max_in_flight == 1
    assert overlapped[0].iteration == waited[0].iteration == 6
    sent = [run[0].stats() for run in (overlapped, waited)]
    assert sent[0].bytes_sent == sent[1].bytes_sent and sent[0].numel == sent[1].numel
    flat = flat_parameters(overlapped[1])
    assert torch.equal(flat, flat_parameters(waited[1]))
    for row in gather(flat):
        np.testing.assert_array_equal(row, flat.numpy())  # every rank alike
    for index, reducer in overlapped[0].reducers.items():
        assert torch.equal(reducer.residual, waited[0].reducers[index].residual), index


def test_bad_hook_options_are_refused():
    with pytest.raises(ValueError, match="momentum"):
        SparseState(momentum=1.5)
    with pytest.raises(ValueError, match="nesterov"):
        SparseState(nesterov=True)
    with pytest.raises(TypeError, match="nesterov"):
        SparseState(momentum=0.9, nesterov=1)
