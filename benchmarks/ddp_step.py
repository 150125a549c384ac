"""Training-step time of one 4096x4096 layer (16.8M fp32 gradients, one DDP bucket) with
DDP's allreduce, PowerSGD (rank 1, 2, 4) and the sparse hook (density 0.01, 0.001), in
one run per world size (torchrun, Gloo, this machine's loopback).

    python benchmarks/ddp_step.py                   # P = 2, 4
    python benchmarks/ddp_step.py --sizes 2 --steps 10

Each configuration runs ``--warmup`` steps (PowerSGD's dense warm-up and the hook's first,
dense iteration among them), then ``--steps`` timed steps; the median step is reported
with the bytes one rank sends and receives per step (the hook: ``stats()``; allreduce
and PowerSGD: their ring allreduces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["allreduce", "powersgd:1", "powersgd:2", "powersgd:4", "sparse:0.01", "sparse:0.001"]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    from horovod_sparse.common.stats import allreduce_ring_bytes
    from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    torch.set_num_threads(1)
    results = []
    for config in CONFIGS:
        torch.manual_seed(0)
        layer = torch.nn.Linear(args.width, args.width, bias=False)
        model = DistributedDataParallel(layer, bucket_cap_mb=1024)
        kind, _, value = config.partition(":")
        state = None
        n = m = args.width
        moved = sum(allreduce_ring_bytes(n * m, size, 4))
        if kind == "powersgd":
            rank = int(value)
            state = powersgd.PowerSGDState(
                None, matrix_approximation_rank=rank, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, powersgd.powerSGD_hook)
            moved = sum(allreduce_ring_bytes((n + m) * rank, size, 4))
        elif kind == "sparse":
            state = SparseState(density=float(value))
            model.register_comm_hook(state, sparse_allreduce_hook)
        x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
        times = []
        for step in range(args.warmup + args.steps):
            model.zero_grad()
            dist.barrier()
            began = time.perf_counter()
            model(x).square().mean().backward()
            if step >= args.warmup:
                times.append(time.perf_counter() - began)
        if kind == "sparse":
            stats = state.stats()
            moved = stats.bytes_sent + stats.bytes_received
        results.append(
            {
                "P": size,
                "config": config,
                "median_s": statistics.median(times),
                "bytes": moved,
                "dense_bytes": sum(allreduce_ring_bytes(n * m, size, 4)),
            }
        )
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ddp_step.md")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(size),
            __file__,
            "--worker",
            "--width",
            str(args.width),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        found = (text for text in done.stdout.splitlines() if text.startswith("RESULTS "))
        line = next(found, None)
        if done.returncode != 0 or line is None:
            raise RuntimeError(f"P={size} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        rows += json.loads(line[len("RESULTS ") :])
    lines = [
        "| P | hook | median step (s) | vs allreduce | bytes/step | vs allreduce |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(r for r in rows if r["P"] == row["P"] and r["config"] == "allreduce")
        lines.append(
            f"| {row['P']} | {row['config']} | {row['median_s']:.3f} | "
            f"{row['median_s'] / base['median_s']:.2f}x | {row['bytes']:,} | "
            f"{row['bytes'] / row['dense_bytes']:.2%} |"
        )
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
