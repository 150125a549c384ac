"""Parallel tests run once per rank under horovodrun; see tests/run_parallel.py."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def pytest_sessionfinish(session, exitstatus):
    """The torchrun-launched files (``test_ddp*.py``) leave Gloo together: a rank that exits
    with the process group alive can abort at interpreter exit while Gloo's threads still
    hold work ("terminate called without an active exception", seen in the examples)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
