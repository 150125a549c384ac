"""What to build, decided from what the environment has: frameworks, CUDA, NCCL, cmake."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from horovod_sparse.build_horovod.patches import HOROVOD_VERSION, PATCH_REVISION, BuildError

# Where pip puts this environment's commands (cmake from pip, horovodrun).
SCRIPTS = Path(sysconfig.get_path("scripts"))
# The frameworks a build can serve, with the name Horovod's HOROVOD_WITH_* variables use.
FRAMEWORKS = {"torch": "PYTORCH", "tensorflow": "TENSORFLOW"}

# GCC 13 no longer includes these headers transitively; Horovod's sources rely on it.
_FORCED_INCLUDES = "-include cstdint -include string -include stdexcept"


@dataclass(frozen=True)
class Environment:
    """What the running interpreter's environment offers a Horovod build."""

    python_tag: str
    torch: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda: a CUDA build of PyTorch
    gpu_capabilities: tuple[str, ...] = ()  # of the GPUs visible now, like "90"
    tensorflow: str | None = None
    nvcc: str | None = None
    cuda_version: str | None = None  # of nvcc
    nccl_include: str | None = None
    nccl_library: str | None = None  # a libnccl.so* file
    compiler: str | None = None
    make: str | None = None
    cmake: str | None = None
    cmake_version: tuple[int, ...] = ()
    missing_build_tools: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuildPlan:
    frameworks: tuple[str, ...]
    cuda: bool
    nccl: bool
    variables: dict[str, str]  # the build's environment variables
    install_first: tuple[str, ...]  # pip requirements the build needs
    cache_key: str
    notes: tuple[str, ...] = field(default=())


def _choose_frameworks(env: Environment, requested: Sequence[str] | None) -> tuple[str, ...]:
    installed = tuple(name for name in FRAMEWORKS if getattr(env, name) is not None)
    chosen = tuple(requested) if requested else installed
    unknown = [name for name in chosen if name not in FRAMEWORKS]
    if unknown:
        raise BuildError(f"unknown framework(s) {unknown}: choose from {list(FRAMEWORKS)}")
    absent = [name for name in chosen if name not in installed]
    if not chosen or absent:
        raise BuildError(
            f"{', '.join(absent) or 'no framework'} installed in {sys.prefix}: install PyTorch "
            "or TensorFlow first (pip install torch / tensorflow), then run this again"
        )
    if env.compiler is None:
        raise BuildError(
            "no C++ compiler found ($CXX, c++, g++): install one (apt-get install g++)"
        )
    if env.make is None:
        raise BuildError("make not found: install it (apt-get install make)")
    return chosen


def _choose_cuda(
    env: Environment, frameworks: tuple[str, ...], cuda: str, notes: list[str]
) -> bool:
    """GPU operations when PyTorch is a CUDA build and nvcc is there (``cuda="auto"``)."""
    if cuda not in ("auto", "on", "off"):
        raise BuildError(f"cuda must be auto, on or off, not {cuda!r}")
    cuda_torch = env.torch_cuda is not None and "torch" in frameworks
    if cuda == "on" and not cuda_torch:
        raise BuildError("--cuda on needs a CUDA build of PyTorch (torch.version.cuda is None)")
    if cuda == "off" or not cuda_torch:
        return False
    if env.nvcc is None:
        message = (
            f"PyTorch is built with CUDA {env.torch_cuda}, but the CUDA toolkit's nvcc is not "
            "on PATH, in $HOROVOD_CUDA_HOME/bin, $CUDA_HOME/bin or /usr/local/cuda/bin"
        )
        if cuda == "on":
            raise BuildError(message + ": install the toolkit (the same major version)")
        notes.append(message + ": building for CPU tensors only")
        return False
    return True


def plan_build(
    env: Environment,
    frameworks: Sequence[str] | None = None,
    cuda: str = "auto",
    nccl_operations: bool = True,
) -> BuildPlan:
    """Decide what to build from what is installed; raise BuildError naming what is missing.
    ``nccl_operations=False`` leaves GPU collectives to Gloo even where NCCL is found
    (NCCL refuses two ranks on one GPU)."""
    chosen = _choose_frameworks(env, frameworks)
    notes: list[str] = []
    with_cuda = _choose_cuda(env, chosen, cuda, notes)
    variables = {
        f"HOROVOD_{'WITH' if name in chosen else 'WITHOUT'}_{variable}": "1"
        for name, variable in FRAMEWORKS.items()
    }
    variables.update(HOROVOD_WITH_GLOO="1", HOROVOD_WITHOUT_MPI="1", HOROVOD_WITHOUT_MXNET="1")
    variables["CXXFLAGS"] = f"{_FORCED_INCLUDES} {os.environ.get('CXXFLAGS', '')}".strip()
    versions = [env.python_tag]
    versions += [f"torch{env.torch}"] if "torch" in chosen else []
    versions += [f"tf{env.tensorflow}"] if "tensorflow" in chosen else []
    nccl = False
    if with_cuda:
        assert env.nvcc is not None
        cuda_home = Path(env.nvcc).resolve().parent.parent
        variables.update(HOROVOD_GPU="CUDA", HOROVOD_CUDA_HOME=str(cuda_home))
        # Default: every architecture nvcc knows, which multiplies the build time.
        architectures = os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST") or ",".join(
            env.gpu_capabilities
        )
        if architectures:
            variables["HOROVOD_BUILD_CUDA_CC_LIST"] = architectures
        found = env.nccl_include is not None and env.nccl_library is not None
        nccl = found and nccl_operations
        if nccl:
            variables.update(
                HOROVOD_GPU_OPERATIONS="NCCL",
                HOROVOD_NCCL_LINK="SHARED",
                HOROVOD_NCCL_INCLUDE=str(env.nccl_include),
            )
        elif found:
            notes.append("NCCL operations left out (--no-nccl): GPU tensors go through Gloo")
        else:
            notes.append("NCCL not found (nccl.h and libnccl.so*): GPU tensors go through Gloo")
        versions += [f"cuda{env.cuda_version}", f"sm{architectures or 'all'}".replace(",", "-")]
        versions += ["nccl"] if nccl else []
    else:
        versions.append("cpu")

    install_first = list(env.missing_build_tools)
    if env.cmake is None or env.cmake_version < (3, 13):
        # From pip, into this environment; below 4: Horovod's CMake files use policies
        # that CMake 4 removed.
        install_first.append("cmake>=3.13,<4")
        variables["HOROVOD_CMAKE"] = str(SCRIPTS / "cmake")
    else:
        variables["HOROVOD_CMAKE"] = env.cmake
        if env.cmake_version >= (4,):
            variables["CMAKE_POLICY_VERSION_MINIMUM"] = "3.5"
    key = "-".join([f"horovod-{HOROVOD_VERSION}-p{PATCH_REVISION}", *versions])
    return BuildPlan(chosen, with_cuda, nccl, variables, tuple(install_first), key, tuple(notes))
