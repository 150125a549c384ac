"""Clear errors when Horovod, or its binding for a framework, is missing.

``horovod_sparse.tensorflow`` calls :func:`require_horovod` before anything else, so a
missing piece is named with what to run, instead of an ImportError from deep inside the
first module that needs it. ``horovod_sparse.torch`` needs PyTorch at import but Horovod
only for its Horovod names (its DDP hook, :mod:`horovod_sparse.torch.ddp`, runs on
``torch.distributed`` alone): it calls :func:`require_horovod` when one of those names is
first used.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["horovod_error", "require_framework", "require_horovod"]

_FRAMEWORKS = {"torch": ("PyTorch", "torch"), "tensorflow": ("TensorFlow", "tensorflow")}
_HOW_TO_BUILD = (
    "Horovod 0.28.1 needs source fixes to build against current PyTorch and TensorFlow: "
    "`python -m horovod_sparse.build_horovod` builds it into this environment for the "
    "frameworks installed here, with Gloo, and with CUDA when PyTorch is a CUDA build and "
    "nvcc is found. `horovodrun --check-build` shows what a build supports."
)
_WITHOUT_HOROVOD = {
    "torch": " (horovod_sparse.torch.ddp, the DistributedDataParallel hook, does not.)",
    "tensorflow": "",
}


def _where() -> str:
    return f"in the environment of {sys.executable}"


def require_framework(framework: str) -> None:
    """Import the framework; raise an ImportError that names it if it is missing."""
    name, module = _FRAMEWORKS[framework]
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"horovod_sparse.{framework} needs {name}, which is not installed {_where()}: "
            f"install it first ({error})"
        ) from error


def horovod_error(framework: str) -> ImportError | None:
    """None if ``horovod.<framework>`` imports; else an ImportError that says what is
    missing (Horovod, or its binding for the framework) and what to run."""
    name, _ = _FRAMEWORKS[framework]
    try:
        horovod = importlib.import_module("horovod")
    except ImportError as error:
        missing = ImportError(
            f"horovod_sparse.{framework} needs Horovod, which is not installed {_where()}. "
            + _HOW_TO_BUILD
            + _WITHOUT_HOROVOD[framework]
        )
        missing.__cause__ = error
        return missing
    try:
        importlib.import_module(f"horovod.{framework}")
    except ImportError as error:
        version = getattr(horovod, "__version__", "?")
        missing = ImportError(
            f"horovod_sparse.{framework} needs Horovod built with {name}, but the Horovod "
            f"{version} {_where()} has no working horovod.{framework} ({error}). "
            + _HOW_TO_BUILD
            + _WITHOUT_HOROVOD[framework]
        )
        missing.__cause__ = error
        return missing
    return None


def require_horovod(framework: str) -> None:
    """Import the framework and ``horovod.<framework>``, or raise the ImportError that
    names what is missing and what to run."""
    require_framework(framework)
    missing = horovod_error(framework)
    if missing is not None:
        raise missing
