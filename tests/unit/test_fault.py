"""Non-elastic training with one rank killed: the survivors fail fast with a clear error.

Launches plain ``horovodrun -np N --gloo`` (no elastic mode) on this machine with
``tests/fault/train_fault.py``. One rank kills itself with SIGKILL mid-run. Every
survivor must raise Horovod's shutdown error from its own collective, and be gone,
within ``DEADLINE_S`` of the kill; ``horovodrun`` must exit non-zero. Dense Horovod at
world size 2 is the control.

``horovodrun`` itself ends the remaining workers once one has died (SIGTERM, then SIGKILL
five seconds later), which would hide a survivor stuck in a collective. The worker
therefore ignores SIGTERM, and the test requires each survivor's own error report, which
a stuck survivor never writes: in practice a survivor must raise within about five
seconds of the first death, well inside ``DEADLINE_S``. Survivors leave with ``os._exit``
right after the report (see the worker's docstring), so one survivor's slow interpreter
teardown does not delay the error of another that waits on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fault" / "train_fault.py"
DEADLINE_S = 60.0  # kill -> each survivor's error and exit
JOB_TIMEOUT_S = 150.0
KILL_AT = 5
SHUTDOWN_MESSAGE = "Horovod has been shut down"
LAUNCHER_MESSAGE = "Horovod detected that one or more processes exited with non-zero status"


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_fault_job(out: Path, optimizer: str, size: int, kill_rank: int) -> dict:
    """Run one job; return what happened, times in seconds after the kill."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [
        str(horovodrun),
        "-np",
        str(size),
        "-H",
        f"localhost:{size}",
        "--gloo",
        "--network-interface",
        "lo",
        sys.executable,
        str(SCRIPT),
        "--optimizer",
        optimizer,
        "--kill-rank",
        str(kill_rank),
        "--kill-at",
        str(KILL_AT),
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{horovodrun.parent}:{os.environ['PATH']}")
    log_path = out / "horovodrun.log"
    procs: dict[int, psutil.Process] = {}
    exit_times: dict[int, float] = {}
    job_exit = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    with log_path.open("w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while time.monotonic() < deadline:
                for ready in out.glob("ready.*.json"):
                    info = json.loads(ready.read_text() or "{}")
                    if info and info["rank"] not in procs:
                        try:
                            procs[info["rank"]] = psutil.Process(info["pid"])
                        except psutil.NoSuchProcess:
                            exit_times[info["rank"]] = time.time()
                now = time.time()
                for rank, proc in procs.items():
                    if rank not in exit_times and _gone(proc):
                        exit_times[rank] = now
                if job_exit is None and job.poll() is not None:
                    job_exit = now
                if job_exit is not None and len(exit_times) == len(procs):
                    break
                time.sleep(0.05)
        finally:
            if job.poll() is None or len(exit_times) < len(procs):
                # A hang: stop the driver and every worker it started.
                job.kill()
                subprocess.run(["pkill", "-9", "-f", str(out)], check=False)
            job.wait()

    killed_path = out / "killed.json"
    killed = json.loads(killed_path.read_text()) if killed_path.exists() else None
    t0 = killed["time"] if killed else float("nan")
    survivors = {}
    for rank in range(size):
        if rank == kill_rank:
            continue
        report_path = out / f"survivor.{rank}.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        survivors[rank] = {
            "raised_after": report["time"] - t0 if report else None,
            "exited_after": exit_times[rank] - t0 if rank in exit_times else None,
            "type": report["type"] if report else None,
            "message": report["message"] if report else None,
            "frames": report["frames"] if report else None,
            "step": report["step"] if report else None,
        }
    return {
        "optimizer": optimizer,
        "size": size,
        "kill_rank": kill_rank,
        "killed": killed,
        "returncode": job.returncode,
        "job_exited_after": (job_exit - t0) if job_exit is not None else None,
        "timed_out": job_exit is None,
        "survivors": survivors,
        "finished": sorted(p.name for p in out.glob("finished.*")),
        "log": log_path.read_text(errors="replace"),
    }


def summary(result: dict) -> str:
    def sec(value: float | None) -> str:
        return "never" if value is None else f"{value:.2f}s"

    lines = [
        f"{result['optimizer']} np={result['size']}, rank {result['kill_rank']} killed at step "
        f"{KILL_AT}: horovodrun rc={result['returncode']} after "
        f"{sec(result['job_exited_after'])}"
    ]
    for rank, s in result["survivors"].items():
        frames = " < ".join(reversed(s["frames"] or []))
        lines.append(
            f"  survivor {rank}: raised after {sec(s['raised_after'])}, exited after "
            f"{sec(s['exited_after'])}; {s['type']}: {(s['message'] or '')[:80]}... "
            f"(step {s['step']}, in {frames})"
        )
    return "\n".join(lines)


@pytest.mark.parametrize(
    ("optimizer", "size", "kill_rank"),
    [("sparse", 2, 1), ("sparse", 3, 1), ("sparse", 4, 0), ("dense", 2, 1)],
    ids=["sparse-np2", "sparse-np3", "sparse-np4", "dense-np2"],
)
def test_survivors_fail_fast_when_a_rank_is_killed(tmp_path, optimizer, size, kill_rank):
    result = run_fault_job(tmp_path, optimizer, size, kill_rank)
    text = summary(result)
    print(text)
    context = f"{text}\n--- horovodrun output (tail) ---\n{result['log'][-4000:]}"
    assert not result["timed_out"], f"horovodrun still running after {JOB_TIMEOUT_S}s\n{context}"
    assert result["killed"] and result["killed"]["rank"] == kill_rank, context
    assert result["returncode"] != 0, context
    assert LAUNCHER_MESSAGE in result["log"], context
    assert not result["finished"], context
    assert len(result["survivors"]) == size - 1, context
    for rank, s in result["survivors"].items():
        assert s["raised_after"] is not None, f"survivor {rank} raised no error\n{context}"
        assert s["raised_after"] < DEADLINE_S, f"survivor {rank} raised late\n{context}"
        assert s["exited_after"] is not None and s["exited_after"] < DEADLINE_S, (
            f"survivor {rank} exited late\n{context}"
        )
        assert s["type"] == "horovod.common.exceptions.HorovodInternalError", context
        assert SHUTDOWN_MESSAGE in s["message"], context
