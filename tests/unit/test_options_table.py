"""The option-support table against the docs and against each front-end's refusal.

Each front-end is driven up to the point where it has judged its options and no
further: the functional APIs stop before their reduction, the torch optimizer before
its validation collective, the TF tape and Keras optimizer keep the verdict they report
at the first step. No Horovod collective runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from horovod_sparse.common import options as option_table
from horovod_sparse.common.config import OPTION_NAMES, SparseConfig
from horovod_sparse.common.options import (
    OPTION_SUPPORT,
    Frontend,
    option_table_markdown,
    refuse_unsupported,
    replace_table,
    supported,
    table_between_markers,
)
from horovod_sparse.common.registry import PerTensorOptions

DOCS = Path(__file__).resolve().parents[2] / "docs" / "options.md"

# A valid value away from the default for every option.
AWAY_FROM_DEFAULT: dict[str, Any] = {
    "density": 0.5,
    "min_sparse_numel": 10,
    "selection": "exact",
    "partition": "balanced",
    "fusion_threshold_bytes": 4096,
    "reestimate_steps": 2,
    "repartition_steps": 7,
    "warmup_steps": 3,
    "density_decay_steps": 5,
    "dense_fusion_bytes": 0,
    "error_feedback": False,
    "momentum_correction": False,
    "residual_lookahead": True,
    "overlap_allgather": True,
    "scheduler": "auto",
    "scheduler_steps": 10,
    "trace": "trace-{rank}.json",
    "global_selection": "exact",
    "refresh_steps": 8,
    "log_every": 5,
    "join_buckets": False,
    "gather_selections": False,
}
OPTIONS = sorted(OPTION_NAMES)


class PastValidationError(Exception):
    """Raised where a front-end has accepted its options and would start reducing."""


def test_every_option_has_a_sample_value_away_from_its_default():
    assert set(AWAY_FROM_DEFAULT) == OPTION_NAMES
    default = SparseConfig()
    for name, value in AWAY_FROM_DEFAULT.items():
        assert getattr(SparseConfig(**{name: value}), name) != getattr(default, name), name


def test_the_table_has_a_row_for_every_option():
    assert set(OPTION_SUPPORT) == OPTION_NAMES
    rows = option_table_markdown().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [n for n in SparseConfig.__dataclass_fields__]


def test_docs_show_the_generated_table():
    shown = table_between_markers(DOCS.read_text(encoding="utf-8"))
    assert shown == option_table_markdown(), (
        "docs/options.md is out of date: run "
        "python -m horovod_sparse.common.options --write docs/options.md"
    )


def test_replace_table_keeps_the_markers_and_the_rest():
    text = "# T\n\n<!-- option-support:begin -->\nold\nrows\n<!-- option-support:end -->\nafter\n"
    replaced = replace_table(text, "new")
    assert replaced == (
        "# T\n\n<!-- option-support:begin -->\nnew\n<!-- option-support:end -->\nafter\n"
    )
    assert table_between_markers(replaced) == "new"
    with pytest.raises(ValueError, match="option-support:begin"):
        table_between_markers("no markers here\n")


def test_module_entry_point_prints_the_table(capsys):
    assert option_table.main([]) == 0
    assert capsys.readouterr().out == option_table_markdown() + "\n"


def test_module_entry_point_writes_between_the_markers(tmp_path):
    page = tmp_path / "options.md"
    page.write_text("intro\n<!-- option-support:begin -->\n<!-- option-support:end -->\nend\n")
    assert option_table.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert table_between_markers(text) == option_table_markdown()
    assert text.startswith("intro\n") and text.endswith("<!-- option-support:end -->\nend\n")


def refusal(name: str, frontend: Frontend) -> str:
    return re.escape(f"{name}={AWAY_FROM_DEFAULT[name]!r} does not apply to {frontend.where}")


@pytest.mark.parametrize("frontend", list(Frontend), ids=lambda f: f.name)
@pytest.mark.parametrize("name", OPTIONS)
def test_refuse_unsupported_follows_the_table(frontend, name):
    config = SparseConfig(**{name: AWAY_FROM_DEFAULT[name]})
    if frontend in OPTION_SUPPORT[name]:
        refuse_unsupported(config, frontend)
    else:
        with pytest.raises(ValueError, match=refusal(name, frontend)):
            refuse_unsupported(config, frontend)
    refuse_unsupported(SparseConfig(), frontend)  # defaults are never refused


# ---------------------------------------------------------------- the front-ends
def ddp_hook_verdict(options: dict[str, Any]) -> Exception | None:
    from horovod_sparse.torch.ddp import SparseState

    try:
        SparseState(**options)  # no process group is needed until the first bucket
    except ValueError as error:
        return error
    return None


def per_tensor_verdict(run: Any, options: dict[str, Any], monkeypatch) -> Exception | None:
    def judged(*args: Any, **kwargs: Any) -> Any:
        raise PastValidationError

    monkeypatch.setattr(PerTensorOptions, "scaled", judged)
    try:
        run(options)
    except PastValidationError:
        return None
    except ValueError as error:
        return error
    raise AssertionError("the options were neither accepted nor refused")


def torch_allreduce_verdict(options: dict[str, Any], monkeypatch) -> Exception | None:
    pytest.importorskip("horovod.torch")
    import torch

    from horovod_sparse.torch.functions import sparse_allreduce

    def run(options: dict[str, Any]) -> None:
        sparse_allreduce(torch.ones(10), name="options_table", **options)

    return per_tensor_verdict(run, options, monkeypatch)


def tf_allreduce_verdict(options: dict[str, Any], monkeypatch) -> Exception | None:
    pytest.importorskip("horovod.tensorflow")
    import tensorflow as tf

    from horovod_sparse.tensorflow.functions import sparse_allreduce

    def run(options: dict[str, Any]) -> None:
        sparse_allreduce(tf.ones([10]), name="options_table", **options)

    return per_tensor_verdict(run, options, monkeypatch)


class OneRank:
    """A process set of this process alone, enough for the optimizer's local checks."""

    def included(self) -> bool:
        return True

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def torch_optimizer_verdict(options: dict[str, Any], monkeypatch) -> Exception | None:
    pytest.importorskip("horovod.torch")
    import torch

    from horovod_sparse.torch import optimizer as torch_optimizer

    verdicts: list[str | None] = []

    def validation_collective(mine: Any, name: str, process_set: Any) -> Any:
        verdicts.append(mine[0])
        raise PastValidationError

    monkeypatch.setattr(torch_optimizer, "allgather_object", validation_collective)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(PastValidationError):
        torch_optimizer.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            process_set=OneRank(),
            model=model,
            **options,
        )
    if verdicts[0] is None:
        return None
    kind, _, message = verdicts[0].partition(": ")  # verdict_of's "ValueError: ..." text
    return ValueError(message) if kind == "ValueError" else RuntimeError(verdicts[0])


