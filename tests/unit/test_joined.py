"""The joined exchange (common/joined.py), single process: its two primitives on both
backends, one alltoall and one allgather for all buckets with the results of one
exchange per bucket, a member that withdraws, a member that is missing, and the cut
where the joined index would pass int32."""

from types import SimpleNamespace

import numpy as np
import pytest

from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.joined import INDEX_LIMIT, JoinedExchange, _fitting
from horovod_sparse.common.pipeline import BucketReducer
from tests.unit.test_backends import BACKENDS, OneRank, _torch_backend


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_owner_major_and_cut_at(framework):
    ops, to, back = BACKENDS[framework]()
    first = to(np.array([[10], [11], [12], [13], [14]], np.uint8))
    second = to(np.array([[20], [21], [22]], np.uint8))
    splits_first, splits_second = [2, 0, 3], [1, 2, 0]
    if framework == "tensorflow":  # TF's splits are int32 tensors
        splits_first, splits_second = to(np.int32(splits_first)), to(np.int32(splits_second))
    rows, splits = ops.owner_major([(first, splits_first), (second, splits_second)])
    # Owner 0: 10, 11 then 20; owner 1: 21, 22; owner 2: 12, 13, 14.
    assert back(rows).reshape(-1).tolist() == [10, 11, 20, 21, 22, 12, 13, 14]
    assert list(np.asarray(splits if framework == "torch" else back(splits))) == [3, 2, 3]
    indices = to(np.array([7, 1, 12, 5, 10], np.int64))
    values = to(np.array([0.7, 0.1, 1.2, 0.5, 1.0], np.float32))
    parts = ops.cut_at(indices, values, [0, 6, 12, 18], ordered=False)
    got = [(back(i).tolist(), back(v).tolist()) for i, v in parts]
    expected = [([1, 5], [0.1, 0.5]), ([1, 4], [0.7, 1.0]), ([0], [1.2])]
    for (got_i, got_v), (want_i, want_v) in zip(got, expected):
        assert got_i == want_i
        np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
    ordered = ops.cut_at(to(np.array([1, 5, 7], np.int64)), values[:3], [0, 6, 12], True)
    assert [back(i).tolist() for i, _ in ordered] == [[1, 5], [1]]


def engine_of(join: bool):
    ops, to, back = _torch_backend()
    counts = {"alltoall": 0, "allgather": 0}
    alltoall, allgather = ops.alltoall_async, ops.allgather_async

    def counted_alltoall(*args):
        counts["alltoall"] += 1
        return alltoall(*args)

    def counted_allgather(*args):
        counts["allgather"] += 1
        return allgather(*args)

    ops.alltoall_async, ops.allgather_async = counted_alltoall, counted_allgather
    config = SparseConfig(density=0.02, join_buckets=join)
    like = to(np.zeros(0, np.float32))
    sizes, ranks = (3000, 2000, 4000), OneRank()  # one process set: they join
    reducers = [BucketReducer(ops, f"s{i}", n, like, config, ranks) for i, n in enumerate(sizes)]
    return Engine(ops, [r.name for r in reducers], reducers), counts, to, back


def test_one_alltoall_and_one_allgather_with_the_results_of_one_exchange_each():
    joined, joined_counts, to, back = engine_of(True)
    apart, apart_counts, _, _ = engine_of(False)
    rng = np.random.default_rng(0)
    for step in range(6):
        grads = [rng.standard_normal(r.numel).astype(np.float32) for r in joined.reducers]
        owed = [back(r.residual).copy() for r in joined.reducers]
        got = [back(t).copy() for t in joined.reduce_all([to(g.copy()) for g in grads])]
        want = [back(t).copy() for t in apart.reduce_all([to(g.copy()) for g in grads])]
        assert joined_counts == {"alltoall": step + 1, "allgather": step + 1}
        assert apart_counts == {"alltoall": 3 * (step + 1), "allgather": 3 * (step + 1)}
        for index, reducer in enumerate(joined.reducers):
            np.testing.assert_array_equal(got[index], want[index])
            np.testing.assert_array_equal(
                back(reducer.residual), back(apart.reducers[index].residual)
            )
            # One rank: the residual and the result hold what was owed plus the gradient.
            np.testing.assert_allclose(
                back(reducer.residual) + got[index], owed[index] + grads[index], atol=1e-6
            )
            assert np.count_nonzero(got[index]) > 0


def test_a_withdrawn_member_sends_nothing_and_a_missing_one_is_named():
    ops, to, back = _torch_backend()
    config = SparseConfig(density=0.02)
    like = to(np.zeros(0, np.float32))
    members = [BucketReducer(ops, f"m{i}", 100, like, config, OneRank()) for i in range(3)]
    exchange = JoinedExchange(ops, members)

    def decode(wire):
        return wire

    exchange.send_scatter(members[0], to(np.array([3, 9], np.int64)), to(np.float32([1, 2])))
    with pytest.raises(RuntimeError, match="missing: m1, m2"):
        exchange.owned(members[0], like, decode)
    exchange.withdraw(members[2])  # its step went dense: the others need not wait
    exchange.send_scatter(members[1], to(np.array([4], np.int64)), to(np.float32([5])))
    indices, sums, received = exchange.owned(members[1], like, decode)
    assert back(indices).tolist() == [4] and back(sums).tolist() == [5.0]
    assert int(received) == 0  # one rank: every row was its own
    indices, sums, _ = exchange.owned(members[2], like, decode)
    assert back(indices).tolist() == []


def test_groups_are_cut_where_the_joined_index_would_pass_int32():
    big = [SimpleNamespace(numel=1 << 30, name=str(i)) for i in range(3)]
    assert [len(run) for run in _fitting(big)] == [2, 1]  # 2 * 2^30 - 1 is the top index
    small = [SimpleNamespace(numel=1000, name=str(i)) for i in range(5)]
    assert [len(run) for run in _fitting(small)] == [5]
    assert INDEX_LIMIT == 2**31
