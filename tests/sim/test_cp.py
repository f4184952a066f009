"""The simulator prices a plan with context parallelism as the planner does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.driver import read_spec, run_frontend
from dtdsl.planner import plan
from dtdsl.reorder.workload import route
from dtdsl.schedule.lower import lower
from dtdsl.sim.simulate import Simulator
from dtdsl.sim.workload import iteration_durations

ROOT = Path(__file__).resolve().parents[2]


def test_a_cp_plan_simulates_close_to_the_plan():
    name, data = read_spec(str(ROOT / "specs" / "mllm_72b_128k.dt"))
    program = run_frontend(name, data).program
    cost = build_cost_model(program, CostParams(samples=1024))
    the_plan = plan(cost, compare_baseline=False)
    llm = the_plan.unit("llm")
    assert llm.cp > 1
    schedule = lower(the_plan, program)
    work = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
    routing = route(the_plan, work, frozenset())
    # The spec's own cost model (cp 1): the simulator takes cp from the plan.
    durations = iteration_durations(the_plan, cost, schedule, routing, work)
    priced = cost.with_cp({"llm": llm.cp})
    assert durations.link_s[("llm", "llm")] == pytest.approx(float(priced.hop_time_s(
        priced.unit("llm"), llm.tp, llm.microbatch_share)))
    assert durations.link_s[("llm", "llm")] < float(cost.hop_time_s(
        cost.unit("llm"), llm.tp, llm.microbatch_share))
    assert durations.compute_s["llm"][0].max() == pytest.approx(llm.fwd_time_s)
    t = Simulator(schedule).run(durations).iteration_time_s
    assert 0.9 * the_plan.iteration_time_s <= t <= 1.001 * the_plan.iteration_time_s
