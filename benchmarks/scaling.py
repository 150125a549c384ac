"""Alpha-beta model of per-rank volume and communication time, P = 2..256.

Fits alpha (seconds per message step) and beta (seconds per byte) to the collectives
measured on the emulated cluster (results/cluster.json, from benchmarks/cluster/run.py),
reports the model's error on every measured point, and predicts each method's volume
and time up to 256 ranks. Writes results/scaling.{json,md,png}.

Per-rank received volume in 4-byte elements (an index-value pair is 2 elements), from
each method's paper; k = density * n:

=================  ==========================  ==========================
method             latency (x alpha)           volume (elements)
=================  ==========================  ==========================
dense ring         2 (P-1)                     2 n (P-1)/P
allgather top-k    log2 P                      2 k (P-1)              (TopkA / GRACE)
gTop-k             2 log2 P                    4 k log2 P
SparDL             2 log2 P                    4 k (P-1)/P            (our reading)
Ok-Topk            2 P + 2 log2 P              6 k (P-1)/P            (upper bound)
horovod_sparse     (2 + 8 r) (P-1)             4 k (P-1)/P + 2048 r (P-1)/P
  exact select     10 (P-1)                    4 k (P-1)/P + 2048 (P-1)/P
=================  ==========================  ==========================

horovod_sparse: alltoall (P-1) + allgather (P-1) latency steps, plus on a refresh step
(a fraction r of the steps; the buckets refreshing on one step share them) four ring
allreduces of 256 int32 per bucket (8 (P-1)); rows of index + value both ways, plus the
histograms. With ``global_selection="exact"`` every step refreshes (r = 1).

    python benchmarks/scaling.py [--cluster results/cluster.json] [--numel 25000000]
                                 [--refresh-fraction 0.25]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def features(op: str, p: int, numel: int) -> tuple[float, float]:
    """(latency steps, bytes on the critical path) of one measured collective."""
    nbytes = 4 * numel
    if op == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if op == "alltoall":
        return p - 1, (p - 1) / p * nbytes
    if op == "allgather":  # numel per rank
        return p - 1, (p - 1) * nbytes
    raise ValueError(op)


def fit(points: list[dict]) -> tuple[float, float]:
    """Least squares on relative error (every size counts), alpha and beta >= 0."""
    a = np.array([features(r["op"], r["P"], r["numel"]) for r in points], dtype=float)
    t = np.array([r["seconds"] for r in points])
    weights = 1.0 / t
    solution, *_ = np.linalg.lstsq(a * weights[:, None], t * weights, rcond=None)
    alpha, beta = (max(0.0, float(x)) for x in solution)
    return alpha, beta


def methods(
    p: int, numel: int, density: float, refresh: float = 0.25
) -> dict[str, tuple[float, float]]:
    """(latency steps, received elements) per method; ``refresh``: the fraction of
    steps on which horovod_sparse's reused global threshold refreshes."""
    k = density * numel
    log_p = math.log2(p)
    return {
        "dense ring": (2 * (p - 1), 2 * numel * (p - 1) / p),
        "allgather top-k": (log_p, 2 * k * (p - 1)),
        "gTop-k": (2 * log_p, 4 * k * log_p),
        "SparDL": (2 * log_p, 4 * k * (p - 1) / p),
        "Ok-Topk": (2 * p + 2 * log_p, 6 * k * (p - 1) / p),
        "horovod_sparse": (
            (2 + 8 * refresh) * (p - 1),
            4 * k * (p - 1) / p + 2048 * refresh * (p - 1) / p,
        ),
        "horovod_sparse, exact select": (10 * (p - 1), 4 * k * (p - 1) / p + 2048 * (p - 1) / p),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=str(ROOT / "results" / "cluster.json"))
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument(
        "--refresh-fraction",
        type=float,
        default=0.25,
        help="steps on which the reused global threshold refreshes (measured: 0.006-0.32)",
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "scaling"))
    args = parser.parse_args()
    cluster = json.loads(Path(args.cluster).read_text())
    out = Path(args.out)
    report: dict = {"links": []}
    lines = []
    for entry in cluster:
        points = [
            {**row, "P": c["world_size"]}
            for c in entry["collectives"]
            for row in c["rows"]
            if row["op"] in ("allreduce", "alltoall", "allgather")
        ]
        alpha, beta = fit(points)
        checked = []
        for r in points:
            lat, nbytes = features(r["op"], r["P"], r["numel"])
            model = alpha * lat + beta * nbytes
            checked.append({**r, "model_s": model, "error": model / r["seconds"] - 1})
        # Whole sparse allreduce: model communication + measured selection time.
        for c in entry["collectives"]:
            p = c["world_size"]
            for r in c["rows"]:
                if r["op"] != "sparse_allreduce":
                    continue
                # Rows measured before the reused threshold ran the exact select each call.
                refresh = r.get("refresh_fraction", 1.0)
                kept = r.get("kept_over_k", 1.0)
                lat, elements = methods(p, r["numel"], r["density"] * kept, refresh)[
                    "horovod_sparse"
                ]
                model = alpha * lat + beta * 4 * elements + r["seconds_select"]
                checked.append({**r, "P": p, "model_s": model, "error": model / r["seconds"] - 1})
        errors = [abs(c["error"]) for c in checked]
        modelled = {
            p: methods(p, args.numel, args.density, args.refresh_fraction)
            for p in (2, 4, 8, 16, 32, 64, 128, 256)
        }
        predictions = {
            name: [
                {
                    "P": p,
                    "elements": by_method[name][1],
                    "seconds": alpha * by_method[name][0] + beta * 4 * by_method[name][1],
                }
                for p, by_method in modelled.items()
            ]
            for name in modelled[2]
        }
        report["links"].append(
            {
                "link": entry["link"],
                "alpha_s": alpha,
                "beta_s_per_byte": beta,
                "points": checked,
                "median_abs_error": float(np.median(errors)),
                "max_abs_error": float(max(errors)),
                "predictions": predictions,
            }
        )
        lines.append(
            f"\n### {entry['link']}: alpha = {alpha * 1e6:.1f} us, "
            f"1/beta = {1 / beta / 1e6:.1f} MB/s"
            if beta
            else f"\n### {entry['link']}"
        )
        lines.append(
            f"model error on {len(checked)} measured points: median "
            f"{np.median(errors):.1%}, max {max(errors):.1%}\n"
        )
        lines.append("| P | " + " | ".join(predictions) + " |")
        lines.append("|---:|" + "---:|" * len(predictions))
        for i, p in enumerate((2, 4, 8, 16, 32, 64, 128, 256)):
            cells = [f"{predictions[m][i]['seconds'] * 1e3:.1f} ms" for m in predictions]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = (
        f"Predicted communication time per step, n = {args.numel:,} fp32, "
        f"density {args.density}" + "\n".join(lines)
    )
    out.with_suffix(".md").write_text(text + "\n")
    plot(report, out.with_suffix(".png"), args.numel, args.density)
    print(text)


def plot(report: dict, path: Path, numel: int, density: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = report["links"]
    fig, axes = plt.subplots(1, len(links) + 1, figsize=(6 * (len(links) + 1), 4), squeeze=False)
    volume_ax = axes[0][0]
    for name, preds in links[0]["predictions"].items():
        volume_ax.plot(
            [x["P"] for x in preds],
            [4 * x["elements"] / 1e6 for x in preds],
            marker="o",
            label=name,
        )
    volume_ax.set(
        xscale="log",
        yscale="log",
        xlabel="ranks P",
        ylabel="MB received per rank",
        title=f"volume, n={numel / 1e6:.0f}M, d={density}",
    )
    volume_ax.legend(fontsize=7)
    for ax, link in zip(axes[0][1:], links):
        for name, preds in link["predictions"].items():
            ax.plot([x["P"] for x in preds], [x["seconds"] for x in preds], marker="o", label=name)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="ranks P",
            ylabel="seconds (model)",
            title=f"communication time, {link['link']}",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
