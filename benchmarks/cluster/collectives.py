"""One rank of the alpha-beta measurement: time collectives over message sizes.

Run inside the emulated cluster by ``run.py``; rank 0 writes the medians as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import horovod.torch as hvd
import torch

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22]  # float32 elements per rank


def timed(fn, tag: str, repeats: int = 5) -> float:
    times = []
    for i in range(repeats + 1):
        hvd.barrier()
        start = time.perf_counter()
        fn(tag)  # one name a tag: a fresh name each call would negotiate it
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        slowest = float(hvd.allreduce(elapsed, op=hvd.Max, name=f"{tag}.t"))
        if i:
            times.append(slowest)
    return statistics.median(times)


def main(out: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    size = hvd.size()
    rows = []
    for numel in SIZES:
        x = torch.randn(numel)
        chunks = torch.full((size,), numel // size, dtype=torch.int32)
        chunks[-1] += numel - int(chunks.sum())
        rows.append(
            {
                "op": "allreduce",
                "numel": numel,
                "seconds": timed(lambda n, x=x: hvd.allreduce(x, name=n), f"ar{numel}"),
            }
        )
        rows.append(
            {
                "op": "alltoall",
                "numel": numel,
                "seconds": timed(
                    lambda n, x=x, c=chunks: hvd.alltoall(x, splits=c, name=n), f"aa{numel}"
                ),
            }
        )
        part = x[: numel // size]
        rows.append(
            {
                "op": "allgather",
                "numel": numel // size,
                "seconds": timed(lambda n, part=part: hvd.allgather(part, name=n), f"ag{numel}"),
            }
        )
    # The whole sparse allreduce (selection included) against dense, for the model check.
    import horovod_sparse.torch as hvds
    from horovod_sparse.common.config import budget

    grad = torch.randn(1 << 22)
    for density in (0.01, 0.001):
        for way in ("reuse", "exact"):
            hvds.reset_residuals()
            name = f"sparse{density}.{way}"
            seen = {"calls": 0, "refreshes": 0, "selected": 0}

            def call(
                n: str, d: float = density, t: str = name, w: str = way, seen: dict = seen
            ) -> None:
                hvds.sparse_allreduce(grad, d, t, global_selection=w)
                step = hvds.stats(t)
                seen["calls"] += 1
                seen["refreshes"] += step.global_refreshes
                seen["selected"] += step.selected

            seconds = timed(call, name)
            s = hvds.stats(name)
            rows.append(
                {
                    "op": "sparse_allreduce",
                    "global_selection": way,
                    "numel": grad.numel(),
                    "density": density,
                    "seconds": seconds,
                    "seconds_select": s.seconds_select,
                    "bytes_per_rank": s.bytes_sent + s.bytes_received,
                    # Over every call, the warm-up call included.
                    "refresh_fraction": seen["refreshes"] / seen["calls"],
                    "kept_over_k": seen["selected"] / seen["calls"] / budget(grad.numel(), density),
                }
            )
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": size, "rows": rows}, f)


if __name__ == "__main__":
    main(sys.argv[1])
