"""What users of ``hvd.DistributedOptimizer`` do, with the sparse optimizer below density 1.

Each test is a job as a user writes it: Horovod's own functions
(``broadcast_parameters``, ``broadcast_optimizer_state``), process sets, a model whose
tensors are all small. None may hang, and ranks must end with identical parameters.
"""

import copy
import io
import os
import warnings

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

_world = int(os.environ["HOROVOD_SPARSE_TEST_WORLD_SIZE"])
EVEN = list(range(0, _world, 2))
even_ranks = hvd.ProcessSet(EVEN)
hvd.init(process_sets=[even_ranks])


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 64x64 weights (4096 entries) go sparse; biases and the last layer stay dense.
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(model, opt, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_same_on_every_rank(tensor: torch.Tensor, name: str, process_set=None) -> None:
    process_set = process_set or hvd.global_process_set
    everyone = hvd.allgather(tensor.reshape(1, -1), name=name, process_set=process_set)
    for row in everyone:
        assert torch.equal(row, tensor), f"{name}: ranks differ"


def torch_state(opt) -> torch.Tensor:
    """Every tensor of the wrapped optimizer's own state, flat, in parameter order."""
    parts = []
    for group in opt.param_groups:
        for p in group["params"]:
            for _key, value in sorted(opt.state.get(p, {}).items()):
                parts.append(torch.as_tensor(value, dtype=torch.float64).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


CONFIGS = {
    "sgd_corrected": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), {}),
    "sgd_uncorrected": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        {"momentum_correction": False},
    ),
    "adam_corrected": (lambda ps: torch.optim.Adam(ps, lr=1e-3), {}),
    "sgd_overlap": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), {"overlap": True}),
    "adamw_scheduler": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        {"scheduler": "auto", "scheduler_steps": 2},
    ),
}


def build(config: str, seed: int = 0, density: float = 0.01):
    make_opt, extra = CONFIGS[config]
    extra = dict(extra)
    model = mlp(seed)
    if extra.pop("overlap", False):
        extra.update(overlap_allgather=True, model=model)
    opt = hvds.DistributedOptimizer(
        make_opt(model.parameters()), model.named_parameters(), density=density, **extra
    )
    return model, opt


