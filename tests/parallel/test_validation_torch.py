"""Bad input: a clear error on every rank before any collective of a step, never a hang."""

import math
import time

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds

hvd.init()


def build(model, **kwargs):
    return hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **kwargs
    )


def expect_error_everywhere(make, match):
    start = time.monotonic()
    with pytest.raises((ValueError, TypeError), match=match):
        make()
    assert time.monotonic() - start < 30
    # Every rank got here: a final collective would hang if one had not.
    hvd.allreduce(torch.ones(1), name=f"after.{match}")


def test_different_shapes_on_one_rank():
    width = 8 if hvd.rank() == 0 else 9
    expect_error_everywhere(lambda: build(torch.nn.Linear(4, width)), "differs between")


def test_different_names_on_one_rank():
    model = torch.nn.Linear(4, 4)
    prefix = "a" if hvd.rank() == 0 else "b"
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    expect_error_everywhere(
        lambda: hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named),
        "differs between",
    )


def test_different_dtype_on_one_rank():
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    expect_error_everywhere(lambda: build(torch.nn.Linear(4, 4).to(dtype)), "differs between")


def test_different_parameter_count_on_one_rank():
    extra = [torch.nn.Linear(4, 4)] if hvd.rank() == 0 else []
    expect_error_everywhere(
        lambda: build(torch.nn.Sequential(torch.nn.Linear(4, 4), *extra)), "parameters"
    )


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan])
def test_density_out_of_range_on_one_rank_only(bad):
    density = bad if hvd.rank() == hvd.size() - 1 else 0.01
    expect_error_everywhere(lambda: build(torch.nn.Linear(4, 4), density=density), "density")


def test_empty_parameter_list():
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    expect_error_everywhere(lambda: build(frozen), "no parameters")


def test_complex_parameters_are_refused():
    model = torch.nn.Linear(4, 4).to(torch.complex64)
    expect_error_everywhere(lambda: build(model), "floating point")


def test_bfloat16_is_refused_with_advice():
    expect_error_everywhere(lambda: build(torch.nn.Linear(4, 4).bfloat16()), "bfloat16")


@pytest.mark.parametrize("selection", ["exact", "threshold"])
def test_nan_reaches_parameters_as_with_dense_horovod(selection):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    opt = build(model, density=0.05, selection=selection)
    g = torch.randn(64, 64)
    if hvd.rank() == 0:
        g[3, 5] = float("nan")
    model.weight.grad = g
    opt.step()
    assert torch.isnan(model.weight[3, 5])  # on every rank, like dense Horovod
    assert int(torch.isnan(model.weight).sum()) == 1


def test_unused_parameter_takes_part_as_zeros():
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    model = torch.nn.ModuleDict({"used": used, "unused": unused})
    opt = build(model, density=1.0)
    if hvd.rank() == 0:  # only rank 0 uses the second layer
        (used(torch.ones(1, 64)).sum() + unused(torch.ones(1, 64)).sum()).backward()
    else:
        used(torch.ones(1, 64)).sum().backward()
    opt.synchronize()
    torch.testing.assert_close(unused.weight.grad, torch.full((64, 64), 1.0 / hvd.size()))
