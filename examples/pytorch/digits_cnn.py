"""Train a small CNN on scikit-learn's bundled 8x8 digits, with sparse or dense allreduce.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/digits_cnn.py --density 0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/digits_cnn.py --density 1.0

The data ships with scikit-learn (no download). The split is fixed: 1437 training and
360 test images (``train_test_split(test_size=0.2, random_state=0)``); rank r trains on
every P-th training image starting at r. The optimizer is SGD with momentum 0.9 and
the learning rate scaled by the number of ranks, as Horovod recommends.

``--density 1.0`` uses Horovod's own ``hvd.DistributedOptimizer`` (the dense baseline);
anything below uses ``horovod_sparse.torch.DistributedOptimizer`` with its defaults.
``--log-every N`` prints the optimizer's one-line figures every N steps;
``--tensorboard DIR`` writes ``optimizer.stats()`` to TensorBoard every step (rank 0;
``pip install tensorboard`` first), then ``tensorboard --logdir DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod_sparse.torch as hvds
from horovod_sparse.common.stats import allreduce_ring_bytes


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers: 151,306 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = torch.nn.Linear(64 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed train/test split, images scaled to [0, 1] as (N, 1, 8, 8)."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )

    def images(a):
        return torch.tensor(a, dtype=torch.float32).unsqueeze(1) / 16.0

    def labels(a):
        return torch.tensor(a, dtype=torch.int64)

    return images(x_train), labels(y_train), images(x_test), labels(y_test)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(-1) == y).sum().item()
    model.train()
    return 100.0 * correct / len(y)


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, order: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of ``(x, y)``, a fresh permutation whenever one is used up."""
    perm, cursor = torch.randperm(len(x), generator=order), 0
    while True:
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(x), generator=order), 0
        batch = perm[cursor : cursor + batch_size]
        cursor += batch_size
        yield x[batch], y[batch]


def write_stats(
    writer: Any, step: int, optimizer: Any, moved: int, dense_bytes: int, loss: float
) -> None:
    """One step's figures as TensorBoard scalars (this rank's loss; the exchange's
    bytes, density and seconds from ``optimizer.stats()`` when it is horovod_sparse's)."""
    writer.add_scalar("train/loss_rank0", loss, step)
    writer.add_scalar("exchange/bytes", moved, step)
    writer.add_scalar("exchange/bytes_vs_dense", moved / dense_bytes, step)
    if hasattr(optimizer, "stats"):
        s = optimizer.stats()
        writer.add_scalar("exchange/density", s.density, step)
        writer.add_scalar("exchange/seconds_exchange", s.seconds_exchange, step)
        writer.add_scalar("exchange/seconds_select", s.seconds_select, step)
        writer.add_scalar("exchange/global_refreshes", s.global_refreshes, step)


