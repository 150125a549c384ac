"""Where a training step's time goes: dense Horovod against the sparse plugin, torch and TF.

Trains the demo's MLP (``--model demo``: 1.19M parameters, as ``make demo``) or a wide
MLP (``--model wide``: 34.1M) for ``--steps`` steps after ``--warmup`` unmeasured ones,
in one ``horovodrun -np P --gloo`` job per framework, P and thread setting, and prints
per step (medians over the measured steps; the whole step is the slowest rank's):

* torch (``--framework torch``): ``hvd.DistributedOptimizer`` and
  ``horovod_sparse.torch.DistributedOptimizer`` at its defaults, SGD with momentum
  (``--torch-modes``: ``dense``, ``sparse``, ``auto`` by default; ``no-lookahead`` and
  ``no-lookahead-no-correction`` turn off the residual lookahead, then the momentum
  correction too, to show what each costs; ``all-dense`` runs the sparse optimizer at
  density 1.0, what a scheduler that chose dense for every bucket would cost);
* TF (``--framework tf``): a ``tf.function`` training step with
  ``hvd.DistributedGradientTape`` and with ``horovod_sparse.tensorflow``'s, SGD with
  momentum (Keras); the step is one traced call, so it is not split further.

Dense and sparse train side by side, one step of each in turn (their order alternating),
each its own model: both meet the same minutes of a machine whose speed drifts by tens
of percent from one minute to the next. "vs dense" is then the median over steps of each
step's time over dense's step of the same index, with its quartiles. The automatic
scheduler (``--torch-modes ...,auto``) judges whole steps from one backward to the next,
which would take in the other modes' steps, so it trains alone after them; its "vs
dense" is the ratio of the two medians.

Columns:

* forward+backward (torch): ``zero_grad`` to the end of ``backward()`` (the sparse
  optimizer's bucket work in the gradient hooks included);
* optimizer step (torch): ``optimizer.step()`` (waiting on the exchanges, unpacking);
* selection and exchange: the sparse plugin's own host seconds (``stats()``: local and
  global selection; issuing and waiting on collectives);
* waits (torch): the part of the exchange spent waiting for collectives to finish
  (Horovod's negotiation included), timed by wrapping the sparse optimizer's backend;
* collectives (torch): the sparse optimizer's alltoalls, allgathers and allreduces per
  step (counted by wrapping its backend), and the fraction of steps whose global
  threshold refreshed (both frameworks).

    python benchmarks/step_profile.py [--model demo,wide] [--framework torch,tf]
                                      [--ranks 2] [--threads default,1]
                                      [--steps 60] [--warmup 20] [--tf-eager]
                                      [--auto-runs 1] [--alone 0]

``--tf-eager`` runs TF's training step eagerly instead of as one traced call.
``--alone N`` (torch) then trains every mode but ``auto`` alone, one after the other,
N rounds, each a fresh model: step by step in turn, the modes' steps share the
machine's caches and Horovod's background thread with each other, and the plugin's
every-step-dense ran 0.83-0.84x dense's step in turn but 0.97-1.12x trained alone
(4b819b6). A row's "vs dense" is then against the dense run of its round.
``--auto-runs N`` trains ``scheduler="auto"`` N times, each with a fresh model and
optimizer and each after a dense run alone (its anchor: "vs dense" of an auto row is
against that run), and prints a second table: each run's trials, its steps slower than
three times its median (where a decision probes the link), the modes it ended in and
its last 100 steps' median against the dense run's.

``--threads default`` sets nothing (``horovodrun`` sets no thread count, so each
framework takes every core in every rank); ``1`` sets one intra-op thread in every rank.
Writes JSON and a markdown table (default under results/step_profile.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WIDTHS = {"demo": 1024, "wide": 4096}
COLLECTIVES = ("alltoall_async", "allgather_async", "allreduce_sum_async")


def build(model_name: str):
    import torch

    width, features, classes = WIDTHS[model_name], 128, 10
    layers = [torch.nn.Linear(features, width), torch.nn.ReLU()]
    layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    if model_name == "wide":
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers), features, classes


# What the sparse optimizer's backend issued and waited for, over the whole process
# (each mode reads its steps' differences).
COUNTS: dict[str, Any] = dict.fromkeys(COLLECTIVES, 0) | {"wait_s": 0.0}


def count_collectives() -> dict[str, Any]:
    """Wrap the sparse optimizer's backend, once a process, so that every collective it
    issues counts in :data:`COUNTS` and the seconds spent waiting for them add up in
    ``COUNTS["wait_s"]``."""
    from horovod_sparse.torch import functions

    backend = functions.BACKEND
    if getattr(backend, "_step_profile_counting", False):
        return COUNTS
    backend._step_profile_counting = True
    counts = COUNTS
    original_wait = backend.wait

    def timed_wait(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original_wait(*args, **kwargs)
        finally:
            counts["wait_s"] += time.perf_counter() - began

    backend.wait = timed_wait
    for kind in (*COLLECTIVES, "allreduce_sum_inplace_async"):
        original = getattr(backend, kind)
        key = "allreduce_sum_async" if kind.startswith("allreduce") else kind

        def counting(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(backend, kind, counting)
    return counts


MODES = {
    "dense": "dense hvd.DistributedOptimizer",
    "sparse": "sparse (defaults)",
    "no-lookahead": "sparse, residual_lookahead=False",
    "no-lookahead-no-correction": "sparse, no lookahead, momentum_correction=False",
    "all-dense": "the sparse optimizer at density=1.0 (every step dense)",
    "auto": 'sparse, scheduler="auto"',
}
# The sparse optimizer's options per mode (the defaults' parts, turned off one by one).
OPTIONS: dict[str, dict[str, Any]] = {
    "sparse": {},
    "no-lookahead": {"residual_lookahead": False},
    "no-lookahead-no-correction": {"residual_lookahead": False, "momentum_correction": False},
    "all-dense": {"density": 1.0},
    "auto": {"scheduler": "auto"},
}


class TorchRun:
    """One torch mode's model, optimizer and measured steps."""

    def __init__(self, model_name: str, mode: str, warmup: int) -> None:
        import horovod.torch as hvd
        import torch

        import horovod_sparse.torch as hvds

        torch.manual_seed(0)
        model, features, classes = build(model_name)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        named = model.named_parameters()
        self.sparse = mode != "dense"
        if self.sparse:
            self.optimizer = hvds.DistributedOptimizer(
                inner, named_parameters=named, **OPTIONS[mode]
            )
        else:
            self.optimizer = hvd.DistributedOptimizer(inner, named_parameters=named)
        generator = torch.Generator().manual_seed(hvd.rank())
        self.x = torch.randn(8, 64, features, generator=generator)
        self.y = torch.randint(0, classes, (8, 64), generator=generator)
        self.counts = count_collectives() if self.sparse else dict(COUNTS)
        self.model, self.mode, self.model_name, self.warmup = model, mode, model_name, warmup
        self.rows: list[dict] = []
        self.total = 0.0
        self.every_step_s: list[float] = []  # warm-up included: the first decision is in it

    def step(self, step: int) -> None:
        import horovod.torch as hvd
        import torch

        model, optimizer, counts = self.model, self.optimizer, self.counts
        before = dict(counts)
        began = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(self.x[step % 8]), self.y[step % 8])
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        ended = time.perf_counter()
        # One name for every step: a fresh name each step would fill Horovod's response
        # cache (1,024 entries) and evict the optimizers' own collectives from it.
        slowest = hvd.allreduce(
            torch.tensor([ended - began], dtype=torch.float64),
            op=hvd.Max,
            name=f"t.{self.mode}",
        )
        self.total += float(slowest)
        self.every_step_s.append(float(slowest))
        if step < self.warmup:
            return
        row = {
            "step_s": float(slowest),
            "forward_backward_s": backward_done - began,
            "optimizer_step_s": ended - backward_done,
        }
        if self.sparse:
            stats = optimizer.stats()
            row |= {
                "selection_s": stats.seconds_select,
                "exchange_s": stats.seconds_exchange,
                "refreshed": int(stats.global_refreshes > 0),
                "wait_s": counts["wait_s"] - before["wait_s"],
                "dense_buckets": stats.dense_buckets,
                "sparse_buckets": stats.sparse_buckets,
                **{kind: counts[kind] - before[kind] for kind in COLLECTIVES},
            }
        self.rows.append(row)

    def result(self, paired: bool) -> dict:
        out = {
            "model": self.model_name,
            "framework": "torch",
            "mode": MODES[self.mode] + ("" if paired or self.mode == "auto" else ", alone"),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            # Every step, the warm-up's too (the scheduler's first trial runs at steps 10-14).
            "all_steps_s": self.total,
            "paired": paired,
            "rows": self.rows,
        }
        if self.mode == "auto":
            out["trials"] = [dataclasses.asdict(t) for t in self.optimizer.schedule_trials()]
            out["every_step_s"] = self.every_step_s
            out["ended_dense"] = [c["mode"] == "dense" for c in self.optimizer.schedule().values()]
        return out


