"""Where a training step's time goes: dense Horovod against the sparse optimizer.

Trains the demo's MLP (``--model demo``: 1.19M parameters, as ``make demo``) or a wide
MLP (``--model wide``: 25.2M) for ``--steps`` steps after ``--warmup`` unmeasured ones,
with ``hvd.DistributedOptimizer`` and then ``horovod_sparse.torch.DistributedOptimizer``
at its defaults, in one ``horovodrun -np P --gloo`` job per P and thread setting, and
prints per step (medians over the measured steps; the whole step is the slowest
rank's):

* forward+backward: ``zero_grad`` to the end of ``backward()`` (the sparse optimizer's
  bucket work in the gradient hooks included);
* optimizer step: ``optimizer.step()`` (waiting on the exchanges, unpacking);
* selection and exchange: the sparse optimizer's own host seconds (``stats()``:
  local and global selection; issuing and waiting on collectives);
* collectives: the sparse optimizer's alltoalls, allgathers and allreduces per step
  (counted by wrapping its backend), and the fraction of steps whose global threshold
  refreshed.

    python benchmarks/step_profile.py [--model demo,wide] [--ranks 2] [--threads default,1]
                                      [--steps 60] [--warmup 20]

``--threads default`` sets nothing (``horovodrun`` sets no thread count, so torch takes
every core in every rank); ``1`` calls ``torch.set_num_threads(1)`` in every rank.
Writes JSON and a markdown table (default under results/step_profile.*).
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
WIDTHS = {"demo": 1024, "wide": 4096}
COLLECTIVES = ("alltoall_async", "allgather_async", "allreduce_sum_async")


def build(model_name: str):
    import torch

    width, features, classes = WIDTHS[model_name], 128, 10
    layers = [torch.nn.Linear(features, width), torch.nn.ReLU()]
    layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    if model_name == "wide":
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers), features, classes


def count_collectives(counts: dict[str, int]) -> None:
    """Wrap the sparse optimizer's backend so that every collective it issues counts."""
    from horovod_sparse.torch import functions

    backend = functions.BACKEND
    for kind in (*COLLECTIVES, "allreduce_sum_inplace_async"):
        original = getattr(backend, kind)
        key = "allreduce_sum_async" if kind.startswith("allreduce") else kind

        def counting(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(backend, kind, counting)


def run_mode(model_name: str, sparse: bool, steps: int, warmup: int) -> dict:
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hvds

    torch.manual_seed(0)
    model, features, classes = build(model_name)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    named = model.named_parameters()
    if sparse:
        optimizer = hvds.DistributedOptimizer(inner, named_parameters=named)
    else:
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=named)
    generator = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(8, 64, features, generator=generator)
    y = torch.randint(0, classes, (8, 64), generator=generator)
    counts = dict.fromkeys(COLLECTIVES, 0)
    if sparse:
        count_collectives(counts)
    rows = []
    for step in range(warmup + steps):
        before = dict(counts)
        began = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[step % 8]), y[step % 8])
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        ended = time.perf_counter()
        slowest = hvd.allreduce(
            torch.tensor([ended - began], dtype=torch.float64), op=hvd.Max, name=f"t.{step}"
        )
        if step < warmup:
            continue
        row = {
            "step_s": float(slowest),
            "forward_backward_s": backward_done - began,
            "optimizer_step_s": ended - backward_done,
        }
        if sparse:
            stats = optimizer.stats()
            row |= {
                "selection_s": stats.seconds_select,
                "exchange_s": stats.seconds_exchange,
                "refreshed": int(stats.global_refreshes > 0),
                **{kind: counts[kind] - before[kind] for kind in COLLECTIVES},
            }
        rows.append(row)
    return {
        "model": model_name,
        "mode": "sparse (defaults)" if sparse else "dense hvd.DistributedOptimizer",
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": rows,
    }


def worker(models: list[str], threads: str, steps: int, warmup: int, out: str) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    if threads != "default":
        torch.set_num_threads(int(threads))
    results = []
    for model_name in models:
        for sparse in (False, True):
            result = run_mode(model_name, sparse, steps, warmup)
            result |= {
                "P": hvd.size(),
                "threads": threads,
                "torch_threads": torch.get_num_threads(),
            }
            results.append(result)
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(results))


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows) if rows and key in rows[0] else 0.0


def summarize(results: list[dict]) -> list[dict]:
    table = []
    dense = {}
    for result in results:
        rows = result["rows"]
        entry = {
            "model": result["model"],
            "P": result["P"],
            "threads": result["threads"],
            "torch_threads": result["torch_threads"],
            "mode": result["mode"],
            "parameters": result["parameters"],
            **{key: median(rows, key) for key in rows[0] if key != "refreshed"},
        }
        if "refreshed" in rows[0]:
            entry["refresh_fraction"] = sum(row["refreshed"] for row in rows) / len(rows)
        setting = (result["model"], result["P"], result["threads"])
        if result["mode"].startswith("dense"):
            dense[setting] = entry["step_s"]
        entry["step_vs_dense"] = entry["step_s"] / dense[setting]
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| model | P | threads | mode | step ms | vs dense | fwd+bwd ms | opt.step ms "
        "| selection ms | exchange ms | alltoall | allgather | allreduce | refreshed |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        sparse = "refresh_fraction" in t
        extra = (
            f"{1e3 * t['selection_s']:.1f} | {1e3 * t['exchange_s']:.1f} | "
            f"{t['alltoall_async']:.0f} | {t['allgather_async']:.0f} | "
            f"{t['allreduce_sum_async']:.0f} | {100 * t['refresh_fraction']:.0f} % |"
            if sparse
            else "- | - | - | - | - | - |"
        )
        threads = t["threads"] if t["threads"] != "default" else f"default ({t['torch_threads']})"
        lines.append(
            f"| {t['model']} ({t['parameters'] / 1e6:.2f}M) | {t['P']} | {threads} | "
            f"{t['mode']} | {1e3 * t['step_s']:.1f} | {t['step_vs_dense']:.2f} | "
            f"{1e3 * t['forward_backward_s']:.1f} | {1e3 * t['optimizer_step_s']:.1f} | {extra}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo,wide")
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--threads", default="default,1")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "results" / "step_profile"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.model.split(",")
    if args.worker:
        worker(models, args.worker_threads, args.steps, args.warmup, args.worker)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for p in (int(x) for x in args.ranks.split(",")):
        for threads in args.threads.split(","):
            part = out.with_name(f"{out.name}.np{p}.t{threads}.json")
            cmd = [
                "horovodrun", "-np", str(p), "-H", f"localhost:{p}", "--gloo",
                sys.executable, __file__, "--model", args.model,
                "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--worker-threads", threads, "--worker", str(part),
            ]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            env.pop("OMP_NUM_THREADS", None)  # "default" means what horovodrun leaves
            subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
            results += json.loads(part.read_text())
    table = summarize(results)
    out.with_suffix(".json").write_text(json.dumps({"table": table, "runs": results}, indent=1))
    text = markdown(table)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
