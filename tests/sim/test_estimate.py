"""The drawn-batch estimate (``sim.estimate``): the chain model on a routed batch less the
same chain at every stage's mean, what the planner ranks layouts by before it simulates."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.planner import plan_baseline, plan_convex
from dtdsl.planner.simulated import DrawnBatches
from dtdsl.reorder.pipeline import chain_1f1b, chain_columns
from dtdsl.reorder.workload import WorkModel, batch_samples
from dtdsl.sim.estimate import drawn_estimate, variation_s

ROOT = Path(__file__).resolve().parents[2]


@cache
def _cost(name: str, schedule: str | None = None):
    """A shipped spec's cost model (``schedule``: its train.schedule replaced)."""
    path = ROOT / "specs" / f"{name}.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    if schedule is not None:
        program = program.model_copy(update={"train": program.train.model_copy(
            update={"schedule": schedule})})
    return build_cost_model(program, CostParams(samples=1024))


def _work(cost, step: int = 0):
    return WorkModel(cost).relative(batch_samples(cost.program, step))


def test_chain_columns_is_the_chain_of_each_column():
    rng = np.random.default_rng(5)
    fwd = rng.uniform(0.1, 1.0, (4, 7, 3))
    bwd = 2 * fwd * rng.uniform(0.8, 1.2, fwd.shape)
    got = chain_columns(fwd, bwd)
    for k in range(3):
        assert got[k] == pytest.approx(chain_1f1b(fwd[:, :, k], bwd[:, :, k])[0], rel=1e-12)
    for bad in (fwd[:, :, 0], -fwd, np.full(fwd.shape, np.nan), fwd[:, :0]):
        with pytest.raises(ValueError):
            chain_columns(bad, np.abs(bad))


@pytest.mark.parametrize("rigid", [False, True])
def test_equal_samples_vary_nothing(rigid):
    """A batch of samples of the mean's work runs as the formula prices it."""
    cost = _cost("mllm_9b")
    the_plan = plan_baseline(cost) if rigid else plan_convex(cost)
    assert the_plan.rigid == rigid
    ones = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
    for policy in (frozenset(), frozenset({"intra", "inter"})):
        assert variation_s(the_plan, ones, policy) == pytest.approx(0.0, abs=1e-12)
        assert drawn_estimate(the_plan, ones, policy) == the_plan.iteration_time_s + \
            variation_s(the_plan, ones, policy)


def test_variation_costs_the_deeper_pipeline_more_without_reordering():
    """Unpacked samples of lognormal lengths, one per microbatch, in data order:
    consecutive microbatches of different work stall 1F1B, more so the more stages."""
    from dtdsl.planner.evaluate import Evaluator
    from dtdsl.planner.result import Layout, make_plan

    cost = _cost("mllm_9b")
    work = _work(cost)
    ev = Evaluator(cost, cost.program.cluster.num_gpus)
    share = []
    for depth in (2, 3, 5):
        tps, dps, pps = (1, 2, 1), (8, 8, 8), (1, depth, 1)
        layout = Layout(tp=tps, dp=dps, pp=pps,
                        iteration_time_s=float(ev.evaluate(tps, dps, pps).iteration_time_s))
        p = make_plan(ev, "convex", layout, solve_time_s=0.0, candidates=0, convex_solves=0,
                      evaluated=0)
        share.append(variation_s(p, work, frozenset()) / p.iteration_time_s)
        # Grouping similar samples and ordering them for 1F1B wins most of it back.
        assert variation_s(p, work, frozenset({"intra", "inter"})) < \
            0.5 * variation_s(p, work, frozenset())
    assert 0 < share[0] < share[1] < share[2]


def test_the_estimate_ranks_layouts_as_the_simulator_does():
    """On the 9B spec under 1F1B the layout the simulator finds fastest on a drawn batch
    under the spec's policy is not the fastest at mean work, and the estimate ranks it
    first. (The spec as shipped runs zero_bubble, whose variation the estimate's 1F1B
    chain overstates on deep pipelines: docs/planned.md.)"""
    from dtdsl.planner.evaluate import Evaluator
    from dtdsl.planner.result import make_plan
    from dtdsl.planner.shortlist import near_layouts

    cost = _cost("mllm_9b", "1f1b")
    gpus = cost.program.cluster.num_gpus
    ev = Evaluator(cost, gpus)
    best = plan_convex(cost)
    plans = [make_plan(ev, "convex", layout, solve_time_s=0.0, candidates=0, convex_solves=0,
                       evaluated=0)
             for layout in near_layouts(cost, gpus, ceiling=best.iteration_time_s, count=4)]
    batches = DrawnBatches(cost, 1)
    policy = frozenset({"intra", "inter"})
    simulated = [batches.mean_time(cost, p, policy) for p in plans]
    estimated = [batches.estimate(p, policy) for p in plans]
    fastest = int(np.argmin(simulated))
    assert fastest != 0                           # not the optimum at mean work
    assert int(np.argmin(estimated)) == fastest
