"""Sparse allreduce under PyTorch and TensorFlow in one Horovod job, dense allreduce as anchor.

Times, per call on rank 0, the functional ``sparse_allreduce`` of the same float32 tensor
under ``horovod_sparse.torch`` and ``horovod_sparse.tensorflow`` (inside a ``tf.function``
traced once, and eagerly), next to ``horovod.torch.allreduce`` and
``horovod.tensorflow.allreduce`` of that tensor. Every call gets a fresh random gradient
(drawn before timing, the same sequence for every method) under one name per method, so
the sparse calls run with error feedback as in a training loop. Two warm-up rounds, then
``--repeats`` timed rounds; a round calls every method once, in an order that rotates
from one round to the next, each call after a tiny allreduce that lines the ranks up.
Each method's median and min are reported, and each sparse method's ratio to its
framework's dense call of the same round, as the median over rounds (lowest-highest):
the methods share the same minutes of a machine whose speed drifts by tens of percent
between minutes. One intra-op thread per framework, as in allreduce.py.

Launches itself under ``horovodrun -np P --gloo`` (loopback) unless already under it.
Both frameworks' Horovod bindings are loaded in the same worker process; each binding
is its own Horovod runtime and is initialised on its own. Should that fail, or with
``--separate``, the frameworks run as two jobs, one after the other.

    python benchmarks/frameworks.py [--sizes 1M,16M] [--densities 0.01] [--ranks 2]
                                    [--repeats 7] [--selection threshold|exact]
                                    [--separate] [--json results/frameworks.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from horovod_sparse.common.config import SELECTION_METHODS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WARMUP = 2
FRAMEWORKS = ("torch", "tf")
TIME_KEYS = ("torch_sparse", "tf_sparse_function", "tf_sparse_eager", "torch_dense", "tf_dense")
LEGEND = (
    "columns: P = ranks; floats = float32 elements per rank; density = target density; "
    "selection = local selection of both sparse runs; "
    "torch sparse = horovod_sparse.torch.sparse_allreduce; "
    "TF sparse fn = horovod_sparse.tensorflow.sparse_allreduce in a tf.function (one signature); "
    "TF sparse eager = the same called eagerly; torch dense = horovod.torch.allreduce; "
    "TF dense = horovod.tensorflow.allreduce (eager); times are seconds per call on rank 0, "
    "median (min); TF/torch = TF sparse fn / torch sparse (medians); sparse/dense = each "
    "sparse call over its framework's dense call of the same round, median over rounds "
    "(lowest-highest)"
)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMG" else text) * scale)


def format_size(numel: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if numel >= scale and numel % scale == 0:
            return f"{numel // scale}{suffix}"
    return str(numel)


def gradient(numel: int, call: int) -> Any:
    """Call ``call``'s gradient on this rank: the same array for every method."""
    import numpy as np

    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    return np.random.default_rng([12345, rank, call]).standard_normal(numel, dtype=np.float32)


@dataclass
class Method:
    """One timed method: ``call(prepare(gradient))`` after ``barrier()``; ``after`` runs
    after each call, outside the timed region. ``first``: the first call's seconds (a
    ``tf.function``'s tracing included)."""

    key: str
    prepare: Callable[[Any], Any]
    call: Callable[[Any], Any]
    barrier: Callable[[], None]
    after: Callable[[], None] | None = None
    times: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)


def timed_in_turn(numel: int, repeats: int, methods: list[Method]) -> dict[str, list[float]]:
    """Seconds of each method's calls after the warm-up rounds, on this rank: every round
    calls each method once, on that round's gradient, the order rotating each round."""
    for i in range(WARMUP + repeats):
        drawn = gradient(numel, i)
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:
            x = method.prepare(drawn.copy())  # a call may not see another's writes
            method.barrier()
            start = time.perf_counter()
            method.call(x)
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                method.times.append(elapsed)
            elif i == 0:
                method.first.append(elapsed)
            if method.after is not None:
                method.after()
    return {method.key: method.times for method in methods}


def sparse_options(selection: str | None) -> dict[str, Any]:
    return {} if selection is None else {"selection": selection}


def used_selection(density: float, selection: str | None) -> str:
    """The selection both ``sparse_allreduce`` run with, resolved as they resolve it."""
    from horovod_sparse.common.config import make_config

    return make_config(dict(sparse_options(selection), density=density)).selection


