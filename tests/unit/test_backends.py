"""Every primitive and the whole single-rank pipeline, on both backends, against NumPy.

One process, no Horovod collectives: a one-rank fake process set and identity
collectives stand in, so these tests exercise the kernels and the stage logic alone.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from horovod_sparse.common.backend import Backend
from horovod_sparse.common.config import SparseConfig, budget
from horovod_sparse.common.global_selection import global_threshold_key
from horovod_sparse.common.pipeline import BucketReducer
from tests.reference import reference_step, uniform_boundaries


class OneRank:
    """Stands in for a Horovod process set of one rank."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _torch_backend():
    import torch

    from horovod_sparse.torch.backend import TorchBackend

    class Local(TorchBackend):
        def alltoall_async(self, rows, splits, name, process_set):
            return rows, list(splits)

        def allgather_async(self, rows, name, process_set):
            return rows

        def allreduce_sum_async(self, tensor, name, process_set):
            return tensor

        def allreduce_sum_inplace_async(self, tensor, name, process_set):
            return tensor

        def wait(self, handle):
            return handle

    return Local(), (lambda a: torch.from_numpy(np.ascontiguousarray(a))), (lambda t: t.numpy())


def _tf_backend():
    import tensorflow as tf

    from horovod_sparse.tensorflow.backend import TFBackend

    class Local(TFBackend):
        def alltoall_async(self, rows, splits, name, process_set):
            return rows, splits

        def allgather_async(self, rows, name, process_set):
            return rows

        def allreduce_sum_async(self, tensor, name, process_set):
            return tensor

    return Local(), tf.constant, (lambda t: t.numpy())


@pytest.fixture(params=["torch", "tensorflow", "tensorflow-host-pass"])
def backend(request, monkeypatch):
    if request.param == "torch":
        return _torch_backend()
    import horovod_sparse.tensorflow.kernels as tf_kernels

    # TF's candidate pass in its own ops, or in NumPy on the host (what a CPU-only
    # process at one or two threads runs): every test runs both.
    monkeypatch.setattr(tf_kernels, "HOST_PASS", request.param == "tensorflow-host-pass")
    return _tf_backend()


def _traced_too(ops, function, *args):
    """``function(*args)``, and under TF also the same traced in a ``tf.function``."""
    results = [function(*args)]
    if "TFBackend" in {cls.__name__ for cls in type(ops).__mro__}:
        import tensorflow as tf

        results.append(tf.function(function)(*args))
    return results


def test_adapters_implement_every_primitive():
    from horovod_sparse.tensorflow.backend import TFBackend
    from horovod_sparse.torch.backend import TorchBackend
    from horovod_sparse.torch.distributed import DistributedBackend

    required = {n for n, _ in inspect.getmembers(Backend) if not n.startswith("_")}
    for cls in (TorchBackend, DistributedBackend, TFBackend):
        missing = sorted(n for n in required if not callable(getattr(cls, n, None)))
        assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("count", [0, 1, 50])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_pack_unpack_round_trip(backend, dtype, count):
    ops, to, back = backend
    rng = np.random.default_rng(0)
    indices = np.sort(rng.choice(1000, count, replace=False)).astype(np.int64)
    values = rng.standard_normal(count).astype(dtype)
    rows = ops.pack_rows(to(indices), 7, to(values))
    width = 4 + np.dtype(dtype).itemsize
    assert back(rows).dtype == np.uint8 and back(rows).shape == (count, width)
    # Little-endian int32 index bytes, then the value's bytes, row by row.
    expected = np.concatenate(
        [
            (indices - 7).astype("<i4").view(np.uint8).reshape(count, 4),
            values.view(np.uint8).reshape(count, width - 4),
        ],
        axis=1,
    )
    np.testing.assert_array_equal(back(rows), expected)
    got_idx, got_val = ops.unpack_rows(rows, to(values))
    np.testing.assert_array_equal(back(got_idx), indices - 7)
    np.testing.assert_array_equal(back(got_val), values)
    if count > 1:  # the rows from the second on, as a joined exchange hands them over
        got_idx, got_val = ops.unpack_rows(rows[1:], to(values))
        np.testing.assert_array_equal(back(got_idx), indices[1:] - 7)
        np.testing.assert_array_equal(back(got_val), values[1:])
    if "TorchKernels" in {cls.__name__ for cls in type(ops).__mro__}:
        import torch

        # Rows at an odd byte offset: no int32 view of them, the bytewise path.
        shifted = torch.zeros(count * width + 1, dtype=torch.uint8)
        shifted[1:] = rows.reshape(-1)
        got_idx, got_val = ops.unpack_rows(shifted[1:].view(count, width), to(values))
        np.testing.assert_array_equal(back(got_idx), indices - 7)
        np.testing.assert_array_equal(back(got_val), values)


