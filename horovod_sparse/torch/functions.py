"""Functional sparse allreduce for users who manage tensors themselves.

Residuals are kept per ``(name, process set)``: call with the same ``name`` every step
for the same logical tensor, as with Horovod's named collectives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

from horovod_sparse.common.engine import BucketView, Engine
from horovod_sparse.common.handle import BucketHandle
from horovod_sparse.common.options import Frontend
from horovod_sparse.common.pipeline import BucketReducer
from horovod_sparse.common.registry import NamedReducers, per_tensor_call
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.step import StepRecord
from horovod_sparse.torch.backend import TorchBackend

__all__ = [
    "SparseHandle",
    "bucket_view",
    "last_record",
    "reset_residuals",
    "residual",
    "sparse_allreduce",
    "sparse_allreduce_async",
    "stats",
    "synchronize",
]

BACKEND = TorchBackend()
# One engine of one bucket per (name, process set): each call is a step of its plan.
_ENGINES: NamedReducers[Engine] = NamedReducers(lambda engine: engine.sparse[0])
_LAST_NAME: list[str] = []
# The last CPU result of each reducer, flat. A later call writes its result there when
# the caller has dropped every view of it: a fresh 64 MB result costs 25 ms of page
# faults on a CPU (16M floats), zeroing a mapped one 1.8 ms. CUDA's caching allocator
# already reuses device memory, so CUDA results are not kept.
_LAST_RESULTS: weakref.WeakKeyDictionary[BucketReducer, torch.Tensor] = weakref.WeakKeyDictionary()


def op_name(op: Any) -> str:
    """Horovod's reduce-op constant as the name :mod:`horovod_sparse.common` uses."""
    return {hvd.Average: "average", hvd.Sum: "sum"}.get(op, repr(op))


@dataclass
class SparseHandle(BucketHandle):
    """The one async handle type (:class:`~horovod_sparse.common.handle.BucketHandle`),
    whose result takes the input's shape; resolved by :func:`synchronize`."""

    shape: tuple[int, ...] = ()

    def wait(self) -> torch.Tensor:
        """Block until the result is ready and return it, shaped like the input."""
        flat = super().wait()
        if flat.device.type == "cpu" and isinstance(self.reducer, BucketReducer):
            _LAST_RESULTS[self.reducer] = flat
        return flat.view(self.shape)


def _dropped_result(reducer: BucketReducer, like: torch.Tensor) -> torch.Tensor | None:
    """The reducer's last result if nothing but this module refers to its memory any
    more (the caller dropped every view of it), and it matches ``like``; else None."""
    last = _LAST_RESULTS.get(reducer)
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if last is None or use_count is None:
        return None
    if last.dtype != like.dtype or last.device != like.device or last.numel() != like.numel():
        return None
    # References to the memory: ``last`` and the storage object made to ask. Any view
    # the caller still holds (the shaped result, a slice, a NumPy array) adds one.
    if use_count(last.untyped_storage()._cdata) != 2:
        return None
    return last


