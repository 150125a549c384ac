"""Training-step time and bytes under DDP: DDP's allreduce, PowerSGD (rank 1, 2, 4) and
the sparse hook (density 0.01, 0.001), in one run per world size and network.

Two models:

* ``layer``: one 4096x4096 layer, 16.8M fp32 gradients in one DDP bucket: the allreduce
  benchmark (the step is little more than the bucket's reduction);
* ``wide_mlp``: the synthetic benchmark's 25.1M-parameter MLP
  (``examples/pytorch/pytorch_synthetic_benchmark.py``) in 25 MB DDP buckets (3; one for
  PowerSGD, which hit a Gloo collective mismatch with several), SGD with momentum 0.9
  (run by the sparse hook, as its momentum correction): the training-step benchmark.

Two networks: this machine's loopback (``torchrun``), or the emulated cluster of
``benchmarks/cluster`` (one rank per network namespace, links shaped to 1 or 10 Gbit/s;
needs root):

    python benchmarks/ddp_step.py                               # layer, loopback, P = 2, 4
    python benchmarks/ddp_step.py --model wide_mlp --batch-size 8
    sudo -E .venv/bin/python benchmarks/ddp_step.py --cluster 1g,10g --sizes 4

Launched by ``torchrun`` itself, it is one run at that world size (rank 0 prints the
table), as any DDP job is launched:

    torchrun --standalone --nproc-per-node 4 benchmarks/ddp_step.py --model wide_mlp

Each configuration runs ``--warmup`` steps (PowerSGD's dense warm-up and the hook's first,
dense iteration among them), then ``--steps`` timed steps; the median step is reported
with the bytes one rank sends and receives per step (the hook: ``stats()``; allreduce
and PowerSGD: their ring allreduces).

``--overlap`` times the sparse hook (``--density``, momentum 0.9) as it is, each bucket's
exchange overlapping the backward of the buckets after it, against the same hook made to
wait on each bucket's future inside the hook (``waiting_hook``: each bucket finished
before the backward goes on). Both models run side by side in one job, interleaved:
``--repeats`` rounds of ``--steps`` steps each (which hook goes first alternates), after
``--warmup`` steps each. The median step, the ratio overlap/waiting of the medians and
the median over rounds of each round's ratio (paired: robust to a load that drifts), and
the hook's ``max_in_flight`` go to ``results/ddp_overlap.md`` and ``.json`` (both
parameter sets are checked bitwise equal):

    python benchmarks/ddp_step.py --overlap --model layer,wide_mlp --batch-size 8 --repeats 5
    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_step.py --overlap --model wide_mlp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["allreduce", "powersgd:1", "powersgd:2", "powersgd:4", "sparse:0.01", "sparse:0.001"]
MODELS = ("layer", "wide_mlp")
# --overlap: the hook as it is, and the hook waiting on each bucket's future.
OVERLAP_CONFIGS = ("overlap", "waiting")


def waiting_hook(state, bucket):
    """The sparse hook made to wait on each bucket: it returns a completed future, so no
    bucket's exchange overlaps the backward of the buckets after it."""
    import torch

    from horovod_sparse.torch.ddp import sparse_allreduce_hook

    future = torch.futures.Future()
    future.set_result(sparse_allreduce_hook(state, bucket).wait())
    return future