def test_regions(backend):
    ops, to, back = backend
    boundaries = [0, 10, 25, 40]
    indices = np.array([0, 3, 9, 10, 24, 30, 39], dtype=np.int64)
    counts = ops.region_counts(to(indices), boundaries)
    counts = back(counts).tolist() if not isinstance(counts, list) else counts
    assert counts == [3, 2, 2]
    offsets = back(ops.region_offsets(to(indices), boundaries))
    np.testing.assert_array_equal(offsets, [0, 0, 0, 10, 10, 25, 25])


@pytest.mark.parametrize(("offset", "numel"), [(0, 40), (0, 13), (9, 13), (27, 13)])
def test_add_scaled_at_adds_a_slice_and_leaves_the_rest(backend, offset, numel):
    ops, to, back = backend
    rng = np.random.default_rng(offset + numel)
    buffer = rng.standard_normal(40).astype(np.float32)
    tensor = rng.standard_normal(numel).astype(np.float32)
    want = buffer.copy()
    want[offset : offset + numel] += np.float32(0.5) * tensor
    got = back(ops.add_scaled_at_(to(buffer.copy()), offset, to(tensor), 0.5))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_adam_direction_is_normalized_for_the_average_of_the_ranks(backend, ranks):
    """Adam's own direction at one rank; for P ranks, the second moment of the average:
    unchanged where the signal dominates (m_hat^2 >= v_hat), sqrt(P) times Adam's
    where the first moment is zero (noise alone)."""
    from horovod_sparse.common.correction import adam_direction

    ops, to, back = backend
    betas, eps, step = (0.9, 0.999), 1e-8, 10_000  # bias corrections near 1
    rng = np.random.default_rng(ranks)
    first = rng.standard_normal(64).astype(np.float32)
    second = (rng.random(64).astype(np.float32) + 0.1) * first * first  # from 0.1 to 1.1 m^2
    first[:8] = 0.0  # noise alone
    grad = rng.standard_normal(64).astype(np.float32)
    got, new_first, new_second = adam_direction(
        ops, to(grad), to(first.copy()), to(second.copy()), betas, eps, step, ranks
    )
    m = (betas[0] * first + (1 - betas[0]) * grad).astype(np.float64)
    v = (betas[1] * second + (1 - betas[1]) * grad * grad).astype(np.float64)
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    averaged = v_hat / ranks + (1 - 1 / ranks) * np.minimum(m_hat * m_hat, v_hat)
    want = m_hat / (np.sqrt(averaged) + eps)
    np.testing.assert_allclose(back(got), want, rtol=1e-5)  # float32 against float64
    np.testing.assert_allclose(back(new_first), m, rtol=1e-5)
    np.testing.assert_allclose(back(new_second), v, rtol=1e-5)
    adam = m_hat / (np.sqrt(v_hat) + eps)
    signal = m_hat * m_hat >= v_hat
    assert signal.any() and (~signal).any()
    np.testing.assert_allclose(back(got)[signal], adam[signal], rtol=1e-5)
    # A first moment far below the second's root (noise dominates): sqrt(P) times Adam's.
    small, large = np.full(16, 1e-3, np.float32), np.ones(16, np.float32)
    noisy = [
        back(
            adam_direction(ops, to(small), to(0 * small), to(large.copy()), (0, 0.999), 0, 1, n)[0]
        )
        for n in (1, ranks)  # fresh moments each time: torch updates them in place
    ]
    np.testing.assert_allclose(noisy[1] / noisy[0], np.sqrt(ranks), rtol=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_indices_at_least_take_the_edges_infinities_and_nan(backend, dtype):
    ops, to, back = backend
    values = np.array([0.5, 1.0, -1.0, 0.999, -0.999, np.nan, np.inf, -np.inf, 2.0, 0.0])
    values = values.astype(dtype)
    for got in _traced_too(ops, ops.indices_at_least, to(values), to(np.array(1.0, dtype))):
        np.testing.assert_array_equal(back(got), [1, 2, 5, 6, 7, 8])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        (0.0, list(range(10))),
        (-0.0, list(range(10))),
        (-1.0, list(range(10))),
        (np.nan, list(range(10))),  # (-NaN, NaN) holds no value
        (np.inf, [5, 6, 7]),
    ],
)
def test_indices_at_least_with_zero_negative_infinite_and_nan_thresholds(
    backend, dtype, threshold, expected
):
    ops, to, back = backend
    values = np.array([0.5, 1.0, -1.0, 0.999, -0.999, np.nan, np.inf, -np.inf, 2.0, -0.0])
    args = to(values.astype(dtype)), to(np.array(threshold, dtype))
    for got in _traced_too(ops, ops.indices_at_least, *args):
        np.testing.assert_array_equal(back(got), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("hits", [[0, 4, 6], [1, 2, 3, 4, 6], [5]])
def test_zero_at_zeroes_every_hit_entry_inf_and_nan_included_and_keeps_the_rest(
    backend, dtype, hits
):
    ops, to, back = backend
    values = np.array([1.5, np.nan, np.inf, -np.inf, -0.0, 2.0, -3.25, 7.0]).astype(dtype)
    indices = np.array(hits, dtype=np.int64)
    expected = values.copy()
    expected[indices] = 0.0  # +0, also where -0 was
    results = [back(ops.zero_at(to(values.copy()), to(indices)))]
    if "TFBackend" in {cls.__name__ for cls in type(ops).__mro__}:
        import tensorflow as tf

        # Traced, the inf/NaN branch is a tf.cond.
        results.append(back(tf.function(ops.zero_at)(to(values), to(indices))))
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    for got in results:
        np.testing.assert_array_equal(got.view(bits), expected.view(bits))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan])