def _check_tensor(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(
            f"sparse_allreduce({name!r}) needs a floating-point tensor, got {tensor!r:.80}"
        )
    if tensor.dtype == torch.bfloat16:
        raise TypeError(
            f"sparse_allreduce({name!r}): bfloat16 is not supported by Horovod's torch bindings; "
            "cast to float32 first"
        )
    if tensor.is_sparse:
        raise TypeError(f"sparse_allreduce({name!r}) takes a dense tensor; call .to_dense() first")


def sparse_allreduce_async(
    tensor: torch.Tensor,
    density: float = 0.01,
    name: str | None = None,
    op: Any = hvd.Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = hvd.global_process_set,
    compression: Any = hvd.Compression.none,
    **options: Any,
) -> SparseHandle:
    """Start a sparse allreduce of ``tensor``; returns a :class:`SparseHandle`.

    Sends one alltoall now (about k(P-1)/P rows of 8 bytes for fp32, k = ceil(density*n));
    the histogram allreduces and the allgather follow in :func:`synchronize`.
    Keeps the unselected mass in a residual stored under ``name``. ``options``: the
    per-tensor options of :class:`~horovod_sparse.common.config.SparseConfig`
    (``selection``, ``partition``, ``reestimate_steps``, ``repartition_steps``,
    ``warmup_steps``, ``density_decay_steps``, ``error_feedback``, ``global_selection``,
    ``refresh_steps``).

    Example:
        >>> handle = sparse_allreduce_async(grad, density=0.01, name="w")
        >>> reduced = synchronize(handle)
    """
    call = per_tensor_call(name, density, options, Frontend.TORCH_ALLREDUCE)
    name, config, prescale, postscale = call.scaled(
        op_name(op), process_set, prescale_factor, postscale_factor
    )
    _check_tensor(tensor, name)
    flat = tensor.detach().reshape(-1)

    def create(previous: Engine | None) -> Engine:
        fresh = BucketReducer(
            BACKEND, f"hvds.{name}", flat.numel(), flat, config, process_set, compression
        )
        if previous is not None:
            fresh.take_residual(previous.sparse[0])
        return Engine(BACKEND, [name], [fresh])

    engine = _ENGINES.obtain(name, process_set, flat.numel(), config, create)
    reducer = engine.sparse[0]
    reducer.compression = compression
    engine.prescale, engine.postscale = prescale, postscale
    engine.begin_step()
    engine.open_step(gradients_in_residual=True)
    engine.accumulate(0, flat, 0)
    handle = engine.launch(0, reducer.residual, result_in_buffer=False)
    assert handle is not None, "one bucket: never a fused run"
    _LAST_NAME[:] = [name]
    out = _dropped_result(reducer, flat)
    return SparseHandle(reducer, handle.stage, flat, postscale, out=out, shape=tensor.shape)


def synchronize(handle: SparseHandle) -> torch.Tensor:
    """Wait for a :class:`SparseHandle` and return the reduced tensor."""
    return handle.wait()


def sparse_allreduce(
    tensor: torch.Tensor,
    density: float = 0.01,
    name: str | None = None,
    op: Any = hvd.Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = hvd.global_process_set,
    compression: Any = hvd.Compression.none,
    **options: Any,
) -> torch.Tensor:
    """Sparse allreduce of ``tensor`` with error feedback; returns a new tensor.

    The result holds about ``density * numel`` nonzeros: the global top-k of the summed
    error-feedback accumulators (divided by the process-set size for ``op=Average``).
    What is not sent stays in a residual kept under ``name`` and is added next call.

    Example:
        >>> out = sparse_allreduce(torch.randn(1_000_000), density=0.01, name="g")
        >>> stats().bytes_sent
    """
    return synchronize(
        sparse_allreduce_async(
            tensor,
            density,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            compression,
            **options,
        )
    )


def _engine(name: str | None, process_set: Any) -> Engine:
    if name is None and not _LAST_NAME:
        raise KeyError("no sparse_allreduce has completed yet")
    return _ENGINES.find(name if name is not None else _LAST_NAME[0], process_set)


def stats(name: str | None = None, process_set: Any = hvd.global_process_set) -> StepStats:
    """Statistics of the last completed :func:`sparse_allreduce` (of ``name`` if given)."""
    return _engine(name, process_set).sparse[0].last_stats()


def last_record(name: str | None = None, process_set: Any = hvd.global_process_set) -> StepRecord:
    """What the last :func:`sparse_allreduce` under ``name`` did, with host numbers: rows
    sent and received per rank (``send_splits``, ``recv_splits``: the alltoall's, None
    at P = 2 where one allgather replaces it), rows kept, seconds."""
    return _engine(name, process_set).sparse[0].last_record.on_host(BACKEND)


def bucket_view(name: str | None = None, process_set: Any = hvd.global_process_set) -> BucketView:
    """A read-only snapshot of the state kept under ``name``: step count, boundaries."""
    return _engine(name, process_set).views()[0]


def residual(name: str, process_set: Any = hvd.global_process_set) -> torch.Tensor:
    """This rank's current residual for ``name`` (flat)."""
    return _engine(name, process_set).sparse[0].residual


def reset_residuals() -> None:
    """Forget every residual kept by the functional API."""
    _ENGINES.clear()
    _LAST_NAME.clear()
    _LAST_RESULTS.clear()
