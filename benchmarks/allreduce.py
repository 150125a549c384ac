"""Sparse vs dense ``hvd.allreduce``, measured in the same run, ratios to dense.

Launches itself under ``horovodrun -np P --gloo`` for each P, then writes JSON, a markdown
table and a PNG plot (default under results/allreduce.*).

    python benchmarks/allreduce.py [--sizes 1M,4M,16M,64M] [--densities 0.001,0.01,0.1]
                                   [--ranks 2,4] [--repeats 5] [--global-selection exact,reuse]
                                   [--threads 1]

``--global-selection`` times each sparse density once per way of finding the global
threshold (the exact radix select, and the threshold reused from the last all-gather),
in the same job as dense.
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


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMG" else text) * scale)


def worker(
    sizes: list[int],
    densities: list[float],
    globals_: list[str],
    repeats: int,
    out: str,
    threads: int = 1,
) -> None:
    """Runs on every rank: time dense and sparse allreduce of the same tensors."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    if threads:  # 0: set nothing, as horovodrun leaves it (torch takes every core)
        torch.set_num_threads(threads)
    rows = []
    for numel in sizes:
        rows += measure_size(numel, densities, globals_, repeats)
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(rows))


def measure_size(
    numel: int, densities: list[float], globals_: list[str], repeats: int
) -> list[dict]:
    """Dense, then each density and global selection, on one random buffer of ``numel``
    floats per rank."""
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hvds
    from horovod_sparse.common.stats import allreduce_ring_bytes

    grad = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))

    def timed(fn, tag: str) -> list[float]:
        times = []
        for i in range(repeats + 1):  # round 0 warms up
            hvd.barrier()
            start = time.perf_counter()
            fn(i)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            # The slowest rank defines the step. One name for every call, as for the
            # calls timed: Horovod's response cache serves recurring names alike.
            slowest = hvd.allreduce(elapsed, op=hvd.Max, name=f"{tag}.t")
            if i:
                times.append(float(slowest))
        return times

    base = {"numel": numel, "world_size": hvd.size()}
    sent, received = allreduce_ring_bytes(numel, hvd.size(), 4)
    dense = timed(lambda i: hvd.allreduce(grad, name=f"dense.{numel}"), f"d{numel}")
    rows = [
        {**base, "mode": "dense", "density": 1.0, "times": dense, "bytes_per_rank": sent + received}
    ]
    for density in densities:
        for way in globals_:
            hvds.reset_residuals()
            name = f"s.{numel}.{density}.{way}"
            refreshes: list[int] = []

            def call(
                i: int, d: float = density, n: str = name, w: str = way, seen: list = refreshes
            ) -> None:
                hvds.sparse_allreduce(grad, d, n, global_selection=w)
                seen.append(hvds.stats(n).global_refreshes)

            times = timed(call, name)
            s = hvds.stats(name)
            rows.append(
                {
                    **base,
                    "mode": "sparse",
                    "global_selection": way,
                    "density": density,
                    "times": times,
                    "bytes_per_rank": s.bytes_sent + s.bytes_received,
                    "seconds_select": s.seconds_select,
                    "refreshes": sum(refreshes[1:]),  # over the timed calls
                }
            )
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    dense = {(r["numel"], r["world_size"]): r for r in rows if r["mode"] == "dense"}
    table = []
    for r in rows:
        d = dense[(r["numel"], r["world_size"])]
        median = statistics.median(r["times"])
        table.append(
            {
                "P": r["world_size"],
                "numel": r["numel"],
                "mode": r["mode"],
                "global_selection": r.get("global_selection", ""),
                "refreshes": r.get("refreshes", 0),
                "calls": len(r["times"]),
                "density": r["density"],
                "median_s": median,
                "min_s": min(r["times"]),
                "max_s": max(r["times"]),
                "bytes_per_rank": r["bytes_per_rank"],
                "time_vs_dense": median / statistics.median(d["times"]),
                "bytes_vs_dense": r["bytes_per_rank"] / d["bytes_per_rank"],
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| P | floats | mode | global | refreshes | density | median s | min s | max s "
        "| MB/rank | time / dense | bytes / dense |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        way = t["global_selection"] or "-"
        refreshed = f"{t['refreshes']}/{t['calls']}" if t["mode"] == "sparse" else "-"
        lines.append(
            f"| {t['P']} | {t['numel'] / (1 << 20):.0f}M | {t['mode']} | {way} | {refreshed} | "
            f"{t['density']:g} | "
            f"{t['median_s']:.3f} | {t['min_s']:.3f} | {t['max_s']:.3f} | "
            f"{t['bytes_per_rank'] / 1e6:.2f} | {t['time_vs_dense']:.2f} | "
            f"{t['bytes_vs_dense']:.4f} |"
        )
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({t["P"] for t in table})
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4), squeeze=False)
    for ax, p in zip(axes[0], ranks):
        series = sorted({(t["density"], t["global_selection"]) for t in table if t["P"] == p})
        for density, way in series:
            pts = sorted(
                (t["numel"], t["median_s"])
                for t in table
                if t["P"] == p and t["density"] == density and t["global_selection"] == way
            )
            label = "dense hvd.allreduce" if density == 1.0 else f"sparse d={density:g} {way}"
            ax.plot([n / (1 << 20) for n, _ in pts], [s for _, s in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("buffer (M floats)")
        ax.set_ylabel("median step (s)")
        ax.set_title(f"P = {p}, Gloo loopback")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--densities", default="0.001,0.01,0.1")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global-selection", default="exact,reuse")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank; 0 sets nothing (torch's default: every core)",
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "allreduce"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    globals_ = args.global_selection.split(",")
    if args.worker:
        worker(sizes, densities, globals_, args.repeats, args.worker, args.threads)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in (int(x) for x in args.ranks.split(",")):
        part = out.with_name(f"{out.name}.np{p}.json")
        cmd = [
            "horovodrun",
            "-np",
            str(p),
            "-H",
            f"localhost:{p}",
            "--gloo",
            sys.executable,
            __file__,
            "--sizes",
            args.sizes,
            "--densities",
            args.densities,
            "--repeats",
            str(args.repeats),
            "--global-selection",
            args.global_selection,
            "--threads",
            str(args.threads),
            "--worker",
            str(part),
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
        rows += json.loads(part.read_text())
    table = summarize(rows)
    out.with_suffix(".json").write_text(json.dumps({"raw": rows, "table": table}, indent=1))
    text = markdown(table)
    out.with_suffix(".md").write_text(text + "\n")
    plot(table, out.with_suffix(".png"))
    print(text)
    print(f"\nwrote {out}.json, {out}.md, {out}.png")


if __name__ == "__main__":
    main()
