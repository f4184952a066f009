"""Plans scored on drawn batches: the simulated figures of ``dtc plan``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.cost.model import build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.planner import plan, plan_baseline, simulate_plan
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
    base = plan_baseline(cost, 4)
    assert sim.baseline_iteration_time_s == pytest.approx(
        simulate_plan(cost, base, policy=frozenset(), steps=3), rel=1e-12)
    assert sim.speedup == pytest.approx(sim.baseline_iteration_time_s / sim.iteration_time_s)
    assert plan(cost, 4).simulated is None


def test_the_baseline_is_simulated_without_reordering(cost):
    """Megatron-LM does not reorder samples."""
    base = plan(cost, 4, search="baseline", simulate_steps=2)
    assert base.simulated.policy == ()
    assert base.simulated.iteration_time_s == base.simulated.no_reorder_iteration_time_s == \
        base.simulated.baseline_iteration_time_s


def test_dtc_plan_prints_the_simulated_speedups(capsys):
    assert cli.main(["plan", str(TINY), "--simulate-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and "2 drawn batches" in out and "without reordering" in out
    assert cli.main(["plan", str(TINY), "--simulate-steps", "0"]) == 0
    assert "drawn batches" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", str(TINY), "--simulate-steps", "-1"])
