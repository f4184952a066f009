"""The zero_bubble schedule (ZB-H1, Qi et al. 2023): the W action's text form, the
lowering's order (every W after its B, stage s deferring s of them, at most the first
stage's microbatches in flight anywhere), the validator's rules for W, and the bubble the
simulator measures against 1F1B's: F + B - W per stage boundary instead of F + B + W."""

from __future__ import annotations

import numpy as np
import pytest

from dtdsl.ir.schedule import Action, ActionKind, Schedule, StageSchedule, parse_action
from dtdsl.schedule.lower import LoweringError, gradient_flow, lower_units, split_weights
from dtdsl.schedule.validate import ScheduleError, validate, validate_nccl
from dtdsl.sim.simulate import Durations, simulate
from tests.helpers.schedules import frozen_program, lowered, passes, unit

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def test_w_round_trips_through_its_text_form():
    for text in ("llm.s1:W3", "llm.s0:W12c1"):
        assert parse_action(text).format() == text
    a = parse_action("llm.s2:W5")
    assert (a.kind, a.microbatch, a.chunk, a.peer) == (W, 5, 0, None)
    assert a.kind.is_compute and not a.kind.is_comm and a.kind.direction is None
    with pytest.raises(ValueError, match="takes no peer"):
        parse_action("llm.s0:W3>llm.s1")
    with pytest.raises(ValueError, match="needs a microbatch"):
        Action(unit="llm", stage=0, kind=W)


def test_split_weights_defers_the_oldest_w():
    order = [(F, 0, 0), (F, 1, 0), (B, 0, 0), (F, 2, 0), (B, 1, 0), (B, 2, 0)]
    assert split_weights(order, 0) == [
        (F, 0, 0), (F, 1, 0), (B, 0, 0), (W, 0, 0), (F, 2, 0), (B, 1, 0), (W, 1, 0),
        (B, 2, 0), (W, 2, 0)]
    assert split_weights(order, 1) == [
        (F, 0, 0), (F, 1, 0), (B, 0, 0), (F, 2, 0), (B, 1, 0), (W, 0, 0), (B, 2, 0),
        (W, 1, 0), (W, 2, 0)]
    # Deferring more than there are backwards: every W after the last pass.
    assert split_weights(order, 5)[-3:] == [(W, 0, 0), (W, 1, 0), (W, 2, 0)]


def _in_flight(order: list[str]) -> int:
    """The most microbatches forwarded whose weight gradients have not run yet (whose
    backward has not, without Ws)."""
    done = "W" if any(p[0] == "W" for p in order) else "B"
    held = most = 0
    for p in order:
        held += {"F": 1, done: -1}.get(p[0], 0)
        most = max(most, held)
    return most


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 16), (4, 8), (4, 3)])
def test_zb_h1_order_of_one_unit(pp: int, m: int):
    zb = lowered("zero_bubble", m, unit("llm", "backbone", pp))
    plain = lowered("1f1b", m, unit("llm", "backbone", pp))
    validate_nccl(zb)
    for s in range(pp):
        order = passes(zb, "llm", s)
        # The forwards and backwards in 1F1B's order, each backward's W after it.
        assert [p for p in order if p[0] != "W"] == passes(plain, "llm", s)
        assert sorted(int(p[1:]) for p in order if p[0] == "W") == list(range(m))
        for j in range(m):
            assert order.index(f"B{j}") < order.index(f"W{j}")
        # Stage s defers s Ws (torch's ZB orders: rank s starts its Ws s backwards late)...
        first_w = order.index("W0")
        assert sum(p[0] == "B" for p in order[:first_w]) == min(s, m - 1) + 1
        # ...so that no stage holds more microbatches than 1F1B's first stage does.
        assert _in_flight(order) <= min(pp, m)
    assert _in_flight(passes(zb, "llm", 0)) == _in_flight(passes(plain, "llm", 0))


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 16), (4, 8), (8, 16)])
@pytest.mark.parametrize("wgt", [0.6, 0.9, 1.0, 1.2])
def test_zb_h1_bubble_is_f_plus_b_minus_w(pp: int, m: int, wgt: float):
    """F 1, backward 2 of which W ``wgt``: 1F1B's pp - 1 bubbles take F + B + W = 3 each,
    ZB-H1's F + B - W (Qi et al.'s figure), never less than F (the chain of forwards)."""
    times = {}
    for name in ("1f1b", "zero_bubble"):
        schedule = lowered(name, m, unit("llm", "backbone", pp))
        times[name] = simulate(schedule, Durations.uniform(schedule, 1.0, 2.0,
                                                           weight_s=wgt)).iteration_time_s
    assert times["1f1b"] == pytest.approx(3 * m + 3 * (pp - 1))
    b = 2.0 - wgt
    assert times["zero_bubble"] == pytest.approx(3 * m + (pp - 1) * max(1 + b - wgt, 1.0))


def test_without_weight_seconds_a_split_backward_takes_what_a_whole_one_does():
    zb = lowered("zero_bubble", 8, unit("llm", "backbone", 4))
    plain = lowered("1f1b", 8, unit("llm", "backbone", 4))
    t = {s.name: simulate(s, Durations.uniform(s, 1.0, 2.0)).iteration_time_s
         for s in (zb, plain)}
    assert t["zero_bubble"] == t["1f1b"]
    result = simulate(zb, Durations.uniform(zb, 1.0, 2.0, weight_s=0.9))
    events = result.timeline().events
    w = [e for e in events if e.kind == "W"]
    b = [e for e in events if e.kind == "B"]
    assert len(w) == len(b) == 4 * 8
    assert {round(e.duration_s, 9) for e in w} == {0.9}
    assert {round(e.duration_s, 9) for e in b} == {1.1}


