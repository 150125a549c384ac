"""benchmarks/time_to_accuracy.py: the time to dense's final metric is read off the curves
as the table says (first evaluation that reaches it; "not reached" and the gap otherwise)."""

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tta():
    return load_script("benchmarks/time_to_accuracy.py")


def run(points, seed=0):
    """A run's JSON as the examples write it: (step, seconds, validation loss) points."""
    curve = [{"step": s, "seconds": t, "val_loss": v} for s, t, v in points]
    return {"curve": curve, "seed": seed, "bytes_per_step": 10.0, "dense_bytes_per_step": 100.0}


def test_steps_and_seconds_to_dense_final_loss(tta):
    task = tta.TASKS["char_lm"]
    runs = {
        tta.DENSE: [run([(0, 0.0, 4.0), (50, 10.0, 2.6), (99, 20.0, 2.5)])],
        "fast": [run([(0, 0.0, 4.0), (50, 4.0, 2.5), (99, 8.0, 2.4)])],
        "slow": [run([(0, 0.0, 4.0), (50, 5.0, 2.7), (99, 10.0, 2.6)])],
    }
    rows = {row["mode"]: row for row in tta.summarize(task, 2, "loopback", runs)}
    assert rows[tta.DENSE]["steps_to_target"] == 99 and rows[tta.DENSE]["speedup"] == 1.0
    assert rows["fast"]["targets"] == [2.5] and rows["fast"]["reached"] == "1/1"
    assert rows["fast"]["steps_to_target"] == 50 and rows["fast"]["seconds_to_target"] == 4.0
    assert rows["fast"]["speedup"] == pytest.approx(20.0 / 4.0)
    assert rows["slow"]["reached"] == "0/1" and rows["slow"]["steps_to_target"] is None
    assert rows["slow"]["speedup"] is None and rows["slow"]["final_gap"] == "+4.0%"
    assert rows["fast"]["seconds_per_step"] == pytest.approx(8.0 / 100)
    table = tta.table(list(rows.values()))
    assert "not reached" in table and "5.00x" in table


def test_higher_is_better_for_accuracy(tta):
    task = tta.TASKS["digits"]
    assert task.reached(97.0, 96.5) and not task.reached(96.0, 96.5)
    assert task.gap(96.0, 96.5) == "-0.50 points"
    assert not tta.TASKS["char_lm"].reached(2.6, 2.5)


def test_every_task_trains_dense_horovod_first_and_every_torch_task_the_ddp_hook(tta):
    for task in tta.TASKS.values():
        names = [mode.name for mode in task.modes]
        assert names[0] == tta.DENSE and "sparse (defaults)" in names, names
        torch_task = all("pytorch" in mode.script for mode in task.modes)
        assert torch_task == ("DDP sparse hook" in names), names
        for mode in task.modes:
            assert (ROOT / mode.script).is_file(), mode.script
    assert "tensorflow2" in tta.TASKS["keras_digits"].modes[0].script


def test_a_subset_of_modes_always_trains_dense_and_refuses_unknown_names(tta):
    tasks = [tta.TASKS["wide_mlp"]]
    every = {mode.name for mode in tasks[0].modes}
    assert tta.chosen_modes(tasks, None) == every
    assert tta.chosen_modes(tasks, "sparse (defaults)") == {tta.DENSE, "sparse (defaults)"}
    with pytest.raises(SystemExit, match="unknown modes"):
        tta.chosen_modes(tasks, "sparse")


def test_the_wide_mlp_task_has_25m_parameters_and_the_same_data_on_every_rank():
    wide_mlp = load_script("examples/pytorch/wide_mlp.py")
    parameters = sum(p.numel() for p in wide_mlp.model().parameters())
    assert parameters == 25_583_716
    first, second = wide_mlp.load_split(), wide_mlp.load_split()
    for a, b in zip(first, second):
        assert a.equal(b)
    x_train, y_train, x_test, y_test = first
    assert x_train.shape == (16_384, 2048) and x_test.shape == (4_096, 2048)
    assert y_test.shape == (4_096,)
    assert set(y_train.tolist()) == set(range(100)) and not x_train[:4096].equal(x_test)
    args = wide_mlp.digits_cnn.parse([], **wide_mlp.DEFAULTS)
    assert (args.steps, args.batch_size, args.lr, args.eval_every) == (250, 16, 0.0025, 25)
    assert wide_mlp.digits_cnn.parse([]).steps == 600  # the digits task's own defaults
