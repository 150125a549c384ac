"""`python -m horovod_sparse.build_horovod`: the source fixes on a fresh Horovod sdist, the
build plan for the environments users have, and the errors that name what is missing.

The CPU build itself runs in every `make test`: ci/bootstrap builds Horovod with it."""

import dataclasses
import os
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

from horovod_sparse.build_horovod import (
    HOROVOD_VERSION,
    PATCHES,
    BuildError,
    Environment,
    SourcePatch,
    apply_patches,
    fetch_sdist,
    plan_build,
    probe_environment,
    unpack_patched,
)
from horovod_sparse.build_horovod.build import _nccl_library_dir
from horovod_sparse.build_horovod.plan import SCRIPTS

CACHE = Path(os.environ.get("HOROVOD_SPARSE_CACHE", Path.home() / ".cache" / "horovod_sparse"))

CPU = Environment(
    python_tag="cp311",
    torch="2.13.0+cpu",
    tensorflow="2.21.0",
    compiler="/usr/bin/c++",
    make="/usr/bin/make",
    cmake="/usr/bin/cmake",
    cmake_version=(3, 25),
)
CUDA = dataclasses.replace(
    CPU,
    torch="2.13.0",
    torch_cuda="13.0",
    gpu_capabilities=("90",),
    nvcc="/usr/local/cuda/bin/nvcc",
    cuda_version="13.0",
    nccl_include="/venv/nvidia/nccl/include",
    nccl_library="/venv/nvidia/nccl/lib/libnccl.so.2",
)


@pytest.fixture(scope="module")
def fresh_sdist():
    """The registry's sdist (downloaded once into the wheel cache ci/bootstrap uses)."""
    return fetch_sdist(CACHE)


def test_every_fix_applies_once_to_a_fresh_sdist(fresh_sdist, tmp_path):
    source = unpack_patched(fresh_sdist, tmp_path)
    assert source.name == f"horovod-{HOROVOD_VERSION}"
    for patch in PATCHES:
        text = (source / patch.path).read_text()
        assert patch.new in text, patch.path
        if patch.old not in patch.new:
            assert patch.old not in text, patch.path
    torch_cmake = (source / "horovod/torch/CMakeLists.txt").read_text()
    assert "CMAKE_CXX_STANDARD 14" not in torch_cmake and "distutils" not in torch_cmake
    assert "distutils" not in (source / "horovod/runner/js_run.py").read_text()
    # Applying twice finds no target: a source that is not the expected sdist is refused.
    with pytest.raises(BuildError, match=r"found 0 times \(expected once\)"):
        apply_patches(source)


def test_a_missing_target_changes_no_file(fresh_sdist, tmp_path):
    with tarfile.open(fresh_sdist) as archive:
        archive.extractall(tmp_path)
    source = tmp_path / f"horovod-{HOROVOD_VERSION}"
    originals = {p.path: (source / p.path).read_text() for p in PATCHES}
    broken = (*PATCHES, SourcePatch("setup.py", "no such text", "x", "for the test"))
    with pytest.raises(BuildError, match=r"setup.py:\nno such text\n\(fix: for the test\)"):
        apply_patches(source, broken)
    for patch in PATCHES:  # all or nothing: the good fixes before it were not written
        assert (source / patch.path).read_text() == originals[patch.path]
    with pytest.raises(BuildError, match="does not exist"):
        apply_patches(tmp_path / "empty", PATCHES)


