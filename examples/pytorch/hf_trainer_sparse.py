"""The transformers ``Trainer`` with the sparse DDP hook, at the Trainer's defaults.

    torchrun --standalone --nproc-per-node 2 examples/pytorch/hf_trainer_sparse.py

A byte-level GPT-2 (2 layers, 1.7 MB of parameters) learns this package's own source
text with the Trainer's defaults: AdamW, a linear schedule, and
``find_unused_parameters=True`` (the Trainer's choice for a ``PreTrainedModel``), under
which DDP keeps its first buckets and the hook is sparse from the first step. The hook
comes in through a ``TrainerCallback``:

- ``on_train_begin``: registers the hook on the Trainer's DDP model;
- ``on_save`` (every rank): ``GatheredState(state).state_dict()`` brings every rank's
  residuals to rank 0, which writes ``sparse_hook.pt`` into the checkpoint folder;
- resuming (``trainer.train(resume_from_checkpoint=...)``): each rank loads its own part.

The script checks, and exits non-zero otherwise: at density 1 the Trainer's run equals
its run without the hook (to 1e-5); at density 0.01 the loss falls, every rank holds the
same parameters, and a run resumed from the halfway checkpoint equals the uninterrupted
one bit for bit.
"""

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import horovod_sparse
from horovod_sparse.torch.ddp import GatheredState, SparseState, sparse_allreduce_hook

CONTEXT = 64
HOOK_FILE = "sparse_hook.pt"


class SparseHook(TrainerCallback):
    """Puts ``state``'s hook on the Trainer's DDP model and into its checkpoints."""

    def __init__(self, state: SparseState) -> None:
        self.state = state
        self.trainer: Trainer | None = None  # set after the Trainer is made

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.state, sparse_allreduce_hook)
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / HOOK_FILE
        if state.global_step and saved.exists():  # resuming: this rank's own part
            GatheredState(self.state).load_state_dict(torch.load(saved, weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        gathered = GatheredState(self.state).state_dict()  # a collective: every rank
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            torch.save(gathered, folder / HOOK_FILE)


class ByteWindows(torch.utils.data.Dataset):
    """Windows of CONTEXT + 1 bytes of this package's source text."""

    def __init__(self) -> None:
        root = Path(horovod_sparse.__file__).parent
        text = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
        self.data = torch.tensor(list(text), dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[i * CONTEXT : i * CONTEXT + CONTEXT]
        return {"input_ids": window, "labels": window.clone()}


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(folder: str, steps: int, state: SparseState | None, resume: str | None = None):
    """The Trainer at its defaults (AdamW, linear decay), a checkpoint every steps/2."""
    arguments = TrainingArguments(
        output_dir=folder,
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=steps // 2,
        logging_steps=10,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = Trainer(model=model(), args=arguments, train_dataset=ByteWindows())
    if state is not None:
        hook = SparseHook(state)
        hook.trainer = trainer
        trainer.add_callback(hook)
    trainer.train(resume_from_checkpoint=resume)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return flat, losses, trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # the Trainer uses the group already made
    rank = dist.get_rank()
    scratch = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(scratch)
    base = scratch[0]

    plain, _, _ = train(f"{base}/plain", 10, None)
    dense_state = SparseState(1.0)
    dense_hook, _, trainer = train(f"{base}/dense", 10, dense_state)
    assert trainer.model_wrapped.find_unused_parameters, "expected the Trainer's default"
    assert dense_state.iteration == 10, dense_state.iteration  # the hook reduced each step
    gap = float((plain - dense_hook).abs().max())
    if rank == 0:
        print(f"density 1 against the Trainer's own DDP, 10 steps: max difference {gap:.2e}")
    assert gap <= 1e-5, gap

    state = SparseState(args.density)
    uninterrupted, losses, _ = train(f"{base}/sparse", args.steps, state)
    halfway = f"{base}/sparse/checkpoint-{args.steps // 2}"
    resumed, _, _ = train(f"{base}/sparse", args.steps, SparseState(args.density), halfway)
    stats = state.stats()
    everyone = [torch.empty_like(uninterrupted) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, uninterrupted)
    if rank == 0:
        moved = (stats.bytes_sent + stats.bytes_received) / stats.dense_bytes
        print(
            f"density {args.density}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {moved:.2%} of "
            f"dense bytes, {stats.sparse_buckets} sparse buckets"
        )
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(other, uninterrupted) for other in everyone), "ranks differ"
    assert torch.equal(resumed, uninterrupted), "the resumed run differs"
    if rank == 0:
        print(
            f"hf trainer OK: {dist.get_world_size()} ranks, parameters identical on every "
            "rank, the run resumed from its halfway checkpoint equals the uninterrupted one"
        )
    dist.barrier()  # every rank is done with the checkpoints
    if rank == 0:
        import shutil

        shutil.rmtree(base)
    # Without this, a rank leaving while Gloo's threads still hold its last collective's
    # work aborts at interpreter exit ("terminate called without an active exception",
    # once in this example's test); the barrier above keeps every rank out of a collective.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
