"""Horovod's documented optimizer behaviours, each run as the same job under
``hvd.DistributedOptimizer`` and ``horovod_sparse.torch.DistributedOptimizer(density=1.0)``.

At density 1 every result must equal dense Horovod's: parameters, reduced gradients and
optimizer state (rtol 1e-6, atol 1e-7), and bitwise the same on every rank.
``min_sparse_numel=16`` sends the weights of the tiny models below
through the sparse exchange and their biases through the dense fallback, so both paths
are held to the contract.

Each job is a function of a factory ``make(opt, named_parameters, **kw)`` that wraps a
torch optimizer, so one function runs the same job under both optimizers.
"""

import io
import os

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

# The even ranks. At world size 2 that is [0]: a process set equal to the global one
# cannot be registered.
_world = int(os.environ["HOROVOD_SPARSE_TEST_WORLD_SIZE"])
EVEN = list(range(0, _world, 2))
even = hvd.ProcessSet(EVEN)
hvd.init(process_sets=[even])

RTOL, ATOL = 1e-6, 1e-7


def horovod(opt, named_parameters=None, **kw):
    return hvd.DistributedOptimizer(opt, named_parameters=named_parameters, **kw)


def sparse(opt, named_parameters=None, **kw):
    return hvds.DistributedOptimizer(
        opt, named_parameters=named_parameters, density=1.0, min_sparse_numel=16, **kw
    )