def test_zero_then_add_leaves_the_bits_of_zero_at_then_each_add_in_turn(backend, dtype, special):
    ops, to, back = backend
    rng = np.random.default_rng(3)
    values = rng.standard_normal(64).astype(dtype)
    values[[5, 9]] = -0.0
    zeroed = np.array([2, 5, 9, 17, 40, 41], dtype=np.int64)
    if special is not None:
        values[17] = special  # a sent entry that does not cancel by subtraction
    # Duplicates within and across the adds, over zeroed and untouched entries alike;
    # then repeats across the adds only (one add's positions distinct, as the protocol
    # says), which a residual kept in its variable takes too (residual_variable.py).
    within = np.array([2, 3, 40, 3], dtype=np.int64)
    across = np.array([2, 3, 40, 7], dtype=np.int64)
    second = np.array([41, 3, 2, 63], dtype=np.int64)
    added = [rng.standard_normal(4).astype(dtype) for _ in range(2)]
    is_tf = "TFBackend" in {cls.__name__ for cls in type(ops).__mro__}

    def run(buffer, sent, held, *flat):
        pairs = list(zip(flat[0::2], flat[1::2]))
        return ops.zero_then_add(buffer, sent, held, pairs)

    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    held = to(values[zeroed])  # as the step takes them before it sends them
    for first, in_variable in ((within, False), (across, is_tf)):
        adds = [(first, added[0]), (second, added[1])]
        expected = values.copy()
        expected[zeroed] = 0.0
        for indices, increments in adds:
            for index, value in zip(indices, increments):
                expected[index] += value
        flat = [to(array) for pair in adds for array in pair]
        for got in _traced_too(ops, run, to(values.copy()), to(zeroed), held, *flat):
            np.testing.assert_array_equal(back(got).view(bits), expected.view(bits))
        if in_variable:
            import tensorflow as tf

            for traced in (False, True):
                variable = tf.Variable(values)
                step = tf.function(run) if traced else run
                step(variable, to(zeroed), held, *flat)
                np.testing.assert_array_equal(variable.numpy().view(bits), expected.view(bits))


