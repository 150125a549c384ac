"""Build Horovod 0.28.1 into the running interpreter's environment.

    python -m horovod_sparse.build_horovod        (or: horovod-sparse-build-horovod)

Horovod's last release cannot be ``pip install``-ed against current PyTorch, TensorFlow,
Python or CUDA: its sources need the fixes in :data:`PATCHES`. This command detects what
the environment has (PyTorch, TensorFlow, a CUDA build of PyTorch with ``nvcc``, NCCL),
downloads the sdist, applies every fix (each must match exactly once, so a changed sdist
fails loudly instead of building something broken), builds a wheel with Gloo, caches it
under a key made of every version the binary depends on, installs it, and checks the
result with ``horovodrun --check-build``. ``--dry-run`` prints the plan and stops.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from horovod_sparse.build_horovod.build import (
    build_wheel,
    check_build,
    fetch_sdist,
    install_wheel,
    pip,
    unpack_patched,
)
from horovod_sparse.build_horovod.patches import (
    HOROVOD_VERSION,
    PATCHES,
    BuildError,
    SourcePatch,
    apply_patches,
)
from horovod_sparse.build_horovod.plan import BuildPlan, Environment, plan_build
from horovod_sparse.build_horovod.probe import probe_environment

__all__ = [
    "HOROVOD_VERSION",
    "PATCHES",
    "BuildError",
    "BuildPlan",
    "Environment",
    "SourcePatch",
    "apply_patches",
    "fetch_sdist",
    "main",
    "plan_build",
    "probe_environment",
    "unpack_patched",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m horovod_sparse.build_horovod", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--frameworks", help="comma-separated subset of torch,tensorflow (default: those installed)"
    )
    parser.add_argument(
        "--cuda",
        choices=("auto", "on", "off"),
        default="auto",
        help="GPU operations: auto = when PyTorch is a CUDA build and nvcc is found",
    )
    parser.add_argument(
        "--no-nccl",
        action="store_true",
        help="GPU collectives through Gloo even where NCCL is found (several ranks on one GPU)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(
            os.environ.get("HOROVOD_SPARSE_CACHE", Path.home() / ".cache" / "horovod_sparse")
        ),
        help="wheel cache folder",
    )
    parser.add_argument("--sdist", type=Path, help="a local horovod-0.28.1.tar.gz (no download)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs"
    )
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    args = parser.parse_args(argv)
    try:
        env = probe_environment()
        frameworks = args.frameworks.split(",") if args.frameworks else None
        plan = plan_build(env, frameworks, args.cuda, nccl_operations=not args.no_nccl)
        gpu = (" and CUDA" if plan.cuda else "") + (" and NCCL" if plan.nccl else "")
        print(
            f"[build_horovod] Horovod {HOROVOD_VERSION} for {', '.join(plan.frameworks)} "
            f"with Gloo{gpu} into {sys.prefix}"
        )
        for note in plan.notes:
            print(f"[build_horovod] note: {note}")
        for name, value in sorted(plan.variables.items()):
            print(f"[build_horovod]   {name}={value}")
        if plan.install_first:
            print(f"[build_horovod] installs first: {' '.join(plan.install_first)}")
        print(f"[build_horovod] wheel cache: {args.cache / plan.cache_key}")
        if args.dry_run:
            return 0
        if plan.install_first:
            pip("install", "-q", *plan.install_first)
        wheels = args.cache / plan.cache_key
        cached = sorted(wheels.glob("horovod-*.whl"))
        if cached and not args.rebuild:
            wheel = cached[0]
            print(f"[build_horovod] reusing cached {wheel}")
        else:
            wheel = build_wheel(env, plan, fetch_sdist(args.cache, args.sdist), wheels, args.jobs)
            print(f"[build_horovod] cached {wheel}")
        install_wheel(wheel)
        print(check_build(plan).rstrip())
        print("[build_horovod] OK")
        return 0
    except BuildError as error:
        print(f"[build_horovod] ERROR: {error}", file=sys.stderr)
        return 1
