"""horovod_sparse.tensorflow against Horovod's dense TF ops and the shared NumPy reference."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.keras as hvds_keras
import horovod_sparse.tensorflow.reducer as reducer_module
import horovod_sparse.tensorflow.tape as tape_module
from horovod_sparse.common.config import SparseConfig, budget
from tests.reference import reference_step, uniform_boundaries

hvd.init()

# The alltoalls of a sparse step: none at P = 2, where one all-gather of both ranks'
# selections takes the place of the alltoall and the all-gather (common/pair_stages.py).
SCATTERS = 0 if hvd.size() == 2 else 1
tf.config.threading.set_inter_op_parallelism_threads(2)


def local_grad(step: int, numel: int) -> tf.Tensor:
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return tf.constant(rng.standard_normal(numel).astype(np.float32))


def gather_rows(flat: tf.Tensor, name: str) -> list[np.ndarray]:
    return list(hvd.allgather(tf.reshape(flat, [1, -1]), name=name).numpy())


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum], ids=["average", "sum"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_density_one_matches_dense_allreduce(op, graph):
    hvds.reset_residuals()

    def reduce(x):
        return hvds.sparse_allreduce(x, density=1.0, name="d1", op=op)

    fn = tf.function(reduce) if graph else reduce
    for step in range(3):
        grad = tf.reshape(local_grad(step, 4000), [40, 100])
        sparse = fn(grad)
        dense = hvd.allreduce(grad, op=op, name=f"d1.dense.{step}.{graph}")
        rel = float(tf.norm(sparse - dense) / tf.norm(dense))
        assert rel < 1e-6, rel
        assert sparse.shape == grad.shape


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_matches_single_process_reference(graph):
    hvds.reset_residuals()
    numel, density = 20_000, 0.02
    k = budget(numel, density)

    def reduce(x):
        return hvds.sparse_allreduce(
            x,
            density=density,
            name="ref",
            op=hvd.Sum,
            selection="exact",
            global_selection="exact",
        )

    fn = tf.function(reduce) if graph else reduce
    before = np.zeros(numel, np.float32)
    for step in range(4):
        grad = local_grad(step, numel)
        accumulators = gather_rows(before + grad.numpy(), f"ref.acc.{step}.{graph}")
        got = fn(grad).numpy()
        expected = reference_step(accumulators, k, uniform_boundaries(numel, hvd.size()))
        np.testing.assert_array_equal(np.flatnonzero(got), expected.selected)
        np.testing.assert_allclose(got, expected.result_sum, rtol=1e-6, atol=1e-6)
        after = hvds.residual_variables()["ref"].numpy()
        np.testing.assert_allclose(after, expected.residuals[hvd.rank()], rtol=1e-6, atol=1e-6)
        before = after.copy()


@pytest.mark.parametrize("partition", ["uniform", "balanced"])
@pytest.mark.parametrize("selection", ["threshold", "exact"])
def test_residual_invariant_50_steps(selection, partition):
    """The traced function runs 50 times: the threshold, the step count and the
    boundaries live in variables, so the selection and the re-partitions move on."""
    hvds.reset_residuals()
    numel, size = 30_000, hvd.size()

    @tf.function
    def reduce(x):
        return hvds.sparse_allreduce(
            x,
            density=0.01,
            name="inv",
            op=hvd.Average,
            selection=selection,
            partition=partition,
            repartition_steps=7,
            global_selection="exact",  # exactly k per step (reuse: its own test)
        )

    before = np.zeros(numel, np.float64)
    for step in range(50):
        grad = local_grad(step, numel) * (1.0 + step / 10)
        out = reduce(grad)
        after = hvds.residual_variables()["inv"]
        lhs = hvd.allreduce(tf.cast(after, tf.float64), op=hvd.Sum, name=f"inv.l.{step}")
        lhs += size * tf.cast(out, tf.float64)
        rhs = hvd.allreduce(
            tf.constant(before) + tf.cast(grad, tf.float64), op=hvd.Sum, name=f"inv.r.{step}"
        )
        np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=0, atol=1e-4)
        assert int(tf.math.count_nonzero(out)) == budget(numel, 0.01)
        before = after.numpy().astype(np.float64)
        assert_identical([out], f"inv.{selection}.{partition}.{step}")
        if step == 0:  # a first call that creates variables traces twice, then never again
            traces = reduce.experimental_get_tracing_count()
    assert reduce.experimental_get_tracing_count() == traces
    s = hvds.stats("inv")
    assert s.selected == budget(numel, 0.01)
    assert abs(s.dense_bytes - 4 * numel * (size - 1) / size * 4) <= 2
    # 2% of dense for the rows, plus the fixed 4 x 1 KiB histogram allreduces each way,
    # plus, on a re-partition step (49 is one: 49 % 7 == 0), the position histogram's
    # ring allreduce of 256 * P int32 each way.
    repartition = 2 * (2 * 256 * size * (size - 1) * 4 // size) if partition == "balanced" else 0
    assert 0 < s.bytes_sent + s.bytes_received < 0.03 * s.dense_bytes + 8 * 1024 + repartition


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_warmup_steps_are_dense_then_sparse(graph):
    """Warm-up under one trace: a tf.cond on the step variable picks the dense kind for
    the first steps (equal to Horovod's allreduce), then the sparse one; no mass lost."""
    hvds.reset_residuals()
    numel, warmup, size = 20_000, 3, hvd.size()

    def reduce(x):
        return hvds.sparse_allreduce(
            x,
            density=0.01,
            name="warm",
            op=hvd.Average,
            warmup_steps=warmup,
            global_selection="exact",  # exactly k per sparse step, asserted below
        )

    fn = tf.function(reduce) if graph else reduce
    before = np.zeros(numel, np.float64)
    for step in range(7):
        grad = local_grad(step, numel)
        out = fn(grad)
        after = hvds.residual_variables()["warm"]
        if step < warmup:
            dense = hvd.allreduce(grad, op=hvd.Average, name=f"warm.dense.{graph}.{step}")
            np.testing.assert_allclose(out.numpy(), dense.numpy(), rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(after.numpy(), np.zeros(numel, np.float32))
            assert hvds.stats("warm").dense_buckets == 1
        else:
            assert int(tf.math.count_nonzero(out)) == budget(numel, 0.01)
            assert hvds.stats("warm").sparse_buckets == 1
        lhs = hvd.allreduce(tf.cast(after, tf.float64), op=hvd.Sum, name=f"warm.l.{graph}.{step}")
        lhs += size * tf.cast(out, tf.float64)
        rhs = hvd.allreduce(
            tf.constant(before) + tf.cast(grad, tf.float64),
            op=hvd.Sum,
            name=f"warm.r.{graph}.{step}",
        )
        np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=0, atol=1e-4)
        before = after.numpy().astype(np.float64)
        assert_identical([out], f"warm.{graph}.{step}")


@pytest.mark.parametrize("selection", ["exact", "threshold"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_density_decay_budget_follows_the_schedule(graph, selection):
    """After warm-up the density decays geometrically to its target: each step keeps
    budget(n, density_at(step)) entries, under one trace (k follows the step variable
    in the graph); the exact selection equals the reference at that k; no mass lost."""
    hvds.reset_residuals()
    numel, size = 20_000, hvd.size()
    schedule = dict(density=0.01, warmup_steps=2, density_decay_steps=5)
    config = SparseConfig(**schedule)

    def reduce(x):
        return hvds.sparse_allreduce(
            x,
            name="decay",
            op=hvd.Sum,
            selection=selection,
            global_selection="exact",  # exactly k per step; the reference selects exactly
            reestimate_steps=3,
            **schedule,
        )

    fn = tf.function(reduce) if graph else reduce
    before = np.zeros(numel, np.float32)
    budgets = []
    for step in range(10):
        grad = local_grad(70 + step, numel)
        accumulators = gather_rows(before + grad.numpy(), f"decay.acc.{graph}.{step}")
        out = fn(grad)
        after = hvds.residual_variables()["decay"]
        k = budget(numel, config.density_at(step))
        budgets.append(k)
        assert int(tf.math.count_nonzero(out)) == k
        stats = hvds.stats("decay")
        assert stats.selected == k
        assert stats.dense_buckets == (1 if step < config.warmup_steps else 0)
        if step < config.warmup_steps:
            dense = hvd.allreduce(grad, op=hvd.Sum, name=f"decay.dense.{graph}.{step}")
            np.testing.assert_allclose(out.numpy(), dense.numpy(), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(after.numpy(), np.zeros(numel, np.float32))
        elif selection == "exact":
            expected = reference_step(accumulators, k, uniform_boundaries(numel, size))
            np.testing.assert_array_equal(np.flatnonzero(out.numpy()), expected.selected)
            np.testing.assert_allclose(out.numpy(), expected.result_sum, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(
                after.numpy(), expected.residuals[hvd.rank()], rtol=1e-6, atol=1e-6
            )
        lhs = hvd.allreduce(tf.cast(after, tf.float64), op=hvd.Sum, name=f"decay.l.{graph}.{step}")
        lhs += tf.cast(out, tf.float64)  # op=Sum: the result is the sum itself
        rhs = hvd.allreduce(
            tf.constant(before, tf.float64) + tf.cast(grad, tf.float64),
            op=hvd.Sum,
            name=f"decay.r.{graph}.{step}",
        )
        np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=0, atol=1e-4)
        before = after.numpy().copy()
        assert_identical([out], f"decay.{graph}.{selection}.{step}")
        if graph and step == 0:  # a first call that creates variables traces twice
            traces = fn.experimental_get_tracing_count()
    if graph:
        assert fn.experimental_get_tracing_count() == traces
    # Dense, dense, then 7963, 3170, 1262, 503, 200: the decay reaches the target.
    assert budgets[:2] == [numel, numel] and budgets[-3:] == [200, 200, 200]
    assert all(a > b for a, b in zip(budgets[1:7], budgets[2:7]))


COLLECTIVES = ("alltoall_async", "allgather_async", "allreduce_sum_async")


@pytest.fixture
def collective_counts(monkeypatch):
    """One variable per collective kind, incremented with each one the stages run: it
    counts what a traced step executes (a refresh is a branch of a tf.cond), not what
    it traced."""
    counts = {kind: tf.Variable(0, dtype=tf.int64, trainable=False) for kind in COLLECTIVES}
    for kind, count in counts.items():
        real = getattr(reducer_module.BACKEND, kind)

        def counting(tensor, *args, _count=count, _real=real):
            with tf.control_dependencies([_count.assign_add(1)]):
                return _real(tf.identity(tensor), *args)

        monkeypatch.setattr(reducer_module.BACKEND, kind, counting)
    return counts


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_a_reused_step_is_one_alltoall_and_one_allgather(graph, collective_counts):
    hvds.reset_residuals()
    numel, size = 30_000, hvd.size()
    k, name = budget(numel, 0.01), f"reuse.{graph}"

    def reduce(x):
        return hvds.sparse_allreduce(
            x, density=0.01, name=name, op=hvd.Sum, global_selection="reuse", refresh_steps=8
        )

    fn = tf.function(reduce) if graph else reduce
    before = np.zeros(numel, np.float64)
    refreshes = []
    for step in range(24):
        grad = local_grad(step, numel) * (1.0 + step / 20)
        start = {kind: int(count.numpy()) for kind, count in collective_counts.items()}
        out = fn(grad)
        issued = {kind: int(c.numpy()) - start[kind] for kind, c in collective_counts.items()}
        refreshed = hvds.stats(name).global_refreshes
        refreshes.append(refreshed)
        assert issued["alltoall_async"] == SCATTERS and issued["allgather_async"] == 1, issued
        assert issued["allreduce_sum_async"] == 4 * refreshed, (step, issued)
        # Invariant: no mass is lost, reused threshold or not.
        after = hvds.residual_variables()[name]
        lhs = hvd.allreduce(tf.cast(after, tf.float64), op=hvd.Sum, name=f"{name}.l.{step}")
        lhs += tf.cast(out, tf.float64)
        rhs = hvd.allreduce(
            tf.constant(before) + tf.cast(grad, tf.float64), op=hvd.Sum, name=f"{name}.r.{step}"
        )
        np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=0, atol=1e-4)
        # Each owner keeps at most its share of 1.25 k rows on a reused step.
        assert 0 < int(tf.math.count_nonzero(out)) <= 1.25 * k + 3 * size
        assert_identical([out], f"{name}.{step}")
        before = after.numpy().astype(np.float64)
        if step == 0 and graph:  # a first call that creates variables traces twice
            traces = fn.experimental_get_tracing_count()
    # The first step, and at least one step in every 8, refresh exactly; most reuse.
    assert refreshes[0] == 1
    for start in range(0, 24, 8):
        assert 1 in refreshes[start : start + 8], refreshes
    assert refreshes.count(0) >= 8, refreshes
    if graph:
        assert fn.experimental_get_tracing_count() == traces


def graph_op_types(graph_def) -> list[str]:
    """Every op type of a traced graph, its functions' (tf.cond branches) included."""
    types = [node.op for node in graph_def.node]
    for function in graph_def.library.function:
        types += [node.op for node in function.node_def]
    return types


def gathers_after_a_scatter(graph_def) -> tuple[int, int]:
    """``(ResourceGather nodes, those with a ResourceScatterUpdate among their ancestors
    in the same graph or function body)``: a gather from a variable starts its
    copy-on-read mode unless a scatter already has."""
    bodies = [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]
    gathers = after = 0
    for nodes in bodies:
        by_name = {node.name: node for node in nodes}

        def ancestors(node, seen):
            for source in node.input:
                parent = by_name.get(source.lstrip("^").split(":")[0])
                if parent is not None and parent.name not in seen:
                    seen.add(parent.name)
                    ancestors(parent, seen)
            return seen

        for node in nodes:
            if node.op == "ResourceGather":
                gathers += 1
                seen = ancestors(node, set())
                after += any(by_name[n].op == "ResourceScatterUpdate" for n in seen)
    return gathers, after


def test_the_residual_is_written_in_place_in_its_variable():
    """A sparse step adds the gradients to the residual's variable and zeroes what it
    sent there (docs/design.md §7): no new residual is assigned, no gather from the
    variable turns its reads into copies (the owed sums' gather follows the scatter
    that zeroes the sent entries), and the step ends copy-on-read mode."""
    hvds.reset_residuals()
    numel, name = 40_000, "in_place"
    fn = tf.function(lambda x: hvds.sparse_allreduce(x, density=0.01, name=name, op=hvd.Sum))
    before = np.zeros(numel, np.float64)
    for step in range(6):
        grad = local_grad(step, numel)
        out = fn(grad)
        after = hvds.residual_variables()[name]
        # Invariant: no mass is lost while the residual changes in place.
        lhs = hvd.allreduce(tf.cast(after, tf.float64), op=hvd.Sum, name=f"{name}.l.{step}")
        lhs += tf.cast(out, tf.float64)
        rhs = hvd.allreduce(
            tf.constant(before) + tf.cast(grad, tf.float64), op=hvd.Sum, name=f"{name}.r.{step}"
        )
        np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=0, atol=1e-4)
        before = after.numpy().astype(np.float64)
    graph = fn.get_concrete_function(grad).graph
    residual = hvds.residual_variables()[name]
    inner = {id(outer): inner for outer, inner in graph.captures}
    handle = inner[id(residual.handle)]
    writers = sorted(op.type for op in handle.consumers())
    assert "AssignAddVariableOp" in writers and "AssignVariableOp" not in writers, writers
    graph_def = graph.as_graph_def()
    types = graph_op_types(graph_def)
    # The sent entries zeroed, then the owed sums (one add: no lossy compression) as a
    # gather and an assignment.
    assert gathers_after_a_scatter(graph_def) == (1, 1)
    assert types.count("ResourceScatterUpdate") == 2 and types.count("DisableCopyOnRead") == 1
    assert "ResourceScatterAdd" not in types


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_log_every_prints_the_step_figures_on_the_first_rank(capsys, graph):
    """``log_every=3`` on the tape: one line at steps 3 and 6 of 7, on rank 0 only, with
    the figures ``stats()`` gives for that step, traced steps included."""
    name = f"log_every.{graph}"
    step_fn = fusion_tape(name, graph, log_every=3)
    capsys.readouterr()
    expected = []
    for step in range(1, 8):
        step_fn(*fusion_grads(step))
        if step % 3 == 0:
            s = tape_reducer(name).stats()
            moved = s.bytes_sent + s.bytes_received
            expected.append(
                f"[horovod_sparse] step {step}: density {s.density:.4f} (target 0.05), "
                f"{moved:,} bytes ({moved / s.dense_bytes:.2%} of dense), exchange "
            )
    lines = [line for line in capsys.readouterr().out.splitlines() if "[horovod_sparse]" in line]
    if hvd.rank() == 0:
        assert len(lines) == 2, lines
        for line, start in zip(lines, expected):
            assert line.startswith(start), (line, start)
            assert line.endswith("refreshed")
    else:
        assert lines == []


def test_options_tensorflow_does_not_act_on_are_refused():
    # dense_fusion_bytes joins buckets: a single tensor has none to join, as in torch.
    for bad, match in [
        (dict(dense_fusion_bytes=1024), "dense_fusion_bytes=1024 does not apply"),
        (dict(scheduler="auto"), "scheduler='auto' does not apply"),
        (dict(trace="t.json"), "trace='t.json' does not apply"),
        (dict(log_every=5), "log_every=5 does not apply"),
    ]:
        with pytest.raises(ValueError, match=match):
            hvds.sparse_allreduce(tf.ones([10]), name="bad", **bad)
    with pytest.raises(TypeError, match="unknown option"):
        hvds.sparse_allreduce(tf.ones([10]), name="bad", densty=0.1)


# ---------------------------------------------------------------- dense-step fusion
# Three sparse buckets at a capacity of 30,000 bytes (the kernels: 24 KiB, 20 KiB and
# 12 KiB, distinct sizes) and one dense bucket (the bias); each warm-up step fuses the
# three sparse buckets into one allreduce.
FUSION_SHAPES = [(64, 96), (80, 64), (64, 48), (48,)]
FUSION_BYTES = 30_000
FUSION_WARMUP = 3
FUSED_BUCKETS = ["sparse0.float32", "sparse1.float32", "sparse2.float32"]


@pytest.fixture
def allreduce_count(monkeypatch):
    """A variable counting the allreduces every reducer runs: incremented with each
    one, so it counts the collectives a traced step executes, not those it traced."""
    count = tf.Variable(0, dtype=tf.int64, trainable=False)
    real = reducer_module.BACKEND.allreduce_sum_async

    def counting(tensor, name, process_set):
        with tf.control_dependencies([count.assign_add(1)]):
            return real(tf.identity(tensor), name, process_set)

    monkeypatch.setattr(reducer_module.BACKEND, "allreduce_sum_async", counting)
    return count


def fusion_grads(step):
    rng = np.random.default_rng(7 * step + 1000 * hvd.rank())
    return [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in FUSION_SHAPES]


def fusion_tape(name, graph, **options):
    """A tape step on FUSION_SHAPES sources whose gradients are the given tensors
    exactly (d/ds sum(s * g) = g), and the reducer it builds."""
    sources = [tf.Variable(tf.zeros(shape)) for shape in FUSION_SHAPES]

    def step(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(s * g) for s, g in zip(sources, grads)])
        dtape = hvds.DistributedGradientTape(
            tape,
            name=name,
            density=0.05,
            fusion_threshold_bytes=FUSION_BYTES,
            selection="exact",
            **options,
        )
        return dtape.gradient(loss, sources)

    return tf.function(step) if graph else step


def tape_reducer(name):
    return tape_module.gradient_reducer(name)


def by_bucket(reducer, tensors):
    """Per sparse bucket name: its flat float64 slice of ``tensors`` (one per source)."""
    return {
        bucket.name: np.concatenate(
            [np.asarray(tensors[p], np.float64).reshape(-1) for p in positions]
        )
        for bucket, positions, state in reducer.buckets
        if state.residual is not None
    }


def residuals_by_bucket(reducer):
    return {name: r.numpy().astype(np.float64) for name, r in reducer.residuals().items()}


def assert_mass_kept(reducer, before, grads, out, tag):
    """Summed over ranks: residual_after + P * result == residual_before + grad."""
    after = residuals_by_bucket(reducer)
    sent, result = by_bucket(reducer, grads), by_bucket(reducer, out)
    for name in after:
        lhs = hvd.allreduce(after[name], op=hvd.Sum, name=f"{tag}.l.{name}").numpy()
        lhs += hvd.size() * result[name]
        rhs = hvd.allreduce(before[name] + sent[name], op=hvd.Sum, name=f"{tag}.r.{name}")
        np.testing.assert_allclose(lhs, rhs.numpy(), rtol=0, atol=1e-4)
    return after


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_fused_warmup_steps_equal_separate_allreduces(graph, allreduce_count):
    """Warm-up steps reduce the three sparse buckets with one allreduce, the result of
    one allreduce each and of Horovod's dense allreduce; the sparse steps after them are
    those of an unfused reducer, bit for bit; one trace does both kinds."""
    steps = FUSION_WARMUP + 3
    fused = fusion_tape(f"fuse.on.{graph}", graph, warmup_steps=FUSION_WARMUP)
    alone = fusion_tape(
        f"fuse.off.{graph}", graph, warmup_steps=FUSION_WARMUP, dense_fusion_bytes=0
    )
    fused_before = alone_before = None
    for step in range(steps):
        grads = fusion_grads(step)
        counted = int(allreduce_count.numpy())
        got = fused(*grads)
        fused_calls = int(allreduce_count.numpy()) - counted
        fused_stats = tape_reducer(f"fuse.on.{graph}").stats()
        counted += fused_calls
        expected = alone(*grads)
        alone_calls = int(allreduce_count.numpy()) - counted
        fused_reducer = tape_reducer(f"fuse.on.{graph}")
        alone_reducer = tape_reducer(f"fuse.off.{graph}")
        if step == 0:
            assert fused_reducer.fused_dense_runs == [FUSED_BUCKETS]
            assert alone_reducer.fused_dense_runs == []
            fused_before = {
                name: np.zeros_like(r) for name, r in residuals_by_bucket(fused_reducer).items()
            }
            alone_before = dict(fused_before)
        warm = step < FUSION_WARMUP
        # One allreduce for the three sparse buckets instead of three (plus the dense
        # bucket's); a sparse step's collectives are the same either way.
        if warm:
            assert (fused_calls, alone_calls) == (2, 4), step
        else:
            assert fused_calls == alone_calls, step
        exact = hvd.size() == 2 or not warm  # a ring over 3+ ranks sums a run in its own order
        for a, b in zip(got, expected):
            if exact:
                np.testing.assert_array_equal(a.numpy(), b.numpy())
            else:
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
        # Each bucket's record: a dense step's, with the bytes of its own share.
        alone_stats = tape_reducer(f"fuse.off.{graph}").stats()
        for field in ("bytes_sent", "bytes_received", "dense_bytes", "numel", "selected"):
            assert getattr(fused_stats, field) == getattr(alone_stats, field), field
        assert fused_stats.dense_buckets == alone_stats.dense_buckets == (4 if warm else 1)
        if warm:
            for i, (a, g) in enumerate(zip(got, grads)):
                dense = hvd.allreduce(g, name=f"fuse.dense.{graph}.{step}.{i}")
                np.testing.assert_allclose(a.numpy(), dense.numpy(), rtol=1e-6, atol=1e-7)
            for r in fused_reducer.residuals().values():
                np.testing.assert_array_equal(r.numpy(), np.zeros(r.shape, np.float32))
        fused_before = assert_mass_kept(
            fused_reducer, fused_before, grads, got, f"fuse.m.{graph}.{step}"
        )
        alone_before = assert_mass_kept(
            alone_reducer, alone_before, grads, expected, f"alone.m.{graph}.{step}"
        )
        assert_identical(got, f"fuse.{graph}.{step}")
        if graph and step == 0:  # a first call that creates variables traces twice
            traces = (
                fused.experimental_get_tracing_count(),
                alone.experimental_get_tracing_count(),
            )
    if graph:
        assert (
            fused.experimental_get_tracing_count(),
            alone.experimental_get_tracing_count(),
        ) == traces
    assert tape_reducer(f"fuse.on.{graph}").stats().sparse_buckets == 3


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_a_residual_owed_on_one_rank_joins_the_fused_allreduce(graph):
    """The fused branch is taken from the schedule, which every rank shares, not from
    a clear residual, which one rank may lack (a checkpoint restored on rank 0 only):
    that rank moves its residual into the fused allreduce, and no mass is left out."""
    name = f"fuse.owed.{graph}"
    fused = fusion_tape(name, graph, warmup_steps=FUSION_WARMUP)
    fused(*fusion_grads(0))
    reducer = tape_reducer(name)
    assert reducer.fused_dense_runs == [FUSED_BUCKETS]
    if hvd.rank() == 0:
        rng = np.random.default_rng(5)
        for r in reducer.residuals().values():
            r.assign(rng.standard_normal(r.shape).astype(np.float32))
    before = residuals_by_bucket(reducer)
    grads = fusion_grads(1)
    got = fused(*grads)
    owed = by_bucket(reducer, grads)
    result = by_bucket(reducer, got)
    for bucket in FUSED_BUCKETS:
        dense = hvd.allreduce(before[bucket] + owed[bucket], name=f"{name}.dense.{bucket}")
        np.testing.assert_allclose(result[bucket], dense.numpy(), rtol=1e-6, atol=1e-7)
    for r in reducer.residuals().values():
        np.testing.assert_array_equal(r.numpy(), np.zeros(r.shape, np.float32))
    assert_mass_kept(reducer, before, grads, got, f"{name}.m")
    assert_identical(got, name)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_density_decay_with_fused_warmup_on_the_tape(graph):
    """Fused warm-up, then each bucket's k follows budget(n_i, density_at(step))."""
    name = f"fuse.decay.{graph}"
    schedule = dict(warmup_steps=2, density_decay_steps=4)
    config = SparseConfig(density=0.05, **schedule)
    # Exactly k per sparse step is asserted below: the exact global selection's count.
    fused = fusion_tape(name, graph, global_selection="exact", **schedule)
    before = None
    for step in range(8):
        grads = fusion_grads(40 + step)
        got = fused(*grads)
        reducer = tape_reducer(name)
        if before is None:
            before = {n: np.zeros_like(r) for n, r in residuals_by_bucket(reducer).items()}
        for bucket, positions, _ in reducer.buckets:
            (p,) = positions  # one source per bucket here
            expected = budget(bucket.numel, config.density_at(step))
            if bucket.kind == "dense":
                expected = bucket.numel
            assert int(tf.math.count_nonzero(got[p])) == expected, (step, bucket.name)
        stats = reducer.stats()
        assert stats.selected == sum(
            budget(b.numel, config.density_at(step)) if b.kind == "sparse" else b.numel
            for b, _, _ in reducer.buckets
        )
        assert stats.dense_buckets == (4 if step < 2 else 1)
        before = assert_mass_kept(reducer, before, grads, got, f"{name}.m.{step}")
        assert_identical(got, f"{name}.{step}")
        if graph and step == 0:
            traces = fused.experimental_get_tracing_count()
    if graph:
        assert fused.experimental_get_tracing_count() == traces


def keras_fusion_model():
    keras.utils.set_random_seed(11)  # identical initial weights on every rank
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(96, activation="tanh"),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(48),
        ]
    )


