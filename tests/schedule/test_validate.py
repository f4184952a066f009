"""The schedule validator: every check fires on a valid schedule broken by removing,
moving, swapping or duplicating actions, names the problem, and marks the bad action
``[unit.sN:ACTION]!`` (or the stage's row ``[unit.sN]!``) in the grid it prints."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from dtdsl.ir.schedule import (
    Action,
    Schedule,
    ScheduleUnit,
    StageSchedule,
    parse_action,
    parse_schedule,
    schedule_text,
)
from dtdsl.schedule.lower import (
    GradientFlow,
    add_communication,
    add_optimizer,
    lower_compute,
    lower_units,
)
from dtdsl.schedule.validate import ScheduleError, format_grid, validate

UNITS = (ScheduleUnit(name="vit", role="encoder", tp=1, dp=1, pp=1),
         ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=2))


def lowered(m: int = 4, flow: Callable[[Schedule], GradientFlow] = GradientFlow.everywhere
            ) -> Schedule:
    base = Schedule.skeleton("1f1b", m, UNITS)
    return lower_units(base, flow(base))


# vit.s0: F0 SEND_F0>llm.s0 F1 SEND_F1>llm.s0 F2 SEND_F2>llm.s0 RECV_B0<llm.s0 B0 F3
#         SEND_F3>llm.s0 RECV_B1<llm.s0 B1 RECV_B2<llm.s0 B2 RECV_B3<llm.s0 B3 SYNC OPT
# llm.s0: RECV_F0<vit.s0 F0 SEND_F0>llm.s1 RECV_F1<vit.s0 F1 SEND_F1>llm.s1 RECV_B0<llm.s1 B0
#         SEND_B0>vit.s0 RECV_F2<vit.s0 F2 SEND_F2>llm.s1 RECV_B1<llm.s1 B1 SEND_B1>vit.s0
#         RECV_F3<vit.s0 F3 SEND_F3>llm.s1 RECV_B2<llm.s1 B2 SEND_B2>vit.s0 RECV_B3<llm.s1 B3
#         SEND_B3>vit.s0 SYNC OPT
# llm.s1: RECV_F0<llm.s0 F0 B0 SEND_B0>llm.s0 RECV_F1<llm.s0 F1 B1 SEND_B1>llm.s0
#         RECV_F2<llm.s0 F2 B2 SEND_B2>llm.s0 RECV_F3<llm.s0 F3 B3 SEND_B3>llm.s0 SYNC OPT
VALID = lowered()

Edit = Callable[[list[str]], list[str]]


def edit(row: str, *edits: Edit, schedule: Schedule = VALID) -> Schedule:
    """``schedule`` with the action tokens of ``row`` (``llm.s1``) rewritten by ``edits``."""
    lines = schedule_text(schedule).splitlines()
    for n, line in enumerate(lines):
        if line.split(":")[0] == row:
            tokens = line.split()[1:]
            for e in edits:
                tokens = e(tokens)
            lines[n] = " ".join([f"{row}:", *tokens])
    return parse_schedule("\n".join(lines) + "\n")


def remove(token: str) -> Edit:
    def apply(tokens: list[str]) -> list[str]:
        assert token in tokens, token
        return [t for t in tokens if t != token]
    return apply


def move(token: str, *, before: str) -> Edit:
    def apply(tokens: list[str]) -> list[str]:
        tokens = remove(token)(tokens)
        k = tokens.index(before)
        return tokens[:k] + [token] + tokens[k:]
    return apply


def swap(a: str, b: str) -> Edit:
    def apply(tokens: list[str]) -> list[str]:
        i, j = tokens.index(a), tokens.index(b)
        tokens = list(tokens)
        tokens[i], tokens[j] = b, a
        return tokens
    return apply


def duplicate(token: str) -> Edit:
    def apply(tokens: list[str]) -> list[str]:
        k = tokens.index(token)
        return tokens[:k + 1] + [token] + tokens[k + 1:]
    return apply


def replace(a: str, b: str) -> Edit:
    def apply(tokens: list[str]) -> list[str]:
        assert a in tokens, a
        return [b if t == a else t for t in tokens]
    return apply


def invalid(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return info.value


def assert_flags(err: ScheduleError, problem: str, *marked: str) -> None:
    """One of ``err``'s problems contains ``problem``, the text shows it, and each of
    ``marked`` is marked in the grid."""
    assert any(problem in p for p in err.problems), err.problems
    text = str(err)
    assert problem in text
    for mark in marked:
        assert f"[{mark}]!" in text, f"{mark} is not marked in\n{text}"


def test_lowered_schedules_are_valid():
    validate(VALID)
    validate(lowered(m=1))
    validate(lowered(m=9))


# ---- phase 1: each stage alone ---------------------------------------------------------------

def test_missing_receive():
    err = invalid(edit("llm.s1", remove("RECV_F2<llm.s0")))
    assert_flags(err, "llm.s1:F2 runs without receiving its input from llm.s0", "llm.s1:F2")


def test_backward_before_forward():
    err = invalid(edit("llm.s1", move("B2", before="RECV_F2<llm.s0")))
    assert_flags(err, "llm.s1:B2 comes before its forward F2", "llm.s1:B2")


def test_receive_after_its_forward():
    err = invalid(edit("llm.s1", swap("RECV_F1<llm.s0", "F1")))
    assert_flags(err, "llm.s1:RECV_F1<llm.s0 arrives after the forward that reads it",
                 "llm.s1:RECV_F1<llm.s0")
    assert_flags(err, "llm.s1:F1 runs without receiving its input", "llm.s1:F1")


def test_gradient_received_after_its_backward():
    err = invalid(edit("llm.s0", swap("RECV_B1<llm.s1", "B1")))
    assert_flags(err, "llm.s0:RECV_B1<llm.s1 arrives after the backward that reads it",
                 "llm.s0:RECV_B1<llm.s1")


@pytest.mark.parametrize("row,a,b,message", [
    ("llm.s0", "F0", "SEND_F0>llm.s1", "sends before the forward that produces it"),
    ("llm.s1", "B0", "SEND_B0>llm.s0", "sends before the backward that produces it"),
])
def test_send_before_the_pass_that_produces_it(row: str, a: str, b: str, message: str):
    err = invalid(edit(row, swap(a, b)))
    assert_flags(err, f"{row}:{b} {message}", f"{row}:{b}")


def test_sync_before_the_last_backward():
    err = invalid(edit("llm.s1", move("SYNC", before="B3")))
    assert_flags(err, "llm.s1:SYNC before the stage's last backward", "llm.s1:SYNC")


def test_forward_after_sync():
    err = invalid(edit("vit.s0", move("SYNC", before="F3"), move("OPT", before="F3")))
    assert_flags(err, "vit.s0:F3 runs after the stage's SYNC", "vit.s0:F3")
    assert_flags(err, "vit.s0:SYNC before the stage's last backward", "vit.s0:SYNC")


def test_optimizer_step_order():
    err = invalid(edit("llm.s0", swap("SYNC", "OPT")))
    assert_flags(err, "llm.s0:OPT before the stage's SYNC", "llm.s0:OPT")
    err = invalid(edit("llm.s0", remove("OPT")))
    assert_flags(err, "llm.s0:SYNC without an OPT after it", "llm.s0:SYNC")


@pytest.mark.parametrize("row,token", [("llm.s1", "F2"), ("llm.s1", "B2"),
                                       ("vit.s0", "SYNC"), ("vit.s0", "OPT")])
def test_a_pass_twice(row: str, token: str):
    err = invalid(edit(row, duplicate(token)))
    assert_flags(err, f"{row}:{token} appears twice", f"{row}:{token}")


def test_sync_on_a_stage_without_backward():
    def frozen_vit(base: Schedule) -> GradientFlow:
        every = GradientFlow.everywhere(base)
        return GradientFlow(every.trains - {("vit", 0, 0)}, every.backward - {("vit", 0, 0)})

    schedule = lowered(flow=frozen_vit)
    assert "B0" not in schedule_text(schedule).splitlines()[3]
    err = invalid(edit("vit.s0", lambda tokens: [*tokens, "SYNC", "OPT"], schedule=schedule))
    assert_flags(err, "vit.s0:SYNC on a stage that runs no backward", "vit.s0:SYNC")


def test_missing_forward_marks_the_row():
    err = invalid(edit("llm.s1", remove("RECV_F3<llm.s0"), remove("F3"), remove("B3"),
                       remove("SEND_B3>llm.s0")))
    assert_flags(err, "llm.s1 never runs the forward of microbatch 3", "llm.s1")
    assert_flags(err, "llm.s1 runs backwards of chunk 0 for some microbatches but not for 3")
    err = invalid(edit("llm.s1", *(remove(f"F{j}") for j in (0, 1, 3))))
    assert_flags(err, "llm.s1 never runs the forward of microbatches 0..1, 3", "llm.s1")


def test_gradient_received_for_a_backward_the_stage_does_not_run():
    err = invalid(edit("llm.s0", remove("B2")))
    assert_flags(err, "llm.s0:RECV_B2<llm.s1: gradients received but the stage runs no "
                 "backward of that microbatch", "llm.s0:RECV_B2<llm.s1")
    assert_flags(err, "llm.s0:SEND_B2>vit.s0 sends before the backward that produces it",
                 "llm.s0:SEND_B2>vit.s0")
    assert_flags(err, "llm.s0 runs backwards of chunk 0 for some microbatches but not for 2",
                 "llm.s0")


@pytest.mark.parametrize("row,old,new,message", [
    ("llm.s1", "F2", "F7", "llm.s1:F7: microbatch out of range (the schedule has 4)"),
    ("llm.s1", "B2", "B2c1", "llm.s1:B2c1: chunk out of range (llm has vpp 1)"),
    ("llm.s0", "SEND_F0>llm.s1", "SEND_F0>llm.s5", "llm.s0:SEND_F0>llm.s5: no such peer"),
    ("llm.s0", "SEND_F0>llm.s1", "SEND_F0>llm.s1c1", "SEND_F0>llm.s1c1: no such peer"),
    ("llm.s0", "SEND_F0>llm.s1", "SEND_F0>vit.s0",
     "llm.s0:SEND_F0>vit.s0: the peer is not one of chunk 0's consumers (llm.s1c0)"),
    ("llm.s0", "RECV_F0<vit.s0", "RECV_F0<llm.s1",
     "llm.s0:RECV_F0<llm.s1: the peer is not one of chunk 0's producers (vit.s0c0)"),
    ("vit.s0", "RECV_B0<llm.s0", "RECV_B0<llm.s1",
     "vit.s0:RECV_B0<llm.s1: the peer is not one of chunk 0's consumers (llm.s0c0)"),
])
def test_actions_out_of_range(row: str, old: str, new: str, message: str):
    err = invalid(edit(row, replace(old, new)))
    assert_flags(err, message, f"{row}:{new}")


def test_action_in_another_stages_row():
    stray = Action(unit="llm", stage=0, kind="F", microbatch=0)
    rows = tuple(StageSchedule(unit=st.unit, stage=st.stage,
                               actions=st.actions + ((stray,) if st.stage == 1 else ()))
                 for st in VALID.stages)
    err = invalid(VALID.with_stages(rows))
    assert_flags(err, "llm.s0:F0 is in the row of llm.s1", "llm.s0:F0")


def test_missing_row():
    err = invalid(VALID.with_stages(VALID.stages[:2]))
    assert_flags(err, "llm.s1 has no row: every stage of llm (pp 2) needs one")


# ---- phase 2: pairing ------------------------------------------------------------------------

def test_send_without_receive():
    err = invalid(edit("vit.s0", remove("RECV_B1<llm.s0")))
    assert_flags(err, "llm.s0:SEND_B1>vit.s0 has no matching receive vit.s0:RECV_B1<llm.s0",
                 "llm.s0:SEND_B1>vit.s0")


def test_receive_without_send():
    err = invalid(edit("llm.s0", remove("SEND_F1>llm.s1")))
    assert_flags(err, "llm.s1:RECV_F1<llm.s0 has no matching send llm.s0:SEND_F1>llm.s1",
                 "llm.s1:RECV_F1<llm.s0")


def test_a_send_twice():
    err = invalid(edit("llm.s0", duplicate("SEND_F1>llm.s1")))
    assert_flags(err, "llm.s0:SEND_F1>llm.s1 appears twice", "llm.s0:SEND_F1>llm.s1")
    err = invalid(edit("llm.s1", duplicate("RECV_F1<llm.s0")))
    assert_flags(err, "llm.s1:RECV_F1<llm.s0 appears twice", "llm.s1:RECV_F1<llm.s0")


def test_pairing_runs_only_on_stages_that_pass_phase_one():
    err = invalid(edit("llm.s1", remove("RECV_F2<llm.s0"), remove("B1")))
    assert not any("matching" in p for p in err.problems)


# ---- phase 3: deadlock -----------------------------------------------------------------------

def test_swapped_receives_deadlock():
    # The last stage takes microbatch 2 first: it waits for activations that its
    # predecessor sends only after the gradient of microbatch 0, which the last stage
    # has not computed yet. Every stage's own order is fine.
    def swap_microbatches(tokens: list[str]) -> list[str]:
        swapped = {0: 2, 2: 0}
        out = []
        for token in tokens:
            a = parse_action(f"llm.s1:{token}")
            if a.microbatch in swapped:
                a = dataclasses.replace(a, microbatch=swapped[a.microbatch])
            out.append(a.format_local())
        return out

    broken = edit("llm.s1", swap_microbatches)
    row = schedule_text(broken).splitlines()[-1]
    assert row.startswith("llm.s1: RECV_F2<llm.s0 F2 B2 SEND_B2>llm.s0 RECV_F1<llm.s0 F1")
    err = invalid(broken)
    assert err.problems[0].startswith("deadlock: no stage can go on")
    assert_flags(err, "llm.s1:RECV_F2<llm.s0 waits for llm.s0:SEND_F2>llm.s1, which llm.s0 "
                 "has not reached", "llm.s1:RECV_F2<llm.s0")
    assert_flags(err, "llm.s0:RECV_B0<llm.s1 waits for llm.s1:SEND_B0>llm.s0",
                 "llm.s0:RECV_B0<llm.s1")
    assert_flags(err, "vit.s0:RECV_B0<llm.s0 waits for llm.s0:SEND_B0>vit.s0",
                 "vit.s0:RECV_B0<llm.s0")
    assert len(err.marks) == 3


def test_receive_hoisted_before_the_send_it_depends_on_deadlocks():
    # The encoder waits for gradient 0 before it sends activation 0.
    err = invalid(edit("vit.s0", move("RECV_B0<llm.s0", before="F0")))
    assert_flags(err, "vit.s0:RECV_B0<llm.s0 waits for llm.s0:SEND_B0>vit.s0",
                 "vit.s0:RECV_B0<llm.s0")
    assert_flags(err, "llm.s0:RECV_F0<vit.s0 waits for vit.s0:SEND_F0>llm.s0, which vit.s0 "
                 "has not reached (it is stuck at slot 0)", "llm.s0:RECV_F0<vit.s0")


def test_a_schedule_that_only_waits_is_not_a_deadlock():
    # Receives moved as early as they may go: slower, but every wait ends.
    validate(edit("llm.s1", move("RECV_F1<llm.s0", before="F0"),
                  move("RECV_F2<llm.s0", before="F1")))


# ---- the error's text ------------------------------------------------------------------------

def test_the_error_prints_the_whole_grid():
    err = invalid(edit("llm.s1", remove("RECV_F2<llm.s0")))
    text = str(err)
    assert text.startswith("invalid schedule:\n  llm.s1:F2 runs without receiving")
    grid = text.split("\n\n", 1)[1]
    assert grid == format_grid(err.schedule, err.marks)
    lines = grid.splitlines()
    assert lines[0].split()[:3] == ["slot", "0", "1"]
    assert [line.split()[0] for line in lines[1:]] == ["vit.s0", "llm.s0", "llm.s1"]
    assert lines[3].split()[1:4] == ["RECV_F0<llm.s0", "F0", "B0"]
    assert err.marks == {(2, 8)}
    assert lines[3].split()[9] == "[llm.s1:F2]!"


def test_grid_columns_line_up():
    lines = format_grid(VALID, {(0, 2), (2, 0)}).splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    assert len(starts) == 1 + max(len(st.actions) for st in VALID.stages)
    for line, st in zip(lines[1:], VALID.stages, strict=True):
        cells = [m.start() for m in re.finditer(r"\S+", line)]
        assert cells == starts[:1 + len(st.actions)]
    assert lines[1].split()[3] == "[vit.s0:F1]!"
    assert lines[3].split()[1] == "[llm.s1:RECV_F0<llm.s0]!"


def test_many_problems_are_cut_short():
    m = 16
    schedule = lowered(m=m)
    err = invalid(edit("llm.s1", *(remove(f"RECV_F{j}<llm.s0") for j in range(m)),
                       schedule=schedule))
    assert len(err.problems) == m
    text = str(err)
    assert "llm.s1:F11 runs without" in text and "llm.s1:F12 runs without" not in text
    assert f"... and {m - 12} more" in text
    assert len(err.marks) == m


# ---- phase 4: NCCL's rules (what runs on GPUs) -------------------------------------------------

def test_every_1f1b_and_gpipe_lowering_keeps_nccls_rules():
    from dtdsl.schedule.validate import validate_nccl

    for name in ("1f1b", "gpipe"):
        for pp in (1, 2, 3, 4):
            for m in (1, 2, 4, 5, 8):
                units = (ScheduleUnit(name="vit", role="encoder", tp=1, dp=1, pp=2),
                         ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=pp),
                         ScheduleUnit(name="gen", role="generator", tp=1, dp=1, pp=1))
                base = Schedule.skeleton(name, m, units)
                validate_nccl(lower_units(base, GradientFlow.everywhere(base)))


def test_sends_that_wait_for_each_others_receives_hang_under_nccl():
    from dtdsl.schedule.validate import validate_nccl

    # The interleaved order (pp 2, 2 virtual stages) with every receive just before the
    # pass that reads it and every send just after the pass that produces it (the
    # lowering's step 2 alone, without schedule.place) passes phases 1-3: every receive's
    # send is reached. On GPUs, llm.s0 sends gradient 0 of chunk 1 in a group of its own
    # before the group that receives llm.s1's gradient 1 of chunk 1, and llm.s1 sends that
    # gradient before the group that receives gradient 0: each send waits for a receive
    # queued behind the other's send on one stream.
    units = (ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=2, vpp=2),)
    base = Schedule.skeleton("interleaved", 4, units)
    flow = GradientFlow.everywhere(base)
    schedule = add_optimizer(add_communication(lower_compute(base, flow)), flow)
    validate(schedule)
    with pytest.raises(ScheduleError) as info:
        validate_nccl(schedule)
    err = info.value
    assert err.problems[0].startswith("deadlock under NCCL's rules")
    assert_flags(err, "llm.s0:SEND_B0c1>llm.s1 waits for llm.s1:RECV_B0<llm.s0c1, whose "
                 "group llm.s1 has not started", "llm.s0:SEND_B0c1>llm.s1")
    assert_flags(err, "llm.s1:SEND_B1c1>llm.s0c1 waits for llm.s0:RECV_B1c1<llm.s1c1",
                 "llm.s1:SEND_B1c1>llm.s0c1")
