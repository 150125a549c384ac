"""The alpha-beta cost model of the link: predicted seconds of a dense and a sparse step.

A sparse step of a bucket of n elements with budget k costs local work (selection,
owner reduction, global selection without its collectives: measured, per element) plus its
collectives; a dense step costs one ring allreduce of n values. With a link of
per-message latency alpha and per-byte time beta (fitted from timed allreduces on the
process set itself) and P ranks:

* dense:  ``2(P-1) alpha + 2 (P-1)/P * n * s * beta`` (s: bytes per value);
* sparse: ``c * n`` (measured local work) plus the alltoall ``(P-1) alpha + k r beta``,
  four histogram allreduces ``4 (2(P-1) alpha + 2 (P-1)/P * 1 KiB * beta)`` and the
  all-gather ``(P-1) alpha + k r beta`` (r: bytes per (index, value) row); at P = 2
  one all-gather of the selections ``alpha + k r beta`` in place of the alltoall and
  the all-gather.

Here the link is probed and fitted (:func:`probe_link`, :func:`fit_link`) and each step
predicted; the scheduler (:mod:`horovod_sparse.common.scheduler`) probes while a
prediction can still decide something (a bucket with a mode never measured) and weighs
these predictions against measured step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from horovod_sparse.common.backend import Backend, Tensor
from horovod_sparse.common.global_selection import HISTOGRAM_BINS, RADIX_SHIFTS

__all__ = [
    "LinkModel",
    "dense_seconds",
    "fit_link",
    "probe_link",
    "probe_numels",
    "ring_terms",
    "sparse_seconds",
]

# Probe sizes in float32 elements: the smallest isolates alpha, the larger ones beta.
# The largest (32 MiB) outlasts a shaper's burst allowance (tc tbf lets the first
# burst of bytes through at line rate, which would make a small probe look fast).
PROBE_NUMELS = (1, 1 << 20, 1 << 23)
PROBE_REPEATS = 3


@dataclass(frozen=True)
class LinkModel:
    """Ring-allreduce cost: ``alpha`` seconds per message step, ``beta`` seconds per byte."""

    alpha: float
    beta: float


def ring_terms(numel: int, itemsize: int, world_size: int) -> tuple[float, float]:
    """(message steps, bytes out per rank) of a ring allreduce."""
    p = world_size
    return 2.0 * (p - 1), 2.0 * (p - 1) / p * numel * itemsize


def fit_link(samples: list[tuple[int, float]], world_size: int, itemsize: int = 4) -> LinkModel:
    """Least-squares ``alpha``, ``beta`` (both >= 0) from (numel, seconds) allreduce timings."""
    rows = [(*ring_terms(n, itemsize, world_size), t) for n, t in samples]
    sxx = sum(m * m for m, _, _ in rows)
    sxy = sum(m * b for m, b, _ in rows)
    syy = sum(b * b for _, b, _ in rows)
    sxt = sum(m * t for m, _, t in rows)
    syt = sum(b * t for _, b, t in rows)
    det = sxx * syy - sxy * sxy
    if det > 0:
        alpha = (sxt * syy - syt * sxy) / det
        beta = (sxx * syt - sxy * sxt) / det
        if alpha >= 0 and beta >= 0:
            return LinkModel(alpha, beta)
    # Degenerate or negative fit: latency from the smallest probe, bandwidth from the largest.
    small = min(rows, key=lambda row: row[1])
    large = max(rows, key=lambda row: row[1])
    alpha = max(0.0, small[2] / small[0]) if small[0] else 0.0
    beta = max(0.0, (large[2] - alpha * large[0]) / large[1]) if large[1] else 0.0
    return LinkModel(alpha, beta)


def dense_seconds(link: LinkModel, numel: int, itemsize: int, world_size: int) -> float:
    """Predicted time of a dense step: one ring allreduce of ``numel`` values."""
    if world_size <= 1:
        return 0.0
    steps, volume = ring_terms(numel, itemsize, world_size)
    return link.alpha * steps + link.beta * volume


def sparse_seconds(
    link: LinkModel,
    numel: int,
    k: int,
    world_size: int,
    local_seconds_per_element: float,
    row_bytes: int = 8,
) -> float:
    """Predicted time of a sparse step: measured local work plus its five collectives
    (at P = 2 four: one allgather of the selections takes the place of the alltoall and
    the allgather, as ``gather_selections`` does by default; common/pair_stages.py)."""
    p = world_size
    local = local_seconds_per_element * numel
    if p <= 1:
        return local
    histograms = len(RADIX_SHIFTS) * dense_seconds(link, HISTOGRAM_BINS, 4, p)
    if p == 2:
        return local + link.alpha + link.beta * k * row_bytes + histograms
    rows_out = k * (p - 1) / p  # a rank's share of k rows, minus its own region
    alltoall = link.alpha * (p - 1) + link.beta * rows_out * row_bytes
    allgather = link.alpha * (p - 1) + link.beta * rows_out * row_bytes
    return local + alltoall + histograms + allgather


def probe_numels(largest: int) -> tuple[int, ...]:
    """The probe sizes for buckets of at most ``largest`` values: ``PROBE_NUMELS``, none
    beyond ``largest``. A probe larger than every bucket predicts no exchange better,
    and it is what a probe's time goes to (a 2^23-float allreduce on loopback takes
    tens of milliseconds, a whole step of a 1M-parameter model)."""
    return tuple(sorted({min(numel, max(1, largest)) for numel in PROBE_NUMELS}))


def probe_link(
    ops: Backend,
    like: Tensor,
    world: int,
    name: str,
    process_set: Any,
    numels: tuple[int, ...] = PROBE_NUMELS,
) -> LinkModel:
    """Alpha and beta of the process set's link, from timed allreduces of ``numels``
    values (the fastest of ``PROBE_REPEATS`` per size).

    The repeats of a size reduce one buffer under one name, so that after the first
    they pay what a training step's collectives pay, whose names recur: no fresh
    allocation and no full negotiation (Horovod's response cache hits). On the demo's
    sizes (1, 2^20 and 1.18M floats, P = 2 on 2 cores; ``benchmarks/probe_cost.py``,
    two jobs of 9 and 15 alternating rounds) the whole probe took 74.5 and 58.4 ms
    (medians; slowest 91 ms) against 74.5 and 74.8 ms (slowest 214-223 ms) with a fresh
    buffer and name per repeat; alpha came out 0.29-0.74 ms against 0.41-1.57 ms in the
    first job."""
    samples = []
    for numel in numels:
        probe = ops.zeros(numel, like)
        best = math.inf
        for _ in range(PROBE_REPEATS):
            began = ops.clock()
            ops.wait(ops.allreduce_sum_async(probe, f"{name}.probe{numel}", process_set))
            best = min(best, ops.clock() - began)
        samples.append((numel, best))
    return fit_link(samples, world)
