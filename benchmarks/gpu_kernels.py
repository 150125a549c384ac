"""The sparse path's local kernels on one device: what each costs against a plain copy.

For each bucket size and density, on one fp32 bucket whose entries are Gaussian with a
heavy tail (one in a thousand scaled by 10), times with CUDA events (after warm-up,
median of ``--repeats``):

* ``copy``: one device-to-device copy of the bucket (the bandwidth line: bytes read plus
  written over its time);
* ``topk``: exact ``torch.topk`` of the magnitudes (``TorchKernels.topk_indices``);
* ``threshold (estimate)``: ``ThresholdSelection.select`` estimating its threshold from
  a strided sample, then one pass above it (every refresh step);
* ``threshold (reused)``: the same selection reusing the last threshold (every other
  step): one pass over the bucket;
* ``pack``: the selected values gathered and packed into rows (index, value bytes);
* ``owner sums``: ``--ranks`` ranks' rows (each rank's selection of its own bucket)
  unpacked and summed per distinct index, in rank order (``owner_reduce``);
* ``unpack``: the summed rows added back into a dense bucket.

Checked on every size: the threshold selection keeps between 0.8k and 1.25k entries,
its overlap with the exact top-k is printed, packed rows unpack to the same indices
and values bit for bit, and the owner sums equal a dense float64 sum of the ranks'
selected values (relative error < 1e-6).

Prints a Markdown table and writes JSON (default ``results/gpu_kernels.json``)::

    python benchmarks/gpu_kernels.py                      # 25M and 100M, 0.001 and 0.01
    python benchmarks/gpu_kernels.py --device cpu --sizes 1M --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from horovod_sparse.common.config import budget  # noqa: E402
from horovod_sparse.common.reduction import owner_reduce  # noqa: E402
from horovod_sparse.common.selection import ThresholdSelection  # noqa: E402
from horovod_sparse.torch.kernels import TorchKernels  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from allreduce import parse_size  # noqa: E402


def timed(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``work`` after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            work()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def bucket(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(numel, generator=g, device=device)
    tail = torch.randint(0, numel, (max(1, numel // 1000),), generator=g, device=device)
    values[tail] *= 10.0
    return values


def measure(numel: int, density: float, ranks: int, repeats: int, device: torch.device) -> dict:
    ops = TorchKernels()
    k = budget(numel, density)
    grads = [bucket(numel, seed, device) for seed in range(ranks)]
    acc = grads[0]
    target = torch.empty_like(acc)

    def select_estimating() -> torch.Tensor:
        return ThresholdSelection(reestimate_steps=1).select(ops, acc, k)

    reusing = ThresholdSelection(reestimate_steps=1 << 30)
    reusing.select(ops, acc, k)  # estimates once; every later call reuses the threshold
    chosen = [ThresholdSelection().select(ops, g, k) for g in grads]
    rows = [ops.pack_rows(i, 0, ops.take(g, i)) for g, i in zip(grads, chosen)]
    received = torch.cat(rows)
    indices, sums = owner_reduce(ops, received, acc, acc, lambda v: v)
    dense = torch.zeros(numel, dtype=acc.dtype, device=device)

    row = {
        "numel": numel,
        "density": density,
        "k": k,
        "ranks": ranks,
        "copy_s": timed(device, lambda: target.copy_(acc), repeats),
        "topk_s": timed(device, lambda: ops.topk_indices(acc, k), repeats),
        "threshold_estimate_s": timed(device, select_estimating, repeats),
        "threshold_reused_s": timed(device, lambda: reusing.select(ops, acc, k), repeats),
        "pack_s": timed(
            device, lambda: ops.pack_rows(chosen[0], 0, ops.take(acc, chosen[0])), repeats
        ),
        "owner_sums_s": timed(
            device, lambda: owner_reduce(ops, received, acc, acc, lambda v: v), repeats
        ),
        "unpack_s": timed(device, lambda: ops.add_at(dense, indices, sums), repeats),
    }
    row["copy_GBps"] = 2 * 4 * numel / row["copy_s"] / 1e9
    row["threshold_reused_GBps_read"] = 4 * numel / row["threshold_reused_s"] / 1e9
    row["topk_over_threshold_estimate"] = row["topk_s"] / row["threshold_estimate_s"]
    row.update(checks(ops, grads, chosen, rows, indices, sums, k))
    return row


def checks(ops, grads, chosen, rows, indices, sums, k: int) -> dict:
    counts = [c.numel() / k for c in chosen]
    assert all(0.8 <= c <= 1.25 for c in counts), f"count/k outside [0.8, 1.25]: {counts}"
    exact = ops.topk_indices(grads[0], k)
    overlap = torch.isin(chosen[0], exact).float().mean().item()
    back_indices, back_values = ops.unpack_rows(rows[0], grads[0])
    assert torch.equal(back_indices, chosen[0]), "packed indices did not round-trip"
    assert torch.equal(back_values, grads[0][chosen[0]]), "packed values did not round-trip"
    reference = torch.zeros(grads[0].numel(), dtype=torch.float64, device=grads[0].device)
    for g, c in zip(grads, chosen):
        reference.index_add_(0, c, g[c].double())
    expected = reference[indices]
    error = ((sums.double() - expected).norm() / expected.norm()).item()
    assert error < 1e-6, f"owner sums off by {error:.2e} relative"
    assert torch.equal(indices, torch.unique(torch.cat(chosen))), "owner sums lost an index"
    return {"count_over_k": counts, "overlap_with_topk": overlap, "owner_sum_rel_error": error}


def table(rows: list[dict]) -> str:
    lines = [
        "| numel | density | copy (ms, GB/s) | topk (ms) | threshold, estimate (ms) "
        "| threshold, reused (ms, GB/s read) | topk / estimate | pack (ms) "
        "| owner sums, P ranks (ms) | unpack (ms) | overlap with topk |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = {key: 1e3 * value for key, value in r.items() if key.endswith("_s")}
        lines.append(
            f"| {r['numel']:,} | {r['density']} | {ms['copy_s']:.3f} "
            f"({r['copy_GBps']:.0f}) | {ms['topk_s']:.3f} | {ms['threshold_estimate_s']:.3f} "
            f"| {ms['threshold_reused_s']:.3f} ({r['threshold_reused_GBps_read']:.0f}) "
            f"| {r['topk_over_threshold_estimate']:.1f}x | {ms['pack_s']:.3f} "
            f"| {ms['owner_sums_s']:.3f} (P={r['ranks']}) | {ms['unpack_s']:.3f} "
            f"| {r['overlap_with_topk']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="25M,100M")
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--ranks", type=int, default=4, help="ranks whose rows an owner sums")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_kernels.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_kernels.py: CUDA is not available (--device cpu runs it on the CPU)")
    rows = [
        measure(parse_size(size), float(density), args.ranks, args.repeats, device)
        for size in args.sizes.split(",")
        for density in args.densities.split(",")
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"## Local kernels on {name} (torch {torch.__version__})\n")
    print(table(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
