"""A training step of the 25M wide MLP on a GPU: DDP's allreduce against the sparse hook.

Launched by ``torchrun``; every rank uses ``cuda:(local rank mod device count)``, so on
one GPU all ranks share it. NCCL takes one rank per GPU; Gloo stages CUDA tensors through
host memory and runs any number of ranks on one GPU::

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_step.py --backend nccl
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_step.py --backend gloo

The model is ``pytorch_synthetic_benchmark.WideMLP`` (1024 -> 4096 -> 4096 -> 1000,
25.2M parameters) at ``--batch-size`` per rank, SGD (momentum 0.9, run by the hook as its
momentum correction when sparse). Per configuration, after ``--warmup`` steps, each of
``--steps`` steps is timed between two ``torch.cuda.synchronize()`` calls:

* ``compute``: the module alone (no DDP): forward, backward, optimizer step;
* ``allreduce``: DDP with its own allreduce;
* ``sparse:D``: DDP with ``sparse_allreduce_hook`` at density D.

Reported per configuration: median step (ms), the step minus ``compute`` (what the
gradient exchange adds, local work included), peak GPU memory during the timed steps
against ``compute``'s, and the synchronising CUDA calls per step made from
horovod_sparse's own code (``torch.cuda.set_sync_debug_mode("warn")`` over 3 steady
steps). Every rank must end with the same parameters (asserted). Rank 0 prints a
Markdown table and writes JSON to ``--out``. ``--profile N`` adds ``torch.profiler``'s
top N operations over 5 more steps of each sparse configuration (by host and by
device time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "pytorch"))

from pytorch_synthetic_benchmark import WideMLP  # noqa: E402

import horovod_sparse  # noqa: E402
from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook  # noqa: E402

PACKAGE_DIR = str(Path(horovod_sparse.__file__).resolve().parent)


class SyncCounter:
    """Counts the synchronising CUDA calls made from horovod_sparse's frames."""

    def __init__(self) -> None:
        self.sources: Counter[str] = Counter()
        self._saved = warnings.showwarning

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE_DIR)]
        if ours:
            where = os.path.relpath(ours[-1].filename, os.path.dirname(PACKAGE_DIR))
            self.sources[f"{where}:{ours[-1].lineno}"] += 1

    def __enter__(self) -> SyncCounter:
        torch.cuda.synchronize()
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._saved
        self._filters.__exit__(*exc)
        torch.cuda.synchronize()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    step: Callable[[], None], args: argparse.Namespace, device: torch.device, barrier: bool
) -> tuple[list[float], int, SyncCounter]:
    """``--steps`` step times after ``--warmup``, the peak memory over them, and the
    synchronising calls of 3 more steps (none counted on the CPU)."""
    for _ in range(args.warmup):
        step()
    on_gpu = device.type == "cuda"
    synchronize(device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        synchronize(device)
        if barrier:
            dist.barrier()
        began = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else 0
    syncs = SyncCounter()
    if on_gpu:  # the CPU path (--device cpu, a dry run of this script) has no syncs
        with syncs:
            for _ in range(3):
                step()
    return times, peak, syncs


def profiled(step: Callable[[], None], device: torch.device, rows: int) -> str:
    """``torch.profiler``'s table of 5 steps, by self CPU time (what the host spends
    launching and waiting) and by self device time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(5):
            step()
        synchronize(device)
    averages = profile.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    return "\n".join(tables)


def run(config: str, args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    module = WideMLP().to(device)
    numel = sum(p.numel() for p in module.parameters())
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch_size, 1024, generator=g, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), generator=g, device=device)
    kind, _, value = config.partition(":")
    state = None
    model: torch.nn.Module = module
    if kind != "compute":
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=25)
    if kind == "sparse":
        state = SparseState(density=float(value), momentum=0.9)
        model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=1e-3, momentum=0.0 if kind == "sparse" else 0.9
    )

    def step() -> None:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    times, peak, syncs = timed(step, args, device, barrier=kind != "compute")
    if args.profile and kind == "sparse":  # every rank steps alike; rank 0 prints
        table = profiled(step, device, args.profile)
        if dist.get_rank() == 0:
            print(table)
    if kind != "compute":
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, flat)
        assert all(torch.equal(part, flat) for part in parts), f"{config}: ranks differ"
    row = {
        "config": config,
        "numel": numel,
        "median_s": statistics.median(times),
        "peak_bytes": peak,
        "syncs_per_step": sum(syncs.sources.values()) / 3,
        "sync_sources": dict(syncs.sources),
    }
    if state is not None:
        stats = state.stats()
        row["bytes_moved"] = stats.bytes_sent + stats.bytes_received
        row["sparse_buckets"] = stats.sparse_buckets
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="rows of a sparse profile")
    parser.add_argument("--configs", default="compute,allreduce,sparse:0.01,sparse:0.001")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_step.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_step.py: CUDA is not available; this benchmark needs a GPU")
    dist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = []
    for config in args.configs.split(","):
        rows.append(run(config, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last configuration's model and optimizer are gone
    if dist.get_rank() == 0:
        size = dist.get_world_size()
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "backend": args.backend,
            "P": size,
            "batch_size": args.batch_size,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        compute = next((r for r in rows if r["config"] == "compute"), None)
        print(f"\n## {report['device']}, P = {size} ({args.backend}), batch {args.batch_size}\n")
        print(
            "| config | step (ms) | step - compute (ms) | peak memory (MiB) "
            "| host syncs / step (ours) | bytes moved, last step |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            extra = f"{1e3 * (r['median_s'] - compute['median_s']):.2f}" if compute else "-"
            moved = "-" if "bytes_moved" not in r else f"{r['bytes_moved']:,}"
            print(
                f"| {r['config']} | {1e3 * r['median_s']:.2f} | {extra} | "
                f"{r['peak_bytes'] / 2**20:.0f} | {r['syncs_per_step']:.1f} | {moved} |"
            )
        for r in rows:
            if r["sync_sources"]:
                print(f"{r['config']} syncs: {r['sync_sources']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
