"""The digits CNN, the char LM or the wide MLP under ``DistributedDataParallel``, with
DDP's allreduce, PowerSGD or the sparse hook, launched as DDP jobs are (no Horovod
needed):

    torchrun --standalone --nproc-per-node 2 examples/pytorch/ddp_train.py --hook sparse
    torchrun --standalone --nproc-per-node 2 examples/pytorch/ddp_train.py --hook powersgd
    torchrun --standalone --nproc-per-node 2 examples/pytorch/ddp_train.py --hook allreduce
    torchrun --standalone --nproc-per-node 2 examples/pytorch/ddp_train.py --task char_lm

The data, model and optimizer are those of ``digits_cnn.py`` (rank r trains on every
P-th training image from r; SGD with momentum 0.9, the learning rate scaled by P; 600
steps), ``char_lm.py`` (random windows of standard-library sources per rank; AdamW,
lr 1e-3, weight decay 0.01; 500 steps) and ``wide_mlp.py`` (the 25.6M-parameter MLP on
a Gaussian mixture; batch 16, SGD with momentum 0.9 at 0.0025 scaled by P; 250 steps).
With the sparse hook, SGD's momentum runs in the hook (momentum correction;
``--no-momentum-correction`` leaves it in the optimizer);
``--adam-correction`` runs the char LM's AdamW in the hook too (``SparseState(betas=...)``,
with ``SGD(weight_decay=...)`` stepping by the exchanged direction). Where the optimizer
is then plain SGD, each forward and backward runs at the parameters moved by the update
pending in the residuals (``state.residual_lookahead(optimizer)``;
``--no-residual-lookahead`` turns it off). Rank 0 prints the
final metric and the bytes one rank sends and receives per step: measured by the sparse
hook's ``stats()``; for allreduce and PowerSGD, those of the ring allreduces they issue
(PowerSGD: P and Q of each matrix it compresses, at its rank, and the other tensors
uncompressed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import char_lm
import digits_cnn
import wide_mlp

from horovod_sparse.common.stats import allreduce_ring_bytes
from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class Task:
    """A model, its optimizer, this rank's batches and the final metric."""

    steps: int
    metric: str
    momentum = 0.0  # SGD momentum, which the sparse hook can run instead (correction)

    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    def optimizer(self, parameters: Any, size: int, momentum: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def batches(self, rank: int, size: int, seed: int) -> Batches:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: torch.nn.Module) -> float:
        raise NotImplementedError


class Digits(Task):
    steps, metric, momentum = 600, "final_test_acc", 0.9
    batch_size, lr = 32, 0.02  # per rank; the learning rate is scaled by P

    def __init__(self) -> None:
        self.x_train, self.y_train, self.x_test, self.y_test = digits_cnn.load_split()

    def model(self) -> torch.nn.Module:
        return digits_cnn.DigitsCNN()

    def optimizer(self, parameters: Any, size: int, momentum: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=self.lr * size, momentum=momentum)

    def batches(self, rank: int, size: int, seed: int) -> Batches:
        order = torch.Generator().manual_seed(seed * 1000 + rank)
        mine = self.x_train[rank::size], self.y_train[rank::size]
        return digits_cnn.batches(*mine, self.batch_size, order)

    def evaluate(self, model: torch.nn.Module) -> float:
        return digits_cnn.accuracy(model, self.x_test, self.y_test)


class CharLM(Task):
    steps, metric = 500, "final_val_loss"
    context, batch_size = 64, 16

    def __init__(self) -> None:
        self.train_text = char_lm.read_text(char_lm.TRAIN_MODULES)
        self.val_text = char_lm.read_text(char_lm.VALIDATION_MODULES)

    def model(self) -> torch.nn.Module:
        return char_lm.CharTransformer(self.context)

    betas = (0.9, 0.999)  # AdamW's

    def optimizer(self, parameters: Any, size: int, momentum: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameters, lr=1e-3, betas=self.betas, weight_decay=0.01)

    def corrected_optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        """The optimizer when the hook runs AdamW: SGD's decay is AdamW's decoupled one."""
        return torch.optim.SGD(parameters, lr=1e-3, weight_decay=0.01)

    def batches(self, rank: int, size: int, seed: int) -> Batches:
        draw = torch.Generator().manual_seed(seed * 1000 + rank)
        last = len(self.train_text) - self.context - 1
        while True:
            starts = torch.randint(0, last, (self.batch_size,), generator=draw)
            yield char_lm.windows(self.train_text, starts, self.context)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x).reshape(-1, char_lm.VOCAB)
        return torch.nn.functional.cross_entropy(logits, y.reshape(-1))

    def evaluate(self, model: torch.nn.Module) -> float:
        return char_lm.validation_loss(model, self.val_text, self.context)


