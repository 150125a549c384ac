"""Dense-step fusion: which adjacent dense buckets share one allreduce, and when."""

import pytest

from horovod_sparse.common.fusion import (
    DenseFusion,
    FusedPart,
    FusionMember,
    SharedAllreduce,
    plan_dense_runs,
)


def back_to_back(*numels: int, arena: int = 0, itemsize: int = 4) -> list[FusionMember]:
    members, offset = [], 0
    for numel in numels:
        members.append(FusionMember(arena, offset, numel, itemsize))
        offset += numel
    return members


def test_adjacent_dense_members_form_one_run():
    members = back_to_back(10, 20, 30, 40)
    assert plan_dense_runs(members, [True] * 4, cap_bytes=10**6) == [[0, 1, 2, 3]]


def test_a_sparse_member_splits_the_runs_and_lone_members_keep_their_own_allreduce():
    members = back_to_back(10, 20, 30, 40, 50)
    dense = [True, True, False, True, False]
    assert plan_dense_runs(members, dense, cap_bytes=10**6) == [[0, 1]]
    assert plan_dense_runs(members, [False] * 5, cap_bytes=10**6) == []


def test_the_cap_cuts_runs_greedily_and_excludes_members_above_it():
    members = back_to_back(10, 10, 10, 10, 100, 10, 10)  # 40 bytes each, 400 for member 4
    # 80 bytes: two members per run; member 4 alone exceeds the cap.
    assert plan_dense_runs(members, [True] * 7, cap_bytes=80) == [[0, 1], [2, 3], [5, 6]]
    assert plan_dense_runs(members, [True] * 7, cap_bytes=120) == [[0, 1, 2], [5, 6]]
    assert plan_dense_runs(members, [True] * 7, cap_bytes=1) == []  # fusion off


def test_runs_never_cross_arenas_or_gaps():
    members = back_to_back(10, 10) + back_to_back(10, 10, arena=1)
    assert plan_dense_runs(members, [True] * 4, cap_bytes=10**6) == [[0, 1], [2, 3]]
    gap = [FusionMember(0, 0, 10, 4), FusionMember(0, 11, 10, 4), FusionMember(0, 21, 5, 4)]
    assert plan_dense_runs(gap, [True] * 3, cap_bytes=10**6) == [[1, 2]]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_a_run_completes_once_all_of_its_members_are_in(order):
    fusion = DenseFusion(back_to_back(10, 20, 30, 40), cap_bytes=10**6)
    assert fusion.plan([True, True, True, False]) == [[0, 1, 2]]
    assert [fusion.fused(i) for i in range(4)] == [True, True, True, False]
    completed = [fusion.complete(i) for i in order]
    assert completed == [None, None, [0, 1, 2]]
    assert fusion.span([0, 1, 2]) == (0, 0, 60)
    # A new step starts counting again.
    fusion.plan([True, True, False, False])
    assert [fusion.complete(1), fusion.complete(0)] == [None, [0, 1]]


class FakeOps:
    """Clock and wait of a backend, counting waits."""

    in_place = True  # the members' buffers hold their parts of the sum

    def __init__(self):
        self.now = 0.0
        self.waits = 0

    def clock(self, *after):
        return self.now

    def wait(self, handle):
        self.waits += 1
        self.now += 3.0  # the collective takes 3 s to arrive
        return handle


def test_the_shared_allreduce_is_waited_once_and_its_time_shared_by_size():
    ops = FakeOps()
    shared = SharedAllreduce(handle="h", numel=30)
    first, second = FusedPart(shared, "a", 10), FusedPart(shared, "b", 20)
    assert second.wait(ops) == ("b", 2.0)
    assert first.wait(ops) == ("a", 1.0)
    assert ops.waits == 1 and first.pending == "h"