def test_cpu_plan_builds_what_is_installed():
    plan = plan_build(CPU)
    assert plan.frameworks == ("torch", "tensorflow") and not plan.cuda and not plan.nccl
    assert plan.variables["HOROVOD_WITH_PYTORCH"] == "1"
    assert plan.variables["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert plan.variables["HOROVOD_WITH_GLOO"] == "1"
    assert plan.variables["HOROVOD_CMAKE"] == "/usr/bin/cmake"
    assert "HOROVOD_GPU" not in plan.variables and plan.install_first == ()
    assert plan.cache_key == "horovod-0.28.1-p5-cp311-torch2.13.0+cpu-tf2.21.0-cpu"

    torch_only = plan_build(dataclasses.replace(CPU, tensorflow=None))
    assert torch_only.frameworks == ("torch",)
    assert torch_only.variables["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert "HOROVOD_WITH_TENSORFLOW" not in torch_only.variables
    tf_only = plan_build(CPU, frameworks=["tensorflow"])
    assert tf_only.variables["HOROVOD_WITHOUT_PYTORCH"] == "1"
    assert len({plan.cache_key, torch_only.cache_key, tf_only.cache_key}) == 3


def test_cuda_plan_uses_nvcc_nccl_and_the_visible_architecture():
    plan = plan_build(CUDA)
    assert plan.cuda and plan.nccl
    assert plan.variables["HOROVOD_GPU"] == "CUDA"
    assert plan.variables["HOROVOD_CUDA_HOME"] == str(Path("/usr/local/cuda").resolve())
    assert plan.variables["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert plan.variables["HOROVOD_NCCL_LINK"] == "SHARED"
    assert plan.variables["HOROVOD_NCCL_INCLUDE"] == "/venv/nvidia/nccl/include"
    assert plan.variables["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert plan.cache_key.endswith("-cuda13.0-sm90-nccl")
    assert plan_build(CUDA, cuda="off").variables.get("HOROVOD_GPU") is None

    gloo_only = plan_build(CUDA, nccl_operations=False)
    assert gloo_only.cuda and not gloo_only.nccl
    assert "HOROVOD_GPU_OPERATIONS" not in gloo_only.variables
    assert any("--no-nccl" in note for note in gloo_only.notes)
    no_nccl = plan_build(dataclasses.replace(CUDA, nccl_include=None, nccl_library=None))
    assert no_nccl.cuda and not no_nccl.nccl and "HOROVOD_GPU_OPERATIONS" not in no_nccl.variables
    assert any("NCCL not found" in note for note in no_nccl.notes)
    assert no_nccl.cache_key != plan.cache_key


def test_cuda_torch_without_nvcc_builds_for_cpu_or_fails_when_asked():
    without_toolkit = dataclasses.replace(CUDA, nvcc=None, cuda_version=None)
    plan = plan_build(without_toolkit)
    assert not plan.cuda and "HOROVOD_GPU" not in plan.variables
    assert any("nvcc is not" in note and "CPU tensors only" in note for note in plan.notes)
    with pytest.raises(BuildError, match="install the toolkit"):
        plan_build(without_toolkit, cuda="on")
    with pytest.raises(BuildError, match="needs a CUDA build of PyTorch"):
        plan_build(CPU, cuda="on")


def test_what_is_missing_is_named():
    with pytest.raises(BuildError, match="no framework installed"):
        plan_build(dataclasses.replace(CPU, torch=None, tensorflow=None))
    with pytest.raises(BuildError, match="tensorflow installed in"):
        plan_build(dataclasses.replace(CPU, tensorflow=None), frameworks=["tensorflow"])
    with pytest.raises(BuildError, match="unknown framework"):
        plan_build(CPU, frameworks=["mxnet"])
    with pytest.raises(BuildError, match="no C\\+\\+ compiler found"):
        plan_build(dataclasses.replace(CPU, compiler=None))
    with pytest.raises(BuildError, match="make not found"):
        plan_build(dataclasses.replace(CPU, make=None))


def test_cmake_is_installed_when_missing_or_old_and_told_about_policies_when_new():
    for cmake, version in ((None, ()), ("/usr/bin/cmake", (3, 10))):
        plan = plan_build(dataclasses.replace(CPU, cmake=cmake, cmake_version=version))
        assert plan.install_first == ("cmake>=3.13,<4",)
        assert plan.variables["HOROVOD_CMAKE"] == str(SCRIPTS / "cmake")
    new = plan_build(dataclasses.replace(CPU, cmake_version=(4, 1)))
    assert new.variables["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5" and new.install_first == ()
    tools = plan_build(dataclasses.replace(CPU, missing_build_tools=("wheel",)))
    assert tools.install_first == ("wheel",)


def test_nccl_from_the_wheel_is_linked_through_a_symlink(tmp_path):
    library = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    env = dataclasses.replace(CUDA, nccl_library=str(library))
    folder = Path(_nccl_library_dir(env, tmp_path))
    assert (folder / "libnccl.so").resolve() == library.resolve()
    system = dataclasses.replace(CUDA, nccl_library="/usr/lib/x86_64-linux-gnu/libnccl.so")
    assert _nccl_library_dir(system, tmp_path) == "/usr/lib/x86_64-linux-gnu"


def test_probe_finds_this_environment():
    env = probe_environment()
    assert env.torch == metadata.version("torch")
    assert env.tensorflow == metadata.version("tensorflow-cpu")
    assert env.torch_cuda is None  # the pinned CPU wheel
    assert env.compiler is not None and env.make is not None
    assert env.python_tag == f"cp{sys.version_info[0]}{sys.version_info[1]}"


def test_dry_run_prints_the_plan_and_builds_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "horovod_sparse.build_horovod", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "for torch, tensorflow with Gloo into" in done.stdout
    assert "HOROVOD_WITH_PYTORCH=1" in done.stdout and "wheel cache:" in done.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "horovod_sparse.build_horovod", "--dry-run", "--cuda", "on"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1
    assert "ERROR: --cuda on needs a CUDA build of PyTorch" in refused.stderr


def test_only_missing_runtime_requirements_are_installed(monkeypatch):
    """Requirements whose module is importable are not asked of pip (a machine without a
    package index installs), and cffi, which no Horovod module imports, is never asked."""
    from horovod_sparse.build_horovod import build

    assert "cffi" not in " ".join(build._RUNTIME_REQUIREMENTS.values())
    monkeypatch.setattr(
        build,
        "_RUNTIME_REQUIREMENTS",
        {"json": "json-from-pip", "no_such_module_here": "no-such-requirement"},
    )
    assert build.missing_requirements() == ["no-such-requirement"]
