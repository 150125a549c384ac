"""The source fixes Horovod 0.28.1 needs, each applied exactly once or not at all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
# Part of the cache key: bump it whenever PATCHES or the build flags change, so a cached
# wheel built from other sources is never installed.
PATCH_REVISION = 5


class BuildError(RuntimeError):
    """What is missing and what to do about it."""


@dataclass(frozen=True)
class SourcePatch:
    """Replace ``old`` by ``new`` in ``path`` (relative to the sdist root), exactly once."""

    path: str
    old: str
    new: str
    why: str


_GLOO_DEVICE = (
    "  attr device_attr;\n"
    "  device_attr.iface = gloo_iface_;\n"
    "  device_attr.ai_family = AF_UNSPEC;\n"
    "  auto dev = CreateDevice(device_attr);\n"
    "\n"
    "  global_ctx = global_context.ctx;"
)
_QUIET_CHECK = (
    "            sys.stdout = open(os.devnull, 'w')\n            sys.stderr = open(os.devnull, 'w')"
)
_CXX17 = (
    "PyTorch >= 2.1 headers need C++17; Horovod compiles with C++14 (fixed upstream after 0.28.1)"
)
PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch(
        "CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)", _CXX17
    ),
    SourcePatch(
        "horovod/torch/CMakeLists.txt",
        "set(CMAKE_CXX_STANDARD 14)",
        "set(CMAKE_CXX_STANDARD 17)",
        _CXX17,
    ),
    SourcePatch(
        "third_party/gloo/CMakeLists.txt",
        "-std=c++11 -fPIC",
        "-std=c++17 -fPIC",
        "Gloo built as C++11 next to C++17 objects defines an inline static member twice, "
        "so the torch extension fails to link",
    ),
    SourcePatch(
        "horovod/common/ops/cuda/CMakeLists.txt",
        "set(CMAKE_CUDA_STANDARD 11)",
        "set(CMAKE_CUDA_STANDARD 17)",
        "CUDA 13's nvcc and PyTorch's headers need C++17 in the CUDA kernels too",
    ),
    SourcePatch(
        "horovod/tensorflow/CMakeLists.txt",
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")',
        "# xla_mpi_ops.cc left out: TF >= 2.21 XLA headers need highwayhash (not in the wheel)",
        "the XLA op serves MPI builds only, and its headers do not compile against TF 2.21",
    ),
    SourcePatch(
        "horovod/torch/CMakeLists.txt",
        '"from distutils.sysconfig import get_python_inc; print(get_python_inc())"',
        "\"import sysconfig; print(sysconfig.get_paths()['include'])\"",
        "distutils is gone from Python 3.12",
    ),
    SourcePatch(
        "horovod/runner/js_run.py",
        "from distutils.spawn import find_executable",
        "from shutil import which as find_executable",
        "distutils is gone from Python 3.12; horovodrun imports this module",
    ),
    SourcePatch(
        "setup.py",
        "setup_requires=require_list if is_build_action() else [],",
        "setup_requires=[],",
        "setup_requires makes setuptools fetch packages itself, which fails without an index",
    ),
    SourcePatch(
        "horovod/common/util.py",
        _QUIET_CHECK,
        _QUIET_CHECK + "\n            os.dup2(sys.stdout.fileno(), 1)\n"
        "            os.dup2(sys.stderr.fileno(), 2)",
        "horovodrun checks its extensions by importing them in a forked child whose Python-level "
        "output is muted; TensorFlow's C++ start-up lines go to file descriptor 2 and reached "
        "every launch's console, PyTorch jobs included",
    ),
    SourcePatch(
        "horovod/ray/worker.py",
        "return ray.get_runtime_context().node_id.hex()",
        "return ray.get_runtime_context().get_node_id()",
        "RuntimeContext.node_id is deprecated (Ray 2.x warns on every RayExecutor worker and "
        "says it may be removed); get_node_id() returns the same hex string",
    ),
    SourcePatch(
        "horovod/common/gloo/gloo_context.cc",
        _GLOO_DEVICE,
        "  gloo_iface_ = global_context.gloo_iface_;\n" + _GLOO_DEVICE,
        "a process set's Gloo device ignored HOROVOD_GLOO_IFACE, so ranks on different "
        "hosts could not connect",
    ),
)


def apply_patches(source_root: Path, patches: Sequence[SourcePatch] = PATCHES) -> None:
    """Apply every patch, or none: all targets are checked before any file is written."""
    texts: dict[Path, str] = {}
    for patch in patches:
        path = source_root / patch.path
        if path not in texts:
            if not path.is_file():
                raise BuildError(
                    f"patch target {path} does not exist (is this Horovod {HOROVOD_VERSION}?)"
                )
            texts[path] = path.read_text()
        count = texts[path].count(patch.old)
        if count != 1:
            raise BuildError(
                f"patch target found {count} times (expected once) in {path}:\n{patch.old}\n"
                f"(fix: {patch.why})"
            )
        texts[path] = texts[path].replace(patch.old, patch.new)
    for path, text in texts.items():
        path.write_text(text)
