"""Run every ``tests/parallel/test_*.py`` under ``horovodrun`` at several world sizes.

Files are launched in groups, once per group and world size, with ``horovodrun -np N
-H localhost:N --gloo`` (``test_ddp*.py``: ``torchrun --standalone --nproc-per-node N``,
as DDP jobs launch); every rank runs one pytest session over the group's files and writes
a JUnit report. A group holds the files of one launcher and one framework; a file that
initializes Horovod with arguments (process sets) runs alone, since Horovod starts once
a process. One launch per group instead of per file saves each file's process start,
imports and Horovod start (about 10 s a file for torch and 20 s for TF at 2 ranks on 2
cores, more at 4). ``--alone`` launches every file by itself.

A test passes at size N only if it passed on every rank. Skipped tests, missing reports
(a crashed rank), a file of which no test ran (without ``-k``), a launch in which none
ran, and launches that exceed the timeout count as failures. Each rank gets the cores
shared among the ranks as its thread count, as ``torchrun`` gives (``rank_threads``).
Prints a line per file and size, a pytest-style closing line, and exits non-zero on any
failure; a failed launch prints each rank's last lines and keeps its whole output under
``results/parallel-logs/``.

Usage: python -m tests.run_parallel [-k EXPR] [--sizes 2,3,4] [--timeout 420] [--alone]
       [FILES...]
"""

from __future__ import annotations

import argparse
import os
import re
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


def framework(path: Path) -> str:
    """The launcher and framework a test file runs under: files of one kind share a launch."""
    if path.name.startswith("test_ddp"):
        return "torchrun"
    if path.stem.endswith("_tf") or path.name == "test_tensorflow.py":
        return "tensorflow"
    return "torch"


def launches_alone(path: Path) -> bool:
    """Whether the file starts Horovod with arguments (``hvd.init(process_sets=...)`` at
    import): Horovod starts once per process, so such a file cannot share a launch."""
    return re.search(r"^hvd\.init\(\s*[^)\s]", path.read_text(), re.MULTILINE) is not None


def launch_groups(files: list[Path], alone: bool = False) -> list[list[Path]]:
    """Files grouped into launches, in the order given: one group per kind
    (:func:`framework`), and a group of its own for each file that must launch alone."""
    groups: dict[str, list[Path]] = {}
    for path in files:
        key = str(path) if alone or launches_alone(path) else framework(path)
        groups.setdefault(key, []).append(path)
    return list(groups.values())


def file_of(test_id: str, group: list[Path]) -> Path | None:
    """The file of the group a JUnit test id belongs to: its classname is the module path
    (``tests.parallel.test_x`` or ``tests.parallel.test_x.Class``); a collection error has
    an empty classname and the module path as its name."""
    for path in group:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if test_id == f"::{module}" or test_id.startswith((f"{module}::", f"{module}.")):
            return path
    return None


def report_by_file(
    group: list[Path],
    world_size: int,
    outcomes: dict[str, str],
    keyword: str | None,
    launch_problems: list[str],
) -> list[str]:
    """Prints a line per file of the group; returns a message per test that did not pass,
    and adds to ``launch_problems`` each file of which no test ran."""
    by_file: dict[Path | None, dict[str, str]] = {path: {} for path in group}
    for test_id, outcome in outcomes.items():
        by_file.setdefault(file_of(test_id, group), {})[test_id] = outcome
    messages = []
    for path, results in by_file.items():
        passed = sum(1 for o in results.values() if o == "passed")
        where = f"{path.relative_to(ROOT) if path else 'outside the group'} [np={world_size}]"
        print(f"{where}: {passed} passed, {len(results) - passed} failed", flush=True)
        if path is not None and not results and keyword is None:
            # With -k, a file may hold no test that matches: the group's others run.
            launch_problems.append(f"no test of {path.name} ran")
        for test_id, outcome in sorted(results.items()):
            if outcome != "passed":
                messages.append(f"{outcome.upper()} {where} {test_id}")
    return messages


