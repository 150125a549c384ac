"""The tensor primitives a framework adapter provides.

The stage modules of :mod:`horovod_sparse.common` are written once against this
interface; ``horovod_sparse.torch`` and ``horovod_sparse.tensorflow`` implement it.
"Host" values are Python ints; everything else stays a device tensor. The only
primitives that read device data on the host are :meth:`Backend.region_counts` (Horovod
wants alltoall ``splits`` on the CPU) and :meth:`Backend.num_rows` of a data-dependent
selection (a collective needs its send size).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Backend", "Tensor"]

Tensor = Any  # a framework tensor: torch.Tensor or tf.Tensor


class Backend(Protocol):
    # ---- process set
    def rank(self, process_set: Any) -> int: ...
    def size(self, process_set: Any) -> int: ...

    # ---- dense arithmetic
    def zeros(self, numel: int, like: Tensor) -> Tensor: ...
    def num_rows(self, tensor: Tensor) -> int: ...
    def itemsize(self, tensor: Tensor) -> int: ...

    # ---- stage kernels
    def topk_indices(self, values: Tensor, k: int) -> Tensor:
        """Indices of the k largest ``|values|``, ascending, int64."""

    def take(self, values: Tensor, indices: Tensor) -> Tensor: ...
    def zero_at(self, buffer: Tensor, indices: Tensor) -> Tensor:
        """``buffer[indices] = 0`` (in place where the framework allows); returns it."""

    def add_at(self, buffer: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """``buffer[indices] += values``, duplicates summed; returns it."""

    def region_counts(self, sorted_indices: Tensor, boundaries: list[int]) -> list[int]:
        """How many of the ascending ``sorted_indices`` fall in each region (host ints)."""

    def pack_rows(self, indices: Tensor, offset: Tensor | int, values: Tensor) -> Tensor:
        """Rows of int32 ``indices - offset`` and ``values`` bytes, as one uint8 tensor."""

    def unpack_rows(self, rows: Tensor, value_dtype: Any) -> tuple[Tensor, Tensor]:
        """Inverse of :meth:`pack_rows`: ``(int64 indices, values)``."""

    def region_offsets(self, sorted_indices: Tensor, boundaries: list[int]) -> Tensor:
        """Per index, the start of the region it falls in."""

    def unique(self, indices: Tensor) -> Tensor: ...
    def magnitude_keys(self, values: Tensor) -> Tensor:
        """int32 keys ordered like ``|values|`` (bits of the fp32 magnitude)."""

    def digit_histogram(self, keys: Tensor, prefix: Tensor, shift: int) -> Tensor:
        """int32[256] counts of digit ``(key >> shift) & 255`` among keys that agree
        with ``prefix`` above bit ``shift + 8``."""

    def choose_digit(
        self, histogram: Tensor, remaining: Tensor, prefix: Tensor, shift: int
    ) -> tuple[Tensor, Tensor]:
        """Largest digit d whose suffix count reaches ``remaining``; returns the new
        ``(prefix | d << shift, remaining - count(digits > d))``."""

    def radix_start(self, like: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Initial ``(prefix, remaining)`` scalars on ``like``'s device."""

    def mask_at_least(self, keys: Tensor, threshold: Tensor) -> Tensor:
        """Boolean mask ``keys >= threshold``."""

    def split_by_mask(self, mask: Tensor, *tensors: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``([t[mask] ...], [t[~mask] ...])``."""

    def count_in_range(self, indices: Tensor, lo: int, hi: int) -> Tensor:
        """Device scalar: entries of ``indices`` in ``[lo, hi)``."""

    def scatter_into(self, numel: int, like: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """A new zero buffer with ``values`` written at the (distinct) ``indices``."""

    def scale(self, tensor: Tensor, factor: float) -> Tensor: ...
    def to_host_int(self, scalar: Tensor) -> int: ...

    # ---- collectives (asynchronous: return a handle for :meth:`wait`)
    def alltoall_async(
        self, rows: Tensor, splits: list[int], name: str, process_set: Any
    ) -> Any: ...
    def allgather_async(self, rows: Tensor, name: str, process_set: Any) -> Any: ...
    def allreduce_sum_async(self, tensor: Tensor, name: str, process_set: Any) -> Any: ...
    def wait(self, handle: Any) -> Any:
        """Result of a collective; for alltoall ``(rows, received splits as host ints)``."""
