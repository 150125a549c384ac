"""What Horovod's negotiation costs the sparse exchange: many small collectives vs few.

Each variant moves the same rows: ``--buckets`` buckets of ``--rows`` (index, value)
rows of 8 bytes per rank, as a sparse step's reduce-scatter and all-gather of small
buckets do. Measured in one job per P, median of ``--steps`` after 10 warm-up steps,
the slowest rank's time:

* alltoall: one per bucket (what the plugin issues) against one of all buckets' rows;
* allgather: one per bucket, launched together, against ``hvd.grouped_allgather`` and
  against one allgather of all buckets' rows;
* response cache: the per-bucket allgathers with a row count that changes every step
  (as the kept count does) against the same count every step (a padded capacity: the
  shapes repeat, so Horovod's response cache can skip the negotiation).

    python benchmarks/negotiation.py [--ranks 2,4] [--buckets 16] [--rows 2621]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(buckets: int, rows: int, steps: int, out: str) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    size, rank = hvd.size(), hvd.rank()
    row = torch.zeros(rows, 8, dtype=torch.uint8)
    splits = torch.full((size,), rows // size, dtype=torch.int32)
    splits[-1] += rows - int(splits.sum())
    joined = torch.zeros(rows * buckets, 8, dtype=torch.uint8)
    joined_splits = splits * buckets

    def per_bucket_alltoall(i: int) -> None:
        handles = [hvd.alltoall_async(row, splits=splits, name=f"a2a.{b}") for b in range(buckets)]
        for h in handles:
            hvd.synchronize(h)

    def one_alltoall(i: int) -> None:
        hvd.alltoall(joined, splits=joined_splits, name="a2a.joined")

    def varying(i: int) -> torch.Tensor:
        # A kept count that differs per step and per rank, as a reused threshold's does.
        return row[: rows // size - (i * 7 + rank * 3) % 50]

    def per_bucket_allgather(i: int, fixed: bool = True) -> None:
        part = row[: rows // size] if fixed else varying(i)
        handles = [hvd.allgather_async(part, name=f"ag.{b}") for b in range(buckets)]
        for h in handles:
            hvd.synchronize(h)

    def grouped_allgather(i: int) -> None:
        part = row[: rows // size]
        hvd.grouped_allgather([part] * buckets, name="ag.grouped")

    def one_allgather(i: int) -> None:
        hvd.allgather(joined[: rows * buckets // size], name="ag.joined")

    variants = {
        "alltoall per bucket": per_bucket_alltoall,
        "one alltoall": one_alltoall,
        "allgather per bucket, same shape each step": per_bucket_allgather,
        "allgather per bucket, shape changes": lambda i: per_bucket_allgather(i, False),
        "grouped_allgather": grouped_allgather,
        "one allgather": one_allgather,
    }
    results = [
        {"P": size, "variant": label, "median_s": _median(fn, steps, label)}
        for label, fn in variants.items()
    ]
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _median(fn, steps: int, label: str) -> float:
    """Median over ``steps`` calls after 10 warm-up calls of the slowest rank's time."""
    import horovod.torch as hvd
    import torch

    times = []
    for i in range(steps + 10):
        hvd.barrier()
        began = time.perf_counter()
        fn(i)
        took = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        # One name for every call: a fresh name each call is negotiated afresh.
        slowest = float(hvd.allreduce(took, op=hvd.Max, name=f"t.{label}"))
        if i >= 10:
            times.append(slowest)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--rows", type=int, default=2621, help="1% of 256K per bucket")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=str(ROOT / "results" / "negotiation.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.buckets, args.rows, args.steps, args.worker)
        return
    rows = []
    for size in (int(p) for p in args.ranks.split(",")):
        part = Path(f"{args.json}.np{size}")
        cmd = ["horovodrun", "-np", str(size), "-H", f"localhost:{size}", "--gloo"]
        cmd += [sys.executable, __file__, "--buckets", str(args.buckets)]
        cmd += ["--rows", str(args.rows), "--steps", str(args.steps), "--worker", str(part)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, check=True, env=env, timeout=1800, stdout=subprocess.DEVNULL)
        rows += json.loads(part.read_text())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{args.buckets} buckets of {args.rows} rows of 8 bytes; median of {args.steps} steps")
    print("| P | variant | median ms |\n|---:|---|---:|")
    for r in rows:
        print(f"| {r['P']} | {r['variant']} | {r['median_s'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