def local(opt, named_parameters=None, **kw):
    """No wrapper: what a rank computes on its own."""
    return opt


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    # No momentum: at 3+ ranks the reduction order differs from Horovod's ring, and
    # RMSprop's momentum buffer, a sum of normalised steps that cancel, magnifies those
    # last-bit differences to about 2e-6 relative.
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def net(seed=0):
    torch.manual_seed(seed)  # the same initial weights on every rank, for both optimizers
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def batch(step, n=6):
    g = torch.Generator().manual_seed(1009 * step + hvd.rank())
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def loss_at(model, step):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss_at(model, step).backward()
        opt.step()


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def gradients(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def optimizer_state(opt):
    """Every state entry of every parameter, in parameter order, as tensors."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                if value is not None:
                    out.append((key, torch.as_tensor(value).detach().clone()))
    return out


def assert_same(got, ref):
    assert len(got) == len(ref), (len(got), len(ref))
    for i, (g, r) in enumerate(zip(got, ref)):
        if isinstance(r, tuple):
            assert g[0] == r[0], (i, g[0], r[0])
            g, r = g[1], r[1]
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"[{i}] {m}")


def ranks_agree(result, name):
    """Whether ``result`` is bitwise the same on every rank."""
    tensors = [t[1] if isinstance(t, tuple) else t for t in result]
    mine = [t.detach().reshape(-1) for t in tensors]
    everyone = hvd.allgather_object(mine, name=name)
    return all(
        len(theirs) == len(mine) and all(torch.equal(a, b) for a, b in zip(theirs, mine))
        for theirs in everyone
    )


def compare(job, *args, **kwargs):
    """Run ``job`` under Horovod's optimizer and ours: equal results, the same on every rank."""
    ref = job(horovod, *args, **kwargs)
    got = job(sparse, *args, **kwargs)
    # The collectives first, so that a rank whose results differ cannot leave the others
    # waiting in them.
    ref_agree = ranks_agree(ref, f"agree.{job.__name__}.horovod")
    got_agree = ranks_agree(got, f"agree.{job.__name__}.sparse")
    assert_same(got, ref)
    assert ref_agree, "hvd.DistributedOptimizer: ranks differ"
    assert got_agree, "ranks differ"
    return ref, got


# broadcast_parameters and broadcast_optimizer_state


def broadcast_after_a_step(make, build):
    model = net()
    opt = make(build(model.parameters()), model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, opt, range(1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after_broadcast = optimizer_state(opt)
    train(model, opt, range(1, 3))
    return parameters(model) + after_broadcast + optimizer_state(opt)


@pytest.mark.parametrize("build", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_broadcast_optimizer_state_after_a_step(build):
    compare(broadcast_after_a_step, build)


def saved_on_rank_zero(build):
    """A checkpoint as rank 0 would have written it: a model and its optimizer, one step on."""
    model = net(seed=1)
    opt = build(model.parameters())
    opt.zero_grad()
    loss_at(model, 100).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    return buffer.getvalue()


def restore_on_rank_zero(make, build, checkpoint, parameters_again=False):
    model = net()
    opt = make(build(model.parameters()), model.named_parameters())
    if hvd.rank() == 0:
        saved = torch.load(io.BytesIO(checkpoint))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if parameters_again:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, opt, range(2))
    return parameters(model) + optimizer_state(opt)


# broadcast_optimizer_state creates a fresh optimizer's state with one local step on zero
# gradients, here on the ranks other than 0 only, after broadcast_parameters. AdamW's
# decoupled weight decay and ASGD's decay move parameters even in that step: with Horovod's
# optimizer those ranks then no longer hold rank 0's parameters. Ours leaves parameters
# as they were in that step, so it is held to Horovod's job that broadcasts the parameters
# once more after the optimizer state, the same on every rank.
DECAY_ON_ZERO_GRADIENTS = {"adamw", "asgd"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_restore_on_rank_zero_then_broadcast(name):
    build = OPTIMIZERS[name]
    checkpoint = saved_on_rank_zero(build) if hvd.rank() == 0 else None
    again = name in DECAY_ON_ZERO_GRADIENTS
    ref = restore_on_rank_zero(horovod, build, checkpoint, parameters_again=again)
    got = restore_on_rank_zero(sparse, build, checkpoint)
    ref_agree = ranks_agree(ref, f"restore.{name}.horovod")
    got_agree = ranks_agree(got, f"restore.{name}.sparse")
    assert_same(got, ref)
    assert ref_agree, "hvd.DistributedOptimizer: ranks differ"
    assert got_agree, "ranks differ"


# Hyperparameters follow rank 0


def hyperparameters_from_rank_zero(make):
    model = net()
    lr, momentum = (0.1, 0.8) if hvd.rank() == 0 else (0.2, 0.9)
    opt = make(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), model.named_parameters()
    )
    train(model, opt, range(1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for group in opt.param_groups:
        assert (group["lr"], group["momentum"]) == (0.1, 0.8)
    train(model, opt, range(1, 3))
    return parameters(model) + optimizer_state(opt)


def test_broadcast_optimizer_state_sets_rank_zero_hyperparameters():
    compare(hyperparameters_from_rank_zero)


# backward_passes_per_step


def two_backward_passes_per_step(make):
    model = net()
    opt = make(sgd(model.parameters()), model.named_parameters(), backward_passes_per_step=2)
    reduced = []
    for step in range(3):
        opt.zero_grad()
        loss_at(model, 2 * step).backward()
        loss_at(model, 2 * step + 1).backward()
        opt.step()
        reduced += gradients(model)
    return parameters(model) + reduced


def test_backward_passes_per_step_two():
    compare(two_backward_passes_per_step)


# groups and num_groups

GROUPINGS = {
    "weights_together": lambda model: {"groups": [[model[0].weight, model[2].weight]]},
    "groups_2": lambda model: {"groups": 2},
    "num_groups_2": lambda model: {"num_groups": 2},
}


def three_sgd_steps(make, options_of=lambda model: {}):
    """Three SGD steps with the optimizer options ``options_of(model)``; the parameters,
    then the reduced gradients of each step."""
    model = net()
    opt = make(sgd(model.parameters()), model.named_parameters(), **options_of(model))
    reduced = []
    for step in range(3):
        opt.zero_grad()
        loss_at(model, step).backward()
        opt.step()
        reduced += gradients(model)
    return parameters(model) + reduced


def grouped(make, grouping):
    return three_sgd_steps(make, grouping)


@pytest.mark.filterwarnings("ignore:Parameter `num_groups`:DeprecationWarning")
@pytest.mark.parametrize("grouping", GROUPINGS.values(), ids=GROUPINGS.keys())
def test_groups(grouping):
    compare(grouped, grouping)


# Process sets


def on_even_ranks(make):
    model = net()
    opt = make(sgd(model.parameters()), model.named_parameters(), process_set=even)
    train(model, opt, range(3))
    return parameters(model)


def test_process_set_of_even_ranks_built_on_every_rank():
    """Members reduce over the set; the others step on their own gradients, with no
    collective, as Horovod's optimizer does."""
    try:
        ref = on_even_ranks(horovod)
        got = on_even_ranks(sparse)
        if even.included():
            flat = torch.cat([p.reshape(-1) for p in got]).reshape(1, -1)
            rows = hvd.allgather(flat, name="even.parameters", process_set=even)
            assert_same(got, ref)
            for row in rows:
                assert torch.equal(row, flat[0])
        else:
            assert_same(got, ref)
            assert_same(got, on_even_ranks(local))
    finally:
        # Ranks outside the set must outlive the set's work: a rank that shuts Horovod
        # down early unregisters the process set on the others.
        hvd.barrier()


# Compression


def fp16_compressed(make):
    return three_sgd_steps(make, lambda model: {"compression": hvd.Compression.fp16})


def test_fp16_compression():
    """At 2 ranks the first step equals Horovod's (at 3 and 4 the fp16 sums run in
    another order, so they agree to one fp16 rounding). After it the sparse optimizer
    differs on purpose:
    on its sparse buckets the fp16 rounding of a step stays in the residual and is sent
    with the next step (no mass dropped), where Horovod discards it. The difference is
    then one fp16 rounding of the gradients (measured: 2.3e-5 in the parameters,
    one fp16 ulp in a reduced gradient)."""
    ref = fp16_compressed(horovod)
    got = fp16_compressed(sparse)
    ref_agree = ranks_agree(ref, "agree.fp16.horovod")
    got_agree = ranks_agree(got, "agree.fp16.sparse")
    params = len(list(net().parameters()))
    first_step = slice(params, 2 * params)
    if hvd.size() == 2:  # one addition: the same fp16 sum, bit for bit
        assert_same(got[first_step], ref[first_step])
    # One fp16 rounding: a relative 2**-10 (a reduced gradient may land one fp16 ulp
    # away, measured 1.2e-4 at 0.13), plus 1e-4 absolute near zero.
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=2**-10, atol=1e-4)
    assert ref_agree, "hvd.DistributedOptimizer: ranks differ"
    assert got_agree, "ranks differ"


# Gradient clipping between synchronize() and step()

MAX_NORM = 0.1


def clipped(make):
    model = net()
    opt = make(sgd(model.parameters()), model.named_parameters())
    reduced, norms = [], []
    for step in range(3):
        opt.zero_grad()
        loss_at(model, step).backward()
        opt.synchronize()
        reduced += gradients(model)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        with opt.skip_synchronize():
            opt.step()
    return parameters(model) + reduced + norms


def test_synchronize_clip_then_step_under_skip_synchronize():
    ref, _ = compare(clipped)
    assert all(float(norm) > MAX_NORM for norm in ref[-3:])  # clipping did act


# Unused and frozen parameters


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.extra = torch.nn.Linear(8, 4)

    def forward(self, x, use_extra):
        h = torch.tanh(self.body(x))
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def with_unused_layer(make):
    model = Branchy()
    opt = make(sgd(model.parameters()), model.named_parameters())
    for step in range(3):
        x, y = batch(step)
        # Even ranks use the extra layer in the first two steps; no rank in the third.
        use_extra = hvd.rank() % 2 == 0 and step < 2
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, use_extra), y).backward()
        opt.step()
    return parameters(model)


def test_parameters_unused_on_some_ranks():
    compare(with_unused_layer)


def frozen_after_construction(make):
    model = net()
    opt = make(sgd(model.parameters()), model.named_parameters())
    train(model, opt, range(1))
    model[0].weight.requires_grad_(False)
    train(model, opt, range(1, 3))
    model[0].weight.requires_grad_(True)
    train(model, opt, range(3, 4))
    return parameters(model) + optimizer_state(opt)


def test_parameters_frozen_after_construction():
    """Horovod's optimizer still reduces a zero gradient for a parameter frozen after it was
    built, so SGD's momentum keeps moving that parameter."""
    compare(frozen_after_construction)


# Names


def test_duplicate_names_raise_value_error_on_every_rank():
    for make in (horovod, sparse):
        model = net()
        named = [("same", p) for p in model.parameters()]
        with pytest.raises(ValueError, match=r"(?i)duplicate"):
            make(sgd(model.parameters()), named)
    # Every rank is still in step.
    assert float(hvd.allreduce(torch.ones(1), name="after.duplicates")) == 1.0


def two_param_groups(model):
    return torch.optim.SGD(
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "lr": 0.05},
        ],
        lr=0.1,
        momentum=0.9,
    )


