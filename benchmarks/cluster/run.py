"""Dense vs sparse training on an emulated 1, 10 and 25 Gbit/s cluster of 4 ranks.

    sudo -E .venv/bin/python benchmarks/cluster/run.py [--ranks 4] [--presets 1g,10g,25g]

For each link preset: the alpha-beta collective measurements (``collectives.py``) and
the synthetic benchmark dense (``hvd.DistributedOptimizer``) and sparse (density 0.01).
Writes results/cluster.json and results/cluster.md; skips with a message unless root.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cluster import PRESETS, Cluster, LinkSpec, require_root  # noqa: E402


def benchmark_command(args: argparse.Namespace, density: float, result: Path) -> list[str]:
    script = ROOT / "examples" / "pytorch" / "pytorch_synthetic_benchmark.py"
    return [
        sys.executable,
        str(script),
        "--model",
        args.model,
        "--density",
        str(density),
        "--batch-size",
        str(args.batch_size),
        "--json",
        str(result),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--collective-ranks", default="2,3,4", help='sizes for the alpha-beta fit ("": none)'
    )
    parser.add_argument("--presets", default="1g,10g,25g")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--model", default="wide_mlp")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument(
        "--only-collectives",
        action="store_true",
        help="re-measure the collectives; reuse the training results already on disk",
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "cluster"))
    args = parser.parse_args()
    require_root()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    report = []
    for preset in args.presets.split(","):
        link = LinkSpec(PRESETS[preset].rate, args.delay_ms)
        entry: dict = {"link": link.label, "ranks": args.ranks, "runs": {}, "collectives": []}
        for size in (int(p) for p in args.collective_ranks.split(",") if p):
            with Cluster(size, link) as cluster:
                micro = out.with_name(f"{out.name}.{link.label}.np{size}.collectives.json")
                command = [sys.executable, str(HERE / "collectives.py"), str(micro)]
                if cluster.run(command, args.timeout, env) != 0:
                    raise SystemExit(f"collective measurement failed on {link.label}, P={size}")
                entry["collectives"].append(json.loads(micro.read_text()))
        for density in (1.0, args.density):
            result = out.with_name(f"{out.name}.{link.label}.d{density}.json")
            if not args.only_collectives:
                with Cluster(args.ranks, link) as cluster:
                    code = cluster.run(benchmark_command(args, density, result), args.timeout, env)
                if code != 0:
                    raise SystemExit(f"benchmark failed on {link.label} density {density}: {code}")
            entry["runs"][str(density)] = json.loads(result.read_text())
        dense, sparse = entry["runs"]["1.0"], entry["runs"][str(args.density)]
        entry["speedup"] = dense["median_step_s"] / sparse["median_step_s"]
        report.append(entry)
        print(
            f"{link.label}: dense {dense['median_step_s']:.3f} s/step, sparse "
            f"{sparse['median_step_s']:.3f} s/step, speedup {entry['speedup']:.2f}x",
            flush=True,
        )
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [
        "| link | ranks | mode | step (s) | samples/s (total) | 95% CI per rank | speedup |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for e in report:
        for key, run in e["runs"].items():
            speed = f"{e['speedup']:.2f}x" if key != "1.0" else "1.00x"
            lines.append(
                f"| {e['link']} | {e['ranks']} | {run['mode']} | {run['median_step_s']:.3f} | "
                f"{run['total_samples_per_s']:.1f} | +-{run['ci95']:.1f} | {speed} |"
            )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
