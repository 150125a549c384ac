"""A Chrome-trace recorder of the exchange stages, and how much of them backward hid.

Open the written JSON in ``chrome://tracing`` or https://ui.perfetto.dev. Each rank
writes its own file. Lanes: ``backward`` (first gradient hook to ``step()``), one lane
per bucket for its collectives in flight, and ``waits`` for host time blocked on them.

A collective's *lifetime* runs from its launch to the moment its result is known to be
there: the first non-blocking poll that finds it done (polls run at every gradient
hook and when backward ends), or the end of the blocking wait. A completion is seen
at the next poll, so a lifetime is an upper bound by at most one hook's interval. The
part of a reduce-scatter's lifetime before the end of backward is *hidden*; the part
after it is exposed (the optimizer waited for it).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HiddenTime", "Trace"]


@dataclass
class HiddenTime:
    """Sums over reduce-scatters: lifetime in seconds, and the part before backward ended."""

    lifetime: float = 0.0
    hidden: float = 0.0
    count: int = 0

    @property
    def fraction(self) -> float:
        return self.hidden / self.lifetime if self.lifetime > 0 else 0.0


@dataclass
class _InFlight:
    lane: str
    name: str
    launched: float
    done: float | None = None


@dataclass
class Trace:
    """Events of the last ``max_events`` spans; ``write()`` dumps them as a Chrome trace.

    Args:
        path: file to write; ``{rank}`` is replaced by the rank.
        rank: this process's rank (the trace's process id).
    """

    path: str
    rank: int
    max_events: int = 200_000
    events: deque[dict[str, Any]] = field(init=False)
    hidden: HiddenTime = field(default_factory=HiddenTime)
    _origin: float = field(default_factory=time.perf_counter)
    _flights: dict[str, _InFlight] = field(default_factory=dict)
    _backward_began: float | None = None

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.max_events)

    # ---------------------------------------------------------------- spans
    def span(self, lane: str, name: str, began: float, ended: float, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "pid": self.rank,
                "tid": lane,
                "ts": (began - self._origin) * 1e6,
                "dur": max(0.0, ended - began) * 1e6,
                "args": args,
            }
        )

    def backward_step(self, now: float) -> None:
        """The first gradient hook of a step."""
        if self._backward_began is None:
            self._backward_began = now

    def launched(self, key: str, lane: str, name: str, now: float) -> None:
        self._flights[key] = _InFlight(lane, name, now)

    def polled(self, key: str, done: bool, now: float) -> None:
        flight = self._flights.get(key)
        if flight is not None and flight.done is None and done:
            flight.done = now

    def waited(self, key: str, began: float, ended: float, backward_end: float | None) -> None:
        """A blocking wait on ``key`` from ``began`` to ``ended``; closes its lifetime.

        ``backward_end`` is given for reduce-scatters, whose hidden share is counted.
        """
        flight = self._flights.pop(key, None)
        if ended - began > 0:
            self.span("waits", f"wait {key}", began, ended)
        if flight is None:
            return
        done = flight.done if flight.done is not None else ended
        self.span(flight.lane, flight.name, flight.launched, done)
        if backward_end is not None:
            self.hidden.lifetime += done - flight.launched
            self.hidden.hidden += max(0.0, min(done, backward_end) - flight.launched)
            self.hidden.count += 1

    def in_flight(self, key: str) -> bool:
        return key in self._flights

    def backward_ended(self, now: float) -> None:
        if self._backward_began is not None:
            self.span("backward", "backward", self._backward_began, now)
        self._backward_began = None

    # ---------------------------------------------------------------- output
    def write(self) -> str:
        """Write the trace (Chrome JSON object format); returns the path written."""
        path = self.path.format(rank=self.rank)
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        lanes = sorted({event["tid"] for event in self.events})
        names = [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.rank,
                "tid": lane,
                "args": {"name": lane},
            }
            for lane in lanes
        ]
        with open(path, "w") as f:
            json.dump(
                {
                    "traceEvents": names + list(self.events),
                    "displayTimeUnit": "ms",
                    "otherData": {
                        "rank": self.rank,
                        "reduce_scatter_hidden_fraction": self.hidden.fraction,
                        "reduce_scatter_lifetime_s": self.hidden.lifetime,
                        "reduce_scatter_hidden_s": self.hidden.hidden,
                        "reduce_scatters": self.hidden.count,
                    },
                },
                f,
            )
        return path
