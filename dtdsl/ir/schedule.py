"""The Schedule IR: per pipeline stage of every unit, the ordered actions of one iteration.

One data structure shared by the simulator (``dtdsl.sim``), the code generator and
the runtime executor. ``dtdsl.schedule.lower`` builds it from a Plan and
``dtdsl.schedule.validate`` checks it.

Actions
-------
Each action belongs to one unit stage (``llm.s1``) and is one of

- ``F`` / ``B``: forward / backward of microbatch j through model chunk c of the stage;
- ``W``: the weight gradients of microbatch j's backward, run apart from its ``B`` (which
  then computes only the gradients of the stage's input and of the activations: the
  zero-bubble schedule, Qi et al. 2023); always after its ``B``, on a stage that trains.
  Without a ``W`` a ``B`` computes both, as in every other schedule;
- ``SEND_F`` / ``RECV_F``: activations of microbatch j leaving chunk c for the peer
  stage's chunk (and arriving there); ``SEND_B`` / ``RECV_B``: the gradients of those
  activations going the other way;
- ``SYNC``: the stage's data-parallel gradient synchronisation (ZeRO-1 reduce-scatter,
  or an all-reduce); ``OPT``: its optimizer step (with the all-gather of the updated
  parameters under ZeRO-1 and the global gradient-norm agreement for clipping).

Text form (round-trips through ``parse_action`` / ``Action.format``; chunk 0 and a
peer's chunk 0 are not written)::

    llm.s1:F3              forward of microbatch 3 on stage 1 of unit llm
    llm.s1:B3c1            backward of microbatch 3, model chunk 1 (interleaved 1F1B)
    llm.s1:W3              weight gradients of microbatch 3 (zero_bubble)
    vit.s0:SEND_F3>llm.s0  vit's last stage sends microbatch 3's activations to llm.s0
    llm.s0:RECV_F3<vit.s0  ... which llm.s0 receives
    llm.s3:SEND_F3>llm.s0c1  the last stage's chunk 0 feeds chunk 1 of stage 0
    llm.s0:SEND_B3>vit.s0  input gradients back to the encoder
    llm.s1:SYNC            gradient synchronisation over the stage's DP group
    llm.s1:OPT             optimizer step

A Schedule (``schedule_text`` / ``parse_schedule``) is a header, one line per unit (its
layout) and one line per unit stage with its actions in program order, the
``unit.sN:`` prefix written once per line::

    schedule 1f1b microbatches=2
    unit vit encoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2
    unit llm backbone tp=1 dp=1 pp=1 vpp=1 first_rank=1 share=1 layers=4
    vit.s0: F0 SEND_F0>llm.s0 F1 SEND_F1>llm.s0 RECV_B0<llm.s0 B0 RECV_B1<llm.s0 B1 SYNC OPT
    llm.s0: RECV_F0<vit.s0 F0 B0 SEND_B0>vit.s0 RECV_F1<vit.s0 F1 B1 SEND_B1>vit.s0 SYNC OPT

Semantics
---------
*Microbatches across units.* Every unit runs the same number M = ``num_microbatches``
(the Plan's, per backbone replica) of microbatch steps j = 0..M-1. At step j the DP
replicas of unit u together process the samples of backbone microbatch j of *all*
backbone DP replicas; one replica of u handles ``microbatch_share`` = dp_lm / dp_u
backbone microbatches' worth of samples (which need not be a whole number).

*Replication.* The schedule is per (unit, stage): every DP replica and TP rank of the
stage executes the same action list (TP ranks in lockstep, DP replicas on their own
samples). The ranks of a stage are ``ScheduleUnit.ranks(stage)``.

*Communication is unit level.* ``SEND_F3>llm.s0`` means "the activations of step 3
leave for llm.s0"; which DP replica of the receiver gets which samples (fan-in and
fan-out between replicas, ratios such as dp 2 -> 3 that do not divide) is the
runtime broker's job and is not in the IR. Sends are asynchronous (posted, waited on
at the end of the step); a receive is posted where it stands, and the pass that reads it
waits until its data has arrived (so a receive may be posted passes early, as
``schedule.place`` does). Every send has exactly one receive; the validator proves the
order free of deadlock under these rules, and under NCCL's stricter ones
(``validate_nccl``).

*Topology.* Within a unit, model chunk c of stage s holds virtual stage k = c * pp + s
(Megatron-LM's round-robin assignment), and k feeds k + 1. Across units, the last
virtual stage of every encoder feeds the backbone's first, and the backbone's last
feeds the first of every generator (``Schedule.producers`` / ``Schedule.consumers``).

Actions are frozen, slotted dataclasses rather than pydantic models: a schedule of 32
stages x 256 microbatches has tens of thousands of them, and the text form is the
serialisation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from dtdsl.ir.plan import Plan, UnitPlan

__all__ = [
    "Action", "ActionKind", "Schedule", "ScheduleUnit", "StageRef", "StageSchedule",
    "parse_action", "parse_schedule", "schedule_text",
]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
ROLES = ("encoder", "backbone", "generator")


class ActionKind(StrEnum):
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SYNC = "SYNC"
    OPT = "OPT"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def direction(self) -> ActionKind | None:
        """F for activations and B for gradients (the pass that produces the data)."""
        return _DIRECTION[self]


# Membership tests on frozensets: schedules have tens of thousands of actions, and these
# are asked of every one in the lowering and the validator.
_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
_COMM = _SENDS | _RECVS
_STEP = frozenset({ActionKind.SYNC, ActionKind.OPT})
_DIRECTION: dict[ActionKind, ActionKind | None] = {
    ActionKind.F: ActionKind.F, ActionKind.SEND_F: ActionKind.F, ActionKind.RECV_F: ActionKind.F,
    ActionKind.B: ActionKind.B, ActionKind.SEND_B: ActionKind.B, ActionKind.RECV_B: ActionKind.B,
    ActionKind.W: None, ActionKind.SYNC: None, ActionKind.OPT: None,
}


_ID = r"[A-Za-z_][A-Za-z0-9_]*"
_NUM = r"0|[1-9][0-9]*"
_LOCAL_RE = re.compile(
    rf"(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|SYNC|OPT|F|B|W)(?P<mb>{_NUM})?(?:c(?P<chunk>{_NUM}))?"
    rf"(?:(?P<dir>[<>])(?P<peer_unit>{_ID})\.s(?P<peer_stage>{_NUM})"
    rf"(?:c(?P<peer_chunk>{_NUM}))?)?")
_PREFIX_RE = re.compile(rf"(?P<unit>{_ID})\.s(?P<stage>{_NUM}):")
_ID_RE = re.compile(_ID)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRef:
    """A unit stage, ``llm.s1``."""

    unit: str
    stage: int

    def __str__(self) -> str:
        return f"{self.unit}.s{self.stage}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step of one unit stage's program (see the module docstring for the kinds)."""

    unit: str
    stage: int
    kind: ActionKind
    microbatch: int | None = None
    chunk: int = 0
    peer_unit: str | None = None      # SEND_*/RECV_*: the other end
    peer_stage: int | None = None
    peer_chunk: int = 0

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not ActionKind:
            kind = ActionKind(kind)
            object.__setattr__(self, "kind", kind)
        mb = self.microbatch
        if kind in _STEP:
            if mb is not None or self.peer_unit is not None or self.peer_stage is not None \
                    or self.chunk or self.peer_chunk:
                raise ValueError(f"{kind} takes no microbatch, chunk or peer")
        elif mb is None:
            raise ValueError(f"{kind} needs a microbatch")
        if kind in _COMM:
            if self.peer_unit is None or self.peer_stage is None:
                raise ValueError(f"{kind} needs a peer stage")
            if self.peer_stage < 0:
                raise ValueError("stages, chunks and microbatches are non-negative")
        elif self.peer_unit is not None or self.peer_stage is not None or self.peer_chunk:
            raise ValueError(f"{kind} takes no peer")
        if self.stage < 0 or self.chunk < 0 or (mb is not None and mb < 0) or \
                self.peer_chunk < 0:
            raise ValueError("stages, chunks and microbatches are non-negative")

    @property
    def where(self) -> StageRef:
        return StageRef(unit=self.unit, stage=self.stage)

    @property
    def peer(self) -> StageRef | None:
        if self.peer_unit is None or self.peer_stage is None:
            return None
        return StageRef(unit=self.peer_unit, stage=self.peer_stage)

    def format_local(self) -> str:
        """The text form without the ``unit.sN:`` prefix (as in a schedule's stage line)."""
        text = self.kind.value
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.chunk:
            text += f"c{self.chunk}"
        if self.peer_unit is not None:
            text += (">" if self.kind.is_send else "<") + f"{self.peer_unit}.s{self.peer_stage}"
            if self.peer_chunk:
                text += f"c{self.peer_chunk}"
        return text

    def format(self) -> str:
        """The text form, ``llm.s1:F3``; ``parse_action`` reads it back."""
        return f"{self.unit}.s{self.stage}:{self.format_local()}"

    def __str__(self) -> str:
        return self.format()


