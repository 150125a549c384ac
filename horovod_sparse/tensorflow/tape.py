"""Drop-in replacement for ``horovod.tensorflow.DistributedGradientTape``."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.config import SparseConfig, make_config
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.reducer import GradientReducer, horovod_arguments
from horovod_sparse.tensorflow.routing import gather_slices, is_slices, scale_local, source_keys
from horovod_sparse.tensorflow.validation import check_variables, describe, validate_across_ranks

__all__ = ["DistributedGradientTape", "gradient_reducer"]

# Reducers (and so residuals) outlive the tape: a new tape is usually made every step.
_REDUCERS: dict[tuple[Any, ...], GradientReducer] = {}


def gradient_reducer(name: str) -> GradientReducer:
    """The state tapes named ``name`` keep between steps (a new tape is usually made
    every step): buckets, residuals, fused runs and the last step's statistics. The
    first made under that name when several were (other sources or options).

    Raises:
        KeyError: no tape of that name has reduced gradients yet.
    """
    for key, reducer in _REDUCERS.items():
        if key[0] == name:
            return reducer
    raise KeyError(f"no DistributedGradientTape named {name!r} has reduced gradients yet")


class DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` returns sparse-allreduced gradients.

    Accepts every argument of ``hvd.DistributedGradientTape`` with the same meaning
    (``device_dense``/``device_sparse`` are accepted for compatibility; placement follows
    the gradients), plus the sparse options of
    :class:`~horovod_sparse.common.config.SparseConfig` that the tape acts on (``density``,
    ``min_sparse_numel``, ``selection``, ``partition``, ``fusion_threshold_bytes``,
    ``reestimate_steps``, ``repartition_steps``, ``warmup_steps``,
    ``density_decay_steps``, ``dense_fusion_bytes``, ``error_feedback``,
    ``global_selection``, ``refresh_steps``, ``log_every``). As under Horovod, a rank
    outside ``process_set`` gets its gradients back unreduced, local sources
    (:meth:`register_local_source`) are not reduced, and ``IndexedSlices`` gradients are
    allgathered unless ``sparse_as_dense`` (:mod:`horovod_sparse.tensorflow.routing`).
    Residuals are
    ``tf.Variable``s that persist across tapes, keyed by ``name`` and the list of
    sources; :meth:`residual_variables` returns them for a checkpoint.

    Invalid keywords or sources are reported by the first ``gradient()`` call, on every
    rank, after one small validation collective (see :meth:`_reducer_for`).

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(model(x), y)
        >>> tape = DistributedGradientTape(tape, density=0.01)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = hvd.Compression.none,
        sparse_as_dense: bool = False,
        op: Any = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = hvd.global_process_set,
        scale_local_gradients: bool = True,
        *,
        name: str = "tape",
        **options: Any,
    ) -> None:
        super().__init__(
            persistent=gradtape._persistent,
            watch_accessed_variables=gradtape._watch_accessed_variables,
        )
        # Adopt what the user's tape recorded.
        self._tape = gradtape._tape
        self._recording = gradtape._recording
        self._watched_variables = gradtape._watched_variables
        # A bad knob becomes this rank's verdict in the validation collective of the
        # first gradient() call, so every rank raises rather than only this one.
        self._problem: Exception | None = None
        self._config: SparseConfig | None = None
        try:
            self._config = make_config(options)
            refuse_unsupported(self._config, Frontend.TF_TAPE)
        except (TypeError, ValueError) as error:
            self._problem = error
        self._options = horovod_arguments(locals())
        self._name = name
        self._scale_local = bool(scale_local_gradients)
        self._local_sources: set[int] = set()  # ids: Keras 3 variables have no ref()
        self._reducer: GradientReducer | None = None

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local, as Horovod does: it takes no part in any
        collective or bucket, and is divided by the process set's size unless the tape
        was made with ``scale_local_gradients=False``."""
        self._local_sources |= source_keys(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        out = list(flat_grads)
        process_set = self._options["process_set"]
        local = [i for i, s in enumerate(flat_sources) if id(s) in self._local_sources]
        # Outside the process set every gradient comes back as computed (routing.py).
        if process_set.included():
            self._reduce_shared(flat_sources, flat_grads, set(local), out)
        scaled = scale_local([out[i] for i in local], process_set.size(), self._scale_local)
        for i, g in zip(local, scaled):
            out[i] = g
        return tf.nest.pack_sequence_as(grads, out) if tf.nest.is_nested(grads) else out[0]

    def _reduce_shared(
        self, sources: list[Any], grads: list[Any], local: set[int], out: list[Any]
    ) -> None:
        """Into ``out``: the buckets' results, and the allgathered IndexedSlices."""
        dense_as = self._options["sparse_as_dense"]
        shared = [i for i in range(len(sources)) if i not in local]
        slices = [i for i in shared if is_slices(grads[i], dense_as)]
        bucketed = [i for i in shared if not is_slices(grads[i], dense_as)]
        if bucketed or not sources:  # no sources at all: validation says so, on every rank
            reducer = self._reducer_for([sources[i] for i in bucketed])
            reduced = reducer.reduce([grads[i] for i in bucketed], [sources[i] for i in bucketed])
            for i, g in zip(bucketed, reduced):
                out[i] = g
        for i in slices:
            out[i] = gather_slices(
                grads[i],
                self._options["op"],
                self._options["gradient_predivide_factor"],
                self._options["process_set"],
                f"hvds.{self._name}.slices.{i}",
            )

    def _reducer_for(self, sources: list[Any]) -> GradientReducer:
        """The reducer for this name and list of sources; built and validated once.

        The first time a (name, source shapes and dtypes, config, process set) is seen,
        the reducer is built and one validation collective runs within the process set:
        an allgather of a small pickled ``(verdict, [(name, shape, dtype)])`` per rank
        (see :mod:`horovod_sparse.tensorflow.validation`), eagerly under
        ``tf.init_scope`` even inside a ``tf.function``, before the step's collectives.
        Every rank raises if any rank's knobs or sources are invalid (empty list, not
        floating point, bfloat16) or if the ranks' source shapes or dtypes differ. Later
        calls with the same sources reuse the reducer without a collective, so every
        rank must pass matching sources under a given ``name`` from the start.
        """
        signature = tuple((tuple(s.shape), tf.as_dtype(s.dtype).name) for s in sources)
        process_set = self._options["process_set"]
        key = (self._name, signature, self._config, id(process_set))
        if key not in _REDUCERS:
            problem = self._problem
            reducer = None
            what = f"DistributedGradientTape {self._name!r}"
            with tf.init_scope():
                if problem is None:
                    try:
                        check_variables(sources, what)
                        assert self._config is not None  # else self._problem is set
                        reducer = GradientReducer(
                            sources, self._config, name=f"hvds.{self._name}", **self._options
                        )
                    except (TypeError, ValueError) as error:
                        problem = error
                validate_across_ranks(describe(sources), problem, process_set, what)
            assert reducer is not None  # every rank is valid, or validation raised
            _REDUCERS[key] = reducer
        self._reducer = _REDUCERS[key]
        return self._reducer

    def stats(self) -> StepStats:
        """Statistics of the last ``gradient()`` call (call eagerly)."""
        if self._reducer is None:
            raise RuntimeError("gradient() has not been called on this tape")
        return self._reducer.stats()

    def residual_variables(self) -> dict[str, tf.Variable]:
        """Residual variable per sparse bucket, for ``tf.train.Checkpoint``."""
        if self._reducer is None:
            raise RuntimeError("gradient() has not been called on this tape")
        return self._reducer.residuals()

    def state_variables(self) -> dict[str, tf.Variable]:
        """Every variable a resumed run needs, by ``"{kind}_{bucket}"``: the residuals
        and each sparse bucket's step count, boundaries, selection and reused global
        threshold state, e.g. ``tf.train.Checkpoint(tape_state=tape.state_variables())``."""
        if self._reducer is None:
            raise RuntimeError("gradient() has not been called on this tape")
        return self._reducer.state_variables()
