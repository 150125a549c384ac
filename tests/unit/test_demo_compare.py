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
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compare.py"), *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    # mode, loss, bytes, vs dense, loopback s, then 1, 10 and 100 Gbit/s in ms.
    assert lines["dense"][3:] == ["100.00%", "2.8", "42.0", "6.0", "2.4"]
    assert lines["sparse"][3:] == ["2.00%", "4.7", "8.8", "8.1", "8.0"]
    assert "not measurements" in out