def without_names(make):
    model = net()
    opt = make(two_param_groups(model), None)
    train(model, opt, range(3))
    return parameters(model) + optimizer_state(opt)


def test_without_named_parameters():
    compare(without_names)


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_parameter_names_as_horovod(named):
    names = []
    for make in (horovod, sparse):
        model = net()
        opt = make(two_param_groups(model), model.named_parameters() if named else None)
        assert set(opt._parameter_names) == set(model.parameters())
        names.append([opt._parameter_names[p] for p in model.parameters()])
    assert names[1] == names[0]


# Sparse embedding gradients

EMBEDDING_CASES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), False),
    "sparse_adam": (lambda ps: torch.optim.SparseAdam(ps, lr=0.01), False),
    "sgd_sparse_as_dense": (lambda ps: torch.optim.SGD(ps, lr=0.1), True),
    "sparse_adam_sparse_as_dense": (lambda ps: torch.optim.SparseAdam(ps, lr=0.01), True),
}


def embedding_job(make, build, sparse_as_dense):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 4, sparse=True)
    opt = make(build(emb.parameters()), emb.named_parameters(), sparse_as_dense=sparse_as_dense)
    reduced = []
    for step in range(3):
        g = torch.Generator().manual_seed(1009 * step + hvd.rank())
        rows = torch.randint(0, 20, (6,), generator=g)  # repeats within and across ranks
        target = torch.randn(6, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(emb(rows), target).backward()
        opt.step()
        assert emb.weight.grad.is_sparse
        reduced.append(emb.weight.grad.to_dense())
    return [emb.weight.detach().clone(), *reduced]


@pytest.mark.parametrize("case", EMBEDDING_CASES.values(), ids=EMBEDDING_CASES.keys())
def test_sparse_embedding_gradients(case):
    build, sparse_as_dense = case
    compare(embedding_job, build, sparse_as_dense)