def build(model_name: str, batch_size: int, rank: int) -> tuple:
    """The module, DDP's bucket cap, and this rank's batch (inputs, targets or None)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "pytorch"))
    from pytorch_synthetic_benchmark import WideMLP

    torch.manual_seed(0)
    inputs = torch.Generator().manual_seed(rank)
    if model_name == "layer":
        module = torch.nn.Linear(4096, 4096, bias=False)
        return module, 1024, torch.randn(batch_size, 4096, generator=inputs), None
    module = WideMLP()
    x = torch.randn(batch_size, 1024, generator=inputs)
    return module, 25, x, torch.randint(0, 1000, (batch_size,), generator=inputs)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "examples" / "pytorch"))
    from ddp_train import powersgd_bytes

    from horovod_sparse.common.stats import allreduce_ring_bytes
    from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    torch.set_num_threads(1)
    results = []
    for config in CONFIGS:
        module, bucket_cap_mb, x, y = build(args.model, args.batch_size, dist.get_rank())
        numel = sum(p.numel() for p in module.parameters())
        kind, _, value = config.partition(":")
        if kind == "powersgd":
            # One bucket: PowerSGD's hook hit a Gloo collective mismatch with several
            # (examples/pytorch/ddp_train.py).
            bucket_cap_mb = 1024
        elif args.bucket_cap_mb:
            bucket_cap_mb = args.bucket_cap_mb
        model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        # The sparse hook runs SGD's momentum itself (momentum correction).
        momentum = 0.0 if kind == "sparse" else 0.9
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=momentum)
        state = None
        dense_bytes = sum(allreduce_ring_bytes(numel, size, 4))
        moved = dense_bytes
        if kind == "powersgd":
            rank = int(value)
            state = powersgd.PowerSGDState(
                None, matrix_approximation_rank=rank, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, powersgd.powerSGD_hook)
            moved = powersgd_bytes(module, rank, size)
        elif kind == "sparse":
            state = SparseState(density=float(value), momentum=0.9)
            model.register_comm_hook(state, sparse_allreduce_hook)
        times = []
        for step in range(args.warmup + args.steps):
            optimizer.zero_grad()
            dist.barrier()
            began = time.perf_counter()
            out = model(x)
            loss = out.square().mean() if y is None else torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - began)
        buckets = None  # the hook's count: sparse and dense DDP buckets
        if kind == "sparse":
            stats = state.stats()
            moved = stats.bytes_sent + stats.bytes_received
            buckets = stats.sparse_buckets + stats.dense_buckets
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        parts = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(parts, flat)
        assert all(torch.equal(part, flat) for part in parts), "ranks differ"
        results.append(
            {
                "P": size,
                "config": config,
                "median_s": statistics.median(times),
                "bytes": moved,
                "dense_bytes": dense_bytes,
                "bucket_cap_mb": bucket_cap_mb,
                "buckets": buckets,
            }
        )
    if dist.get_rank() == 0:
        if args.result:
            Path(args.result).write_text(json.dumps(results))
        else:  # launched by torchrun directly
            print(table([dict(row, network="this launch") for row in results]))
    # destroy_process_group is no barrier (examples/pytorch/quickstart_ddp.py says why).
    dist.barrier()
    dist.destroy_process_group()


def overlap_worker(args: argparse.Namespace) -> None:
    """One rank of --overlap: every model of ``--model`` in turn."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = [row for name in args.model.split(",") for row in overlap_rows(args, name)]
    if dist.get_rank() == 0:
        if args.result:
            Path(args.result).write_text(json.dumps(results))
        else:  # launched by torchrun directly
            print(overlap_table([dict(row, network="this launch") for row in results]))
    dist.barrier()  # destroy_process_group is no barrier
    dist.destroy_process_group()


