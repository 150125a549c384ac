"""The digits CNN on a local Ray cluster, launched by Horovod's ``RayExecutor``: dense
``hvd.DistributedOptimizer`` and then the sparse optimizer, on the same workers.

    pip install ray        # not among this package's requirements
    python examples/pytorch/digits_ray.py --workers 2 --density 0.01 --steps 300

``RayExecutor`` starts one Horovod worker per Ray actor (Gloo, CPU) and runs
``digits_cnn.train`` on each (the same training as ``horovodrun ... digits_cnn.py``).
The last line is a JSON object with both runs' accuracy, bytes per step and parameter
spread across workers (0 when every worker holds the same parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from horovod.ray import RayExecutor

HERE = Path(__file__).resolve().parent


def train_on_worker(argv: list[str]) -> dict[str, Any]:
    import digits_cnn  # on the worker: the examples folder is on its PYTHONPATH

    return digits_cnn.train(digits_cnn.parse(argv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=None, help="write the summaries here")
    args = parser.parse_args()

    # Workers import digits_cnn (this folder) and horovod_sparse (installed, or this checkout).
    path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=args.workers,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    began = time.perf_counter()
    settings = RayExecutor.create_settings(timeout_s=120)
    executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=1, use_gpu=False)
    executor.start()
    started = time.perf_counter() - began
    runs = {}
    try:
        for density in (1.0, args.density):
            argv = ["--density", str(density), "--steps", str(args.steps), "--eval-every", "100"]
            summaries = executor.run(train_on_worker, args=[argv])
            runs[summaries[0]["mode"]] = summaries[0]
    finally:
        executor.shutdown()
        ray.shutdown()
    report = {
        "workers": args.workers,
        "executor_start_seconds": round(started, 1),
        "runs": {
            mode: {
                key: s[key]
                for key in (
                    "final_test_acc",
                    "final_train_loss",
                    "bytes_per_step",
                    "dense_bytes_per_step",
                    "parameter_spread",
                    "seconds",
                )
            }
            for mode, s in runs.items()
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
