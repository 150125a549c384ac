"""The README's quickstarts, as whole programs, pass at 2 ranks under horovodrun (the DDP
one under torchrun): the loss falls by half, every rank holds the same parameters, under
a tenth of dense bytes moved. The DDP hook's Lightning, Accelerate and transformers
Trainer examples pass at 2 ranks under torchrun.
The PyTorch job's output has no TensorFlow log line (horovodrun's extension check)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script", ["examples/pytorch/quickstart.py", "examples/tensorflow2/quickstart.py"]
)
def test_quickstart_passes_at_two_ranks(script):
    horovodrun = Path(sys.executable).with_name("horovodrun")
    env = dict(os.environ, PATH=f"{horovodrun.parent}:{os.environ['PATH']}")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # what a user's shell has
    done = subprocess.run(
        [str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "[0]<stdout>:quickstart OK: loss" in output, output[-4000:]
    if "pytorch" in script:
        assert "oneDNN" not in output and "absl::InitializeLog" not in output, output[-4000:]


@pytest.mark.parametrize(
    ("script", "banner"),
    [
        ("examples/pytorch/quickstart_ddp.py", "quickstart OK: loss"),
        # Where PyTorch users train, each at its framework's defaults; each checks that
        # density 1 equals the framework's own DDP, the loss falls, every rank holds the
        # same parameters, and a run resumed from a checkpoint rank 0 alone wrote equals
        # the uninterrupted run bit for bit.
        ("examples/pytorch/lightning_sparse.py", "lightning OK:"),
        ("examples/pytorch/accelerate_sparse.py", "accelerate OK:"),
        ("examples/pytorch/hf_trainer_sparse.py", "hf trainer OK:"),
    ],
)
def test_ddp_example_passes_at_two_ranks_under_torchrun(script, banner):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert banner in output, output[-4000:]
