"""Schedule validation: every send has its receive, forwards precede backwards, no deadlock.

``validate(schedule)`` raises a ``ScheduleError`` whose message states the problems and
then prints the whole schedule grid (one row per unit stage, one column per action
slot) with the offending actions marked ``[llm.s1:B3]!`` (a row label marked
``[llm.s1]!`` when the problem is something missing from that stage), like torch
pipelining's ``_validate_schedule``.

Checks, in three phases (a phase runs only when the previous ones found nothing), and a
fourth for what runs on GPUs (``validate_nccl``: ``dtc compile`` runs it on every bundle's
schedule; the simulator and ``dtc simulate`` take any schedule phases 1-3 accept):

1. Each stage alone: every unit stage present and its actions its own; microbatches,
   chunks and peers in range, peers the right neighbours (``Schedule.producers`` /
   ``consumers``); each (chunk, microbatch) forwarded exactly once; backwards at most
   once, after their forward, for all microbatches of a chunk or none; weight-gradient
   passes (``W``, zero_bubble) at most once, after their backward, for all backwards
   of a chunk or none, only in a zero_bubble schedule; a forward reads
   its input: a ``RECV_F`` from every producer before it; sends after the pass that
   produces their data, receives of gradients before the backward that uses them;
   at most one ``SYNC`` and ``OPT``, ``SYNC`` after the last backward (and ``W``) and followed by
   ``OPT``, no forward after ``SYNC`` (the step ends the iteration).
2. Pairing: every send has exactly one matching receive (same microbatch, direction,
   chunks and ends) and every receive one send.
3. Deadlock: execute the schedule abstractly (sends never block, a receive waits until
   its send has run; stricter than the runtime and the simulator, where only the pass
   that reads a receive waits for it, so a schedule free of deadlock here is free of
   it there). That is a topological walk of the dependency graph (program
   order within a stage, send -> receive across stages; F(j) -> B(j) holds by phase 1);
   if stages stop before their end the graph has a cycle, and each stuck stage's
   waiting receive is marked. Only receives can block, so the walk steps from receive
   to receive, and a stage waiting for another is woken when that one moves on (a
   32-stage x 256-microbatch pipeline, about 48,000 actions, validates in about 0.1 s).
4. Deadlock under NCCL's rules, which are stricter: the runtime (``parallel.p2p``) issues
   each maximal run of consecutive communication actions as one NCCL group, and all of a
   rank's groups go to one communicator, whose one stream runs them in order. A group
   starts once the passes before it have run (its sends read their outputs) and the
   stream's previous group has completed; it completes once the other end of each of its
   transfers has started (a send blocks until its receive is posted, and the reverse);
   a pass runs once the groups holding the receives it reads have completed. Two stages
   that each send to the other in a group of its own, before the group that receives,
   wait forever on a GPU although every receive's send was reached (NCCL completes a
   send early only while it fits the connection's buffers, a few MiB: activations do
   not). Every lowering keeps this rule: 1F1B's and GPipe's sends and receives pair up
   step by step next to their passes (Megatron-LM's combined
   ``send_forward_recv_backward``); an interleaved unit's, placed next to their passes,
   would not, so the lowering places them by an execution trace (``schedule.place``,
   which says why that cannot deadlock, and tests/schedule/test_place.py checks it over
   a grid of shapes).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from dtdsl.ir.schedule import Action, ActionKind, Schedule

_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_COMM = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B})
F, B, W, SYNC, OPT = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.SYNC, ActionKind.OPT
SEND_F, SEND_B = ActionKind.SEND_F, ActionKind.SEND_B
RECV_F, RECV_B = ActionKind.RECV_F, ActionKind.RECV_B

__all__ = ["ScheduleError", "format_grid", "validate", "validate_nccl"]

_MAX_PROBLEMS = 12
# A mark on a stage's row label rather than on one action.
ROW = -1

Mark = tuple[int, int]    # (stage index, action slot or ROW)


class ScheduleError(ValueError):
    """An invalid schedule: ``problems`` says what, ``marks`` where; ``str()`` has both
    and the whole grid."""

    def __init__(self, problems: list[str], schedule: Schedule, marks: Iterable[Mark]):
        self.problems = tuple(problems)
        self.schedule = schedule
        self.marks = frozenset(marks)
        shown = list(self.problems[:_MAX_PROBLEMS])
        if len(self.problems) > _MAX_PROBLEMS:
            shown.append(f"... and {len(self.problems) - _MAX_PROBLEMS} more")
        text = "invalid schedule:\n" + "\n".join(f"  {p}" for p in shown) + "\n\n" + \
            format_grid(schedule, self.marks)
        super().__init__(text)


def format_grid(schedule: Schedule, marks: Iterable[Mark] = ()) -> str:
    """The schedule as a grid: a row per unit stage, a column per action slot; marked
    actions written in full as ``[llm.s1:B3]!``."""
    marks = set(marks)
    rows = []
    for i, st in enumerate(schedule.stages):
        label = f"[{st.where}]!" if (i, ROW) in marks else str(st.where)
        cells = [f"[{a.format()}]!" if (i, k) in marks else a.format_local()
                 for k, a in enumerate(st.actions)]
        rows.append([label, *cells])
    width = max((len(r) for r in rows), default=1)
    header = ["slot", *(str(k) for k in range(width - 1))]
    table = [header] + [r + [""] * (width - len(r)) for r in rows]
    widths = [max(len(r[col]) for r in table) for col in range(width)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in table)


def _describe(a: Action) -> str:
    return a.format()


def _chunk_name(c: int) -> str:
    return f"c{c}" if c else ""


def _vs_name(vs: tuple[str, int, int]) -> str:
    return f"{vs[0]}.s{vs[1]}{_chunk_name(vs[2])}"


def _check_stages(schedule: Schedule) -> tuple[list[str], set[Mark]]:
    problems: list[str] = []
    marks: set[Mark] = set()
    for u in schedule.units:
        for s in range(u.pp):
            if not schedule.has_stage(u.name, s):
                problems.append(f"{u.name}.s{s} has no row: every stage of {u.name} "
                                f"(pp {u.pp}) needs one")
    for i in range(len(schedule.stages)):
        _Row(schedule, i, problems, marks).check()
    return problems, marks


class _Row:
    """The checks of one stage's row (``_check_stages``): each action where it stands
    (``scan``), every microbatch's passes present (``complete``), sends, receives and
    forwards in their order (``ordered``), the SYNC and OPT last (``synced``). Problems
    and their marks go to the lists they are given, in row order."""

    def __init__(self, schedule: Schedule, i: int, problems: list[str],
                 marks: set[Mark]) -> None:
        st = schedule.stages[i]
        self.schedule, self.i, self.st = schedule, i, st
        self.problems, self.marks = problems, marks
        self.vpp = schedule.unit(st.unit).vpp
        self.producers = [schedule.producers(st.unit, st.stage, c) for c in range(self.vpp)]
        self.consumers = [schedule.consumers(st.unit, st.stage, c) for c in range(self.vpp)]
        self.peers = {True: [set(p) for p in self.producers],     # upstream
                      False: [set(q) for q in self.consumers]}
        self.fwd: dict[tuple[int, int], int] = {}
        self.bwd: dict[tuple[int, int], int] = {}
        self.wgt: dict[tuple[int, int], int] = {}
        self.sync: int | None = None
        self.opt: int | None = None
        self.skip: set[int] = set()     # slots already reported: no follow-up problems

    def bad(self, msg: str, k: int) -> None:
        self.problems.append(msg)
        self.marks.add((self.i, k))

    def check(self) -> None:
        for k, a in enumerate(self.st.actions):
            self.scan(k, a)
        self.complete()
        self.ordered()
        self.synced()

    def scan(self, k: int, a: Action) -> None:
        """Action ``a`` at slot ``k``: in its row, in range, a legal peer; each pass once."""
        schedule, st, m = self.schedule, self.st, self.schedule.num_microbatches
        problem = None
        if a.unit != st.unit or a.stage != st.stage:
            problem = f"{_describe(a)} is in the row of {st.where}"
        elif a.microbatch is not None and a.microbatch >= m:
            problem = f"{_describe(a)}: microbatch out of range (the schedule has {m})"
        elif a.chunk >= self.vpp:
            problem = f"{_describe(a)}: chunk out of range ({st.unit} has vpp {self.vpp})"
        elif a.kind in _COMM and (not schedule.has_stage(a.peer_unit, a.peer_stage) or
                                  a.peer_chunk >= schedule.unit(a.peer_unit).vpp):
            problem = f"{_describe(a)}: no such peer stage"
        if problem is not None:
            self.bad(problem, k)
            self.skip.add(k)
            return
        c, mb, kind = a.chunk, a.microbatch, a.kind
        if kind in _COMM:
            upstream = kind is RECV_F or kind is SEND_B
            legal = self.producers[c] if upstream else self.consumers[c]
            if (a.peer_unit, a.peer_stage, a.peer_chunk) not in self.peers[upstream][c]:
                side = "producers" if upstream else "consumers"
                names = ", ".join(f"{p[0]}.s{p[1]}c{p[2]}" for p in legal) or "none"
                self.bad(f"{_describe(a)}: the peer is not one of chunk {c}'s {side} "
                         f"({names})", k)
                self.skip.add(k)
            return
        key = (c, mb)
        if kind is F:
            if key in self.fwd:
                self.bad(f"{_describe(a)} appears twice", k)
            else:
                self.fwd[key] = k
                if self.sync is not None:
                    self.bad(f"{_describe(a)} runs after the stage's SYNC", k)
        elif kind is B:
            if key in self.bwd:
                self.bad(f"{_describe(a)} appears twice", k)
            elif key not in self.fwd:
                self.bad(f"{_describe(a)} comes before its forward F{mb}{_chunk_name(c)}", k)
            self.bwd.setdefault(key, k)
        elif kind is W:
            if schedule.name != "zero_bubble":
                self.bad(f"{_describe(a)}: weight-gradient passes are the zero_bubble "
                         f"schedule's, not {schedule.name}'s", k)
            elif key in self.wgt:
                self.bad(f"{_describe(a)} appears twice", k)
            elif key not in self.bwd:
                self.bad(f"{_describe(a)} comes before its backward B{mb}{_chunk_name(c)}", k)
            self.wgt.setdefault(key, k)
        elif kind is SYNC:
            if self.sync is not None:
                self.bad(f"{_describe(a)} appears twice", k)
            self.sync = k if self.sync is None else self.sync
        elif kind is OPT:
            if self.opt is not None:
                self.bad(f"{_describe(a)} appears twice", k)
            elif self.sync is None:
                self.bad(f"{_describe(a)} before the stage's SYNC", k)
            self.opt = k if self.opt is None else self.opt

    def complete(self) -> None:
        """Orders that need the whole row: every forward, and all or no backwards."""
        st, m = self.st, self.schedule.num_microbatches
        for c in range(self.vpp):
            missing_f = [j for j in range(m) if (c, j) not in self.fwd]
            if missing_f:
                self.problems.append(f"{st.where} never runs the forward of microbatch"
                                     f"{'es' if len(missing_f) > 1 else ''} "
                                     f"{_ranges(missing_f)}" + (f" (chunk {c})" if c else ""))
                self.marks.add((self.i, ROW))
            done_b = [j for j in range(m) if (c, j) in self.bwd]
            if done_b and len(done_b) < m:
                missing = [j for j in range(m) if (c, j) not in self.bwd]
                self.problems.append(f"{st.where} runs backwards of chunk {c} for some "
                                     f"microbatches but not for {_ranges(missing)}")
                self.marks.add((self.i, ROW))
            done_w = [j for j in range(m) if (c, j) in self.wgt]
            if done_w and len(done_w) < len(done_b):
                missing = [j for j in done_b if (c, j) not in self.wgt]
                self.problems.append(f"{st.where} splits the weight gradients of chunk {c} "
                                     f"off some backwards but not off {_ranges(missing)}")
                self.marks.add((self.i, ROW))

    def ordered(self) -> None:
        """A forward reads its input: a receive from every producer must precede it; a
        send follows the pass that produces it, a receive precedes the pass that reads it."""
        received: dict[tuple[int, int], set] = defaultdict(set)
        fwd, bwd, end = self.fwd, self.bwd, len(self.st.actions)
        for k, a in enumerate(self.st.actions):
            kind = a.kind
            if kind is F or kind is B or kind is W or kind is SYNC or kind is OPT:
                if kind is F and k not in self.skip:
                    got = received.get((a.chunk, a.microbatch), ())
                    for p in self.producers[a.chunk]:
                        if p not in got:
                            self.bad(f"{_describe(a)} runs without receiving its input "
                                     f"from {_vs_name(p)}", k)
                            break
                continue
            if k in self.skip:
                continue
            key = (a.chunk, a.microbatch)
            if kind is SEND_F:
                if not k > fwd.get(key, end):
                    self.bad(f"{_describe(a)} sends before the forward that produces it", k)
            elif kind is SEND_B:
                if not k > bwd.get(key, end):
                    self.bad(f"{_describe(a)} sends before the backward that produces it", k)
            elif kind is RECV_F:
                if not k < fwd.get(key, -1):
                    self.bad(f"{_describe(a)} arrives after the forward that reads it", k)
                received[key].add((a.peer_unit, a.peer_stage, a.peer_chunk))
            elif key not in bwd:
                self.bad(f"{_describe(a)}: gradients received but the stage runs no backward "
                         "of that microbatch", k)
            elif not k < bwd[key]:
                self.bad(f"{_describe(a)} arrives after the backward that reads it", k)

    def synced(self) -> None:
        """The SYNC after the last backward, an OPT after it."""
        sync, where = self.sync, self.st.where
        if sync is None:
            return
        if not self.bwd:
            self.bad(f"{where}:SYNC on a stage that runs no backward", sync)
        elif max(self.bwd.values()) > sync:
            self.bad(f"{where}:SYNC before the stage's last backward", sync)
        elif max(self.wgt.values(), default=-1) > sync:
            self.bad(f"{where}:SYNC before the stage's last weight-gradient pass", sync)
        elif self.opt is None:
            self.bad(f"{where}:SYNC without an OPT after it", sync)


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for n, v in enumerate(values):
        if start is None:
            start = v
        if n + 1 == len(values) or values[n + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return ", ".join(out)


_COUNTERPART = {SEND_F: RECV_F, SEND_B: RECV_B, RECV_F: SEND_F, RECV_B: SEND_B}


def _counterpart(a: Action) -> str:
    arrow = "<" if a.kind in _SENDS else ">"
    return f"{a.peer_unit}.s{a.peer_stage}:{_COUNTERPART[a.kind]}{a.microbatch}" \
        f"{_chunk_name(a.peer_chunk)}{arrow}{a.unit}.s{a.stage}{_chunk_name(a.chunk)}"


def _pair(schedule: Schedule) -> tuple[list[str], set[Mark], dict[Mark, Mark]]:
    """Match sends with receives. Returns the problems, their marks, receive -> send (in
    the order of the receives: stage by stage, in program order)."""
    # Keyed by (data kind, sending virtual stage, receiving virtual stage, microbatch);
    # the data kind is the receive's, so that a send and its receive share the key.
    sends: dict[tuple, Mark] = {}
    recvs: dict[tuple, Mark] = {}
    extra: list[Mark] = []
    for i, st in enumerate(schedule.stages):
        for k, a in enumerate(st.actions):
            kind = a.kind
            if kind is SEND_F or kind is SEND_B:
                key = (_COUNTERPART[kind], a.unit, a.stage, a.chunk, a.peer_unit,
                       a.peer_stage, a.peer_chunk, a.microbatch)
                table = sends
            elif kind is RECV_F or kind is RECV_B:
                key = (kind, a.peer_unit, a.peer_stage, a.peer_chunk, a.unit, a.stage,
                       a.chunk, a.microbatch)
                table = recvs
            else:
                continue
            if key in table:
                extra.append((i, k))
            else:
                table[key] = (i, k)
    problems: list[str] = []
    marks: set[Mark] = set()
    match: dict[Mark, Mark] = {}

    def action(mark: Mark) -> Action:
        return schedule.stages[mark[0]].actions[mark[1]]

    for mark in extra:
        problems.append(f"{_describe(action(mark))} appears twice")
        marks.add(mark)
    for key, recv in recvs.items():
        send = sends.get(key)
        if send is not None:
            match[recv] = send
        else:
            a = action(recv)
            problems.append(f"{_describe(a)} has no matching send {_counterpart(a)}")
            marks.add(recv)
    if len(match) < len(sends):
        for key, send in sends.items():
            if key not in recvs:
                a = action(send)
                problems.append(f"{_describe(a)} has no matching receive {_counterpart(a)}")
                marks.add(send)
    return problems, marks, match


def _deadlock(schedule: Schedule, match: dict[Mark, Mark]) -> tuple[list[str], set[Mark]]:
    """Run the schedule abstractly; the stages that cannot finish and where they stop.
    ``match``: receive -> send, in program order per stage."""
    stages = schedule.stages
    n = len(stages)
    # Per stage, only its receives matter (nothing else blocks): their slots and the
    # (stage, slot) of their sends, in program order.
    recv_slots: list[list[int]] = [[] for _ in range(n)]
    recv_from: list[list[Mark]] = [[] for _ in range(n)]
    for (i, k), send in match.items():
        recv_slots[i].append(k)
        recv_from[i].append(send)
    at = [0] * n                 # index into recv_slots of the receive a stage waits at
    # A stage has run every action before slot reached[i] (all of them when it is done).
    reached = [0] * n
    waiters: list[list[int]] = [[] for _ in range(n)]
    ready = list(range(n))
    while ready:
        i = ready.pop()
        slots, froms = recv_slots[i], recv_from[i]
        p = at[i]
        while p < len(slots):
            si, sk = froms[p]
            if reached[si] <= sk:
                waiters[si].append(i)
                break
            p += 1
        at[i] = p
        new = slots[p] if p < len(slots) else len(stages[i].actions)
        if new != reached[i]:
            reached[i] = new
            ready += waiters[i]
            waiters[i] = []
    stuck = [(i, recv_slots[i][at[i]]) for i in range(n) if at[i] < len(recv_slots[i])]
    if not stuck:
        return [], set()
    problems = ["deadlock: no stage can go on (receives block until their send has run):"]
    for i, k in stuck:
        a = stages[i].actions[k]
        si, sk = match[(i, k)]
        problems.append(f"{_describe(a)} waits for {_describe(stages[si].actions[sk])}, "
                        f"which {stages[si].where} has not reached "
                        f"(it is stuck at slot {reached[si]})")
    return problems, set(stuck)


def _groups(actions: tuple[Action, ...]) -> tuple[list[list[int]], list[int], list[int]]:
    """A stage's NCCL groups (each a run of consecutive communication slots), per slot
    its group (-1 for a pass) and per group how many passes come before it."""
    groups: list[list[int]] = []
    group_of = [-1] * len(actions)
    passes_before: list[int] = []
    passes = 0
    for k, a in enumerate(actions):
        if a.kind in _COMM:
            if k == 0 or actions[k - 1].kind not in _COMM:
                groups.append([])
                passes_before.append(passes)
            groups[-1].append(k)
            group_of[k] = len(groups) - 1
        elif a.kind is not SYNC and a.kind is not OPT:
            passes += 1
    return groups, group_of, passes_before


def _nccl_deadlock(schedule: Schedule, match: dict[Mark, Mark]
                   ) -> tuple[list[str], set[Mark]]:
    """Run the schedule under NCCL's rules (module docstring, phase 4); the stages that
    cannot finish and where they stop."""
    stages = schedule.stages
    n = len(stages)
    other: dict[Mark, Mark] = dict(match)
    other.update({send: recv for recv, send in match.items()})
    layout = [_groups(st.actions) for st in stages]
    # Per pass slot, the groups whose receives it reads (F: RECV_F, B: RECV_B of its
    # microbatch and chunk) and per stage its pass slots in order.
    reads: list[dict[int, set[int]]] = []
    pass_slots: list[list[int]] = []
    for i, st in enumerate(stages):
        _, group_of, _ = layout[i]
        recv_groups: dict[tuple, set[int]] = defaultdict(set)
        for k, a in enumerate(st.actions):
            if a.kind is RECV_F or a.kind is RECV_B:
                recv_groups[(F if a.kind is RECV_F else B, a.microbatch, a.chunk)].add(
                    group_of[k])
        reads.append({k: recv_groups.get((a.kind, a.microbatch, a.chunk), set())
                      for k, a in enumerate(st.actions) if a.kind in (F, B)})
        pass_slots.append([k for k, a in enumerate(st.actions)
                           if a.kind not in _COMM and a.kind is not SYNC
                           and a.kind is not OPT])
    peers = [{m[0] for k in range(len(st.actions)) if (m := other.get((i, k)))}
             for i, st in enumerate(stages)]
    started = [0] * n            # groups started (in order), per stage
    completed = [0] * n          # groups completed (in order)
    ran = [0] * n                # passes run (in order)
    ready = list(range(n))
    queued = [True] * n
    while ready:
        i = ready.pop()
        queued[i] = False
        groups, group_of, passes_before = layout[i]
        moved = False
        while True:
            if started[i] == completed[i] < len(groups) and \
                    ran[i] >= passes_before[started[i]]:
                started[i] += 1
                moved = True
                continue
            if completed[i] < started[i] and all(
                    started[j] > layout[j][1][kk]
                    for j, kk in (other[(i, k)] for k in groups[completed[i]])):
                completed[i] += 1
                moved = True
                continue
            if ran[i] < len(pass_slots[i]) and all(
                    g < completed[i] for g in reads[i].get(pass_slots[i][ran[i]], ())):
                ran[i] += 1
                moved = True
                continue
            break
        if moved:
            for j in peers[i] | {i}:
                if not queued[j]:
                    queued[j] = True
                    ready.append(j)
    stuck = [i for i in range(n)
             if completed[i] < len(layout[i][0]) or ran[i] < len(pass_slots[i])]
    if not stuck:
        return [], set()
    problems = ["deadlock under NCCL's rules (a send completes only once its receive is "
                "posted; a rank's transfer groups run in order on one stream):"]
    marks: set[Mark] = set()
    for i in stuck:
        groups, group_of, _ = layout[i]
        g = completed[i]
        if g < started[i]:          # started, waiting for the other ends
            for k in groups[g]:
                j, kk = other[(i, k)]
                if started[j] <= layout[j][1][kk]:
                    problems.append(
                        f"{_describe(stages[i].actions[k])} waits for "
                        f"{_describe(stages[j].actions[kk])}, whose group "
                        f"{stages[j].where} has not started")
                    marks.add((i, k))
        elif ran[i] < len(pass_slots[i]):
            k = pass_slots[i][ran[i]]
            problems.append(f"{_describe(stages[i].actions[k])} waits for the transfers "
                            f"it reads, stuck behind {stages[i].where}'s earlier group")
            marks.add((i, k))
        else:
            k = groups[g][0]
            problems.append(f"{_describe(stages[i].actions[k])} cannot start: its stream's "
                            "earlier group has not completed")
            marks.add((i, k))
    return problems, marks


def validate(schedule: Schedule) -> None:
    """Raise a ``ScheduleError`` (problems plus the marked grid) unless ``schedule`` is
    complete, consistent and free of deadlock (see the module docstring)."""
    problems, marks = _check_stages(schedule)
    if problems:
        raise ScheduleError(problems, schedule, marks)
    problems, marks, match = _pair(schedule)
    if problems:
        raise ScheduleError(problems, schedule, marks)
    problems, marks = _deadlock(schedule, match)
    if problems:
        raise ScheduleError(problems, schedule, marks)


def validate_nccl(schedule: Schedule) -> None:
    """``validate``, then phase 4: raise a ``ScheduleError`` unless the runtime's NCCL
    groups of ``schedule`` cannot deadlock (module docstring)."""
    validate(schedule)
    _, _, match = _pair(schedule)
    problems, marks = _nccl_deadlock(schedule, match)
    if problems:
        raise ScheduleError(problems, schedule, marks)
