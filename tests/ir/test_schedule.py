"""The Schedule IR: actions and their text form (round trips, hypothesis), the schedule
text form and its errors (each naming its line), the constructors' checks, and the
topology (producers and consumers across a DAG of units, interleaved chunks)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtdsl.ir.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleUnit,
    StageSchedule,
    parse_action,
    parse_schedule,
    schedule_text,
)
from dtdsl.schedule.lower import GradientFlow, lower_units

# ---- actions ---------------------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
small = st.integers(min_value=0, max_value=10_000)


@st.composite
def actions(draw) -> Action:
    kind = draw(st.sampled_from(list(ActionKind)))
    unit, stage = draw(names), draw(small)
    if kind in (ActionKind.SYNC, ActionKind.OPT):
        return Action(unit=unit, stage=stage, kind=kind)
    fields = dict(unit=unit, stage=stage, kind=kind, microbatch=draw(small), chunk=draw(small))
    if kind.is_comm:
        fields.update(peer_unit=draw(names), peer_stage=draw(small), peer_chunk=draw(small))
    return Action(**fields)


@given(actions())
def test_action_text_round_trips(a: Action):
    text = a.format()
    assert parse_action(text) == a
    assert str(a) == text
    assert text == f"{a.unit}.s{a.stage}:{a.format_local()}"
    assert " " not in text


@given(actions())
def test_action_kinds_partition(a: Action):
    kind = a.kind
    assert [kind.is_compute, kind.is_send, kind.is_recv,
            kind in (ActionKind.SYNC, ActionKind.OPT)].count(True) == 1
    assert kind.is_comm == (kind.is_send or kind.is_recv)
    assert (a.peer is not None) == kind.is_comm
    assert a.where.unit == a.unit and a.where.stage == a.stage


@pytest.mark.parametrize("text,fields", [
    ("llm.s1:F3", dict(unit="llm", stage=1, kind="F", microbatch=3)),
    ("llm.s0:B3c1", dict(unit="llm", stage=0, kind="B", microbatch=3, chunk=1)),
    ("vit.s0:SEND_F3>llm.s0", dict(unit="vit", stage=0, kind="SEND_F", microbatch=3,
                                   peer_unit="llm", peer_stage=0)),
    ("llm.s0:RECV_F3<vit.s0", dict(unit="llm", stage=0, kind="RECV_F", microbatch=3,
                                   peer_unit="vit", peer_stage=0)),
    ("llm.s3:SEND_F3>llm.s0c1", dict(unit="llm", stage=3, kind="SEND_F", microbatch=3,
                                     peer_unit="llm", peer_stage=0, peer_chunk=1)),
    ("llm.s0:RECV_B12c1<llm.s1c1", dict(unit="llm", stage=0, kind="RECV_B", microbatch=12,
                                        chunk=1, peer_unit="llm", peer_stage=1,
                                        peer_chunk=1)),
    ("llm.s1:SYNC", dict(unit="llm", stage=1, kind="SYNC")),
    ("llm.s1:OPT", dict(unit="llm", stage=1, kind="OPT")),
])
def test_documented_examples(text: str, fields: dict):
    a = Action(**fields)
    assert a.kind is ActionKind(fields["kind"])     # a plain string becomes the enum
    assert a.format() == text
    assert parse_action(text) == a


@pytest.mark.parametrize("fields,message", [
    (dict(kind="SYNC", microbatch=1), "takes no microbatch"),
    (dict(kind="OPT", chunk=1), "takes no microbatch"),
    (dict(kind="F"), "needs a microbatch"),
    (dict(kind="SEND_F", microbatch=1), "needs a peer"),
    (dict(kind="RECV_B", microbatch=1, peer_unit="vit"), "needs a peer"),
    (dict(kind="F", microbatch=1, peer_unit="vit", peer_stage=0), "takes no peer"),
    (dict(kind="B", microbatch=1, peer_chunk=1), "takes no peer"),
    (dict(kind="F", microbatch=-1), "non-negative"),
    (dict(kind="F", microbatch=1, chunk=-1), "non-negative"),
    (dict(kind="SEND_F", microbatch=1, peer_unit="vit", peer_stage=-1), "non-negative"),
    (dict(kind="JUMP", microbatch=1), "JUMP"),
])
def test_action_checks_its_fields(fields: dict, message: str):
    with pytest.raises(ValueError, match=message):
        Action(unit="llm", stage=0, **fields)
    with pytest.raises(ValueError, match="non-negative"):
        Action(unit="llm", stage=-1, kind="F", microbatch=0)


@pytest.mark.parametrize("text,message", [
    ("F3", "expected UNIT.sSTAGE:ACTION"),
    ("llm.s1 F3", "expected UNIT.sSTAGE:ACTION"),
    ("llm.s1:", "not an action"),
    ("llm.s1:F", "needs a microbatch"),
    ("llm.s1:F03", "not an action"),
    ("llm.s1:X3", "not an action"),
    ("llm.s1:F3 ", "not an action"),
    ("llm.s1:SYNC3", "takes no microbatch"),
    ("llm.s1:SEND_F3<llm.s2", "written with '>'"),
    ("llm.s1:RECV_F3>llm.s0", "written with '<'"),
    ("llm.s1:RECV_F3", "written with '<'"),
    ("llm.s1:F3>llm.s2", "takes no peer"),
    ("llm.s1:SEND_F3>llm", "not an action"),
])
def test_parse_action_errors(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_action(text)


# ---- schedules -------------------------------------------------------------------------------

def unit(name: str, role: str, pp: int = 1, **kw) -> ScheduleUnit:
    return ScheduleUnit(name=name, role=role, tp=kw.pop("tp", 1), dp=kw.pop("dp", 1), pp=pp,
                        **kw)


def lowered(name: str, m: int, *units: ScheduleUnit) -> Schedule:
    base = Schedule.skeleton(name, m, units)
    return lower_units(base, GradientFlow.everywhere(base))


TINY = """\
schedule 1f1b microbatches=2
unit vit encoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2
unit llm backbone tp=1 dp=1 pp=1 vpp=1 first_rank=1 share=1 layers=4
vit.s0: F0 SEND_F0>llm.s0 F1 SEND_F1>llm.s0 RECV_B0<llm.s0 B0 RECV_B1<llm.s0 B1 SYNC OPT
llm.s0: RECV_F0<vit.s0 F0 B0 SEND_B0>vit.s0 RECV_F1<vit.s0 F1 B1 SEND_B1>vit.s0 SYNC OPT
"""


def test_the_docstring_example_is_what_the_lowering_builds():
    schedule = lowered("1f1b", 2,
                       unit("vit", "encoder", first_rank=0, layers_per_stage=(2,)),
                       unit("llm", "backbone", first_rank=1, layers_per_stage=(4,)))
    assert schedule_text(schedule) == TINY
    assert parse_schedule(TINY) == schedule


SYNTHETIC = [
    ("1f1b", 8, (unit("llm", "backbone", 4),)),
    ("gpipe", 3, (unit("vit", "encoder", 2), unit("llm", "backbone", 3))),
    ("interleaved", 5, (unit("llm", "backbone", 3, vpp=2, layers_per_stage=(4, 4, 4)),)),
    ("interleaved", 6, (unit("vit", "encoder", 2, dp=3, microbatch_share=2 / 3),
                        unit("aud", "encoder", 1, tp=2, first_rank=6, microbatch_share=2.0),
                        unit("llm", "backbone", 2, vpp=2, dp=2, first_rank=8),
                        unit("sd", "generator", 2, first_rank=12, microbatch_share=2.0),
                        unit("gen", "generator", 1, dp=4, first_rank=14,
                             microbatch_share=0.5))),
]


@pytest.mark.parametrize("name,m,units", SYNTHETIC, ids=[f"{s[0]}-{len(s[2])}" for s in SYNTHETIC])
def test_schedule_text_round_trips(name: str, m: int, units: tuple[ScheduleUnit, ...]):
    schedule = lowered(name, m, *units)
    text = schedule_text(schedule)
    back = parse_schedule(text)
    assert back == schedule
    assert schedule_text(back) == text
    assert back.units == schedule.units        # shares such as 2/3 survive exactly


def test_parse_skips_blank_and_comment_lines():
    text = "# a comment\n\n" + TINY.replace("\nvit.s0", "\n  # the encoder\n\nvit.s0")
    assert parse_schedule(text) == parse_schedule(TINY)


def test_a_stage_without_actions_round_trips():
    schedule = Schedule.skeleton("1f1b", 1, (unit("llm", "backbone", 2),))
    text = schedule_text(schedule)
    assert text.splitlines()[-2:] == ["llm.s0:", "llm.s1:"]
    assert parse_schedule(text) == schedule


def _replace_line(text: str, number: int, new: str) -> str:
    lines = text.splitlines()
    lines[number - 1] = new
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("number,line,message", [
    (1, "schedule 1f1b", "expected 'schedule NAME microbatches=M'"),
    (1, "schedule zb microbatches=2", "unknown schedule 'zb'"),
    (1, "schedule 1f1b microbatches=0", "at least 1"),
    (2, "unit vit encoder tp=1", "expected 'unit NAME ROLE"),
    (2, "unit vit decoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2",
     "expected 'unit NAME ROLE"),
    (2, "unit vit encoder tp=0 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2", "at least 1"),
    (2, "unit vit encoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=x layers=2", "float"),
    (2, "unit vit encoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2,2",
     "2 layer counts for 1 stages"),
    (2, "unit vit encoder tp=1 dp=1 pp=1 vpp=1 first_rank=0 share=1 layers=2,,2", "int"),
    (3, "unit vit backbone tp=1 dp=1 pp=1 vpp=1 first_rank=1 share=1 layers=4",
     r"unit vit again \(first on line 2\)"),
    (2, "unit enc backbone tp=1 dp=1 pp=1 vpp=1 first_rank=1 share=1 layers=4",
     r"line 3: a second backbone \(the first on line 2\)"),
    (4, "vit.s0 F0", "expected a stage line"),
    (4, "vat.s0: F0", "unknown unit 'vat'.*vit, llm"),
    (4, "vit.s1: F0", "vit has 1 stages"),
    (4, "llm.s0: F0", r"line 5: llm.s0 again \(first on line 4\)"),
    (5, "llm.s0: RECV_F0<vit.s0 F0 B0 SEND_B0<vit.s0", "written with '>'"),
    (5, "llm.s0: F0 G0", "not an action: 'G0'"),
    (5, "unit gen generator tp=1 dp=1 pp=1 vpp=1 first_rank=2 share=1 layers=2",
     "unit lines come before the stage lines"),
])
def test_malformed_schedule_text_names_the_line(number: int, line: str, message: str):
    """Line ``number`` of a valid text replaced by ``line``: the error names that line
    (or the one ``message`` names where the clash shows on a later line)."""
    expected = message if message.startswith("line ") else f"line {number}: .*{message}"
    with pytest.raises(ValueError, match=rf"^{expected}"):
        parse_schedule(_replace_line(TINY, number, line))


def test_line_numbers_count_comments_and_blank_lines():
    text = "# header\n\n" + TINY.replace("F1 SEND_F1>llm.s0", "F1 SEND_F1>>llm.s0")
    with pytest.raises(ValueError, match=r"^line 6: not an action: 'SEND_F1>>llm.s0'"):
        parse_schedule(text)


def test_whole_text_errors():
    with pytest.raises(ValueError, match="empty schedule text"):
        parse_schedule("# nothing\n\n")
    no_backbone = "\n".join(line for line in TINY.splitlines() if "llm" not in line.split()[:2]
                            and not line.startswith("llm"))
    with pytest.raises(ValueError, match="no backbone unit line"):
        parse_schedule(no_backbone)


# ---- constructors ----------------------------------------------------------------------------

def test_schedule_checks_its_shape():
    llm = unit("llm", "backbone", 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        Schedule.skeleton("zb", 2, (llm,))
    with pytest.raises(ValueError, match="at least 1"):
        Schedule.skeleton("1f1b", 0, (llm,))
    with pytest.raises(ValueError, match="duplicate unit names"):
        Schedule.skeleton("1f1b", 2, (llm, llm))
    with pytest.raises(ValueError, match="exactly one backbone"):
        Schedule.skeleton("1f1b", 2, (unit("vit", "encoder"),))
    with pytest.raises(ValueError, match="exactly one backbone"):
        Schedule.skeleton("1f1b", 2, (llm, unit("other", "backbone")))
    base = Schedule.skeleton("1f1b", 2, (llm,))
    with pytest.raises(ValueError, match="unknown unit"):
        base.with_stages((StageSchedule(unit="vit", stage=0),))
    with pytest.raises(ValueError, match="llm has 2 stages"):
        base.with_stages((StageSchedule(unit="llm", stage=2),))
    with pytest.raises(ValueError, match="appears twice"):
        base.with_stages((StageSchedule(unit="llm", stage=0),) * 2)


@pytest.mark.parametrize("kw,message", [
    (dict(name="my-unit"), "not an identifier"),
    (dict(role="decoder"), "unknown role"),
    (dict(dp=0), "at least 1"),
    (dict(vpp=0), "at least 1"),
    (dict(layers_per_stage=(1, 2, 3)), "3 layer counts for 2 stages"),
])
def test_schedule_unit_checks_its_fields(kw: dict, message: str):
    fields = dict(name="llm", role="backbone", tp=1, dp=1, pp=2) | kw
    with pytest.raises(ValueError, match=message):
        ScheduleUnit(**fields)


def test_ranks_follow_the_plan_grid():
    u = unit("llm", "backbone", 3, tp=2, dp=4, first_rank=10)
    assert [list(u.ranks(s)) for s in range(3)] == [list(range(10 + 8 * s, 18 + 8 * s))
                                                    for s in range(3)]


def test_skeleton_and_lookup():
    units = (unit("vit", "encoder", 2), unit("llm", "backbone", 3))
    base = Schedule.skeleton("1f1b", 4, units)
    assert [str(st.where) for st in base.stages] == ["vit.s0", "vit.s1", "llm.s0", "llm.s1",
                                                     "llm.s2"]
    assert base.stage("llm", 1) is base.stages[base.stage_index("llm", 1)]
    assert base.has_stage("llm", 2) and not base.has_stage("llm", 3)
    assert base.unit("vit") is units[0]
    assert base.num_actions == 0


# ---- topology --------------------------------------------------------------------------------

def test_producers_and_consumers_across_a_dag():
    s = Schedule.skeleton("interleaved", 4, (
        unit("vit", "encoder", 2), unit("aud", "encoder", 1),
        unit("llm", "backbone", 2, vpp=3),
        unit("sd", "generator", 2), unit("gen", "generator", 1)))
    assert s.producers("vit", 0) == ()
    assert s.producers("vit", 1) == (("vit", 0, 0),)
    assert s.consumers("vit", 1) == (("llm", 0, 0),)
    assert s.consumers("aud", 0) == (("llm", 0, 0),)
    assert s.producers("llm", 0) == (("vit", 1, 0), ("aud", 0, 0))
    # chunk c of stage s is virtual stage c * pp + s, and k feeds k + 1
    assert s.consumers("llm", 0, 0) == (("llm", 1, 0),)
    assert s.consumers("llm", 1, 0) == (("llm", 0, 1),)
    assert s.producers("llm", 0, 1) == (("llm", 1, 0),)
    assert s.producers("llm", 0, 2) == (("llm", 1, 1),)
    assert s.consumers("llm", 1, 2) == (("sd", 0, 0), ("gen", 0, 0))
    assert s.producers("sd", 0) == (("llm", 1, 2),)
    assert s.producers("gen", 0) == (("llm", 1, 2),)
    assert s.consumers("sd", 1) == ()
    assert s.consumers("gen", 0) == ()
