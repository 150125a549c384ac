"""DDP's allreduce against PowerSGD and the sparse hook on the digits CNN or the char LM,
in one run.

Launches ``examples/pytorch/ddp_train.py`` with ``torchrun`` for every (P, seed, hook)
and writes a markdown table (the final metric per seed and its mean, bytes per step,
seconds on this machine) and a plot of the metric against bytes.

    python benchmarks/ddp_accuracy.py                  # digits; P = 2, 4; seeds 0-2 (6 min)
    python benchmarks/ddp_accuracy.py --task char_lm   # (about 60 min on 2 cores)
    python benchmarks/ddp_accuracy.py --sizes 2 --seeds 0
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


# The summary's metric, how the table names it, and whether higher is better.
METRICS = {
    "digits": ("final_test_acc", "test accuracy (%)", True),
    "char_lm": ("final_val_loss", "validation loss (nats)", False),
}


def run(task: str, size: int, seed: int, hook: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(size), str(ROOT / "examples/pytorch/ddp_train.py")]
    command += ["--task", task, *hook, "--seed", str(seed), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(METRICS), default="digits")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=None, help="default: results/ddp_<task>")
    args = parser.parse_args()
    args.out = args.out or ROOT / "results" / f"ddp_{args.task}"
    key, label, _ = METRICS[args.task]
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for mode, hook in HOOKS.items():
            runs = [
                run(
                    args.task,
                    size,
                    seed,
                    hook,
                    args.out / f"p{size}_{hook[1]}_{hook[-1]}_s{seed}.json",
                )
                for seed in seeds
            ]
            assert all(r["parameter_spread"] == 0.0 for r in runs), runs
            row = {
                "P": size,
                "mode": mode,
                "metric": [r[key] for r in runs],
                "bytes": mean(r["bytes_per_step"] for r in runs),
                "dense_bytes": runs[0]["dense_bytes_per_step"],
                "seconds": mean(r["seconds"] for r in runs),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        f"| P | hook | {label}, seeds " + ", ".join(map(str, seeds)) + " | mean | bytes/step "
        "| vs DDP allreduce | seconds (2 cores, loopback) |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        digits = 2 if args.task == "digits" else 4
        values = ", ".join(f"{a:.{digits}f}" for a in row["metric"])
        lines.append(
            f"| {row['P']} | {row['mode']} | {values} | {mean(row['metric']):.{digits}f} "
            f"| {row['bytes']:,.0f} | {row['bytes'] / row['dense_bytes']:.2%} "
            f"| {row['seconds']:.1f} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "rows.json").write_text(json.dumps(rows))
    print(table)
    plot(rows, args.task, label, args.out / "metric_vs_bytes.png")


def plot(rows: list[dict], task: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len({r["P"] for r in rows}), figsize=(10, 4), squeeze=False)
    for axis, size in zip(axes[0], sorted({r["P"] for r in rows})):
        for row in (r for r in rows if r["P"] == size):
            axis.scatter(row["bytes"], mean(row["metric"]), label=row["mode"])
        axis.set_xscale("log")
        axis.set_xlabel("bytes per step and rank")
        axis.set_ylabel(f"{label}, mean over seeds")
        axis.set_title(f"{task}, P = {size}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
