"""``reorder.workload.route``, the one routing rule of the simulator and of the workers that feed
a run: every sample routed exactly once under every policy, a deterministic function of the
costs, the workers' ``route_batch`` the same function, and the chosen step order against
every permutation simulated on a lowered schedule."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.data.batch import SyntheticSource, route_batch, routing_of, sample_set
from dtdsl.driver import run_frontend
from dtdsl.ir.plan import Plan, UnitPlan, split_layers
from dtdsl.planner import plan as make_plan
from dtdsl.reorder.workload import (
    POLICIES,
    WorkModel,
    batch_samples,
    parse_policy,
    reordered,
    route,
)
from dtdsl.schedule.lower import lower
from dtdsl.sim.simulate import Simulator
from dtdsl.sim.workload import iteration_durations

ROOT = Path(__file__).resolve().parents[2]


def handmade(*, dp_lm: int, mb: int, m: int, pp: int, dp_enc: int, dp_gen: int,
             pp_enc: int = 1, rigid: bool = False) -> Plan:
    """A plan with an encoder, a backbone and a generator, as ``route`` reads it."""
    units = []
    first = 0
    for name, role, dp, depth in (("enc", "encoder", dp_enc, pp_enc), ("lm", "backbone", dp_lm, pp),
                                  ("gen", "generator", dp_gen, 1)):
        if rigid:
            dp = dp_lm
        share = dp_lm / dp
        units.append(UnitPlan(
            name=name, role=role, projectors=(), gpus=dp * depth, tp=1, dp=dp, pp=depth,
            first_rank=first, layers_per_stage=split_layers(3 * depth + 1, depth),
            microbatch_share=share, fwd_time_s=share * mb * (0.3 if role == "encoder" else 1.0),
            bwd_time_s=share * mb * (0.6 if role == "encoder" else 2.0), dp_sync_time_s=0.1,
            memory_bytes=1e9, memory_limit_bytes=8e10))
        first += dp * depth
    return Plan(spec="handmade", spec_sha256="0" * 64,
                search="baseline" if rigid else "exhaustive", num_gpus=first, gpus_used=first,
                global_batch=m * dp_lm * mb, micro_batch=mb, num_microbatches=m,
                schedule="1f1b", iteration_time_s=1.0, warmup_time_s=0.1, steady_time_s=0.8,
                dp_sync_time_s=0.1, model_flops_per_iteration=1e15, mfu=0.5, solve_time_s=0.0,
                candidates=1, convex_solves=0, evaluated=1, units=tuple(units))


@st.composite
def routed_batches(draw):
    plan = handmade(dp_lm=draw(st.integers(1, 4)), mb=draw(st.integers(1, 3)),
                    m=draw(st.integers(1, 6)), pp=draw(st.integers(1, 3)),
                    dp_enc=draw(st.integers(1, 5)), dp_gen=draw(st.integers(1, 3)),
                    pp_enc=draw(st.integers(1, 2)), rigid=draw(st.booleans()))
    n = plan.global_batch
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    work = {}
    for u in plan.units:
        w = rng.lognormal(0.0, draw(st.sampled_from([0.0, 0.5, 1.2])), n)
        w[rng.random(n) < draw(st.sampled_from([0.0, 0.3]))] = 0.0   # no image, no target
        work[u.name] = w
    return plan, work, parse_policy(draw(st.sampled_from(POLICIES)))


@settings(max_examples=120, deadline=None)
@given(routed_batches())
def test_every_sample_routed_exactly_once(case):
    plan, work, policy = case
    routing = route(plan, work, policy)
    m, mb, n = plan.num_microbatches, plan.micro_batch, plan.global_batch
    lm = plan.unit("lm")
    # Every position has a step, and every step the backbone's dp microbatches of mb.
    assert routing.step.shape == (n,)
    assert np.bincount(routing.step, minlength=m).tolist() == [lm.dp * mb] * m
    per_replica = routing.loads("lm", np.ones(n), lm.dp)
    assert (per_replica == mb).all()
    for u in plan.units:
        r = routing.replica[u.name]
        assert r.shape == (n,) and r.min() >= 0 and r.max() < u.dp
        counts = routing.loads(u.name, np.ones(n), u.dp)
        assert (counts.max(axis=1) - counts.min(axis=1) <= 1).all(), u.name
        if plan.rigid:
            assert np.array_equal(r, routing.replica["lm"])
    # A deterministic function of the costs: the same answer again, and from copies.
    again = route(plan, {k: v.copy() for k, v in work.items()}, policy)
    assert np.array_equal(again.step, routing.step)
    for u in plan.units:
        assert np.array_equal(again.replica[u.name], routing.replica[u.name])


def test_inter_groups_the_backbone_and_balances_its_replicas():
    plan = handmade(dp_lm=4, mb=2, m=8, pp=4, dp_enc=2, dp_gen=1)
    rng = np.random.default_rng(5)
    work = {u.name: rng.lognormal(0.0, 1.0, plan.global_batch) for u in plan.units}
    routing = route(plan, work, parse_policy("both"))
    length = work["lm"]
    # Each step's samples lie next to each other in the sorted order of backbone work
    # (or of the slowest stage's), far tighter than data order.
    spread = np.mean([np.ptp(length[routing.step == j]) for j in range(plan.num_microbatches)])
    plain = route(plan, work, frozenset())
    assert spread < 0.5 * np.mean([np.ptp(length[plain.step == j])
                                   for j in range(plan.num_microbatches)])
    # A microbatch pads less than in data order.
    assert routing.padded_loads("lm", length, 4).sum() < plain.padded_loads("lm", length, 4).sum()


def _tiny(pp: int, m: int):
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    text = text.replace("global_batch     = 16", f"global_batch     = {m}")
    text = text.replace("micro_batch      = 2", "micro_batch      = 1")
    text = text.replace("gpus          = 4", f"gpus          = {2 + pp}")
    text = text.replace("tp(*) in {1, 2}", f"tp(*) == 1\n  pp(llm) == {pp}\n  dp(*) == 1")
    result = run_frontend("tiny_pp.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    program = result.program
    cost = build_cost_model(program, CostParams(samples=256))
    # Disaggregated: a phased encoder's stage per step follows the step's place in the
    # order (``reorder.workload.phase_fit``), which inter's chain model does not price.
    the_plan = make_plan(cost, program.cluster.num_gpus, compare_baseline=False,
                         placement="disaggregated")
    assert the_plan.unit("llm").pp == pp
    return program, cost, the_plan, lower(the_plan, program)


@pytest.mark.parametrize("pp,m", [(2, 5), (2, 6), (3, 5), (3, 6)])
def test_the_chosen_order_against_every_permutation_simulated(pp, m):
    """The lowered schedule of a small plan (an encoder, a backbone of pp stages, a
    generator) simulated for every order of its m steps on drawn batches: inter's order
    is within 0.1% of the best (its model leaves out the transfers and the gradient
    sync), and data order is not."""
    program, cost, the_plan, schedule = _tiny(pp, m)
    simulator = Simulator(schedule)
    work_model = WorkModel(cost)
    worst_data = 1.0
    for step in range(2):
        work = work_model.relative(batch_samples(program, step))
        routing = route(the_plan, work, parse_policy("inter"))

        def seconds(r, work=work) -> float:
            return simulator.run(iteration_durations(the_plan, cost, schedule, r,
                                                     work)).iteration_time_s

        best = min(seconds(reordered(routing, list(o)))
                   for o in itertools.permutations(range(m)))
        assert seconds(routing) <= best * 1.001
        worst_data = max(worst_data, seconds(route(the_plan, work, frozenset())) / best)
    assert worst_data > 1.03


def test_workers_route_as_the_simulator():
    """``route_batch`` (what the preprocessing workers and ``LocalBatches`` call) is
    ``route`` on the batch's own sample sizes: one code path."""
    path = ROOT / "specs" / "tiny_cpu.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    cost = build_cost_model(program, CostParams(samples=256))
    the_plan = make_plan(cost, program.cluster.num_gpus, compare_baseline=False)
    work_model = WorkModel(cost)
    source = SyntheticSource(program)
    for policy in POLICIES:
        chosen = parse_policy(policy)
        for step in range(2):
            sizes = source.sizes(step)
            ours = routing_of(the_plan, route_batch(the_plan, program, sizes, chosen,
                                                    work_model))
            expected = route(the_plan, work_model.relative(sample_set(program, sizes)), chosen)
            assert np.array_equal(ours.step, expected.step)
            for name, r in expected.replica.items():
                assert np.array_equal(ours.replica[name], r)