class TorchRuns:
    """Dense and sparse calls through horovod.torch."""

    def __init__(self) -> None:
        import horovod.torch as hvd_t
        import torch

        torch.set_num_threads(1)
        hvd_t.init()
        self.hvd, self.torch = hvd_t, torch
        self.tiny = torch.zeros(1)

    def probe(self) -> None:
        got = self.hvd.allreduce(self.torch.ones(2) * (self.hvd.rank() + 1), name="probe.torch")
        expect = (self.hvd.size() + 1) / 2
        if abs(float(got[0]) - expect) > 1e-6:
            raise RuntimeError(f"horovod.torch probe allreduce gave {got.tolist()}, not {expect}")

    def barrier(self) -> None:
        self.hvd.allreduce(self.tiny, name="barrier.torch")

    def dense(self, numel: int) -> list[Method]:
        hvd = self.hvd
        name = f"dense.torch.{numel}"
        return [
            Method(
                "torch_dense",
                self.torch.from_numpy,
                lambda x: hvd.allreduce(x, op=hvd.Average, name=name),
                self.barrier,
            )
        ]

    def sparse(
        self, numel: int, density: float, selection: str | None
    ) -> tuple[list[Method], Callable[[], dict]]:
        import horovod_sparse.torch as hvds

        hvd, options = self.hvd, sparse_options(selection)
        name = f"torch.{numel}.{density}"

        def call(x: Any) -> Any:
            return hvds.sparse_allreduce(x, density=density, name=name, op=hvd.Average, **options)

        def finish() -> dict:
            s = hvds.stats(name)
            hvds.reset_residuals()
            return {"torch_bytes_per_rank": s.bytes_sent + s.bytes_received}

        return [Method("torch_sparse", self.torch.from_numpy, call, self.barrier)], finish


class TFRuns:
    """Dense and sparse calls through horovod.tensorflow, results read with ``.numpy()``."""

    def __init__(self) -> None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import horovod.tensorflow as hvd_tf
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        hvd_tf.init()
        self.hvd, self.tf = hvd_tf, tf
        self.tiny = tf.zeros([1])

    def probe(self) -> None:
        tf, hvd = self.tf, self.hvd
        got = hvd.allreduce(tf.ones([2]) * (hvd.rank() + 1), name="probe.tf").numpy()
        expect = (hvd.size() + 1) / 2
        if abs(float(got[0]) - expect) > 1e-6:
            raise RuntimeError(f"horovod.tensorflow probe allreduce gave {got}, not {expect}")

    def barrier(self) -> None:
        self.hvd.allreduce(self.tiny, name="barrier.tf").numpy()

    def dense(self, numel: int) -> list[Method]:
        hvd = self.hvd
        name = f"dense.tf.{numel}"
        return [
            Method(
                "tf_dense",
                self.tf.constant,
                lambda x: hvd.allreduce(x, op=hvd.Average, name=name).numpy(),
                self.barrier,
            )
        ]

    def sparse(
        self, numel: int, density: float, selection: str | None
    ) -> tuple[list[Method], Callable[[], dict]]:
        import horovod_sparse.tensorflow as hvds

        tf, hvd, options = self.tf, self.hvd, sparse_options(selection)
        fn_name, eager_name = f"tf.fn.{numel}.{density}", f"tf.eager.{numel}.{density}"

        @tf.function(input_signature=[tf.TensorSpec([numel], tf.float32)])
        def step(x):
            return hvds.sparse_allreduce(
                x, density=density, name=fn_name, op=hvd.Average, **options
            )

        def eager(x):
            return hvds.sparse_allreduce(
                x, density=density, name=eager_name, op=hvd.Average, **options
            )

        # TF traces twice on the first call when that call creates variables (the
        # residual); traces after the first call would be retracing.
        traces: list[int] = []
        traced = Method(
            "tf_sparse_function",
            tf.constant,
            lambda x: step(x).numpy(),
            self.barrier,
            lambda: traces.append(int(step.experimental_get_tracing_count())),
        )
        untraced = Method("tf_sparse_eager", tf.constant, lambda x: eager(x).numpy(), self.barrier)

        def finish() -> dict:
            if traces[-1] != traces[0]:
                print(
                    f"warning: {fn_name} retraced: traces after each call {traces}", file=sys.stderr
                )
            s_fn, s_eager = hvds.stats(fn_name), hvds.stats(eager_name)
            hvds.reset_residuals()
            return {
                "tf_function_traces_first_call": traces[0],
                "tf_function_first_call_s": traced.first[0],
                "tf_function_retraces": traces[-1] - traces[0],
                "tf_bytes_per_rank": s_fn.bytes_sent + s_fn.bytes_received,
                "tf_eager_bytes_per_rank": s_eager.bytes_sent + s_eager.bytes_received,
            }

        return [traced, untraced], finish