def interleaved(runs: list[Any], steps: int) -> None:
    """Step every run once per step index, the order rotating from one index to the next,
    so that dense and sparse steps share the same minutes of a noisy machine and neither
    always follows the other."""
    for step in range(steps):
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:
            run.step(step)


class TFRun:
    """One TF mode's model, traced (or eager) training step and measured steps."""

    def __init__(self, model_name: str, sparse: bool, warmup: int, eager: bool) -> None:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        import horovod_sparse.tensorflow as hvds

        width = WIDTHS[model_name]
        tf.keras.utils.set_random_seed(0)
        layers = [tf.keras.layers.Dense(width, activation="relu") for _ in range(2)]
        if model_name == "wide":
            layers.append(tf.keras.layers.Dense(width, activation="relu"))
        model = tf.keras.Sequential([tf.keras.Input((128,)), *layers, tf.keras.layers.Dense(10)])
        variables = [v.value for v in model.trainable_variables]  # tf.Variables for either tape
        hvd.broadcast_variables(variables, root_rank=0)
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        loss_of = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        generator = tf.random.Generator.from_seed(hvd.rank())
        self.x = generator.normal([8, 64, 128])
        self.y = generator.uniform([8, 64], maxval=10, dtype=tf.int32)
        self.tapes: list[Any] = []  # each trace's tape: the step's Python runs when traced

        @tf.function
        def train_step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_of(labels, model(images, training=True))
            if sparse:
                tape = hvds.DistributedGradientTape(tape)
            else:
                tape = hvd.DistributedGradientTape(tape)
            self.tapes.append(tape)
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        self.run_step = train_step.python_function if eager else train_step
        self.model, self.model_name, self.sparse, self.eager = model, model_name, sparse, eager
        self.warmup = warmup
        self.rows: list[dict] = []
        self.total = 0.0

    def step(self, step: int) -> None:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        began = time.perf_counter()
        self.run_step(self.x[step % 8], self.y[step % 8]).numpy()
        ended = time.perf_counter()
        slowest = hvd.allreduce(
            tf.constant([ended - began], tf.float64),
            op=hvd.Max,
            name=f"t.{int(self.sparse)}",  # one name for every step: see TorchRun.step
        )
        self.total += float(slowest[0])
        if step < self.warmup:
            return
        row = {"step_s": float(slowest[0])}
        if self.sparse:
            stats = self.tapes[-1].stats()
            row |= {
                "selection_s": stats.seconds_select,
                "exchange_s": stats.seconds_exchange,
                "refreshed": int(stats.global_refreshes > 0),
            }
        self.rows.append(row)

    def result(self) -> dict:
        import tensorflow as tf

        mode = "sparse tape (defaults)" if self.sparse else "dense hvd.DistributedGradientTape"
        return {
            "model": self.model_name,
            "framework": "tf",
            "mode": mode + (", eager" if self.eager else ""),
            "parameters": sum(int(tf.size(v)) for v in self.model.trainable_variables),
            "all_steps_s": self.total,
            "paired": True,
            "rows": self.rows,
        }


