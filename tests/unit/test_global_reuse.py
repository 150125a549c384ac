"""The reused global threshold's rules, single process, against direct computation."""

import numpy as np
import pytest

from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.global_selection import (
    ReusedGlobalThreshold,
    global_threshold_key,
    grouped_threshold_keys,
)
from horovod_sparse.common.pipeline import BucketReducer
from tests.unit.test_backends import BACKENDS, OneRank, _tf_backend, _torch_backend


def key_of(value: float) -> int:
    return int(np.array([abs(value)], np.float32).view(np.int32)[0])


def test_next_threshold_is_the_kth_gathered_magnitude_or_the_tail_extended():
    ops, to, _ = _torch_backend()
    reuse = ReusedGlobalThreshold(refresh_steps=7)
    keys = ops.magnitude_keys(to(np.array([5.0, -4.0, 3.0, 2.0, 1.0], np.float32)))
    # Due at first: the radix select over one rank finds the exact 2nd largest, 4.0.
    exact = lambda: global_threshold_key(ops, keys, 2, "t", OneRank())  # noqa: E731
    assert int(reuse.threshold(ops, keys, 2, exact)) == key_of(4.0)
    assert reuse.refreshed
    # Gathered 3 >= k = 2 rows: the next key is the 2nd largest gathered magnitude.
    reuse.observe(ops, to(np.array([-7.0, 6.0, 0.5], np.float32)), 2, own_rows=3)
    assert int(reuse.key) == key_of(6.0)
    # 3 rows is above the cap's 1.25 k = 2.5, yet no refresh: the k-th key is known.
    assert not reuse.due
    # Gathered 2 < k = 4: the tail extended down to k rows. The count doubles every
    # (median key - lowest key) keys down: from 6.0 (lowest) and 8.0 (median), one
    # doubling, 2 -> 4 rows, lands on the key of 4.0 (keys of 4, 6 and 8 are evenly
    # spaced: 6 and 8 share an exponent, 4 is one exponent down at mantissa 0).
    reuse.observe(ops, to(np.array([-8.0, 6.0], np.float32)), 4, own_rows=2)
    assert int(reuse.key) == key_of(4.0)
    assert not reuse.due  # 2 rows is not below 0.25 k: the extended tail is used
    # 3 rows of k = 7 is below 0.5 k but not below 0.25 k: the extended tail is used.
    reuse.observe(ops, to(np.array([-8.0, 6.0, 5.0], np.float32)), 7, own_rows=3)
    assert not reuse.due
    # Below 0.25 k: refresh (3 rows of k = 13, tail extended all the same).
    reuse.observe(ops, to(np.array([-8.0, 6.0, 5.0], np.float32)), 13, own_rows=3)
    assert reuse.due
    # One row gives no tail to extend: the key stays, and the next step refreshes.
    reuse.due = False
    before = int(reuse.key)
    reuse.observe(ops, to(np.array([6.5], np.float32)), 2, own_rows=1)
    assert int(reuse.key) == before
    assert reuse.due  # 1 row: no tail
    # Within the band, the next step reuses until refresh_steps steps have passed.
    for age in range(6, 9):  # steps since the refresh, this one included
        reuse.due = False
        reuse.observe(ops, to(np.array([9.0, 8.0], np.float32)), 2, own_rows=2)
        assert reuse.due == (age >= 7)
    # A per-owner cap raises the threshold so at most `cap` keys pass.
    capped = ReusedGlobalThreshold.capped(ops, keys, to(np.array(1, np.int32)), 2)
    assert int(capped) == key_of(4.0)