def _parse_local(unit: str, stage: int, text: str) -> Action:
    m = _LOCAL_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3c1, W3, SEND_F3>llm.s0, "
                         "RECV_B3<llm.s2, SYNC or OPT)")
    kind = ActionKind(m["kind"])
    direction = m["dir"]
    if kind.is_comm and direction != (">" if kind.is_send else "<"):
        arrow = ">" if kind.is_send else "<"
        raise ValueError(f"{text!r}: {kind} is written with '{arrow}' before its peer")
    if not kind.is_comm and direction is not None:
        raise ValueError(f"{text!r}: {kind} takes no peer")
    return Action(unit=unit, stage=stage, kind=kind,
                  microbatch=None if m["mb"] is None else int(m["mb"]),
                  chunk=int(m["chunk"] or 0), peer_unit=m["peer_unit"],
                  peer_stage=None if m["peer_stage"] is None else int(m["peer_stage"]),
                  peer_chunk=int(m["peer_chunk"] or 0))


def parse_action(text: str) -> Action:
    """Read an action's text form (``llm.s1:F3``, ``vit.s0:SEND_F3>llm.s0``, ...)."""
    m = _PREFIX_RE.match(text)
    if m is None:
        raise ValueError(f"not an action: {text!r} (expected UNIT.sSTAGE:ACTION, e.g. llm.s1:F3)")
    return _parse_local(m["unit"], int(m["stage"]), text[m.end():])


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleUnit:
    """A unit's layout as far as the schedule is concerned (from the Plan's UnitPlan)."""

    name: str
    role: Literal["encoder", "backbone", "generator"]
    tp: int
    dp: int
    pp: int
    vpp: int = 1
    first_rank: int = 0
    microbatch_share: float = 1.0     # backbone microbatches per unit microbatch step
    layers_per_stage: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if _ID_RE.fullmatch(self.name) is None:
            raise ValueError(f"unit name {self.name!r} is not an identifier")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}")
        if min(self.tp, self.dp, self.pp, self.vpp) < 1:
            raise ValueError(f"{self.name}: tp, dp, pp and vpp must be at least 1")
        if self.layers_per_stage and len(self.layers_per_stage) != self.pp:
            raise ValueError(f"{self.name}: {len(self.layers_per_stage)} layer counts for "
                             f"{self.pp} stages")

    @staticmethod
    def of(unit: UnitPlan) -> ScheduleUnit:
        return ScheduleUnit(name=unit.name, role=unit.role, tp=unit.tp, dp=unit.dp, pp=unit.pp,
                            vpp=unit.vpp, first_rank=unit.first_rank,
                            microbatch_share=unit.microbatch_share,
                            layers_per_stage=tuple(unit.layers_per_stage))

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def ranks(self, stage: int) -> range:
        """The global ranks that run ``stage`` (the Plan's (pp, dp, tp) grid, TP innermost)."""
        per_stage = self.dp * self.tp
        start = self.first_rank + stage * per_stage
        return range(start, start + per_stage)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSchedule:
    """The actions of one unit stage, in program order."""

    unit: str
    stage: int
    actions: tuple[Action, ...] = ()

    @property
    def where(self) -> StageRef:
        return StageRef(unit=self.unit, stage=self.stage)


