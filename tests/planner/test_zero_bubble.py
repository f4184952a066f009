"""The zero_bubble schedule in the cost model and the planner: the weight gradients'
share of a backward (``CostModel.weight_grad_share``, by FLOPs), ZB-H1's warm-up in the
evaluator and in the co-located splits against the simulator, the convex search still
finding the exhaustive optimum, and the Megatron-LM baselines kept on 1F1B."""

from __future__ import annotations

import random
import re

import pytest

from dtdsl.cost.model import build_cost_model
from dtdsl.ir import program as ir
from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.planner import Infeasible, plan_baseline, plan_convex, plan_exhaustive
from dtdsl.planner.baseline import StageWork, megatron_split
from dtdsl.planner.evaluate import Evaluator
from dtdsl.schedule.lower import GradientFlow, lower_units
from dtdsl.sim.simulate import Durations, simulate
from tests.helpers.planning import from_text
from tests.planner.random_specs import random_spec
from tests.specs import TINY

TEXT = TINY.read_text()


def tiny(schedule: str = "zero_bubble", *edits: tuple[str, str]) -> ir.Program:
    text = TEXT.replace("schedule         = 1f1b", f"schedule         = {schedule}")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return from_text(text)


def test_weight_share_is_the_weight_gemms_of_the_backward_flops():
    model = build_cost_model(tiny())
    llm = model.unit("llm")
    w = llm.fwd_work
    assert llm.recompute is ir.Recompute.NONE and llm.backward_factor == 2
    assert model.weight_grad_share(llm) == pytest.approx(
        (w.matmul + w.conv) / (2 * w.total))
    # Attention has no weights: the share is below half.
    assert 0.3 < model.weight_grad_share(llm) < 0.5
    # Full recomputation runs the forward again in B: a smaller share.
    again = build_cost_model(tiny("zero_bubble", ("swiglu)", "swiglu)\n    recompute = full")))
    assert again.weight_grad_share(again.unit("llm")) == pytest.approx(
        (w.matmul + w.conv) / (3 * w.total))
    # Nothing trainable, no W.
    frozen = build_cost_model(tiny("zero_bubble", ("swiglu)", "swiglu)\n    frozen = true")))
    assert frozen.weight_grad_share(frozen.unit("llm")) == 0.0


def test_the_evaluators_warm_up_shrinks_by_twice_the_w_per_stage_boundary():
    zb, plain = Evaluator(build_cost_model(tiny()), 8), \
        Evaluator(build_cost_model(tiny("1f1b")), 8)
    layout = ([1, 1, 1], [1, 2, 1], [1, 2, 1])    # vit, llm (two stages), gen
    a, b = zb.evaluate(*layout), plain.evaluate(*layout)
    assert float(a.steady_s) == pytest.approx(float(b.steady_s))
    llm = zb.units[1]
    _, bwd = zb.fwd_bwd(1, 1)
    hidden = 2 * min(zb.cost.weight_grad_share(llm) * bwd / 2, bwd / 4)   # per stage
    assert float(b.warmup_s) - float(a.warmup_s) == pytest.approx(hidden)


@pytest.mark.parametrize("wgt", [0.2, 0.25, 0.3])
def test_colocated_split_times_match_the_simulator(wgt: float):
    """Eight layers on four stages, F 0.25, backward 0.5 of which W ``wgt`` per layer:
    the split's ZB-H1 time is what the simulator measures on the lowered schedule."""
    work = StageWork(fwd=0.25, bwd=0.5, wgt=wgt)
    split, predicted = megatron_split(8, 4, work, 8)
    assert split == (2, 2, 2, 2)
    base = Schedule.skeleton("zero_bubble", 8, (ScheduleUnit(name="llm", role="backbone",
                                                             tp=1, dp=1, pp=4),))
    schedule = lower_units(base, GradientFlow.everywhere(base))
    measured = simulate(schedule, Durations.uniform(schedule, 0.5, 1.0, weight_s=2 * wgt))
    assert predicted == pytest.approx(measured.iteration_time_s)
    one_f_one_b = megatron_split(8, 4, StageWork(fwd=0.25, bwd=0.5), 8)[1]
    assert one_f_one_b - predicted == pytest.approx(3 * 2 * min(2 * wgt, 0.5))


@pytest.mark.parametrize("seed", range(6))
def test_convex_finds_the_exhaustive_optimum_under_zero_bubble(seed: int):
    """The convex search's bounds stay below every layout's cost with ZB-H1's shorter
    warm-ups (a bound above one would make it skip the optimum)."""
    rng = random.Random(seed)
    text = re.sub(r"schedule = \S+", "schedule = zero_bubble", random_spec(rng, max_units=4))
    model = build_cost_model(from_text(text))
    gpus = rng.randint(4, 32)
    try:
        exact = plan_exhaustive(model, gpus)
    except Infeasible:
        with pytest.raises(Infeasible):
            plan_convex(model, gpus)
        return
    assert exact.schedule == "zero_bubble"
    convex = plan_convex(model, gpus)
    assert convex.iteration_time_s <= exact.iteration_time_s * (1 + 1e-3)


def test_the_megatron_baseline_runs_1f1b():
    """Megatron-LM mainline has no zero-bubble schedule: a zero_bubble spec's baseline is
    its 1F1B spec's."""
    zb = plan_baseline(build_cost_model(tiny()), 4)
    plain = plan_baseline(build_cost_model(tiny("1f1b")), 4)
    assert zb.schedule == "1f1b"
    assert zb.iteration_time_s == pytest.approx(plain.iteration_time_s)
