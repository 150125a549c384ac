"""The optimizer on a process set smaller than the world."""

import os

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds

# A 2-rank subset when the world has 3 or more ranks; a 1-rank subset at world size 2
# (a process set equal to the global one cannot be registered).

_world = int(os.environ["HOROVOD_SPARSE_TEST_WORLD_SIZE"])
SUBSET = [0, 1] if _world >= 3 else [0]
subset = hvd.ProcessSet(SUBSET)
hvd.init(process_sets=[subset])


def test_optimizer_on_a_subset_matches_dense_on_that_subset():
    try:
        if hvd.rank() in SUBSET:  # ranks outside the set take no part, as with Horovod
            run_on_subset()
    finally:
        # Ranks outside the set must outlive the set's work: a rank that shuts Horovod
        # down early unregisters the process set on the others.
        hvd.barrier()


def run_on_subset():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        process_set=subset,
        density=1.0,
    )
    g = torch.Generator().manual_seed(hvd.rank())
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.synchronize()
    for n, p in model.named_parameters():
        dense = hvd.allreduce(grads[n], name=f"ps.{n}", process_set=subset)
        torch.testing.assert_close(p.grad, dense, rtol=1e-6, atol=1e-7)
    # Sparse on the subset: parameters stay identical inside it.
    opt2 = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        process_set=subset,
        density=0.05,
    )
    for _step in range(5):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt2.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.reshape(1, -1), name="ps.params", process_set=subset)
    for row in everyone:
        assert torch.equal(row, flat)
    assert opt2.stats().selected > 0
