"""Plans scored on drawn batches: the simulated figures of ``dtc plan``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.cost.model import build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.planner import plan, simulate_plan
from dtdsl.planner.baseline import baseline_candidates, to_simulate
from dtdsl.schedule.lower import lower
from dtdsl.sim.run import simulate_steps
from dtdsl.sim.workload import parse_policy

TINY = Path(__file__).resolve().parents[2] / "specs" / "tiny_cpu.dt"


@pytest.fixture(scope="module")
def cost():
    program = run_frontend(str(TINY), TINY.read_bytes()).program
    return build_cost_model(program)


def test_plans_carry_their_simulated_times(cost):
    result = plan(cost, 4, simulate_steps=3)
    sim = result.simulated
    assert sim is not None and sim.steps == 3
    policy = parse_policy(cost.program.train.reorder)
    assert sim.policy == tuple(sorted(policy))
    # The same figures as simulating the plan step by step, on the same drawn batches.
    schedule = lower(result, cost.program)
    steps = list(simulate_steps(cost.program, cost, result, schedule, steps=3, policy=policy))
    assert sim.iteration_time_s == pytest.approx(
        sum(s.iteration_time_s for s in steps) / 3, rel=1e-12)
    assert sim.no_reorder_iteration_time_s == pytest.approx(
        simulate_plan(cost, result, policy=frozenset(), steps=3), rel=1e-12)
    # The baselines on the same batches, without reordering: the fastest of the candidates
    # simulated, each with the cost model that priced it (its padding, recomputation).
    candidates = to_simulate(baseline_candidates(cost, 4))
    times = [simulate_plan(c.cost, c.plan, policy=frozenset(), steps=3) for c in candidates]
    megatron = result.baselines["megatron"]
    assert megatron.simulated_s == pytest.approx(min(times), rel=1e-12)
    assert megatron.candidates == len(candidates)
    assert megatron.simulated_speedup == pytest.approx(megatron.simulated_s /
                                                       sim.iteration_time_s)
    assert result.speedup(simulated=True) == megatron.simulated_speedup
    assert plan(cost, 4).simulated is None


def test_the_baseline_is_simulated_without_reordering(cost):
    """Megatron-LM does not reorder samples."""
    base = plan(cost, 4, search="baseline", simulate_steps=2)
    assert base.simulated.policy == ()
    assert base.simulated.iteration_time_s == base.simulated.no_reorder_iteration_time_s == \
        base.baselines["megatron"].simulated_s
    assert base.speedup() == pytest.approx(1.0)
    assert base.speedup(simulated=True) == pytest.approx(1.0)
    assert base.baselines["megatron"].layout == base.model_copy(
        update={"simulated": None, "baselines": None})


def test_dtc_plan_prints_the_simulated_speedups(capsys):
    assert cli.main(["plan", str(TINY), "--simulate-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and "2 drawn batches" in out and "without reordering" in out
    assert cli.main(["plan", str(TINY), "--simulate-steps", "0"]) == 0
    assert "drawn batches" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", str(TINY), "--simulate-steps", "-1"])


def test_the_plan_is_the_fastest_of_its_runners_up_on_drawn_batches(cost):
    """Stragglers in the objective: the convex plan and its runners-up in expectation are
    scored on the same drawn batches under the spec's policy; the fastest is kept."""
    from dtdsl.planner import plan_convex
    from dtdsl.planner.orchestrate import convex_alternatives

    best = plan_convex(cost, 8)
    others = convex_alternatives(cost, 8, best, count=3)
    assert others, "tiny_cpu on 8 GPUs has runners-up"
    layouts = {(tuple(u.tp for u in p.units), tuple(u.dp for u in p.units))
               for p in [best, *others]}
    assert len(layouts) == 1 + len(others)            # each another TP/DP candidate
    times = [p.iteration_time_s for p in others]
    assert times == sorted(times)
    assert all(best.iteration_time_s <= t <= 1.25 * best.iteration_time_s for t in times)
    policy = parse_policy(cost.program.train.reorder)
    scored = [simulate_plan(cost, p, policy=policy, steps=2) for p in [best, *others]]
    chosen = plan(cost, 8, simulate_steps=2, alternatives=3)
    assert chosen.simulated.candidates == 1 + len(others)
    assert chosen.simulated.iteration_time_s == pytest.approx(min(scored), rel=1e-12)
    k = scored.index(min(scored))
    assert [(u.tp, u.dp, u.pp) for u in chosen.units] == \
        [(u.tp, u.dp, u.pp) for u in [best, *others][k].units]
