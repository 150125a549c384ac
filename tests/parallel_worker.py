"""One rank of a parallel test launch: run pytest on a file, write this rank's JUnit report."""

import os
import sys

import pytest

if __name__ == "__main__":
    path, report_dir, *extra = sys.argv[1:]
    # horovodrun, torchrun, mpirun
    rank = (
        os.environ.get("HOROVOD_RANK")
        or os.environ.get("RANK")
        or os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    )
    args = [
        path,
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout=240",  # a hung collective fails this test instead of the whole launch
        f"--junitxml={report_dir}/rank{rank}.xml",
        *extra,
    ]
    sys.exit(pytest.main(args))
