"""Property tests (hypothesis) for the pure stages, each against an independent NumPy model.

Covered, on random inputs (no Horovod collectives; identity or thread-lockstep stand-ins):

1. Exchange rows: ``pack_rows`` gives exactly the bytes NumPy lays out (int32 region-local
   index, then the value's bytes), and ``unpack_rows`` gives back the same indices and
   bit-identical values (fp16/fp32/fp64 with inf, -0.0, subnormals, NaN payloads), on
   the torch and the TF backend, which also agree byte for byte.
   Zero or one row of fp16/bf16/fp64 values (a regression test: these once failed to
   view as the wider dtype) are covered too.
2. Partition: uniform and balanced boundaries are P + 1 non-decreasing ints from 0 to n,
   so every index has exactly one owner; uniform regions are n//P or ceil(n/P) long
   (arithmetic only, n up to 3 * 2**31); balanced cuts lie on bin edges and split the
   histogram into equal shares up to half a bin (the histogram comes from
   ``position_histogram`` on both backends, itself checked against ``np.bincount``).
   A cut sits exactly where the histogram bin it stands for begins. The send side of
   the reduce-scatter (``region_counts``, ``region_offsets``, both backends) routes every
   row to the owner a direct count finds.
3. Local selection: ``ExactSelection`` returns exactly k distinct ascending indices with
   the top-k magnitudes; ``ThresholdSelection`` (over a sequence of calls, so the reused
   threshold is exercised) returns a count inside its documented band [0.8k, 1.25k] of
   distinct ascending indices that dominate every unselected magnitude.
4. Owner reduction: ``owner_reduce`` on rows from several ranks with duplicate indices
   equals ``np.add.at`` (distinct indices ascending, sums within 1e-6 of the sum of
   magnitudes), on both backends, with fp16 wire values decoded to fp32.
5. Global selection: ``magnitude_keys`` orders like ``|values|``, and
   ``global_threshold_key`` run by P owners in lockstep (threads, summing allreduce)
   returns on every owner the exact k-th largest key of the union.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # once per module: slow to import
import torch

from horovod_sparse.common.global_selection import global_threshold_key
from horovod_sparse.common.partition import UniformPartition, balanced_boundaries
from horovod_sparse.common.reduction import owner_reduce
from horovod_sparse.common.selection import ExactSelection, ThresholdSelection
from horovod_sparse.tensorflow.backend import TFBackend
from horovod_sparse.torch.backend import TorchBackend

TORCH = TorchBackend()
TF = TFBackend()
INT32_MAX = 2**31 - 1

# No example database: every run explores afresh; a failure prints the input that fails.
FAST = settings(max_examples=60, deadline=None, database=None)
FEWER = settings(max_examples=40, deadline=None, database=None)


def _torch(array: np.ndarray) -> torch.Tensor:
    # A copy with standard strides: torch.from_numpy gives an empty array stride 0, which
    # no torch kernel produces and which the byte views of pack/unpack_rows reject.
    return torch.from_numpy(np.ascontiguousarray(array)).clone(
        memory_format=torch.contiguous_format
    )


def _bits(values: np.ndarray) -> np.ndarray:
    """The raw bit pattern, so NaN compares by payload and -0.0 differs from 0.0."""
    return values.view(np.dtype(f"u{values.dtype.itemsize}"))


def _numpy_rows(local: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The wire layout written out in NumPy: native int32 index bytes, then value bytes."""
    index_bytes = local.astype(np.int32).view(np.uint8).reshape(-1, 4)
    value_bytes = np.ascontiguousarray(values).view(np.uint8).reshape(-1, values.dtype.itemsize)
    return np.concatenate([index_bytes, value_bytes], axis=1)


# ---------------------------------------------------------------- 1. exchange rows

FLOAT_DTYPES = [np.float16, np.float32, np.float64]


