"""PyTorch kernels for the tensor primitives in ``horovod_sparse.common.backend``, with no
collective and no Horovod (:class:`~horovod_sparse.torch.backend.TorchBackend` adds
Horovod's, :class:`~horovod_sparse.torch.distributed.DistributedBackend` torch's).

Every kernel runs on the tensors' own device. A sparse step with the default threshold
selection synchronises with the host four times per bucket (counted with
``torch.cuda.set_sync_debug_mode`` on an H100), each because a size is data-dependent:

* :meth:`TorchKernels.indices_at_least` - the candidates above the sampled threshold;
* :meth:`TorchKernels.region_counts` - an alltoall takes its ``splits`` on the host;
* :meth:`TorchKernels.unique_inverse` - the distinct indices an owner received;
* :meth:`TorchKernels.split_by_mask` - the all-gather's send size (one sync for both
  parts: the dropped count follows from the kept one).

A dense step has none (Horovod's own GPU-to-host staging is not counted here)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable

import numpy as np
import torch

from horovod_sparse.common.backend import HorovodPrimitives, HostCell
from horovod_sparse.common.host_candidates import numpy_kth_largest, numpy_unique_inverse
from horovod_sparse.common.reduction import sum_rows_in_turn
from horovod_sparse.torch.candidates import cpu_indices_at_least, numpy_serves
from horovod_sparse.torch.threads import LocalThreads, local_ranks_from_environment

__all__ = ["TorchKernels"]

_HISTOGRAM_BINS = 256


class TorchKernels(HorovodPrimitives):
    """The tensor kernels, without collectives. Stateless."""

    in_place = True  # torch's kernels write into their first argument
    # Ranks on this host by the launcher's environment; Horovod's backend asks Horovod.
    local_threads = LocalThreads(local_ranks_from_environment)

    def local_work(self) -> AbstractContextManager[None]:
        return self.local_threads.scope()

    # ---- state and control flow: a step runs its Python every time, so host values do
    def cell(self, initial: Any, like: torch.Tensor | None = None) -> HostCell:
        if like is not None:
            initial = torch.full((), initial, dtype=like.dtype, device=like.device)
        return HostCell(initial)

    def cond(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        return then() if pred else otherwise()

    select = cond  # the step runs its Python every time: only the chosen value is computed

    def on_host(self, function: Callable[[list[int]], list[int]], counts: torch.Tensor) -> Any:
        return function(counts.tolist())

    # ---- dense arithmetic
    def zeros(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def length(self, tensor: torch.Tensor) -> int:
        return int(tensor.shape[0])

    def num_rows(self, tensor: torch.Tensor) -> int:
        return int(tensor.shape[0])

    def itemsize(self, tensor: torch.Tensor) -> int:
        return tensor.element_size()

    def add_scaled_(
        self, buffer: torch.Tensor, tensor: torch.Tensor, factor: float
    ) -> torch.Tensor:
        return buffer.add_(tensor.reshape(-1).to(buffer.dtype), alpha=factor)

    def add_scaled_at_(
        self, buffer: torch.Tensor, offset: int, tensor: torch.Tensor, factor: float
    ) -> torch.Tensor:
        part = buffer[offset : offset + tensor.numel()]
        part.add_(tensor.reshape(-1).to(buffer.dtype), alpha=factor)
        return buffer

    def add_scaled(self, tensor: torch.Tensor, other: torch.Tensor, factor: float) -> torch.Tensor:
        return tensor.add(other, alpha=factor)

    def momentum_update_(
        self, buffer: torch.Tensor, value: torch.Tensor, momentum: float, weight: float
    ) -> torch.Tensor:
        if weight == 1.0 and value.shape == buffer.shape:
            # value + momentum * buffer in one pass over the buffer instead of two; the
            # kernel may fuse the multiply-add, so it can differ from torch.optim.SGD's
            # mul_ then add_ in the last bit. 1M floats, one thread: 0.39 against 0.63 ms.
            return torch.add(value, buffer, alpha=momentum, out=buffer)
        return buffer.mul_(momentum).add_(value, alpha=weight)

    def moving_average_(
        self, buffer: torch.Tensor, value: torch.Tensor, beta: float
    ) -> torch.Tensor:
        return buffer.mul_(beta).add_(value, alpha=1.0 - beta)

    def moving_average_of_square_(
        self, buffer: torch.Tensor, value: torch.Tensor, beta: float
    ) -> torch.Tensor:
        return buffer.mul_(beta).addcmul_(value, value, value=1.0 - beta)

    def adam_ratio(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        first_scale: float,
        second_scale: float,
        eps: float,
        ranks: int,
    ) -> torch.Tensor:
        # torch.optim.Adam's own order of operations (its non-capturable path).
        first_hat, second_hat = first / first_scale, second / second_scale
        if ranks > 1:  # the average's second moment (common.correction.adam_direction)
            signal = first_hat.square()
            torch.minimum(signal, second_hat, out=signal)  # one temporary, not two
            second_hat = signal.mul_(1.0 - 1.0 / ranks).add_(second_hat, alpha=1.0 / ranks)
        return first_hat.div_(second_hat.sqrt_().add_(eps))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def assign(self, buffer: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return buffer.copy_(source)

    def scale(self, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        return tensor.mul_(factor)

    def to_host_number(self, scalar: torch.Tensor | float) -> float:
        return scalar.item() if isinstance(scalar, torch.Tensor) else scalar

    def sum_except(self, counts: list[int], rank: int) -> int:
        return sum(counts) - counts[rank]

    def clock(self, *after: torch.Tensor) -> float:
        # Host time. On CUDA this is launch time unless a stage synchronised anyway
        # (the selection does, for the alltoall splits); no sync is added for timing.
        return time.perf_counter()

    # ---- selection
    def topk_indices(self, values: torch.Tensor, k: int) -> torch.Tensor:
        if k >= values.numel():
            return torch.arange(values.numel(), device=values.device)
        return torch.topk(values.abs(), k, sorted=False).indices.sort().values

    def strided_sample_abs(self, values: torch.Tensor, size: int, offset: int) -> torch.Tensor:
        # A strided view, not an index tensor: no positions to build and gather by.
        stride = max(1, values.numel() // size)
        start = offset % stride
        return values[start : start + size * stride : stride].abs()

    def kth_largest(self, values: torch.Tensor, k: int) -> torch.Tensor:
        # NumPy's partition (a 25.6K-float sample, k = 256: 0.04 against 0.16 ms topk).
        if numpy_serves(values) and values.dtype != torch.bfloat16:
            return torch.from_numpy(numpy_kth_largest(values.numpy(), int(k)))
        return torch.topk(values, k, sorted=False).values.min()

    def indices_at_least(self, values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        if values.device.type == "cpu":
            return cpu_indices_at_least(values, threshold)
        # One memory pass without materialising |values|. Written as "not inside the
        # band" so NaN (false in every comparison) is selected and reaches the result,
        # as it would with dense Horovod. nonzero() syncs: the size is data-dependent.
        keep = (values < threshold).logical_and_(values > -threshold).logical_not_()
        return keep.nonzero().view(-1)

    def top_of(self, values: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
        magnitudes = values.index_select(0, candidates).abs()
        best = torch.topk(magnitudes, k, sorted=False).indices
        return candidates.index_select(0, best).sort().values

    def position_histogram(self, indices: torch.Tensor, numel: int, bins: int) -> torch.Tensor:
        which = indices * bins // numel
        counts = torch.zeros(bins, dtype=torch.int32, device=indices.device)
        return counts.scatter_add_(0, which, torch.ones_like(which, dtype=torch.int32))

    def to_host_list(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()

    def take(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return values.index_select(0, indices)

    def zero_at(self, buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return buffer.index_fill_(0, indices, 0)

    def add_at(
        self, buffer: torch.Tensor, indices: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        values = values.to(buffer.dtype)
        if buffer.is_cuda:
            # index_add_ adds duplicate indices with CUDA atomics, in no fixed order: owner
            # sums of 3+ ranks then change from run to run (1e-9 to 6e-8 relative, seen on
            # an H100). index_put_ with accumulate sorts stably and adds in arrival order,
            # as index_add_ does on the CPU: the same bits every run.
            return buffer.index_put_((indices,), values, accumulate=True)
        return buffer.index_add_(0, indices, values)

    def zero_then_add(
        self,
        buffer: torch.Tensor,
        zeroed: torch.Tensor,
        held: torch.Tensor,
        adds: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        # In place, each write is O(its indices): nothing to join, nothing to cancel.
        buffer = self.zero_at(buffer, zeroed)
        for indices, values in adds:
            buffer = self.add_at(buffer, indices, values)
        return buffer

    def shift(self, indices: torch.Tensor, offset: int) -> torch.Tensor:
        return indices + offset

    # ---- partition and packing
    def _boundaries(self, boundaries: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(boundaries, dtype=torch.int64).to(device, non_blocking=True)

    def region_counts(self, sorted_indices: torch.Tensor, boundaries: list[int]) -> list[int]:
        edges = self._boundaries(boundaries, sorted_indices.device)
        positions = torch.searchsorted(sorted_indices, edges)
        return (positions[1:] - positions[:-1]).tolist()  # host sync: splits live on the CPU

    def region_offsets(self, sorted_indices: torch.Tensor, boundaries: list[int]) -> torch.Tensor:
        edges = self._boundaries(boundaries, sorted_indices.device)
        region = torch.searchsorted(edges[1:-1], sorted_indices, right=True)
        return edges.index_select(0, region)

    def pack_rows(
        self, indices: torch.Tensor, offset: torch.Tensor | int, values: torch.Tensor
    ) -> torch.Tensor:
        local = (indices - offset).to(torch.int32)
        if values.element_size() == 4:
            # Index and value bits as int32 words, not a bytewise cat (0.05 / 0.22 ms, 24K).
            words = torch.empty((local.numel(), 2), dtype=torch.int32, device=local.device)
            words[:, 0] = local
            words[:, 1] = values.reshape(-1).view(torch.int32)
            return words.view(torch.uint8)
        index_bytes = local.view(torch.uint8).view(-1, 4)
        value_bytes = values.contiguous().view(-1, 1).view(torch.uint8)  # (rows, itemsize)
        return torch.cat([index_bytes, value_bytes], dim=1)

    def unpack_rows(
        self, rows: torch.Tensor, wire_like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count, width = rows.shape
        aligned = rows.is_contiguous() and rows.storage_offset() % 4 == 0
        if width == 8 and wire_like.element_size() == 4 and aligned:
            # As int32 words (24K rows, one thread: 0.04 against 0.24 ms bytewise).
            words = rows.view(torch.int32)
            values = words[:, 1].view(wire_like.dtype).clone(memory_format=torch.contiguous_format)
            return words[:, 0].to(torch.int64), values
        # Fresh buffers, not .contiguous(): with 0 or 1 rows a column slice is already
        # "contiguous" at an offset a wider dtype cannot view (float64 at offset 4).
        index_bytes = torch.empty((count, 4), dtype=torch.uint8, device=rows.device)
        value_bytes = torch.empty((count, width - 4), dtype=torch.uint8, device=rows.device)
        indices = index_bytes.copy_(rows[:, :4]).view(torch.int32).view(-1).to(torch.int64)
        values = value_bytes.copy_(rows[:, 4:]).view(wire_like.dtype).view(-1)
        return indices, values

    def unique_inverse(
        self, indices: torch.Tensor, runs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if numpy_serves(indices):
            # NumPy's stable sort merges the ranks' ascending runs (host_candidates).
            distinct, inverse = numpy_unique_inverse(indices.numpy())
            return torch.from_numpy(distinct), torch.from_numpy(inverse)
        # One sort whatever the runs (340K indices in 2 runs, one CPU thread: 20 ms, where
        # NumPy's merge took 5.7-6.7 in the same run); parallel above two threads.
        return torch.unique(indices, sorted=True, return_inverse=True)

    sum_rows = sum_rows_in_turn  # unique_inverse, then add_at in row order

    # ---- global selection (radix select over fp32 magnitude bits)
    def magnitude_keys(self, values: torch.Tensor) -> torch.Tensor:
        return values.abs().to(torch.float32).view(torch.int32)

    def radix_start(self, like: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # torch.full is a kernel launch, not a blocking host-to-device copy.
        prefix = torch.zeros((), dtype=torch.int32, device=like.device)
        remaining = torch.full((), k, dtype=torch.int64, device=like.device)
        return prefix, remaining

    def digit_histogram(self, keys: torch.Tensor, prefix: torch.Tensor, shift: int) -> torch.Tensor:
        digit = (keys >> shift) & (_HISTOGRAM_BINS - 1)
        if shift + 8 < 32:
            active = (keys >> (shift + 8)) == (prefix >> (shift + 8))
            digit = torch.where(active, digit, _HISTOGRAM_BINS)  # bin 256: not in the running
        counts = torch.zeros(_HISTOGRAM_BINS + 1, dtype=torch.int32, device=keys.device)
        counts.scatter_add_(0, digit.to(torch.int64), torch.ones_like(digit))
        return counts[:_HISTOGRAM_BINS]

    def choose_digit(
        self, histogram: torch.Tensor, remaining: torch.Tensor, prefix: torch.Tensor, shift: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        counts = histogram.to(torch.int64)
        at_least = counts.flip(0).cumsum(0).flip(0)  # at_least[d] = #digits >= d
        digit = ((at_least >= remaining).sum() - 1).clamp(min=0)
        greater = at_least.gather(0, digit.view(1)) - counts.gather(0, digit.view(1))
        return prefix | (digit.to(torch.int32) << shift), remaining - greater.view(())

    def mask_at_least(self, keys: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return keys >= threshold

    def count_reaching(self, keys: torch.Tensor, threshold: torch.Tensor) -> int:
        if keys.device.type != "cpu":
            return self.num_rows(keys)  # an upper bound the host has: no sync
        return int(torch.count_nonzero(keys >= threshold))

    def larger_key(self, key: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return torch.maximum(key, other)

    def extrapolate_key(
        self, lowest: torch.Tensor, middle: torch.Tensor, count: int, k: int
    ) -> torch.Tensor:
        # Device arithmetic on the keys: no host read of either.
        below = (middle - lowest).to(torch.float64) * math.log2(k / count)
        return (lowest.to(torch.float64) - below).clamp_min(0).round().to(torch.int32)

    def shifted_key(
        self, key: torch.Tensor, offset: torch.Tensor, low: int, high: int
    ) -> torch.Tensor:
        total = key.to(torch.int64) + offset.to(torch.int64)
        return total.clamp(low, high).to(key.dtype)

    def concat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors))

    def chunks(self, tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
        return list(tensor.view(count, -1).unbind(0))

    def split_by_mask(
        self, mask: torch.Tensor, *tensors: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if numpy_serves(mask):
            # 12K flags, half (90 %) set, one thread: 0.13 (0.07) against 0.41 (0.12) ms.
            flags = mask.numpy()
            keep = torch.from_numpy(np.flatnonzero(flags))
            drop = torch.from_numpy(np.flatnonzero(~flags))
        else:
            keep = mask.nonzero().view(-1)  # host sync: the all-gather needs its send size
            # The drop count is known on the host now: no second sync.
            drop = torch.nonzero_static(~mask, size=mask.numel() - keep.numel()).view(-1)
        return [t.index_select(0, keep) for t in tensors], [
            t.index_select(0, drop) for t in tensors
        ]

    def count_in_range(self, indices: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return ((indices >= lo) & (indices < hi)).sum()

    def owner_major(
        self, sends: Sequence[tuple[torch.Tensor, list[int]]]
    ) -> tuple[torch.Tensor, list[int]]:
        # The splits are host ints already: views, and one copy into the joined send.
        pieces = [rows.split(splits) for rows, splits in sends]
        owners = len(sends[0][1])
        joined = [piece[owner] for owner in range(owners) for piece in pieces]
        return torch.cat(joined), [sum(splits[o] for _, splits in sends) for o in range(owners)]

    def cut_at(
        self, indices: torch.Tensor, values: torch.Tensor, edges: Sequence[int], ordered: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not ordered:
            indices, order = torch.sort(indices)
            values = values.index_select(0, order)
        bounds = self._boundaries(list(edges), indices.device)
        positions = torch.searchsorted(indices, bounds).tolist()  # host sync: the cut sizes
        sizes = [hi - lo for lo, hi in zip(positions[:-1], positions[1:])]
        cut = zip(indices.split(sizes), values.split(sizes), edges)
        return [(part - start, part_values) for part, part_values, start in cut]

    def scatter_into(
        self,
        numel: int,
        like: torch.Tensor,
        indices: torch.Tensor,
        values: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.zeros(numel, dtype=like.dtype, device=like.device)
        else:
            out.zero_()
        return out.index_copy_(0, indices, values.to(out.dtype))

    def zero_(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.zero_()

    def value_of(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer

    def from_host(self, values: list[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=like.device)
