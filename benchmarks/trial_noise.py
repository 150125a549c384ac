"""How often a trial of ``scheduler="auto"`` would judge dense against sparse wrongly.

Trains the demo's model (1.19M parameters, SGD with momentum) with one sparse optimizer
whose exchange is switched between dense and sparse (``pin_exchange``) every ``B``
steps, for each block length ``B`` given, one block length after the other. Each
block's first step carries the switch and is not counted; a block's time is the median
of its other steps (each step's seconds averaged over ranks). A ratio is a sparse
block's time over the mean of the dense blocks either side of it, as a trial forms it.

For each block length it prints the ratio over the whole run (the median of every
ratio: what a long trial would find) and, for trials of R ratios (R sparse blocks), the
range of the trial's verdict over every window of R consecutive ratios in the run and
the share of windows whose verdict falls on the other side of 1 from the whole run's:
the median of the R ratios (the scheduler's rule: 4 ratios of 5-step blocks) and their
geometric mean (its rule before: 2 ratios).

    python benchmarks/trial_noise.py --blocks 2,5 --steps 400

Ranks share this machine's cores, as the scheduler's trials do where it matters most.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRIAL_LENGTHS = (2, 4, 8)


def worker(blocks: list[int], steps: int, warmup: int, threads: str, out: str) -> None:
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, str(HERE))
    from step_profile import TorchRun

    hvd.init()
    if threads != "default":
        torch.set_num_threads(int(threads))
    results = []
    for block in blocks:
        run = TorchRun("demo", "sparse", warmup)
        optimizer = run.optimizer
        seconds, dense = [], []
        for step in range(warmup + steps):
            mode_dense = (step // block) % 2 == 0
            optimizer.pin_exchange("dense" if mode_dense else "sparse")
            began = time.perf_counter()
            optimizer.zero_grad()
            x, y = run.x[step % 8], run.y[step % 8]
            torch.nn.functional.cross_entropy(run.model(x), y).backward()
            optimizer.step()
            took = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            mean = float(hvd.allreduce(took, name="trial_noise.step"))  # one name: cached
            seconds.append(mean)
            dense.append(mode_dense)
        results.append({"block": block, "seconds": seconds, "dense": dense, "warmup": warmup})
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(results))


def block_times(seconds: list[float], dense: list[bool], warmup: int) -> list[tuple[bool, float]]:
    """(dense, median of the block's steps after its first) for each whole block after
    the warm-up."""
    out, start = [], warmup
    while start < len(seconds):
        end = start
        while end < len(seconds) and dense[end] == dense[start]:
            end += 1
        counted = seconds[start + 1 : end]
        if counted and end < len(seconds):
            out.append((dense[start], statistics.median(counted)))
        start = end
    return out


def ratios(blocks: list[tuple[bool, float]]) -> list[float]:
    """Each sparse block over the mean of the dense blocks either side."""
    return [
        blocks[i][1] / statistics.mean((blocks[i - 1][1], blocks[i + 1][1]))
        for i in range(1, len(blocks) - 1)
        if not blocks[i][0] and blocks[i - 1][0] and blocks[i + 1][0]
    ]


def verdicts(values: list[float], length: int, rule: str) -> list[float]:
    """The verdict of every window of ``length`` consecutive ratios."""
    out = []
    for start in range(len(values) - length + 1):
        logs = [math.log(v) for v in values[start : start + length]]
        centre = statistics.median(logs) if rule == "median" else statistics.mean(logs)
        out.append(math.exp(centre))
    return out


def summarize(result: dict) -> list[dict]:
    values = ratios(block_times(result["seconds"], result["dense"], result["warmup"]))
    whole = math.exp(statistics.median(math.log(v) for v in values))
    rows = []
    for rule in ("median", "geometric mean"):
        for length in TRIAL_LENGTHS:
            if len(values) < length:
                continue
            found = verdicts(values, length, rule)
            wrong = sum((v < 1.0) != (whole < 1.0) for v in found) / len(found)
            rows.append(
                {
                    "block": result["block"],
                    "ratios": len(values),
                    "whole_run": whole,
                    "rule": rule,
                    "trial_ratios": length,
                    "trial_steps": 2 * length * result["block"],
                    "lowest": min(found),
                    "highest": max(found),
                    "wrong_side": wrong,
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| block steps | ratios in the run | sparse / dense, whole run | trial rule | ratios a"
        " trial | trial steps | trial verdicts, lowest-highest | wrong side of 1 |",
        "|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block']} | {r['ratios']} | {r['whole_run']:.2f} | {r['rule']} | "
            f"{r['trial_ratios']} | {r['trial_steps']} | {r['lowest']:.2f}-{r['highest']:.2f} "
            f"| {100 * r['wrong_side']:.0f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="2,5", help="block lengths in steps")
    parser.add_argument(
        "--steps", type=int, default=400, help="steps a block length, after the warm-up"
    )
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", default="1", help="torch threads a rank, or default")
    parser.add_argument("--out", default=str(ROOT / "results" / "trial_noise"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    if any(b < 2 for b in blocks):
        parser.error("--blocks: each block needs 2 steps or more (its first is not counted)")
    if args.worker:
        worker(blocks, args.steps, args.warmup, args.threads, args.worker)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".runs.json")
    p = args.ranks
    cmd = [
        "horovodrun", "-np", str(p), "-H", f"localhost:{p}", "--gloo",
        sys.executable, __file__, "--blocks", args.blocks, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--threads", args.threads, "--worker", str(part),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
    rows = [row for result in json.loads(part.read_text()) for row in summarize(result)]
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
