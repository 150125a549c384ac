"""What the DDP hook's tests share: a model whose gradient is chosen exactly, and a
gather of one tensor from every rank of the default group."""

import numpy as np
import torch
import torch.distributed as dist


class Exact(torch.nn.Module):
    """d(loss)/d(weight) is the given tensor exactly: the hook sees chosen gradients."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad).sum()


def gather(tensor: torch.Tensor) -> list[np.ndarray]:
    """``tensor`` of every rank, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return [p.numpy().copy() for p in parts]


class SmallNet(torch.nn.Module):
    """Three linear layers (21K parameters): several DDP buckets at bucket_cap_mb=0.03.
    ``poison`` makes the output, and so the gradients, of this rank non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 128)
        self.b = torch.nn.Linear(128, 128)
        self.c = torch.nn.Linear(128, 4)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return out * float("inf") if self.poison else out
