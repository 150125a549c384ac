"""Selection benchmark: exact vs threshold top-k, owner load, global-selection recall.

Prints a table and writes JSON (default results/selection.json). Parts 1-2 run in this
process; part 3 launches ``selection_recall.py`` under ``horovodrun -np 2 --gloo``.

    python benchmarks/selection.py [--numel 25000000] [--steps 100] [--out results/selection.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from horovod_sparse.common.config import budget
from horovod_sparse.common.partition import UniformPartition, balanced_boundaries
from horovod_sparse.common.selection import ExactSelection, ThresholdSelection
from horovod_sparse.torch.backend import TorchBackend

HERE = Path(__file__).resolve().parent


def drifting_gradients(numel: int, steps: int, seed: int = 0):
    """A gradient stream whose scale and heavy tail drift: step t is a rolled copy of a
    base draw, scaled by 1 + 0.5 sin(t/8), with a drifting share of outliers."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    outliers = torch.randint(0, numel, (numel // 1000,), generator=g)
    for t in range(steps):
        grad = base.roll(997 * t) * (1.0 + 0.5 * math.sin(t / 8))
        grad[outliers] *= 3.0 + 2.0 * math.cos(t / 13)
        yield grad


def time_selection(numel: int, steps: int, density: float) -> dict:
    ops = TorchBackend()
    k = budget(numel, density)
    exact, threshold = ExactSelection(), ThresholdSelection()
    residual = torch.zeros(numel)
    exact_s, threshold_s, counts, agree = [], [], [], []
    for grad in drifting_gradients(numel, steps):
        acc = residual.add_(grad)  # error feedback drives the drift the selector sees
        t0 = time.perf_counter()
        chosen = threshold.select(ops, acc, k)
        t1 = time.perf_counter()
        reference = exact.select(ops, acc, k)
        t2 = time.perf_counter()
        threshold_s.append(t1 - t0)
        exact_s.append(t2 - t1)
        counts.append(chosen.numel() / k)
        agree.append(torch.isin(chosen, reference).float().mean().item() if chosen.numel() else 0)
        residual = acc.index_fill_(0, chosen, 0.0)
    copy = torch.empty_like(residual)
    t0 = time.perf_counter()
    for _ in range(10):
        copy.copy_(residual)
    memory_pass = (time.perf_counter() - t0) / 10
    in_band = sum(1 for c in counts if 0.8 <= c <= 1.25)
    return {
        "numel": numel,
        "density": density,
        "steps": steps,
        "exact_median_s": statistics.median(exact_s),
        "threshold_median_s": statistics.median(threshold_s),
        "speedup": statistics.median(exact_s) / statistics.median(threshold_s),
        "copy_100MB_equivalent_s": memory_pass,
        "count_over_k_min": min(counts),
        "count_over_k_median": statistics.median(counts),
        "count_over_k_max": max(counts),
        "steps_in_band_0.8_1.25": in_band,
        "overlap_with_exact_topk_median": statistics.median(agree),
    }


def skewed_selection(numel: int, density: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's bucket, whose large entries sit 80% in the last 10%, and its top-k."""
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(numel, generator=g) * 0.01
    heavy = numel // 50
    tail = torch.randint(numel - numel // 10, numel, (int(0.8 * heavy),), generator=g)
    head = torch.randint(0, numel - numel // 10, (heavy - tail.numel(),), generator=g)
    grad[tail] += torch.randn(tail.numel(), generator=g)
    grad[head] += torch.randn(head.numel(), generator=g)
    return grad, TorchBackend().topk_indices(grad, budget(numel, density))


def owner_load(numel: int, density: float, world_size: int, bins_per_rank: int = 256) -> dict:
    """Rows each owner receives in the reduce-scatter, with the uniform cut and with the
    balanced cut that the partition derives from the gathered rows (the global top-k
    of the owners' sums: every rank sends its value where it selected)."""
    ops = TorchBackend()
    ranks = [skewed_selection(numel, density, r) for r in range(world_size)]
    selections = [indices for _, indices in ranks]
    sums = torch.zeros(numel)
    for grad, indices in ranks:
        sums.index_add_(0, indices, grad[indices])
    gathered = ops.topk_indices(sums, budget(numel, density))
    bins = bins_per_rank * world_size
    summed = ops.position_histogram(gathered, numel, bins)
    result = {}
    for name, bounds in (
        ("uniform", UniformPartition().boundaries(numel, world_size)),
        ("balanced", balanced_boundaries(summed.tolist(), numel, world_size)),
    ):
        loads = [0] * world_size
        for s in selections:
            for owner, c in enumerate(ops.region_counts(s, bounds)):
                loads[owner] += c
        result[name] = {"max_over_mean": max(loads) / (sum(loads) / world_size), "loads": loads}
    return result


def recall_run(steps: int, selection: str) -> dict:
    out = HERE.parent / "results" / f"selection_recall.{selection}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        "horovodrun",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        str(HERE / "selection_recall.py"),
        "--steps",
        str(steps),
        "--selection",
        selection,
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    subprocess.run(cmd, check=True, env=env, timeout=1200, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--recall-steps", type=int, default=100)
    parser.add_argument("--out", default=str(HERE.parent / "results" / "selection.json"))
    args = parser.parse_args()
    torch.manual_seed(0)

    timing = time_selection(args.numel, args.steps, args.density)
    load = {p: owner_load(1_000_000, args.density, p) for p in (2, 4)}
    recall = {s: recall_run(args.recall_steps, s) for s in ("exact", "threshold")}
    report = {"selection": timing, "owner_load": load, "global_selection": recall}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))

    t = timing
    print(
        f"\n## Local selection, {t['numel']:,} fp32, density {t['density']}, "
        f"{t['steps']} drifting steps"
    )
    print("| method | median time (s) | vs exact |")
    print("|---|---:|---:|")
    print(f"| exact torch.topk | {t['exact_median_s']:.3f} | 1.0x |")
    print(f"| threshold | {t['threshold_median_s']:.3f} | {t['speedup']:.1f}x |")
    print(f"| (one 100 MB copy) | {t['copy_100MB_equivalent_s']:.3f} | |")
    print(
        f"\nthreshold count / k: min {t['count_over_k_min']:.3f}, "
        f"median {t['count_over_k_median']:.3f}, max {t['count_over_k_max']:.3f}; "
        f"in [0.8, 1.25] on {t['steps_in_band_0.8_1.25']}/{t['steps']} steps; "
        f"overlap with exact top-k {t['overlap_with_exact_topk_median']:.4f}"
    )
    print("\n## Owner load max/mean, skewed bucket (80% of large entries in the last 10%)")
    print("| P | uniform | balanced |")
    print("|---:|---:|---:|")
    for p, r in load.items():
        print(
            f"| {p} | {r['uniform']['max_over_mean']:.2f} | {r['balanced']['max_over_mean']:.2f} |"
        )
    for selection, r in recall.items():
        print(
            f"\n## Global selection, {r['steps']}-step training run, P={r['world_size']}, "
            f"local selection {selection}"
        )
        print(
            f"recall vs top-k of the owners' reduced candidates: "
            f"{r['candidate_recall_mean']:.3f}; kept count / k: min {r['kept_over_k_min']:.3f}, "
            f"max {r['kept_over_k_max']:.3f}; end-to-end recall vs top-k of the summed "
            f"accumulators: mean {r['recall_mean']:.3f}, min {r['recall_min']:.3f}"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
