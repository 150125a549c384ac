"""Long stress run: ``tests/stress.py`` under horovodrun (default 1000 steps, 4 ranks).

python benchmarks/stress.py --steps 1000 --np 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-size", type=int, default=1_000_003, help="largest tensor")
    parser.add_argument("--json", default=str(ROOT / "results" / "stress.json"))
    args = parser.parse_args()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(Path(sys.executable).with_name("horovodrun")),
        "-np",
        str(args.np),
        "-H",
        f"localhost:{args.np}",
        "--gloo",
        sys.executable,
        "-m",
        "tests.stress",
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--json",
        args.json,
        "--max-size",
        str(args.max_size),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sys.exit(subprocess.run(cmd, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
