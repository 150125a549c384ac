"""Run every ``tests/parallel/test_*.py`` under ``horovodrun`` at several world sizes.

Each file is launched once per world size with ``horovodrun -np N -H localhost:N --gloo``
(``test_ddp*.py``: ``torchrun --standalone --nproc-per-node N``, as DDP jobs launch);
every rank runs pytest on the file and writes a JUnit report. A test passes at size N
only if it passed on every rank. Skipped tests, missing reports (a crashed rank) and
launches that exceed the timeout count as failures. Each rank gets the cores shared
among the ranks as its thread count, as ``torchrun`` gives (``rank_threads``). Prints a
pytest-style closing line and exits non-zero on any failure.

Usage: python -m tests.run_parallel [-k EXPR] [--sizes 2,3,4] [--timeout 420] [FILES...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_reports(report_dir: Path, world_size: int) -> tuple[dict[str, str], list[str]]:
    """Outcome per test id (worst over ranks) and problems found (missing reports)."""
    outcomes: dict[str, str] = {}
    problems = []
    rank_ids: list[set[str]] = []
    for rank in range(world_size):
        path = report_dir / f"rank{rank}.xml"
        if not path.exists():
            problems.append(f"rank {rank} wrote no report")
            rank_ids.append(set())
            continue
        ids = set()
        for case in ET.parse(path).getroot().iter("testcase"):
            test_id = f"{case.get('classname')}::{case.get('name')}"
            ids.add(test_id)
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            if outcomes.get(test_id, "passed") == "passed":
                outcomes[test_id] = outcome
        rank_ids.append(ids)
    union = set().union(*rank_ids) if rank_ids else set()
    for rank, ids in enumerate(rank_ids):
        for test_id in sorted(union - ids):
            outcomes[test_id] = "failed"
            problems.append(f"rank {rank} did not run {test_id}")
    return outcomes, problems


def rank_threads(world_size: int) -> dict[str, str]:
    """Intra-op threads per rank, as ``torchrun`` sets them for a multi-rank job: the
    cores this process may use, shared among the ranks (a value already set stands).

    ``horovodrun`` sets none, and ranks that each start a thread per core preempt one
    another: ``test_overlap_torch.py`` at 4 ranks on 2 cores took 168 s at torch's
    default threads and 44 s at one. The plugin's own sizing of its kernels' threads
    (``torch/threads.py``) is tested in ``tests/unit/test_threads.py``."""
    from horovod_sparse.torch.threads import cores_available  # imports torch: here only

    per_rank = str(max(1, cores_available() // world_size))
    return {
        name: os.environ.get(name, per_rank)
        for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")
    }


def launch(
    path: Path, world_size: int, timeout: float, keyword: str | None
) -> tuple[int, int, list[str]]:
    """Run one file at one world size; returns (passed, failed, messages)."""
    with tempfile.TemporaryDirectory(prefix="hvds-reports-") as tmp:
        report_dir = Path(tmp)
        worker = [sys.executable, str(HERE / "parallel_worker.py"), str(path), str(report_dir)]
        if path.name.startswith("test_ddp"):
            # torch.distributed tests launch as DDP users launch: torchrun, a free port.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", str(world_size), *worker[1:]]
        else:
            cmd = ["horovodrun", "-np", str(world_size), "-H", f"localhost:{world_size}"]
            cmd += ["--gloo", *worker]
        if keyword:
            cmd += ["-k", keyword]
        env = dict(os.environ, PYTHONPATH=str(ROOT), HOROVOD_SPARSE_TEST_WORLD_SIZE=str(world_size))
        env.update(rank_threads(world_size))
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            # horovodrun starts each worker in a session of its own: find them by the
            # report directory on their command line, or they would spin on.
            subprocess.run(["pkill", "-9", "-f", str(report_dir)], check=False)
            output, _ = proc.communicate()
        elapsed = time.monotonic() - start
        outcomes, problems = parse_reports(report_dir, world_size)
    label = f"{path.relative_to(ROOT)} [np={world_size}]"
    messages = []
    # Launch-level problems count as one failure each, on top of the tests' own outcomes.
    launch_problems = []
    if timed_out:
        launch_problems.append(f"timed out after {timeout:.0f}s")
    if (
        proc.returncode not in (0, None)
        and not timed_out
        and all(o == "passed" for o in outcomes.values())
    ):
        launch_problems.append(f"the launcher exited with {proc.returncode}")
    if not outcomes:
        launch_problems.append("no test ran")
    passed = sum(1 for o in outcomes.values() if o == "passed")
    failed = len(outcomes) - passed + len(launch_problems)
    status = "ok" if failed == 0 else "FAILED"
    print(
        f"{label}: {passed} passed, {len(outcomes) - passed} failed, {elapsed:.1f}s {status}",
        flush=True,
    )
    for test_id, outcome in sorted(outcomes.items()):
        if outcome != "passed":
            messages.append(f"{outcome.upper()} {label} {test_id}")
    messages += [f"FAILED {label}: {p}" for p in problems + launch_problems]
    if failed:
        tail = "\n".join(output.splitlines()[-80:])
        messages.append(f"---- output of {label} (last 80 lines) ----\n{tail}")
    return passed, failed, messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--sizes", default=os.environ.get("HOROVOD_SPARSE_TEST_SIZES", "2,3,4"))
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per launch")
    parser.add_argument("-k", dest="keyword", default=None)
    args = parser.parse_args()
    files = [f.resolve() for f in args.files] or sorted((HERE / "parallel").glob("test_*.py"))
    sizes = [int(s) for s in args.sizes.split(",")]
    start = time.monotonic()
    passed = failed = 0
    messages: list[str] = []
    for path in files:
        for world_size in sizes:
            p, f, m = launch(path, world_size, args.timeout, args.keyword)
            passed, failed, messages = passed + p, failed + f, messages + m
    for message in messages:
        print(message)
    elapsed = time.monotonic() - start
    print(f"========== {passed} passed, {failed} failed in {elapsed:.1f}s (parallel) ==========")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
