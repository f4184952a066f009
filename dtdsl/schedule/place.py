"""Communication placed by an execution trace, so that NCCL's groups cannot deadlock.

``add_communication`` (``schedule.lower``) puts each receive just before the pass that
reads it and each send just after the pass that produces it. Under NCCL's rules
(``schedule.validate``, phase 4: each run of consecutive communication actions is one
group, a rank's groups run in order on one stream, a send completes only once its
receive is posted) that is safe for 1F1B and GPipe, whose sends and receives pair up step
by step, but not for the interleaved order: two stages can each send to the other in a
group of its own, before the group that receives, and wait forever.

``place_by_trace`` moves the communication actions, as torch's
``PipelineScheduleMulti`` and Megatron-LM pair their transfers step by step. It runs the
compute orders as soon as possible (any positive durations: a forward takes L / vpp and a
backward 2 L / vpp, L the units' vpps' least common multiple, integers so that ties are
exact; transfers take no time). Transfer k then has a time t_k, the end of the pass that
produces it, and every transfer one place in a global order (t_k, then its ends). On
every stage each send and each receive of transfer k goes just before the first of the
stage's passes that starts at t_k or later (after its last pass if none does), the
actions of one such gap in the global order. A send so stays right after the pass that
produces it (the next pass starts at t_k or later); a receive is posted early, at the
gap where its send is due, and the pass that reads it (which started at t_k or later in
the trace) still follows it.

Why no deadlock, merged groups included: give a pass its trace start s, a group (the
actions of one gap, before a pass starting at s_p and after one starting at s_{p-1})
the least and the greatest t_k of its transfers, both in (s_{p-1}, s_p]. A group starts
once the passes before it have run (starts < its least t_k) and the stage's previous
group has completed (greatest t_k <= s_{p-1} < its least t_k); it completes once it and
the groups holding its transfers' other ends have started (their least t_k is at most
one of its own, so at most its greatest); a pass runs once the one before it has (an
earlier start) and the groups of what it reads have completed (their greatest t_k is at
most its start). So every wait is for an event with a key (start; least t_k of a
group's start; greatest t_k of its completion) no greater than its own, and every cycle
of waits would pass through a group's start, whose waits are strictly smaller: there is
none. Per pair of stages both ends follow the global order, so NCCL's in-order matching
pairs each send with its own receive.

The runtime (``train.executor``) waits for a receive only at the pass that reads it, and
the simulator (``sim.simulate``) likewise, so a receive posted early costs no time there.
It holds its buffer from its gap to that pass: data that would otherwise wait on the
sender (whose send completes only once the receive is posted) waits on the receiver. In
tests/schedule/test_place.py's grid a lone interleaved backbone's stage holds at most 9
such receives at once, a generator behind a frozen backbone (which runs its forwards
without a pause) 17; the memory plans (``train.memplan``, the cost model) count the
stashed activations, not these buffers.
"""

from __future__ import annotations

from collections import defaultdict
from math import lcm

from dtdsl.ir.schedule import Action, ActionKind, Schedule, StageSchedule

__all__ = ["place_by_trace", "trace_times"]

F, B = ActionKind.F, ActionKind.B

# A transfer: (direction, sending unit, stage, chunk, receiving unit, stage, chunk, microbatch).
Transfer = tuple[ActionKind, str, int, int, str, int, int, int]


def transfer_of(a: Action) -> Transfer:
    """The transfer a send or receive is one end of (the same key at both ends)."""
    assert a.peer_unit is not None and a.peer_stage is not None and a.microbatch is not None
    direction = a.kind.direction
    assert direction is not None
    if a.kind.is_send:
        return (direction, a.unit, a.stage, a.chunk, a.peer_unit, a.peer_stage,
                a.peer_chunk, a.microbatch)
    return (direction, a.peer_unit, a.peer_stage, a.peer_chunk, a.unit, a.stage, a.chunk,
            a.microbatch)


def trace_times(schedule: Schedule) -> tuple[list[list[int]], dict[Transfer, int]]:
    """Run ``schedule``'s passes as soon as possible (module docstring): per stage the
    start of each of its passes in order, and per transfer the end of the pass that
    produces it. Receives are taken as read by the next pass on their stage, sends as
    produced by the previous one (``add_communication``'s placement)."""
    scale = lcm(*(u.vpp for u in schedule.units))
    vpp = {u.name: u.vpp for u in schedule.units}
    # Per stage, its passes: (duration, the transfers they wait for, those they produce).
    programs: list[list[tuple[int, list[Transfer], list[Transfer]]]] = []
    for st in schedule.stages:
        passes: list[tuple[int, list[Transfer], list[Transfer]]] = []
        waiting: list[Transfer] = []
        for a in st.actions:
            if a.kind is F or a.kind is B:
                passes.append(((1 if a.kind is F else 2) * scale // vpp[st.unit], waiting, []))
                waiting = []
            elif a.kind.is_recv:
                waiting.append(transfer_of(a))
            elif a.kind.is_send:
                if not passes:
                    raise ValueError(f"{a.format()}: a send before any pass")
                passes[-1][2].append(transfer_of(a))
        if waiting:
            raise ValueError(f"{st.where}: receives after its last pass")
        programs.append(passes)
    starts: list[list[int]] = [[] for _ in programs]
    sent: dict[Transfer, int] = {}
    free = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for i, passes in enumerate(programs):
            while len(starts[i]) < len(passes):
                duration, reads, makes = passes[len(starts[i])]
                if any(t not in sent for t in reads):
                    break
                start = max([free[i]] + [sent[t] for t in reads])
                starts[i].append(start)
                free[i] = start + duration
                for t in makes:
                    sent[t] = free[i]
                progress = True
    stuck = [str(schedule.stages[i].where) for i, passes in enumerate(programs)
             if len(starts[i]) < len(passes)]
    if stuck:
        raise ValueError(f"the compute orders deadlock at {', '.join(stuck)}")
    return starts, sent


def place_by_trace(schedule: Schedule) -> Schedule:
    """``schedule`` (sends and receives next to their passes, ``add_communication``) with
    every send and receive moved to the gap the trace gives it (module docstring)."""
    starts, sent = trace_times(schedule)
    stages = []
    for st, pass_starts in zip(schedule.stages, starts, strict=True):
        passes = [a for a in st.actions if a.kind is F or a.kind is B]
        tail = [a for a in st.actions if not a.kind.is_comm and a.kind is not F
                and a.kind is not B]
        gaps: dict[int, list[tuple[int, Transfer, Action]]] = defaultdict(list)
        p = 0
        for a in sorted((a for a in st.actions if a.kind.is_comm),
                        key=lambda a: (sent[transfer_of(a)], transfer_of(a))):
            t = sent[transfer_of(a)]
            while p < len(passes) and pass_starts[p] < t:
                p += 1
            gaps[p].append((t, transfer_of(a), a))
        out: list[Action] = []
        for k, a in enumerate(passes):
            out += [c for _, _, c in gaps.get(k, ())]
            out.append(a)
        out += [c for _, _, c in gaps.get(len(passes), ())]
        stages.append(StageSchedule(unit=st.unit, stage=st.stage, actions=tuple(out + tail)))
    return schedule.with_stages(tuple(stages))
