"""Timelines: what ran where and when during one iteration, predicted or measured.

The simulator (``dtdsl.sim.simulate``) produces a predicted Timeline; the runtime records
a measured one in the same form, so the TensorBoard writer and the trace exporter take
either and the two can be laid side by side.

A timeline is a list of events. An event is one schedule action (``dtdsl.ir.schedule``)
as run by one data-parallel replica of one unit stage: the replica's TP ranks run in
lockstep, so one event stands for all of them and ``rank`` is the first of them. Times
are seconds from the start of the iteration.

JSON form (``to_json`` / ``from_json``)::

    {"version": 1, "source": "predicted", "step": 0, "num_microbatches": 4,
     "units": [{"name": "vit", "role": "encoder", "pp": 1, "dp": 1, "tp": 1,
                "first_rank": 0}, ...],
     "events": [["vit", 0, 0, 0, "F", 0, 0, 0.0, 0.0125], ...]}

with each event as ``[unit, stage, replica, rank, kind, microbatch, chunk, start_s,
end_s]`` (microbatch null for SYNC and OPT).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["COMPUTE_KINDS", "Event", "Timeline", "TimelineUnit", "TIMELINE_VERSION"]

TIMELINE_VERSION = 1
COMPUTE_KINDS = frozenset({"F", "B", "W"})
KINDS = frozenset({"F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SYNC", "OPT"})

Row = tuple[str, int, int]   # (unit, stage, replica)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One action of one replica of a unit stage, from ``start_s`` to ``end_s``."""

    unit: str
    stage: int
    replica: int
    rank: int
    kind: str
    microbatch: int | None
    chunk: int = 0
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def row(self) -> Row:
        return (self.unit, self.stage, self.replica)

    @property
    def label(self) -> str:
        """The action's local text form, ``F3``, ``B3c1``, ``SYNC``."""
        text = self.kind + ("" if self.microbatch is None else str(self.microbatch))
        return text + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineUnit:
    """The layout of one unit, for row labels and rank numbers."""

    name: str
    role: Literal["encoder", "backbone", "generator"]
    pp: int
    dp: int
    tp: int
    first_rank: int = 0

    def rank(self, stage: int, replica: int) -> int:
        """The first global rank of ``replica`` of ``stage`` (the plan's grid, TP innermost)."""
        return self.first_rank + (stage * self.dp + replica) * self.tp


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Events of one iteration (see the module docstring)."""

    source: Literal["predicted", "measured"]
    num_microbatches: int
    units: tuple[TimelineUnit, ...]
    events: tuple[Event, ...]
    step: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("predicted", "measured"):
            raise ValueError(f"source {self.source!r}: 'predicted' or 'measured'")
        names = {u.name for u in self.units}
        for e in self.events:
            if e.unit not in names:
                raise ValueError(f"event {e.label} of unknown unit {e.unit!r}")
            if e.kind not in KINDS:
                raise ValueError(f"event kind {e.kind!r}; one of {', '.join(sorted(KINDS))}")
            if not e.end_s >= e.start_s:
                raise ValueError(f"event {e.unit}.s{e.stage}:{e.label} ends before it starts")

    # ---- views ------------------------------------------------------------------------------

    @property
    def start_s(self) -> float:
        return min((e.start_s for e in self.events), default=0.0)

    @property
    def end_s(self) -> float:
        return max((e.end_s for e in self.events), default=0.0)

    @property
    def iteration_time_s(self) -> float:
        """From the first event's start to the last one's end."""
        return self.end_s - self.start_s

    def unit(self, name: str) -> TimelineUnit:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def rows(self) -> list[Row]:
        """Every (unit, stage, replica) in unit order, then stage, then replica."""
        return [(u.name, s, r) for u in self.units for s in range(u.pp) for r in range(u.dp)]

    def by_row(self) -> dict[Row, list[Event]]:
        """Each row's events, by start time."""
        out: dict[Row, list[Event]] = {row: [] for row in self.rows()}
        for e in self.events:
            out.setdefault(e.row, []).append(e)
        for events in out.values():
            events.sort(key=lambda e: (e.start_s, e.end_s))
        return out

    def busy_s(self) -> dict[Row, float]:
        """Seconds of forward and backward compute per row."""
        busy: dict[Row, float] = dict.fromkeys(self.rows(), 0.0)
        for e in self.events:
            if e.kind in COMPUTE_KINDS:
                busy[e.row] = busy.get(e.row, 0.0) + e.duration_s
        return busy

    def compute_s(self) -> dict[str, float]:
        """Per unit stage (``llm.s1``): seconds of forward and backward compute (mean over
        its replicas)."""
        per_stage: dict[str, list[float]] = defaultdict(list)
        for (unit, stage, _), busy in self.busy_s().items():
            per_stage[f"{unit}.s{stage}"].append(busy)
        return {name: sum(b) / len(b) for name, b in per_stage.items()}

    def bubble_fraction(self) -> dict[str, float]:
        """Per unit stage (``llm.s1``): the share of the iteration its replicas spend not
        computing (mean over the replicas)."""
        span = self.iteration_time_s
        per_stage: dict[str, list[float]] = defaultdict(list)
        for (unit, stage, _), busy in self.busy_s().items():
            per_stage[f"{unit}.s{stage}"].append(busy)
        return {name: (1.0 - sum(b) / len(b) / span) if span > 0 else 0.0
                for name, b in per_stage.items()}

    def mean_bubble_fraction(self) -> float:
        """The bubble fraction over all stages, weighted by their replicas."""
        busy = self.busy_s()
        span = self.iteration_time_s
        if not busy or span <= 0:
            return 0.0
        return 1.0 - sum(busy.values()) / (len(busy) * span)

    # ---- JSON -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": TIMELINE_VERSION, "source": self.source, "step": self.step,
            "num_microbatches": self.num_microbatches,
            "units": [{"name": u.name, "role": u.role, "pp": u.pp, "dp": u.dp, "tp": u.tp,
                       "first_rank": u.first_rank} for u in self.units],
            "events": [[e.unit, e.stage, e.replica, e.rank, e.kind, e.microbatch, e.chunk,
                        e.start_s, e.end_s] for e in self.events],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Timeline:
        """Read ``to_json``'s form; a ValueError says what is wrong."""
        if not isinstance(data, dict) or data.get("version") != TIMELINE_VERSION:
            raise ValueError(f"not a version-{TIMELINE_VERSION} timeline")
        try:
            units = tuple(TimelineUnit(**u) for u in data["units"])
            events = tuple(
                Event(unit=u, stage=int(s), replica=int(r), rank=int(k), kind=str(kind),
                      microbatch=None if j is None else int(j), chunk=int(c),
                      start_s=float(t0), end_s=float(t1))
                for u, s, r, k, kind, j, c, t0, t1 in data["events"])
            return Timeline(source=data["source"], step=int(data.get("step", 0)),
                            num_microbatches=int(data["num_microbatches"]), units=units,
                            events=events)
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed timeline: {err}") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))
