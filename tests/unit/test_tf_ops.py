"""benchmarks/tf_ops.py: kernels are told from the executor's and profiler's own events,
summed by op type over TF's compute threads only, and divided by the profiled steps."""

import pytest
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tests.scripts import load_script


@pytest.fixture(scope="module")
def tf_ops():
    return load_script("benchmarks/tf_ops.py")


def space_of(plane_name: str, lines: dict[str, list[tuple[str, float]]]) -> xplane_pb2.XSpace:
    """An XSpace with one plane whose lines hold (event name, milliseconds) events."""
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name=plane_name)
    ids: dict[str, int] = {}
    for line_name, events in lines.items():
        line = plane.lines.add(name=line_name)
        for name, ms in events:
            if name not in ids:
                ids[name] = len(ids) + 1
                plane.event_metadata[ids[name]].name = name
            line.events.add(metadata_id=ids[name], duration_ps=int(ms * 1e9))
    return space


def test_op_type_is_the_kernel_type_and_none_for_other_events(tf_ops):
    assert tf_ops.op_type("gradient_tape/dense/MatMul/MatMul_1:_MklMatMul") == "_MklMatMul"
    assert tf_ops.op_type("cond_5/then/_49/cond_5/PyFuncStateless:PyFuncStateless") == (
        "PyFuncStateless"
    )
    for other in ("ExecutorState::Process", "ExecutorState::ProcessAsync::Done", "train_step"):
        assert tf_ops.op_type(other) is None
    assert tf_ops.op_type("region:StartRegion") is None


def test_tally_sums_kernels_by_type_over_compute_threads_per_step(tf_ops):
    space = space_of(
        "/host:CPU",
        {
            "tf_Compute/1": [
                ("ExecutorState::Process", 10.0),
                ("a/MatMul:_MklMatMul", 4.0),
                ("b/Mul:Mul", 1.0),
            ],
            "tf_Compute/2": [
                ("ExecutorState::Process", 6.0),
                ("c/MatMul:_MklMatMul", 2.0),
                ("r:StartRegion", 5.0),
            ],
            # Python's line (eager calls, the traced call itself) is not a kernel's.
            "python": [("EagerLocalExecute: x:Mul", 50.0)],
        },
    )
    result = tf_ops.tally(space, steps=2)
    assert result["kernels_ms"] == pytest.approx(3.5)
    assert result["kernels"] == pytest.approx(1.5)
    assert result["executor_ms"] == pytest.approx(8.0)
    assert result["by_type"]["_MklMatMul"] == pytest.approx({"ms": 3.0, "count": 1.0})
    assert result["by_type"]["Mul"] == pytest.approx({"ms": 0.5, "count": 0.5})
    assert list(result["by_type"]) == ["_MklMatMul", "Mul"]  # largest first


def test_tally_reads_only_the_host_plane(tf_ops):
    space = space_of("/device:GPU:0", {"tf_Compute/1": [("a/MatMul:_MklMatMul", 4.0)]})
    assert tf_ops.tally(space, steps=1)["kernels"] == 0


def test_markdown_ranks_types_by_their_largest_time_in_any_mode(tf_ops):
    modes = {
        "dense": {
            "step_ms": 20.0,
            "executor_ms": 12.0,
            "kernels_ms": 10.0,
            "kernels": 70.0,
            "by_type": {"MatMul": {"ms": 9.0, "count": 5.0}, "Mul": {"ms": 1.0, "count": 13.0}},
        },
        "sparse": {
            "step_ms": 30.0,
            "executor_ms": 24.0,
            "kernels_ms": 18.0,
            "kernels": 300.0,
            "by_type": {"MatMul": {"ms": 9.5, "count": 5.0}, "PyFunc": {"ms": 4.0, "count": 6.0}},
        },
    }
    lines = tf_ops.markdown(modes, top=2).splitlines()
    assert lines[2] == "| step, wall | 20.00 |  | 30.00 |  |"
    assert lines[4] == "| kernels | 10.00 | 70.0 | 18.00 | 300.0 |"
    assert lines[5] == "| `MatMul` | 9.00 | 5.0 | 9.50 | 5.0 |"
    assert lines[6] == "| `PyFunc` | 0.00 | 0.0 | 4.00 | 6.0 |"  # absent in dense: zero
    assert len(lines) == 7  # Mul (1 ms) is past the top 2
