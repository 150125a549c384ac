"""DDP's allreduce against PowerSGD and the sparse hook on the digits CNN, in one run.

Launches ``examples/pytorch/digits_ddp.py`` with ``torchrun`` for every (P, seed, hook)
and writes a markdown table (mean test accuracy over the seeds, bytes per step, seconds
on this machine) and a plot of accuracy against bytes.

    python benchmarks/ddp_digits.py                 # P = 2, 4; seeds 0-2 (6 min on 2 cores)
    python benchmarks/ddp_digits.py --sizes 2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
HOOKS = {
    "DDP allreduce": ["--hook", "allreduce"],
    "PowerSGD rank 1": ["--hook", "powersgd", "--rank", "1"],
    "PowerSGD rank 2": ["--hook", "powersgd", "--rank", "2"],
    "PowerSGD rank 4": ["--hook", "powersgd", "--rank", "4"],
    "sparse density 0.01": ["--hook", "sparse", "--density", "0.01"],
    "sparse density 0.001": ["--hook", "sparse", "--density", "0.001"],
}


def run(size: int, seed: int, hook: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(size), str(ROOT / "examples/pytorch/digits_ddp.py")]
    command += [*hook, "--seed", str(seed), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ddp_digits")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for mode, hook in HOOKS.items():
            runs = [
                run(size, seed, hook, args.out / f"p{size}_{hook[1]}_{hook[-1]}_s{seed}.json")
                for seed in seeds
            ]
            assert all(r["parameter_spread"] == 0.0 for r in runs), runs
            row = {
                "P": size,
                "mode": mode,
                "accuracy": [r["final_test_acc"] for r in runs],
                "bytes": mean(r["bytes_per_step"] for r in runs),
                "dense_bytes": runs[0]["dense_bytes_per_step"],
                "seconds": mean(r["seconds"] for r in runs),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        "| P | hook | test accuracy, seeds " + ", ".join(map(str, seeds)) + " | mean | bytes/step "
        "| vs DDP allreduce | seconds (2 cores, loopback) |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        accuracies = ", ".join(f"{a:.2f}" for a in row["accuracy"])
        lines.append(
            f"| {row['P']} | {row['mode']} | {accuracies} | {mean(row['accuracy']):.2f} "
            f"| {row['bytes']:,.0f} | {row['bytes'] / row['dense_bytes']:.2%} "
            f"| {row['seconds']:.1f} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "rows.json").write_text(json.dumps(rows))
    print(table)
    plot(rows, args.out / "accuracy_vs_bytes.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len({r["P"] for r in rows}), figsize=(10, 4), squeeze=False)
    for axis, size in zip(axes[0], sorted({r["P"] for r in rows})):
        for row in (r for r in rows if r["P"] == size):
            axis.scatter(row["bytes"], mean(row["accuracy"]), label=row["mode"])
        axis.set_xscale("log")
        axis.set_xlabel("bytes per step and rank")
        axis.set_ylabel("test accuracy (%), mean over seeds")
        axis.set_title(f"digits CNN, P = {size}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
