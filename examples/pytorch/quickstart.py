"""The README's PyTorch quickstart as a whole program (run it under horovodrun).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/quickstart.py

Fits a small MLP to a fixed random regression task with the sparse optimizer at density
0.01, then checks what a user relies on: the loss fell, every rank holds the same
parameters, and the bytes sent were a few percent of a dense allreduce's.
"""

import horovod.torch as hvd
import torch
from torch.nn import functional

import horovod_sparse.torch as hvds
from horovod_sparse.common.stats import allreduce_ring_bytes


def main() -> None:
    hvd.init()
    torch.manual_seed(0)  # the same task on every rank; each rank takes its own batches
    inputs = torch.randn(4096, 64)
    targets = inputs @ torch.randn(64, 1) + 0.1 * torch.randn(4096, 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    optimizer = hvds.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), density=0.01
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    generator = torch.Generator().manual_seed(1 + hvd.rank())
    losses, moved, dense = [], 0, 0
    for step in range(200):
        batch = torch.randint(0, len(inputs), (64,), generator=generator)
        optimizer.zero_grad()
        loss = functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stats = optimizer.stats()  # this step's figures
        moved += stats.bytes_sent + stats.bytes_received
        dense += stats.dense_bytes
        if step % 50 == 0 and hvd.rank() == 0:
            print(f"step {step:3d} loss {loss.item():.4f} {optimizer.stats()}")
    # After the last step: what the residuals still owe reaches the model (one allreduce).
    moved += sum(allreduce_ring_bytes(optimizer.flush_residuals(), hvd.size(), 4))

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="quickstart.parameters")
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert all(torch.equal(gathered[0], row) for row in gathered), "ranks' parameters differ"
    assert last < 0.5 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"
    # Over every step, the threshold refreshes' histogram allreduces and the flush included.
    assert dense > 10 * moved, (moved, dense)
    if hvd.rank() == 0:
        print(
            f"quickstart OK: loss {first:.4f} -> {last:.4f}, "
            f"{moved / dense:.2%} of dense bytes over {len(losses)} steps, "
            f"parameters identical on {hvd.size()} ranks"
        )


if __name__ == "__main__":
    main()