def test_keras_fused_warmup_follows_the_trajectory_of_separate_allreduces():
    """model.fit with momentum correction (the velocity rides through the fused step):
    fused and separate warm-up allreduces give the same parameters and velocities,
    bit for bit at 2 ranks (a + b in any layout), to rounding at 3 and 4."""
    models, opts = [], []
    for fusion in (None, 0):
        model = keras_fusion_model()
        opt = hvds_keras.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            density=0.05,
            fusion_threshold_bytes=FUSION_BYTES,
            warmup_steps=FUSION_WARMUP,
            dense_fusion_bytes=fusion,
        )
        model.compile(optimizer=opt, loss="mse")
        rng = np.random.default_rng(3 + hvd.rank())
        x = rng.standard_normal((16 * (FUSION_WARMUP + 2), 64)).astype(np.float32)
        y = rng.standard_normal((16 * (FUSION_WARMUP + 2), 48)).astype(np.float32)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        models.append(model)
        opts.append(opt)
    fused, alone = opts
    kernels = ["sparse0.float32", "sparse1.float32", "sparse2.float32"]
    assert fused.fused_dense_runs == [kernels]
    assert alone.fused_dense_runs == []
    assert fused.momentum_correction and fused.stats().sparse_buckets == 3
    tolerance = dict(rtol=0, atol=0) if hvd.size() == 2 else dict(rtol=1e-6, atol=1e-7)
    for a, b in zip(models[0].trainable_variables, models[1].trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), **tolerance)
    for name, u in alone.velocity_variables().items():
        np.testing.assert_allclose(fused.velocity_variables()[name].numpy(), u.numpy(), **tolerance)
    assert_identical(models[0].trainable_variables, "kfuse")


