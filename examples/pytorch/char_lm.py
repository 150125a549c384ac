"""Train a character-level transformer language model on Python's own standard library.

Run with 2 ranks:
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/char_lm.py --density 0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch/char_lm.py --density 1.0

The text ships with every Python: a fixed list of standard-library modules is the
training set and four other modules are the validation set (no download). Characters
outside ASCII map to one symbol. Every rank draws its own random windows of the
training text. The optimizer is AdamW (lr 1e-3, weight decay 0.01) in every mode.

``--density 1.0`` uses Horovod's own ``hvd.DistributedOptimizer`` (the dense baseline);
anything below uses ``horovod_sparse.torch.DistributedOptimizer`` with its defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

import horovod_sparse.torch as hvds
from horovod_sparse.common.config import budget
from horovod_sparse.common.stats import allreduce_ring_bytes, settled_reuse

SETTLED = 50  # steps after which the refresh fraction and kept count are summarized
TRAIN_MODULES = [
    "argparse.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "inspect.py",
    "pathlib.py",
    "random.py",
    "typing.py",
]
VALIDATION_MODULES = ["heapq.py", "shlex.py", "string.py", "textwrap.py"]
VOCAB = 128  # ASCII; anything else becomes 127


def read_text(modules: list[str]) -> torch.Tensor:
    """The modules' sources, concatenated, as a tensor of character codes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in modules)
    codes = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    return codes.clamp_(max=VOCAB - 1)


