"""Recall of the global selection during a real training run (launched by selection.py).

A 2-layer MLP trains on a synthetic task; every step the flattened gradient goes through
``horovod_sparse.torch.sparse_allreduce`` (the real implementation), the accumulators of
all ranks are gathered, and the selected indices are compared with

* the exact top-k of the summed accumulators (what a dense allreduce + top-k would keep);
* the exact top-k of the owners' reduced candidates (what the global threshold targets).
"""

from __future__ import annotations

import argparse
import json

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.common.config import budget


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--selection", default="threshold")
    parser.add_argument("--global-selection", default="reuse")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    k = budget(numel, args.density)
    teacher = torch.randn(64, 10)
    g = torch.Generator().manual_seed(hvd.rank())
    residual = torch.zeros(numel)
    recalls, candidate_recalls, kept = [], [], []
    refreshes = 0
    for _ in range(args.steps):
        x = torch.randn(64, 64, generator=g)
        y = (x @ teacher).argmax(-1)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        accumulators = hvd.allgather((residual + grad).view(1, -1), name="acc")
        out = hvds.sparse_allreduce(
            grad,
            density=args.density,
            name="g",
            op=hvd.Sum,
            selection=args.selection,
            global_selection=args.global_selection,
        )
        refreshes += hvds.stats("g").global_refreshes
        residual = hvds.residual("g").clone()
        chosen = set(out.nonzero().view(-1).tolist())
        ideal = set(accumulators.sum(0).abs().topk(k).indices.tolist())
        # The owners' candidates: the union of every rank's local top-k, summed.
        local = [a.abs().topk(k).indices for a in accumulators]
        candidates = torch.zeros(numel)
        for a, idx in zip(accumulators, local):
            candidates.index_add_(0, idx, a[idx])
        best = set(candidates.abs().topk(k).indices.tolist())
        recalls.append(len(chosen & ideal) / k)
        candidate_recalls.append(len(chosen & best) / k)
        kept.append(len(chosen) / k)
        offset = 0
        with torch.no_grad():
            for p in params:
                p -= 0.1 * out[offset : offset + p.numel()].view_as(p) / hvd.size()
                offset += p.numel()
    if hvd.rank() == 0:
        ordered = sorted(kept)

        def percentile(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        report = {
            "steps": args.steps,
            "selection": args.selection,
            "global_selection": args.global_selection,
            "global_refreshes": refreshes,
            "world_size": hvd.size(),
            "numel": numel,
            "k": k,
            "recall_mean": sum(recalls) / len(recalls),
            "recall_min": min(recalls),
            "candidate_recall_mean": sum(candidate_recalls) / len(candidate_recalls),
            "kept_over_k_min": min(kept),
            "kept_over_k_max": max(kept),
            "kept_over_k_p5": percentile(0.05),
            "kept_over_k_median": percentile(0.5),
            "kept_over_k_p95": percentile(0.95),
            "candidate_recall_min": min(candidate_recalls),
        }
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