def start_runtimes(frameworks: list[str]) -> list[Any]:
    """Init each framework's Horovod binding (each is its own runtime) and probe it."""
    runs: list[Any] = []
    if "torch" in frameworks:
        runs.append(TorchRuns())
    if "tf" in frameworks:
        runs.append(TFRuns())
    for r in runs:
        r.probe()
    return runs


def run_worker(args: argparse.Namespace, runs: list[Any]) -> list[dict] | None:
    """Runs on every rank; returns the measured rows on rank 0 (None elsewhere)."""
    rows = []
    for numel in args.sizes:
        for density in args.densities:
            methods: list[Method] = []
            finishes = []
            for r in runs:
                methods += r.dense(numel)
                sparse, finish = r.sparse(numel, density, args.selection)
                methods += sparse
                finishes.append(finish)
            row = {
                "P": runs[0].hvd.size(),
                "numel": numel,
                "density": density,
                "selection": used_selection(density, args.selection),
                **timed_in_turn(numel, args.repeats, methods),
            }
            for finish in finishes:
                row.update(finish())
            rows.append(row)
    return rows if runs[0].hvd.rank() == 0 else None


def worker_main(args: argparse.Namespace) -> None:
    """Entry point under horovodrun: ``--worker PATH`` from the launcher, or run by hand."""
    reports = args.worker and os.environ.get("HOROVOD_RANK", "0") == "0"
    phase = "init"
    try:
        runs = start_runtimes(args.frameworks.split(","))
        phase = "measure"
        if reports:  # written now: horovodrun may kill this rank before it can report
            Path(args.worker).write_text(json.dumps({"phase": phase}))
        rows = run_worker(args, runs)
    except Exception as exc:
        if reports:
            error = {"error": f"{type(exc).__name__}: {exc}", "phase": phase}
            Path(args.worker).write_text(json.dumps(error))
        raise
    if rows is None:
        return
    if args.worker:
        Path(args.worker).write_text(json.dumps({"rows": rows}))
    else:  # started by hand under horovodrun: rank 0 reports
        report(args, rows, {"mode": "one job (started under horovodrun)"})


def launch(args: argparse.Namespace, frameworks: str, part: Path) -> dict:
    """One horovodrun job of this script at ``--ranks`` ranks; its rank 0's JSON."""
    p = args.ranks
    runner = Path(sys.executable).with_name("horovodrun")
    cmd = [
        str(runner) if runner.exists() else "horovodrun",
        "-np",
        str(p),
        "-H",
        f"localhost:{p}",
        "--gloo",
        sys.executable,
        __file__,
        "--sizes",
        args.sizes_text,
        "--densities",
        args.densities_text,
        "--repeats",
        str(args.repeats),
        "--frameworks",
        frameworks,
        "--worker",
        str(part),
    ]
    if args.selection is not None:
        cmd += ["--selection", args.selection]
    part.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        cmd, env=env, timeout=3600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    result = json.loads(part.read_text()) if part.exists() else {}
    if done.returncode != 0 or "rows" not in result:
        tail = "\n".join(done.stderr.splitlines()[-25:])
        reason = result.get("error", f"horovodrun exited with {done.returncode}")
        # No phase from rank 0: the job failed before both runtimes worked.
        return {"error": reason, "phase": result.get("phase", "init"), "stderr_tail": tail}
    return result


def launcher_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hvds-frameworks-") as tmp:
        part = Path(tmp) / "rank0.json"
        meta: dict[str, Any] = {}
        if not args.separate:
            joint = launch(args, "torch,tf", part)
            if "rows" in joint:
                report(args, joint["rows"], {"mode": "one job, both frameworks per process"})
                return
            print(joint["stderr_tail"], file=sys.stderr)
            if joint["phase"] != "init":  # the runtimes worked; the benchmark itself failed
                raise SystemExit(f"benchmark failed: {joint['error']}")
            meta["joint_error"] = joint["error"]
            print(f"one job with both frameworks failed: {joint['error']}", file=sys.stderr)
            print("falling back to one job per framework", file=sys.stderr)
        merged: dict[tuple[int, float], dict] = {}
        for framework in FRAMEWORKS:
            result = launch(args, framework, part)
            if "rows" not in result:
                print(result["stderr_tail"], file=sys.stderr)
                raise SystemExit(f"{framework} job failed: {result['error']}")
            for row in result["rows"]:
                merged.setdefault((row["numel"], row["density"]), {}).update(row)
        meta["mode"] = "one job per framework"
        report(args, list(merged.values()), meta)