def launch(
    group: list[Path], world_size: int, timeout: float, keyword: str | None
) -> tuple[int, int, list[str]]:
    """Run one group of files at one world size; returns (passed, failed, messages)."""
    with tempfile.TemporaryDirectory(prefix="hvds-reports-") as tmp:
        report_dir = Path(tmp)
        worker = [sys.executable, str(HERE / "parallel_worker.py"), str(report_dir)]
        worker += [str(path) for path in group]
        if framework(group[0]) == "torchrun":
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
    names = ", ".join(path.name for path in group)
    label = f"[{names}] [np={world_size}]"
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
    messages = report_by_file(group, world_size, outcomes, keyword, launch_problems)
    if not outcomes:
        launch_problems.append("no test ran")
    passed = sum(1 for o in outcomes.values() if o == "passed")
    failed = len(outcomes) - passed + len(launch_problems)
    status = "ok" if failed == 0 else "FAILED"
    summary = f"  launch of {len(group)} file(s) [np={world_size}]: {elapsed:.1f}s {status}"
    print(summary, flush=True)
    messages += [f"FAILED {label}: {p}" for p in problems + launch_problems]
    if failed:
        log = save_output(output, group, world_size)
        messages.append(
            f"---- output of {label}, the last {TAIL_LINES} lines of each rank "
            f"(all of it: {log}) ----\n{output_tails(output)}"
        )
    return passed, failed, messages


# Lines of each rank's output a failed launch prints. One rank's abort can come long
# before the other ranks stop writing, so a tail of the whole interleaved output can miss
# it: each rank's own tail keeps it.
TAIL_LINES = 60
_RANK_PREFIX = re.compile(r"^\[(\d+)\]<(?:stdout|stderr)>:")


def output_tails(output: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of each rank's output (``horovodrun``'s ``[N]<stdout>:``
    prefixes; ``torchrun``'s and the launcher's own lines as one more stream), in rank
    order."""
    streams: dict[str, list[str]] = {}
    for line in output.splitlines():
        match = _RANK_PREFIX.match(line)
        streams.setdefault(f"rank {match.group(1)}" if match else "unprefixed", []).append(line)

    def order(name: str) -> tuple[int, int]:
        return (0, int(name.split()[1])) if name.startswith("rank ") else (1, 0)

    parts = []
    for name in sorted(streams, key=order):
        kept = streams[name][-lines:]
        parts.append(f"-- {name}: {len(kept)} of {len(streams[name])} lines --")
        parts += kept
    return "\n".join(parts)


def save_output(output: str, group: list[Path], world_size: int) -> Path:
    """Write a failed launch's whole output under ``results/parallel-logs/``; its path."""
    folder = ROOT / "results" / "parallel-logs"
    folder.mkdir(parents=True, exist_ok=True)
    stem = "+".join(path.stem for path in group)[:150]
    log = folder / f"{stem}.np{world_size}.{time.strftime('%Y%m%d-%H%M%S')}.log"
    log.write_text(output)
    return log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--sizes", default=os.environ.get("HOROVOD_SPARSE_TEST_SIZES", "2,3,4"))
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per file in a launch")
    parser.add_argument("--alone", action="store_true", help="launch every file by itself")
    parser.add_argument("-k", dest="keyword", default=None)
    args = parser.parse_args()
    files = [f.resolve() for f in args.files] or sorted((HERE / "parallel").glob("test_*.py"))
    sizes = [int(s) for s in args.sizes.split(",")]
    start = time.monotonic()
    passed = failed = 0
    messages: list[str] = []
    for group in launch_groups(files, args.alone):
        for world_size in sizes:
            p, f, m = launch(group, world_size, args.timeout * len(group), args.keyword)
            passed, failed, messages = passed + p, failed + f, messages + m
    for message in messages:
        print(message)
    elapsed = time.monotonic() - start
    print(f"========== {passed} passed, {failed} failed in {elapsed:.1f}s (parallel) ==========")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
