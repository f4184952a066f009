"""Timelines as a Chrome trace-event file, for Perfetto (ui.perfetto.dev) and chrome://tracing.

Layout of the trace:

- one process (``pid``) per unit *and source*: ``llm (predicted)`` and ``llm (measured)``
  are separate processes, so a predicted and a measured run of the same steps lie one above
  the other on the same time axis instead of painting over each other;
- timelines of the same source are laid end to end in the order given: each step starts where
  the previous one of that source ended (its ``end_s``), so pass them in step order;
- one thread (``tid``) per stage replica for its compute (``s1 r0 (rank 5)``: F, B, OPT) and
  one for its communication (``s1 r0 comm``: SEND/RECV and the gradient SYNC), plus a
  ``steps`` thread per process with one slice per step; tids are unique in the file.
  Perfetto draws slices of a thread only when they nest, and sends and receives overlap
  compute and each other, so a track whose events overlap spills into extra lanes
  (``s1 r0 comm #2``) instead;
- complete events (``"ph": "X"``) with ``ts``/``dur`` in microseconds, rounded to whole
  nanoseconds so that touching events stay touching; ``name`` is the action label (``F3``,
  ``B3c1``, ``SYNC``), ``cat`` is compute, comm, optimizer or step, and ``args`` carry the
  microbatch, chunk, rank, replica and step.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dtdsl.ir.timeline import Event, Timeline

__all__ = ["trace_events", "write_trace"]

_COMPUTE_TRACK = 0
_COMM_TRACK = 1
_CATEGORY = {"F": "compute", "B": "compute", "W": "compute", "OPT": "optimizer", "SYNC": "comm",
             "SEND_F": "comm", "RECV_F": "comm", "SEND_B": "comm", "RECV_B": "comm"}

# A track key: (stage, replica, track, lane); the steps track sorts before every stage.
_TrackKey = tuple[int, int, int, int]
_STEPS_KEY: _TrackKey = (-1, -1, 0, 0)


def trace_events(timelines: Timeline | Iterable[Timeline]) -> dict[str, Any]:
    """The trace-event JSON object for one timeline or several (see the module docstring)."""
    if isinstance(timelines, Timeline):
        timelines = [timelines]
    timelines = list(timelines)

    pids: dict[tuple[str, str], int] = {}   # (source, unit) -> pid
    for tl in timelines:
        for name in [u.name for u in tl.units] + [e.unit for e in tl.events]:
            pids.setdefault((tl.source, name), len(pids) + 1)

    # Lay the steps out first (offsets and lanes), then number the threads of each process in
    # sorted order, so tids do not depend on which event happened to come first.
    slices: list[tuple[int, _TrackKey, int, int, str, str, dict[str, Any]]] = []
    ranks: dict[tuple[int, int, int], int] = {}
    lane_ends: dict[tuple[int, int, int, int], list[int]] = {}
    offset_ns: dict[str, int] = {}
    for tl in timelines:
        base_ns = offset_ns.get(tl.source, 0)
        offset_ns[tl.source] = base_ns + max(_ns(tl.end_s), 0)
        for unit in tl.units:
            for stage in range(unit.pp):
                for replica in range(unit.dp):
                    ranks.setdefault((pids[tl.source, unit.name], stage, replica),
                                     unit.rank(stage, replica))
        for e in sorted(tl.events, key=lambda e: (e.start_s, e.end_s)):
            pid = pids[tl.source, e.unit]
            ranks.setdefault((pid, e.stage, e.replica), e.rank)
            track = _COMM_TRACK if _CATEGORY[e.kind] == "comm" else _COMPUTE_TRACK
            t0, t1 = base_ns + _ns(e.start_s), base_ns + _ns(e.end_s)
            ends = lane_ends.setdefault((pid, e.stage, e.replica, track), [])
            lane = next((i for i, end in enumerate(ends) if end <= t0), len(ends))
            if lane == len(ends):
                ends.append(t1)
            else:
                ends[lane] = t1
            slices.append((pid, (e.stage, e.replica, track, lane), t0, t1, e.label,
                           _CATEGORY[e.kind], _args(e, tl)))
        if tl.events:
            t0 = base_ns + _ns(tl.start_s)
            step_args = {"step": tl.step, "source": tl.source,
                         "iteration_ms": round(tl.iteration_time_s * 1e3, 6),
                         "bubble_fraction": round(tl.mean_bubble_fraction(), 6)}
            for pid in sorted({pids[tl.source, e.unit] for e in tl.events}):
                slices.append((pid, _STEPS_KEY, t0, base_ns + _ns(tl.end_s),
                               f"step {tl.step}", "step", step_args))

    # tids are unique across the whole trace and disjoint from the pids: Perfetto's JSON
    # importer follows Linux in reading a tid as one thread, and tid == pid as a main thread.
    tracks = sorted({(s[0], s[1]) for s in slices})
    tids = {track: len(pids) + 1 + i for i, track in enumerate(tracks)}

    meta: list[dict[str, Any]] = []
    for (source, unit), pid in pids.items():
        meta.append(_meta("process_name", pid, 0, {"name": f"{unit} ({source})"}))
        meta.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
    for (pid, key), tid in tids.items():
        meta.append(_meta("thread_name", pid, tid, {"name": _thread_name(key, ranks, pid)}))
        meta.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))

    events = [{"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tids[pid, key],
               "ts": t0 / 1000, "dur": (t1 - t0) / 1000, "args": args}
              for pid, key, t0, t1, name, cat, args in slices]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def is_trace(data: bytes) -> bool:
    """Whether ``data`` is a trace ``write_trace`` writes (a JSON object of trace events;
    ``dtc simulate`` replaces only one)."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return False
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(found, dict) and isinstance(found.get("traceEvents"), list)


def write_trace(path: str | Path, timelines: Timeline | Iterable[Timeline]) -> Path:
    """Write ``trace_events(timelines)`` to ``path`` (gzip-compressed when it ends in .gz,
    which Perfetto and chrome://tracing both open); returns the path."""
    path = Path(path)
    data = json.dumps(trace_events(timelines), separators=(",", ":")).encode("ascii")
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)   # mtime=0: same timelines, same bytes
    path.write_bytes(data)
    return path


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _args(e: Event, tl: Timeline) -> dict[str, Any]:
    return {"microbatch": e.microbatch, "chunk": e.chunk, "rank": e.rank,
            "replica": e.replica, "stage": f"{e.unit}.s{e.stage}", "step": tl.step}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _thread_name(key: _TrackKey, ranks: dict[tuple[int, int, int], int], pid: int) -> str:
    if key == _STEPS_KEY:
        return "steps"
    stage, replica, track, lane = key
    name = f"s{stage} r{replica}"
    name += " comm" if track == _COMM_TRACK else f" (rank {ranks[pid, stage, replica]})"
    return name + (f" #{lane + 1}" if lane else "")
