"""The engine's decisions over all buckets, single process, against the reducers' own."""

import numpy as np
import pytest

from horovod_sparse.common.config import SparseConfig
from horovod_sparse.common.engine import Engine
from horovod_sparse.common.fusion import DenseFusion, FusionMember
from horovod_sparse.common.pipeline import BucketReducer, DenseBucketReducer
from horovod_sparse.common.step import StepKind
from tests.unit.test_backends import OneRank, _torch_backend


def make_engine(config: SparseConfig, fused: bool = False):
    ops, to, back = _torch_backend()
    like = to(np.zeros(0, np.float32))
    reducers = [
        BucketReducer(ops, "s0", 3000, like, config, OneRank()),
        BucketReducer(ops, "s1", 2000, like, config, OneRank()),
        DenseBucketReducer(ops, "d0", 100, like, OneRank()),
    ]
    fusion = None
    if fused:
        members = [FusionMember(0, 0, 3000, 4), FusionMember(0, 3000, 2000, 4)]
        fusion = DenseFusion(members, 1 << 30)
    return Engine(ops, ["s0", "s1", "d0"], reducers, fusion), ops, to, back


def run_step(engine, ops, to, rng):
    """One step as an adapter runs it: plan, fill, launch, finish, record."""
    kinds = engine.open_step().kinds
    for index, reducer in enumerate(engine.reducers):
        grad = to(rng.standard_normal(reducer.numel).astype(np.float32))
        buffer = ops.copy(grad)
        if not engine.gradients_in_buffer(index):
            engine.accumulate(index, grad, 0)
        engine.launch(index, buffer)
        assert (engine.handles[index] is not None) == (kinds[index] is not StepKind.DENSE_FUSED)
    results = [engine.finish(i, h) for i, h in engine.launch_gathers()]
    engine.record_step()
    engine.begin_step()
    return kinds, results


def test_kinds_follow_warmup_then_sparse_and_records_make_stats():
    engine, ops, to, _ = make_engine(SparseConfig(density=0.01, warmup_steps=2))
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(4):
        kinds, _ = run_step(engine, ops, to, rng)
        seen.append(kinds)
        stats = engine.stats()
        assert stats.numel == 3000 + 2000 + 100
        dense = sum(k.dense for k in kinds)
        assert (stats.dense_buckets, stats.sparse_buckets) == (dense, 3 - dense)
    # Warm-up with clear residuals: the gradients go to the buffer; then sparse.
    assert seen[0] == [StepKind.DENSE_IN_BUFFER] * 3
    assert seen[1] == [StepKind.DENSE_IN_BUFFER] * 3
    assert seen[2] == seen[3] == [StepKind.SPARSE, StepKind.SPARSE, StepKind.DENSE_IN_BUFFER]
    assert engine.step == 4
    # The last step's selection: about 1% of each sparse bucket, all of the dense one.
    assert engine.stats().selected == 30 + 20 + 100


def test_forced_dense_with_mass_owed_is_dense_from_the_residual():
    engine, ops, to, _ = make_engine(SparseConfig(density=0.01))
    rng = np.random.default_rng(1)
    run_step(engine, ops, to, rng)  # sparse: the residuals now owe mass
    engine.sparse[1].force_dense = True
    kinds = engine.open_step().kinds
    assert kinds == [StepKind.SPARSE, StepKind.DENSE_FROM_RESIDUAL, StepKind.DENSE_IN_BUFFER]


def test_fusion_plans_runs_of_adjacent_dense_buckets():
    engine, *_ = make_engine(SparseConfig(density=0.01, warmup_steps=1), fused=True)
    kinds = engine.open_step().kinds
    assert kinds[:2] == [StepKind.DENSE_FUSED, StepKind.DENSE_FUSED]
    assert engine.fusion_runs == [[0, 1]]


def test_shared_state_round_trip_and_checkpoint_share():
    engine, ops, to, back = make_engine(SparseConfig(density=0.01, partition="balanced"))
    rng = np.random.default_rng(2)
    for _ in range(3):
        run_step(engine, ops, to, rng)
    shared = engine.shared_state()
    assert shared["s0"][0] == 3 and shared["s0"][1][0] == 0 and shared["s0"][1][-1] == 3000
    other, _, _, _ = make_engine(SparseConfig(density=0.01, partition="balanced"))
    other.adopt_shared_state(shared)
    assert other.shared_state() == shared
    saved = {name: dict(state) for name, state in engine.state_dict().items()}
    residual = back(saved["s0"]["residual"]).copy()
    assert np.abs(residual).sum() > 0
    other.load_state_dict(saved, share=0.5)
    np.testing.assert_array_equal(back(other.sparse[0].residual), residual * np.float32(0.5))
    with pytest.raises(ValueError, match="no state matching bucket s1"):
        other.load_state_dict({"s0": saved["s0"]})


