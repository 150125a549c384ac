"""Parallel tests run once per rank under horovodrun; see tests/run_parallel.py."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
