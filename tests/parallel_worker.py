"""One rank of a parallel test launch: run pytest on the files given, write this rank's
JUnit report.

Usage: parallel_worker.py REPORT_DIR FILE [FILE ...] [-k EXPR]"""

import os
import sys

import pytest

if __name__ == "__main__":
    report_dir, *pytest_args = sys.argv[1:]
    # horovodrun, torchrun, mpirun
    rank = (
        os.environ.get("HOROVOD_RANK")
        or os.environ.get("RANK")
        or os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    )
    args = [
        *pytest_args,
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout=240",  # a hung collective fails this test instead of the whole launch
        # Python's output is kept per test; what C++ writes to the descriptors (Horovod's
        # and Gloo's errors, an abort's message) reaches the launch's output even when
        # the process dies, where a captured descriptor's content would be lost.
        "--capture=sys",
        f"--junitxml={report_dir}/rank{rank}.xml",
    ]
    sys.exit(pytest.main(args))