def test_keras_log_every_prints_on_the_first_rank_and_training_goes_on(capsys):
    """model.fit with ``log_every=3`` for 6 steps: lines at steps 3 and 6 on rank 0 only,
    the last with the figures of ``stats()``; every rank's graph is the same (a rank-0-only
    branch in the traced step once hung the next collectives) and the weights agree."""
    model = keras_fusion_model()
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9),
        density=0.05,
        fusion_threshold_bytes=FUSION_BYTES,
        log_every=3,
    )
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(3 + hvd.rank())
    x = rng.standard_normal((16 * 6, 64)).astype(np.float32)
    y = rng.standard_normal((16 * 6, 48)).astype(np.float32)
    capsys.readouterr()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    lines = [line for line in capsys.readouterr().out.splitlines() if "[horovod_sparse]" in line]
    s = opt.stats()
    moved = s.bytes_sent + s.bytes_received
    if hvd.rank() == 0:
        assert len(lines) == 2, lines
        assert lines[0].startswith("[horovod_sparse] step 3: density "), lines
        assert lines[1].startswith(
            f"[horovod_sparse] step 6: density {s.density:.4f} (target 0.05), "
            f"{moved:,} bytes ({moved / s.dense_bytes:.2%} of dense), exchange "
        ), lines
    else:
        assert lines == []
    assert_identical(model.trainable_variables, "klog")