def test_engine_runs_a_step_launching_each_bucket_at_its_last_tensor():
    """The run of a step: a bucket launches when its last tensor is in, a fused run
    when its last bucket is; handles move on and finish into the buffers; the results
    equal the sums (one rank: the gradients themselves at a dense step)."""
    ops, to, back = _torch_backend()
    like = to(np.zeros(0, np.float32))
    config = SparseConfig(density=0.01, warmup_steps=1)
    arena = to(np.zeros(5000, np.float32))
    buffers = [arena[:3000], arena[3000:], to(np.zeros(100, np.float32))]
    reducers = [
        BucketReducer(ops, "s0", 3000, like, config, OneRank()),
        BucketReducer(ops, "s1", 2000, like, config, OneRank()),
        DenseBucketReducer(ops, "d0", 100, like, OneRank()),
    ]
    fusion = DenseFusion([FusionMember(0, 0, 3000, 4), FusionMember(0, 3000, 2000, 4)], 1 << 30)
    engine = Engine(
        ops,
        ["s0", "s1", "d0"],
        reducers,
        fusion,
        buffers=buffers,
        arenas=[arena],
        members=[2, 1, 1],
    )
    rng = np.random.default_rng(3)
    for step in range(2):
        engine.open_step()
        grads = [rng.standard_normal(n).astype(np.float32) for n in (1500, 1500, 2000, 100)]
        places = [(0, 0), (0, 1500), (1, 0), (2, 0)]
        # s0 waits for its second tensor; at the fused warm-up step it also waits for
        # s1, the run's last bucket; the dense bucket launches at once.
        expected_launches = [[False, False, True, True], [False, True, True, True]][step]
        for (index, offset), grad, expected_launch in zip(places, grads, expected_launches):
            if engine.gradients_in_buffer(index):
                buffers[index][offset : offset + grad.size] = to(grad)
            else:
                engine.accumulate(index, to(grad), offset)
            engine.arrived(index)
            assert (engine.handles[index] is not None) == expected_launch
        assert all(h is not None for h in engine.handles)
        results = [back(engine.finish(i, h)).copy() for i, h in engine.launch_gathers()]
        assert not engine.busy
        engine.record_step()
        expected = [np.concatenate(grads[:2]), grads[2], grads[3]]
        if step == 0:
            assert engine.fusion_runs == [[0, 1]]
            for result, want in zip(results, expected):
                np.testing.assert_array_equal(result, want)
        else:
            assert engine.kinds[:2] == [StepKind.SPARSE, StepKind.SPARSE]
            for index in range(2):
                # One rank: residual + result == gradient, entry by entry.
                owed = back(engine.sparse[index].residual)
                np.testing.assert_allclose(owed + results[index], expected[index], rtol=0, atol=0)
            np.testing.assert_array_equal(results[2], expected[2])
        engine.begin_step()
    assert [view.step for view in engine.views() if view.sparse] == [2, 2]


def test_loaded_residual_shares_follow_who_loaded_what():
    """The checkpoint policy's agreement (docs/design.md §6), given every rank's load."""
    import warnings

    from horovod_sparse.common.engine_state import residual_share_among

    rank0 = (0, "run-a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # One checkpoint per rank: each restores its own exactly.
        assert residual_share_among(rank0, [rank0, (1, "run-a"), (2, "run-a")]) == 1.0
        assert residual_share_among(None, [None, rank0]) == 1.0  # loaded nothing
        # Horovod's pattern: rank 0's live optimizer ("run-a") still holds what it saved,
        # the other ranks loaded copies, which owe none of it.
        assert residual_share_among(rank0, [None, rank0, rank0], holders={"run-a"}) == 0.0
    # Rank 0's checkpoint loaded by all three ranks: a third each, with a warning.
    with pytest.warns(UserWarning, match="3 ranks loaded"):
        assert residual_share_among(rank0, [rank0, rank0, rank0]) == pytest.approx(1 / 3)
