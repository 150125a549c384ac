"""The parallel test runner's grouping of files into launches and its reading of reports
(``tests/run_parallel.py``), without launching anything."""

from pathlib import Path

from tests.run_parallel import HERE, file_of, launch_groups, output_tails, parse_reports


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_files_of_one_kind_share_a_launch_and_process_sets_launch_alone(tmp_path):
    torch_a = write(tmp_path, "test_a_torch.py", "hvd.init()\n")
    tf_a = write(tmp_path, "test_a_tf.py", "hvd.init()\n")
    ddp = write(tmp_path, "test_ddp_x.py", "dist.init_process_group('gloo')\n")
    sets = write(tmp_path, "test_sets_torch.py", "hvd.init(process_sets=[even])\n")
    sets_tf = write(tmp_path, "test_sets_tf.py", "hvd.init(\n    process_sets=[even]\n)\n")
    torch_b = write(tmp_path, "test_b.py", "import x\nhvd.init()\n")
    tf_b = write(tmp_path, "test_tensorflow.py", "hvd.init( )\n")
    files = [torch_a, tf_a, ddp, sets, sets_tf, torch_b, tf_b]
    assert launch_groups(files) == [[torch_a, torch_b], [tf_a, tf_b], [ddp], [sets], [sets_tf]]
    assert launch_groups(files, alone=True) == [[path] for path in files]


def test_every_test_id_maps_to_its_file():
    group = [HERE / "parallel" / "test_ddp.py", HERE / "parallel" / "test_ddp_adam.py"]
    assert file_of("tests.parallel.test_ddp::test_x", group) == group[0]
    assert file_of("tests.parallel.test_ddp_adam::test_x[2]", group) == group[1]
    assert file_of("tests.parallel.test_ddp_adam.TestClass::test_x", group) == group[1]
    assert file_of("::tests.parallel.test_ddp_adam", group) == group[1]  # collection error
    assert file_of("tests.parallel.test_ddp_amp::test_x", group) is None


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.parallel.test_a" name="test_ok"/>
<testcase classname="tests.parallel.test_a" name="test_flaky">{flaky}</testcase>
<testcase classname="tests.parallel.test_b" name="test_skip"><skipped/></testcase>
</testsuite></testsuites>"""


def test_a_test_passes_only_if_it_passed_on_every_rank(tmp_path):
    (tmp_path / "rank0.xml").write_text(JUNIT.format(flaky=""))
    (tmp_path / "rank1.xml").write_text(JUNIT.format(flaky="<failure/>"))
    outcomes, problems = parse_reports(tmp_path, 2)
    assert outcomes == {
        "tests.parallel.test_a::test_ok": "passed",
        "tests.parallel.test_a::test_flaky": "failed",
        "tests.parallel.test_b::test_skip": "skipped",
    }
    assert problems == []
    outcomes, problems = parse_reports(tmp_path, 3)
    assert problems == ["rank 2 wrote no report"] + [
        f"rank 2 did not run {test_id}" for test_id in sorted(outcomes)
    ]
    assert set(outcomes.values()) == {"failed"}


def test_a_failed_launch_shows_each_ranks_own_tail():
    """A rank that aborted early keeps its last lines even when the other ranks wrote
    far more after it."""
    lines = ["[1]<stderr>:terminate called: the cause", "[1]<stderr>:Fatal Python error: Aborted"]
    lines += [f"[0]<stdout>:rank 0 line {i}" for i in range(500)]
    lines += ["mpirun noticed that a rank exited", "[2]<stdout>:rank 2 last"]
    shown = output_tails("\n".join(lines), lines=3).splitlines()
    assert shown == [
        "-- rank 0: 3 of 500 lines --",
        "[0]<stdout>:rank 0 line 497",
        "[0]<stdout>:rank 0 line 498",
        "[0]<stdout>:rank 0 line 499",
        "-- rank 1: 2 of 2 lines --",
        "[1]<stderr>:terminate called: the cause",
        "[1]<stderr>:Fatal Python error: Aborted",
        "-- rank 2: 1 of 1 lines --",
        "[2]<stdout>:rank 2 last",
        "-- unprefixed: 1 of 1 lines --",
        "mpirun noticed that a rank exited",
    ]