def tf_worker(
    models: list[str], threads: str, steps: int, warmup: int, out: str, eager: bool
) -> None:
    import tensorflow as tf

    if threads != "default":
        tf.config.threading.set_intra_op_parallelism_threads(int(threads))
    import horovod.tensorflow as hvd

    hvd.init()
    results = []
    for model_name in models:
        runs = [TFRun(model_name, sparse, warmup, eager) for sparse in (False, True)]
        interleaved(runs, warmup + steps)
        used = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
        setting = {"P": hvd.size(), "threads": threads, "threads_used": used}
        results += [run.result() | setting for run in runs]
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(results))


def worker(
    models: list[str],
    modes: list[str],
    threads: str,
    steps: int,
    warmup: int,
    out: str,
    auto_runs: int,
    alone_rounds: int = 0,
) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    if threads != "default":
        torch.set_num_threads(int(threads))
    results = []
    setting = {"P": hvd.size(), "threads": threads, "threads_used": torch.get_num_threads()}
    for model_name in models:
        # The automatic scheduler times whole steps from one backward to the next, which
        # would take in the other modes' steps: it runs after the others, alone.
        together = [TorchRun(model_name, mode, warmup) for mode in modes if mode != "auto"]
        interleaved(together, warmup + steps)
        results += [run.result(paired=True) | setting for run in together]
        for _ in range(auto_runs if "auto" in modes else 0):
            # Dense alone just before, the anchor of this run's ratio: the machine's speed
            # drifts between the paired runs above and this one.
            for mode in ("dense", "auto"):
                alone = TorchRun(model_name, mode, warmup)
                interleaved([alone], warmup + steps)
                results.append(alone.result(paired=False) | setting)
        for round_index in range(alone_rounds):
            for mode in modes:
                if mode != "auto":
                    alone = TorchRun(model_name, mode, warmup)
                    interleaved([alone], warmup + steps)
                    results.append(alone.result(paired=False) | setting | {"round": round_index})
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(results))


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows) if rows and key in rows[0] else 0.0


