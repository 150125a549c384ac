"""Keras 3 optimizer wrapper: sparse allreduce inside ``model.fit`` and custom loops.

Horovod's ``horovod.tensorflow.keras`` does not support Keras 3; this does. The
reduction runs in the optimizer's update step, so it happens once per *update*: with
``backward_passes_per_step = n`` the wrapper uses Keras's own
``gradient_accumulation_steps = n`` and reduces the accumulated gradient every n-th
step. Keras's ``clipnorm`` / ``global_clipnorm`` / ``clipvalue`` apply to the reduced
gradient, as clipping does with dense Horovod.

Momentum correction (on by default for a sparse ``keras.optimizers.SGD`` with momentum
and for ``Adam``/``AdamW``; the rules are :mod:`horovod_sparse.common.correction`, shared
with torch):

- SGD: each rank runs the momentum on its own gradient before the exchange
  (``u = m * u + g``), the exchange carries ``u`` and the wrapped SGD steps with its
  momentum off, so lumps released by error feedback are not amplified by momentum a
  second time. Entries a rank sent leave its velocity (DGC's momentum factor masking).
  At density 1 and a constant learning rate this is Keras's momentum SGD up to rounding.
- Adam, AdamW: each rank keeps its own moments over the sparse buckets and the exchange
  carries Adam's bias-corrected direction; those variables step by ``-lr`` times the
  reduced direction (AdamW's decoupled decay is applied by Keras as usual). Variables of
  dense buckets (under ``min_sparse_numel``) step by Adam's own update.

Clipping then bounds the reduced step direction rather than the reduced gradient; pass
``momentum_correction=False`` for Horovod's clipping semantics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from horovod_sparse.common.classes import combined_class
from horovod_sparse.common.config import SparseConfig, make_config, optimizer_scales, take_options
from horovod_sparse.common.correction import correction_family
from horovod_sparse.common.options import Frontend, refuse_unsupported
from horovod_sparse.tensorflow.keras.flush import KerasFlush
from horovod_sparse.tensorflow.keras.state import SparseStateAccess
from horovod_sparse.tensorflow.keras.update import exchange_update
from horovod_sparse.tensorflow.reducer import (
    AdamSettings,
    GradientReducer,
    horovod_arguments,
    op_name,
)
from horovod_sparse.tensorflow.routing import source_keys
from horovod_sparse.tensorflow.validation import check_variables, describe, validate_across_ranks

__all__ = ["DistributedOptimizer", "SparseOptimizerMixin"]


if TYPE_CHECKING:
    # What the mixin is combined with (combined_class): type checkers see the Keras
    # optimizer's methods and attributes; at run time the mixin has no base of its own.
    from keras.optimizers import Optimizer as _OptimizerBase
else:
    _OptimizerBase = object


class SparseOptimizerMixin(SparseStateAccess, KerasFlush, _OptimizerBase):
    """Put in front of a Keras 3 optimizer class to reduce gradients sparsely.

    Takes the sparse keywords of :func:`DistributedOptimizer` next to the optimizer's own.

    Example:
        >>> class SparseAdam(SparseOptimizerMixin, keras.optimizers.Adam):
        ...     pass
        >>> opt = SparseAdam(learning_rate=1e-3, density=0.01)
    """

    def __init__(
        self,
        *args: Any,
        compression: Any = hvd.Compression.none,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        op: Any = hvd.Average,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = hvd.global_process_set,
        scale_local_gradients: bool = True,
        **kwargs: Any,
    ) -> None:
        # The sparse options (SparseConfig's fields) are taken out of the keywords; the
        # rest belong to the Keras optimizer. A bad one is not raised here: it becomes
        # this rank's verdict in the validation collective of build(), so every rank
        # raises instead of one rank raising while the others wait in a collective.
        options = take_options(kwargs)
        problem: Exception | None = None
        config: SparseConfig | None = None
        try:
            if int(backward_passes_per_step) < 1:
                raise ValueError(
                    f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
                )
            if backward_passes_per_step > 1:
                kwargs["gradient_accumulation_steps"] = int(backward_passes_per_step)
            config = make_config(options)
            refuse_unsupported(config, Frontend.KERAS_OPTIMIZER)
        except (TypeError, ValueError) as error:
            problem = error
        super().__init__(*args, **kwargs)  # Keras wants it before any attribute is set
        # The SGD momentum the exchange carries (0: no correction), taken out of the
        # wrapped SGD so it steps plainly by the reduced direction.
        self._corrected_momentum, self._corrected_nesterov = 0.0, False
        self._adam_correction: AdamSettings | None = None
        if problem is None:
            try:
                assert config is not None
                self._take_correction(config.momentum_correction, config)
            except ValueError as error:
                problem = error
        self._sparse_problem = problem
        self.sparse_config = config
        self._sparse_options = horovod_arguments(locals())
        # Keras averages accumulated gradients; Horovod sums them unless asked to average.
        self._aggregation_scale = (
            1.0
            if average_aggregated_gradients or self._sparse_problem is not None
            else float(max(1, int(backward_passes_per_step)))
        )
        self._sparse_kwargs = dict(
            options,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients,
            scale_local_gradients=scale_local_gradients,
        )
        self._gradient_reducer: GradientReducer | None = None
        self._scale_local = bool(scale_local_gradients)
        self._local_vars: set[int] = set()  # ids (routing.source_keys)
        self._local_indices: set[int] = set()  # positions in the build order

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local, as Horovod does: it takes no part in any
        collective or bucket, and is divided by the process set's size unless the
        optimizer was made with ``scale_local_gradients=False``. Register before the
        optimizer is built (its first step): the buckets are planned then."""
        if self.built:
            raise ValueError(
                "register_local_var() after the optimizer is built: its buckets are "
                "planned; register local variables before the first step"
            )
        self._local_vars |= source_keys(var)

    def _take_correction(self, requested: bool | None, config: SparseConfig) -> None:
        """Resolve ``momentum_correction`` (:func:`~horovod_sparse.common.correction.
        correction_family`): ``None`` turns it on for a sparse ``keras.optimizers.SGD``
        with momentum and for ``Adam``/``AdamW``, ``True`` insists, ``False`` leaves the
        wrapped optimizer as it is."""
        is_sgd = isinstance(self, keras.optimizers.SGD)
        is_adam = isinstance(self, keras.optimizers.Adam)  # AdamW is a subclass
        if is_adam and self.amsgrad:
            if requested:
                raise ValueError("momentum_correction does not support Adam(amsgrad=True)")
            return
        family = "sgd" if is_sgd else "adam" if is_adam else None
        chosen = correction_family(
            requested,
            family,
            float(self.momentum) > 0.0 if is_sgd else is_adam,
            config.density < 1.0 or config.warmup_steps > 0,
            type(self).__name__,
            "keras.optimizers.SGD, Adam or AdamW",
        )
        if chosen == "adam":
            self._adam_correction = AdamSettings(
                float(self.beta_1), float(self.beta_2), float(self.epsilon)
            )
        elif chosen == "sgd":
            self._corrected_momentum = float(self.momentum)
            self._corrected_nesterov = bool(self.nesterov)
            # Keras's SGD reads these in build() and update_step(): with momentum 0 it
            # creates no slots and applies -lr * gradient.
            self.momentum: float = 0.0
            self.nesterov: bool = False

    @property
    def momentum_correction(self) -> bool:
        """Whether the SGD momentum runs in front of the exchange (see the module)."""
        return self._corrected_momentum > 0.0 or self._adam_correction is not None

    def build(self, variables: list[Any]) -> None:
        """Validate across ranks, then create the slots, the residuals and the reducer.

        Before anything else, one validation collective within the process set: an
        allgather of a small pickled ``(verdict, [(path, shape, dtype)])`` per rank (see
        :mod:`horovod_sparse.tensorflow.validation`). The verdict covers the sparse
        keywords given to the constructor and the variables (non-empty, floating point,
        not bfloat16). It runs once per optimizer, eagerly (under ``tf.init_scope``) even
        when Keras builds the optimizer while tracing a ``tf.function``, before the first
        training step's collectives. Every rank then raises if any rank is invalid or
        holds different variable shapes or dtypes.
        """
        variables = list(variables)
        process_set = self._sparse_options["process_set"]
        self._local_indices = {i for i, v in enumerate(variables) if id(v) in self._local_vars}
        if not process_set.included():
            # Horovod's identity outside the process set: no collective, no buckets.
            super().build(variables)
            return
        problem = self._sparse_problem
        if problem is None:
            try:
                options = self._sparse_options
                optimizer_scales(
                    op_name(options["op"]),
                    process_set.size(),
                    float(options["gradient_predivide_factor"]),
                )
                check_variables(variables, "the optimizer")
            except (TypeError, ValueError) as error:
                problem = error
        validate_across_ranks(describe(variables), problem, process_set, "the optimizer")
        super().build(variables)
        shared = [v for i, v in enumerate(variables) if i not in self._local_indices]
        if not shared:
            return  # every variable is local

        def make_variable(kind: str, numel: int, dtype: tf.DType, name: str) -> Any:
            # Optimizer variables: saved and restored with the model's checkpoint.
            return self.add_variable((numel,), dtype=dtype.name, name=f"sparse_{kind}_{name}")

        def make_state_variable(initial: tf.Tensor, name: str) -> Any:
            # A bucket's step count, boundaries, selection and reused threshold: made at
            # build (not at the first step), so a fresh optimizer's variable list is the
            # saved one's, and a restored run resumes its schedule.
            # Through ``initializer``, not an ``assign`` after it: Keras builds the
            # optimizer inside a stateless scope where an assign is not kept (the
            # variables then started at zero: partition boundaries [0, 0, 0] sent no
            # rows at all).
            return self.add_variable(
                tuple(initial.shape),
                initializer=lambda shape, dtype: tf.cast(initial, dtype),
                dtype=initial.dtype.name,
                name=f"sparse_{name}",
            )

        assert self.sparse_config is not None  # else validation raised above
        self._gradient_reducer = GradientReducer(
            shared,
            self.sparse_config,
            name=f"hvds.keras.{self.name}",
            make_variable=make_variable,
            make_state_variable=make_state_variable,
            momentum=self._corrected_momentum,
            adam=self._adam_correction,
            nesterov=self._corrected_nesterov,
            **self._sparse_options,
        )

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        # Clipping moves after the reduction (see _backend_update_step).
        return grads

    def _backend_update_step(
        self, grads: list[Any], trainable_variables: list[Any], learning_rate: Any
    ) -> None:
        # Keras may have dropped variables without gradients: the buckets take the full
        # list in the build order, zeros where a gradient is missing, so ranks match.
        by_index = {self._get_variable_index(v): g for g, v in zip(grads, trainable_variables)}
        if self._aggregation_scale != 1.0:
            by_index = {i: g * self._aggregation_scale for i, g in by_index.items()}
        reduced, corrected = exchange_update(
            by_index,
            self._trainable_variables,
            self._gradient_reducer,
            self._local_indices,
            self._sparse_options,
            self._scale_local,
            f"hvds.keras.{self.name}",
        )
        grads = [reduced[self._get_variable_index(v)] for v in trainable_variables]
        grads = super()._clip_gradients(grads)
        if self._adam_correction is None:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
            return
        # Adam's correction: the reduced direction of a sparse bucket's variable is the
        # step (-lr times it); other variables take Adam's own update.
        native = [
            (g, v)
            for g, v in zip(grads, trainable_variables)
            if self._get_variable_index(v) not in corrected
        ]
        for g, v in zip(grads, trainable_variables):
            if self._get_variable_index(v) in corrected:
                v.assign_sub(tf.cast(learning_rate, v.dtype) * g)
        if native:
            super()._backend_update_step(
                [g for g, _ in native], [v for _, v in native], learning_rate
            )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self._corrected_momentum > 0.0:  # the user's SGD settings, not the SGD stepped
            config.update(momentum=self._corrected_momentum, nesterov=self._corrected_nesterov)
        config.update(self._sparse_kwargs)
        return config


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = hvd.Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = hvd.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = hvd.global_process_set,
    scale_local_gradients: bool = True,
    **options: Any,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so every update uses sparse allreduce.

    Accepts the arguments of Horovod's Keras ``DistributedOptimizer``
    (``device_dense`` and ``device_sparse`` are accepted for compatibility and have no
    effect) with Horovod's meaning: a rank outside ``process_set`` steps with its own
    gradients, :meth:`~SparseOptimizerMixin.register_local_var` and
    ``scale_local_gradients`` as Horovod's, ``IndexedSlices`` allgathered unless
    ``sparse_as_dense`` (:mod:`horovod_sparse.tensorflow.routing`). Wrap before the
    first step: the new optimizer is built from ``optimizer.get_config()``, so slot
    variables start fresh.

    Sparse options: those of :class:`~horovod_sparse.common.config.SparseConfig` that
    the Keras optimizer acts on: ``density`` (fraction of entries exchanged per bucket),
    ``min_sparse_numel`` (smaller variables go through a dense allreduce),
    ``selection``, ``partition``, ``fusion_threshold_bytes`` (bucket capacity; ``None``
    follows ``HOROVOD_FUSION_THRESHOLD``), ``reestimate_steps``, ``repartition_steps``,
    ``warmup_steps`` and ``density_decay_steps`` (the density schedule, followed inside
    one trace), ``dense_fusion_bytes`` (on a step where adjacent sparse buckets are all
    dense, they share one allreduce of up to that many bytes; 0: one each),
    ``error_feedback`` (``False`` zeroes the residual at the end of every step: ablation
    only, it loses gradient mass), ``global_selection`` and ``refresh_steps`` (how owners
    find the global threshold), ``log_every`` (a line of the step's figures on rank 0) and
    ``momentum_correction`` (default ``None``: on for
    ``keras.optimizers.SGD`` with momentum when ``density < 1``), which runs the
    momentum on each rank's gradient before the exchange and steps the SGD with its
    momentum off; the velocity is saved with the optimizer's variables. Its velocity
    holds gradients, as torch's SGD does, where Keras's holds ``lr * g`` terms: under a
    learning-rate schedule past steps are scaled by the current rate, not by their own.

    Invalid keywords (e.g. ``density`` outside (0, 1]) are not raised here: they are
    reported when the optimizer is built (first step, or ``optimizer.build``), on every
    rank, by the one validation collective of :meth:`SparseOptimizerMixin.build`, which
    also checks that every rank has the same variable shapes and dtypes.

    Example:
        >>> opt = DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), density=0.01)
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        >>> model.fit(x, y)
    """
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is built (before the first training step)")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    register = keras.saving.register_keras_serializable(package="horovod_sparse")
    cls = combined_class(SparseOptimizerMixin, type(optimizer), __name__, register)
    return cls(
        **config,
        **options,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
