"""Context parallelism in the planner: cp enters the search only where a constraint allows
it, the 128K spec needs it and gets it, GPUs are tp x cp x pp x dp, and compile takes it on
the backbone and on encoder units of their own ranks, never on a generator."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from dtdsl.codegen.support import runtime_support
from dtdsl.cost.model import build_cost_model
from dtdsl.driver import read_spec, run_frontend
from dtdsl.ir import program as ir
from dtdsl.planner import Infeasible, cp_choices, plan, plan_convex, plan_exhaustive
from dtdsl.planner.baseline import with_recompute
from tests.helpers.planning import long_video, spec_text

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "specs").glob("*.dt") if p.stem != "mllm_72b_128k")


def _program(text: str, name: str = "t.dt") -> ir.Program:
    result = run_frontend(name, text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


@cache
def long_plan():
    return plan(build_cost_model(_program(spec_text("mllm_72b_128k"))), compare_baseline=False)


def _tiles(p) -> None:
    """Every unit's GPUs are tp x cp x pp x dp, and the units tile ranks 0..gpus_used-1."""
    owned = []
    for u in p.units:
        if u.gpus:
            assert u.gpus == u.tp * u.cp * u.pp * u.dp
            owned += list(u.ranks)
    assert sorted(owned) == list(range(p.gpus_used))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_search_no_cp(name):
    spec_name, data = read_spec(str(ROOT / "specs" / f"{name}.dt"))
    result = run_frontend(spec_name, data)
    assert result.ok, result.diagnostics
    assert all(c.cp.candidates(10**6) == (1,) for c in result.program.constraints)


def test_the_128k_spec_needs_cp_and_plans_with_it():
    p = long_plan()
    llm = p.unit("llm")
    assert llm.cp > 1
    _tiles(p)
    # Pinned to cp 1, a 128K-token sample fits only on a shallow pipeline of the widest
    # TP, recomputing: a far slower step.
    text = spec_text("mllm_72b_128k").replace("cp(llm)   in {1, 2, 4, 8}", "cp(llm) == 1")
    pinned = plan(build_cost_model(_program(text)), compare_baseline=False)
    assert pinned.unit("llm").cp == 1
    assert pinned.iteration_time_s > 1.3 * p.iteration_time_s


def test_the_128k_plan_is_priced_at_its_cp():
    p = long_plan()
    llm = p.unit("llm")
    cost = build_cost_model(_program(spec_text("mllm_72b_128k")))
    if llm.recompute:
        cost = with_recompute(cost)
    priced = cost.with_cp({"llm": llm.cp})
    fwd, _ = priced.fwd_bwd_time_s(priced.unit("llm"), llm.tp, llm.tp_across_nodes)
    per_stage = max(llm.layers_per_stage) / sum(llm.layers_per_stage)
    share = llm.microbatch_share
    assert llm.fwd_time_s == pytest.approx(share * fwd * per_stage, rel=1e-9)
    unpriced = cost.fwd_bwd_time_s(cost.unit("llm"), llm.tp, llm.tp_across_nodes)[0]
    assert fwd < unpriced / 2


TINY_CP = ("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  cp(llm) in {1, 2}\n")


def _tiny_cp() -> ir.Program:
    return _program(spec_text("tiny_cpu").replace(*TINY_CP))


def test_exhaustive_and_convex_agree_on_a_cp_layout():
    cost = build_cost_model(_tiny_cp()).with_cp({"llm": 2})
    for gpus in (4, 6):
        convex = plan_convex(cost, gpus)
        exhaustive = plan_exhaustive(cost, gpus)
        assert convex.iteration_time_s == pytest.approx(exhaustive.iteration_time_s, rel=1e-3)
        assert convex.unit("llm").cp == exhaustive.unit("llm").cp == 2
        _tiles(convex)
        _tiles(exhaustive)


def test_cp_multiplies_the_gpus_a_unit_takes():
    cost = build_cost_model(_tiny_cp())
    # Each unit on GPUs of its own: three GPUs hold tiny at cp 1, not with llm at cp 2.
    assert plan_exhaustive(cost, 3).gpus_used == 3
    with pytest.raises(Infeasible):
        plan_exhaustive(cost.with_cp({"llm": 2}), 3)


def test_the_planner_weighs_cp_against_none():
    cost = build_cost_model(_tiny_cp())
    assert [c for _, c in cp_choices(cost)] == [{"vit": 1, "llm": 2, "gen": 1}]
    p = plan(cost, 4, compare_baseline=False, placement="disaggregated")
    without = plan(build_cost_model(_program(spec_text("tiny_cpu"))), 4,
                   compare_baseline=False, placement="disaggregated")
    assert p.iteration_time_s <= without.iteration_time_s + 1e-12


