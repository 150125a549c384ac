"""Worker of the fault test: plain (non-elastic) data-parallel SGD; one rank dies.

Every rank writes ``ready.<rank>.json`` (its pid) after ``hvd.init()``. Rank
``--kill-rank`` writes the wall-clock time to ``killed.json`` and kills itself with
SIGKILL at step ``--kill-at``. Every other rank trains until a collective fails, then
writes ``survivor.<rank>.json`` (exception type and message, the last frames of its
traceback, wall-clock time of the failure) and exits with status 1 at once
(``os._exit``). A rank that finishes every step writes ``finished.<rank>``.

Why at once: Horovod closes its Gloo connections only when the process ends, so a
survivor waiting on another survivor (not on the dead rank) learns of the failure only
when that peer's process is gone. A normal interpreter exit takes one to several seconds
here, and the failure would crawl from rank to rank at that pace.

A non-elastic ``horovodrun`` terminates the remaining workers (SIGTERM, then SIGKILL five
seconds later) once one of them exits non-zero, so a survivor stuck in a collective would
still be ended by the launcher, and SIGTERM could cut a survivor short before it reports.
Workers here therefore ignore SIGTERM: a survivor that writes ``survivor.<rank>.json``
raised its error on its own; one stuck in a collective is SIGKILLed without a report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("dense", "sparse"), default="sparse")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)

    hvd.init()
    rank = hvd.rank()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (out / f"ready.{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid()}))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.optimizer == "sparse":
        opt = hvds.DistributedOptimizer(sgd, model.named_parameters(), density=0.01)
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    step = 0
    try:
        for step in range(args.steps):
            if step == args.kill_at and rank == args.kill_rank:
                marker = {"rank": rank, "step": step, "time": time.time(), "pid": os.getpid()}
                (out / "killed.json").write_text(json.dumps(marker))
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(32, 256, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x).backward()
            opt.step()
    except BaseException as exc:
        failure = {
            "rank": rank,
            "step": step,
            "time": time.time(),
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "frames": [
                f"{Path(f.filename).name}:{f.lineno}:{f.name}"
                for f in traceback.extract_tb(exc.__traceback__)[-4:]
            ],
        }
        (out / f"survivor.{rank}.json").write_text(json.dumps(failure))
        print(f"rank {rank} failed at step {step}: {failure['type']}: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    (out / f"finished.{rank}").write_text(str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
