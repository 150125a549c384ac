"""What the automatic scheduler's link probe costs a step: ``probe_link`` against the
same probe with a fresh buffer and a fresh collective name for every repeat (as before
it reused them), alternating in one ``horovodrun`` job.

    python benchmarks/probe_cost.py [--ranks 2] [--largest 1180672] [--rounds 7]

``--largest``: the largest bucket's size (the probes stop there; the demo's sparse
bucket has 1,180,672 values). One torch thread a rank, as ``make demo`` sets. Prints,
for each way, the whole probe's milliseconds on rank 0 (median, lowest-highest over
the rounds) and the alpha-beta fit of each round.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_each_repeat(ops, like, world, name, process_set, numels):
    """The probe with a new buffer and name per repeat: the reference."""
    from horovod_sparse.common.cost_model import PROBE_REPEATS, fit_link

    samples = []
    for numel in numels:
        best = math.inf
        for repeat in range(PROBE_REPEATS):
            probe = ops.zeros(numel, like)
            began = ops.clock()
            ops.wait(ops.allreduce_sum_async(probe, f"{name}.probe{numel}.{repeat}", process_set))
            best = min(best, ops.clock() - began)
        samples.append((numel, best))
    return fit_link(samples, world)


def worker(largest: int, rounds: int) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_sparse.common.cost_model import probe_link, probe_numels
    from horovod_sparse.torch.backend import TorchBackend

    hvd.init()
    torch.set_num_threads(1)
    ops, like, world = TorchBackend(), torch.zeros(1), hvd.size()
    numels = probe_numels(largest)
    ways = {"fresh buffer and name per repeat": fresh_each_repeat, "probe_link": probe_link}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    fits: dict[str, list[str]] = {way: [] for way in ways}
    for round_ in range(rounds):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        for way in order:
            hvd.allreduce(torch.zeros(1), name="line_up")  # start together
            began = time.perf_counter()
            link = ways[way](
                ops, like, world, f"r{round_}.{len(way)}", hvd.global_process_set, numels
            )
            seconds[way].append(time.perf_counter() - began)
            fits[way].append(f"{1e3 * link.alpha:.2f} ms, {1e9 * link.beta:.2f} ns/B")
    if hvd.rank() == 0:
        print(f"P = {world}, probe sizes {numels}, {rounds} rounds")
        print("| probe | ms (median, lowest-highest) | alpha, beta per round |")
        print("|---|---|---|")
        for way, times in seconds.items():
            ms = [1e3 * t for t in times]
            print(
                f"| {way} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) "
                f"| {'; '.join(fits[way])} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--largest", type=int, default=1_180_672)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.largest, args.rounds)
        return
    cmd = [
        "horovodrun", "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
        sys.executable, __file__, "--worker",
        "--largest", str(args.largest), "--rounds", str(args.rounds),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, env=env, timeout=600)


if __name__ == "__main__":
    main()
