"""Worker of the elastic test: sparse SGD under ``hvd.elastic.run``; one worker dies.

The worker placed on host ``127.0.0.1`` kills itself (SIGKILL) after ``--kill-at``
committed steps; the survivors on ``localhost`` must restore, rebuild the sparse
reducers for the smaller world and finish. Each survivor writes a JSON report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        density=0.05,
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])
    resets = []  # outside the state: a restore must not roll it back

    def on_reset() -> None:
        resets.append(hvd.size())

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < args.steps:
            if (
                state.step == args.kill_at
                and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1"
                and not (out / "killed").exists()
            ):
                (out / "killed").write_text(str(hvd.rank()))
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            # Every rank must hold the same parameters after every step.
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            spread = hvd.allreduce(flat, op=hvd.Max, name="hi") - hvd.allreduce(
                flat, op=hvd.Min, name="lo"
            )
            assert spread.abs().max().item() == 0.0, "parameters differ between ranks"
            state.sizes.append(hvd.size())
            state.step += 1
            state.commit()

    train(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    report = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "step": state.step,
        "resets": resets,
        "sizes": state.sizes,
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "reducer_world_sizes": [v.world_size for v in opt.buckets() if v.sparse],
        "residual_abs_sum": sum(float(r.abs().sum()) for r in opt.residuals().values()),
    }
    (out / f"report.{hvd.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
