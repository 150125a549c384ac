"""Engine entry points run inside the backend's ``local_work()`` context: the plugin's
thread count on the CPU (docs/design.md §12)."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

__all__ = ["on_local_threads"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def on_local_threads(method: _Method) -> _Method:
    """Run a method of an object with ``ops`` (an engine, a bucket's handle) inside
    ``ops.local_work()`` (:meth:`~horovod_sparse.common.backend.Backend.local_work`)."""

    @functools.wraps(method)
    def run(owner: Any, *args: Any, **kwargs: Any) -> Any:
        with owner.ops.local_work():
            return method(owner, *args, **kwargs)

    return cast(_Method, run)