@st.composite
def row_inputs(draw):
    """(region-local int32 indices, values, per-row region offsets or an int offset)."""
    dtype = np.dtype(draw(st.sampled_from(FLOAT_DTYPES)))
    n = draw(st.integers(0, 64))
    local = draw(hnp.arrays(np.int32, n, elements=st.integers(0, INT32_MAX)))
    if draw(st.booleans()):
        # Any bit pattern: every NaN payload, signalling NaNs, subnormals, infinities.
        raw = draw(hnp.arrays(np.dtype(f"u{dtype.itemsize}"), n))
        values = raw.view(dtype)
    else:
        values = draw(hnp.arrays(dtype, n, elements=hnp.from_dtype(dtype)))
    mode = draw(st.sampled_from(["zero", "scalar", "per_row"]))
    if mode == "zero":
        offset = 0
    elif mode == "scalar":
        offset = draw(st.integers(0, 3 * 2**31))
    else:  # what region_offsets hands pack_rows: one region start per row
        offset = draw(hnp.arrays(np.int64, n, elements=st.integers(0, 3 * 2**31)))
    return local, values, offset


SPECIALS = {
    np.float16: [np.inf, -np.inf, -0.0, 0.0, np.nan, 6e-8, -6e-8, 65504.0],
    np.float32: [np.inf, -np.inf, -0.0, 0.0, np.nan, 1e-45, -1e-45, 3.4028235e38],
    np.float64: [np.inf, -np.inf, -0.0, 0.0, np.nan, 5e-324, -5e-324, 1.7976931348623157e308],
}


def _special_case(dtype):
    values = np.array(SPECIALS[dtype], dtype=dtype)
    local = np.array([0, INT32_MAX, 1, INT32_MAX - 1, 0, 7, 2**30, INT32_MAX], dtype=np.int32)
    return local, values, np.arange(8, dtype=np.int64) * 2**31


