"""The backend primitives that every framework shares (see
:mod:`horovod_sparse.common.backend`): Horovod's objects answer them, or they are plain
Python."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable

from horovod_sparse.common.host_counts import HostCounts

if TYPE_CHECKING:
    from horovod_sparse.common.backend import Cell, Tensor

__all__ = ["HorovodPrimitives"]


class HorovodPrimitives(HostCounts):
    """The primitives of :class:`~horovod_sparse.common.backend.Backend` that are the
    same in every framework, because Horovod's objects answer them: a ``ProcessSet``'s
    rank and size, and a ``Compression`` class's codec. Backends inherit them and set
    :attr:`no_compression` to their framework's ``hvd.Compression.none``. The host
    budget arithmetic of :class:`HostCounts` comes with them."""

    no_compression: Any = None

    def local_work(self) -> AbstractContextManager[None]:
        """No thread sizing: the framework's own (see :meth:`Backend.local_work`)."""
        return nullcontext()

    def update_cells(
        self,
        update: Callable[[Any, Sequence[Cell], Sequence[Any]], Any],
        cells: Sequence[Cell],
        inputs: Sequence[Any],
        unread: Sequence[Cell] = (),
        returns: Sequence[Any] = (),
    ) -> Any:
        """Here, with this backend's own kernels (see :meth:`Backend.update_cells`)."""
        return update(self, [*cells, *unread], inputs)

    def rank(self, process_set: Any) -> int:
        return int(process_set.rank())

    def size(self, process_set: Any) -> int:
        return int(process_set.size())

    def compress(self, values: Tensor, compression: Any) -> tuple[Tensor, Any, Any]:
        """``(wire values, context, rounding lost or None)``: a lossy wire dtype
        (Horovod's fp16) loses a rounding that the caller keeps in the residual."""
        if compression is None or compression is self.no_compression:
            return values, None, None
        wire, ctx = compression.compress(values)
        if wire.dtype == values.dtype:
            return wire, (compression, ctx), None
        return wire, (compression, ctx), values - compression.decompress(wire, ctx)

    def decompress(self, wire: Tensor, ctx: Any) -> Tensor:
        if ctx is None:
            return wire
        compression, inner = ctx
        return compression.decompress(wire, inner)
