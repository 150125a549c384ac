"""The same model gets the same buckets under PyTorch and TensorFlow (one shared planner)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest
import torch

from horovod_sparse.common.buckets import plan_model
from horovod_sparse.tensorflow.reducer import describe_variables
from horovod_sparse.torch.parameters import describe_parameters

# (inputs, outputs) of a stack of dense layers, with a 1-D norm between two of them.
LAYERS = [(20, 64), (64, 64), (64, 48), (48, 5)]


def torch_model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(LAYERS):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i == 1:
            layers.append(torch.nn.LayerNorm(fan_out))
    return torch.nn.Sequential(*layers)


def keras_model() -> keras.Model:
    layers: list[keras.layers.Layer] = [keras.Input((LAYERS[0][0],))]
    for i, (_, fan_out) in enumerate(LAYERS):
        layers.append(keras.layers.Dense(fan_out))
        if i == 1:
            layers.append(keras.layers.LayerNormalization())
    return keras.Sequential(layers)


def layout(plan, positions: dict[str, int]) -> list[tuple]:
    """A plan with each tensor named by its registration position (names differ)."""
    return [
        (b.kind, b.dtype, tuple((positions[e.name], e.numel, e.offset) for e in b.entries))
        for b in plan.buckets
    ]


@pytest.mark.parametrize(
    "min_sparse_numel,capacity,num_groups,groups",
    [
        (1024, 128 * 1024 * 1024, 0, None),  # one sparse bucket, one dense
        (0, 4 * 4096, 0, None),  # every tensor sparse, several buckets by capacity
        (100, 1 << 30, 2, None),  # num_groups: reversed order cut in two
        (100, 1 << 30, 0, [[0, 2], [4]]),  # explicit groups (positions of weights)
    ],
)
def test_torch_and_tensorflow_plan_the_same_buckets(min_sparse_numel, capacity, num_groups, groups):
    named = list(torch_model().named_parameters())
    variables = keras_model().trainable_variables
    described_torch = describe_parameters(named)
    described_tf = describe_variables(variables)
    # The frameworks register the same tensors in the same order (weights transposed).
    assert [d[1:] for d in described_torch] == [d[1:] for d in described_tf]
    torch_groups = tf_groups = None
    if groups is not None:
        torch_groups = [[named[i][0] for i in g] for g in groups]
        tf_groups = [[str(i) for i in g] for g in groups]
    torch_plan = plan_model(described_torch, min_sparse_numel, capacity, torch_groups, num_groups)
    tf_plan = plan_model(described_tf, min_sparse_numel, capacity, tf_groups, num_groups)
    torch_positions = {n: i for i, (n, _) in enumerate(named)}
    tf_positions = {str(i): i for i in range(len(variables))}
    assert layout(torch_plan, torch_positions) == layout(tf_plan, tf_positions)
    # Every tensor is in exactly one bucket; readiness order: the last layer first.
    placed = sorted(i for _, _, entries in layout(tf_plan, tf_positions) for i, _, _ in entries)
    assert placed == list(range(len(variables)))
    if groups is None:  # readiness order: the last large tensor opens the first bucket
        last_large = max(i for i, d in enumerate(described_tf) if d[1] >= min_sparse_numel)
        assert int(tf_plan.buckets[0].entries[0].name) == last_large


def test_num_groups_cuts_in_readiness_order():
    described = [(f"t{i}", 2000, "float32", 4) for i in range(5)]
    plan = plan_model(described, 1024, 1 << 30, None, 2)
    assert [[e.name for e in b.entries] for b in plan.sparse] == [["t4", "t3", "t2"], ["t1", "t0"]]
    assert plan.dense == ()
