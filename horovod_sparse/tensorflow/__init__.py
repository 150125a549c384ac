"""TensorFlow adapter (mirrors ``horovod.tensorflow``).

It will implement the primitives of ``horovod_sparse.common.backend`` with TF ops, so
that the stage logic in ``horovod_sparse.common`` runs unchanged, eagerly and inside
``tf.function``.
"""

__all__: list[str] = []
