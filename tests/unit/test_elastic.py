"""Elastic Horovod with the sparse optimizer: a worker is killed, the others go on.

Launches ``horovodrun`` in elastic mode with a host-discovery script that offers two
"hosts" on this machine (``localhost`` with 2 slots and ``127.0.0.1`` with 1). The
worker on ``127.0.0.1`` kills itself mid-run; Horovod blacklists that host and the two
survivors restore the last commit, rebuild for world size 2 and finish.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_training_survives_a_killed_worker(tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    discover.chmod(0o755)
    horovodrun = Path(sys.executable).with_name("horovodrun")
    steps, kill_at = 30, 10
    cmd = [
        str(horovodrun),
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-np",
        "3",
        "--host-discovery-script",
        str(discover),
        "--gloo",
        "--network-interface",
        "lo",
        sys.executable,
        str(ROOT / "tests" / "elastic" / "train_elastic.py"),
        "--out",
        str(tmp_path),
        "--steps",
        str(steps),
        "--kill-at",
        str(kill_at),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{horovodrun.parent}:{os.environ['PATH']}")
    job = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = job.communicate(timeout=200)
    finally:
        if job.poll() is None:  # a hang: stop the driver and every worker it started
            job.kill()
            subprocess.run(["pkill", "-9", "-f", str(tmp_path)], check=False)
            output, _ = job.communicate()
    log = output[-6000:]
    assert (tmp_path / "killed").exists(), log
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report.*.json"))]
    assert len(reports) == 2, log
    for report in reports:
        assert report["size"] == 2 and report["step"] == steps, report
        assert report["resets"] and report["resets"][-1] == 2, report
        assert report["sizes"][:kill_at] == [3] * kill_at, report
        assert report["sizes"][-1] == 2, report
        assert set(report["reducer_world_sizes"]) == {2}, report
        assert report["residual_abs_sum"] > 0, report
    assert reports[0]["digest"] == reports[1]["digest"], "survivors' parameters differ"