@pytest.mark.parametrize("config", CONFIGS)
def test_rank0_restore_then_horovod_broadcasts(config):
    """Rank 0 resumes from its checkpoint, the others start fresh; Horovod's broadcast
    functions then make every rank rank 0's, and training continues without a hang."""
    model, opt = build(config)
    train(model, opt, 3)
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    expected_state = torch_state(opt)
    assert expected_state.numel() > 0  # the correction's state is in the torch state
    if opt.momentum_correction:
        assert all(opt.state[p] for p in model.parameters())

    # A new job: rank 0 loads, every other rank starts from another initialisation.
    model, opt = build(config, seed=hvd.rank())
    if hvd.rank() == 0:
        model.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # Rank 0 alone loaded residuals (settled within the broadcast, where every rank
    # meets): it keeps all of them, the fresh ranks owe nothing, so the mass counts once.
    saved = checkpoint[1].get("horovod_sparse", {}).get("buckets", {})
    for name, residual in opt.residuals().items():
        if hvd.rank() == 0:
            assert torch.equal(residual, saved[name]["residual"]), name
        else:
            assert not residual.any(), name
    state = torch_state(opt)
    if hvd.rank() == 0:
        assert torch.equal(state, expected_state)
    assert_same_on_every_rank(state, f"restore.state.{config}")
    assert_same_on_every_rank(flat_params(model), f"restore.params0.{config}")

    train(model, opt, 4, first=3)
    opt.flush()
    assert_same_on_every_rank(flat_params(model), f"restore.params.{config}")
    assert opt.stats().selected > 0


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_carries_hyperparameters(kind):
    """Ranks built with different hyperparameters: after Horovod's broadcast every rank
    has rank 0's, the correction follows them, and parameters stay identical."""
    model = mlp()
    if kind == "sgd":
        lr, momentum = (0.1, 0.8) if hvd.rank() == 0 else (0.2, 0.9)
        wrapped = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    else:
        lr, betas = (1e-3, (0.8, 0.99)) if hvd.rank() == 0 else (2e-3, (0.9, 0.999))
        wrapped = torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    opt = hvds.DistributedOptimizer(wrapped, model.named_parameters(), density=0.01)
    assert opt.momentum_correction
    train(model, opt, 1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    group = opt.param_groups[0]
    if kind == "sgd":
        assert (group["lr"], group["momentum"]) == (0.1, 0.8)
    else:
        assert group["lr"] == 1e-3 and tuple(group["betas"]) == (0.8, 0.99)
    assert_same_on_every_rank(torch_state(opt), f"hyper.state.{kind}")
    train(model, opt, 4, first=1)
    assert_same_on_every_rank(flat_params(model), f"hyper.params.{kind}")
    # The momentum-corrected step used rank 0's hyperparameters on every rank.
    assert opt.param_groups[0]["lr"] == (0.1 if kind == "sgd" else 1e-3)


def test_ranks_outside_the_process_set_step_locally():
    """Built on every rank with the even ranks' process set: the members reduce among
    themselves; every other rank steps on its own gradients, with no collective."""
    model = mlp()
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        density=0.01,
        process_set=even_ranks,
    )
    try:
        if hvd.rank() in EVEN:
            train(model, opt, 4)
            assert opt.stats().selected > 0
            assert_same_on_every_rank(flat_params(model), "ps.params", even_ranks)
        else:
            reference = mlp()
            local = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
            train(model, opt, 4)
            train(reference, local, 4)
            assert torch.equal(flat_params(model), flat_params(reference))
            assert not opt.momentum_correction and opt.stats().selected == 0
    finally:
        hvd.barrier()  # the set's members must finish before any rank shuts down


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_nothing_sparse_means_the_wrapped_optimizers_own_algorithm(kind):
    """density=0.01 on a model whose tensors are all under min_sparse_numel: every step
    is dense, so the result is Horovod's, with no momentum correction."""

    def make(distributed):
        torch.manual_seed(3)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        )
        if kind == "sgd":
            wrapped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            wrapped = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, distributed(wrapped, model.named_parameters())

    sparse_model, sparse_opt = make(lambda o, n: hvds.DistributedOptimizer(o, n, density=0.01))
    dense_model, dense_opt = make(hvd.DistributedOptimizer)
    assert not sparse_opt.momentum_correction
    for step in range(4):
        x, y = batch(step, hvd.rank())
        for model, opt in ((sparse_model, sparse_opt), (dense_model, dense_opt)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model[:3](x), y).backward()
            opt.synchronize()
        # p.grad is the averaged gradient, as with Horovod (not a velocity).
        for p, q in zip(sparse_model.parameters(), dense_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        for opt in (sparse_opt, dense_opt):
            with opt.skip_synchronize():
                opt.step()
    for p, q in zip(sparse_model.parameters(), dense_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_mixed_model_corrects_only_its_sparse_buckets():
    """Small tensors keep the wrapped SGD's own (global, identical) momentum; large ones
    carry a per-rank velocity. Both live in the torch state under momentum_buffer."""
    model = mlp()
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        density=0.01,
    )
    assert opt.momentum_correction
    train(model, opt, 3)
    small = [p for p in model.parameters() if p.numel() < 1024]
    large = [p for p in model.parameters() if p.numel() >= 1024]
    assert small and large
    for p in small + large:
        assert "momentum_buffer" in opt.state[p]
    native = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in small])
    assert_same_on_every_rank(native, "mixed.native")
    assert_same_on_every_rank(flat_params(model), "mixed.params")


