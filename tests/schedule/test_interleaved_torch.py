"""Interleaved 1F1B for any microbatch count: our lowered order against
torch.distributed.pipelining's ScheduleInterleaved1F1B (its own order, built by its own
class for every rank without a process group, converted into Schedule IR actions) and
against plain 1F1B on the same work, all simulated with ``dtdsl.sim.simulate`` and
uniform passes (a chunk takes a stage's time over vpp); and the peak of chunks in flight
at the first stage against ``dtdsl.cost.model.in_flight``."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from dtdsl.cost.model import in_flight
from dtdsl.ir.schedule import Action, ActionKind, Schedule, ScheduleUnit, StageSchedule
from dtdsl.schedule.lower import (
    GradientFlow,
    add_communication,
    add_optimizer,
    group_sizes,
    interleaved_order,
    lower_units,
)
from dtdsl.schedule.validate import validate
from dtdsl.sim.simulate import Durations, simulate
from dtdsl.train.memplan import in_flight_of

FORWARD_S, BACKWARD_S = 1.0, 2.0
# p in {2, 4, 8} with vpp 2, and some vpp 3 and 4; every M from 1 to 3p.
LAYOUTS = [(2, 2), (4, 2), (8, 2), (2, 3), (4, 3), (4, 4), (8, 4)]
CASES = [(p, v, m) for p, v in LAYOUTS for m in range(1, 3 * p + 1)]


def backbone(pp: int, vpp: int = 1) -> ScheduleUnit:
    return ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=pp, vpp=vpp)


def ours(name: str, m: int, *units: ScheduleUnit) -> Schedule:
    base = Schedule.skeleton(name, m, units)
    return lower_units(base, GradientFlow.everywhere(base))


@cache
def torch_order(pp: int, vpp: int, m: int) -> dict[int, list] | None:
    """torch's per-rank order (``pipeline_order``: actions and idle slots), or None where
    torch refuses ``m``. ScheduleInterleaved1F1B reads only the group size, the rank and
    the stage count of its stages to build the order of every rank: stand-ins suffice."""
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * vpp,
                              stage_index=c * pp, is_first=c == 0, is_last=False)
              for c in range(vpp)]
    try:
        return ScheduleInterleaved1F1B(stages, m).pipeline_order
    except ValueError as err:
        assert "multiple of the number of rounds" in str(err)
        return None


def torch_schedule(pp: int, vpp: int, m: int) -> Schedule:
    """torch's order as our Schedule: stage index k of rank s is chunk k // pp of our
    stage s; communication, SYNC and OPT added by our lowering's steps 2 and 3."""
    order = torch_order(pp, vpp, m)
    assert order is not None
    base = Schedule.skeleton("interleaved", m, (backbone(pp, vpp),))
    kinds = {_ComputationType.FORWARD: ActionKind.F, _ComputationType.FULL_BACKWARD: ActionKind.B}
    stages = []
    for s in range(pp):
        actions = []
        for a in order[s]:
            if a is None:        # an idle slot of torch's lock-step table
                continue
            assert a.stage_index % pp == s
            actions.append(Action(unit="llm", stage=s, kind=kinds[a.computation_type],
                                  microbatch=a.microbatch_index, chunk=a.stage_index // pp))
        stages.append(StageSchedule(unit="llm", stage=s, actions=tuple(actions)))
    flow = GradientFlow.everywhere(base)
    schedule = add_optimizer(add_communication(base.with_stages(tuple(stages))), flow)
    validate(schedule)
    return schedule


def seconds(schedule: Schedule, forward_s: float = FORWARD_S,
            backward_s: float = BACKWARD_S) -> float:
    return simulate(schedule, Durations.uniform(schedule, forward_s, backward_s)
                    ).iteration_time_s


def compute_passes(schedule: Schedule, stage: int) -> list[str]:
    return [a.format_local() for a in schedule.stage("llm", stage).actions if a.kind.is_compute]


def test_torch_accepts_exactly_the_counts_its_rounds_divide():
    # The stand-in stages reach torch's own check: M // pp rounds (one below pp) must
    # divide M. So the comparisons below cover both kinds of M.
    refused = {(p, m) for p, v in [(2, 2), (4, 2), (8, 2)] for m in range(1, 3 * p + 1)
               if torch_order(p, v, m) is None}
    assert refused == {(2, 5), (4, 9), (4, 11), (8, 17), (8, 19), (8, 21), (8, 23)}


@pytest.mark.parametrize("p,v,m", CASES)
def test_never_slower_than_1f1b_and_as_fast_as_torch(p: int, v: int, m: int):
    interleaved = seconds(ours("interleaved", m, backbone(p, v)))
    plain = seconds(ours("1f1b", m, backbone(p)))
    assert interleaved <= plain * (1 + 1e-9), (interleaved, plain)
    if torch_order(p, v, m) is not None:
        theirs = seconds(torch_schedule(p, v, m))
        assert interleaved == pytest.approx(theirs, rel=1e-9, abs=0)
    # The closed form the planner uses (dtdsl.planner.evaluate): a stage time of forward
    # and backward per microbatch, (pp - 1) / v of them extra, or pp microbatches' worth
    # below pp microbatches and (m - 1) / v extra.
    stage_s = FORWARD_S + BACKWARD_S
    assert interleaved == pytest.approx(stage_s * (max(m, p) + (min(m, p) - 1) / v),
                                        rel=1e-9, abs=0)


@pytest.mark.parametrize("p,v,m", [c for c in CASES if torch_order(*c) is not None])
def test_the_order_is_torchs_where_torch_accepts_m(p: int, v: int, m: int):
    mine, theirs = ours("interleaved", m, backbone(p, v)), torch_schedule(p, v, m)
    for s in range(p):
        assert compute_passes(mine, s) == compute_passes(theirs, s)


@pytest.mark.parametrize("forward_s,backward_s", [(1.0, 2.0), (2.0, 4.0), (1.0, 1.0)])
def test_the_cross_checks_case(forward_s: float, backward_s: float):
    # p 8, M 9 (not a multiple of p): Megatron's groups of 8 and a last group of 1 took
    # 98 time units at forward 2, backward 4 (more than 1F1B's 96); torch's one group of
    # 9 takes 75, and so does ours now.
    p, v, m = 8, 2, 9
    stage_s = forward_s + backward_s
    assert seconds(ours("interleaved", m, backbone(p, v)), forward_s, backward_s) == \
        pytest.approx(stage_s * 12.5)
    assert seconds(torch_schedule(p, v, m), forward_s, backward_s) == \
        pytest.approx(stage_s * 12.5)
    assert seconds(ours("1f1b", m, backbone(p)), forward_s, backward_s) == \
        pytest.approx(stage_s * 16)


# ---- chunks in flight --------------------------------------------------------------------------

@pytest.mark.parametrize("p,v,m", CASES)
def test_in_flight_is_the_first_stages_real_peak(p: int, v: int, m: int):
    schedule = ours("interleaved", m, backbone(p, v))
    count, layers = in_flight("interleaved", p * v * 3, p, v, p, m)
    assert int(count) == in_flight_of(schedule, "llm", 0)
    assert int(layers) == 3


@pytest.mark.parametrize("enc_pp", [0, 1])
@pytest.mark.parametrize("gen_pp", [1, 2, 3])
@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (2, 5), (4, 2), (4, 6), (4, 9), (4, 12)])
def test_in_flight_between_other_units(enc_pp: int, gen_pp: int, p: int, m: int):
    # A generator of depth D behind the backbone: one chunk more per stage of it, groups
    # of at least D microbatches where it is deeper than the backbone. Between other
    # units the lowering keeps Megatron's fixed groups where they are faster; those hold
    # fewer chunks (a first group of max(pp, D)), so in_flight is then an upper bound.
    units = ((ScheduleUnit(name="vit", role="encoder", tp=1, dp=1, pp=enc_pp),) if enc_pp
             else ()) + (backbone(p, 2), ScheduleUnit(name="sd", role="generator", tp=1, dp=1,
                                                      pp=gen_pp))
    schedule = ours("interleaved", m, *units)
    count, _ = in_flight("interleaved", p * 2, p, 2, p + gen_pp, m)
    real = in_flight_of(schedule, "llm", 0)
    fwd, _ = interleaved_order(m, 2, group_sizes(m, max(p, min(gen_pp, m))))
    kept = [p_ for p_ in compute_passes(schedule, 0) if p_.startswith("F")] == \
        [f"F{j}" + (f"c{c}" if c else "") for j, c in fwd]
    if kept:
        assert int(count) == real
    else:
        assert int(count) >= real