# Each sparse method over its framework's dense call of the same round.
PAIRED = (
    ("torch_sparse_over_dense", "torch_sparse", "torch_dense"),
    ("tf_sparse_over_dense", "tf_sparse_function", "tf_dense"),
    ("tf_eager_over_dense", "tf_sparse_eager", "tf_dense"),
)


def summarize(row: dict) -> dict:
    median = {k: statistics.median(row[k]) for k in TIME_KEYS}
    entry = {
        "P": row["P"],
        "numel": row["numel"],
        "density": row["density"],
        "selection": row["selection"],
        **{f"{k}_median_s": median[k] for k in TIME_KEYS},
        **{f"{k}_min_s": min(row[k]) for k in TIME_KEYS},
        "tf_over_torch_sparse": median["tf_sparse_function"] / median["torch_sparse"],
    }
    for key, sparse, dense in PAIRED:
        ratios = [a / b for a, b in zip(row[sparse], row[dense])]
        entry |= {key: statistics.median(ratios), f"{key}_range": (min(ratios), max(ratios))}
    return entry


def markdown(table: list[dict]) -> str:
    lines = [
        "| P | floats | density | selection | torch sparse s | TF sparse fn s "
        "| TF sparse eager s | torch dense s | TF dense s | TF/torch sparse "
        "| torch sparse/dense | TF fn/dense | TF eager/dense |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        cells = [str(t["P"]), format_size(t["numel"]), f"{t['density']:g}", t["selection"]]
        cells += [f"{t[k + '_median_s']:.4f} ({t[k + '_min_s']:.4f})" for k in TIME_KEYS]
        cells.append(f"{t['tf_over_torch_sparse']:.2f}")
        for key, _, _ in PAIRED:
            low, high = t[f"{key}_range"]
            cells.append(f"{t[key]:.2f} ({low:.2f}-{high:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args: argparse.Namespace, rows: list[dict], meta: dict) -> None:
    rows.sort(key=lambda r: (r["numel"], r["density"]))
    table = [summarize(r) for r in rows]
    print(
        f"{meta['mode']}; P = {rows[0]['P']} on loopback (Gloo); float32; "
        f"{WARMUP} warm-up + {args.repeats} timed calls per method"
    )
    for r in rows:
        print(
            f"  {format_size(r['numel'])} d={r['density']:g}: selection={r['selection']}, "
            f"tf.function traces on 1st call={r.get('tf_function_traces_first_call')} "
            f"(1st call {r.get('tf_function_first_call_s', float('nan')):.2f} s) "
            f"retraces after={r.get('tf_function_retraces')}, "
            f"bytes/rank torch={r.get('torch_bytes_per_rank')} "
            f"TF fn={r.get('tf_bytes_per_rank')} TF eager={r.get('tf_eager_bytes_per_rank')}"
        )
    print(LEGEND)
    print(markdown(table))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "sizes": args.sizes,
            "densities": args.densities,
            "ranks": rows[0]["P"],
            "repeats": args.repeats,
            "warmup": WARMUP,
            "selection": args.selection,
        }
        out.write_text(
            json.dumps({"config": config, **meta, "raw": rows, "table": table}, indent=1)
        )
        print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M", help="floats per rank, suffixes K/M/G")
    parser.add_argument("--densities", default="0.01")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per method")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--selection",
        choices=SELECTION_METHODS,
        default=None,
        help="selection= for both sparse_allreduce (default: theirs, threshold)",
    )
    parser.add_argument("--separate", action="store_true", help="one horovodrun job per framework")
    parser.add_argument("--json", default=None, help="write results to this path")
    parser.add_argument("--frameworks", default="torch,tf", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes_text, args.densities_text = args.sizes, args.densities
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.densities = [float(d) for d in args.densities.split(",")]
    if args.worker or "HOROVOD_RANK" in os.environ:
        worker_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
