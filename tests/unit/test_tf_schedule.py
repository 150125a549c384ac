"""TF's graph budget arithmetic against the host rule it stands in for.

While the density decays, TF computes k from the step variable in the graph
(``TFBackend.sparse_budget``) and the threshold selection's band and sample rank from
that k (``TFBackend.scaled_count``). Every rank must get the host's integers exactly,
or the collectives' sizes and the density schedule would drift from torch's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

tf = pytest.importorskip("tensorflow")

from horovod_sparse.common.backend import HostCounts  # noqa: E402
from horovod_sparse.common.config import SparseConfig, budget  # noqa: E402
from horovod_sparse.tensorflow.backend import TFBackend  # noqa: E402
from horovod_sparse.tensorflow.kernels import scheduled_budget  # noqa: E402

SCHEDULES = [
    dict(density=0.01),
    dict(density=0.01, warmup_steps=3),
    dict(density=0.01, density_decay_steps=7),
    dict(density=0.3, warmup_steps=2, density_decay_steps=5),
    dict(density=0.001, warmup_steps=1, density_decay_steps=50),
    dict(density=1.0, density_decay_steps=3),
]


@pytest.mark.parametrize("options", SCHEDULES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1000, 20_000, 123_457])
def test_graph_budget_is_the_host_rule(options, numel):
    config = SparseConfig(**options)
    steps = config.warmup_steps + config.density_decay_steps + 3
    expected = [budget(numel, config.density_at(step)) for step in range(steps)]
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def traced():
        return scheduled_budget(numel, config, step)

    got = []
    for s in range(steps):
        step.assign(s)
        eager = scheduled_budget(numel, config, tf.convert_to_tensor(step))
        got.append((int(eager), int(traced())))
    assert got == [(k, k) for k in expected]


def test_sparse_budget_is_a_host_int_unless_the_density_decays():
    ops, step = TFBackend(), tf.Variable(4, dtype=tf.int64)
    flat = SparseConfig(density=0.01, warmup_steps=3)
    assert ops.sparse_budget(20_000, flat, step) == 200  # no step read: a host int
    decaying = SparseConfig(density=0.01, warmup_steps=3, density_decay_steps=4)
    k = ops.sparse_budget(20_000, decaying, tf.convert_to_tensor(step))
    assert tf.is_tensor(k) and int(k) == budget(20_000, decaying.density_at(4))


@pytest.mark.parametrize(
    "numerator, denominator, rounding, least, most",
    [
        (0.8, 1, "ceil", None, None),
        (1.25, 1, "floor", None, None),
        (65_536, 123_457, "round", 1, 65_536),
        (3, 7, "round", 1, 5),
        (1, 2, "round", None, None),  # exact halves: both round half to even
    ],
)
def test_graph_scaled_count_is_the_host_arithmetic(numerator, denominator, rounding, least, most):
    counts = np.arange(1, 40_001, dtype=np.int64)
    host = [
        HostCounts().scaled_count(int(c), numerator, denominator, rounding, least, most)
        for c in counts
    ]
    graph = TFBackend().scaled_count(
        tf.constant(counts), numerator, denominator, rounding, least, most
    )
    assert graph.dtype == tf.int64
    np.testing.assert_array_equal(graph.numpy(), host)
