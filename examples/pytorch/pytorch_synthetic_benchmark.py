"""Synthetic training throughput: sparse vs dense allreduce on a communication-bound model.

Samples/s with a 95% confidence interval over timed iterations, after warm-up, in the
manner of Horovod's own synthetic benchmark.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/pytorch_synthetic_benchmark.py \\
        --model wide_mlp --density 0.01

``--density 1.0`` uses Horovod's ``hvd.DistributedOptimizer`` (dense allreduce).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

import torch

import horovod_sparse.torch as hvds


class WideMLP(torch.nn.Module):
    """25.1M parameters (1024 -> 4096 -> 4096 -> 1000): little compute per byte."""

    def __init__(self, features: int = 1024, width: int = 4096, classes: int = 1000) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EmbeddingTransformer(torch.nn.Module):
    """A small transformer with a tied 50k x 512 embedding: 32.0M parameters."""

    def __init__(self, vocab: int = 50_000, dim: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = torch.nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(block, layers)
        self.head = torch.nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight  # tied, as language models do

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["wide_mlp", "transformer"], default="wide_mlp")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--overlap", action="store_true", help="overlap_allgather=True")
    parser.add_argument(
        "--overlap-auto", action="store_true", help='overlap_allgather="auto" (judged by trials)'
    )
    parser.add_argument("--scheduler", choices=["fixed", "auto"], default="fixed")
    parser.add_argument("--scheduler-steps", type=int, default=100)
    parser.add_argument(
        "--fusion-mb", type=float, default=None, help="bucket size (default: Horovod's)"
    )
    parser.add_argument("--trace", default=None, help="Chrome trace path ({rank} allowed)")
    parser.add_argument("--json", default=None, help="write a summary here (rank 0)")
    args = parser.parse_args()
    # Imported here: benchmarks/ddp_step.py takes the models without Horovod.
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = WideMLP() if args.model == "wide_mlp" else EmbeddingTransformer()
    if args.model == "wide_mlp":
        data = torch.randn(args.batch_size, 1024)
        target = torch.randint(0, 1000, (args.batch_size,))
    else:
        data = torch.randint(0, 50_000, (args.batch_size, 64))
        target = torch.randint(0, 50_000, (args.batch_size, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    if args.density >= 1.0:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        mode = "dense"
    else:
        optimizer = hvds.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            density=args.density,
            fusion_threshold_bytes=None if args.fusion_mb is None else int(args.fusion_mb * 2**20),
            overlap_allgather="auto" if args.overlap_auto else args.overlap,
            model=model,
            scheduler=args.scheduler,
            scheduler_steps=args.scheduler_steps,
            trace=args.trace,
        )
        mode = ("auto" if args.scheduler == "auto" else f"sparse d={args.density}") + (
            " +overlap" if args.overlap else " +overlap(auto)" if args.overlap_auto else ""
        )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    parameters = sum(p.numel() for p in model.parameters())

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = torch.nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]), target.reshape(-1)
        )
        loss.backward()
        optimizer.step()

    for _ in range(args.num_warmup_batches):
        benchmark_step()
    rates, step_times = [], []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            benchmark_step()
        elapsed = time.perf_counter() - start
        rates.append(args.batch_size * args.num_batches_per_iter / elapsed)
        step_times.append(elapsed / args.num_batches_per_iter)
    mean = statistics.mean(rates)
    half_width = 1.96 * statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else 0.0
    moved, extra = None, {}
    if mode != "dense":
        optimizer.flush()  # the last step's deferred updates (overlap)
        s = optimizer.stats()
        moved = s.bytes_sent + s.bytes_received
        extra["dense_buckets"], extra["sparse_buckets"] = s.dense_buckets, s.sparse_buckets
        extra["schedule"] = {k: v["mode"] for k, v in optimizer.schedule().items()}
        extra["overlapping"] = optimizer.overlapping
        extra["fused_dense_runs"] = optimizer.fused_dense_runs
        extra["trials"] = [dataclasses.asdict(t) for t in optimizer.schedule_trials()]
        if args.trace:
            extra["trace"] = optimizer.trace_summary()
            optimizer.write_trace()
    if hvd.rank() == 0:
        total = mean * hvd.size()
        print(f"[{mode}] model {args.model}, {parameters:,} parameters, {hvd.size()} ranks")
        print(f"[{mode}] samples/s per rank: {mean:.1f} +- {half_width:.1f} (95% CI)")
        median_step = statistics.median(step_times)
        print(f"[{mode}] total samples/s: {total:.1f}; median step {median_step:.3f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "mode": mode,
                        "density": args.density,
                        "model": args.model,
                        "parameters": parameters,
                        "world_size": hvd.size(),
                        "samples_per_s_per_rank": mean,
                        "ci95": half_width,
                        "total_samples_per_s": total,
                        "median_step_s": statistics.median(step_times),
                        "step_times_s": step_times,
                        "bytes_per_step": moved,
                        **extra,
                    },
                    f,
                )


if __name__ == "__main__":
    main()
