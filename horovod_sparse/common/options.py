"""Which front-end acts on which option of :class:`~horovod_sparse.common.config.SparseConfig`.

:data:`OPTION_SUPPORT` is the one table: every front-end refuses, by name, an option it
does not act on when it is set away from its default (:func:`refuse_unsupported`), and
``docs/options.md`` shows the same table (:func:`option_table_markdown`). Run
``python -m horovod_sparse.common.options`` to print it, or with ``--write docs/options.md``
to replace the table between the file's markers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType

from horovod_sparse.common.config import OPTION_NAMES, SparseConfig

__all__ = [
    "OPTION_SUPPORT",
    "TABLE_BEGIN",
    "TABLE_END",
    "Frontend",
    "main",
    "option_table_markdown",
    "refuse_unsupported",
    "replace_table",
    "supported",
    "table_between_markers",
]


class Frontend(Enum):
    """A user-facing entry point that takes the sparse options.

    Each member carries ``where`` (how a refusal names it) and ``heading`` (its column
    in the documentation's table).
    """

    TORCH_OPTIMIZER = ("DistributedOptimizer", "PyTorch `DistributedOptimizer`")
    TORCH_ALLREDUCE = ("sparse_allreduce", "PyTorch `sparse_allreduce`")
    DDP_HOOK = ("the DDP communication hook", "DDP hook `SparseState`")
    TF_TAPE = ("DistributedGradientTape", "TF `DistributedGradientTape`")
    KERAS_OPTIMIZER = ("the Keras optimizer", "Keras `DistributedOptimizer`")
    TF_ALLREDUCE = ("sparse_allreduce under TensorFlow", "TF `sparse_allreduce`")

    def __init__(self, where: str, heading: str) -> None:
        self.where = where
        self.heading = heading


_EVERY = frozenset(Frontend)
# A single tensor has no buckets to size, fuse, schedule or trace, and no optimizer.
_PER_TENSOR = frozenset((Frontend.TORCH_ALLREDUCE, Frontend.TF_ALLREDUCE))
# Many tensors in buckets: those under min_sparse_numel are averaged densely.
_WHOLE_MODEL = _EVERY - _PER_TENSOR
# Options over a whole step's buckets (their capacity, dense fusion, one progress line
# a step): DDP sizes its own buckets (bucket_cap_mb) and calls the hook once a bucket.
_BUCKETED = _WHOLE_MODEL - {Frontend.DDP_HOOK}

# For every option, the front-ends that act on it; the others refuse it by name.
OPTION_SUPPORT: Mapping[str, frozenset[Frontend]] = MappingProxyType(
    {
        "density": _EVERY,
        "min_sparse_numel": _WHOLE_MODEL,
        "selection": _EVERY,
        "partition": _EVERY,
        "fusion_threshold_bytes": _BUCKETED,
        "reestimate_steps": _EVERY,
        "repartition_steps": _EVERY,
        "warmup_steps": _EVERY,
        "density_decay_steps": _EVERY,
        "dense_fusion_bytes": _BUCKETED,
        "error_feedback": _EVERY,
        # Needs the wrapped optimizer's momentum: the DDP hook takes its own ``momentum``
        # keyword instead, and a tape has no optimizer.
        "momentum_correction": frozenset((Frontend.TORCH_OPTIMIZER, Frontend.KERAS_OPTIMIZER)),
        # Moves the parameters the optimizer steps: the PyTorch optimizer's own.
        "residual_lookahead": frozenset((Frontend.TORCH_OPTIMIZER,)),
        "overlap_allgather": frozenset((Frontend.TORCH_OPTIMIZER,)),
        "scheduler": frozenset((Frontend.TORCH_OPTIMIZER,)),
        "scheduler_steps": frozenset((Frontend.TORCH_OPTIMIZER,)),
        "trace": frozenset((Frontend.TORCH_OPTIMIZER,)),
        "global_selection": _EVERY,
        "refresh_steps": _EVERY,
        "log_every": _BUCKETED,
        # Several buckets in one engine: DDP hands each bucket to the hook on its own.
        "join_buckets": _BUCKETED,
        "gather_selections": _EVERY,
    }
)

# An option added to SparseConfig without a row would be refused everywhere.
if set(OPTION_SUPPORT) != OPTION_NAMES:
    raise RuntimeError(
        f"OPTION_SUPPORT and SparseConfig disagree on: {sorted(set(OPTION_SUPPORT) ^ OPTION_NAMES)}"
    )

TABLE_BEGIN = "<!-- option-support:begin -->"
TABLE_END = "<!-- option-support:end -->"
ACTED_ON = "\u2713"  # check mark
REFUSED = "\u2014"  # em dash


def supported(frontend: Frontend) -> frozenset[str]:
    """The options ``frontend`` acts on."""
    return frozenset(name for name, where in OPTION_SUPPORT.items() if frontend in where)


def refuse_unsupported(config: SparseConfig, frontend: Frontend) -> None:
    """Refuse an option of ``config`` set away from its default that ``frontend`` does
    not act on.

    Raises:
        ValueError: naming the option, its value and the front-end.
    """
    config.unsupported(frontend.where, supported(frontend))


def option_table_markdown() -> str:
    """:data:`OPTION_SUPPORT` as a Markdown table: a row per option, in
    :class:`SparseConfig`'s order, and a column per front-end."""
    columns = list(Frontend)
    lines = [
        "| option | " + " | ".join(f.heading for f in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for name in (spec.name for spec in fields(SparseConfig)):
        marks = (ACTED_ON if f in OPTION_SUPPORT[name] else REFUSED for f in columns)
        lines.append(f"| `{name}` | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def _marker_lines(lines: list[str]) -> tuple[int, int]:
    stripped = [line.strip() for line in lines]
    if stripped.count(TABLE_BEGIN) != 1 or stripped.count(TABLE_END) != 1:
        raise ValueError(f"expected one {TABLE_BEGIN} line and one {TABLE_END} line")
    begin, end = stripped.index(TABLE_BEGIN), stripped.index(TABLE_END)
    if end < begin:
        raise ValueError(f"{TABLE_END} comes before {TABLE_BEGIN}")
    return begin, end


def table_between_markers(text: str) -> str:
    """The lines of ``text`` between its two marker lines.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    lines = text.splitlines()
    begin, end = _marker_lines(lines)
    return "\n".join(lines[begin + 1 : end])


def replace_table(text: str, table: str) -> str:
    """``text`` with the lines between its marker lines replaced by ``table``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    lines = text.splitlines(keepends=True)
    begin, end = _marker_lines([line.rstrip("\n") for line in lines])
    return "".join([*lines[: begin + 1], table + "\n", *lines[end:]])


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table, or with ``--write FILE`` put it between FILE's markers."""
    parser = argparse.ArgumentParser(
        prog="python -m horovod_sparse.common.options",
        description="The table of which front-end acts on which sparse option.",
    )
    parser.add_argument(
        "--write",
        metavar="FILE",
        type=Path,
        help=f"replace the lines between {TABLE_BEGIN} and {TABLE_END} in FILE",
    )
    args = parser.parse_args(argv)
    table = option_table_markdown()
    if args.write is None:
        print(table)
        return 0
    path: Path = args.write
    text = path.read_text(encoding="utf-8")
    updated = replace_table(text, table)
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
