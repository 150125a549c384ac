"""The tensor primitives a framework adapter provides.

The stage modules of :mod:`horovod_sparse.common` are written once against this
interface; ``horovod_sparse.torch`` and ``horovod_sparse.tensorflow`` implement it.
Sizes and ranks are host ints; everything else may stay a device tensor.
A "scalar" is either a host number or a 0-d tensor (TF keeps them in the graph). The
budget k is a host int too, except under TF while the density decays
(``density_decay_steps``): it follows the step variable, so it is a graph scalar
(:class:`HostCounts`).

State that changes from step to step (a reused threshold, a step count, partition
boundaries) lives in a :class:`Cell` that the backend makes: a plain Python box for
PyTorch, whose step runs eagerly, and a ``tf.Variable`` for TensorFlow, so a
``tf.function`` traced once still reads and updates it on every call. Decisions that
depend on such state go through :meth:`Backend.cond`: a Python ``if`` on a host value,
``tf.cond`` on a graph tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Protocol

from horovod_sparse.common.horovod_primitives import HorovodPrimitives
from horovod_sparse.common.host_counts import HostCounts, host_at_least
from horovod_sparse.common.host_scalars import HostCell

if TYPE_CHECKING:
    from horovod_sparse.common.config import SparseConfig

__all__ = [
    "Backend",
    "Cell",
    "HorovodPrimitives",
    "HostCell",
    "HostCounts",
    "Tensor",
    "host_at_least",
]

Tensor = Any  # a framework tensor: torch.Tensor or tf.Tensor


class Cell(Protocol):
    """One value of per-bucket state that persists between steps."""

    def get(self) -> Any: ...
    def set(self, value: Any) -> None: ...


class Backend(Protocol):
    """Primitives used by the stages, grouped as in the adapters.

    In place: a kernel whose name ends in ``_``, and ``assign``, ``scale``,
    ``zero_at``, ``add_at``, ``zero_then_add`` and ``allreduce_sum_inplace_async``, may
    write into its first argument; every kernel returns its result, and the common code
    always uses the return value, so a backend that cannot write in place (TF) returns a
    new tensor instead. :attr:`in_place` says which kind this backend is, for the one
    path that needs the write itself (dense-step fusion reduces the adapter's arena
    slice).
    """

    in_place: bool  # whether the kernels above write into their first argument
    # Whether a P = 2 all-gather pads each rank's rows to a capacity fixed while the budget
    # is (docs/design.md §2.2): its shape then repeats, and Horovod's response cache
    # serves it instead of a negotiation.
    pads_gathered_rows: bool

    # ---- process set
    def rank(self, process_set: Any) -> int: ...
    def size(self, process_set: Any) -> int: ...

    def local_work(self) -> AbstractContextManager[None]:
        """The context the plugin's own kernels run in: under PyTorch on the CPU, at
        most the cores of this host divided by its ranks (ranks that share cores would
        otherwise each start every core's threads on small kernels)."""

    # ---- state and control flow
    def cell(self, initial: Any, like: Tensor | None = None) -> Cell:
        """State that persists between steps: a host int or bool, a list of host ints
        (boundaries), or, given ``like``, a scalar in ``like``'s dtype."""

    def cond(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        """``then()`` if ``pred`` else ``otherwise()``; both return the same structure."""

    def update_cells(
        self,
        update: Callable[[Any, Sequence[Cell], Sequence[Any]], Any],
        cells: Sequence[Cell],
        inputs: Sequence[Any],
        unread: Sequence[Cell] = (),
        returns: Sequence[Any] = (),
    ) -> Any:
        """``update(ops, [*cells, *unread], inputs)``: with this backend for ``ops``, or,
        where the update's scalar arithmetic costs more as kernels than as one host call
        (TF with the NumPy kernels), once on the host: ``HOST_SCALARS`` for ``ops``, the
        cells' values and the tensor inputs as NumPy arrays, every cell written back
        after. ``unread``: cells the update sets without reading them first (not read).
        ``returns``: the update returns a tuple of 1-D tensors, one per entry, each of
        that entry's dtype (a tensor's, or ``"int64"``); this returns them (None where
        ``returns`` is empty)."""

    def select(self, pred: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        """:meth:`cond` for a scalar whose two values are cheap and free of collectives:
        a graph may compute both and pick one (no branch functions to build), where the
        step runs its Python every time only the one chosen is computed."""

    def on_host(self, function: Callable[[list[int]], list[int]], counts: Tensor) -> Any:
        """``function`` of the host list of int ``counts``, at run time (a host round
        trip), as a host list or, in a graph, an int64 tensor."""

    # ---- budgets (see HostCounts): host ints, or graph scalars where the step is one
    def sparse_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        """k of a sparse step at ``step`` (``SparseConfig.sparse_density_at``): a host
        int, or an int64 scalar tensor where the step count is a graph value and the
        density decays."""

    def scheduled_budget(self, numel: int, config: SparseConfig, step: Any) -> Any:
        """k by the density schedule at ``step``, warm-up included: a host int, or an
        int64 scalar where the step count is a graph value and the schedule reads it."""

    def all_of(self, flags: Sequence[Any]) -> Any:
        """Whether every decision holds (a graph bool where one of them is)."""
        ...

    def any_of(self, flags: Sequence[Any]) -> Any:
        """Whether some decision holds (a graph bool where one of them is)."""
        ...

    def scaled_count(
        self,
        count: Any,
        numerator: float,
        denominator: int = 1,
        rounding: str = "floor",
        least: int | None = None,
        most: int | None = None,
    ) -> Any:
        """Rounded ``count * numerator / denominator`` within ``[least, most]``: a host
        int for a host ``count``, an int64 scalar for a graph one."""

    # ---- dense arithmetic and bookkeeping
    def zeros(self, numel: int, like: Tensor) -> Tensor: ...
    def length(self, tensor: Tensor) -> int:
        """Static first dimension of a bucket-sized tensor (a host int)."""

    def num_rows(self, tensor: Tensor) -> Any:
        """First dimension (host int or scalar tensor)."""

    def itemsize(self, tensor: Tensor) -> int: ...
    def add_scaled_(self, buffer: Tensor, tensor: Tensor, factor: float) -> Tensor:
        """``buffer + factor * tensor.flatten()``, in place where the framework allows."""

    def add_scaled_at_(self, buffer: Tensor, offset: int, tensor: Tensor, factor: float) -> Tensor:
        """``buffer[offset:offset + numel] += factor * tensor.flatten()``; returns it."""

    def add_scaled(self, tensor: Tensor, other: Tensor, factor: float) -> Tensor:
        """A new ``tensor + factor * other``."""

    def momentum_update_(
        self, buffer: Tensor, value: Tensor, momentum: float, weight: float
    ) -> Tensor:
        """``momentum * buffer + weight * value``, in place where the framework allows."""

    def moving_average_(self, buffer: Tensor, value: Tensor, beta: float) -> Tensor:
        """``beta * buffer + (1 - beta) * value``, in place where the framework allows."""

    def moving_average_of_square_(self, buffer: Tensor, value: Tensor, beta: float) -> Tensor:
        """``beta * buffer + (1 - beta) * value**2``, in place where the framework allows."""

    def adam_ratio(
        self,
        first: Tensor,
        second: Tensor,
        first_scale: Any,
        second_scale: Any,
        eps: float,
        ranks: int,
    ) -> Tensor:
        """A new ``m / (sqrt(v) + eps)`` with ``m = first / first_scale`` and, for the
        average of ``ranks`` ranks' gradients, ``v = second / second_scale / ranks +
        (1 - 1 / ranks) * min(m**2, second / second_scale)`` (see
        :func:`~horovod_sparse.common.correction.adam_direction`); Adam's own ratio at
        ``ranks == 1``."""

    def copy(self, tensor: Tensor) -> Tensor: ...
    def value_of(self, buffer: Tensor) -> Tensor:
        """``buffer``'s contents now, to compute from: ``buffer`` itself, or under TF the
        value of a residual kept in its variable (``tensorflow/residual_variable.py``)."""

    def assign(self, buffer: Tensor, source: Any) -> Tensor:
        """``buffer``'s contents replaced by ``source`` (any device, same length)."""

    def scale(self, tensor: Tensor, factor: float) -> Tensor: ...
    def to_host_number(self, scalar: Any) -> float: ...
    def sum_except(self, counts: Any, rank: int) -> Any:
        """Sum of per-rank ``counts`` without entry ``rank``."""

    def clock(self, *after: Tensor) -> Any:
        """A timestamp taken after ``after`` are computed (seconds)."""

    # ---- selection and residual updates
    def topk_indices(self, values: Tensor, k: Any) -> Tensor:
        """Indices of the k largest ``|values|``, ascending, int64 (``k``: a host int, or
        a graph scalar below n, as every ``k`` below)."""

    def strided_sample_abs(self, values: Tensor, size: int, offset: int) -> Tensor:
        """``|values|`` at ``size`` evenly strided positions starting near ``offset``."""

    def kth_largest(self, values: Tensor, k: Any) -> Tensor:
        """Scalar: the k-th largest of ``values``."""

    def indices_at_least(self, values: Tensor, threshold: Tensor) -> Tensor:
        """Ascending int64 indices where ``|values| >= threshold`` (one memory pass)."""

    def top_of(self, values: Tensor, candidates: Tensor, k: Any) -> Tensor:
        """The k of ``candidates`` with the largest ``|values|``, ascending."""

    def position_histogram(self, indices: Tensor, numel: int, bins: int) -> Tensor:
        """int32[bins]: how many ``indices`` fall in each of ``bins`` equal bins of [0, n)."""

    def to_host_list(self, tensor: Tensor) -> list[Any]: ...

    def take(self, values: Tensor, indices: Tensor) -> Tensor: ...
    def zero_at(self, buffer: Tensor, indices: Tensor) -> Tensor:
        """``buffer[indices] = 0``; returns the updated buffer."""

    def add_at(self, buffer: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """``buffer[indices] += values``, duplicates summed; returns the updated buffer."""

    def zero_then_add(
        self,
        buffer: Tensor,
        zeroed: Tensor,
        held: Tensor,
        adds: Sequence[tuple[Tensor, Tensor]],
    ) -> Tensor:
        """``buffer[zeroed] = 0``, then each ``(indices, values)`` of ``adds`` added in
        its turn, as :meth:`zero_at` and :meth:`add_at` would leave it, bit for bit;
        returns the buffer. One add's indices are distinct (positions repeat only across
        adds). ``held``: the entries at ``zeroed`` as the caller read them (:meth:`take`),
        which a backend that is not in place cancels to write the buffer in one pass."""

    def shift(self, indices: Tensor, offset: int) -> Tensor: ...

    # ---- partition and packing
    def region_counts(self, sorted_indices: Tensor, boundaries: Any) -> Any:
        """Entries of the ascending ``sorted_indices`` per region: the alltoall splits.
        ``boundaries``: P + 1 host ints, or an int64 tensor of them (a cell's value)."""

    def region_offsets(self, sorted_indices: Tensor, boundaries: Any) -> Tensor:
        """Per index, the start of the region it falls in."""

    def pack_rows(self, indices: Tensor, offset: Any, values: Tensor) -> Tensor:
        """uint8 rows: int32 ``indices - offset`` bytes, then the value's bytes."""

    def unpack_rows(self, rows: Tensor, wire_like: Tensor) -> tuple[Tensor, Tensor]:
        """Inverse of :meth:`pack_rows`: ``(int64 indices, values in wire_like's dtype)``."""

    def pad_rows(self, rows: Tensor, capacity: Any) -> Tensor:
        """``rows`` followed by padding rows up to ``capacity`` rows (none where there are
        that many already): all bytes 0xFF, so each unpacks to index -1."""

    def unpadded(self, indices: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The unpacked rows less the padding rows (index -1) :meth:`pad_rows` added."""

    def unique_inverse(self, indices: Tensor, runs: Any = None) -> tuple[Tensor, Tensor]:
        """``(distinct values ascending, position of each input in them)``. ``runs``:
        None, or the lengths of the consecutive runs ``indices`` is made of (a tensor
        or a list of counts), each of distinct ascending values (one per sending rank),
        which may be merged rather than sorted."""

    def sum_rows(
        self, indices: Tensor, values: Tensor, like: Tensor, runs: Any = None
    ) -> tuple[Tensor, Tensor]:
        """``(distinct indices ascending, the sum of values at each)`` in ``like``'s
        dtype, each sum added in row order (so identical inputs give identical bits):
        :meth:`unique_inverse` then :meth:`add_at` into zeros, or one kernel doing both.
        ``runs``: as for :meth:`unique_inverse`."""

    # ---- value compression (Horovod ``Compression`` classes)
    def compress(self, values: Tensor, compression: Any) -> tuple[Tensor, Any, Any]:
        """``(wire values, context, rounding lost or None)``."""

    def decompress(self, wire: Tensor, ctx: Any) -> Tensor: ...

    # ---- global selection (radix select over fp32 magnitude bits)
    def magnitude_keys(self, values: Tensor) -> Tensor:
        """int32 keys ordered like ``|values|`` (bits of the fp32 magnitude)."""

    def radix_start(self, like: Tensor, k: Any) -> tuple[Tensor, Tensor]:
        """Initial ``(prefix, remaining)`` scalars."""

    def digit_histogram(self, keys: Tensor, prefix: Tensor, shift: int) -> Tensor:
        """int32[256]: counts of digit ``(key >> shift) & 255`` among keys that agree
        with ``prefix`` above bit ``shift + 8``."""

    def choose_digit(
        self, histogram: Tensor, remaining: Tensor, prefix: Tensor, shift: int
    ) -> tuple[Tensor, Tensor]:
        """Largest digit d whose count of digits >= d reaches ``remaining``; returns
        ``(prefix | d << shift, remaining - count(digits > d))``."""

    def mask_at_least(self, keys: Tensor, threshold: Tensor) -> Tensor: ...
    def count_reaching(self, keys: Tensor, threshold: Tensor) -> Any:
        """At least how many ``keys`` are ``>= threshold``: the count, or, where counting
        would make the host wait for a device, the number of keys (a host int)."""

    def larger_key(self, key: Tensor, other: Tensor) -> Tensor:
        """The larger of two magnitude-key scalars."""

    def extrapolate_key(self, lowest: Tensor, middle: Tensor, count: Any, k: Any) -> Tensor:
        """The key below which about ``k`` rows lie, from ``count`` rows whose lowest key
        is ``lowest`` and whose median is ``middle``: the count doubles every
        ``middle - lowest`` keys down (keys step about evenly in log magnitude)."""

    def shifted_key(self, key: Tensor, offset: Tensor, low: int, high: int) -> Tensor:
        """``key + offset`` clamped to ``[low, high]``, in ``key``'s dtype (int32 scalars;
        the sum is taken wider, so it does not wrap)."""

    def split_by_mask(self, mask: Tensor, *tensors: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``([t[mask] ...], [t[~mask] ...])``."""

    def concat(self, tensors: Sequence[Tensor]) -> Tensor:
        """The 1-D ``tensors`` end to end."""

    def chunks(self, tensor: Tensor, count: int) -> list[Tensor]:
        """``tensor`` (1-D, a multiple of ``count`` long) cut into ``count`` equal parts."""

    def count_in_range(self, indices: Tensor, lo: int, hi: int) -> Any:
        """Scalar: entries of ``indices`` in ``[lo, hi)``."""

    # ---- one exchange for several buckets (common/joined.py)
    def owner_major(self, sends: Sequence[tuple[Tensor, Any]]) -> tuple[Tensor, Any]:
        """Several alltoall sends ``(rows, splits)`` (each rows' owners in order) as one:
        the rows for owner 0 of every send in send order, then owner 1's, ...; and the
        summed splits."""

    def cut_at(
        self, indices: Tensor, values: Tensor, edges: Any, ordered: bool
    ) -> list[tuple[Tensor, Tensor]]:
        """Per part p, the ``(indices - edges[p], values)`` whose index lies in
        ``[edges[p], edges[p+1])``, indices ascending. ``edges``: host ints, or (under
        TF) a graph tensor of them. ``ordered``: ``indices`` are ascending already; else
        they get sorted (equal indices in no set order)."""

    def scatter_into(
        self, numel: int, like: Tensor, indices: Tensor, values: Tensor, out: Any = None
    ) -> Tensor:
        """Zeros with ``values`` at the (distinct) ``indices``: in ``out`` if the framework
        allows writing into it, else a new buffer."""

    # ---- collectives (asynchronous where the framework allows; resolve with wait)
    def alltoall_async(self, rows: Tensor, splits: Any, name: str, process_set: Any) -> Any: ...
    def allgather_async(self, rows: Tensor, name: str, process_set: Any) -> Any: ...
    def allreduce_sum_async(self, tensor: Tensor, name: str, process_set: Any) -> Any: ...
    def allreduce_sum_inplace_async(self, tensor: Tensor, name: str, process_set: Any) -> Any:
        """Sum allreduce whose result may overwrite ``tensor`` (use what ``wait`` returns)."""
        ...

    def zero_(self, buffer: Tensor) -> Tensor:
        """``buffer`` cleared (in place where the framework allows)."""
        ...

    def from_host(self, values: list[float], like: Tensor) -> Tensor:
        """A float64 tensor of host ``values`` on ``like``'s device (scheduler figures)."""
        ...

    def broadcast(self, tensor: Tensor, root: int, name: str, process_set: Any) -> Tensor:
        """Blocking broadcast of ``tensor`` from ``root`` (the scheduler's choice)."""
        ...

    def poll(self, handle: Any) -> bool:
        """Whether a collective finished, without blocking (used by the trace)."""
        ...

    def wait(self, handle: Any) -> Any:
        """Result of a collective; for alltoall ``(rows, received splits)``."""