@pytest.mark.parametrize(
    ("numel", "size", "offset"), [(100, 10, 3), (103, 10, 12), (7, 7, 5), (262144, 25600, 9)]
)
def test_strided_sample_abs_takes_every_strideth_magnitude_from_the_offset(
    backend, numel, size, offset
):
    ops, to, back = backend
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    stride = max(1, numel // size)
    want = np.abs(values[offset % stride :: stride][:size])
    assert len(want) == size
    np.testing.assert_array_equal(back(ops.strided_sample_abs(to(values), size, offset)), want)


def test_threshold_sample_holds_about_sample_rank_entries_above_the_kth():
    from horovod_sparse.common.selection import ThresholdSelection

    selection = ThresholdSelection(sample_size=1 << 16, sample_rank=256)
    assert selection.sample_length(262144, 2622) == 25595  # ceil(256 * 262144 / 2622)
    assert selection.sample_length(16 << 20, 167773) == 25600
    assert selection.sample_length(16 << 20, 16777) == 1 << 16  # the cap
    assert selection.sample_length(1000, 10) == 1000  # the whole bucket
    assert selection.sample_length(1000, object()) == 1000  # a graph budget: the cap


def test_topk_indices_match_numpy(backend):
    ops, to, back = backend
    values = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    got = back(ops.topk_indices(to(values), 50))
    np.testing.assert_array_equal(got, np.sort(np.argsort(-np.abs(values))[:50]))
    np.testing.assert_array_equal(back(ops.topk_indices(to(values[:10]), 10)), np.arange(10))


@pytest.mark.parametrize("k", [1, 37, 999, 1000, 5000])
def test_radix_select_finds_kth_magnitude(backend, k):
    ops, to, back = backend
    values = np.random.default_rng(k).standard_normal(1000).astype(np.float32) * 1e-3
    values[::7] *= 1e4  # many decades of magnitude
    keys = ops.magnitude_keys(to(values))
    threshold = global_threshold_key(ops, keys, k, "t", OneRank())
    kept = back(ops.mask_at_least(keys, threshold))
    expected = np.abs(values) >= (np.sort(np.abs(values))[-k] if k <= 1000 else 0)
    np.testing.assert_array_equal(kept, expected)
    assert kept.sum() == min(k, 1000)


BACKENDS = {"torch": _torch_backend, "tensorflow": _tf_backend}


@pytest.mark.parametrize("density", [0.01, 0.2, 1.0])
@pytest.mark.parametrize(
    "framework,selection",
    [
        ("torch", "exact"),
        ("torch", "threshold"),
        ("tensorflow", "exact"),
        ("tensorflow", "threshold"),
    ],
)
def test_single_rank_pipeline_matches_reference(framework, selection, density):
    ops, to, back = BACKENDS[framework]()
    numel = 3000
    like = to(np.zeros(0, np.float32))
    config = SparseConfig(density=density, selection=selection)
    reducer = BucketReducer(ops, "b", numel, like, config, OneRank())
    before = np.zeros(numel, np.float32)
    rng = np.random.default_rng(5)
    k = budget(numel, density)
    for _ in range(3):
        grad = rng.standard_normal(numel).astype(np.float32)
        inflight = reducer.reduce_and_gather(reducer.start(to(grad)))
        got = back(reducer.finish(inflight, like))
        # A threshold selection is the top-c entries for its own count c in [0.8k, 1.25k]:
        # the reference with budget c must agree exactly.
        count = int(np.count_nonzero(got)) if selection == "threshold" else k
        assert 0.8 * k <= count <= 1.25 * k
        expected = reference_step([before + grad], count, uniform_boundaries(numel, 1))
        np.testing.assert_allclose(got, expected.result_sum, rtol=1e-6)
        before = back(reducer.residual).copy()
        np.testing.assert_allclose(before, expected.residuals[0], rtol=1e-6)
        np.testing.assert_allclose(before + got, expected.residuals[0] + expected.result_sum)
    stats = reducer.last_stats()
    assert stats.selected == count and stats.bytes_sent == 0  # one rank


def test_fp16_values_clamp_to_fp16_range_and_the_excess_stays_behind():
    import torch

    from horovod_sparse.torch.distributed import DistributedBackend, FP16Values

    values = torch.tensor([1e6, -1e6, 1.0, 0.1], dtype=torch.float32)
    wire, ctx, lost = DistributedBackend().compress(values, FP16Values)
    assert wire.dtype == torch.float16 and torch.isfinite(wire).all()
    back = DistributedBackend().decompress(wire, ctx)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back + lost, values, rtol=0, atol=0)  # nothing dropped
    assert float(lost[0]) == 1e6 - 65504.0 and float(lost[2]) == 0.0


