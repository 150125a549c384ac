"""Overlap and the automatic dense/sparse choice, side by side, on emulated links.

    sudo -E .venv/bin/python benchmarks/cluster/schedule.py [--ranks 4] [--links loopback,1g,10g]

For each link (``loopback``: plain ``horovodrun`` on this machine, no shaping; ``1g`` /
``10g``: the emulated cluster of ``cluster.py``, one namespace and NIC per rank), runs the
synthetic benchmark (25.1M-parameter wide MLP, 20 MiB buckets) in six configurations:
dense Horovod, sparse at the fixed density, sparse with ``overlap_allgather=True``, sparse
with ``overlap_allgather="auto"``, ``scheduler="auto"``, and auto with ``"auto"`` overlap.
Reports the median step time of each and four ratios per link: overlap / no overlap and
``"auto"`` overlap / no overlap (both sparse), and auto, without and with ``"auto"``
overlap, / the better of dense and sparse. Writes results/schedule.json and
results/schedule.md. The shaped links need root; without it only ``loopback`` runs.
Each rank is pinned to one core (``--no-pin``: not).

With ``--rounds R`` every configuration runs R times, in forward order in even rounds and
in reverse order in odd ones, so that a slow spell of the shared host does not fall on
one configuration only; a configuration's figure is the median of the step times pooled
over its rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cluster import PRESETS, Cluster, LinkSpec  # noqa: E402

CONFIGS = {
    "dense": ["--density", "1.0"],
    "sparse": [],
    "sparse+overlap": ["--overlap"],
    "sparse+auto-overlap": ["--overlap-auto"],
    "auto": ["--scheduler", "auto"],
    "auto+auto-overlap": ["--scheduler", "auto", "--overlap-auto"],
}
# Rank r runs on core r * cores // ranks (ranks 0 and 1 on core 0, 2 and 3 on core 1 for
# 4 ranks on 2 cores). Unpinned, the same sparse run on loopback took 1.62 and 1.66
# s/step, single iterations up to 57% off the run's median; pinned, 0.71 to 1.00 s/step,
# iterations at most 7-21% off: the ranks no longer migrate between the cores.
PIN = 'exec taskset -c $(( HOROVOD_RANK * {cores} / HOROVOD_SIZE )) "$@"'


def command(args: argparse.Namespace, config: str, result: Path) -> list[str]:
    extra = list(CONFIGS[config])
    if "--density" not in extra:
        extra += ["--density", str(args.density), "--fusion-mb", str(args.fusion_mb)]
    if config == "sparse+overlap":
        extra += ["--trace", str(result.with_suffix("")) + ".trace.{rank}.json"]
    pin = ["sh", "-c", PIN.format(cores=os.cpu_count()), "pin"] if args.pin else []
    return [
        *pin,
        sys.executable,
        str(ROOT / "examples" / "pytorch" / "pytorch_synthetic_benchmark.py"),
        "--model",
        "wide_mlp",
        "--batch-size",
        str(args.batch_size),
        "--num-warmup-batches",
        # The automatic scheduler decides at step 10 and, after a trial, at 15; a bucket
        # trial is followed by an overlap trial that ends at step 20.
        "24",
        "--num-iters",
        str(args.iters),
        "--json",
        str(result),
        *extra,
    ]


def run_loopback(args: argparse.Namespace, cmd: list[str], env: dict[str, str]) -> None:
    launch = ["horovodrun", "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo"]
    done = subprocess.run(
        launch + cmd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"loopback run failed: {done.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--links", default="loopback,1g,10g")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--fusion-mb", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations of 3 steps")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="let the ranks migrate between cores"
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "schedule"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    links = args.links.split(",")
    if os.geteuid() != 0 and links != ["loopback"]:
        print("not root: the shaped links need network namespaces; running loopback only")
        links = ["loopback"]
    report = {}
    configs = args.configs.split(",")
    for link in links:
        rounds: dict[str, list[dict]] = {config: [] for config in configs}
        for round_index in range(args.rounds):
            for config in configs if round_index % 2 == 0 else configs[::-1]:
                result = out.with_name(f"{out.name}.{link}.{config}.{round_index}.json")
                cmd = command(args, config, result)
                if link == "loopback":
                    run_loopback(args, cmd, env)
                else:
                    with Cluster(args.ranks, LinkSpec(PRESETS[link].rate)) as cluster:
                        if cluster.run(cmd, args.timeout, env) != 0:
                            raise SystemExit(f"{config} failed on {link}")
                run = json.loads(result.read_text())
                rounds[config].append(run)
                print(
                    f"{link:8s} {config:20s} round {round_index}: "
                    f"{run['median_step_s']:.3f} s/step",
                    flush=True,
                )
        runs = {}
        for config, done in rounds.items():
            pooled = [t for run in done for t in run["step_times_s"]]
            # The first round's run stands for the configuration (trace, trials, bytes);
            # the step time is the median over every round's timed steps.
            runs[config] = {
                **done[0],
                "median_step_s": statistics.median(pooled),
                "round_medians_s": [run["median_step_s"] for run in done],
                "round_trials": [run.get("trials") for run in done],
            }
        report[link] = runs
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [
        "| link | " + " | ".join(CONFIGS) + " | overlap / no overlap "
        "| auto-overlap / no overlap | auto / best fixed | auto+auto-overlap / best fixed "
        "| reduce-scatter hidden |",
        "|---|" + "---:|" * (len(CONFIGS) + 5),
    ]
    for link, runs in report.items():
        step = {config: run["median_step_s"] for config, run in runs.items()}
        best = min(step.get("dense", math.inf), step.get("sparse", math.inf))
        hidden = runs.get("sparse+overlap", {}).get("trace", {}).get("hidden_fraction")
        cells = [f"{step[c]:.3f}" if c in step else "-" for c in CONFIGS]
        no_overlap = step.get("sparse", math.nan)
        ratios = [
            step.get("sparse+overlap", math.nan) / no_overlap,
            step.get("sparse+auto-overlap", math.nan) / no_overlap,
            step.get("auto", math.nan) / best,
            step.get("auto+auto-overlap", math.nan) / best,
        ]
        lines.append(
            f"| {link} | "
            + " | ".join(cells + [f"{r:.3f}" for r in ratios])
            + " | "
            + (f"{100 * hidden:.0f}%" if hidden is not None else "-")
            + " |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