def make_model(seed=3):
    keras.utils.set_random_seed(seed)  # identical initial weights on every rank
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(5),
        ]
    )


def data(step, n=32):
    rng = np.random.default_rng(7919 * step + 31 * hvd.rank())
    return rng.standard_normal((n, 20)).astype(np.float32), rng.integers(0, 5, n)


def loss_fn(y, logits):
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    )


def test_gradient_tape_density_one_matches_horovod_tape():
    model = make_model()
    x, y = data(0)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    with tf.GradientTape() as tape2:
        loss2 = loss_fn(y, model(x))
    # Horovod's own tape calls .ref(), which Keras 3 variables lack: pass the tf.Variables.
    variables = [v.value for v in model.trainable_variables]
    sparse = hvds.DistributedGradientTape(tape, density=1.0, name="t1").gradient(loss, variables)
    dense = hvd.DistributedGradientTape(tape2).gradient(loss2, variables)
    for a, b in zip(sparse, dense):
        assert float(tf.norm(a - b) / tf.norm(b)) < 1e-6


@pytest.mark.parametrize("global_selection", ["reuse", "exact"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_buckets_refreshing_together_share_four_allreduces(
    graph, global_selection, collective_counts
):
    """Three sparse buckets on one tape: a step on which any threshold refreshes runs
    their radix selects together (4 allreduces in all, not 4 per bucket), a reused step
    none; the three share one alltoall and one allgather (common/joined.py). (The grouped keys
    equal separate selects: tests/unit/test_global_reuse.py.)"""
    name = f"group.{global_selection}.{graph}"
    grouped = fusion_tape(name, graph, global_selection=global_selection, refresh_steps=4)
    before, refreshes = None, []
    for step in range(10):
        grads = fusion_grads(step)
        start = {kind: int(c.numpy()) for kind, c in collective_counts.items()}
        got = grouped(*grads)
        issued = {kind: int(c.numpy()) - start[kind] for kind, c in collective_counts.items()}
        reducer = tape_reducer(name)
        refreshed = reducer.stats().global_refreshes
        refreshes.append(refreshed)
        assert reducer.stats().sparse_buckets == 3
        # The dense bucket's allreduce, plus 4 for the sparse ones on a refresh step.
        assert issued["alltoall_async"] == SCATTERS and issued["allgather_async"] == 1, issued
        assert issued["allreduce_sum_async"] == 1 + (4 if refreshed else 0), (step, issued)
        if before is None:
            before = {n: np.zeros_like(r) for n, r in residuals_by_bucket(reducer).items()}
        before = assert_mass_kept(reducer, before, grads, got, f"{name}.m.{step}")
        assert_identical(got, f"{name}.{step}")
    if global_selection == "exact":
        assert refreshes == [3] * 10  # every bucket, every step, in one radix select
    else:
        assert refreshes[0] == 3 and 0 in refreshes, refreshes


def test_gradient_tape_matches_reference_and_keeps_local_sources():
    keras.utils.set_random_seed(5)
    layer = keras.layers.Dense(200, use_bias=False)
    layer.build((None, 100))
    local = tf.Variable(tf.ones([3]))
    numel, density = 20_000, 0.05
    before = np.zeros(numel, np.float32)
    for step in range(3):
        rng = np.random.default_rng(17 * step + hvd.rank())
        x = rng.standard_normal((8, 100)).astype(np.float32)
        c = rng.standard_normal((8, 200)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x) * c) + tf.reduce_sum(local * float(hvd.rank() + 1))
        kernel_grad = (x.T @ c).reshape(-1)  # d loss / d kernel, this rank
        accumulators = gather_rows(before + kernel_grad, f"t2.acc.{step}")
        dtape = hvds.DistributedGradientTape(
            tape,
            density=density,
            op=hvd.Sum,
            name="t2",
            selection="exact",
            global_selection="exact",
        )
        dtape.register_local_source(local)
        g_kernel, g_local = dtape.gradient(loss, [layer.kernel, local])
        # Horovod's semantics: a local gradient is divided by the number of ranks.
        np.testing.assert_allclose(
            g_local.numpy(), np.full(3, (hvd.rank() + 1) / hvd.size(), np.float32), rtol=1e-6
        )
        expected = reference_step(
            accumulators, budget(numel, density), uniform_boundaries(numel, hvd.size())
        )
        got = g_kernel.numpy().reshape(-1)
        np.testing.assert_array_equal(np.flatnonzero(got), expected.selected)
        np.testing.assert_allclose(got, expected.result_sum, rtol=1e-5, atol=1e-5)
        (residual,) = dtape.residual_variables().values()
        np.testing.assert_allclose(
            residual.numpy(), expected.residuals[hvd.rank()], rtol=1e-5, atol=1e-5
        )
        before = residual.numpy().copy()
    assert dtape.stats().selected == budget(numel, density)


def test_tape_inside_tf_function_parameters_identical():
    model = make_model()
    opt = keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hvds.DistributedGradientTape(tape, density=0.05, name="t3")
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for s in range(10):
        step(*data(s))
    assert_identical(model.trainable_variables, "t3")


def assert_identical(variables, name):
    flat = tf.concat([tf.reshape(v, [-1]) for v in variables], axis=0)
    everyone = hvd.allgather(tf.reshape(flat, [1, -1]), name=f"ident.{name}").numpy()
    for r in range(hvd.size()):
        np.testing.assert_array_equal(everyone[r], flat.numpy(), err_msg=f"rank {r} differs")


def test_keras_fit_30_steps_identical_on_every_rank():
    model = make_model()
    opt = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.05)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.concatenate([data(s)[0] for s in range(30)])
    y = np.concatenate([data(s)[1] for s in range(30)])
    start = [v.numpy().copy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 30
    assert_identical(model.trainable_variables, "fit")
    moved = sum(
        float(np.abs(v.numpy() - s).sum()) for v, s in zip(model.trainable_variables, start)
    )
    assert moved > 0
    s = opt.stats()
    assert 0 < s.selected < s.numel
    assert isinstance(opt, hvds_keras.SparseOptimizerMixin) and isinstance(
        opt, keras.optimizers.SGD
    )


def test_keras_density_one_matches_dense_average():
    """One custom-loop step at density 1: the update equals SGD on the rank-averaged gradient."""
    model, ref = make_model(), make_model()
    opt = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), density=1.0)
    ref_opt = keras.optimizers.SGD(0.1)
    x, y = data(4)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    averaged = [hvd.allreduce(g, name=f"kd.{i}") for i, g in enumerate(grads)]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    ref_opt.apply_gradients(zip(averaged, ref.trainable_variables))
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_keras_backward_passes_per_step():
    model, ref = make_model(), make_model()
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), density=1.0, backward_passes_per_step=2
    )
    ref_opt = keras.optimizers.SGD(0.1)
    summed = None
    for s in range(2):
        x, y = data(10 + s)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        before = [v.numpy().copy() for v in model.trainable_variables]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if s == 0:  # no update on the first pass
            for v, b in zip(model.trainable_variables, before):
                np.testing.assert_array_equal(v.numpy(), b)
    averaged = [hvd.allreduce(g, name=f"bpps.{i}") for i, g in enumerate(summed)]
    ref_opt.apply_gradients(zip(averaged, ref.trainable_variables))
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_keras_momentum_correction_at_density_one_equals_keras_momentum_sgd(nesterov):
    """Sums are linear: the average of per-rank velocities is the velocity of the average."""
    model, ref = make_model(), make_model()
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9, nesterov=nesterov),
        density=1.0,
        momentum_correction=True,
    )
    ref_opt = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=nesterov)
    for step in range(8):
        x, y = data(40 + step)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            ref_loss = loss_fn(y, ref(x))
        ref_grads = tape.gradient(ref_loss, ref.trainable_variables)
        averaged = [
            hvd.allreduce(g, name=f"kmc1.{nesterov}.{step}.{i}") for i, g in enumerate(ref_grads)
        ]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        ref_opt.apply_gradients(zip(averaged, ref.trainable_variables))
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert opt.momentum_correction and opt.momentum == 0.0  # the wrapped SGD steps plainly
    assert opt.get_config()["momentum"] == 0.9 and opt.get_config()["nesterov"] == nesterov
    velocities = opt.velocity_variables()
    assert velocities and all(any(u is v for v in opt.variables) for u in velocities.values())
    assert_identical(model.trainable_variables, f"kmc1.{nesterov}")