def test_adasum_is_refused_on_every_rank_before_any_collective():
    """Only the last rank asks for Adasum: every rank raises, naming it, and none waits."""
    model = mlp()
    op = hvd.Adasum if hvd.rank() == hvd.size() - 1 else hvd.Average
    with pytest.raises(ValueError, match="op=Average and op=Sum"):
        hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=op
        )
    hvd.barrier()  # every rank got here: nothing is left waiting in a collective


def test_loaded_hyperparameters_drive_the_correction():
    """A checkpoint written with momentum 0.5, loaded into an optimizer built with 0.9:
    the correction's velocity then follows 0.5, exactly as the run that wrote it."""

    def build_with(momentum):
        model = mlp()
        wrapped = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
        opt = hvds.DistributedOptimizer(wrapped, model.named_parameters(), density=0.01)
        return model, opt

    model_a, opt_a = build_with(0.5)
    train(model_a, opt_a, 2)
    saved = copy.deepcopy((model_a.state_dict(), opt_a.state_dict()))
    train(model_a, opt_a, 3, first=2)
    model_b, opt_b = build_with(0.9)
    model_b.load_state_dict(saved[0])
    opt_b.load_state_dict(saved[1])
    assert opt_b.param_groups[0]["momentum"] == 0.5 and opt_b.momentum_correction
    train(model_b, opt_b, 3, first=2)
    assert torch.equal(flat_params(model_a), flat_params(model_b))


def test_sparse_gradients_with_overlap_follow_the_plain_trajectory():
    """An embedding with sparse gradients next to dense layers, all-gathers deferred to
    the next forward: the same parameters as without overlap, on every rank."""

    def run(overlap: bool) -> torch.Tensor:
        torch.manual_seed(4)
        embedding = torch.nn.Embedding(300, 16, sparse=True)
        model = torch.nn.Sequential(embedding, torch.nn.Linear(16, 4))
        # Overlap defers the update into the next forward, so it takes no lookahead.
        options = (
            {"overlap_allgather": True, "model": model}
            if overlap
            else {"residual_lookahead": False}
        )
        opt = hvds.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            density=0.01,
            min_sparse_numel=32,
            **options,
        )
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            tokens = torch.randint(0, 300, (8,), generator=g)
            opt.zero_grad()
            model(tokens).pow(2).mean().backward()
            opt.step()
        opt.flush()
        return flat_params(model)

    plain, overlapped = run(False), run(True)
    assert torch.equal(plain, overlapped)
    assert_same_on_every_rank(overlapped, "sparse-grad.overlap")


@pytest.mark.parametrize("config", ["sgd_corrected", "adam_corrected", "sgd_overlap"])
def test_a_gathered_checkpoint_saved_by_rank_zero_resumes_exactly(config):
    """Horovod's pattern, ``if hvd.rank() == 0: torch.save(...)``, with the optimizer's
    state gathered first (``hvds.GatheredState``, called on every rank): every rank
    loads rank 0's file, takes its own residuals and velocities or moments, and the run
    goes on bit for bit as the uninterrupted one, with no residual-sharing warning."""
    model, opt = build(config)
    train(model, opt, 3)
    gathered = hvds.GatheredState(opt).state_dict()  # a collective: every rank
    file = io.BytesIO()
    if hvd.rank() == 0:
        assert sorted(gathered["parts"]) == list(range(hvd.size()))
        torch.save({"model": model.state_dict(), "optimizer": gathered}, file)
    else:
        assert sorted(gathered["parts"]) == [hvd.rank()]  # its own part only
    saved = hvd.broadcast_object(file.getvalue(), root_rank=0, name=f"gathered.{config}")
    train(model, opt, 4, first=3)
    opt.flush()
    uninterrupted = flat_params(model)

    model, opt = build(config, seed=hvd.rank())  # a new job
    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    hvds.GatheredState(opt).load_state_dict(checkpoint["optimizer"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "loaded another rank's residuals"
        train(model, opt, 4, first=3)
        opt.flush()
    assert torch.equal(flat_params(model), uninterrupted)
    assert_same_on_every_rank(uninterrupted, f"gathered.params.{config}")
