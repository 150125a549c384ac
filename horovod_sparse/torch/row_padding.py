"""The padding of wire rows (``Backend.pad_rows``, ``Backend.unpadded``) under PyTorch,
for the Horovod and the ``torch.distributed`` backends alike."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RowPadding"]


class RowPadding:
    """Pads rows with all-0xFF rows (index -1) and drops them again."""

    # Not measured under torch: its P = 2 all-gather keeps each step's own row count.
    pads_gathered_rows = False

    def pad_rows(self, rows: torch.Tensor, capacity: Any) -> torch.Tensor:
        missing = max(int(capacity) - rows.shape[0], 0)  # host ints: no device read
        return torch.cat([rows, rows.new_full((missing, rows.shape[1]), 255)])

    def unpadded(
        self, indices: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keep = indices >= 0
        return indices[keep], values[keep]
