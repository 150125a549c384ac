"""Train an MLP on a synthetic teacher-student task with sparse or dense allreduce.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/train_synthetic.py --density 0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/train_synthetic.py --density 1.0

``--density 1.0`` uses Horovod's own ``hvd.DistributedOptimizer`` (dense allreduce);
anything below uses ``horovod_sparse.torch.DistributedOptimizer``. ``--scheduler auto``
lets it choose, per bucket and from measured steps, whether to exchange densely or
sparsely; the summary then says what it chose and on which measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.common.config import SparseConfig, budget
from horovod_sparse.common.stats import allreduce_ring_bytes, settled_reuse

SETTLED = 50  # steps after which the refresh fraction and kept count are summarized


def make_data(rank: int, batches: int, batch_size: int, features: int, classes: int):
    teacher = torch.Generator().manual_seed(1234)  # the same task on every rank
    w1 = torch.randn(features, 64, generator=teacher)
    w2 = torch.randn(64, classes, generator=teacher)
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own shard
    x = torch.randn(batches, batch_size, features, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(-1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=0, help="dense steps first")
    parser.add_argument("--decay-steps", type=int, default=0, help="density decay after warm-up")
    parser.add_argument("--scheduler", choices=("fixed", "auto"), default="fixed")
    parser.add_argument("--json", default=None, help="write a summary here (rank 0)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    features, classes = 128, 10
    model = torch.nn.Sequential(
        torch.nn.Linear(features, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, classes),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    if args.density >= 1.0:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        mode = "dense (hvd.DistributedOptimizer)"
    else:
        optimizer = hvds.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            density=args.density,
            warmup_steps=args.warmup_steps,
            density_decay_steps=args.decay_steps,
            scheduler=args.scheduler,
        )
        mode = f"sparse density={args.density}"
        if args.scheduler == "auto":
            mode += ", scheduler=auto"
    numel = sum(p.numel() for p in model.parameters())
    x, y = make_data(hvd.rank(), 16, args.batch_size, features, classes)

    # k of the sparse tensors (one bucket at the default fusion threshold); smaller
    # tensors are averaged densely and counted whole in stats().selected.
    least = SparseConfig().min_sparse_numel
    sparse_numel = sum(p.numel() for p in model.parameters() if p.numel() >= least)
    sparse_k = budget(sparse_numel, min(args.density, 1.0))
    losses, moved, sent_bytes, message_steps = [], [], [], []
    refreshed, kept = [], []  # per sparse step: did a global threshold refresh; rows kept
    ring = hvd.size() - 1  # a ring collective's message steps, in units of P - 1
    start = time.perf_counter()
    for step in range(args.steps):
        xb, yb = x[step % len(x)], y[step % len(y)]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())
        if args.density >= 1.0:
            sent, received = allreduce_ring_bytes(numel, hvd.size(), 4)
            steps = 2 * ring  # Horovod fuses every gradient into one ring allreduce
        else:
            s = optimizer.stats()
            sent, received = s.bytes_sent, s.bytes_received
            # One alltoall and one allgather for all sparse buckets (join_buckets; at
            # P = 2 one allgather, gather_selections), 4 histogram allreduces on a step
            # where a threshold refreshes, one allreduce for the dense buckets.
            refresh = 4 if s.global_refreshes else 0
            if s.sparse_buckets:  # scheduler="auto" may exchange the bucket densely
                refreshed.append(s.global_refreshes > 0)
                kept.append(s.selected - (numel - sparse_numel))
            sparse = (1 if hvd.size() == 2 else 2) if s.sparse_buckets else 0
            steps = ring * (sparse + 2 * refresh + (2 if s.dense_buckets else 0))
        moved.append(sent + received)
        sent_bytes.append(sent)
        message_steps.append(steps)
        if hvd.rank() == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(
                f"[{mode}] step {step:4d} loss {losses[-1]:.4f} bytes/step {moved[-1]:,}",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    dense_sent, dense_received = allreduce_ring_bytes(numel, hvd.size(), 4)
    summary = {
        "mode": mode,
        "density": args.density,
        "world_size": hvd.size(),
        "parameters": numel,
        "steps": args.steps,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "bytes_per_step": sum(moved) / len(moved),
        "bytes_sent_per_step": sum(sent_bytes) / len(sent_bytes),
        "message_steps_per_step": sum(message_steps) / len(message_steps),
        "dense_bytes_per_step": dense_sent + dense_received,
        "seconds": elapsed,
    }
    # The reused threshold in steady state (refreshes <= 5 % of steps, kept about k),
    # after the first 50 sparse steps.
    reuse = settled_reuse(refreshed, kept, sparse_k, SETTLED)
    if reuse:
        summary["refresh_fraction_after_50"] = reuse["refresh_fraction"]
        summary["kept_over_k_after_50"] = reuse["kept_over_k"]
        summary["within_tenth_of_k_after_50"] = reuse["within_tenth_of_k"]
    if args.scheduler == "auto" and args.density < 1.0:
        # What the scheduler chose per bucket, on which measurements, and its trials.
        summary["schedule"] = optimizer.schedule()
        summary["trials"] = [dataclasses.asdict(trial) for trial in optimizer.schedule_trials()]
    if hvd.rank() == 0:
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
