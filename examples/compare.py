"""Print the side-by-side table of two or more train_synthetic.py summaries.

Besides what was measured (loss, bytes, seconds on this machine's loopback), it gives
what each step's exchange would take on 1, 10 and 100 Gbit/s links by the alpha-beta
model of the README's scaling section: ALPHA_S per message step of a collective (the
ring steps of each allreduce, alltoall and allgather the run issued) plus the bytes one
rank sends, at the link's rate. That column is a model, not a measurement. For a run
with ``--scheduler auto`` it then says what the scheduler chose for each bucket, on
which measured exchange times, and every trial it ran (whole-step medians of the modes
before and tried, which ran in turn, block by block).
"""

import json
import math
import sys

# Seconds per message step, fitted to Horovod's collectives on the emulated cluster
# (README "Scaling model": 1.03 ms at 1 Gbit/s, 1.11 ms at 10 Gbit/s).
ALPHA_S = 1.0e-3
LINKS_GBIT = (1, 10, 100)


def modelled_ms(row: dict, gbit: int) -> float | None:
    if "bytes_sent_per_step" not in row:
        return None  # a summary from before these fields
    seconds = ALPHA_S * row["message_steps_per_step"] + row["bytes_sent_per_step"] * 8 / (
        gbit * 1e9
    )
    return seconds * 1e3


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def modes(dense: list[bool]) -> str:
    return ",".join("dense" if flag else "sparse" for flag in dense)


def explain_schedule(row: dict) -> None:
    """What scheduler="auto" chose per bucket, on which measurements, and its trials."""
    print(
        f"\n{row['mode']}: what it chose and why (a trial runs the modes before and tried in"
        "\n  turn, four blocks of 5 steps each, and keeps the tried ones only if their median"
        "\n  step over the blocks around them is below 1; a bucket's exchange time alone does"
        "\n  not decide)"
    )
    for name, choice in row["schedule"].items():
        print(
            f"  bucket {name}: {choice['mode']}; its exchange measured "
            f"{ms(choice['measured_dense_s'])} a step dense, "
            f"{ms(choice['measured_sparse_s'])} sparse"
        )
    for trial in row["trials"]:
        verdict = "kept" if trial["kept"] else "rejected"
        blocks = ""
        if trial.get("blocks"):
            each = ", ".join(f"{1e3 * s:.1f}" for s in trial["blocks"])
            blocks = f" (blocks {each} ms; tried over the blocks around it {trial['ratio']:.2f})"
        print(
            f"  trial {modes(trial['before'])} -> {modes(trial['tried'])}: median step "
            f"{ms(trial['seconds_before'])} -> {ms(trial['seconds_tried'])}{blocks}, {verdict}"
        )
    if not row["trials"]:
        print("  no trial: every bucket kept the mode it started in")


rows = [json.load(open(path)) for path in sys.argv[1:]]
dense = next((r for r in rows if r["density"] >= 1.0), rows[0])
links = " ".join(f"{f'{g} Gbit/s':>10s}" for g in LINKS_GBIT)
measured = (
    f"{'mode':36s} {'final loss':>10s} {'bytes/step':>14s} {'vs dense':>9s} {'loopback s':>10s}   "
)
print(f"{'':{len(measured)}s}modelled exchange per step (ms)")
print(measured + links)
for r in rows:
    ratio = r["bytes_per_step"] / dense["bytes_per_step"]
    model = [modelled_ms(r, g) for g in LINKS_GBIT]
    cells = " ".join(f"{m:10.1f}" if m is not None else f"{'-':>10s}" for m in model)
    print(
        f"{r['mode']:36s} {r['final_loss']:10.4f} {r['bytes_per_step']:14,.0f} "
        f"{ratio:9.2%} {r['seconds']:10.1f}   {cells}"
    )
for r in rows:
    if "schedule" in r:
        explain_schedule(r)
print(
    "\nLoopback seconds are measured here: the ranks share this machine's cores and copy"
    "\nthrough memory, so dense pays no network time and sparse pays for its local"
    "\nselection work; they favour dense. The per-link columns are the alpha-beta model"
    f"\n({ALPHA_S * 1e3:g} ms per message step plus the bytes one rank sends at the link's"
    "\nrate) of the exchange alone, not measurements; a step's local work (forward,"
    "\nbackward, selection) comes on top. Sparse wins where the link, not the CPU, is the"
    "\nbottleneck."
)
