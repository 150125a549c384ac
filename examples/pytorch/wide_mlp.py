"""Train a 25.6M-parameter MLP on a 100-class Gaussian mixture, sparse or dense.

The model where bytes matter: its fp32 gradient is 102 MB a step.

    horovodrun -np 4 -H localhost:4 --gloo python examples/pytorch/wide_mlp.py --density 0.01
    horovodrun -np 4 -H localhost:4 --gloo python examples/pytorch/wide_mlp.py --density 1.0

The data is generated, identically on every rank, from fixed seeds: 100 class centres
drawn from N(0, I) in 2048 dimensions, and samples at a centre plus N(0, 4² I) noise
(16,384 training and 4,096 test samples, classes uniform). Rank r trains on every P-th
training sample from r, with batch 16 per rank and SGD with momentum 0.9 at a learning
rate of 0.0025 scaled by P, for 250 steps (less than one pass over the training set at
P = 4). Training, flags and the JSON summary are ``digits_cnn.py``'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits_cnn
from pytorch_synthetic_benchmark import WideMLP

FEATURES, WIDTH, CLASSES = 2048, 4096, 100
TRAIN_SAMPLES, TEST_SAMPLES, NOISE = 16_384, 4_096, 4.0
# The task's flags where they differ from the digits CNN's.
DEFAULTS = {"steps": 250, "batch_size": 16, "lr": 0.0025, "eval_every": 25}


def model() -> torch.nn.Module:
    """2048 -> 4096 -> 4096 -> 100: 25.6M parameters and little compute per byte."""
    return WideMLP(FEATURES, WIDTH, CLASSES)


def load_split() -> digits_cnn.Split:
    """The Gaussian mixture's training and test samples, the same on every rank."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234))

    def samples(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        draw = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, CLASSES, (count,), generator=draw)
        return centres[labels] + NOISE * torch.randn(count, FEATURES, generator=draw), labels

    x_train, y_train = samples(TRAIN_SAMPLES, 1)
    x_test, y_test = samples(TEST_SAMPLES, 2)
    return x_train, y_train, x_test, y_test


def main() -> None:
    args = digits_cnn.parse(description=__doc__.splitlines()[0], **DEFAULTS)
    digits_cnn.train(args, model, load_split, "wide_mlp")


if __name__ == "__main__":
    main()