def overlap_rows(args: argparse.Namespace, model_name: str) -> list[dict]:
    """--overlap: the hook as it is against the hook waiting on each bucket, on one
    model, interleaved round by round; one row each at this world size."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook

    size = dist.get_world_size()
    runs = {}
    for config in OVERLAP_CONFIGS:
        module, bucket_cap_mb, x, y = build(model_name, args.batch_size, dist.get_rank())
        bucket_cap_mb = args.bucket_cap_mb or bucket_cap_mb
        model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        state = SparseState(density=args.density, momentum=0.9)  # the optimizer's momentum
        model.register_comm_hook(
            state, sparse_allreduce_hook if config == "overlap" else waiting_hook
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        runs[config] = (model, optimizer, state, x, y, [])

    def step(config: str) -> float:
        model, optimizer, _, x, y, _ = runs[config]
        optimizer.zero_grad()
        dist.barrier()
        began = time.perf_counter()
        out = model(x)
        loss = out.square().mean() if y is None else torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - began

    for config in OVERLAP_CONFIGS:
        for _ in range(args.warmup):
            step(config)
    for round_ in range(args.repeats):
        # Alternate which hook goes first, so that a drift in the machine's load
        # weighs on both alike; each round's steps are kept apart for the paired ratio.
        for config in OVERLAP_CONFIGS[:: 1 if round_ % 2 == 0 else -1]:
            runs[config][5].append([step(config) for _ in range(args.steps)])
    flats = {
        config: torch.cat([p.detach().reshape(-1) for p in run[0].parameters()])
        for config, run in runs.items()
    }
    assert torch.equal(flats["overlap"], flats["waiting"]), "overlap changed the result"
    parts = [torch.empty_like(flats["overlap"]) for _ in range(size)]
    dist.all_gather(parts, flats["overlap"])
    assert all(torch.equal(part, flats["overlap"]) for part in parts), "ranks differ"
    rows = []
    for config, (_, _, state, _, _, rounds) in runs.items():
        stats = state.stats()
        times = [t for one in rounds for t in one]
        rows.append(
            {
                "model": model_name,
                "P": size,
                "config": config,
                "density": args.density,
                "buckets": stats.sparse_buckets + stats.dense_buckets,
                "max_in_flight": state.max_in_flight,
                "median_s": statistics.median(times),
                "steps": len(times),
                "round_medians_s": [statistics.median(one) for one in rounds],
                "times_s": times,
            }
        )
    return rows


def overlap_table(rows: list[dict]) -> str:
    lines = [
        "| network | model | P | buckets | waiting: step (ms) | overlap: step (ms) "
        "| overlap / waiting | same, paired rounds | max in flight |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["network"], r["model"], r["P"]) for r in rows}, key=str)
    for key in keys:
        mine = {r["config"]: r for r in rows if (r["network"], r["model"], r["P"]) == key}
        waited, overlapped = mine["waiting"], mine["overlap"]
        paired = statistics.median(
            o / w for o, w in zip(overlapped["round_medians_s"], waited["round_medians_s"])
        )
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {overlapped['buckets']} | "
            f"{1e3 * waited['median_s']:.1f} | {1e3 * overlapped['median_s']:.1f} | "
            f"{overlapped['median_s'] / waited['median_s']:.3f} | {paired:.3f} | "
            f"{overlapped['max_in_flight']} |"
        )
    return "\n".join(lines)


def worker_args(args: argparse.Namespace, result: Path) -> list[str]:
    return [
        __file__,
        "--worker",
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--density",
        str(args.density),
        "--bucket-cap-mb",
        str(args.bucket_cap_mb),
        *(["--overlap"] if args.overlap else []),
        "--result",
        str(result),
    ]


def run_loopback(args: argparse.Namespace, size: int, result: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(size), *worker_args(args, result)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    if done.returncode != 0:
        raise RuntimeError(f"P={size} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def run_cluster(args: argparse.Namespace, size: int, preset: str, result: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from cluster import PRESETS, Cluster

    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with Cluster(size, PRESETS[preset]) as cluster:
        code = cluster.run_distributed(
            [sys.executable, *worker_args(args, result)], timeout=3000, env=env
        )
    if code != 0:
        raise RuntimeError(f"P={size} on {preset} failed with exit code {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="layer", help="layer or wide_mlp (--overlap: a list)")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--cluster", default="", help="link presets, e.g. 1g,10g (root)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--overlap", action="store_true", help="overlap against waiting")
    parser.add_argument(
        "--bucket-cap-mb",
        type=int,
        default=0,
        help="DDP's bucket cap for allreduce and the hook (0: the model's, 25 for wide_mlp)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="--overlap: interleaved rounds")
    parser.add_argument("--density", type=float, default=0.01, help="--overlap: the density")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="default: results/ddp_step_*")
    args = parser.parse_args()
    names = args.model.split(",")
    if any(name not in MODELS for name in names) or (len(names) > 1 and not args.overlap):
        parser.error(f"--model: one of {MODELS} (with --overlap, a comma-separated list)")
    if args.worker or "TORCHELASTIC_RUN_ID" in os.environ:  # a rank, or torchrun's child
        (overlap_worker if args.overlap else worker)(args)
        return
    if args.overlap:
        overlap_main(args)
        return
    networks = args.cluster.split(",") if args.cluster else ["loopback"]
    out = args.out or ROOT / "results" / f"ddp_step_{args.model}_{'_'.join(networks)}"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for network in networks:
        for size in (int(s) for s in args.sizes.split(",")):
            result = out / f"{network}_p{size}.json"
            if network == "loopback":
                run_loopback(args, size, result)
            else:
                run_cluster(args, size, network, result)
            rows += [dict(row, network=network) for row in json.loads(result.read_text())]
            print(f"{network} P={size} done", flush=True)
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    (out / "rows.json").write_text(json.dumps(rows))
    print(text)
    plot(rows, args.model, out / "step_vs_allreduce.png")


def overlap_main(args: argparse.Namespace) -> None:
    """--overlap on this machine's loopback, one torchrun job per world size."""
    out = args.out or ROOT / "results"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    load = os.getloadavg()
    for size in (int(s) for s in args.sizes.split(",")):
        result = out / f"ddp_overlap_p{size}.json"
        run_loopback(args, size, result)
        rows += [dict(row, network="loopback") for row in json.loads(result.read_text())]
        result.unlink()
        print(f"loopback P={size} done", flush=True)
    text = overlap_table(rows)
    command = " ".join(["python benchmarks/ddp_step.py", *sys.argv[1:]])
    note = (
        f"`{command}`: {args.warmup} warm-up steps, then {args.repeats} interleaved rounds "
        f"of {args.steps} steps per hook; median step, and the median of the rounds' "
        f"ratios; density {args.density}, momentum 0.9, batch "
        f"{args.batch_size}, {os.cpu_count()} CPU cores, load average before / after: "
        f"{load[0]:.2f} / {os.getloadavg()[0]:.2f}."
    )
    (out / "ddp_overlap.md").write_text(text + "\n\n" + note + "\n")
    (out / "ddp_overlap.json").write_text(json.dumps({"command": command, "rows": rows}))
    print(text)
    print(note)


def table(rows: list[dict]) -> str:
    lines = [
        "| network | P | hook | median step (s) | vs allreduce | bytes/step | vs allreduce |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(
            r
            for r in rows
            if (r["network"], r["P"], r["config"]) == (row["network"], row["P"], "allreduce")
        )
        lines.append(
            f"| {row['network']} | {row['P']} | {row['config']} | {row['median_s']:.3f} | "
            f"{row['median_s'] / base['median_s']:.2f}x | {row['bytes']:,} | "
            f"{row['bytes'] / row['dense_bytes']:.2%} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], model: str, path: Path) -> None:
    """Step time against allreduce's, and bytes, per hook: one panel per (network, P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["network"], r["P"]) for r in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (network, size) in zip(axes[0], panels):
        mine = [r for r in rows if (r["network"], r["P"]) == (network, size)]
        base = next(r for r in mine if r["config"] == "allreduce")
        for row in mine:
            ratio = row["median_s"] / base["median_s"]
            axis.scatter(row["bytes"], ratio, label=row["config"])
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_xlabel("bytes per step and rank")
        axis.set_ylabel("step time / allreduce's")
        axis.set_title(f"{model}, {network}, P = {size}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