def test_a_composite_pipeline_splits_only_stages_that_train():
    """Encoders, backbone and generators under zero_bubble: NCCL-safe; a frozen encoder
    runs no backward and so no W; a frozen backbone passes gradients on (B) with no W."""
    units = (unit("vit", "encoder", 2), unit("beats", "encoder", 1),
             unit("llm", "backbone", 2), unit("sd", "generator", 2),
             unit("audiogen", "generator", 1))
    base = Schedule.skeleton("zero_bubble", 6, units)
    schedule = lower_units(base, gradient_flow(base, frozen_program("vit", "vit_to_llm",
                                                                    "llm")))
    validate_nccl(schedule)

    def has(unit_name: str, stage: int, kind: ActionKind) -> bool:
        return any(a.kind is kind for a in schedule.stage(unit_name, stage).actions)

    assert not has("vit", 0, B) and not has("vit", 0, W)
    assert has("llm", 1, B) and not has("llm", 1, W)
    for name, stages in (("beats", 1), ("sd", 2), ("audiogen", 1)):
        for s in range(stages):
            assert has(name, s, W)


@pytest.mark.parametrize("shape", [(1, 2, 1, 4), (2, 3, 2, 8), (3, 2, 1, 5), (1, 4, 3, 6),
                                   (2, 1, 2, 3)])
def test_transfers_group_as_in_1f1b(shape: tuple[int, int, int, int]):
    """An encoder, a backbone and a generator of these depths (and M): the Ws sit between
    the transfers and passes, never inside a run of transfers, so each stage's NCCL groups
    are 1F1B's and the schedule is free of deadlock on GPUs."""
    enc, llm, gen, m = shape
    units = (unit("vit", "encoder", enc), unit("llm", "backbone", llm),
             unit("sd", "generator", gen))
    zb, plain = lowered("zero_bubble", m, *units), lowered("1f1b", m, *units)
    validate_nccl(zb)
    for a, b in zip(zb.stages, plain.stages, strict=True):
        assert [x for x in a.actions if x.kind is not W] == list(b.actions)


def test_zero_bubble_has_no_model_chunks():
    with pytest.raises(LoweringError, match="zero_bubble"):
        lowered("zero_bubble", 4, unit("llm", "backbone", 2, vpp=2))


def _with_row(schedule: Schedule, stage: int, actions: list[str]) -> Schedule:
    row = tuple(parse_action(f"llm.s{stage}:{t}") for t in actions)
    stages = tuple(StageSchedule(unit="llm", stage=st.stage, actions=row)
                   if st.stage == stage else st for st in schedule.stages)
    return schedule.with_stages(stages)


@pytest.mark.parametrize("row,problem", [
    (["F0", "W0", "B0", "F1", "B1", "W1", "SYNC", "OPT"], "W0 comes before its backward B0"),
    (["F0", "B0", "W0", "W0", "F1", "B1", "W1", "SYNC", "OPT"], "W0 appears twice"),
    (["F0", "B0", "W0", "F1", "B1", "SYNC", "OPT"], "not off 1"),
    (["F0", "B0", "W0", "F1", "B1", "SYNC", "W1", "OPT"], "SYNC before the stage's last weight"),
])
def test_the_validator_checks_w(row: list[str], problem: str):
    schedule = lowered("zero_bubble", 2, unit("llm", "backbone", 1))
    validate(schedule)
    with pytest.raises(ScheduleError, match=problem):
        validate(_with_row(schedule, 0, row))


def test_w_belongs_to_the_zero_bubble_schedule():
    schedule = lowered("1f1b", 2, unit("llm", "backbone", 1))
    with pytest.raises(ScheduleError, match="zero_bubble schedule's, not 1f1b's"):
        validate(_with_row(schedule, 0, ["F0", "B0", "W0", "F1", "B1", "W1", "SYNC", "OPT"]))


def test_weight_seconds_are_part_of_the_backward():
    schedule = lowered("zero_bubble", 4, unit("llm", "backbone", 2))
    d = Durations.uniform(schedule, 1.0, 2.0)
    with pytest.raises(ValueError, match="exceeds the backward"):
        simulate(schedule, Durations(compute_s=d.compute_s,
                                     weight_s={"llm": np.full((2, 1, 4, 1), 2.5)}))
    with pytest.raises(ValueError, match="weight_s\\['llm'\\] has shape"):
        simulate(schedule, Durations(compute_s=d.compute_s,
                                     weight_s={"llm": np.full((2, 4, 1), 1.0)}))
    # A 1F1B schedule runs whole backwards: its weight seconds change nothing.
    plain = lowered("1f1b", 4, unit("llm", "backbone", 2))
    assert simulate(plain, Durations.uniform(plain, 1.0, 2.0, weight_s=1.0)) \
        .iteration_time_s == simulate(plain, Durations.uniform(plain, 1.0, 2.0)).iteration_time_s