class WideMLP(Digits):
    """A classifier trained as the digits CNN is, with wide_mlp.py's model and data."""

    steps = wide_mlp.DEFAULTS["steps"]
    batch_size, lr = wide_mlp.DEFAULTS["batch_size"], wide_mlp.DEFAULTS["lr"]

    def __init__(self) -> None:
        self.x_train, self.y_train, self.x_test, self.y_test = wide_mlp.load_split()

    def model(self) -> torch.nn.Module:
        return wide_mlp.model()


TASKS: dict[str, Callable[[], Task]] = {"digits": Digits, "char_lm": CharLM, "wide_mlp": WideMLP}


def powersgd_bytes(model: torch.nn.Module, rank: int, size: int) -> int:
    """Bytes one rank sends and receives per compressed PowerSGD step: ring allreduces
    of the (n + m)·rank factors of each matrix it compresses and of the other tensors."""
    floats = 0
    for p in model.parameters():
        n = p.shape[0] if p.dim() > 1 else 1
        m = p.numel() // n
        factors = (n + m) * min(rank, n, m)
        # PowerSGD compresses a matrix only when that saves 2x (min_compression_rate).
        floats += factors if p.dim() > 1 and n * m >= 2 * factors else p.numel()
    return sum(allreduce_ring_bytes(floats, size, 4))


