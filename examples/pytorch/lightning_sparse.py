"""Lightning with the sparse DDP hook, on CPUs as on GPUs.

    torchrun --standalone --nproc-per-node 2 examples/pytorch/lightning_sparse.py

``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a hook on CUDA devices
only, and a CPU job then trains densely without a word. ``SparseDDPStrategy`` below
registers it on every device (a few lines: Lightning calls ``_register_ddp_hooks`` once
the model is wrapped). The hook's state goes into Lightning's checkpoints through the
module's ``on_save_checkpoint`` / ``on_load_checkpoint``, which run on every rank;
``GatheredState`` brings every rank's residuals into the one file rank 0 writes, and
gives each rank its own back.

The script checks, and exits non-zero otherwise: at density 1 the run equals Lightning's
own DDP (SGD momentum, run by the hook in the hooked run) to 1e-6; at density 0.01 the
loss falls and every rank holds the same parameters; fitting on from the halfway
checkpoint equals the uninterrupted run bit for bit.
"""

import argparse
import shutil
import tempfile

import lightning as L  # noqa: N812 (Lightning's own spelling)
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import functional

from horovod_sparse.torch.ddp import GatheredState, SparseState, sparse_allreduce_hook


class SparseDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers its communication hook on CPUs too."""

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class Regression(L.LightningModule):
    def __init__(self, state: SparseState | None, momentum: float, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512),
            torch.nn.Tanh(), torch.nn.Linear(512, 8),
        )  # fmt: skip
        self.sparse_state, self.momentum, self.losses = state, momentum, []
        self.batches = batches(steps)

    def training_step(self, batch, index):
        # The batch of this optimizer step, whatever the loader's position: Lightning
        # restarts the loader of an epoch that a checkpoint cut.
        inputs, targets = self.batches[self.global_step]
        loss = functional.mse_loss(self.net(inputs), targets)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=self.momentum)

    def on_save_checkpoint(self, checkpoint):  # every rank; rank 0 writes the file
        if self.sparse_state is not None:
            checkpoint["sparse_hook"] = GatheredState(self.sparse_state).state_dict()

    def on_load_checkpoint(self, checkpoint):  # every rank: its own part
        if self.sparse_state is not None:
            GatheredState(self.sparse_state).load_state_dict(checkpoint["sparse_hook"])


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)  # the same task on every rank
    weights = torch.randn(64, 8, generator=generator)
    own = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batches
    data = []
    for _ in range(steps):
        inputs = torch.randn(64, 64, generator=own)
        data.append((inputs, torch.tanh(inputs @ weights)))
    return data


def fit(state, steps, folder, momentum=0.9, resume=None, save_at=None):
    """Lightning's Trainer for ``steps`` steps; with ``save_at``, epochs of that many
    steps and a checkpoint at the end of each."""
    if state is None:
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = SparseDDPStrategy(
            process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=sparse_allreduce_hook
        )
    module = Regression(state, momentum, steps)
    callbacks = []
    if save_at:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=folder, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(save_at), callbacks=callbacks, use_distributed_sampler=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(range(save_at or steps), batch_size=None)  # steps
    trainer.fit(module, loader, ckpt_path=resume)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return flat, module.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # Lightning uses the group already made
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)

    plain, _ = fit(None, 10, folder[0])
    dense_state = SparseState(1.0, momentum=0.9)
    hooked, _ = fit(dense_state, 10, folder[0], momentum=0.0)  # the hook runs the momentum
    gap = float((plain - hooked).abs().max())
    if rank == 0:
        print(f"density 1 against Lightning's DDP, 10 steps: max difference {gap:.2e}")
    assert dense_state.iteration == 10 and gap <= 1e-6, (dense_state.iteration, gap)

    half = args.steps // 2
    state = SparseState(args.density, momentum=0.9)
    uninterrupted, losses = fit(state, args.steps, folder[0], momentum=0.0, save_at=half)
    halfway = f"{folder[0]}/epoch=0-step={half}.ckpt"
    resumed, _ = fit(
        SparseState(args.density, momentum=0.9), args.steps, folder[0], 0.0, halfway, half
    )
    stats = state.stats()
    others = [torch.empty_like(uninterrupted) for _ in range(dist.get_world_size())]
    dist.all_gather(others, uninterrupted)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    if rank == 0:
        moved = (stats.bytes_sent + stats.bytes_received) / stats.dense_bytes
        print(
            f"density {args.density}: loss {first:.4f} -> {last:.4f}, {moved:.2%} of dense "
            f"bytes, {stats.sparse_buckets} sparse buckets"
        )
    checks = {
        "the loss halved": last < 0.5 * first,
        "every rank holds the same parameters": all(torch.equal(o, uninterrupted) for o in others),
        "the resumed run equals the uninterrupted one": torch.equal(resumed, uninterrupted),
    }
    failed = [name for name, held in checks.items() if not held]
    dist.barrier()  # every rank is done with the checkpoints
    if rank == 0:
        shutil.rmtree(folder[0])
        verdict = f"FAILED: not {', '.join(failed)}" if failed else f"OK: {', '.join(checks)}"
        print(f"lightning {verdict}")
    dist.destroy_process_group()  # as hf_trainer_sparse.py: no Gloo work left at exit
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