def summarize(results: list[dict]) -> list[dict]:
    table = []
    dense = {}
    for result in results:
        rows = result["rows"]
        entry = {
            "model": result["model"],
            "P": result["P"],
            "threads": result["threads"],
            "threads_used": result["threads_used"],
            "framework": result.get("framework", "torch"),
            "mode": result["mode"],
            "parameters": result["parameters"],
            "all_steps_s": result["all_steps_s"],
            **{key: median(rows, key) for key in rows[0] if key != "refreshed"},
        }
        if "refreshed" in rows[0]:
            entry["refresh_fraction"] = sum(row["refreshed"] for row in rows) / len(rows)
        setting = (result["model"], entry["framework"], result["P"], result["threads"])
        if result["mode"].startswith("dense"):
            dense[setting] = (entry["step_s"], entry["all_steps_s"], rows)
        dense_step, dense_all, dense_rows = dense[setting]
        entry["step_vs_dense"] = entry["step_s"] / dense_step
        entry["all_steps_vs_dense"] = entry["all_steps_s"] / dense_all
        if result.get("paired") and len(rows) == len(dense_rows):
            # Steps run in turn with dense's: the ratio of each step to dense's step of
            # the same index, its median and quartiles.
            ratios = [row["step_s"] / twin["step_s"] for row, twin in zip(rows, dense_rows)]
            low, middle, high = statistics.quantiles(ratios, n=4)
            entry |= {"paired_vs_dense": middle, "paired_low": low, "paired_high": high}
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| model | framework | P | threads | mode | step ms | vs dense | all steps, vs dense "
        "| fwd+bwd ms "
        "| opt.step ms | selection ms | exchange ms | waits ms | alltoall | allgather "
        "| allreduce | refreshed |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(t: dict, key: str) -> str:
        return f"{1e3 * t[key]:.1f}" if key in t else "-"

    def per_step(t: dict, key: str) -> str:
        return f"{t[key]:.0f}" if key in t else "-"

    def vs_dense(t: dict) -> str:
        if "paired_vs_dense" not in t:
            return f"{t['step_vs_dense']:.2f}"
        return f"{t['paired_vs_dense']:.2f} ({t['paired_low']:.2f}-{t['paired_high']:.2f})"

    for t in table:
        refreshed = f"{100 * t['refresh_fraction']:.0f} %" if "refresh_fraction" in t else "-"
        threads = t["threads"] if t["threads"] != "default" else f"default ({t['threads_used']})"
        mode = t["mode"]
        if "dense_buckets" in t:
            buckets = t["dense_buckets"] + t["sparse_buckets"]
            mode += f" ({t['dense_buckets']:.0f} of {buckets:.0f} buckets dense)"
        cells = [
            f"{t['model']} ({t['parameters'] / 1e6:.2f}M)", t["framework"], str(t["P"]),
            threads, mode, ms(t, "step_s"), vs_dense(t),
            f"{t['all_steps_s']:.2f} s, {t['all_steps_vs_dense']:.2f}",
            ms(t, "forward_backward_s"), ms(t, "optimizer_step_s"), ms(t, "selection_s"),
            ms(t, "exchange_s"), ms(t, "wait_s"), per_step(t, "alltoall_async"),
            per_step(t, "allgather_async"), per_step(t, "allreduce_sum_async"), refreshed,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def modes_text(dense: list[bool]) -> str:
    return "".join("D" if flag else "S" for flag in dense)


def auto_markdown(results: list[dict]) -> str:
    """Each ``scheduler="auto"`` run: its trials, its slowest steps (the decisions that
    probe the link show there), how it ended, and its last 100 steps against the median
    step of the dense run trained alone just before it."""
    lines = [
        "| model | threads | run | trials (modes per sparse bucket, D dense: before -> tried, "
        "median ms each, (tried over the blocks around it), kept) "
        "| steps over 3x the median (step: ms) | ended in "
        "| last 100 ms | vs dense alone before it |",
        "|---|---|---:|---|---|---|---:|---:|",
    ]
    dense: dict[tuple, float] = {}  # the latest dense run's median step, per setting
    runs: dict[tuple, int] = {}
    for result in results:
        setting = (result["model"], result["P"], result["threads"])
        if result["mode"].startswith("dense") and result["framework"] == "torch":
            dense[setting] = median(result["rows"], "step_s")
        if "trials" not in result:
            continue
        runs[setting] = runs.get(setting, 0) + 1
        trials = "; ".join(
            f"{modes_text(t['before'])} -> {modes_text(t['tried'])} "
            f"{1e3 * t['seconds_before']:.1f} / {1e3 * t['seconds_tried']:.1f} "
            f"({t.get('ratio', float('nan')):.2f}) {'kept' if t['kept'] else 'rejected'}"
            for t in result["trials"]
        )
        every = result["every_step_s"]
        typical = statistics.median(every)
        slow = ", ".join(
            f"{i}: {1e3 * s:.0f}" for i, s in enumerate(every) if s > 3 * typical and i > 0
        )
        last = statistics.median(every[-100:])
        cells = [
            result["model"], str(result["threads"]), str(runs[setting]), trials or "none",
            slow or "none",
            modes_text(result["ended_dense"]),
            f"{1e3 * last:.1f}", f"{last / dense[setting]:.2f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo,wide")
    parser.add_argument("--framework", default="torch,tf")
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--torch-modes", default="dense,sparse,auto")
    parser.add_argument("--threads", default="default,1")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "results" / "step_profile"))
    parser.add_argument(
        "--auto-runs", type=int, default=1, help='fresh scheduler="auto" runs, one after another'
    )
    parser.add_argument(
        "--tf-eager", action="store_true", help="TF: run the training step eagerly, untraced"
    )
    parser.add_argument(
        "--alone", type=int, default=0, help="rounds of every mode trained alone (torch)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--worker-framework", default="torch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.model.split(",")
    modes = args.torch_modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or "dense" not in modes:
        parser.error(f"--torch-modes: dense and any of {', '.join(MODES)}; got {modes}")
    modes.sort(key=list(MODES).index)  # dense first: the others are read against it
    if args.worker:
        if args.worker_framework == "tf":
            tf_worker(
                models, args.worker_threads, args.steps, args.warmup, args.worker, args.tf_eager
            )
        else:
            worker(
                models,
                modes,
                args.worker_threads,
                args.steps,
                args.warmup,
                args.worker,
                args.auto_runs,
                args.alone,
            )
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    jobs = [
        (framework, int(p), threads)
        for framework in args.framework.split(",")
        for p in args.ranks.split(",")
        for threads in args.threads.split(",")
    ]
    for framework, p, threads in jobs:
        part = out.with_name(f"{out.name}.{framework}.np{p}.t{threads}.json")
        cmd = [
            "horovodrun", "-np", str(p), "-H", f"localhost:{p}", "--gloo",
            sys.executable, __file__, "--model", args.model,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--worker-threads", threads, "--worker-framework", framework,
            "--torch-modes", ",".join(modes), "--auto-runs", str(args.auto_runs),
            "--alone", str(args.alone),
            "--worker", str(part),
        ] + (["--tf-eager"] if args.tf_eager else [])  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("OMP_NUM_THREADS", None)  # "default" means what horovodrun leaves
        subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
        results += json.loads(part.read_text())
    table = summarize(results)
    out.with_suffix(".json").write_text(json.dumps({"table": table, "runs": results}, indent=1))
    text = markdown(table)
    if any("trials" in result for result in results):
        text += "\n\n" + auto_markdown(results)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
