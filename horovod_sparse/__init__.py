"""horovod_sparse: sparse allreduce for Horovod.

Framework adapters live in :mod:`horovod_sparse.torch` and
:mod:`horovod_sparse.tensorflow`; :mod:`horovod_sparse.common` holds the
framework-free algorithm decisions.
"""

from horovod_sparse.version import __version__

__all__ = ["__version__"]