@pytest.mark.parametrize(
    ("own_rows", "gathered", "cap"), [(3, 3, 3), (1, 3, 2), (0, 3, 1), (30, 40, 2)]
)
def test_an_owners_row_cap_is_its_smoothed_share_of_a_quarter_more_than_k(own_rows, gathered, cap):
    """cap = ceil(1.25 k (own + 1) / (gathered + 1)), k = 2: the owner that sent every
    row may send 1.25 k; one that sent none still 1."""
    ops, to, _ = _torch_backend()
    reuse = ReusedGlobalThreshold(refresh_steps=4)
    keys = ops.magnitude_keys(to(np.array([5.0, -4.0, 3.0], np.float32)))
    reuse.threshold(ops, keys, 2, lambda: global_threshold_key(ops, keys, 2, "t", OneRank()))
    reuse.observe(ops, to(np.linspace(1.0, 2.0, gathered, dtype=np.float32)), 2, own_rows)
    assert reuse.row_cap == cap
    assert reuse.row_cap == int(np.ceil(1.25 * 2 * (own_rows + 1) / (gathered + 1)))


@pytest.mark.parametrize(("own_rows", "gathered", "cap"), [(12, 12, 31), (0, 12, 3), (9, 30, 17)])
def test_a_row_cap_is_shared_over_at_least_half_of_k(own_rows, gathered, cap):
    """k = 40: below 0.5 k = 20 gathered rows, the share counts 20 rows, so
    cap = ceil(1.25 k (own + 1) / (max(gathered, 20) + 1)); above, the gathered count."""
    ops, to, _ = _torch_backend()
    reuse = ReusedGlobalThreshold(refresh_steps=4)
    keys = ops.magnitude_keys(to(np.linspace(1.0, 2.0, 60, dtype=np.float32)))
    reuse.threshold(ops, keys, 40, lambda: global_threshold_key(ops, keys, 40, "t", OneRank()))
    reuse.observe(ops, to(np.linspace(1.0, 2.0, gathered, dtype=np.float32)), 40, own_rows)
    assert reuse.row_cap == cap
    shared = max(gathered, 20)
    assert reuse.row_cap == int(np.ceil(1.25 * 40 * (own_rows + 1) / (shared + 1)))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [7, 40, 1000])
