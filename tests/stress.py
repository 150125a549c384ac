"""Stress run of the functional sparse allreduce, checked at every step.

Every rank draws the same sequence of random choices (tensor name and size, density,
selection, partition, op, dtype); only the tensor values differ per rank. After every
call it asserts the residual invariant (summed over ranks: residual before + input ==
residual after + reduced sum) and that the result is bitwise identical on every rank.

Run under ``horovodrun`` (``python -m tests.stress --steps 1000``), or call :func:`run`.
``benchmarks/stress.py`` launches the long version; the parallel suite runs a short one.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds

SIZES = [1, 5, 1000, 1024, 4099, 65_536, 250_000, 1_000_003]
SHORT_SIZES = SIZES[:-2]  # the CI version: same shapes of problem, less time
DENSITIES = [0.0005, 0.001, 0.01, 0.05, 0.3, 0.999, 1.0]


def run(steps: int, seed: int = 0, names: int = 6, sizes: list[int] = SIZES) -> dict[str, float]:
    """``steps`` rounds; each round reduces a random subset of ``names`` tensors whose
    sizes are drawn from ``sizes``."""
    hvd.init()
    choose = random.Random(seed)  # identical on every rank
    values = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    world = hvd.size()
    sizes = {f"stress.{seed}.{i}": choose.choice(sizes) for i in range(names)}
    dtypes = {name: choose.choice([torch.float32, torch.float64]) for name in sizes}
    calls, worst, began = 0, 0.0, time.perf_counter()
    for step in range(steps):
        for name in choose.sample(sorted(sizes), choose.randint(1, names)):
            density = choose.choice(DENSITIES)
            op = choose.choice([hvd.Average, hvd.Sum])
            scale = 10.0 ** choose.randint(-3, 3)
            x = (torch.randn(sizes[name], generator=values) * scale).to(dtypes[name])
            if choose.random() < 0.2:  # heavy tails: a few huge entries
                x[torch.randint(0, x.numel(), (3,), generator=values)] *= 1e4
            try:
                before = hvds.residual(name).clone()
            except KeyError:
                before = torch.zeros_like(x)
            out = hvds.sparse_allreduce(
                x,
                density=density,
                name=name,
                op=op,
                selection=choose.choice(["threshold", "exact"]),
                partition=choose.choice(["uniform", "balanced"]),
            )
            after = hvds.residual(name)
            owed = hvd.allreduce(before + x - after, op=hvd.Sum, name=f"{name}.owed")
            summed = out * world if op == hvd.Average else out
            # Rounding is relative to the largest magnitude on any rank.
            largest = hvd.allreduce(
                (before.abs() + x.abs()).max().reshape(1), op=hvd.Max, name=f"{name}.max"
            )
            tolerance = 1e-5 * float(largest) * world + 1e-12
            error = float((summed - owed).abs().max())
            assert error <= tolerance, (step, name, density, error, tolerance)
            worst = max(worst, error / tolerance)
            gathered = hvd.allgather(out.reshape(1, -1), name=f"{name}.out")
            assert all(torch.equal(row, out) for row in gathered), (step, name, "ranks differ")
            calls += 1
    return {
        "world_size": world,
        "steps": steps,
        "calls": calls,
        "worst_error_over_tolerance": worst,
        "seconds": time.perf_counter() - began,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-size", type=int, default=max(SIZES), help="largest tensor")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    summary = run(args.steps, args.seed, sizes=[n for n in SIZES if n <= args.max_size])
    if hvd.rank() == 0:
        print(json.dumps(summary), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