@FAST
@given(row_inputs())
@example(_special_case(np.float16))
@example(_special_case(np.float32))
@example(_special_case(np.float64))
def test_pack_unpack_round_trip_bit_exact_on_both_backends(case):
    local, values, offset = case
    global_idx = local.astype(np.int64) + offset  # bucket-local, may exceed int32
    expected = _numpy_rows(local, values)

    # torch
    offset_t = _torch(offset) if isinstance(offset, np.ndarray) else offset
    rows_t = TORCH.pack_rows(_torch(global_idx), offset_t, _torch(values))
    assert rows_t.dtype == torch.uint8
    np.testing.assert_array_equal(rows_t.numpy(), expected)
    idx_t, val_t = TORCH.unpack_rows(rows_t, _torch(values[:0]))
    assert idx_t.dtype == torch.int64
    np.testing.assert_array_equal(idx_t.numpy(), local.astype(np.int64))
    assert val_t.numpy().dtype == values.dtype
    np.testing.assert_array_equal(_bits(val_t.numpy()), _bits(values))

    # TensorFlow: same bytes as torch, same round trip
    offset_f = tf.constant(offset) if isinstance(offset, np.ndarray) else offset
    rows_f = TF.pack_rows(tf.constant(global_idx), offset_f, tf.constant(values))
    assert rows_f.dtype == tf.uint8
    np.testing.assert_array_equal(rows_f.numpy(), rows_t.numpy())
    idx_f, val_f = TF.unpack_rows(rows_f, tf.constant(values[:0]))
    assert idx_f.dtype == tf.int64
    np.testing.assert_array_equal(idx_f.numpy(), local.astype(np.int64))
    np.testing.assert_array_equal(_bits(val_f.numpy()), _bits(values))
    # Torch reads TF's rows (the two adapters share one wire format).
    idx_x, val_x = TORCH.unpack_rows(_torch(rows_f.numpy()), _torch(values[:0]))
    np.testing.assert_array_equal(idx_x.numpy(), local.astype(np.int64))
    np.testing.assert_array_equal(_bits(val_x.numpy()), _bits(values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [0, 1])
def test_torch_unpack_rows_of_zero_or_one_row(n, dtype):
    """What an owner gets from Horovod's alltoall when 0 or 1 rows arrive for it (fp16 or
    bf16 compression: 6-byte rows; fp64 buckets: 12-byte rows)."""
    values = torch.arange(n, dtype=torch.float64).add_(1.5).to(dtype)
    raw = values.view(torch.uint8).numpy().reshape(n, values.element_size())  # native order
    layout = np.concatenate([np.arange(n, dtype=np.int32).view(np.uint8).reshape(n, 4), raw], 1)
    rows = torch.empty(layout.shape, dtype=torch.uint8)  # freshly allocated, like Horovod's
    rows.copy_(torch.from_numpy(layout))
    indices, unpacked = TORCH.unpack_rows(rows, values[:0])
    assert indices.tolist() == list(range(n))
    assert unpacked.dtype == dtype and torch.equal(unpacked, values)


# ---------------------------------------------------------------- 2. partition


def _check_boundaries(b: list[int], numel: int, world_size: int) -> None:
    assert all(isinstance(x, int) for x in b)
    assert len(b) == world_size + 1
    assert b[0] == 0
    assert b[-1] == numel
    assert all(lo <= hi for lo, hi in zip(b, b[1:]))


def _check_single_owner(b: list[int], numel: int, rng: np.random.Generator) -> None:
    """Every index in [0, numel) lies in exactly one [b[j], b[j+1])."""
    edges = np.array(b, dtype=np.int64)
    if numel <= 4096:  # explicit: paint every region, each index painted once
        painted = np.zeros(numel, dtype=np.int64)
        for lo, hi in zip(b, b[1:]):
            painted[lo:hi] += 1
        assert np.all(painted == 1)
        sample = np.arange(numel, dtype=np.int64)
    else:
        sample = np.concatenate(
            [rng.integers(0, numel, 512), [0, numel - 1], edges[1:-1], edges[1:-1] - 1]
        )
        sample = sample[(sample >= 0) & (sample < numel)]
    inside = (edges[:-1][None, :] <= sample[:, None]) & (sample[:, None] < edges[1:][None, :])
    assert np.all(inside.sum(axis=1) == 1)
    owner = np.searchsorted(edges, sample, side="right") - 1
    np.testing.assert_array_equal(owner, inside.argmax(axis=1))


@FAST
@given(
    numel=st.one_of(st.integers(1, 10**7), st.integers(1, 3 * 2**31)),
    world_size=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
)
@example(numel=1, world_size=64, seed=0)
@example(numel=3 * 2**31, world_size=2, seed=0)
def test_uniform_boundaries_cover_index_space(numel, world_size, seed):
    b = UniformPartition().boundaries(numel, world_size)
    _check_boundaries(b, numel, world_size)
    lengths = np.diff(np.array(b, dtype=np.int64))
    assert set(lengths.tolist()) <= {numel // world_size, -(-numel // world_size)}
    # Region-local indices are int32: they fit whenever the average region does.
    if -(-numel // world_size) <= 2**31:
        assert lengths.max() - 1 <= INT32_MAX
    if numel <= 10**7:
        _check_single_owner(b, numel, np.random.default_rng(seed))


@st.composite
def histograms(draw):
    """(selected positions, numel, world size, bins) as BalancedPartition.follow_gathered
    sees them."""
    numel = draw(st.one_of(st.integers(1, 300), st.integers(1, 10**7)))
    world_size = draw(st.integers(1, 64))
    if draw(st.booleans()):  # as BalancedPartition.follow_gathered sizes it
        bins_per_rank = draw(st.sampled_from([1, 2, 7, 256]))
        bins = max(1, min(numel, bins_per_rank * world_size))
    else:  # any bin count, more bins than elements included
        bins = draw(st.integers(1, 2000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    count = draw(st.integers(0, 3000))
    shape = draw(st.sampled_from(["uniform", "clustered", "one_spot", "edges"]))
    if shape == "uniform":
        positions = rng.integers(0, numel, count)
    elif shape == "clustered":  # most selections in a narrow band
        centre = rng.integers(0, numel)
        positions = np.clip(rng.normal(centre, 1 + numel / 100, count), 0, numel - 1)
    elif shape == "one_spot":
        positions = np.full(count, rng.integers(0, numel))
    else:
        positions = rng.choice(np.array([0, numel - 1]), count)
    positions = np.unique(positions.astype(np.int64))  # a rank's selection: distinct, sorted
    return positions, numel, world_size, bins, seed


@FAST
@given(histograms())
def test_balanced_boundaries_cover_and_balance(case):
    positions, numel, world_size, bins, seed = case
    hist = TORCH.position_histogram(_torch(positions), numel, bins)
    expected = np.bincount(positions * bins // numel, minlength=bins)
    assert hist.dtype == torch.int32
    np.testing.assert_array_equal(hist.numpy(), expected)
    hist_tf = TF.position_histogram(tf.constant(positions), numel, bins)
    assert hist_tf.dtype == tf.int32
    np.testing.assert_array_equal(hist_tf.numpy(), expected)
    counts = hist.tolist()

    b = balanced_boundaries(counts, numel, world_size)
    _check_boundaries(b, numel, world_size)
    _check_single_owner(b, numel, np.random.default_rng(seed))
    total = len(positions)
    if total == 0:
        assert b == UniformPartition().boundaries(numel, world_size)
        return
    bin_edges = {-(-i * numel // bins) for i in range(bins + 1)}  # where bins begin
    biggest = max(counts)
    for j in range(1, world_size):
        assert b[j] in bin_edges  # cut on a bin edge
        # Selected rows owned by ranks < j: within half a bin of their equal share.
        left = int(np.searchsorted(positions, b[j]))
        assert abs(left - total * j / world_size) <= biggest / 2 + 1e-9 * total


def test_balanced_cut_falls_where_the_histogram_bin_begins():
    """n = 3, B = 2: position_histogram puts positions {0, 1} in bin 0 (p*B//n = 0) and {2}
    in bin 1; balanced_boundaries cuts after bin 0 for P = 2, so the cut must fall at 2,
    where bin 1 begins (it once fell at 1*3//2 = 1)."""
    positions = np.array([0, 1, 2])
    counts = TORCH.position_histogram(_torch(positions), 3, 2).tolist()
    assert counts == [2, 1]
    assert balanced_boundaries(counts, 3, 2) == [0, 2, 3]


@st.composite
def routed_indices(draw):
    """(ascending distinct bucket-local indices, boundaries): the reduce-scatter's input."""
    numel = draw(st.integers(1, 5000))
    world_size = draw(st.integers(1, 16))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(0, numel))
    indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    if draw(st.booleans()):
        b = UniformPartition().boundaries(numel, world_size)
    else:  # a balanced cut, possibly with empty regions
        bins = max(1, min(numel, 4 * world_size))
        counts = np.bincount(indices * bins // numel, minlength=bins).tolist()
        b = balanced_boundaries(counts, numel, world_size)
    return indices, b


@FAST
@given(routed_indices())
def test_region_counts_and_offsets_route_each_row_to_its_owner(case):
    indices, b = case
    world_size = len(b) - 1
    expected_counts = [int(((indices >= lo) & (indices < hi)).sum()) for lo, hi in zip(b, b[1:])]
    expected_offsets = np.array(
        [next(lo for lo, hi in zip(b, b[1:]) if lo <= i < hi) for i in indices.tolist()],
        dtype=np.int64,
    )
    for ops, wrap in ((TORCH, _torch), (TF, tf.constant)):
        counts = ops.region_counts(wrap(indices), b)
        counts = counts if isinstance(counts, list) else counts.numpy().tolist()
        assert counts == expected_counts and len(counts) == world_size
        offsets = ops.region_offsets(wrap(indices), b)
        np.testing.assert_array_equal(np.asarray(offsets), expected_offsets.reshape(-1))
        values = wrap(np.arange(len(indices), dtype=np.float32))
        rows = np.asarray(ops.pack_rows(wrap(indices), offsets, values))
        local = rows[:, :4].copy().view(np.int32).reshape(-1)
        np.testing.assert_array_equal(local.astype(np.int64) + expected_offsets, indices)


# ---------------------------------------------------------------- 3. local selection

KINDS = ["normal", "ties", "sparse", "constant", "zeros", "heavy", "tiny", "signed_zeros"]


def _values(kind: str, n: int, seed: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        v = rng.standard_normal(n)
    elif kind == "ties":  # few distinct magnitudes, many zeros
        v = rng.integers(-3, 4, n).astype(np.float64)
    elif kind == "sparse":
        v = rng.standard_normal(n) * (rng.random(n) < 0.01)
    elif kind == "constant":
        v = np.full(n, rng.choice([1.5, -2.0]))
    elif kind == "zeros":
        v = np.zeros(n)
    elif kind == "heavy":  # Cauchy: fp16 overflows to inf
        v = rng.standard_cauchy(n) * 1e3
    elif kind == "tiny":  # subnormal in fp32, zero in fp16
        v = rng.standard_normal(n) * 1e-40
    else:
        v = rng.choice([0.0, -0.0, 1.0, -1.0], n)
    with np.errstate(over="ignore"):
        return v.astype(dtype)


@st.composite
def accumulators(draw):
    n = draw(st.one_of(st.integers(1, 64), st.integers(1, 50000)))
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float64, np.float16]))
    k = draw(st.one_of(st.integers(1, n), st.sampled_from([1, n, max(1, n // 100)])))
    return _values(kind, n, draw(st.integers(0, 2**32 - 1)), dtype), k


def _check_dominates(values: np.ndarray, selected: np.ndarray) -> None:
    """Distinct, ascending, in range; every selected |v| >= every unselected |v|."""
    n = len(values)
    assert selected.dtype == np.int64
    assert np.all(np.diff(selected) > 0)  # ascending and distinct
    assert len(selected) == 0 or (selected[0] >= 0 and selected[-1] < n)
    chosen = np.zeros(n, dtype=bool)
    chosen[selected] = True
    magnitude = np.abs(values.astype(np.float64))
    if chosen.any() and not chosen.all():
        assert magnitude[chosen].min() >= magnitude[~chosen].max()


@FAST
@given(accumulators())
def test_exact_selection_is_the_top_k(case):
    values, k = case
    selected = ExactSelection().select(TORCH, _torch(values), k).numpy()
    assert len(selected) == k
    _check_dominates(values, selected)
    magnitude = np.sort(np.abs(values.astype(np.float64)))
    assert np.abs(values[selected].astype(np.float64)).min() == magnitude[len(values) - k]


@settings(FAST, max_examples=100)
@given(
    n=st.one_of(st.integers(2, 64), st.integers(2, 50000), st.integers(5000, 50000)),
    # Typical densities too: with a sampled threshold they land on both sides of k.
    k_fraction=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.001, 0.01, 0.1, 0.3])),
    steps=st.lists(
        st.tuples(st.sampled_from(KINDS), st.integers(0, 2**32 - 1), st.sampled_from([1, 1e-3])),
        min_size=1,
        max_size=4,
    ),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    reestimate_steps=st.integers(1, 10),
    sample_size=st.sampled_from([8, 100, 1000, 1 << 16]),
    sample_rank=st.sampled_from([1, 16, 256]),
)
def test_threshold_selection_count_stays_in_band(
    n, k_fraction, steps, dtype, reestimate_steps, sample_size, sample_rank
):
    k = max(1, min(n, round(k_fraction * n)))
    selection = ThresholdSelection(
        reestimate_steps=reestimate_steps, sample_size=sample_size, sample_rank=sample_rank
    )
    low, high = selection.band
    for kind, seed, scale in steps:  # one instance: later calls reuse the threshold
        with np.errstate(over="ignore"):  # fp16: large magnitudes become inf
            values = (_values(kind, n, seed, np.float64) * scale).astype(dtype)
        selected = selection.select(TORCH, _torch(values), k).numpy()
        if k == n:
            np.testing.assert_array_equal(selected, np.arange(n))
        else:  # "So the count is always within the band."
            assert low * k <= len(selected) <= high * k, (len(selected), k)
        _check_dominates(values, selected)


# ---------------------------------------------------------------- 4. owner reduction

WIRES = {  # name: (wire dtype, bucket dtype)
    "fp32": (np.float32, np.float32),
    "fp16_wire": (np.float16, np.float32),  # Horovod's FP16 compression, decoded to fp32
    "fp64": (np.float64, np.float64),
}


@st.composite
def received_rows(draw):
    """What one owner receives: each rank's distinct sorted region-local rows, rank order."""
    ranks = draw(st.integers(1, 8))
    region = draw(st.one_of(st.integers(1, 50), st.integers(1, 20000), st.just(2**31 - 1)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    wire, bucket = WIRES[draw(st.sampled_from(sorted(WIRES)))]
    parts_idx, parts_val = [], []
    for _ in range(ranks):
        count = draw(st.integers(0, min(region, 500)))
        if region <= 50:
            idx = rng.integers(0, region, count)  # dense: many duplicates across ranks
        else:
            hot = rng.integers(0, region, 8)  # a few indices most ranks select
            idx = np.concatenate([rng.integers(0, region, count), rng.choice(hot, count // 4)])
        idx = np.unique(idx).astype(np.int32)
        scale = rng.choice([1.0, 1e-3, 1e3])
        val = (rng.standard_normal(len(idx)) * scale).astype(wire)
        val[rng.random(len(idx)) < 0.05] = -0.0
        parts_idx.append(idx)
        parts_val.append(val)
    idx = np.concatenate(parts_idx)
    val = np.concatenate(parts_val)
    return _numpy_rows(idx, val), idx, val, bucket, [len(part) for part in parts_idx]


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@FAST
@given(received_rows())
def test_owner_reduce_matches_numpy_add_at(framework, case):
    rows, idx, val, bucket, runs = case
    wire = val.dtype
    if framework == "torch":
        ops, wrap = TORCH, _torch

        def decode(w):
            return w.to(getattr(torch, np.dtype(bucket).name))

    else:
        ops, wrap = TF, tf.constant

        def decode(w):
            return tf.cast(w, np.dtype(bucket).name)

    def reduce(received_splits):
        reduced = owner_reduce(
            ops, wrap(rows), wrap(np.zeros(0, wire)), wrap(np.zeros(3, bucket)), decode,
            received_splits,
        )  # fmt: skip
        return tuple(np.asarray(part) for part in reduced)

    got_idx, got_sum = reduce(None)
    # Told each rank's run (the alltoall's received splits), a backend may merge the runs
    # instead of sorting (TF does): the same indices and, added in the same row order,
    # the same sums bit for bit.
    merged_idx, merged_sum = reduce(runs if framework == "torch" else tf.constant(runs, tf.int32))
    np.testing.assert_array_equal(merged_idx, got_idx)
    np.testing.assert_array_equal(merged_sum.view(np.uint8), got_sum.view(np.uint8))

    expected_idx = np.unique(idx.astype(np.int64))
    expected_sum = np.zeros(len(expected_idx), dtype=np.float64)
    magnitude_sum = np.zeros(len(expected_idx), dtype=np.float64)
    where = np.searchsorted(expected_idx, idx)
    np.add.at(expected_sum, where, val.astype(np.float64))
    np.add.at(magnitude_sum, where, np.abs(val.astype(np.float64)))

    np.testing.assert_array_equal(got_idx, expected_idx)
    assert got_sum.dtype == np.dtype(bucket)
    assert np.all(np.abs(got_sum - expected_sum) <= 1e-6 * magnitude_sum)


# ---------------------------------------------------------------- 5. global selection


class _Lockstep(TorchBackend):
    """P owners in threads; ``allreduce_sum_async`` sums what all P contributed."""

    def __init__(self, owners: int) -> None:
        self.barrier = threading.Barrier(owners, timeout=30)
        self.lock = threading.Lock()
        self.sent: dict[str, list[torch.Tensor]] = {}

    def allreduce_sum_async(self, tensor, name, process_set):
        with self.lock:
            self.sent.setdefault(name, []).append(tensor.clone())
        self.barrier.wait()
        return torch.stack(self.sent[name]).sum(0)

    def wait(self, handle):
        return handle


@FEWER
@given(
    owners=st.integers(1, 4),
    sizes=st.lists(st.integers(0, 3000), min_size=4, max_size=4),
    kinds=st.lists(st.sampled_from(KINDS), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    k_fraction=st.floats(0.0, 1.2),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
)
def test_global_threshold_key_is_kth_largest_key_of_all_owners(
    owners, sizes, kinds, seed, k_fraction, dtype
):
    values = [_values(kinds[r], sizes[r], seed + r, dtype) for r in range(owners)]
    total = sum(len(v) for v in values)
    k = max(1, round(k_fraction * total))

    # magnitude_keys: int32 keys ordered like |values| (the fp32 magnitude bits).
    everything = np.concatenate(values)
    with np.errstate(over="ignore"):
        expected_keys = np.abs(everything).astype(np.float32).view(np.int32)
    keys = [TORCH.magnitude_keys(_torch(v)) for v in values]
    np.testing.assert_array_equal(torch.cat(keys).numpy(), expected_keys)
    by_magnitude = np.argsort(np.abs(everything.astype(np.float64)), kind="stable")
    assert np.all(np.diff(expected_keys[by_magnitude].astype(np.int64)) >= 0)

    ops = _Lockstep(owners)
    results: list = [None] * owners

    def owner(r):
        try:
            results[r] = int(global_threshold_key(ops, keys[r], k, "bucket", None))
        except BaseException as error:  # reported below, not lost in the thread
            results[r] = error
            ops.barrier.abort()

    threads = [threading.Thread(target=owner, args=(r,)) for r in range(owners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert len(set(results)) == 1  # every owner cuts at the same key
    threshold = results[0]
    if k <= total:
        assert threshold == np.sort(expected_keys)[total - k]
        assert (expected_keys >= threshold).sum() >= k > (expected_keys > threshold).sum()
    else:  # fewer than k entries over all owners: all are kept
        assert np.all(expected_keys >= threshold)