def test_the_owners_caps_add_up_to_about_a_quarter_more_than_k(world_size, k):
    """Whatever the gathered count (down to 1 row) and its split among the owners, the
    caps add up to at most 1.25 k + 1.25 k (P - 1) / (ceil(0.5 k) + 1) + P."""
    ops, to, _ = _torch_backend()
    rng = np.random.default_rng(k * world_size)
    bound = 1.25 * k + 1.25 * k * (world_size - 1) / (np.ceil(0.5 * k) + 1) + world_size
    for gathered in sorted({1, 2, k // 4, k // 2, k, int(1.25 * k)} - {0}):
        split = rng.multinomial(gathered, np.ones(world_size) / world_size)
        caps = []
        for own_rows in split:
            reuse = ReusedGlobalThreshold(refresh_steps=4)
            keys = ops.magnitude_keys(to(np.ones(4, np.float32)))
            reuse.threshold(
                ops, keys, k, lambda: global_threshold_key(ops, keys, k, "t", OneRank())
            )
            reuse.observe(ops, to(np.ones(gathered, np.float32)), k, int(own_rows))
            caps.append(int(reuse.row_cap))
        assert sum(caps) <= bound, (gathered, list(split), caps)


def test_one_rank_reuse_keeps_residual_plus_result_equal_to_the_accumulator():
    ops, to, back = _torch_backend()
    config = SparseConfig(density=0.01, global_selection="reuse", refresh_steps=3)
    like = to(np.zeros(0, np.float32))
    reducer = BucketReducer(ops, "b", 4000, like, config, OneRank())
    rng = np.random.default_rng(0)
    owed = np.zeros(4000, np.float32)
    refreshed = []
    for _ in range(9):
        grad = rng.standard_normal(4000).astype(np.float32)
        inflight = reducer.reduce_and_gather(reducer.start(to(grad)))
        result = back(reducer.finish(inflight, to(np.zeros(4000, np.float32)))).copy()
        refreshed.append(int(reducer.last_record.refreshed))
        np.testing.assert_allclose(back(reducer.residual) + result, owed + grad, atol=1e-6)
        owed = back(reducer.residual).copy()
        assert 0 < np.count_nonzero(result) <= reducer.k
    assert refreshed[0] == 1 and 0 in refreshed


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_grouped_radix_selects_equal_each_bucket_alone(framework):
    """Buckets that refresh on the same step share one allreduce per digit: each
    bucket's key is the one its own radix select finds (sizes, budgets and ties vary)."""
    ops, to, _ = BACKENDS[framework]()
    rng = np.random.default_rng(3)
    values = [
        rng.standard_normal(5000).astype(np.float32),
        rng.standard_normal(700).astype(np.float32) * 1e-3,
        np.repeat(np.float32([2.0, 1.0, 0.5]), 40),  # ties at every candidate threshold
        np.zeros(10, np.float32),  # fewer than k nonzero: everything is kept
    ]
    ks = [50, 7, 45, 3]
    keys = [ops.magnitude_keys(to(v)) for v in values]
    grouped = grouped_threshold_keys(ops, keys, ks, "g", OneRank())
    for bucket_keys, k, key in zip(keys, ks, grouped):
        alone = global_threshold_key(ops, bucket_keys, k, "a", OneRank())
        assert int(key) == int(alone)
    # Each key selects that bucket's k largest magnitudes (ties at the cut all kept).
    for v, k, key in zip(values, ks, grouped):
        magnitudes = np.sort(np.abs(v))[::-1]
        assert int(key) == key_of(float(magnitudes[k - 1]))


@pytest.mark.parametrize(
    ("framework", "traced"), [("torch", False), ("tensorflow", False), ("tensorflow", True)]
)
def test_a_capped_threshold_keeps_at_most_cap_keys_as_the_cap_th_key_would(framework, traced):
    """The keys a capped threshold keeps are those of max(threshold, cap-th largest key):
    caps below, at and above the count that reaches the threshold, ties at the cut."""
    ops, to, back = BACKENDS[framework]()
    capped = ReusedGlobalThreshold.capped
    if traced:
        import tensorflow as tf

        capped = tf.function(capped, autograph=False)
    rng = np.random.default_rng(5)
    magnitudes = np.concatenate([rng.standard_normal(60), np.full(8, 1.5)]).astype(np.float32)
    keys_np = np.abs(magnitudes).view(np.int32)
    keys = ops.magnitude_keys(to(magnitudes))
    for threshold_value in (0.3, 1.0, 1.5, 2.2):
        threshold = key_of(threshold_value)
        reaching = int(np.count_nonzero(keys_np >= threshold))
        for cap in sorted({1, 5, reaching - 1, reaching, reaching + 1, 68} - {0}):
            if cap < 1:
                continue
            expected_key = max(threshold, int(np.sort(keys_np)[::-1][cap - 1]))
            got = capped(ops, keys, to(np.array(threshold, np.int32)), cap)
            kept = back(ops.mask_at_least(keys, got))
            np.testing.assert_array_equal(kept, keys_np >= expected_key)
            # At most cap keys above the cut; ties at the cut all pass.
            assert np.count_nonzero(keys_np > expected_key) <= cap


@pytest.mark.parametrize(("saved_cap", "expected"), [(5, 5), (0, 7), (None, 7)])
def test_a_restored_cap_is_the_saved_one_or_k(saved_cap, expected):
    """A checkpoint carries this owner's cap; one without (older, or another rank's state
    adopted before this rank's first step: cap 0) gives k, the earlier per-owner bound."""
    ops, to, _ = _torch_backend()
    state = {"key": key_of(4.0), "due": False, "age": 2, "k": 7}
    if saved_cap is not None:
        state["cap"] = saved_cap
    reuse = ReusedGlobalThreshold(refresh_steps=4)
    reuse.load_state_dict(ops, state, ops.magnitude_keys(to(np.zeros(1, np.float32))))
    assert reuse.row_cap == expected
    assert int(reuse.key) == key_of(4.0) and not reuse.due


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_reused_key_that_was_too_high_is_lowered_by_a_quarter_of_its_misses(framework):
    """The drift: a quarter of the mean of each two misses of a reused key added in,
    never above 0, none learned on a refresh; it lowers the next key and travels in the
    checkpoint."""
    ops, to, _ = BACKENDS[framework]()
    reuse = ReusedGlobalThreshold(refresh_steps=100)
    keys = ops.magnitude_keys(to(np.array([5.0, -4.0, 3.0, 2.0, 1.0], np.float32)))
    exact = lambda: global_threshold_key(ops, keys, 4, "t", OneRank())  # noqa: E731
    model = {"drift": 0, "miss": 0}  # the rule, in Python ints (floor division)

    def step(gathered: list[float], this_step: int) -> None:
        """A reused step of k = 4 that gathered these rows, where k rows lay at
        ``this_step``; checks the next key against the rule."""
        used = int(reuse.key)
        reuse.threshold(ops, keys, 4, exact)
        assert not reuse.refreshed
        reuse.observe(ops, to(np.array(gathered, np.float32)), 4, own_rows=len(gathered))
        miss = this_step - used
        paired = (miss // 2 + model["miss"] // 2) // 4
        model.update(drift=min(0, model["drift"] + paired), miss=miss)
        assert int(reuse.key) == this_step + model["drift"]
        state = reuse.state_dict(ops)
        assert (state["drift"], state["miss"]) == (model["drift"], model["miss"])

    reuse.threshold(ops, keys, 4, exact)
    assert reuse.refreshed  # the first step: exact, nothing to learn
    reuse.observe(ops, to(np.array([-7.0, 6.0, 5.0, 4.5], np.float32)), 4, own_rows=4)
    assert int(reuse.key) == key_of(4.5)
    assert (reuse.state_dict(ops)["drift"], reuse.state_dict(ops)["miss"]) == (0, 0)
    # The key of 4.5 gathered 2 rows of k = 4: their tail extended says k rows lay at
    # 4.0 (see the first test). The key was too high: the next one is below 4.0.
    step([-8.0, 6.0], key_of(4.0))
    assert model["drift"] < 0 and int(reuse.key) < key_of(4.0)
    # Too high again: the drift grows with the mean of the two misses.
    step([-8.0, 6.0], key_of(4.0))
    assert model["drift"] < (key_of(4.0) - key_of(4.5)) // 8
    # A refresh learns nothing (its key is exact); the next key is still lowered.
    reuse.due = True
    reuse.threshold(ops, keys, 4, exact)
    assert reuse.refreshed
    reuse.observe(ops, to(np.array([-7.0, 6.0, 5.0, 4.5], np.float32)), 4, own_rows=4)
    state = reuse.state_dict(ops)
    assert (state["drift"], state["miss"]) == (model["drift"], model["miss"])
    assert int(reuse.key) == key_of(4.5) + model["drift"]
    # A checkpoint carries it; one from before the drift restores 0.
    restored = ReusedGlobalThreshold(refresh_steps=100)
    restored.load_state_dict(ops, reuse.state_dict(ops), keys)
    assert restored.state_dict(ops) == reuse.state_dict(ops)
    older = {k: v for k, v in reuse.state_dict(ops).items() if k not in ("drift", "miss")}
    restored.load_state_dict(ops, older, keys)
    assert (restored.state_dict(ops)["drift"], restored.state_dict(ops)["miss"]) == (0, 0)
    # More than k rows came back: the misses are positive, the drift goes back towards 0
    # but never above (the key is then the k-th gathered, exactly).
    step([9.0, 8.0, 7.5, 7.0, 6.9], key_of(7.0))
    step([9.0, 8.0, 7.5, 7.0, 6.9], key_of(7.0))
    assert model["drift"] == 0 and int(reuse.key) == key_of(7.0)
    # Misses one way and then the other: their mean.
    step([-8.0, 6.0], key_of(4.0))
    step([7.5, 7.2, 7.0, 6.0], key_of(6.0))
    assert not reuse.due  # no step here refreshes after the first


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_shifted_key_is_the_clamped_sum_without_wrapping(framework):
    ops, to, back = BACKENDS[framework]()
    top = 2**31 - 1

    def shifted(key: int, offset: int, low: int, high: int) -> int:
        result = ops.shifted_key(
            to(np.array(key, np.int32)), to(np.array(offset, np.int32)), low, high
        )
        value = np.asarray(back(result))
        assert value.dtype == np.int32 and value.size == 1
        return int(value.reshape(-1)[0])

    assert shifted(top - 10, 100, 0, top) == top  # would wrap negative in int32
    assert shifted(5, -10, 0, top) == 0
    assert shifted(-top, -5, -top, 0) == -top
    assert shifted(-8, 5, -top, 0) == -3
    assert shifted(-8, 9, -top, 0) == 0
    assert shifted(1000, -1, 0, top) == 999


def _observed_states(ops, to, dtype, traced=False):
    """The reused threshold's state after each of a run of observes (both owners' caps
    kept, P = 2 as rank 1): gathered counts above, at and below k, one row, a refresh."""
    rng = np.random.default_rng(11)
    reuse = ReusedGlobalThreshold(refresh_steps=5)
    keys = ops.magnitude_keys(to(rng.standard_normal(64).astype(np.float32)))
    exact = lambda: global_threshold_key(ops, keys, 16, "t", OneRank())  # noqa: E731
    observe = reuse.observe
    if traced:
        import tensorflow as tf

        observe = tf.function(lambda *args: reuse.observe(ops, *args, rank=1))
    states = []
    for count, k, own, refresh in [
        (20, 16, 12, True), (16, 16, 3, False), (9, 16, 9, False), (3, 16, 0, False),
        (1, 16, 1, False), (30, 24, 25, False), (12, 24, 6, True), (2, 24, 1, False),
    ]:  # fmt: skip
        if states:
            reuse.due = refresh
        reuse.threshold(ops, keys, k, exact)
        gathered = to((rng.standard_normal(count) * 2.0 ** rng.integers(-8, 8)).astype(dtype))
        if traced:
            observe(gathered, k, own)
        else:
            observe(ops, gathered, k, own, rank=1)
        states.append(reuse.state_dict(ops))
    return states


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_tfs_one_host_call_derives_the_state_its_kernels_and_torchs_derive(dtype):
    """Under TF with the NumPy kernels, ``observe`` is one host call (``update_cells``);
    eagerly and traced it derives the very state that TF's own kernels and torch's do,
    key, drift, miss, caps and due flag alike, step after step."""
    from horovod_sparse.common.horovod_primitives import HorovodPrimitives
    from horovod_sparse.tensorflow import kernels

    assert kernels.host_kernels(), "the unit tests run where the NumPy kernels serve"
    tf_ops, tf_to, _ = _tf_backend()
    torch_ops, torch_to, _ = _torch_backend()
    in_kernels = type(
        "InKernels", (type(tf_ops),), {"update_cells": HorovodPrimitives.update_cells}
    )
    reference = _observed_states(torch_ops, torch_to, dtype)
    assert {state["due"] for state in reference} == {True, False}
    assert len({state["drift"] for state in reference}) > 1  # the drift learned
    assert _observed_states(in_kernels(), tf_to, dtype) == reference
    assert _observed_states(tf_ops, tf_to, dtype) == reference
    assert _observed_states(tf_ops, tf_to, dtype, traced=True) == reference
