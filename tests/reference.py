"""Single-process NumPy reference of one sparse allreduce step over all ranks.

Both the PyTorch and the TensorFlow suites compare against this one implementation.
It follows docs/design.md §2 literally, with no communication: every rank's accumulator
is given, and every rank's residual after the step is returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ReferenceStep:
    result_sum: np.ndarray  # the dense result before any post-scale
    residuals: list[np.ndarray]  # per rank, after the step
    selected: np.ndarray  # ascending indices present in the result


def uniform_boundaries(numel: int, world_size: int) -> list[int]:
    return [j * numel // world_size for j in range(world_size + 1)]


def reference_step(accumulators: list[np.ndarray], k: int, boundaries: list[int]) -> ReferenceStep:
    """One step from every rank's accumulator (residual before + scaled gradient)."""
    numel = accumulators[0].size
    residuals = [a.copy() for a in accumulators]
    reduced = np.zeros(numel, dtype=accumulators[0].dtype)
    touched = np.zeros(numel, dtype=bool)
    for rank, acc in enumerate(accumulators):
        # Local selection: exact top-k by magnitude.
        local = np.argsort(-np.abs(acc), kind="stable")[: min(k, numel)]
        residuals[rank][local] = 0
        # Owner reduction, ranks in order (as the received rows are ordered).
        np.add.at(reduced, local, acc[local])
        touched[local] = True
    candidates = np.flatnonzero(touched)
    magnitudes = np.abs(reduced[candidates]).astype(np.float32)
    if candidates.size <= k:
        kept = candidates
    else:
        threshold = np.sort(magnitudes)[-k]
        kept = candidates[magnitudes >= threshold]
    dropped = np.setdiff1d(candidates, kept)
    # Global residual collection: the owner of each dropped index keeps its sum.
    owners = np.searchsorted(np.asarray(boundaries[1:-1]), dropped, side="right")
    for index, owner in zip(dropped, owners):
        residuals[owner][index] += reduced[index]
    result = np.zeros(numel, dtype=reduced.dtype)
    result[kept] = reduced[kept]
    return ReferenceStep(result, residuals, kept)