def parse(
    argv: list[str] | None = None, description: str | None = None, **defaults: Any
) -> argparse.Namespace:
    """The command line; another task's script passes its ``description`` and the
    ``defaults`` where they differ from the digits task's."""
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--no-error-feedback", action="store_true", help="ablation")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by P")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--json", default=None, help="write the curves here (rank 0)")
    parser.add_argument(
        "--tensorboard",
        default=None,
        help="write optimizer.stats() and the curves to this TensorBoard log dir (rank 0; "
        "needs `pip install tensorboard`)",
    )
    parser.add_argument("--log-every", type=int, default=0, help="the optimizer's log_every")
    parser.add_argument(
        "--no-residual-lookahead", dest="residual_lookahead", action="store_const", const=False
    )  # gradients at the shared parameters (ablation); the default is the optimizer's
    parser.add_argument(
        "--no-flush", dest="flush", action="store_false", help="ablation: keep the residuals"
    )  # by default the last step applies every rank's pending update (flush_residuals)
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def shared_parameters(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """The sparse optimizer's shared parameters (see ``residual_lookahead``); Horovod's
    optimizer has no other."""
    shared = getattr(optimizer, "shared_parameters", None)
    return shared() if shared is not None else contextlib.nullcontext()


Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def train(
    args: argparse.Namespace,
    model_class: Callable[[], torch.nn.Module] = DigitsCNN,
    split: Callable[[], Split] = load_split,
    task: str = "digits_cnn",
) -> dict[str, Any]:
    """Train a classifier on this rank (Horovod initialised here); return the run's
    summary. The digits CNN by default; ``wide_mlp.py`` passes its model and data."""
    # Imported here: ddp_train.py takes the model and data from this module without Horovod.
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = split()
    x_mine, y_mine = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]

    model = model_class()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    if args.density >= 1.0:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        mode = "dense"
    else:
        optimizer = hvds.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            density=args.density,
            error_feedback=not args.no_error_feedback,
            log_every=args.log_every,
            residual_lookahead=args.residual_lookahead,
        )
        mode = f"density {args.density}" + (" no EF" if args.no_error_feedback else "")
    numel = sum(p.numel() for p in model.parameters())
    dense_bytes = sum(allreduce_ring_bytes(numel, hvd.size(), 4))

    order = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    data = batches(x_mine, y_mine, args.batch_size, order)
    curve: list[dict[str, float]] = []
    moved = []
    writer = None
    if args.tensorboard and hvd.rank() == 0:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        writer = SummaryWriter(args.tensorboard)
    evaluating = 0.0  # seconds spent evaluating: not training time
    began = time.perf_counter()
    for step, (x, y) in zip(range(args.steps), data):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        moved.append(
            dense_bytes
            if args.density >= 1.0
            else optimizer.stats().bytes_sent + optimizer.stats().bytes_received
        )
        last = step == args.steps - 1
        if last and args.flush and args.density < 1.0:
            # The model this run keeps holds every rank's pending update too.
            flushed = optimizer.flush_residuals()
            moved[-1] += sum(allreduce_ring_bytes(flushed, hvd.size(), 4))
        if writer is not None:
            write_stats(writer, step, optimizer, moved[-1], dense_bytes, loss.item())
        if step % args.eval_every == 0 or last:
            paused = time.perf_counter()
            train_loss = hvd.allreduce(loss.detach(), name="train_loss").item()
            point = {
                "step": step,
                "seconds": paused - began - evaluating,  # training time so far
                "train_loss": train_loss,
            }
            with shared_parameters(optimizer):  # the model every rank holds alike
                point["test_acc"] = accuracy(model, x_test, y_test)
            curve.append(point)
            evaluating += time.perf_counter() - paused
            if hvd.rank() == 0:
                print(
                    f"[{mode}] step {step:4d} loss {train_loss:.4f} "
                    f"test acc {point['test_acc']:.2f}% bytes/step {moved[-1]:,}",
                    flush=True,
                )
    # Every rank must hold the same parameters.
    with shared_parameters(optimizer):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = (
        (
            hvd.allreduce(flat, op=hvd.Max, name="pmax")
            - hvd.allreduce(flat, op=hvd.Min, name="pmin")
        )
        .abs()
        .max()
        .item()
    )
    summary = {
        "task": task,
        "mode": mode,
        "density": args.density,
        "error_feedback": not args.no_error_feedback,
        "world_size": hvd.size(),
        "parameters": numel,
        "steps": args.steps,
        "seed": args.seed,
        "final_test_acc": curve[-1]["test_acc"],
        "final_train_loss": curve[-1]["train_loss"],
        "bytes_per_step": sum(moved) / len(moved),
        "dense_bytes_per_step": dense_bytes,
        "parameter_spread": spread,
        "seconds": time.perf_counter() - began,
        "curve": curve,
    }
    if hvd.rank() == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)
    if writer is not None:
        for point in curve:
            writer.add_scalar("eval/test_acc", point["test_acc"], int(point["step"]))
        writer.close()
    return summary


def main() -> None:
    train(parse())


if __name__ == "__main__":
    main()