@pytest.mark.parametrize("fraction", [0.5, 0.8, 0.95])
def test_extrapolate_key_finds_the_kth_magnitude_below_the_rows_held(backend, fraction):
    """The reused global threshold's correction when fewer than k rows came back: from
    the top ``fraction * k`` magnitudes of a Gaussian sample, the key that keeps about
    k. Scaling the magnitude by count / k instead (the count taken as proportional to
    it) keeps several times k at 0.5."""
    ops, to, back = backend
    rng = np.random.default_rng(3)
    magnitudes = np.sort(np.abs(rng.standard_normal(1 << 20)).astype(np.float32))[::-1]
    k = 10_000
    held = magnitudes[: int(fraction * k)].copy()
    keys = ops.magnitude_keys(to(held))
    count = held.size
    key = ops.extrapolate_key(
        ops.kth_largest(keys, count), ops.kth_largest(keys, count // 2), count, k
    )
    threshold = np.asarray(back(key)).astype(np.int32).view(np.float32)
    kept = int((magnitudes >= threshold).sum())
    assert 0.9 * k <= kept <= 1.1 * k, kept


def test_tf_unique_inverse_merges_known_runs_and_sorts_when_their_number_is_unknown():
    import tensorflow as tf

    from horovod_sparse.tensorflow import row_sums

    runs = [np.array([1, 4, 9]), np.array([], dtype=np.int64), np.array([0, 4, 5, 9, 12])]
    indices = np.concatenate(runs).astype(np.int64)
    lengths = np.array([len(run) for run in runs], dtype=np.int32)
    expected_distinct, expected_position = np.unique(indices, return_inverse=True)
    unknown = tf.function(
        row_sums.unique_inverse,
        input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int32)],
    )
    for distinct, position in (
        row_sums.unique_inverse(tf.constant(indices), tf.constant(lengths)),
        unknown(tf.constant(indices), tf.constant(lengths)),
    ):
        np.testing.assert_array_equal(distinct.numpy(), expected_distinct)
        np.testing.assert_array_equal(position.numpy(), expected_position)


def test_torch_unique_inverse_is_numpys_unique_on_the_host_path_and_on_torchs(monkeypatch):
    """At up to HOST_PASS_THREADS threads a CPU owner's received indices go through
    NumPy's stable sort, above through torch.unique: both give np.unique's answer."""
    import torch

    from horovod_sparse.common import host_candidates
    from horovod_sparse.torch import kernels as kernels_module
    from horovod_sparse.torch.kernels import TorchKernels

    host_calls: list[int] = []

    def counted(indices):
        host_calls.append(indices.size)
        return host_candidates.numpy_unique_inverse(indices)

    monkeypatch.setattr(kernels_module, "numpy_unique_inverse", counted)
    rng = np.random.default_rng(3)
    overlapping = [np.sort(rng.choice(400, n, replace=False)) for n in (150, 0, 220, 90)]
    cases = [
        (np.concatenate(overlapping), [len(run) for run in overlapping]),
        (rng.integers(0, 50, 300), None),  # unordered, repeated
        (np.array([7, 7, 7]), [1, 1, 1]),
        (np.array([5]), [1]),
        (np.zeros(0, np.int64), [0, 0]),
    ]
    kernels = TorchKernels()
    before = torch.get_num_threads()
    try:
        for threads, host in ((1, True), (host_candidates.HOST_PASS_THREADS + 1, False)):
            torch.set_num_threads(threads)
            host_calls.clear()
            for indices, runs in cases:
                expected_distinct, expected_position = np.unique(indices, return_inverse=True)
                distinct, position = kernels.unique_inverse(
                    torch.from_numpy(indices.astype(np.int64)), runs
                )
                assert (distinct.dtype, position.dtype) == (torch.int64, torch.int64)
                np.testing.assert_array_equal(distinct.numpy(), expected_distinct)
                np.testing.assert_array_equal(position.numpy(), expected_position.ravel())
            assert len(host_calls) == (len(cases) if host else 0), (threads, host_calls)
    finally:
        torch.set_num_threads(before)


