"""Validation across ranks before the first collective of a training step.

The Keras optimizer (when it is built) and :class:`DistributedGradientTape` (when it
first builds its reducer for a list of sources) each run one small collective: every
rank sends its local verdict (an error message or ``None``) and the list of its
variables as ``(name, shape, dtype)``, gathered by :func:`allgather_object` as one
pickled object per rank. Then every rank raises the same kind of error, or none: its
own error, another rank's error (named), or the first variable that differs between
ranks. A mistake on one rank so becomes a clear error on all of them instead of a hang
in the step's collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.validation import raise_on_any_rank, verdict_of

__all__ = ["allgather_object", "check_variables", "describe", "validate_across_ranks"]

# One name for every validation: ranks that reach it from different call sites still
# meet in the same collective (and then see different variable lists) instead of waiting.
_COLLECTIVE = "hvds.validate"

Entry = tuple[str, Any, str]  # (name, shape or None if the rank is unknown, dtype)


def allgather_object(obj: Any, name: str, process_set: Any = hvd.global_process_set) -> list[Any]:
    """Pickle-based allgather within ``process_set``; one object per rank, in rank order.

    Horovod 0.28's ``allgather_object`` takes no process set. This version sends two
    small allgathers: the payload lengths (int64), then the payloads (uint8). It runs
    eagerly (under ``tf.init_scope``) even when called while a ``tf.function`` is traced.
    """
    with tf.init_scope():
        payload = tf.constant(np.frombuffer(pickle.dumps(obj), dtype=np.uint8))
        lengths = hvd.allgather(
            tf.constant([int(payload.shape[0])], tf.int64),
            name=f"{name}.len",
            process_set=process_set,
        )
        gathered = hvd.allgather(payload, name=f"{name}.data", process_set=process_set)
        data = gathered.numpy().tobytes()
        out, start = [], 0
        for length in lengths.numpy().tolist():
            out.append(pickle.loads(data[start : start + length]))
            start += length
        return out


def label(variable: Any, index: int) -> str:
    """A readable name: the Keras ``path``, the ``tf.Variable`` name, or the position."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    return str(name) if name else f"source {index}"


def describe(variables: Sequence[Any]) -> list[Entry]:
    """``(name, shape, dtype)`` of each variable, picklable."""
    out = []
    for i, v in enumerate(variables):
        shape = tf.TensorShape(v.shape)
        dims = None if shape.rank is None else tuple(shape.as_list())
        out.append((label(v, i), dims, tf.as_dtype(v.dtype).name))
    return out


def check_variables(variables: Sequence[Any], what: str) -> None:
    """Local checks: a non-empty list of floating-point variables Horovod's TF ops carry.

    Raises ValueError or TypeError; callers put the error in the validation verdict.
    """
    if not variables:
        raise ValueError(f"{what} has no variables to reduce: the variable list is empty")
    for i, v in enumerate(variables):
        dtype = tf.as_dtype(v.dtype)
        if not dtype.is_floating:
            raise TypeError(
                f"variable {label(v, i)!r} has dtype {dtype.name}; gradients must be floating point"
            )
        if dtype == tf.bfloat16:
            raise TypeError(
                f"variable {label(v, i)!r} is bfloat16, which Horovod's TensorFlow ops do not "
                "support; keep float32 variables (Keras's 'mixed_bfloat16' policy does)"
            )


def validate_across_ranks(
    entries: list[Entry], problem: Exception | None, process_set: Any, what: str
) -> None:
    """One allgather of ``(verdict, entries)``; raises on every rank if any rank is wrong.

    ``entries`` are compared by position on shape and dtype only: Keras and TF make
    names unique per process (``dense_1``), so names may differ between ranks with the
    same model; they appear in the messages. Raises this rank's own ``problem``, or a
    ValueError naming another rank's error, or the first variable that differs.
    """
    everyone = allgather_object((verdict_of(problem), entries), _COLLECTIVE, process_set)
    raise_on_any_rank(
        everyone, entries, problem, "variable", what, comparable=lambda entry: entry[1:]
    )
