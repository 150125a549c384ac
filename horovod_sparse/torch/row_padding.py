"""The padding of wire rows (``Backend.pad_rows``, ``Backend.unpadded``) under PyTorch,
for the Horovod and the ``torch.distributed`` backends alike (the latter does not pad:
``torch.distributed`` has no response cache to serve a repeated shape)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RowPadding"]


class RowPadding:
    """Pads rows with all-0xFF rows (index -1) and drops them again."""

    # Horovod's torch all-gather negotiates again when its shape changes: the demo's step
    # at P = 2 measured 0.99-1.00x dense's with the rows padded, against 1.07-1.08x without
    # (docs/benchmarks.md, "Fixed shapes at P = 2").
    pads_gathered_rows = True

    def pad_rows(self, rows: torch.Tensor, capacity: Any) -> torch.Tensor:
        missing = max(int(capacity) - rows.shape[0], 0)  # host ints: no device read
        return torch.cat([rows, rows.new_full((missing, rows.shape[1]), 255)])

    def unpadded(
        self, indices: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keep = indices >= 0
        return indices[keep], values[keep]
