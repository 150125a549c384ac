"""Hugging Face Accelerate with the sparse DDP hook: one call after ``prepare``.

    torchrun --standalone --nproc-per-node 2 examples/pytorch/accelerate_sparse.py
    accelerate launch --cpu --num_processes 2 examples/pytorch/accelerate_sparse.py

Accelerate wraps the model in ``DistributedDataParallel``; its own ``comm_hook`` option
takes only PyTorch's built-in hooks, so the sparse hook is registered on the prepared
model itself. The optimizer is the user's AdamW, on the exchanged gradient (``--adam
hook`` runs Adam in the hook instead: ``SparseState(betas=...)`` with
``SGD(weight_decay=...)``, which on this task reaches a higher loss, docs/ddp.md), and
``GatheredState`` makes ``save_state`` (written by the main process only) hold every
rank's residuals. The script checks what a user relies on, and exits non-zero otherwise:

1. at density 1 the hook (with SGD momentum run by the hook) equals Accelerate's own DDP
   with momentum SGD, to 1e-6;
2. at density 0.01 the loss falls and every rank holds the same parameters;
3. ``save_state`` halfway, ``load_state`` into new objects, and the rest of the run
   equal the uninterrupted run bit for bit.
"""

import argparse
import copy
import shutil
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.nn import functional

from horovod_sparse.torch.ddp import GatheredState, SparseState, sparse_allreduce_hook

LR, WD, BETAS = 3e-3, 0.01, (0.9, 0.999)


def task() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # the same task on every rank
    inputs = torch.randn(4096, 64, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(64, 8, generator=generator))
    return inputs, targets


def network() -> torch.nn.Module:
    set_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 8),
    )  # fmt: skip


def prepared(accelerator: Accelerator, state: SparseState | None, optimizer: str, lr: float = LR):
    """A model and optimizer through ``accelerator.prepare``, the hook registered."""
    model = network()
    if optimizer == "momentum":  # SGD momentum: in the hook when there is one
        momentum = 0.0 if state is not None else 0.9
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    elif optimizer == "adamw-hook":  # AdamW run by the hook; SGD steps by its direction
        opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=WD)
    else:  # AdamW itself, on the exchanged gradient
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WD)
    model, opt = accelerator.prepare(model, opt)
    if state is not None:
        model.register_comm_hook(state, sparse_allreduce_hook)  # the one added call
    return model, opt


def train(accelerator, model, opt, steps, batch=64) -> list[float]:
    inputs, targets = task()
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
        rows = torch.randint(0, len(inputs), (batch,), generator=generator)
        opt.zero_grad()
        loss = functional.mse_loss(model(inputs[rows]), targets[rows])
        accelerator.backward(loss)
        opt.step()
        losses.append(float(loss))
    return losses


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(accelerator: Accelerator, tensor: torch.Tensor) -> bool:
    everyone = accelerator.gather(tensor[None])
    return bool((everyone == tensor).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--adam", choices=["optimizer", "hook"], default="optimizer")
    parser.add_argument("--lr", type=float, default=LR)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    say = accelerator.print

    # 1. Density 1 against Accelerate's own DDP, SGD momentum in both.
    plain, plain_opt = prepared(accelerator, None, "momentum")
    hooked, hooked_opt = prepared(accelerator, SparseState(1.0, momentum=0.9), "momentum")
    train(accelerator, plain, plain_opt, range(10))
    train(accelerator, hooked, hooked_opt, range(10))
    gap = float((flat(hooked) - flat(plain)).abs().max())
    say(f"density 1 against Accelerate's DDP, 10 steps: max difference {gap:.2e}")
    assert gap <= 1e-6, gap
    accelerator.free_memory()  # forget these models: save_state saves every prepared one

    # 2. and 3. The sparse run, with a checkpoint halfway that a second run resumes.
    def options() -> SparseState:
        return SparseState(args.density, betas=BETAS if args.adam == "hook" else None)

    half = args.steps // 2
    state = options()
    adamw = "adamw-hook" if args.adam == "hook" else "adamw"
    model, opt = prepared(accelerator, state, adamw, args.lr)
    checkpointed = GatheredState(state)  # its state_dict() gathers every rank's part
    accelerator.register_for_checkpointing(checkpointed)
    losses = train(accelerator, model, opt, range(half))
    folder = [tempfile.mkdtemp() if accelerator.is_main_process else None]
    torch.distributed.broadcast_object_list(folder, src=0)  # one folder for the host
    accelerator.save_state(folder[0])  # every rank calls it; the main process writes
    saved_here = copy.deepcopy(state.state_dict())
    losses += train(accelerator, model, opt, range(half, args.steps))
    uninterrupted = flat(model)

    # A restarted job: new model, optimizer and hook state, then load_state.
    accelerator.free_memory()  # (it keeps the objects registered for checkpointing)
    state2 = options()
    model2, opt2 = prepared(accelerator, state2, adamw, args.lr)
    checkpointed.state = state2  # the registered object now restores the new state
    accelerator.load_state(folder[0])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder[0])
    loaded = state2.state_dict()  # this rank's own residuals, not rank 0's
    for index, bucket in saved_here["buckets"].items():
        assert torch.equal(loaded["buckets"][index]["residual"], bucket["residual"])
    train(accelerator, model2, opt2, range(half, args.steps))
    resumed = flat(model2)
    stats = state.stats()
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    say(
        f"density {args.density}: loss {first:.4f} -> {last:.4f}, "
        f"{(stats.bytes_sent + stats.bytes_received) / stats.dense_bytes:.2%} of dense bytes, "
        f"{stats.sparse_buckets} sparse buckets"
    )
    assert last < 0.5 * first, (first, last)
    assert same_on_every_rank(accelerator, uninterrupted), "ranks differ"
    assert torch.equal(resumed, uninterrupted), "the resumed run differs"
    say(
        f"accelerate OK: {accelerator.num_processes} ranks, parameters identical on every "
        "rank, the run resumed from save_state equals the uninterrupted one bit for bit"
    )
    # Tearing the process group down is no barrier: a rank that exits while another is
    # still in the last collective aborts it ("terminate called without an active
    # exception", seen once in this example's test). Every rank waits, then tears down.
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
