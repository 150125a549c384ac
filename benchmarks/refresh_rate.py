"""How often the reused global threshold refreshes, and how many rows it keeps, on fresh
i.i.d. gradients: ``sparse_allreduce`` of a new N(0, 1) tensor on every call.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/refresh_rate.py --numel 16M

Rank 0 prints, after ``--settled`` calls, the fraction of calls whose global threshold
came from the radix select (a refresh) and the kept count (entries of the result that
are not zero) against k = ceil(density · numel): minimum, mean and maximum. The residual
mass is checked every call against the dense sum (no entry lost) on a 1M-float prefix.
"""

from __future__ import annotations

import argparse
import json

import horovod.torch as hvd
import torch
from allreduce import parse_size  # this folder: the sizes as allreduce.py reads them

import horovod_sparse.torch as hvds
from horovod_sparse.common.config import budget
from horovod_sparse.common.stats import settled_reuse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="16M")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--settled", type=int, default=50, help="calls before counting")
    parser.add_argument("--json", default=None, help="write the summary here (rank 0)")
    args = parser.parse_args()
    hvd.init()
    numel, name = parse_size(args.numel), "refresh_rate"
    k = budget(numel, args.density)
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    prefix = min(numel, 1 << 20)
    carried = torch.zeros(prefix, dtype=torch.float64)  # residual before the call
    refreshed, kept = [], []
    for step in range(args.steps):
        grad = torch.randn(numel, generator=generator)
        out = hvds.sparse_allreduce(grad, density=args.density, name=name, op=hvd.Sum)
        refreshed.append(hvds.stats(name).global_refreshes > 0)
        kept.append(int((out != 0).sum()))
        # Mass conservation on the prefix: sent plus what stays equals what came in.
        residual = hvds.residual(name, hvd.global_process_set)[:prefix].double()
        came = hvd.allreduce(carried + grad[:prefix].double(), op=hvd.Sum, name="in")
        stays = hvd.allreduce(residual, op=hvd.Sum, name="stays")
        error = float((stays + out[:prefix].double() - came).abs().max())
        if error > 1e-3:
            raise AssertionError(f"call {step}: mass off by {error}")
        carried = residual
    summary = {
        "world_size": hvd.size(),
        "numel": numel,
        "density": args.density,
        "calls": args.steps,
        "settled_after": args.settled,
        **settled_reuse(refreshed, kept, k, args.settled),
        "refreshed_calls": [i for i, r in enumerate(refreshed) if r],
    }
    if hvd.rank() == 0:
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
