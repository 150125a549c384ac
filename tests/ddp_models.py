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