def test_keras_momentum_correction_sends_velocity_and_masks_it():
    """The exchange carries m * velocity + grad; the entries a rank sent leave its velocity."""
    numel, density, momentum = 20_000, 0.02, 0.9
    k = budget(numel, density)
    weight = keras.Variable(np.zeros(numel, np.float32), name="w")
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(1.0, momentum=momentum),
        density=density,
        selection="exact",
        global_selection="exact",
    )
    assert opt.momentum_correction  # the default for a sparse momentum SGD
    residual, velocity = np.zeros(numel, np.float32), np.zeros(numel, np.float32)
    masked_total = 0
    for step in range(5):
        grad = local_grad(step, numel)
        update = momentum * velocity + grad.numpy()
        acc = residual + update
        everyone = gather_rows(tf.constant(acc), f"kmc.acc.{step}")
        before = weight.numpy().copy()
        opt.apply_gradients([(grad, weight)])
        got = before - weight.numpy()  # lr 1, no momentum left in the wrapped SGD
        ref = reference_step(everyone, k, uniform_boundaries(numel, hvd.size()))
        np.testing.assert_array_equal(np.flatnonzero(got), ref.selected)
        np.testing.assert_allclose(got, ref.result_sum / hvd.size(), rtol=1e-5, atol=1e-5)
        (residual_variable,) = opt.residual_variables().values()
        residual = residual_variable.numpy().copy()
        np.testing.assert_allclose(residual, ref.residuals[hvd.rank()], rtol=1e-5, atol=1e-5)
        sent = np.argsort(-np.abs(acc), kind="stable")[:k]
        expected_velocity = update.copy()
        expected_velocity[sent] = 0
        (velocity_variable,) = opt.velocity_variables().values()
        velocity = velocity_variable.numpy().copy()
        np.testing.assert_allclose(velocity, expected_velocity, rtol=1e-6, atol=1e-6)
        masked_total += int((velocity == 0).sum())
    assert masked_total >= 5 * k


