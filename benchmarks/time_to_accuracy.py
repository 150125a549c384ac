"""Time to dense's quality: how many steps and wall-clock seconds each way of reducing
gradients needs to reach the validation metric that dense Horovod ends with.

Every mode of a task trains the same model on the same data order with the same
hyperparameters and seeds: dense Horovod (``hvd.DistributedOptimizer``), the sparse
Horovod optimizer with its defaults and without ``residual_lookahead``, DDP's own
allreduce, the sparse DDP hook (with the task's optimizer run in the hook: SGD momentum
for digits, AdamW for the char LM; and its residual lookahead), and
PowerSGD rank 1 and 4 under DDP (Keras digits: dense and sparse only). Each run
records its validation metric every ``--eval-every`` steps against the seconds spent
training so far (evaluation left out). Per seed, the target is dense's
final metric on that seed; a mode's time to it is the first evaluation that reaches it.

    python benchmarks/time_to_accuracy.py --tasks char_lm --sizes 2 --seeds 0   # 3 minutes
    python benchmarks/time_to_accuracy.py         # char_lm, digits; P = 2, 4; seeds 0-2
    python benchmarks/time_to_accuracy.py --tasks keras_digits   # Keras model.fit (no DDP)
    sudo -E .venv/bin/python benchmarks/time_to_accuracy.py --links loopback,1g,10g
    python benchmarks/time_to_accuracy.py --sizes 2 --reuse  # rerun only the missing runs
    sudo -E .venv/bin/python benchmarks/time_to_accuracy.py --tasks wide_mlp --sizes 4 \
        --links 1g --eval-every 25 --modes "sparse (defaults),DDP sparse hook"   # 25.6M
    python benchmarks/time_to_accuracy.py --modes "sparse (no lookahead)"  # before the default

``1g`` and ``10g`` run every rank in its own network namespace on a shaped link
(``benchmarks/cluster/``, root only: without root those links are skipped with a
message). Writes ``results/time_to_accuracy/`` (each run's JSON, ``rows.json``,
``table.md``) and a plot per task, size and link of the metric against seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))

from cluster import PRESETS, Cluster  # noqa: E402


@dataclass(frozen=True)
class Mode:
    """One way to train a task: a script, its arguments, and how it is launched."""

    name: str
    script: str
    arguments: tuple[str, ...]
    launcher: str  # "horovod" (horovodrun) or "torch" (torchrun)


@dataclass(frozen=True)
class Task:
    name: str
    metric: str  # the key of the metric in each curve point
    label: str
    higher_is_better: bool
    modes: tuple[Mode, ...]

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def gap(self, value: float, target: float) -> str:
        if self.higher_is_better:
            return f"{value - target:+.2f} points"
        return f"{(value - target) / target:+.1%}"


def modes(task: str, example: str, hook_options: tuple[str, ...]) -> tuple[Mode, ...]:
    """Dense Horovod and the sparse optimizer on ``example``; the DDP hook and PowerSGD
    on the same task through ``ddp_train.py``."""
    horovod = f"examples/pytorch/{example}"
    ddp, common = "examples/pytorch/ddp_train.py", ("--task", task)
    return (
        Mode(DENSE, horovod, ("--density", "1.0"), "horovod"),
        Mode("sparse (defaults)", horovod, (), "horovod"),
        # The defaults before residual lookahead: gradients at the shared parameters, and
        # the residuals left unflushed at the end.
        Mode(
            "sparse (no lookahead)",
            horovod,
            ("--no-residual-lookahead", "--no-flush"),
            "horovod",
        ),
        # DDP's own dense allreduce: the DDP rows' baseline without Horovod's runtime.
        Mode("DDP allreduce", ddp, (*common, "--hook", "allreduce"), "torch"),
        Mode("DDP sparse hook", ddp, (*common, "--hook", "sparse", *hook_options), "torch"),
        Mode("PowerSGD rank 1", ddp, (*common, "--hook", "powersgd", "--rank", "1"), "torch"),
        Mode("PowerSGD rank 4", ddp, (*common, "--hook", "powersgd", "--rank", "4"), "torch"),
    )


DENSE = "dense Horovod"
KERAS_DIGITS = "examples/tensorflow2/keras_digits.py"
TASKS = {
    # AdamW: run by the hook too (--adam-correction); SGD momentum: the hook's by default.
    "char_lm": Task(
        "char_lm",
        "val_loss",
        "validation loss (nats)",
        False,
        modes("char_lm", "char_lm.py", ("--adam-correction",)),
    ),
    "digits": Task(
        "digits", "test_acc", "test accuracy (%)", True, modes("digits", "digits_cnn.py", ())
    ),
    # 25.6M parameters: the task where bytes matter (run it with --eval-every 25).
    "wide_mlp": Task(
        "wide_mlp", "test_acc", "test accuracy (%)", True, modes("wide_mlp", "wide_mlp.py", ())
    ),
    # Keras 3 model.fit: no DDP. Horovod's own Keras binding does not take Keras 3, so the
    # dense row is the Keras adapter at density 1, which reduces with hvd.allreduce.
    "keras_digits": Task(
        "keras_digits",
        "test_acc",
        "test accuracy (%)",
        True,
        (
            Mode(DENSE, KERAS_DIGITS, ("--density", "1.0"), "horovod"),
            Mode("sparse (defaults)", KERAS_DIGITS, (), "horovod"),
        ),
    ),
}


@dataclass(frozen=True)
class Setting:
    """Where and how every mode of a task trains."""

    size: int
    link: str  # "loopback", or a preset of benchmarks/cluster/ ("1g", "10g")
    eval_every: int
    timeout: float
    out: Path

    def result(self, task: Task, mode: Mode, seed: int) -> Path:
        name = mode.name.replace(" ", "_").replace("(", "").replace(")", "")
        return self.out / f"{task.name}_p{self.size}_{self.link}_{name}_s{seed}.json"


def command(mode: Mode, setting: Setting, seed: int, out: Path) -> list[str]:
    script = [str(ROOT / mode.script), *mode.arguments, "--seed", str(seed)]
    script += ["--eval-every", str(setting.eval_every), "--json", str(out)]
    if setting.link != "loopback":  # the cluster starts one process per rank itself
        return [sys.executable, *script]
    size = str(setting.size)
    if mode.launcher == "horovod":
        return [
            "horovodrun",
            "-np",
            size,
            "-H",
            f"localhost:{size}",
            "--gloo",
            sys.executable,
            *script,
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        size,
        *script,
    ]


def train(task: Task, mode: Mode, setting: Setting, seed: int, reuse: bool = False) -> dict:
    out = setting.result(task, mode, seed)
    if reuse and out.exists():
        return json.loads(out.read_text())
    launch = command(mode, setting, seed, out)
    if setting.link == "loopback":
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            launch, cwd=ROOT, capture_output=True, text=True, timeout=setting.timeout, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(launch)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
    else:
        with Cluster(setting.size, PRESETS[setting.link]) as cluster:
            run = cluster.run if mode.launcher == "horovod" else cluster.run_distributed
            if run(launch, setting.timeout, {"PYTHONPATH": str(ROOT)}) != 0:
                raise RuntimeError(f"{' '.join(launch)} failed on {setting.link}")
    result = json.loads(out.read_text())
    if result["parameter_spread"] != 0.0:
        raise AssertionError(
            f"{mode.name}: ranks' parameters differ by {result['parameter_spread']}"
        )
    return result


def first_reaching(task: Task, curve: list[dict], target: float) -> dict | None:
    """The first evaluation at or past ``target`` (an upper bound on steps and seconds)."""
    return next((point for point in curve if task.reached(point[task.metric], target)), None)


def summarize(task: Task, size: int, link: str, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per mode: seeds that reached dense's final metric, steps and seconds to it
    (median over the seeds that reached it), the final metric and bytes per step."""
    targets = [run["curve"][-1][task.metric] for run in runs[DENSE]]
    dense_seconds = [
        first_reaching(task, run["curve"], t)["seconds"] for run, t in zip(runs[DENSE], targets)
    ]
    rows = []
    for name, mode_runs in runs.items():
        hits = [first_reaching(task, run["curve"], t) for run, t in zip(mode_runs, targets)]
        reached = [(hit, dense) for hit, dense in zip(hits, dense_seconds) if hit is not None]
        finals = [run["curve"][-1][task.metric] for run in mode_runs]
        rows.append(
            {
                "task": task.name,
                "P": size,
                "link": link,
                "mode": name,
                "targets": targets,
                "final": finals,
                "final_gap": task.gap(mean(finals), mean(targets)),
                "reached": f"{len(reached)}/{len(mode_runs)}",
                "steps_to_target": median(h["step"] for h, _ in reached) if reached else None,
                "seconds_to_target": median(h["seconds"] for h, _ in reached) if reached else None,
                "speedup": median(d / h["seconds"] for h, d in reached) if reached else None,
                "seconds_per_step": mean(
                    r["curve"][-1]["seconds"] / (r["curve"][-1]["step"] + 1) for r in mode_runs
                ),
                "bytes_per_step": mean(r["bytes_per_step"] for r in mode_runs),
                "dense_bytes_per_step": mode_runs[0]["dense_bytes_per_step"],
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| task | P | link | mode | final (mean) | gap to dense | reached | steps to dense's final "
        "| seconds to it | speedup in seconds | s/step | bytes/step |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        steps = "not reached" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}"
        seconds = "-" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.1f}"
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(
            f"| {row['task']} | {row['P']} | {row['link']} | {row['mode']} "
            f"| {mean(row['final']):.4g} "
            f"| {row['final_gap']} | {row['reached']} | {steps} | {seconds} | {speedup} "
            f"| {row['seconds_per_step']:.3f} | {row['bytes_per_step']:,.0f} "
            f"({row['bytes_per_step'] / row['dense_bytes_per_step']:.2%}) |"
        )
    return "\n".join(lines)


def plot(task: Task, size: int, link: str, runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, mode_runs in runs.items():
        run = mode_runs[0]  # the first seed: one line per mode
        axis.plot(
            [p["seconds"] for p in run["curve"]], [p[task.metric] for p in run["curve"]], label=name
        )
    axis.axhline(runs[DENSE][0]["curve"][-1][task.metric], color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("seconds training (evaluation left out)")
    axis.set_ylabel(task.label)
    axis.set_title(f"{task.name}, P = {size}, {link}, seed {runs[DENSE][0]['seed']}")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def chosen_modes(tasks: list[Task], names: str | None) -> set[str]:
    """The modes to train: ``names`` (comma-separated) and dense, or every mode of ``tasks``."""
    known = {mode.name for task in tasks for mode in task.modes}
    if names is None:
        return known
    chosen = {DENSE, *names.split(",")}
    if chosen - known:
        raise SystemExit(f"unknown modes {sorted(chosen - known)}: one of {sorted(known)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="char_lm,digits")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--links", default="loopback", help="loopback, 1g, 10g (root)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "time_to_accuracy")
    parser.add_argument(
        "--reuse", action="store_true", help="take runs whose JSON is under --out already"
    )
    parser.add_argument("--plots", type=Path, default=None, help="default: --out")
    parser.add_argument(
        "--modes",
        default=None,
        help="only these modes, by name, comma-separated (default: all of each task's); "
        f"{DENSE!r} runs always: its final metric is the target",
    )
    args = parser.parse_args()
    tasks = [TASKS[name] for name in args.tasks.split(",")]
    chosen = chosen_modes(tasks, args.modes)
    args.out.mkdir(parents=True, exist_ok=True)
    plots = args.plots or args.out
    plots.mkdir(parents=True, exist_ok=True)
    links = args.links.split(",")
    unknown = [link for link in links if link != "loopback" and link not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown links {unknown}: loopback or one of {sorted(PRESETS)}")
    shaped = [link for link in links if link != "loopback"]
    if os.geteuid() != 0 and shaped:
        print(f"SKIPPED: links {shaped} need root (network namespaces and tc)")
        links = [link for link in links if link == "loopback"]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for task in tasks:
        for size in (int(s) for s in args.sizes.split(",")):
            for link in links:
                setting = Setting(size, link, args.eval_every, args.timeout, args.out)
                runs = {
                    mode.name: [train(task, mode, setting, seed, args.reuse) for seed in seeds]
                    for mode in task.modes
                    if mode.name in chosen
                }
                found = summarize(task, size, link, runs)
                rows += found
                print(table(found), flush=True)
                plot(task, size, link, runs, plots / f"{task.name}_p{size}_{link}.png")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    (args.out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
