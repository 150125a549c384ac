"""The README's DDP quickstart as a whole program (run it under torchrun; no Horovod).

    torchrun --standalone --nproc-per-node 2 examples/pytorch/quickstart_ddp.py

Fits a small MLP to a fixed random regression task under ``DistributedDataParallel``
with the sparse hook at density 0.01 and SGD momentum 0.9 run by the hook (momentum
correction: the optimizer itself has none), saves the hook's state with the model halfway and
resumes from it, then checks what a user relies on: the loss fell, every rank holds the
same parameters, and the bytes were a few percent of DDP's allreduce.
"""

import io

import torch
import torch.distributed as dist
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook


def make_model(state: SparseState) -> DistributedDataParallel:
    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model = DistributedDataParallel(net)
    model.register_comm_hook(state, sparse_allreduce_hook)
    return model


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" with CUDA tensors
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same task on every rank; each rank takes its own batches
    inputs = torch.randn(4096, 64)
    targets = inputs @ torch.randn(64, 1) + 0.1 * torch.randn(4096, 1)

    # Like PowerSGDState (process_group=None: the default group). The momentum is SGD's,
    # run by the hook on each rank's gradient before the exchange; the optimizer has none.
    state = SparseState(density=0.01, momentum=0.9)
    model = make_model(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for step in range(200):
        if step == 100:  # a checkpoint and a resume, as a restarted job would do
            saved = io.BytesIO()
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "hook": state.state_dict(),
                },
                saved,
            )
            saved.seek(0)
            checkpoint = torch.load(saved)
            state = SparseState(density=0.01, momentum=0.9)
            state.load_state_dict(checkpoint["hook"])
            model = make_model(state)
            model.load_state_dict(checkpoint["model"])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
            optimizer.load_state_dict(checkpoint["optimizer"])
        batch = torch.randint(0, len(inputs), (64,), generator=generator)
        optimizer.zero_grad()
        loss = functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0 and rank == 0:
            print(f"step {step:3d} loss {loss.item():.4f} {state.stats()}")

    stats = state.stats()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert all(torch.equal(flat, row) for row in gathered), "ranks' parameters differ"
    assert last < 0.5 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"
    assert stats.compression_ratio > 10, stats
    if rank == 0:
        print(
            f"quickstart OK: loss {first:.4f} -> {last:.4f}, "
            f"{1 / stats.compression_ratio:.2%} of dense bytes, "
            f"parameters identical on {size} ranks"
        )
    # destroy_process_group is no barrier: a rank tearing Gloo down while another is
    # still in its last collective aborted the other ("terminate called without an
    # active exception") in 7 of 36 runs of quickstart_ddp.py; 0 of 36 with this barrier.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
