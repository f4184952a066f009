"""Plans scored on drawn batches: the simulated figures of ``dtc plan``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.cost.model import build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.planner import plan, plan_convex, simulate_plan
from dtdsl.planner.baseline import ESTIMATE_WITHIN, baseline_candidates, with_recompute
from dtdsl.planner.baseline import SIMULATED as BASELINE_SIMULATED
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import make_plan
from dtdsl.planner.shortlist import near_layouts
from dtdsl.planner.simulated import ESTIMATED, SIMULATED, DrawnBatches
from dtdsl.reorder.workload import parse_policy
from dtdsl.schedule.lower import lower
from dtdsl.sim.run import simulate_steps

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
    # The baselines on the same batches, without reordering: those near the fastest at
    # mean work ranked by the drawn-batch estimate, the best few simulated, each with the
    # cost model that priced it (its padding, recomputation), the fastest kept.
    found = baseline_candidates(cost, 4)
    near = [c for c in found
            if c.plan.iteration_time_s <= ESTIMATE_WITHIN * found[0].plan.iteration_time_s]
    batches = DrawnBatches(cost, 3)
    ranked = sorted(near, key=lambda c: batches.estimate(c.plan, frozenset()))
    simulated = ranked[:BASELINE_SIMULATED]
    times = [simulate_plan(c.cost, c.plan, policy=frozenset(), steps=3) for c in simulated]
    megatron = result.baselines["megatron"]
    assert megatron.simulated_s == pytest.approx(min(times), rel=1e-12)
    assert megatron.candidates == len(simulated) and megatron.estimated == len(near)
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


def _near_plans(cost, gpus):
    best = plan_convex(cost, gpus)
    ev = Evaluator(cost, gpus)
    layouts = near_layouts(cost, gpus, ceiling=best.iteration_time_s)
    return best, layouts, [make_plan(ev, "convex", layout, solve_time_s=0.0, candidates=0,
                                     convex_solves=0, evaluated=0) for layout in layouts]


def test_the_layouts_near_the_optimum_are_one_per_backbone_layout(cost):
    best, layouts, _ = _near_plans(cost, 8)
    assert len(layouts) > 1, "tiny_cpu on 8 GPUs has layouts near its optimum"
    backbone = [u.name for u in best.units].index("llm")
    keys = [(x.tp[backbone], x.dp[backbone], x.pp[backbone]) for x in layouts]
    assert len(set(keys)) == len(keys)
    times = [x.iteration_time_s for x in layouts]
    assert times == sorted(times)
    # The first is the optimum (the convex search's, to its tolerance), the rest near it.
    assert times[0] == pytest.approx(best.iteration_time_s, rel=1e-3)
    assert all(t <= 1.25 * times[0] for t in times)
    # Whatever search supplied the ceiling, the same list.
    assert near_layouts(cost, 8, ceiling=2 * best.iteration_time_s) == layouts


def test_the_plan_is_the_fastest_on_drawn_batches_of_the_best_estimated(cost):
    """The objective is the time on drawn batches: the layouts near the optimum, searched
    with the spec's recomputation and with every layer recomputed, the fastest ESTIMATED
    at mean work of both, are ranked by the drawn-batch estimate, the best few simulated
    under the spec's policy, and the fastest there is the plan; it is the fastest of them
    all on those batches."""
    policy = parse_policy(cost.program.train.reorder)
    batches = DrawnBatches(cost, 2)
    candidates = []
    for priced in (cost, with_recompute(cost)):
        candidates += [(p, priced) for p in _near_plans(priced, 8)[2]]
    candidates = sorted(candidates, key=lambda c: c[0].iteration_time_s)[:ESTIMATED]
    estimates = [batches.estimate(p, policy) for p, _ in candidates]
    top = sorted(range(len(candidates)), key=lambda k: (estimates[k], k))[:SIMULATED]
    every = [simulate_plan(priced, p, policy=policy, steps=2) for p, priced in candidates]
    scored = [every[k] for k in top]
    chosen = plan(cost, 8, simulate_steps=2, placement="disaggregated")
    assert chosen.simulated.candidates == len(top)
    assert chosen.simulated.estimated == len(candidates)
    assert chosen.simulated.iteration_time_s == pytest.approx(min(scored), rel=1e-12)
    best = candidates[top[scored.index(min(scored))]][0]
    assert [(u.tp, u.dp, u.pp, u.recompute) for u in chosen.units] == \
        [(u.tp, u.dp, u.pp, u.recompute) for u in best.units]
    assert min(scored) == pytest.approx(min(every), rel=1e-12)


def test_a_layout_that_does_not_fit_packed_is_compared_with_the_packed_plan():
    """mllm_9b's optimum at mean work (eleven backbone stages of four replicas) holds one
    sample per microbatch; packed rows of 8192 positions do not fit its memory, so the
    packing figure simulates the planner's layout for packed data (its convex search,
    with and without recomputation, at mean work) instead of a layout no run could use."""
    from dtdsl.planner import replan_for_packing
    from dtdsl.planner.simulated import SpecData, _pricing, packing_figures

    path = Path(__file__).resolve().parents[2] / "specs" / "mllm_9b.dt"
    cost_9b = build_cost_model(run_frontend(str(path), path.read_bytes()).program)
    unpacked = plan_convex(cost_9b)
    data = SpecData(cost_9b, 1)
    packed_cost = data.cost(True)
    figures = packing_figures(cost_9b, unpacked, steps=1, iteration_time_s=1.0,
                              replan=replan_for_packing, data=data)
    assert figures.replanned and not figures.spec_packs
    packed_plan = plan(packed_cost, unpacked.num_gpus, placement=unpacked.placement,
                       compare_baseline=False)
    assert figures.packed_s == pytest.approx(
        simulate_plan(_pricing(packed_cost, packed_plan), packed_plan, policy=frozenset(),
                      steps=1), rel=1e-12)


def test_a_plan_is_priced_at_its_recompute_and_its_context_parallelism(cost):
    """The model that priced a plan that recomputes where the spec does not and splits a
    sequence: both at once (recomputation rebuilds the model from the program, whose
    units are at cp 1, so cp must be applied after it)."""
    from dtdsl.ir.program import Recompute
    from dtdsl.planner.simulated import _pricing

    base = plan_convex(cost)
    units = tuple(u.model_copy(update={"cp": 2, "recompute": "full"})
                  if u.role == "backbone" else u for u in base.units)
    priced = _pricing(cost, base.model_copy(update={"units": units}))
    llm = next(u.name for u in units if u.role == "backbone")
    assert priced.unit(llm).cp == 2
    assert priced.unit(llm).recompute is Recompute.FULL
