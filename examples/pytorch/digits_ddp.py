"""The digits CNN under ``DistributedDataParallel``, with DDP's allreduce, PowerSGD or the
sparse hook, launched as DDP jobs are:

    torchrun --standalone --nproc-per-node 2 examples/pytorch/digits_ddp.py --hook sparse
    torchrun --standalone --nproc-per-node 2 examples/pytorch/digits_ddp.py --hook powersgd
    torchrun --standalone --nproc-per-node 2 examples/pytorch/digits_ddp.py --hook allreduce

The same data, split, model and optimizer as ``digits_cnn.py`` (rank r trains on every
P-th training image from r; SGD with momentum 0.9, the learning rate scaled by P). Rank 0
prints the test accuracy and the bytes one rank sends and receives per step: measured by
the sparse hook's ``stats()``; for allreduce and PowerSGD, those of the ring allreduces
they issue (PowerSGD: P and Q of each matrix at its rank, the vectors uncompressed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_cnn import DigitsCNN, accuracy, batches, load_split

from horovod_sparse.common.stats import allreduce_ring_bytes
from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook


def powersgd_bytes(model: torch.nn.Module, rank: int, size: int) -> int:
    """Bytes one rank sends and receives per compressed PowerSGD step: ring allreduces
    of the (n + m)·rank factors of each matrix it compresses and of the other tensors."""
    floats = 0
    for p in model.parameters():
        n = p.shape[0] if p.dim() > 1 else 1
        m = p.numel() // n
        factors = (n + m) * min(rank, n, m)
        # PowerSGD compresses a matrix only when that saves 2x (min_compression_rate).
        floats += factors if p.dim() > 1 and n * m >= 2 * factors else p.numel()
    return sum(allreduce_ring_bytes(floats, size, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=("allreduce", "powersgd", "sparse"), default="sparse")
    parser.add_argument("--density", type=float, default=0.01, help="--hook sparse")
    parser.add_argument("--rank", type=int, default=2, help="--hook powersgd: matrix rank")
    parser.add_argument("--warmup", type=int, default=10, help="PowerSGD's dense iterations")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by P")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the summary here (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    x_train, y_train, x_test, y_test = load_split()
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]
    model = DistributedDataParallel(DigitsCNN())
    numel = sum(p.numel() for p in model.parameters())
    dense_bytes = sum(allreduce_ring_bytes(numel, size, 4))
    state: Any = None
    if args.hook == "sparse":
        state = SparseState(density=args.density)
        model.register_comm_hook(state, sparse_allreduce_hook)
        mode = f"sparse density {args.density}"
    elif args.hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.warmup,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        mode = f"PowerSGD rank {args.rank}"
    else:
        mode = "DDP allreduce"
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    order = torch.Generator().manual_seed(args.seed * 1000 + rank)
    data, moved = batches(x_mine, y_mine, args.batch_size, order), []
    began = time.perf_counter()
    for step, (x, y) in zip(range(args.steps), data):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if args.hook == "sparse":
            stats = state.stats()
            moved.append(stats.bytes_sent + stats.bytes_received)
        elif args.hook == "powersgd" and step >= args.warmup:
            moved.append(powersgd_bytes(model.module, args.rank, size))
        else:
            moved.append(dense_bytes)
    seconds = time.perf_counter() - began
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat)
    spread = max(float((part - flat).abs().max()) for part in parts)
    summary = {
        "task": "digits_ddp",
        "mode": mode,
        "world_size": size,
        "steps": args.steps,
        "seed": args.seed,
        "final_test_acc": accuracy(model.module, x_test, y_test),
        "final_train_loss": float(loss),
        "bytes_per_step": sum(moved) / len(moved),
        "dense_bytes_per_step": dense_bytes,
        "parameter_spread": spread,
        "seconds": seconds,
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
