"""Communication placed by the execution trace (``dtdsl.schedule.place``): interleaved
lowerings keep NCCL's rules (``validate_nccl``) over a grid of shapes, beside encoders and
generators up- and downstream, co-located modules and frozen ones; sends stay right after
the pass that produces them; 1F1B and GPipe lowerings are left as step 2 writes them."""

from __future__ import annotations

import pytest

from dtdsl.ir.schedule import ActionKind, Schedule, ScheduleUnit
from dtdsl.schedule.lower import (
    GradientFlow,
    add_communication,
    add_optimizer,
    lower_compute,
    lower_units,
)
from dtdsl.schedule.place import place_by_trace, trace_times, transfer_of
from dtdsl.schedule.validate import ScheduleError, validate_nccl

F, B = ActionKind.F, ActionKind.B


def unit(name: str, role: str, pp: int, vpp: int = 1) -> ScheduleUnit:
    return ScheduleUnit(name=name, role=role, tp=1, dp=1, pp=pp, vpp=vpp)


# Which units the backbone sits between and which of them run backward: every one; a
# frozen encoder (no B); a frozen encoder whose projector trains (its last stage only);
# a frozen backbone and encoder with a trainable generator (the generator's B only); the
# backbone alone, as it is with co-located encoders and generators (which run inside its
# first and last stages and add no rows); deeper units (an encoder of 3 stages, a
# generator of 4, which sets the backbone's microbatch groups where it is deeper).
SURROUNDINGS = ["all", "frozen_encoder", "projector_only", "generator_only", "colocated",
                "deep"]


def schedule_of(pp: int, v: int, m: int, around: str) -> tuple[Schedule, GradientFlow]:
    units = [unit("llm", "backbone", pp, v)]
    if around == "deep":
        units = [unit("vit", "encoder", 3), *units, unit("sd", "generator", 4)]
    elif around != "colocated":
        units = [unit("vit", "encoder", 2), *units, unit("sd", "generator", 2)]
    base = Schedule.skeleton("interleaved", m, tuple(units))
    every = GradientFlow.everywhere(base).backward
    drop = {"all": set(), "colocated": set(), "deep": set(),
            "frozen_encoder": {vs for vs in every if vs[0] == "vit"},
            "projector_only": {("vit", 0, 0)},
            "generator_only": {vs for vs in every if vs[0] != "sd"}}[around]
    backward = every - drop
    return base, GradientFlow(backward, backward)


def grid() -> list[tuple[int, int, int, str]]:
    """pp 2..8, v 2..4 and every microbatch count from 1 to 3 pp, the surroundings in
    turn (every one meets every pp and v)."""
    return [(pp, v, m, SURROUNDINGS[(pp + v + m) % len(SURROUNDINGS)])
            for pp in range(2, 9) for v in (2, 3, 4) for m in range(1, 3 * pp + 1)]


@pytest.mark.parametrize("pp,v,m,around", grid())
def test_interleaved_lowerings_keep_nccls_rules(pp: int, v: int, m: int, around: str):
    base, flow = schedule_of(pp, v, m, around)
    schedule = lower_units(base, flow)      # phases 1-3
    validate_nccl(schedule)
    # Each send right after the pass that produces it: nothing but sends and receives
    # between them.
    for st in schedule.stages:
        last_pass = None
        for a in st.actions:
            if a.kind is F or a.kind is B:
                last_pass = a
            elif a.kind.is_send:
                assert last_pass is not None and (last_pass.kind, last_pass.chunk,
                                                  last_pass.microbatch) == \
                    (a.kind.direction, a.chunk, a.microbatch), a.format()


def test_the_placement_is_what_makes_them_safe():
    # The same orders with step 2's placement alone deadlock under NCCL's rules in many
    # shapes of the grid (35 of the 81 with pp up to 4): the test above is not passed by
    # the orders themselves.
    hung = 0
    cases = [c for c in grid() if c[0] <= 4]
    for pp, v, m, around in cases:
        base, flow = schedule_of(pp, v, m, around)
        try:
            validate_nccl(add_optimizer(add_communication(lower_compute(base, flow)), flow))
        except ScheduleError:
            hung += 1
    assert hung > len(cases) // 4


def test_receives_go_where_their_sends_are_due():
    # pp 2, v 2, M 4: llm.s1 forwards F0, F1 then F0c1, which reads llm.s0's F0c1; that
    # send is due once llm.s0 has run F0, F1 and F0c1 (at 3 in forward times), so llm.s1
    # posts the receive of F0c1 before the first of its passes that starts at 3 or later.
    base = Schedule.skeleton("interleaved", 4, (unit("llm", "backbone", 2, 2),))
    flow = GradientFlow.everywhere(base)
    plain = add_communication(lower_compute(base, flow))
    starts, sent = trace_times(plain)
    placed = place_by_trace(plain)
    s1 = placed.stage("llm", 1).actions
    recv = next(k for k, a in enumerate(s1) if a.kind is ActionKind.RECV_F and a.chunk == 1
                and a.microbatch == 0)
    t = sent[transfer_of(s1[recv])]
    passes = [a for a in s1 if a.kind is F or a.kind is B]
    first_due = next(k for k, s in enumerate(starts[1]) if s >= t)
    following = next(a for a in s1[recv:] if a.kind is F or a.kind is B)
    assert following == passes[first_due]
    # Placement moves sends and receives only: the passes stay in their order.
    assert [a for a in s1 if not a.kind.is_comm] == \
        [a for a in plain.stage("llm", 1).actions if not a.kind.is_comm]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_schedules_without_chunks_keep_step_twos_placement(name: str):
    units = (unit("vit", "encoder", 2), unit("llm", "backbone", 3), unit("sd", "generator", 1))
    base = Schedule.skeleton(name, 5, units)
    flow = GradientFlow.everywhere(base)
    assert lower_units(base, flow) == \
        add_optimizer(add_communication(lower_compute(base, flow)), flow)


@pytest.mark.parametrize("pp,v,m,around", [(2, 2, 4, "all"), (4, 2, 9, "deep"),
                                           (3, 3, 7, "frozen_encoder")])
def test_the_placement_costs_no_simulated_time(pp: int, v: int, m: int, around: str):
    # The simulator, like the runtime, waits for a receive only at the pass that reads it,
    # and sends stay right after their passes: the placed schedule takes exactly the time
    # of step 2's placement, whatever each pass and link takes.
    import numpy as np

    from dtdsl.sim.simulate import Durations, simulate

    base, flow = schedule_of(pp, v, m, around)
    placed = lower_units(base, flow)
    unplaced = add_optimizer(add_communication(lower_compute(base, flow)), flow)
    assert placed != unplaced
    rng = np.random.default_rng(pp * 100 + m)
    names = [u.name for u in base.units]
    d = Durations(compute_s={u.name: rng.uniform(0.1, 2.0, size=(2, u.pp, u.vpp, m, u.dp))
                             for u in base.units},
                  link_s={(a, b): float(rng.uniform(0, 0.3)) for a in names for b in names})
    assert simulate(placed, d).iteration_time_s == \
        pytest.approx(simulate(unplaced, d).iteration_time_s, rel=1e-12)