def test_kth_largest_of_keys_and_of_values_on_every_path(backend):
    """The global selection's int32 keys and a float sample, fp32 and fp16, ties among
    them (under torch NumPy's partition on the host, torch.topk otherwise): the k-th
    largest, ties counted, traced too under TF."""
    import torch

    from horovod_sparse.common import host_candidates

    ops, to, back = backend
    rng = np.random.default_rng(5)
    distinct = rng.permutation(1001).astype(np.int32)
    tied = rng.integers(0, 300, 1001).astype(np.int32)
    values = rng.standard_normal(513).astype(np.float32)
    values[[5, 6, 7]] = values[8]
    cases = [(keys, k) for keys in (distinct, tied) for k in (1, 2, 500, 1000, 1001)]
    cases += [
        (sample, k) for sample in (values, values.astype(np.float16)) for k in (1, 2, 3, 77, 513)
    ]
    torch_threads = [1, host_candidates.HOST_PASS_THREADS + 1]  # NumPy, then torch.topk
    torch_backend = "TorchKernels" in {cls.__name__ for cls in type(ops).__mro__}
    before = torch.get_num_threads()
    try:
        for threads in torch_threads if torch_backend else [None]:
            if threads is not None:
                torch.set_num_threads(threads)
            for array, k in cases:
                expected = np.sort(array)[::-1][k - 1]
                for kth in _traced_too(ops, ops.kth_largest, to(array), k):
                    got = np.asarray(back(kth))
                    assert got.shape == () and got.dtype == array.dtype, (got.shape, got.dtype)
                    assert got == expected, (threads, k, got, expected)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kept", [0.0, 0.5, 0.9, 1.0])
def test_split_by_mask_keeps_and_drops_in_order_on_every_path(backend, kept, monkeypatch):
    """The rows whose flag is set, then the others, each in their order, for every
    tensor passed: under torch through NumPy's flatnonzero (one or two threads) and
    torch's nonzero (more); traced too under TF."""
    ops, to, back = backend
    rng = np.random.default_rng(int(100 * kept))
    flags = rng.random(1003) < kept
    indices, values = rng.integers(0, 1 << 20, 1003), rng.standard_normal(1003)

    def split(mask, first, second):
        return ops.split_by_mask(mask, first, second)

    torch_backend = "TorchKernels" in {cls.__name__ for cls in type(ops).__mro__}
    for host_threads in [0, 1 << 10] if torch_backend else [None]:
        if host_threads is not None:  # torch's nonzero (0), NumPy's on the host
            import horovod_sparse.torch.candidates as candidates

            monkeypatch.setattr(candidates, "_NUMPY_CANDIDATE_THREADS", host_threads)
        for kept_rows, dropped_rows in _traced_too(ops, split, to(flags), to(indices), to(values)):
            for got, expected in zip(
                kept_rows + dropped_rows,
                (indices[flags], values[flags], indices[~flags], values[~flags]),
            ):
                np.testing.assert_array_equal(back(got), expected)


@pytest.mark.parametrize("count", [0, 1, 50])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_pack_unpack_with_an_offset_per_row_eagerly_and_traced(backend, dtype, count):
    """Rows packed with each row's own region offset (a tensor, as a partition cuts
    them) read back bit for bit, traced too under TF (where the host packing runs in a
    ``tf.numpy_function``)."""
    ops, to, back = backend
    rng = np.random.default_rng(count)
    indices = np.sort(rng.choice(1000, count, replace=False)).astype(np.int64)
    offsets = np.where(indices >= 500, 500, 0).astype(np.int64)
    values = rng.standard_normal(count).astype(dtype)

    def round_trip(positions, starts, entries):
        return ops.unpack_rows(ops.pack_rows(positions, starts, entries), entries)

    for got_idx, got_val in _traced_too(ops, round_trip, to(indices), to(offsets), to(values)):
        np.testing.assert_array_equal(back(got_idx), indices - offsets)
        np.testing.assert_array_equal(back(got_val).view(np.uint8), values.view(np.uint8))


@pytest.mark.parametrize("count", [0, 1, 50])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_scatter_into_writes_the_entries_over_zeros_and_leaves_earlier_results(
    backend, dtype, count
):
    """Zeros with the values at the indices, in the bucket's dtype and length (traced
    too under TF, where the host path hands NumPy's memory to TF); a second scatter
    leaves the first result as it was."""
    ops, to, back = backend
    rng = np.random.default_rng(count)
    like = to(np.zeros(0, dtype))
    results = []
    for draw in range(2):
        indices = np.sort(rng.choice(1000, count, replace=False)).astype(np.int64)
        values = (rng.standard_normal(count) + draw).astype(np.float64)  # cast to dtype
        expected = np.zeros(1000, dtype)
        expected[indices] = values.astype(dtype)

        def scatter(positions, entries):
            return ops.scatter_into(1000, like, positions, entries)

        for got in _traced_too(ops, scatter, to(indices), to(values)):
            assert back(got).dtype == dtype and tuple(got.shape) == (1000,)
            np.testing.assert_array_equal(back(got), expected)
            results.append((got, expected))
    for got, expected in results:
        np.testing.assert_array_equal(back(got), expected)
