"""Clear errors at import when Horovod, or its binding for a framework, is missing.

``horovod_sparse.torch`` and ``horovod_sparse.tensorflow`` call :func:`require_horovod`
before anything else, so a missing piece is named with what to run, instead of an
ImportError from deep inside the first module that needs it.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["require_horovod"]

_FRAMEWORKS = {"torch": ("PyTorch", "torch"), "tensorflow": ("TensorFlow", "tensorflow")}
_HOW_TO_BUILD = (
    "Horovod 0.28.1 needs source fixes to build against current PyTorch and TensorFlow: "
    "`python -m horovod_sparse.build_horovod` builds it into this environment for the "
    "frameworks installed here, with Gloo, and with CUDA when PyTorch is a CUDA build and "
    "nvcc is found. `horovodrun --check-build` shows what a build supports."
)


def require_horovod(framework: str) -> None:
    """Import ``horovod.<framework>``; raise an ImportError that says what is missing
    (the framework, Horovod, or Horovod's binding for the framework) and what to run."""
    name, module = _FRAMEWORKS[framework]
    where = f"in the environment of {sys.executable}"
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"horovod_sparse.{framework} needs {name}, which is not installed {where}: "
            f"install it first ({error})"
        ) from error
    try:
        horovod = importlib.import_module("horovod")
    except ImportError as error:
        raise ImportError(
            f"horovod_sparse.{framework} needs Horovod, which is not installed {where}. "
            + _HOW_TO_BUILD
        ) from error
    try:
        importlib.import_module(f"horovod.{framework}")
    except ImportError as error:
        version = getattr(horovod, "__version__", "?")
        raise ImportError(
            f"horovod_sparse.{framework} needs Horovod built with {name}, but the Horovod "
            f"{version} {where} has no working horovod.{framework} ({error}). " + _HOW_TO_BUILD
        ) from error
