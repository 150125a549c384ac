"""The demo's comparison: measured figures as given, the per-link exchange time from
the alpha-beta model (1 ms per message step plus the bytes one rank sends)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def summary(mode, density, sent, steps, seconds):
    return {
        "mode": mode,
        "density": density,
        "final_loss": 0.5,
        "bytes_per_step": 2 * sent,
        "bytes_sent_per_step": sent,
        "message_steps_per_step": steps,
        "seconds": seconds,
    }


def compare(paths):
    """examples/compare.py's output for these summary files."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compare.py"), *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_compare_prints_measured_and_modelled_columns(tmp_path):
    rows = [
        summary("dense", 1.0, 5_000_000, 2, 2.8),  # 1 Gbit/s: 2 ms + 40 ms
        summary("sparse", 0.01, 100_000, 8, 4.7),  # 1 Gbit/s: 8 ms + 0.8 ms
    ]
    paths = []
    for row in rows:
        path = tmp_path / f"{row['mode']}.json"
        path.write_text(json.dumps(row))
        paths.append(str(path))
    out = compare(paths)
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    # mode, loss, bytes, vs dense, loopback s, then 1, 10 and 100 Gbit/s in ms.
    assert lines["dense"][3:] == ["100.00%", "2.8", "42.0", "6.0", "2.4"]
    assert lines["sparse"][3:] == ["2.00%", "4.7", "8.8", "8.1", "8.0"]
    assert "not measurements" in out


def test_compare_says_what_the_automatic_scheduler_chose_and_why(tmp_path):
    auto = summary("auto", 0.01, 4_000_000, 2, 2.5)
    nan = float("nan")
    auto["schedule"] = {
        "bucket.0": {"mode": "dense", "measured_dense_s": 0.0042, "measured_sparse_s": nan}
    }
    auto["trials"] = [
        {"before": [False], "tried": [True], "seconds_before": 0.0112, "seconds_tried": 0.0098,
         "kept": True, "ratio": 0.875, "blocks": [0.0112, 0.0098, 0.0112, 0.0098, 0.0112]},
        {"before": [True], "tried": [False], "seconds_before": 0.0097, "seconds_tried": 0.0121,
         "kept": False},
    ]  # fmt: skip
    paths = []
    for row in (summary("dense", 1.0, 5_000_000, 2, 2.8), auto):
        path = tmp_path / f"{row['mode']}.json"
        path.write_text(json.dumps(row))  # NaN written as Python's json writes it
        paths.append(str(path))
    out = compare(paths)
    assert "bucket bucket.0: dense; its exchange measured 4.2 ms a step dense, - sparse" in out
    assert (
        "trial sparse -> dense: median step 11.2 ms -> 9.8 ms (blocks 11.2, 9.8, 11.2, 9.8,"
        " 11.2 ms; tried over the blocks around it 0.88), kept" in out
    )
    assert "trial dense -> sparse: median step 9.7 ms -> 12.1 ms, rejected" in out


def test_compare_says_when_the_automatic_scheduler_tried_nothing(tmp_path):
    auto = summary("auto", 0.01, 100_000, 2, 2.5)
    auto["schedule"], auto["trials"] = {}, []
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(auto))
    out = compare([str(path)])
    assert "no trial: every bucket kept the mode it started in" in out