def _at_cp(p, name: str, cp: int = 2, **update):
    units = tuple(u.model_copy(update={"cp": cp, "gpus": cp * u.gpus, **update})
                  if u.name == name else u for u in p.units)
    return p.model_copy(update={"units": units})


def test_compile_takes_backbone_and_encoder_cp_plans_and_refuses_the_rest():
    program = _tiny_cp()
    p = plan_exhaustive(build_cost_model(program).with_cp({"llm": 2}), 4)
    assert not [d for d in runtime_support(program, p) if "context" in d.message]
    # cp on an encoder unit of its own ranks: its patch rows are sharded (runs).
    assert not [d for d in runtime_support(program, _at_cp(p, "vit"))
                if "context" in d.message]
    # On a generator, and on an encoder run inside the backbone's stages: DT601.
    for name, update in (("gen", {}), ("vit", {"colocated": True})):
        found = [d for d in runtime_support(program, _at_cp(p, name, **update))
                 if "context parallelism" in d.message]
        assert [d.code for d in found] == ["DT601"], (name, found)
        assert name in found[0].message and f"cp({name}) == 1" in found[0].hint
        assert found[0].span == program.module(name).span
    # An encoder's Ulysses degree its heads cannot take (4 heads over 8): DT622.
    modules = tuple(m.model_copy(update={"context_parallel": "ulysses"})
                    if m.name == "vit" else m for m in program.modules)
    found = runtime_support(program.model_copy(update={"modules": modules}),
                            _at_cp(p, "vit", 8))
    assert [d.code for d in found if d.code == "DT622"] == ["DT622"]
    # A hand-edited Ulysses degree the heads cannot take (4 heads over 8): DT622.
    modules = tuple(m.model_copy(update={"context_parallel": "ulysses"})
                    if m.name == "llm" else m for m in program.modules)
    uly = program.model_copy(update={"modules": modules})
    units = tuple(u.model_copy(update={"cp": 8, "gpus": 8 * u.gpus // u.cp})
                  if u.name == "llm" else u for u in p.units)
    found = runtime_support(uly, p.model_copy(update={"units": units}))
    assert [d.code for d in found if d.code == "DT622"] == ["DT622"]


def test_reports_show_cp_only_where_a_unit_uses_it():
    from dtdsl.report import baseline_layout, plan_markdown, plan_table, plan_tables_stacked

    program = _tiny_cp()
    with_cp = plan_exhaustive(build_cost_model(program).with_cp({"llm": 2}), 4)
    plain = plan_exhaustive(build_cost_model(program), 4)
    headers = [c.header for c in plan_table(with_cp).columns]
    assert headers[3:6] == ["TP", "CP", "DP"]
    assert "CP" not in [c.header for c in plan_table(plain).columns]
    assert "| TP | CP | DP |" in plan_markdown(with_cp)
    assert "CP" not in plan_markdown(plain).split("\n")[2]
    assert "CP" in [c.header for c in plan_tables_stacked(with_cp)[0].columns]
    assert "llm tp 1 cp 2 dp" in baseline_layout(with_cp)


def test_the_planner_splits_a_long_video_encoders_clips_where_it_pays():
    cost = build_cost_model(long_video("cp(vit) in {1, 2, 4, 8}"))
    assert any(c["vit"] > 1 for _, c in cp_choices(cost))
    p = plan(cost, compare_baseline=False)
    assert p.unit("vit").cp > 1
    _tiles(p)
    assert not [d for d in runtime_support(cost.program, p) if d.code == "DT601"]
    pinned = plan(build_cost_model(long_video("cp(vit) == 1")), compare_baseline=False)
    assert pinned.unit("vit").cp == 1
    assert p.iteration_time_s < pinned.iteration_time_s


def test_the_planner_never_splits_a_generator():
    # cp(*) allows it everywhere; the runtime refuses a generator's (DT601).
    cost = build_cost_model(_program(spec_text("tiny_cpu").replace(
        *("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  cp(*) in {1, 2}\n"))))
    choices = [c for _, c in cp_choices(cost)]
    assert {c["gen"] for c in choices} == {1}
    assert {(c["vit"], c["llm"]) for c in choices} == {(1, 2), (2, 1), (2, 2)}


def test_a_cp_constraint_without_1_is_kept():
    # cp(vit) == 2: the cost model's own cp 1 is no candidate (nor is co-location, whose
    # encoders run whole on the backbone's ranks); the ViT gets GPUs of its own at cp 2.
    program = _program(spec_text("tiny_cpu").replace(*("  tp(*) in {1, 2}\n",
                                                       "  tp(*) in {1, 2}\n  cp(vit) == 2\n")))
    p = plan(build_cost_model(program), 4, compare_baseline=False)
    assert p.unit("vit").cp == 2 and p.placement == "disaggregated"
    _tiles(p)
    assert not [d for d in runtime_support(program, p) if d.code == "DT601"]