# A virtual stage: (unit, stage, chunk).
VirtualStage = tuple[str, int, int]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Every unit stage's actions for one iteration (see the module docstring)."""

    name: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
    num_microbatches: int
    units: tuple[ScheduleUnit, ...]
    stages: tuple[StageSchedule, ...]
    _index: dict[tuple[str, int], int] = field(init=False, repr=False, compare=False)
    _units: dict[str, ScheduleUnit] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.name!r}; one of {', '.join(SCHEDULE_NAMES)}")
        if self.num_microbatches < 1:
            raise ValueError("num_microbatches must be at least 1")
        units = {u.name: u for u in self.units}
        if len(units) != len(self.units):
            raise ValueError("duplicate unit names")
        if [u.role for u in self.units].count("backbone") != 1:
            raise ValueError("a schedule has exactly one backbone unit")
        index: dict[tuple[str, int], int] = {}
        for i, st in enumerate(self.stages):
            if st.unit not in units:
                raise ValueError(f"stage {st.where} of an unknown unit")
            if not 0 <= st.stage < units[st.unit].pp:
                raise ValueError(f"{st.where}: {st.unit} has {units[st.unit].pp} stages")
            if (st.unit, st.stage) in index:
                raise ValueError(f"stage {st.where} appears twice")
            index[(st.unit, st.stage)] = i
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_units", units)

    @staticmethod
    def skeleton(name: str, num_microbatches: int, units: tuple[ScheduleUnit, ...]
                 ) -> Schedule:
        """A schedule of ``units`` with every stage and no actions yet (the lowering's
        start)."""
        return Schedule(name=name, num_microbatches=num_microbatches, units=units,
                        stages=tuple(StageSchedule(unit=u.name, stage=s)
                                     for u in units for s in range(u.pp)))

    @staticmethod
    def empty(plan: Plan) -> Schedule:
        """The skeleton of ``plan``'s units with GPUs of their own (a co-located unit runs
        inside the backbone's first or last stage: its passes are part of that stage's; a
        phased one before and after the pipeline on the backbone's ranks, outside the
        schedule: see ``sim.workload.iteration_durations``)."""
        return Schedule.skeleton(plan.schedule, plan.num_microbatches,
                                 tuple(ScheduleUnit.of(u) for u in plan.units
                                       if not (u.colocated or u.phased)))

    def unit(self, name: str) -> ScheduleUnit:
        return self._units[name]

    def stage_index(self, unit: str, stage: int) -> int:
        """The position of ``unit.s<stage>`` in ``stages``."""
        return self._index[(unit, stage)]

    def stage(self, unit: str, stage: int) -> StageSchedule:
        return self.stages[self._index[(unit, stage)]]

    def has_stage(self, unit: str, stage: int) -> bool:
        return (unit, stage) in self._index

    def with_stages(self, stages: tuple[StageSchedule, ...]) -> Schedule:
        return Schedule(name=self.name, num_microbatches=self.num_microbatches, units=self.units,
                        stages=stages)

    @property
    def num_actions(self) -> int:
        return sum(len(st.actions) for st in self.stages)

    # ---- topology -------------------------------------------------------------------------

    def _virtual(self, unit: ScheduleUnit, k: int) -> VirtualStage:
        return (unit.name, k % unit.pp, k // unit.pp)

    def producers(self, unit: str, stage: int, chunk: int = 0) -> tuple[VirtualStage, ...]:
        """The virtual stages whose activations virtual stage (unit, stage, chunk) reads."""
        u = self._units[unit]
        k = chunk * u.pp + stage
        if k > 0:
            return (self._virtual(u, k - 1),)
        if u.role == "encoder":
            return ()
        wanted = "encoder" if u.role == "backbone" else "backbone"
        return tuple(self._virtual(p, p.num_virtual_stages - 1)
                     for p in self.units if p.role == wanted)

    def consumers(self, unit: str, stage: int, chunk: int = 0) -> tuple[VirtualStage, ...]:
        """The virtual stages that read the activations of (unit, stage, chunk)."""
        u = self._units[unit]
        k = chunk * u.pp + stage
        if k + 1 < u.num_virtual_stages:
            return (self._virtual(u, k + 1),)
        if u.role == "generator":
            return ()
        wanted = "backbone" if u.role == "encoder" else "generator"
        return tuple((c.name, 0, 0) for c in self.units if c.role == wanted)


# ---- schedule text form -----------------------------------------------------------------------

def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _unit_line(u: ScheduleUnit) -> str:
    layers = ",".join(str(n) for n in u.layers_per_stage) or "-"
    return (f"unit {u.name} {u.role} tp={u.tp} dp={u.dp} pp={u.pp} vpp={u.vpp} "
            f"first_rank={u.first_rank} share={_num(u.microbatch_share)} layers={layers}")


def schedule_text(schedule: Schedule) -> str:
    """The schedule's text form (``parse_schedule`` reads it back; ``--emit schedule``)."""
    lines = [f"schedule {schedule.name} microbatches={schedule.num_microbatches}"]
    lines += [_unit_line(u) for u in schedule.units]
    for st in schedule.stages:
        body = " ".join(a.format_local() for a in st.actions)
        lines.append(f"{st.where}: {body}".rstrip())
    return "\n".join(lines) + "\n"


_HEADER_RE = re.compile(rf"schedule (?P<name>\S+) microbatches=(?P<m>{_NUM})")
_UNIT_RE = re.compile(
    rf"unit (?P<name>{_ID}) (?P<role>encoder|backbone|generator) tp=(?P<tp>{_NUM}) "
    rf"dp=(?P<dp>{_NUM}) pp=(?P<pp>{_NUM}) vpp=(?P<vpp>{_NUM}) "
    rf"first_rank=(?P<first>{_NUM}) share=(?P<share>\S+) layers=(?P<layers>\S+)")


def parse_schedule(text: str) -> Schedule:
    """Read ``schedule_text``'s form back (blank lines and ``#`` comment lines are skipped).
    A ValueError names the line of anything malformed."""
    header = None
    units: dict[str, tuple[int, ScheduleUnit]] = {}      # name -> (line, unit)
    stages: dict[tuple[str, int], tuple[int, StageSchedule]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if header is None:
                m = _HEADER_RE.fullmatch(line)
                if m is None:
                    raise ValueError("expected 'schedule NAME microbatches=M'")
                if m["name"] not in SCHEDULE_NAMES:
                    raise ValueError(f"unknown schedule {m['name']!r}; one of "
                                     f"{', '.join(SCHEDULE_NAMES)}")
                if int(m["m"]) < 1:
                    raise ValueError("microbatches must be at least 1")
                header = (m["name"], int(m["m"]))
            elif line.startswith("unit "):
                if stages:
                    raise ValueError("unit lines come before the stage lines")
                m = _UNIT_RE.fullmatch(line)
                if m is None:
                    raise ValueError("expected 'unit NAME ROLE tp=.. dp=.. pp=.. vpp=.. "
                                     "first_rank=.. share=.. layers=a,b,..'")
                if m["name"] in units:
                    raise ValueError(f"unit {m['name']} again (first on line "
                                     f"{units[m['name']][0]})")
                backbones = [n for n, u in units.values() if u.role == "backbone"]
                if m["role"] == "backbone" and backbones:
                    raise ValueError(f"a second backbone (the first on line {backbones[0]}); "
                                     "a schedule has exactly one")
                layers = () if m["layers"] == "-" else \
                    tuple(int(n) for n in m["layers"].split(","))
                units[m["name"]] = (number, ScheduleUnit(
                    name=m["name"], role=m["role"], tp=int(m["tp"]), dp=int(m["dp"]),
                    pp=int(m["pp"]), vpp=int(m["vpp"]), first_rank=int(m["first"]),
                    microbatch_share=float(m["share"]), layers_per_stage=layers))
            else:
                m = _PREFIX_RE.match(line)
                if m is None:
                    raise ValueError("expected a stage line 'UNIT.sN: ACTION ...'")
                unit, stage = m["unit"], int(m["stage"])
                if unit not in units:
                    raise ValueError(f"stage of an unknown unit {unit!r} (the unit lines "
                                     f"name {', '.join(units) or 'none'})")
                if stage >= units[unit][1].pp:
                    raise ValueError(f"{unit}.s{stage}: {unit} has {units[unit][1].pp} "
                                     "stages")
                if (unit, stage) in stages:
                    raise ValueError(f"{unit}.s{stage} again (first on line "
                                     f"{stages[(unit, stage)][0]})")
                actions = tuple(_parse_local(unit, stage, tok)
                                for tok in line[m.end():].split())
                stages[(unit, stage)] = (number, StageSchedule(unit=unit, stage=stage,
                                                               actions=actions))
        except ValueError as err:
            raise ValueError(f"line {number}: {err}") from None
    if header is None:
        raise ValueError("empty schedule text")
    if not any(u.role == "backbone" for _, u in units.values()):
        raise ValueError("no backbone unit line (a schedule has exactly one)")
    return Schedule(name=header[0], num_microbatches=header[1],
                    units=tuple(u for _, u in units.values()),
                    stages=tuple(st for _, st in stages.values()))