def test_keras_momentum_correction_resolution():
    sgd = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    plain = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
    adam = hvds_keras.DistributedOptimizer(keras.optimizers.Adam())
    adamw = hvds_keras.DistributedOptimizer(keras.optimizers.AdamW())
    amsgrad = hvds_keras.DistributedOptimizer(keras.optimizers.Adam(amsgrad=True))
    dense = hvds_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=1.0)
    dense_adam = hvds_keras.DistributedOptimizer(keras.optimizers.Adam(), density=1.0)
    off = hvds_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), momentum_correction=False
    )
    assert sgd.momentum_correction and adam.momentum_correction and adamw.momentum_correction
    assert not any(o.momentum_correction for o in (plain, amsgrad, dense, dense_adam, off))
    assert off.momentum == 0.9 and dense.momentum == 0.9
    # Asked for where it cannot apply: refused when built, on every rank, before any step.
    insisted = hvds_keras.DistributedOptimizer(keras.optimizers.RMSprop(), momentum_correction=True)
    with pytest.raises(ValueError, match=r"momentum_correction=True needs keras\.optimizers\.SGD"):
        insisted.build(make_model().trainable_variables)
    insisted = hvds_keras.DistributedOptimizer(
        keras.optimizers.Adam(amsgrad=True), momentum_correction=True
    )
    with pytest.raises(ValueError, match="amsgrad"):
        insisted.build(make_model().trainable_variables)


