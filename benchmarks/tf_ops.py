"""What a traced TF training step runs, op by op: Horovod's tape against the sparse tape.

Trains the demo's MLP (or ``--model wide``) as ``benchmarks/step_profile.py --framework tf``
does, dense and sparse in turn, in one ``horovodrun -np P --gloo`` job, then runs
``--profiled`` more steps of each mode under TF's profiler on rank 0 (the other ranks run
the same steps unprofiled) and prints, per step and for each mode: the wall time of the
profiled steps, the kernels' time and count, the executor's time around them, and the
kernels by op type (summed over TF's compute threads, so kernels that ran side by side
add up: the totals are work, not a breakdown of the step).

Horovod's collectives run as asynchronous kernels whose wait shows in no op; the step's
wall time less what the kernels explain is the waiting, and the threads' parallelism.

    python benchmarks/tf_ops.py [--model demo] [--ranks 2] [--threads 1]
                                [--warmup 40] [--profiled 20] [--top 25]

``--threads default`` sets nothing (TF takes every core in every rank); ``1`` sets one
intra-op thread in every rank. Writes JSON and markdown (default results/tf_ops.*).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The executor's own events (the work around each kernel), not kernels.
EXECUTOR = "ExecutorState::Process"


def op_type(event_name: str) -> str | None:
    """A kernel event's op type (TF names them ``scope/name:Type``); None for the
    profiler's other events (the executor, regions, Python)."""
    if ":" not in event_name or event_name.startswith("Executor"):
        return None
    kind = event_name.rsplit(":", 1)[1]
    return None if kind in ("StartRegion", "StopRegion", "Record") else kind


def tally(space: Any, steps: int) -> dict[str, Any]:
    """Per step: kernel milliseconds and counts by op type, their totals, and the
    executor's milliseconds, over the host plane's compute threads of an ``XSpace``."""
    milliseconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    executor = 0.0
    for plane in space.planes:
        if "CPU" not in plane.name:
            continue
        names = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = names[event.metadata_id].name
                if name == EXECUTOR:
                    executor += event.duration_ps / 1e9
                kind = op_type(name)
                if kind is not None:
                    milliseconds[kind] += event.duration_ps / 1e9
                    counts[kind] += 1
    return {
        "kernels_ms": sum(milliseconds.values()) / steps,
        "kernels": sum(counts.values()) / steps,
        "executor_ms": executor / steps,
        "by_type": {
            kind: {"ms": ms / steps, "count": counts[kind] / steps}
            for kind, ms in milliseconds.most_common()
        },
    }


def markdown(modes: dict[str, dict[str, Any]], top: int) -> str:
    """Totals, then the ``top`` op types by the largest time in any mode, one column
    pair (ms, count) a mode."""
    names = list(modes)
    header = "| | " + " | ".join(f"{name} ms | {name} ops" for name in names) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(names)]

    def row(label: str, cells: list[tuple[float, float | None]]) -> str:
        text = [f"{ms:.2f} | {'' if n is None else f'{n:.1f}'}" for ms, n in cells]
        return f"| {label} | " + " | ".join(text) + " |"

    lines.append(row("step, wall", [(m["step_ms"], None) for m in modes.values()]))
    lines.append(row("executor", [(m["executor_ms"], None) for m in modes.values()]))
    lines.append(row("kernels", [(m["kernels_ms"], m["kernels"]) for m in modes.values()]))
    absent = {"ms": 0.0, "count": 0.0}  # an op type a mode did not run
    kinds = {kind for m in modes.values() for kind in m["by_type"]}
    ranked = sorted(
        kinds, key=lambda k: -max(m["by_type"].get(k, absent)["ms"] for m in modes.values())
    )
    for kind in ranked[:top]:
        of_kind = [m["by_type"].get(kind, absent) for m in modes.values()]
        lines.append(row(f"`{kind}`", [(t["ms"], t["count"]) for t in of_kind]))
    return "\n".join(lines)


def worker(model: str, threads: str, warmup: int, profiled: int, out: str) -> None:
    import tensorflow as tf

    if threads != "default":
        tf.config.threading.set_intra_op_parallelism_threads(int(threads))
    import horovod.tensorflow as hvd
    import step_profile
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    hvd.init()
    runs = {
        "dense": step_profile.TFRun(model, False, warmup, eager=False),
        "sparse": step_profile.TFRun(model, True, warmup, eager=False),
    }
    step_profile.interleaved(list(runs.values()), warmup)
    modes = {}
    for name, run in runs.items():
        folder = tempfile.mkdtemp(prefix=f"tf_ops_{name}_")
        if hvd.rank() == 0:
            tf.profiler.experimental.start(folder)
        began = time.perf_counter()
        for step in range(warmup, warmup + profiled):
            run.step(step)
        wall = (time.perf_counter() - began) / profiled
        if hvd.rank() != 0:
            continue
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        space.ParseFromString(next(Path(folder).rglob("*.xplane.pb")).read_bytes())
        modes[name] = {"step_ms": 1e3 * wall, **tally(space, profiled)}
    if hvd.rank() == 0:
        setting = {"model": model, "P": hvd.size(), "threads": threads, "profiled": profiled}
        Path(out).write_text(json.dumps(setting | {"modes": modes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", choices=("demo", "wide"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", default="1")
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--profiled", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=str(ROOT / "results" / "tf_ops"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.threads, args.warmup, args.profiled, args.worker)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f"{out.name}.np{args.ranks}.json")
    cmd = [
        "horovodrun", "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
        sys.executable, __file__, "--model", args.model, "--threads", args.threads,
        "--warmup", str(args.warmup), "--profiled", str(args.profiled), "--worker", str(part),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    env.pop("OMP_NUM_THREADS", None)  # "default" means what horovodrun leaves
    subprocess.run(cmd, check=True, env=env, timeout=1800, stdout=subprocess.DEVNULL)
    result = json.loads(part.read_text())
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = (
        f"{result['model']}, P = {result['P']}, threads {result['threads']}, "
        f"{result['profiled']} profiled steps a mode, per step:\n\n"
        + markdown(result["modes"], args.top)
    )
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
