"""Many small buckets: step time and Horovod collectives per step, in one job per P.

A model of ``--buckets`` linear layers of ``--floats`` weights each, one sparse bucket
per layer (``fusion_threshold_bytes`` set to the layer's size), is reduced by
``synchronize()`` every step with fresh random gradients:

* dense: ``horovod.torch.DistributedOptimizer`` (Horovod's own fused allreduce);
* sparse, ``global_selection="exact"``: the radix select on every sparse step;
* sparse, ``global_selection="reuse"``: the threshold derived from the last all-gather;
* ``reuse_apart``: the same with ``join_buckets=False`` (one alltoall and one allgather
  per bucket instead of one for all of them).

Collectives are counted by wrapping the backend's async collectives (sparse) and
Horovod's ``allreduce_async_`` / ``grouped_allreduce_async_`` (dense; Horovod fuses what
is ready at once into one allreduce in its background cycle, which this count does not
see: it counts requests); step times are the
slowest rank's, median over ``--steps`` after 30 warm-up steps.

    python benchmarks/latency.py [--ranks 2,3,4] [--buckets 16] [--floats 256K]
                                 [--density 0.01] [--steps 20] [--json results/latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Steps before timing. Error feedback makes the accumulator grow over the first tens of
# steps from zero; a reused threshold lags that growth and refreshes often meanwhile
# (measured: about every other step over the first 25 at 256K floats, P=2), so the
# timed steps start past it.
WARMUP = 30
MODES = ("dense", "exact", "reuse", "reuse_apart")
COLLECTIVES = ("alltoall_async", "allgather_async", "allreduce_sum_async")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KM" else text) * scale)


def worker(buckets: int, floats: int, density: float, steps: int, out: str) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    rows = [measure(mode, buckets, floats, density, steps) for mode in MODES]
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(rows))


def measure(mode: str, buckets: int, floats: int, density: float, steps: int) -> dict[str, Any]:
    import horovod.torch as hvd
    import horovod.torch.optimizer as horovod_optimizer
    import torch

    import horovod_sparse.torch as hvds
    import horovod_sparse.torch.functions as functions

    side = int(floats**0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(buckets)])
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    counts = {"collectives": 0}
    if mode == "dense":
        opt = hvd.DistributedOptimizer(sgd, model.named_parameters())
        # The names Horovod's optimizer calls (imported into its module).
        wrapped = [
            (horovod_optimizer, "allreduce_async_"),
            (horovod_optimizer, "grouped_allreduce_async_"),
        ]
    else:
        opt = hvds.DistributedOptimizer(
            sgd,
            model.named_parameters(),
            density=density,
            global_selection="exact" if mode == "exact" else "reuse",
            join_buckets=mode != "reuse_apart",
            fusion_threshold_bytes=side * side * 4,
        )
        wrapped = [(functions.BACKEND, name) for name in COLLECTIVES]
    originals = []
    for owner, name in wrapped:
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counts["collectives"] += 1
            return _original(*args, **kwargs)

        setattr(owner, name, counting)
    generator = torch.Generator().manual_seed(hvd.rank())
    times, per_step, refreshes = [], [], 0
    try:
        for step in range(WARMUP + steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            # Line the ranks up. One name a mode (and for the timer below): a fresh name a
            # step fills Horovod's response cache and evicts the optimizer's collectives.
            hvd.allreduce(torch.zeros(1), name=f"lat.line.{mode}")
            before = counts["collectives"]
            start = time.perf_counter()
            opt.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            issued = counts["collectives"] - before
            slowest = float(hvd.allreduce(elapsed, op=hvd.Max, name=f"lat.t.{mode}"))
            with opt.skip_synchronize():
                opt.step()
            if step >= WARMUP:
                times.append(slowest)
                per_step.append(issued)
                if mode != "dense":
                    refreshes += opt.stats().global_refreshes
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return {
        "mode": mode,
        "P": hvd.size(),
        "buckets": buckets,
        "floats": side * side,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "collectives_per_step": statistics.mean(per_step),
        "refreshing_buckets_per_step": refreshes / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4")
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--floats", default="256K")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=str(ROOT / "results" / "latency.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    floats = parse_size(args.floats)
    if args.worker:
        worker(args.buckets, floats, args.density, args.steps, args.worker)
        return
    rows = []
    for p in (int(x) for x in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "rows.json"
            cmd = ["horovodrun", "-np", str(p), "-H", f"localhost:{p}", "--gloo"]
            cmd += [sys.executable, __file__, "--buckets", str(args.buckets)]
            cmd += ["--floats", str(floats), "--density", str(args.density)]
            cmd += ["--steps", str(args.steps), "--worker", str(part)]
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
            rows += json.loads(part.read_text())
    dense = {r["P"]: r["median_s"] for r in rows if r["mode"] == "dense"}
    print(
        f"{args.buckets} buckets of {rows[0]['floats']} floats, density {args.density}, "
        f"Gloo loopback; slowest rank's synchronize(), median of {args.steps} steps"
    )
    print(
        "| P | mode | median s | min s | collectives / step | refreshing buckets / step "
        "| time / dense |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['P']} | {r['mode']} | {r['median_s']:.4f} | {r['min_s']:.4f} | "
            f"{r['collectives_per_step']:.1f} | {r['refreshing_buckets_per_step']:.2f} | "
            f"{r['median_s'] / dense[r['P']]:.2f} |"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