def tf_tape_verdict(options: dict[str, Any], monkeypatch) -> Exception | None:
    pytest.importorskip("horovod.tensorflow")
    import tensorflow as tf

    from horovod_sparse.tensorflow.tape import DistributedGradientTape

    with tf.GradientTape() as tape:
        pass
    # The tape reports its verdict in the first gradient() call's validation collective.
    return DistributedGradientTape(tape, name="options_table", **options)._problem


def keras_optimizer_verdict(options: dict[str, Any], monkeypatch) -> Exception | None:
    pytest.importorskip("horovod.tensorflow")
    import keras

    from horovod_sparse.tensorflow.keras.optimizer import DistributedOptimizer

    # The optimizer reports its verdict in build()'s validation collective.
    return DistributedOptimizer(keras.optimizers.SGD(0.01), **options)._sparse_problem


VERDICTS = {
    Frontend.TORCH_OPTIMIZER: torch_optimizer_verdict,
    Frontend.TORCH_ALLREDUCE: torch_allreduce_verdict,
    Frontend.DDP_HOOK: lambda options, monkeypatch: ddp_hook_verdict(options),
    Frontend.TF_TAPE: tf_tape_verdict,
    Frontend.KERAS_OPTIMIZER: keras_optimizer_verdict,
    Frontend.TF_ALLREDUCE: tf_allreduce_verdict,
}


def test_every_front_end_is_exercised():
    assert set(VERDICTS) == set(Frontend)


@pytest.mark.parametrize("frontend", list(Frontend), ids=lambda f: f.name)
@pytest.mark.parametrize("name", OPTIONS)
def test_front_end_refuses_exactly_what_the_table_says(frontend, name, monkeypatch):
    problem = VERDICTS[frontend]({name: AWAY_FROM_DEFAULT[name]}, monkeypatch)
    if name in supported(frontend):
        assert problem is None, f"{frontend.name} refused {name}: {problem}"
    else:
        assert isinstance(problem, ValueError), f"{frontend.name} accepted {name}"
        assert re.search(refusal(name, frontend), str(problem)), str(problem)


@pytest.mark.parametrize("frontend", list(Frontend), ids=lambda f: f.name)
def test_front_end_reads_the_table(frontend, monkeypatch):
    # Take error_feedback, which every front-end acts on, away from one of them.
    changed = dict(OPTION_SUPPORT, error_feedback=OPTION_SUPPORT["error_feedback"] - {frontend})
    monkeypatch.setattr(option_table, "OPTION_SUPPORT", MappingProxyType(changed))
    problem = VERDICTS[frontend]({"error_feedback": False}, monkeypatch)
    assert isinstance(problem, ValueError)
    assert re.search(refusal("error_feedback", frontend), str(problem)), str(problem)
