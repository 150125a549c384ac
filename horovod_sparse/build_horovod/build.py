"""Download, patch, build, cache, install and check the Horovod wheel."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from horovod_sparse.build_horovod.patches import HOROVOD_VERSION, BuildError, apply_patches
from horovod_sparse.build_horovod.plan import SCRIPTS, BuildPlan, Environment

# Horovod's runtime requirements by the module each provides, installed after the wheel
# where missing. Horovod's setup.py also asks for cffi with PyTorch, which no module of
# the package imports: left out, so that a machine without a package index that has the
# others installs (seen on a GPU machine, where pip could not reach an index for cffi).
_RUNTIME_REQUIREMENTS = {
    "cloudpickle": "cloudpickle",
    "psutil": "psutil",
    "yaml": "pyyaml",
    "packaging": "packaging",
}


def missing_requirements() -> list[str]:
    """The runtime requirements whose module this interpreter cannot find."""
    return [
        requirement
        for module, requirement in _RUNTIME_REQUIREMENTS.items()
        if importlib.util.find_spec(module) is None
    ]


def pip(*arguments: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *arguments]
    print("[build_horovod] " + " ".join(command[2:]), flush=True)
    if subprocess.run(command).returncode != 0:
        raise BuildError(f"pip {' '.join(arguments)} failed (see above)")


def fetch_sdist(cache: Path, given: Path | None = None) -> Path:
    """The sdist: ``given``, or the one in the cache, downloaded there once."""
    if given is not None:
        return given
    target = cache / "sdist" / f"horovod-{HOROVOD_VERSION}.tar.gz"
    if not target.is_file():
        pip(
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            f"horovod=={HOROVOD_VERSION}",
            "-d",
            str(target.parent),
        )
    return target


def _nccl_library_dir(env: Environment, build: Path) -> str:
    """The folder to link NCCL from. The nvidia-nccl wheel ships only libnccl.so.2, which
    CMake's find_library does not take, so the build links through a libnccl.so symlink;
    the resulting library needs libnccl.so.2, which PyTorch has loaded by then."""
    assert env.nccl_library is not None
    library = Path(env.nccl_library)
    if library.name == "libnccl.so":
        return str(library.parent)
    links = build / "nccl-lib"
    links.mkdir(exist_ok=True)
    (links / "libnccl.so").symlink_to(library)
    return str(links)


def unpack_patched(sdist: Path, folder: Path) -> Path:
    """Unpack the sdist into ``folder`` and apply every fix; return the source root."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # refuses links and paths out of the folder
            archive.extractall(folder, filter="data")
        else:
            archive.extractall(folder)
    source = folder / f"horovod-{HOROVOD_VERSION}"
    apply_patches(source)
    return source


def build_wheel(env: Environment, plan: BuildPlan, sdist: Path, into: Path, jobs: int) -> Path:
    """Patch the sdist and build the wheel into ``into``; the compiler's output goes to a log."""
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as scratch:
        build = Path(scratch)
        source = unpack_patched(sdist, build)
        variables = dict(os.environ, **plan.variables, MAKEFLAGS=f"-j{jobs}")
        # pip installs cmake into this environment's bin folder; the build must find it.
        variables["PATH"] = f"{SCRIPTS}{os.pathsep}{variables.get('PATH', '')}"
        if plan.nccl:
            variables["HOROVOD_NCCL_LIB"] = _nccl_library_dir(env, build)
        log = into / "build.log"
        into.mkdir(parents=True, exist_ok=True)
        print(
            f"[build_horovod] building (3 minutes on 2 cores for both frameworks); "
            f"compiler output: {log}",
            flush=True,
        )
        command = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(build / "wheel"),
            str(source),
        ]
        with log.open("w") as output:
            returncode = subprocess.run(
                command, env=variables, stdout=output, stderr=subprocess.STDOUT
            ).returncode
        if returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
            raise BuildError(f"the Horovod build failed; the last lines of {log}:\n{tail}")
        wheel = next((build / "wheel").glob("horovod-*.whl"))
        shutil.copy2(wheel, into / wheel.name)
        return into / wheel.name


def _marker() -> Path:
    return Path(sys.prefix) / ".horovod_sparse-horovod-wheel"


def install_wheel(wheel: Path) -> None:
    """Install unless this very wheel is installed already (a marker in the environment)."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    from importlib import metadata

    try:
        installed = metadata.version("horovod")
    except metadata.PackageNotFoundError:
        installed = None
    if installed == HOROVOD_VERSION and _marker().is_file() and _marker().read_text() == digest:
        print(f"[build_horovod] {wheel.name} is installed already", flush=True)
        return
    pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    missing = missing_requirements()
    if missing:
        pip("install", "-q", *missing)
    _marker().write_text(digest)


_CHECK_NAMES = {"torch": "PyTorch", "tensorflow": "TensorFlow"}


def check_build(plan: BuildPlan) -> str:
    """``horovodrun --check-build``; raise if a framework, Gloo or NCCL is not in it."""
    horovodrun = SCRIPTS / "horovodrun"
    quiet = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    result = subprocess.run(
        [str(horovodrun), "--check-build"], capture_output=True, text=True, env=quiet
    )
    report = result.stdout + result.stderr
    wanted = (
        [_CHECK_NAMES[name] for name in plan.frameworks]
        + ["Gloo"]
        + (["NCCL"] if plan.nccl else [])
    )
    missing = [name for name in wanted if not re.search(rf"\[X\] {name}\b", report)]
    if result.returncode != 0 or missing:
        raise BuildError(f"horovodrun --check-build lacks {missing or '(it failed)'}:\n{report}")
    return report