class CharTransformer(torch.nn.Module):
    """A small pre-norm causal transformer over characters."""

    def __init__(self, context: int, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        layer = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)
        self.register_buffer(
            "causal", torch.nn.Transformer.generate_square_subsequent_mask(context)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def windows(
    text: torch.Tensor, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(context + 1)
    chunk = text[starts[:, None] + offsets]
    return chunk[:, :-1], chunk[:, 1:]


def validation_loss(model: torch.nn.Module, text: torch.Tensor, context: int) -> float:
    """Mean cross-entropy (nats per character) over fixed, non-overlapping windows."""
    starts = torch.arange(0, len(text) - context - 1, context)[:256]
    model.eval()
    with torch.no_grad():
        total = 0.0
        for chunk in starts.split(64):
            x, y = windows(text, chunk, context)
            total += torch.nn.functional.cross_entropy(
                model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum"
            ).item()
    model.train()
    return total / (len(starts) * context)


def shared_parameters(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """The sparse optimizer's shared parameters (see ``residual_lookahead``); Horovod's
    optimizer has no other."""
    shared = getattr(optimizer, "shared_parameters", None)
    return shared() if shared is not None else contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--no-error-feedback", action="store_true", help="ablation")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16, help="windows per rank")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=0, help="dense steps first")
    parser.add_argument("--decay-steps", type=int, default=0, help="density decay after warm-up")
    parser.add_argument(
        "--no-momentum-correction", action="store_true", help="ablation: AdamW on the average"
    )
    parser.add_argument("--global-selection", default="reuse", help="reuse or exact")
    parser.add_argument(
        "--min-sparse-numel", type=int, default=1024, help="smaller tensors go dense"
    )
    parser.add_argument(
        "--fusion-threshold-bytes", type=int, default=None, help="sparse bucket capacity"
    )
    parser.add_argument(
        "--no-residual-lookahead", dest="residual_lookahead", action="store_const", const=False
    )  # gradients at the shared parameters (ablation); the default is the optimizer's
    parser.add_argument(
        "--no-flush", dest="flush", action="store_false", help="ablation: keep the residuals"
    )  # by default the last step applies every rank's pending update (flush_residuals)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the curves here (rank 0)")
    args = parser.parse_args()
    # Imported here: ddp_train.py takes the model and data from this module without Horovod.
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_text, val_text = read_text(TRAIN_MODULES), read_text(VALIDATION_MODULES)

    model = CharTransformer(args.context)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if args.density >= 1.0:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        mode = "dense"
    else:
        optimizer = hvds.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            density=args.density,
            error_feedback=not args.no_error_feedback,
            warmup_steps=args.warmup_steps,
            density_decay_steps=args.decay_steps,
            momentum_correction=False if args.no_momentum_correction else None,
            global_selection=args.global_selection,
            min_sparse_numel=args.min_sparse_numel,
            fusion_threshold_bytes=args.fusion_threshold_bytes,
            residual_lookahead=args.residual_lookahead,
        )
        mode = f"density {args.density}" + (" no EF" if args.no_error_feedback else "")
    numel = sum(p.numel() for p in model.parameters())
    dense_bytes = sum(allreduce_ring_bytes(numel, hvd.size(), 4))

    # k of the sparse tensors (one bucket at the default fusion threshold), so that the
    # global selection's kept count can be read against it (tensors under
    # min_sparse_numel are averaged densely and counted whole in stats().selected).
    sparse_numel = sum(p.numel() for p in model.parameters() if p.numel() >= args.min_sparse_numel)
    sparse_k = budget(sparse_numel, min(args.density, 1.0))
    refreshed, kept = [], []  # per step: did a global threshold refresh; rows kept
    draw = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    curve: list[dict[str, float]] = []
    moved = []
    evaluating = 0.0  # seconds spent evaluating: not training time
    began = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(
            0, len(train_text) - args.context - 1, (args.batch_size,), generator=draw
        )
        x, y = windows(train_text, starts, args.context)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if args.density >= 1.0:
            moved.append(dense_bytes)
        else:
            stats = optimizer.stats()
            moved.append(stats.bytes_sent + stats.bytes_received)
            refreshed.append(stats.global_refreshes > 0)
            kept.append(stats.selected - (numel - sparse_numel))
            if step == args.steps - 1 and args.flush:
                # The model this run keeps holds every rank's pending update too.
                flushed = optimizer.flush_residuals()
                moved[-1] += sum(allreduce_ring_bytes(flushed, hvd.size(), 4))
        if step % args.eval_every == 0 or step == args.steps - 1:
            paused = time.perf_counter()
            train_loss = hvd.allreduce(loss.detach(), name="train_loss").item()
            with shared_parameters(optimizer):  # the model every rank holds alike
                val = validation_loss(model, val_text, args.context)
            seconds = paused - began - evaluating  # training time so far
            curve.append(
                {"step": step, "seconds": seconds, "train_loss": train_loss, "val_loss": val}
            )
            evaluating += time.perf_counter() - paused
            if hvd.rank() == 0:
                print(
                    f"[{mode}] step {step:4d} train {train_loss:.4f} val {val:.4f} "
                    f"(ppl {math.exp(val):.2f}) bytes/step {moved[-1]:,}",
                    flush=True,
                )
    with shared_parameters(optimizer):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    highest = hvd.allreduce(flat, op=hvd.Max, name="param_max")
    lowest = hvd.allreduce(flat, op=hvd.Min, name="param_min")
    summary = {
        "task": "char_lm",
        "mode": mode,
        "density": args.density,
        "error_feedback": not args.no_error_feedback,
        "world_size": hvd.size(),
        "parameters": numel,
        "steps": args.steps,
        "seed": args.seed,
        "final_val_loss": curve[-1]["val_loss"],
        "final_val_perplexity": math.exp(curve[-1]["val_loss"]),
        "final_train_loss": curve[-1]["train_loss"],
        "bytes_per_step": sum(moved) / len(moved),
        "dense_bytes_per_step": dense_bytes,
        "parameter_spread": (highest - lowest).abs().max().item(),
        "seconds": time.perf_counter() - began,
        "curve": curve,
    }
    # The reused threshold in steady state (refreshes <= 5 % of steps, kept about k).
    reuse = settled_reuse(refreshed, kept, sparse_k, SETTLED)
    if reuse:
        summary["refresh_fraction_after_50"] = reuse["refresh_fraction"]
        summary["kept_over_k_after_50"] = reuse["kept_over_k"]
        summary["within_tenth_of_k_after_50"] = reuse["within_tenth_of_k"]
    if hvd.rank() == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
