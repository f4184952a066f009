"""Measured timelines: each rank's events of a step gathered on rank 0 into the
``Timeline`` the simulator's readers read (``ir.timeline``), within a byte budget per
step (``telemetry_every``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ActionKind, Schedule
from dtdsl.ir.timeline import Event, Timeline, TimelineUnit

__all__ = ["TELEMETRY_BYTES", "gather_timeline", "measured_timeline", "telemetry_bytes",
           "telemetry_every"]


def measured_timeline(plan: Plan, step: int, events: Sequence[Event]) -> Timeline:
    """A measured ``Timeline`` of one step from the events of any set of ranks (e.g. all
    of them, gathered)."""
    # Co-located and phased units have no rows of their own: their passes are in the
    # backbone's rows' events, as in the simulator's timeline.
    units = tuple(TimelineUnit(name=u.name, role=u.role, pp=u.pp, dp=u.dp, tp=u.tp,
                               first_rank=u.first_rank) for u in plan.units
                  if not (u.colocated or u.phased))
    return Timeline(source="measured", num_microbatches=plan.num_microbatches, units=units,
                    events=tuple(events), step=step)


_KINDS = tuple(k.value for k in ActionKind)


# What rank 0 may receive of measured timelines per training step, on average.
TELEMETRY_BYTES = 64 * 1024
_ROW_BYTES = 9 * 8      # one event: nine float64 fields


def telemetry_bytes(plan: Plan, schedule: Schedule) -> int:
    """What rank 0 receives in one ``gather_timeline``: every rank's events, padded to
    the longest list (a stage's passes and two more, and two per phased encoder: its
    phases), and its count."""
    phases = 2 * sum(u.phased for u in plan.units)
    width = max((sum(a.kind in (ActionKind.F, ActionKind.B) for a in st.actions) + 2 +
                 phases for st in schedule.stages), default=1)
    return plan.gpus_used * (width * _ROW_BYTES + 8)


def telemetry_every(plan: Plan, schedule: Schedule) -> int:
    """Gather the measured timeline every this many steps: rank 0 receives at most
    ``TELEMETRY_BYTES`` per step on average (``telemetry_bytes``). Every step for small
    jobs; for a 1170-rank job a few hundred steps apart."""
    return max(1, -(-telemetry_bytes(plan, schedule) // TELEMETRY_BYTES))


def gather_timeline(plan: Plan, step: int, events: Sequence[Event], *,
                    device: torch.device | str = "cpu", dst: int = 0) -> Timeline | None:
    """The measured ``Timeline`` of one step from every rank's ``events``, on rank ``dst``
    (None on the others; collective over the default group). Events come from TP leaders
    only (a replica's TP ranks run in lockstep, one event stands for them all). Each
    rank's times are relative to its own start of the step, taken right after a barrier,
    so they compare across ranks up to the barrier's skew."""
    names = [u.name for u in plan.units if not (u.colocated or u.phased)]
    rank = dist.get_rank()
    mine = [e for e in events if e.rank == rank]
    rows = torch.tensor([[names.index(e.unit), e.stage, e.replica, e.rank, _KINDS.index(e.kind),
                          -1 if e.microbatch is None else e.microbatch, e.chunk, e.start_s,
                          e.end_s] for e in mine], dtype=torch.float64).reshape(-1, 9)
    counts = [torch.zeros(1, dtype=torch.int64, device=device)
              for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(mine)], dtype=torch.int64, device=device))
    width = max(int(c) for c in counts)
    padded = torch.zeros(width, 9, dtype=torch.float64, device=device)
    padded[:len(mine)] = rows.to(device)
    parts = [torch.empty(width, 9, dtype=torch.float64, device=device)
             for _ in counts] if rank == dst else None
    dist.gather(padded, parts, dst=dst)
    if parts is None:
        return None
    out = []
    for part, count in zip(parts, counts, strict=True):
        for row in part[:int(count)].tolist():
            unit, stage, replica, r, kind, mb, chunk, start, end = row
            out.append(Event(unit=names[int(unit)], stage=int(stage), replica=int(replica),
                             rank=int(r), kind=_KINDS[int(kind)],
                             microbatch=None if mb < 0 else int(mb), chunk=int(chunk),
                             start_s=start, end_s=end))
    return measured_timeline(plan, step, out)
