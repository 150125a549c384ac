"""Convergence of sparse vs dense training on real data that ships with the machine.

Runs every task under ``horovodrun`` at each world size in four modes: dense Horovod,
density 0.01, density 0.001, and density 0.01 with error feedback off (the ablation).
Seeds, hyperparameters and step counts are the same in every mode. Writes one JSON per
run, the curves as PNG, and a markdown table of final accuracy / loss and bytes per step.

    python benchmarks/convergence.py                       # everything (about an hour on 2 cores)
    python benchmarks/convergence.py --tasks digits --sizes 2
    python benchmarks/convergence.py --report-only         # redraw from the JSON files
    python benchmarks/convergence.py --tasks char_lm --steps 3000 --eval-every 500 \
        --out results/convergence_3000 --plots results/convergence_3000  # longer runs
    python benchmarks/convergence.py --tasks digits,keras_digits --modes dense,0.01 \
        --seeds 0,1,2                                      # the digits gap over seeds
    python benchmarks/convergence.py --tasks char_lm --sizes 2 --modes dense,0.01,0.1,0.5 \
        --out results/char_lm_ablation --plots docs/accuracy/char_lm_ablation
                                                           # the char LM ablation (more modes
                                                           # in MODES; char_lm only)

With several seeds, every (task, P, mode) runs once per seed (the seed sets the initial
weights and each rank's data order) and a second table gives each seed's final value,
their mean, and the mean gap to dense over the seeds both ran. The first table and the
plots show seed 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    name: str
    script: str
    steps: int
    metric: str  # key of the curve points and of the summary's final value
    label: str
    higher_is_better: bool
    script_args: tuple[str, ...] = ()  # passed to the script before the mode's


TASKS = {
    "digits": Task(
        "digits", "examples/pytorch/digits_cnn.py", 600, "test_acc", "test accuracy (%)", True
    ),
    "char_lm": Task(
        "char_lm", "examples/pytorch/char_lm.py", 500, "val_loss", "validation loss (nats)", False
    ),
    "keras_digits": Task(
        "keras_digits",
        "examples/tensorflow2/keras_digits.py",
        600,
        "test_acc",
        "test accuracy (%)",
        True,
    ),
    "keras_digits_adam": Task(
        "keras_digits_adam",
        "examples/tensorflow2/keras_digits.py",
        600,
        "test_acc",
        "test accuracy (%)",
        True,
        ("--optimizer", "adam"),
    ),
}

# The char LM and digits CNN flags for the defaults before residual lookahead (which
# came before the final flush of the residuals).
BEFORE_LOOKAHEAD = ("--no-residual-lookahead", "--no-flush")

# mode name -> extra command-line arguments
MODES = {
    "dense": ["--density", "1.0"],
    "0.01": ["--density", "0.01"],
    "0.001": ["--density", "0.001"],
    "0.01-no-ef": ["--density", "0.01", "--no-error-feedback"],
    # The char LM's ablation (docs/accuracy.md, "The language model's gap"): what moved
    # its 500-step gap before residual lookahead was the default, so these modes take
    # gradients at the shared parameters, as then. Warm-up: dense steps, then a
    # geometric density decay.
    "0.1": ["--density", "0.1", *BEFORE_LOOKAHEAD],
    "0.5": ["--density", "0.5", *BEFORE_LOOKAHEAD],
    "0.1-no-mc": ["--density", "0.1", "--no-momentum-correction", *BEFORE_LOOKAHEAD],
    "0.5-no-mc": ["--density", "0.5", "--no-momentum-correction", *BEFORE_LOOKAHEAD],
    "0.01-no-mc": ["--density", "0.01", "--no-momentum-correction", *BEFORE_LOOKAHEAD],
    "0.01-exact": ["--density", "0.01", "--global-selection", "exact", *BEFORE_LOOKAHEAD],
    "0.01-decay100": ["--density", "0.01", "--decay-steps", "100", *BEFORE_LOOKAHEAD],
    "0.01-decay200": ["--density", "0.01", "--decay-steps", "200", *BEFORE_LOOKAHEAD],
    "0.01-warm25-decay75": [
        "--density",
        "0.01",
        "--warmup-steps",
        "25",
        "--decay-steps",
        "75",
        *BEFORE_LOOKAHEAD,
    ],
    "0.01-warm50-decay150": [
        "--density",
        "0.01",
        "--warmup-steps",
        "50",
        "--decay-steps",
        "150",
        *BEFORE_LOOKAHEAD,
    ],
    "0.01-warm100-decay100": [
        "--density",
        "0.01",
        "--warmup-steps",
        "100",
        "--decay-steps",
        "100",
        *BEFORE_LOOKAHEAD,
    ],
    # Which tensors: those under the size go dense (20000: the embedding, the head and the
    # attention's output projections; 50000: the attention's input projections too).
    "0.01-min10k": ["--density", "0.01", "--min-sparse-numel", "10000", *BEFORE_LOOKAHEAD],
    "0.01-min20k": ["--density", "0.01", "--min-sparse-numel", "20000", *BEFORE_LOOKAHEAD],
    "0.01-min50k": ["--density", "0.01", "--min-sparse-numel", "50000", *BEFORE_LOOKAHEAD],
    # A bucket per tensor: each tensor its own top-k.
    "0.01-per-tensor": ["--density", "0.01", "--fusion-threshold-bytes", "1024", *BEFORE_LOOKAHEAD],
    # The defaults before residual lookahead: gradients at the shared parameters.
    "0.01-no-lookahead": ["--density", "0.01", *BEFORE_LOOKAHEAD],
    # The defaults before the final flush: the model ends without the residuals' mass.
    "0.01-no-flush": ["--density", "0.01", "--no-flush"],
}


DEFAULT_MODES = ("dense", "0.01", "0.001", "0.01-no-ef")


def result_path(out: Path, name: str, size: int, mode: str, seed: int) -> Path:
    """Seed 0 keeps the plain name, so earlier single-seed results still count."""
    return out / f"{name}_np{size}_{mode}{f'_seed{seed}' if seed else ''}.json"


def run_one(
    task: Task,
    size: int,
    mode: str,
    out: Path,
    timeout: int,
    eval_every: int | None = None,
    seed: int = 0,
) -> Path:
    path = result_path(out, task.name, size, mode, seed)
    cmd = [
        "horovodrun",
        "-np",
        str(size),
        "-H",
        f"localhost:{size}",
        "--gloo",
        sys.executable,
        str(ROOT / task.script),
        *task.script_args,
        *MODES[mode],
        "--steps",
        str(task.steps),
        "--seed",
        str(seed),
        "--json",
        str(path),
    ]
    if eval_every is not None:
        cmd += ["--eval-every", str(eval_every)]
    began = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not path.exists():
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(
            f"{task.name} np={size} {mode} seed {seed} failed (rc={done.returncode})"
        )
    elapsed = time.perf_counter() - began
    print(f"  {task.name} np={size} {mode:10s} seed {seed} {elapsed:6.1f} s", flush=True)
    return path


def final_value(task: Task, summary: dict) -> float:
    return summary["curve"][-1][task.metric]


def gap(task: Task, value: float, reference: float) -> float:
    """``value`` against dense: accuracy points, or percent of the loss."""
    return value - reference if task.higher_is_better else 100 * (value / reference - 1)


def table(results: dict[tuple[str, int, str], dict]) -> str:
    lines = [
        "| task | P | mode | final metric | vs dense | bytes/step | % of dense bytes | "
        "param spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, size, mode), summary in sorted(results.items()):
        task = TASKS[name]
        value = final_value(task, summary)
        dense = results.get((name, size, "dense"))
        if dense is None:
            versus = "n/a"
        elif task.higher_is_better:
            versus = f"{gap(task, value, final_value(task, dense)):+.2f} pt"
        else:
            versus = f"{gap(task, value, final_value(task, dense)):+.1f}%"
        if task.metric == "test_acc":
            shown = f"{value:.2f}% acc"
        else:
            shown = f"{value:.4f} (ppl {math.exp(value):.2f})"
        share = summary["bytes_per_step"] / summary["dense_bytes_per_step"]
        lines.append(
            f"| {name} | {size} | {mode} | {shown} | {versus} | "
            f"{summary['bytes_per_step']:,.0f} | {100 * share:.2f}% | "
            f"{summary['parameter_spread']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def seed_table(by_seed: dict[tuple[str, int, str], dict[int, dict]]) -> str:
    """Each seed's final value, their mean, and the mean gap to dense (over the seeds
    that ran both); only rows with more than one seed."""
    lines = [
        "| task | P | mode | seeds | final metric per seed | mean | mean vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, size, mode), runs in sorted(by_seed.items()):
        if len(runs) < 2:
            continue
        task = TASKS[name]
        seeds = sorted(runs)
        values = [final_value(task, runs[seed]) for seed in seeds]
        mean = sum(values) / len(values)
        dense = by_seed.get((name, size, "dense"), {})
        shared = [seed for seed in seeds if seed in dense]
        if shared:
            gaps = [
                gap(task, final_value(task, runs[seed]), final_value(task, dense[seed]))
                for seed in shared
            ]
            unit = " pt" if task.higher_is_better else "%"
            versus = f"{sum(gaps) / len(gaps):+.2f}{unit} ({len(shared)} seeds)"
        else:
            versus = "n/a"
        lines.append(
            f"| {name} | {size} | {mode} | {','.join(map(str, seeds))} | "
            + " / ".join(f"{v:.2f}" for v in values)
            + f" | {mean:.2f} | {versus} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plot(results: dict[tuple[str, int, str], dict], plots: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name in sorted({key[0] for key in results}):
        task = TASKS[name]
        sizes = sorted({key[1] for key in results if key[0] == name})
        fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
        for ax, size in zip(axes[0], sizes):
            for mode in MODES:
                summary = results.get((name, size, mode))
                if summary is None:
                    continue
                steps = [point["step"] for point in summary["curve"]]
                values = [point[task.metric] for point in summary["curve"]]
                ax.plot(steps, values, marker=".", label=mode)
            ax.set_title(f"{name}, P={size}")
            ax.set_xlabel("step")
            ax.set_ylabel(task.label)
            if task.metric == "test_acc":
                ax.set_ylim(80, 100)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = plots / f"convergence_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:  # noqa: C901 - a script's linear flow: arguments, runs, tables
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--out", default=str(ROOT / "results" / "convergence"))
    parser.add_argument("--plots", default=str(ROOT / "docs" / "accuracy"))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--steps", type=int, default=None, help="override every task's steps")
    parser.add_argument("--eval-every", type=int, default=None, help="override the scripts'")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds to run")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()

    out, plots = Path(args.out), Path(args.plots)
    out.mkdir(parents=True, exist_ok=True)
    plots.mkdir(parents=True, exist_ok=True)
    tasks = [TASKS[name] for name in args.tasks.split(",")]
    if args.steps is not None:
        tasks = [dataclasses.replace(task, steps=args.steps) for task in tasks]
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        for seed in seeds:
            for task in tasks:
                for size in sizes:
                    for mode in modes:
                        run_one(task, size, mode, out, args.timeout, args.eval_every, seed)
    # Every result on disk for these tasks and sizes, whichever seeds this call ran.
    by_seed: dict[tuple[str, int, str], dict[int, dict]] = {}
    for task in tasks:
        for size in sizes:
            for mode in MODES:
                for path in out.glob(f"{task.name}_np{size}_{mode}*.json"):
                    summary = json.loads(path.read_text())
                    if path != result_path(out, task.name, size, mode, summary["seed"]):
                        continue  # "0.01*" also matches "0.01-no-ef"
                    by_seed.setdefault((task.name, size, mode), {})[summary["seed"]] = summary
    results = {key: runs[0] for key, runs in by_seed.items() if 0 in runs}
    markdown = table(results)
    over_seeds = seed_table(by_seed)
    if over_seeds:
        markdown += "\nOver seeds (final values at the last evaluation):\n\n" + over_seeds
    (out / "convergence.md").write_text(markdown)
    (plots / "convergence.md").write_text(markdown)
    print(markdown)
    for path in plot(results, plots):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