def set_up_reduction(
    args: argparse.Namespace, task: Any, model: DistributedDataParallel, size: int
) -> tuple[Any, str, torch.optim.Optimizer, Any]:
    """Register the chosen hook on ``model``; its state, the mode's name, the optimizer
    and the sparse hook's residual lookahead (or None)."""
    state: Any = None
    lookahead: Any = None
    momentum = task.momentum
    if args.hook == "sparse":
        # Momentum correction: SGD's momentum runs in the hook, the optimizer has none.
        corrected = momentum if not args.no_momentum_correction else 0.0
        adam = {"betas": task.betas} if args.adam_correction else {}
        state = SparseState(
            density=args.density, fp16_values=args.fp16_values, momentum=corrected, **adam
        )
        model.register_comm_hook(state, sparse_allreduce_hook)
        momentum -= corrected
        mode = f"sparse density {args.density}" + (" fp16" if args.fp16_values else "")
        mode += " no MC" if args.no_momentum_correction and task.momentum else ""
        mode += " Adam in hook" if adam else ""
    elif args.hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.warmup,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        mode = f"PowerSGD rank {args.rank}"
    else:
        mode = "DDP allreduce"
    if args.hook == "sparse" and args.adam_correction:
        optimizer = task.corrected_optimizer(model.parameters())
    else:
        optimizer = task.optimizer(model.parameters(), size, momentum)
    if args.hook == "sparse" and args.residual_lookahead and momentum == 0.0:
        # Forward and backward where the pending residual takes the parameters; it needs
        # the optimizer's plain SGD step (the momentum or AdamW runs in the hook).
        lookahead = state.residual_lookahead(optimizer)
    elif args.hook == "sparse":
        mode += " no lookahead"
    return state, mode, optimizer, lookahead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="digits")
    parser.add_argument("--hook", choices=("allreduce", "powersgd", "sparse"), default="sparse")
    parser.add_argument("--density", type=float, default=0.01, help="--hook sparse")
    parser.add_argument("--fp16-values", action="store_true", help="--hook sparse")
    parser.add_argument(
        "--no-momentum-correction",
        action="store_true",
        help="--hook sparse: leave SGD's momentum in the optimizer (plain error feedback)",
    )
    parser.add_argument(
        "--adam-correction",
        action="store_true",
        help="--hook sparse, --task char_lm: AdamW runs in the hook (SparseState(betas=...))",
    )
    parser.add_argument(
        "--no-residual-lookahead",
        dest="residual_lookahead",
        action="store_false",
        help="--hook sparse: gradients at the shared parameters (ablation)",
    )
    parser.add_argument(
        "--no-flush",
        dest="flush",
        action="store_false",
        help="--hook sparse: keep the residuals at the end (ablation; flushed by default "
        "where the lookahead runs)",
    )
    parser.add_argument("--rank", type=int, default=2, help="--hook powersgd: matrix rank")
    parser.add_argument("--warmup", type=int, default=10, help="PowerSGD's dense iterations")
    parser.add_argument("--steps", type=int, default=None, help="default: the task's")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's, every bucket")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="record the metric every N steps (0: at the end)"
    )
    parser.add_argument("--json", default=None, help="write the summary here (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task = TASKS[args.task]()
    steps = args.steps or task.steps
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    # An explicit cap applies to DDP's first bucket too (by default 1 MB): both models fit
    # one bucket. PowerSGD's hook, which issues collectives from future callbacks, hit a
    # Gloo collective mismatch with the char LM's two default buckets (torch 2.13).
    model = DistributedDataParallel(task.model(), bucket_cap_mb=args.bucket_cap_mb)
    numel = sum(p.numel() for p in model.parameters())
    dense_bytes = sum(allreduce_ring_bytes(numel, size, 4))
    if args.hook == "sparse" and args.adam_correction and not isinstance(task, CharLM):
        parser.error("--adam-correction needs --task char_lm (AdamW)")
    state, mode, optimizer, lookahead = set_up_reduction(args, task, model, size)

    curve_key = task.metric.removeprefix("final_")  # as char_lm.py and digits_cnn.py name it
    moved = []
    curve: list[dict[str, float]] = []  # the metric against steps and training seconds
    evaluating = 0.0  # seconds spent evaluating: not training time
    began = time.perf_counter()
    for step, (x, y) in zip(range(steps), task.batches(rank, size, args.seed)):
        optimizer.zero_grad()
        loss = task.loss(model, x, y)
        loss.backward()
        optimizer.step()
        if args.hook == "sparse":
            stats = state.stats()
            moved.append(stats.bytes_sent + stats.bytes_received)
        elif args.hook == "powersgd" and step >= args.warmup:
            moved.append(powersgd_bytes(model.module, args.rank, size))
        else:
            moved.append(dense_bytes)
        if args.eval_every and step % args.eval_every == 0 and step != steps - 1:
            paused = time.perf_counter()
            metric = task.evaluate(model.module)
            curve.append({"step": step, "seconds": paused - began - evaluating, curve_key: metric})
            evaluating += time.perf_counter() - paused
    if lookahead is not None and args.flush:
        # The model this run keeps holds every rank's pending update too.
        moved[-1] += sum(allreduce_ring_bytes(lookahead.flush_residuals(), size, 4))
    seconds = time.perf_counter() - began - evaluating
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat)
    spread = max(float((part - flat).abs().max()) for part in parts)
    final = task.evaluate(model.module)
    curve.append({"step": steps - 1, "seconds": seconds, curve_key: final})
    summary = {
        "task": f"{args.task}_ddp",
        "mode": mode,
        "world_size": size,
        "parameters": numel,
        "steps": steps,
        "seed": args.seed,
        task.metric: final,
        "final_train_loss": float(loss.detach()),
        "bytes_per_step": sum(moved) / len(moved),
        "dense_bytes_per_step": dense_bytes,
        "parameter_spread": spread,
        "seconds": seconds,
        "curve": curve,
    }
    if args.task == "char_lm":
        summary["final_val_perplexity"] = math.exp(final)
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(summary))
    # destroy_process_group is no barrier (examples/pytorch/quickstart_ddp.py says why).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