@pytest.mark.parametrize("density", [1.0, 0.05])
def test_keras_adam_correction_exchanges_each_ranks_adam_direction(density):
    """Each rank's own Adam direction m_hat / (sqrt(v) + eps) is exchanged (with error
    feedback at density < 1) and the variable steps by -lr times the reduced direction;
    v is the P-rank average's second moment, v_hat / P + (1 - 1/P) min(m_hat^2, v_hat).

    With a small epsilon Adam's first direction is sign(g): every magnitude ties at 1 and
    float rounding picks the top k. An epsilon of 1 keeps the magnitudes |g| / (|g| + 1)
    apart (about 5e-5 between neighbours here), so the exact reference selection holds."""
    numel, lr, (beta1, beta2, eps) = 20_000, 0.01, (0.9, 0.999, 1.0)
    k = budget(numel, density)
    weight = keras.Variable(np.zeros(numel, np.float32), name="w")
    opt = hvds_keras.DistributedOptimizer(
        keras.optimizers.Adam(lr, beta_1=beta1, beta_2=beta2, epsilon=eps),
        density=density,
        selection="exact",
        global_selection="exact",  # the reference selects exactly
        momentum_correction=True,
    )
    first = np.zeros(numel, np.float64)
    second = np.zeros(numel, np.float64)
    residual = np.zeros(numel, np.float32)
    expected = np.zeros(numel, np.float64)
    for t in range(1, 6):
        grad = local_grad(60 + t, numel)
        g = grad.numpy().astype(np.float64)
        first = beta1 * first + (1 - beta1) * g
        second = beta2 * second + (1 - beta2) * g * g
        m_hat, v_hat = first / (1 - beta1**t), second / (1 - beta2**t)
        ranks = hvd.size()
        v = v_hat / ranks + (1 - 1 / ranks) * np.minimum(m_hat * m_hat, v_hat)
        direction = m_hat / (np.sqrt(v) + eps)
        acc = residual + direction.astype(np.float32)
        everyone = gather_rows(tf.constant(acc), f"kadam.{density}.{t}")
        opt.apply_gradients([(grad, weight)])
        ref = reference_step(everyone, k, uniform_boundaries(numel, hvd.size()))
        expected -= lr * ref.result_sum / hvd.size()
        np.testing.assert_allclose(weight.numpy(), expected, rtol=1e-4, atol=1e-6)
        (residual_variable,) = opt.residual_variables().values()
        residual = residual_variable.numpy().copy()
        np.testing.assert_allclose(residual, ref.residuals[hvd.rank()], rtol=1e-4, atol=1e-5)
    (moments,) = opt.moment_variables().values()
    np.testing.assert_allclose(moments[0].numpy(), first, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(moments[1].numpy(), second, rtol=1e-4, atol=1e-8)
    assert all(any(m is v for v in opt.variables) for m in moments)
    assert_identical([weight], f"kadam.{density}")


def test_keras_residuals_in_checkpoint(tmp_path_factory):
    model = make_model()
    opt = hvds_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3), density=0.05)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(20, n=128)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    residuals = opt.residual_variables()
    assert residuals and all(any(r is v for v in opt.variables) for r in residuals.values())
    saved = {k: v.numpy().copy() for k, v in residuals.items()}
    assert any(np.abs(v).sum() > 0 for v in saved.values())
    path = str(tmp_path_factory.mktemp(f"ckpt{hvd.rank()}") / "ckpt")
    save_path = tf.train.Checkpoint(model=model, optimizer=opt).save(path)
    for v in residuals.values():
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=model, optimizer=opt).restore(save_path)
    for k, v in opt.residual_variables().items():
        np.testing.assert_array_equal(v.numpy(), saved[k])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="density"):
        hvds.sparse_allreduce(tf.ones([10]), density=1.5, name="bad")
    with pytest.raises(TypeError, match="floating"):
        hvds.sparse_allreduce(tf.ones([10], tf.int32), name="bad")
    with pytest.raises(ValueError, match="op="):
        hvds.sparse_allreduce(tf.ones([10]), name="bad", op=hvd.Adasum)
