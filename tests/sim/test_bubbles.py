"""Phased encoders in the pipeline's bubbles (issue 27's stretch): the assignment of
microbatch steps to backbone stages (``reorder.split.bubble_owners``), the simulator's
events and dependencies, and the routing that follows it on drawn batches."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.planner import plan
from dtdsl.reorder.split import bubble_exposure, bubble_owners, one_f_one_b_times
from dtdsl.reorder.workload import WorkModel, batch_samples, phase_fit, route
from dtdsl.schedule.lower import GradientFlow, lower, lower_units
from dtdsl.sim.simulate import Durations, Simulator, simulate
from dtdsl.sim.workload import iteration_durations
from tests.pipeline_ref import one_f_one_b_events

ROOT = Path(__file__).resolve().parents[2]


def _pipeline(p: int, m: int) -> Schedule:
    u = ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=p)
    base = Schedule.skeleton("1f1b", m, (u,))
    return lower_units(base, GradientFlow.everywhere(base))


def _with_encoder(schedule: Schedule, owners, f: float, b: float) -> Durations:
    d = Durations.uniform(schedule, 1.0, 2.0)
    m = schedule.num_microbatches
    enc = np.empty((2, 1, 1, m, 1))
    enc[0], enc[1] = f, b
    return Durations(compute_s={**d.compute_s, "vit": enc},
                     bubbles=(("vit", tuple(owners)),))


def test_one_f_one_b_times_are_the_simulators():
    schedule = _pipeline(3, 5)
    result = simulate(schedule, Durations.uniform(schedule, 1.0, 2.0))
    f_start, b_end = one_f_one_b_times([1.0] * 3, [2.0] * 3, 5)
    events = result.timeline().events
    for e in events:
        if e.kind == "F":
            assert e.start_s == pytest.approx(f_start[e.stage][e.microbatch])
        elif e.kind == "B":
            assert e.end_s == pytest.approx(b_end[e.stage][e.microbatch])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 24), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 1e-3, 0.37]))
def test_one_f_one_b_times_equal_an_event_loop_bit_for_bit(pp, m, seed, hop):
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.uniform(0.01, 2.0, pp).tolist(), rng.uniform(0.01, 4.0, pp).tolist()
    assert one_f_one_b_times(fwd, bwd, m, hop) == one_f_one_b_events(fwd, bwd, m, hop)


def test_a_hand_made_case():
    # Two stages, four steps of F 1 s and B 2 s (15 s without the encoder). Stage 1
    # encodes steps 0 and 1 (0.5 s each, from 0 s), stage 0 steps 2 and 3 before its
    # first forward: F0 starts at 1 s, the pipeline ends at 16 s. Stage 1's encoder
    # backwards (1 s each) wait for its last action (B3, 14 s), for stage 0's B1 (10 s)
    # and its last forward (11 s): 14-16 s, in the bubble. Stage 0's own run after its
    # B3: 16-18 s, exposed; its SYNC waits for both.
    schedule = _pipeline(2, 4)
    result = Simulator(schedule).run(_with_encoder(schedule, (1, 1, 0, 0), 0.5, 1.0))
    assert result.iteration_time_s == pytest.approx(18.0)
    events = [e for e in result.timeline().events if e.microbatch is None]
    got = sorted((e.stage, e.kind, e.start_s, e.end_s) for e in events if e.kind in "FB")
    assert got == [(0, "B", 16.0, 17.0), (0, "B", 17.0, 18.0),
                   (0, "F", 0.0, 0.5), (0, "F", 0.5, 1.0),
                   (1, "B", 14.0, 15.0), (1, "B", 15.0, 16.0),
                   (1, "F", 0.0, 0.5), (1, "F", 0.5, 1.0)]   # halves: exact
    # Stage 0 waits for stage 1's embeddings of its first step: encoded later, later.
    slow = Simulator(schedule).run(_with_encoder(schedule, (1, 0, 0, 0), 2.5, 0.0))
    f0 = next(e for e in slow.timeline().events if e.kind == "F" and e.microbatch == 0
              and e.stage == 0)
    assert f0.start_s == pytest.approx(7.5)     # its own three steps end at 7.5 s
    late = Simulator(schedule).run(_with_encoder(schedule, (1, 1, 1, 1), 2.5, 0.0))
    f0 = next(e for e in late.timeline().events if e.kind == "F" and e.microbatch == 0
              and e.stage == 0)
    assert f0.start_s == pytest.approx(2.5)     # stage 1's first step
    # The estimate ``bubble_owners`` prices agrees here: 1 s before, 2 s after.
    assert bubble_exposure([1.0, 1.0], [2.0, 2.0], (1, 1, 0, 0), [0.5] * 4, [1.0] * 4) \
        == pytest.approx((1.0, 2.0))


def test_bad_owners_are_refused():
    schedule = _pipeline(2, 4)
    with pytest.raises(ValueError, match="owners"):
        Simulator(schedule).run(_with_encoder(schedule, (0, 1, 2, 0), 0.5, 1.0))
    with pytest.raises(ValueError, match="owners"):
        Simulator(schedule).run(_with_encoder(schedule, (0, 1, 1), 0.5, 1.0))


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 6), m=st.integers(1, 24),
       ef=st.floats(0.0, 3.0), eb=st.floats(0.0, 6.0),
       layers=st.lists(st.integers(1, 4), min_size=6, max_size=6))
@example(pp=4, m=4, ef=3.0, eb=3.0, layers=[1, 1, 1, 2, 1, 1])   # the greedy alone: 7 s > 6
def test_owners_cover_every_step_and_the_estimate_is_the_simulators(pp, m, ef, eb, layers):
    fwd = [1.0 * n for n in layers[:pp]]
    bwd = [2.0 * n for n in layers[:pp]]
    fit = bubble_owners(fwd, bwd, m, ef, eb)
    assert len(fit.owners) == m and all(0 <= s < pp for s in fit.owners)
    if pp == 1:
        assert fit.owners == (0,) * m
    assert (fit.exposed_f, fit.exposed_b) == pytest.approx(
        bubble_exposure(fwd, bwd, fit.owners, [ef] * m, [eb] * m))
    # Never worse than the phases before and after the pipeline (each stage a share).
    share = -(-m // pp)
    assert fit.exposed_f + fit.exposed_b <= share * (ef + eb) + 1e-9 or pp == 1
    # The simulator, with the owners as events, takes at most the estimate's exposure
    # over the pipeline alone, up to the hops the estimate leaves out (none here).
    u = ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=pp,
                     layers_per_stage=tuple(layers[:pp]))
    base = Schedule.skeleton("1f1b", m, (u,))
    schedule = lower_units(base, GradientFlow.everywhere(base))
    compute = np.empty((2, pp, 1, m, 1))
    compute[0] = np.asarray(fwd)[:, None, None, None]
    compute[1] = np.asarray(bwd)[:, None, None, None]
    enc = np.empty((2, 1, 1, m, 1))
    enc[0], enc[1] = ef, eb
    alone = simulate(schedule, Durations(compute_s={"llm": compute})).iteration_time_s
    with_enc = simulate(schedule, Durations(compute_s={"llm": compute, "vit": enc},
                                            bubbles=(("vit", fit.owners),)))
    assert with_enc.iteration_time_s >= alone - 1e-9
    assert with_enc.iteration_time_s <= alone + fit.exposed_f + fit.exposed_b + 1e-6


def test_small_encoders_hide_in_the_bubbles():
    # An encoder of a tenth of a stage's work over 4 stages and 8 steps: at most one
    # step's work shows each way (the first step's forward, the last one's backward),
    # and the first stage, which has no bubble, takes none.
    fit = bubble_owners([1.0] * 4, [2.0] * 4, 8, 0.1, 0.3)
    assert fit.exposed_f <= 0.1 + 1e-12 and fit.exposed_b <= 0.3 + 1e-12
    assert 0 not in fit.owners


@cache
def _phased(name: str):
    path = ROOT / "specs" / f"{name}.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    cost = build_cost_model(program, CostParams(samples=512))
    the_plan = plan(cost, program.cluster.num_gpus, compare_baseline=False,
                    placement="phased")
    return program, cost, the_plan, lower(the_plan, program)


@pytest.mark.parametrize("name", ["tiny_cpu", "mllm_9b"])
def test_drawn_batches_keep_the_dependencies(name):
    """On drawn batches routed under the spec's policy: each sample is encoded once, by
    its backbone replica's stage that the plan gives its step; in the simulated step the
    first stage's forward of a step starts after the step's encoding, a later stage's
    encoder backwards after the first stage's backward of the last of its steps."""
    program, cost, the_plan, schedule = _phased(name)
    bb = next(u for u in the_plan.units if u.role == "backbone")
    (enc,) = [u for u in the_plan.units if u.phased]
    owners = phase_fit(the_plan).owners
    work_model = WorkModel(cost)
    simulator = Simulator(schedule)
    for step in range(2):
        work = work_model.relative(batch_samples(program, step))
        routing = route(the_plan, work, frozenset(program.train.reorder))
        q = routing.replica[enc.name]
        assert np.array_equal(q, np.asarray(owners)[routing.step] * bb.dp
                              + routing.replica[bb.name])
        result = simulator.run(iteration_durations(the_plan, cost, schedule, routing, work))
        events = result.timeline().events
        for r in range(bb.dp):
            mine = [e for e in events if e.unit == bb.name and e.replica == r]
            fwd0 = {e.microbatch: e for e in mine if e.stage == 0 and e.kind == "F"
                    and e.microbatch is not None}
            bwd0 = {e.microbatch: e for e in mine if e.stage == 0 and e.kind == "B"
                    and e.microbatch is not None}
            for s in range(1, bb.pp):
                steps = [j for j, o in enumerate(owners) if o == s]
                ef = sorted((e for e in mine if e.stage == s and e.kind == "F"
                             and e.microbatch is None), key=lambda e: e.start_s)
                eb = sorted((e for e in mine if e.stage == s and e.kind == "B"
                             and e.microbatch is None), key=lambda e: e.start_s)
                assert len(ef) == len(eb) == len(steps)
                for j, e in zip(steps, ef, strict=True):
                    assert fwd0[j].start_s >= e.end_s - 1e-9
                if steps:
                    assert eb[0].start_s >= bwd0[steps[-1]].end_s - 1e-9
