"""What the running interpreter's environment has, found without importing a framework here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from horovod_sparse.build_horovod.patches import BuildError
from horovod_sparse.build_horovod.plan import SCRIPTS, Environment

_TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly")

# Installed before the build when missing: setup.py imports packaging, and a build without
# isolation uses what the environment has.
_BUILD_TOOLS = {"setuptools": "setuptools", "wheel": "wheel", "packaging": "packaging"}
_TORCH_PROBE = """
import json, torch
capabilities = set()
if torch.version.cuda and torch.cuda.is_available():
    for device in range(torch.cuda.device_count()):
        capabilities.add("%d%d" % torch.cuda.get_device_capability(device))
probe = {"version": torch.__version__, "cuda": torch.version.cuda}
print(json.dumps(dict(probe, capabilities=sorted(capabilities))))
"""


def _distribution_version(names: Sequence[str]) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _probe_torch() -> dict[str, object] | None:
    if _distribution_version(["torch"]) is None:
        return None
    # A subprocess: importing torch here would load its libraries into the process that
    # later imports TensorFlow for nothing, and a broken torch must not stop the probe.
    result = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"PyTorch is installed but does not import:\n{result.stderr.strip()}")
    probe: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return probe


def _find_nvcc() -> str | None:
    for home in (os.environ.get("HOROVOD_CUDA_HOME"), os.environ.get("CUDA_HOME")):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None
    )


def _find_nccl(nvcc: str | None) -> tuple[str | None, str | None]:
    """nccl.h's folder and a libnccl.so* file: $HOROVOD_NCCL_HOME, the CUDA toolkit, the
    system, or the nvidia-nccl wheel PyTorch's CUDA builds depend on."""
    roots = [Path(os.environ["HOROVOD_NCCL_HOME"])] if "HOROVOD_NCCL_HOME" in os.environ else []
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots += [Path("/usr"), Path("/usr/local")]
    roots += [
        Path(p, "nvidia", "nccl")
        for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    ]
    for root in roots:
        headers = [root / "include" / "nccl.h"]
        libraries = sorted(
            (*root.glob("lib*/libnccl.so*"), *root.glob("lib/*-linux-gnu/libnccl.so*")), key=str
        )
        if headers[0].is_file() and libraries:
            return str(headers[0].parent), str(libraries[0])
    return None, None


def _cmake_version(cmake: str) -> tuple[int, ...]:
    output = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"version\s+(\d+)\.(\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else ()


def probe_environment() -> Environment:
    torch = _probe_torch()
    nvcc = _find_nvcc()
    cuda_version = None
    if nvcc:
        match = re.search(
            r"release (\d+\.\d+)",
            subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout,
        )
        cuda_version = match.group(1) if match else "unknown"
    nccl_include, nccl_library = _find_nccl(nvcc)
    # This environment's own cmake (pip's) first, as the build's PATH has it.
    search = f"{SCRIPTS}{os.pathsep}{os.environ.get('PATH', '')}"
    cmake = os.environ.get("HOROVOD_CMAKE") or shutil.which("cmake", path=search)
    missing = tuple(
        requirement
        for module, requirement in _BUILD_TOOLS.items()
        if subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True
        ).returncode
    )
    capabilities = torch["capabilities"] if torch else []
    assert isinstance(capabilities, list)
    return Environment(
        python_tag=f"cp{sys.version_info[0]}{sys.version_info[1]}",
        torch=str(torch["version"]) if torch else None,
        torch_cuda=str(torch["cuda"]) if torch and torch["cuda"] else None,
        gpu_capabilities=tuple(str(c) for c in capabilities),
        tensorflow=_distribution_version(_TENSORFLOW_DISTRIBUTIONS),
        nvcc=nvcc,
        cuda_version=cuda_version,
        nccl_include=nccl_include,
        nccl_library=nccl_library,
        compiler=os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"),
        make=shutil.which("make"),
        cmake=cmake,
        cmake_version=_cmake_version(cmake) if cmake else (),
        missing_build_tools=missing,
    )
