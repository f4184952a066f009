"""The simulator against closed forms and an independent action-by-action reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Schedule, ScheduleUnit, parse_schedule
from dtdsl.schedule.lower import GradientFlow, lower, lower_units
from dtdsl.schedule.validate import validate
from dtdsl.sim.simulate import Durations, Simulator, simulate

ROOT = Path(__file__).resolve().parents[2]


def _pipeline(name: str, p: int, m: int, *, vpp: int = 1, dp: int = 1) -> Schedule:
    u = ScheduleUnit(name="llm", role="backbone", tp=1, dp=dp, pp=p, vpp=vpp)
    base = Schedule.skeleton(name, m, (u,))
    return lower_units(base, GradientFlow.everywhere(base))


def reference(schedule: Schedule, durations: Durations) -> float:
    """Execute the actions one by one, every replica of every stage with its own clock: a
    replica runs its next action when it can (a receive at once; the pass that reads it,
    the next pass of its kind, chunk and microbatch, once its sends have been posted,
    plus the link time: from the same replica within a unit, from the replicas the routes
    name between units, all of them without routes; SYNC once every replica of the stage
    has reached it). A W (zero_bubble) takes its ``weight_s``, its B the backward less
    that. Quadratic, obviously right."""
    units = {u.name: u for u in schedule.units}
    split = {(a.unit, a.stage, a.chunk, a.microbatch) for st in schedule.stages
             for a in st.actions if a.kind.value == "W"}
    lanes = [(st, r) for st in schedule.stages for r in range(units[st.unit].dp)]
    clock = {(st.where, r): 0.0 for st, r in lanes}
    pos = {(st.where, r): 0 for st, r in lanes}
    posted: dict[tuple, float] = {}
    # Per lane and (F or B, chunk, microbatch): the receives the next such pass reads.
    awaited: dict[tuple, list[tuple[tuple, float]]] = {}
    remaining = sum(len(st.actions) for st, _ in lanes)

    def senders(a, r: int) -> list[int]:
        if a.peer_unit == a.unit:
            return [r]
        backward = a.kind.direction.value == "B"
        edge = (a.unit, a.peer_unit) if backward else (a.peer_unit, a.unit)
        if edge not in durations.routes:
            return list(range(units[a.peer_unit].dp))
        mask = np.asarray(durations.routes[edge])[a.microbatch]
        return [int(q) for q in np.flatnonzero(mask[r] if backward else mask[:, r])]

    while remaining:
        progressed = False
        for st, r in lanes:
            lane = (st.where, r)
            while pos[lane] < len(st.actions):
                a = st.actions[pos[lane]]
                t = clock[lane]
                if a.kind.is_send:
                    key = (a.kind.direction, a.unit, a.stage, a.chunk, a.peer_unit,
                           a.peer_stage, a.peer_chunk, a.microbatch, r)
                    posted[key] = t
                elif a.kind.is_recv:
                    keys = [(a.kind.direction, a.peer_unit, a.peer_stage, a.peer_chunk, a.unit,
                             a.stage, a.chunk, a.microbatch, q) for q in senders(a, r)]
                    link = durations.link_s.get((a.peer_unit, a.unit), 0.0)
                    awaited.setdefault((lane, a.kind.direction, a.chunk, a.microbatch), []) \
                        .extend((k, link) for k in keys)
                elif a.kind.is_compute:
                    reads = awaited.get((lane, a.kind, a.chunk, a.microbatch), [])
                    if any(k not in posted for k, _ in reads):
                        break
                    t = max([t] + [posted[k] + link for k, link in reads])
                    awaited.pop((lane, a.kind, a.chunk, a.microbatch), None)
                    arr = np.asarray(durations.compute_s[a.unit])
                    d = arr[0 if a.kind.value == "F" else 1, a.stage, a.chunk, a.microbatch, r]
                    where = (a.unit, a.stage, a.chunk, a.microbatch)
                    w = float(np.asarray(durations.weight_s[a.unit])[where[1:] + (r,)]) \
                        if where in split and a.unit in durations.weight_s else 0.0
                    d = w if a.kind.value == "W" else d - (w if a.kind.value == "B" else 0.0)
                    clock[lane] = t + float(d)
                else:
                    others = [(st.where, q) for q in range(units[st.unit].dp)]
                    if a.kind.value == "SYNC":
                        if any(pos[o] < pos[lane] for o in others):
                            break       # a collective: every replica must reach it
                        t = max(clock[o] for o in others if pos[o] == pos[lane])
                    table = durations.sync_s if a.kind.value == "SYNC" else durations.opt_s
                    clock[lane] = t + (float(np.asarray(table[a.unit])[a.stage])
                                       if a.unit in table else 0.0)
                pos[lane] += 1
                remaining -= 1
                progressed = True
        assert progressed, "reference deadlocked"
    return max(clock.values())


def _random_durations(schedule: Schedule, rng: np.random.Generator) -> Durations:
    m = schedule.num_microbatches
    compute = {u.name: rng.uniform(0.1, 2.0, size=(2, u.pp, u.vpp, m, u.dp))
               for u in schedule.units}
    names = [u.name for u in schedule.units]
    links = {(a, b): float(rng.uniform(0, 0.3)) for a in names for b in names}
    sync = {u.name: rng.uniform(0, 0.5, size=u.pp) for u in schedule.units}
    opt = {u.name: rng.uniform(0, 0.1, size=u.pp) for u in schedule.units}
    return Durations(compute_s=compute, link_s=links, sync_s=sync, opt_s=opt)


@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 1), (4, 8), (8, 3), (8, 64), (16, 16)])
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_uniform_stages_reproduce_the_analytic_bubble(name, p, m):
    schedule = _pipeline(name, p, m)
    result = simulate(schedule, Durations.uniform(schedule, 1.0, 2.0))
    assert result.iteration_time_s == pytest.approx((m + p - 1) * 3.0, rel=1e-12)
    expected = (p - 1) / (m + p - 1)
    for stage, bubble in result.bubble_fraction().items():
        assert bubble == pytest.approx(expected, abs=1e-12), stage
    assert result.timeline().mean_bubble_fraction() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 2, 4)])
def test_interleaved_divides_the_warmup_by_the_virtual_stages(p, v, m):
    schedule = _pipeline("interleaved", p, m, vpp=v)
    result = simulate(schedule, Durations.uniform(schedule, 1.0, 2.0))
    assert result.iteration_time_s == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v, rel=1e-12)


def test_links_delay_the_receiver():
    schedule = _pipeline("1f1b", 2, 1)
    d = Durations.uniform(schedule, 1.0, 2.0, link_s=0.25)
    # F on s0, transfer, F and B on s1, transfer, B on s0.
    assert simulate(schedule, d).iteration_time_s == pytest.approx(1 + 0.25 + 3 + 0.25 + 2)


def test_replicas_run_their_own_pipelines_and_meet_at_the_gradient_sync():
    schedule = _pipeline("1f1b", 2, 2, dp=2)
    d = Durations.uniform(schedule, 1.0, 2.0)
    d.compute_s["llm"][0, 0, 0, :, 1] = 1.5          # replica 1 of stage 0: slower forwards
    sync = {"llm": np.array([0.5, 0.5])}
    d = Durations(compute_s=d.compute_s, sync_s=sync)
    result = simulate(schedule, d)
    assert result.iteration_time_s == pytest.approx(reference(schedule, d))
    # Each replica alone: replica 1's pipeline is the longer one, and the sync waits for it.
    alone = []
    for r in range(2):
        one = _pipeline("1f1b", 2, 2)
        alone.append(simulate(one, Durations(
            compute_s={"llm": d.compute_s["llm"][..., r:r + 1]}, sync_s=sync)).iteration_time_s)
    assert alone[1] > alone[0]
    assert result.iteration_time_s == pytest.approx(alone[1])
    events = result.timeline().events
    fwd = {(e.replica, e.microbatch): e for e in events if e.kind == "F" and e.stage == 0}
    assert fwd[(0, 0)].duration_s == pytest.approx(1.0)
    assert fwd[(1, 0)].duration_s == pytest.approx(1.5)
    # Replica 0 does not wait for replica 1: its second forward starts after its own first.
    assert fwd[(0, 1)].start_s == pytest.approx(1.0)
    assert fwd[(1, 1)].start_s == pytest.approx(1.5)
    syncs = [e for e in events if e.kind == "SYNC" and e.stage == 0]
    assert len({e.start_s for e in syncs}) == 1      # a collective: every replica together
    assert {(e.replica, e.rank) for e in fwd.values()} == {(0, 0), (1, 1)}


def _two_units(dp_enc: int, dp_llm: int, m: int = 4) -> Schedule:
    units = (ScheduleUnit(name="vit", role="encoder", tp=1, dp=dp_enc, pp=1),
             ScheduleUnit(name="llm", role="backbone", tp=1, dp=dp_llm, pp=2))
    base = Schedule.skeleton("1f1b", m, units)
    return lower_units(base, GradientFlow.everywhere(base))


def test_units_wait_only_for_the_replicas_whose_samples_they_receive():
    schedule = _two_units(2, 2)
    d = Durations.uniform(schedule, 1.0, 2.0)
    d.compute_s["vit"][:, :, :, :, 1] *= 3                    # encoder replica 1 is slow
    diagonal = np.broadcast_to(np.eye(2, dtype=bool), (4, 2, 2))
    everyone = np.ones((4, 2, 2), dtype=bool)
    times = {}
    for name, mask in (("diagonal", diagonal), ("everyone", everyone), ("none", None)):
        routed = Durations(compute_s=d.compute_s,
                           routes={} if mask is None else {("vit", "llm"): mask})
        result = simulate(schedule, routed)
        times[name] = result.iteration_time_s
        assert times[name] == pytest.approx(reference(schedule, routed))
        if name == "diagonal":   # backbone replica 0 never waits for encoder replica 1
            f = {e.microbatch: e.start_s for e in result.timeline().events
                 if e.kind == "F" and e.unit == "llm" and e.stage == 0 and e.replica == 0}
            assert f[0] == pytest.approx(1.0)
    # Without routes every pair exchanges (the broker's worst case).
    assert times["none"] == pytest.approx(times["everyone"])
    assert times["diagonal"] <= times["everyone"]
    # Backbone replica 0's chain is fast, replica 1's is not: the iteration is replica 1's.
    assert times["diagonal"] == pytest.approx(simulate(_two_units(1, 1), Durations(
        compute_s={k: v[..., 1:2] for k, v in d.compute_s.items()})).iteration_time_s)


def test_routes_of_the_wrong_shape_are_refused():
    schedule = _two_units(2, 2)
    d = Durations.uniform(schedule, 1.0, 2.0)
    bad = Durations(compute_s=d.compute_s, routes={("vit", "llm"): np.ones((4, 2, 3), bool)})
    with pytest.raises(ValueError, match="routes"):
        simulate(schedule, bad)


@pytest.fixture(scope="module", params=["tiny_cpu", "mllm_9b", "audio_image"])
def spec_schedule(request, planned_compile) -> Schedule:
    """A shipped spec's schedule as ``dtc compile`` plans it: the compile that
    tests/codegen/test_compile.py checks, run once per test run (not at collection, in
    every xdist worker: audio_image's planning takes most of a minute of CPU)."""
    path = ROOT / "specs" / f"{request.param}.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    plan = Plan.model_validate_json((planned_compile(request.param) / "plan.json").read_text())
    return lower(plan, program)


def test_matches_the_reference_on_shipped_specs(spec_schedule):
    rng = np.random.default_rng(1)
    sim = Simulator(spec_schedule)
    for _ in range(3):
        d = _random_durations(spec_schedule, rng)
        assert sim.run(d).iteration_time_s == pytest.approx(reference(spec_schedule, d),
                                                            rel=1e-12)


def test_matches_the_reference_with_random_routes(spec_schedule):
    rng = np.random.default_rng(2)
    sim = Simulator(spec_schedule)
    units = {u.name: u for u in spec_schedule.units}
    backbone = next(u for u in spec_schedule.units if u.role == "backbone")
    edges = [(u.name, backbone.name) if u.role == "encoder" else (backbone.name, u.name)
             for u in spec_schedule.units if u.role != "backbone"]
    m = spec_schedule.num_microbatches
    for _ in range(2):
        d = _random_durations(spec_schedule, rng)
        routes = {(a, b): rng.random((m, units[a].dp, units[b].dp)) < 0.5 for a, b in edges}
        d = Durations(compute_s=d.compute_s, link_s=d.link_s, sync_s=d.sync_s,
                      opt_s=d.opt_s, routes=routes)
        assert sim.run(d).iteration_time_s == pytest.approx(reference(spec_schedule, d),
                                                            rel=1e-12)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_matches_the_reference_on_random_durations(name, vpp):
    rng = np.random.default_rng(7)
    schedule = _pipeline(name, 4, 8, vpp=vpp, dp=2)
    sim = Simulator(schedule)
    for _ in range(5):
        d = _random_durations(schedule, rng)
        assert sim.run(d).iteration_time_s == pytest.approx(reference(schedule, d), rel=1e-12)


def test_timeline_events_respect_the_stage_order(spec_schedule):
    result = simulate(spec_schedule, _random_durations(spec_schedule,
                                                       np.random.default_rng(3)))
    timeline = result.timeline()
    for row, events in timeline.by_row().items():
        for a, b in zip(events, events[1:], strict=False):
            assert a.end_s <= b.start_s + 1e-12 or a.start_s == b.start_s, row
    assert timeline.end_s == pytest.approx(result.iteration_time_s)
    assert timeline.iteration_time_s == pytest.approx(result.iteration_time_s)


def test_bad_durations_are_refused():
    schedule = _pipeline("1f1b", 2, 2)
    d = Durations.uniform(schedule, 1.0, 2.0)
    with pytest.raises(ValueError, match="shape"):
        Simulator(schedule).run(Durations(compute_s={"llm": d.compute_s["llm"][:, :1]}))
    bad = d.compute_s["llm"].copy()
    bad[0, 0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        Simulator(schedule).run(Durations(compute_s={"llm": bad}))


def test_32_stages_by_256_microbatches():
    # How fast it runs (the target: 10 ms) is benchmarks/simulate_time.py's figure.
    schedule = _pipeline("1f1b", 32, 256)
    result = Simulator(schedule).run(Durations.uniform(schedule, 1.0, 2.0))
    assert result.iteration_time_s == pytest.approx((256 + 31) * 3.0)


def test_a_send_after_a_receive_does_not_wait_for_it():
    # SEND_F1 follows RECV_B0 with no pass between: the runtime issues both at once, so
    # the send is posted when F1 ends (2.0), not when the gradient arrives (5.0); only B0
    # waits for that. s1's F1 starts when s1 is free (4.5), the activations long there.
    schedule = parse_schedule(
        "schedule 1f1b microbatches=2\n"
        "unit llm backbone tp=1 dp=1 pp=2 vpp=1 first_rank=0 share=1 layers=-\n"
        "llm.s0: F0 SEND_F0>llm.s1 F1 RECV_B0<llm.s1 SEND_F1>llm.s1 B0 RECV_B1<llm.s1 B1\n"
        "llm.s1: RECV_F0<llm.s0 F0 B0 SEND_B0>llm.s0 RECV_F1<llm.s0 F1 B1 SEND_B1>llm.s0\n")
    validate(schedule)
    d = Durations.uniform(schedule, 1.0, 2.0, link_s=0.5)
    result = simulate(schedule, d)
    assert result.iteration_time_s == pytest.approx(reference(schedule, d))
    assert result.iteration_time_s == pytest.approx(10.0)
    f1 = [e for e in result.timeline().events if e.stage == 1 and e.label == "F1"]
    assert f1[0].start_s == pytest.approx(4.5)
    b0 = [e for e in result.timeline().events if e.stage == 0 and e.label == "B0"]
    assert b0[0].start_s == pytest.approx(5.0)
    assert result.busy_s() == {"llm.s0": pytest.approx(6.0), "llm.s1": pytest.approx(6.0)}


def test_a_receive_posted_early_waits_only_at_the_pass_that_reads_it():
    # llm.s1 posts the receive of activations 1 before F0 (as schedule.place does): F0
    # starts when activations 0 arrive (1.0), not activations 1 (2.0); F1 waits for them.
    schedule = parse_schedule(
        "schedule 1f1b microbatches=2\n"
        "unit llm backbone tp=1 dp=1 pp=2 vpp=1 first_rank=0 share=1 layers=-\n"
        "llm.s0: F0 SEND_F0>llm.s1 F1 SEND_F1>llm.s1 RECV_B0<llm.s1 B0 RECV_B1<llm.s1 B1\n"
        "llm.s1: RECV_F0<llm.s0 RECV_F1<llm.s0 F0 B0 SEND_B0>llm.s0 F1 B1 SEND_B1>llm.s0\n")
    validate(schedule)
    d = Durations.uniform(schedule, 1.0, 2.0)
    result = simulate(schedule, d)
    assert result.iteration_time_s == pytest.approx(reference(schedule, d))
    assert result.iteration_time_s == pytest.approx(9.0)
    f0 = [e for e in result.timeline().events if e.stage == 1 and e.label == "F0"]
    assert f0[0].start_s == pytest.approx(1.0)


def test_receives_at_the_end_of_a_stage_take_no_time():
    # Not a valid schedule (nothing reads the data), but the simulator must not charge the
    # wait for it with another action's duration.
    schedule = parse_schedule(
        "schedule 1f1b microbatches=1\n"
        "unit llm backbone tp=1 dp=1 pp=2 vpp=1 first_rank=0 share=1 layers=-\n"
        "llm.s0: F0 SEND_F0>llm.s1 B0\n"
        "llm.s1: F0 B0 RECV_F0<llm.s0\n")
    result = simulate(schedule, Durations.uniform(schedule, 1.0, 2.0))
    assert result.iteration_time_s == pytest.approx(3.0)
    assert len(result.timeline().events) == 4


def test_mean_bubble_fraction_is_the_timelines(spec_schedule):
    # What dtc simulate reports and what TensorBoard shows for the same step must agree:
    # every replica with its own compute time, idle replicas included.
    d = _random_durations(spec_schedule, np.random.default_rng(5))
    result = simulate(spec_schedule, d)
    assert result.mean_bubble_fraction() == pytest.approx(
        result.timeline().mean_bubble_fraction(), abs=1e-12)
    uniform = _pipeline("1f1b", 4, 8, dp=3)
    assert simulate(uniform, Durations.uniform(uniform, 1.0, 2.0)).mean_bubble_fraction() == \
        pytest.approx(3 / 11, abs=1e-12)
