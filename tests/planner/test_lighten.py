"""Recomputation chosen per unit (``planner.lighten``): a unit that fits without
recomputing does not pay for the neighbour that needs it."""

from __future__ import annotations

from functools import cache

from dtdsl.cost.model import build_cost_model
from dtdsl.ir import program as ir
from dtdsl.planner import plan
from dtdsl.planner.baseline import with_recompute
from dtdsl.planner.lighten import lightened
from dtdsl.planner.placement import plan_fits
from tests.helpers.planning import ROOT, from_text


@cache
def _tight():
    """tiny_cpu in 32 MiB a GPU: the backbone fits only recomputing, the others without."""
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    assert "memory=4 GiB" in text
    return build_cost_model(from_text(text.replace("memory=4 GiB", "memory=32 MiB")))


def test_only_the_unit_that_needs_it_recomputes():
    cost = _tight()
    result = plan(cost, placement="disaggregated", compare_baseline=False)
    modes = {u.name: ir.Recompute.of(u.recompute) for u in result.units}
    assert modes["llm"] is not ir.Recompute.NONE
    assert modes["vit"] is ir.Recompute.NONE and modes["gen"] is ir.Recompute.NONE
    # The plan fits as the runtime runs it, each unit at its own mode ...
    assert plan_fits(with_recompute(cost, modes=modes), result)
    # ... and the backbone does not fit at that layout without recomputing.
    assert not plan_fits(cost, result)


def test_lightening_is_faster_than_recomputing_alike():
    cost = _tight()
    result = plan(cost, placement="disaggregated", compare_baseline=False)
    mode = ir.Recompute.of(next(u.recompute for u in result.units if u.name == "llm"))
    alike = with_recompute(cost, mode=mode)
    assert alike is not None
    uniform = plan(alike, placement="disaggregated", compare_baseline=False)
    assert all(u.recompute for u in uniform.units)
    assert result.iteration_time_s < uniform.iteration_time_s


def test_a_plan_at_the_specs_recomputation_is_kept():
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    cost = build_cost_model(from_text(text))
    result = plan(cost, placement="disaggregated", compare_baseline=False)
    assert not any(u.recompute for u in result.units)
    assert lightened(cost, result, cost) == (result, cost)


def test_recomputing_variants_price_on_the_draw_they_were_built_on(monkeypatch):
    # Recomputation changes no sample: the variants the planner and the lightening price
    # reuse the cost model's draw (a packed spec at a long seq_len took a second a draw,
    # a dozen of them a plan).
    import dtdsl.cost.model as model

    cost = _tight()
    drawn = cost.drawn()

    def refuse(*_args, **_kwargs):
        raise AssertionError("drew the samples again")

    monkeypatch.setattr(model, "draw_samples", refuse)
    for again in (with_recompute(cost), with_recompute(cost, mode=ir.Recompute.SELECTIVE),
                  with_recompute(cost, modes={"llm": ir.Recompute.FULL})):
        assert again is not None and again.drawn() is drawn
        assert again.units != cost.units          # priced again, on the same draw
    result = plan(cost, placement="disaggregated", compare_baseline=False)
    assert any(u.recompute for u in result.units)
