"""The co-located placement: encoders on the backbone's first pipeline stage, generators on
its last (``planner.placement``), weighed against disaggregation, and searched with and
without recomputation."""

from __future__ import annotations

import math
from functools import cache

import pytest

from dtdsl import cli
from dtdsl.cost.model import build_cost_model
from dtdsl.ir.plan import Plan
from dtdsl.ir.plan_check import plan_problems
from dtdsl.planner import Infeasible, plan
from dtdsl.planner.placement import colocated_layouts, plan_fits
from tests.helpers.planning import cost, from_text, program
from tests.specs import TINY

VIT_H = "arch = transformer(layers=32, hidden=1280, heads=16, ffn=5120, patch=14)"


@cache
def _nine_b(vit: str):
    """mllm_9b with another image encoder."""
    text = (TINY.parent / "mllm_9b.dt").read_text()
    assert VIT_H in text
    return build_cost_model(from_text(text.replace(VIT_H, vit)))


def test_a_small_encoder_is_co_located_and_a_heavy_one_is_not():
    """Where the encoder is a small share of the work, sharing the backbone's GPUs beats
    GPUs of its own; a heavy one (5.4B, InternViT-6B-class) needs its own."""
    small = plan(_nine_b("arch = transformer(layers=8, hidden=768, heads=12, ffn=3072, "
                         "patch=14)"), compare_baseline=False)
    heavy = plan(_nine_b("arch = transformer(layers=48, hidden=3072, heads=24, ffn=12288, "
                         "patch=14)"), compare_baseline=False)
    for result in (small, heavy):
        # auto weighs them all and keeps the fastest, by the planner's own figures.
        assert set(result.placements) == {"disaggregated", "colocated", "phased"}
        assert result.placements[result.placement] == min(result.placements.values())
        assert result.placements[result.placement] == result.iteration_time_s
    # The small encoder shares the backbone's GPUs: on its first stage, or phased (its
    # forward and backward over all of them, before and after the pipeline).
    assert small.placement in ("colocated", "phased")
    assert small.placements["disaggregated"] > max(small.placements["colocated"],
                                                   small.placements["phased"])
    assert heavy.placement == "disaggregated"
    # By 3.4% as priced now (5.4% while a backbone's gradient reduction was all exposed
    # after its last backward: hiding it helps the co-located plan's deeper stages more).
    assert heavy.placements["colocated"] > 1.03 * heavy.placements["disaggregated"]


@pytest.mark.parametrize("name", ["tiny_cpu", "mllm_9b", "audio_image"])
def test_co_located_plans_hold_their_modules_on_the_backbone_stages(name):
    """Every set of co-located modules is weighed: those in it run on the backbone's GPUs
    (its TP groups and replicas), the others on GPUs of their own beside it."""
    found = colocated_layouts(cost(name))
    assert found, name
    keys = [(frozenset(u.name for u in p.units if u.colocated),
             next(u.pp for u in p.units if u.role == "backbone")) for p in found]
    assert len(set(keys)) == len(keys)      # one per set and backbone depth
    others = {u.name for u in found[0].units if u.role != "backbone"}
    assert {k for k, _ in keys} >= {frozenset(others)}
    assert [p.iteration_time_s for p in found] == sorted(p.iteration_time_s for p in found)
    for result in found:
        backbone = next(u for u in result.units if u.role == "backbone")
        assert not result.rigid and result.placement == "colocated"
        assert result.gpus_used == sum(u.gpus for u in result.units) <= result.num_gpus
        assert backbone.gpus == backbone.tp * backbone.dp * backbone.pp
        assert sum(backbone.layers_per_stage) == cost(name).unit(backbone.name).layers
        assert min(backbone.layers_per_stage) >= 1
        for u in result.units:
            if u is backbone:
                continue
            if u.colocated:
                assert u.gpus == 0 and u.pp == 1
                assert (u.tp, u.dp, u.first_rank, u.microbatch_share) == \
                    (backbone.tp, backbone.dp, backbone.first_rank, 1.0)
            else:
                assert u.gpus == u.tp * u.dp * u.pp > 0 and u.pp == 1
                assert u.microbatch_share == backbone.dp / u.dp
        ranks = sorted((u.first_rank, u.gpus) for u in result.units if u.gpus)
        assert [r for r, _ in ranks] == [sum(g for _, g in ranks[:k]) for k in range(len(ranks))]
        assert plan_fits(cost(name), result)
        assert plan_problems(result, program(name)) == []
        assert Plan.model_validate_json(result.model_dump_json()) == result


def test_a_module_the_backbone_tp_cannot_split_is_replicated_over_it():
    """SD 2.1's first level has 5 heads: co-located on a backbone of tp 2 it runs whole on
    both ranks of each TP group, priced at tp 1."""
    found = [p for p in colocated_layouts(cost("mllm_9b"))
             if p.unit("llm").tp > 1 and p.unit("sd").colocated]
    assert found
    sd = cost("mllm_9b").unit("sd")
    fwd, bwd = cost("mllm_9b").fwd_bwd_time_s(sd, 1)
    for result in found:
        assert result.unit("sd").tp_replicated
        assert not result.unit("vit").tp_replicated
        assert math.isclose(result.unit("sd").fwd_time_s, fwd, rel_tol=1e-9)
        assert math.isclose(result.unit("sd").bwd_time_s, bwd, rel_tol=1e-9)


def test_placement_colocated_says_why_nothing_co_locates():
    pinned = TINY.read_text().replace("tp(*) in {1, 2}", "tp(*) in {1, 2}\n  gpus(vit) == 1")
    with pytest.raises(Infeasible, match="vit is constrained to GPUs of its own"):
        plan(build_cost_model(from_text(pinned)), placement="colocated",
             compare_baseline=False)
    # auto falls back to the placement that exists.
    result = plan(build_cost_model(from_text(pinned)), compare_baseline=False)
    assert result.placement == "disaggregated" and set(result.placements) == {"disaggregated"}


def test_a_layout_that_fits_only_recomputing_is_planned_so():
    """On 20 MiB GPUs the tiny spec's backbone fits only with every layer recomputed: the
    planner searches that too (as the baselines may), and the plan says so per unit (the
    encoder and generator fit without: ``planner.lighten``)."""
    text = TINY.read_text().replace("memory=4 GiB", "memory=20 MiB")
    tight = build_cost_model(from_text(text))
    assert not any(m.recompute for m in tight.program.modules)
    result = plan(tight, compare_baseline=False)
    assert {u.name: u.recompute for u in result.units} == {
        "vit": "none", "llm": "full", "gen": "none"}
    assert not plan_fits(tight, result)              # the spec's own settings do not fit
    roomy = plan(cost("tiny_cpu"), compare_baseline=False)
    assert not any(u.recompute for u in roomy.units)


def test_dtc_plan_explains_the_placement(capsys):
    assert cli.main(["plan", str(TINY), "--simulate-steps", "0", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "placement" in out and "next best at mean work" in out
    assert cli.main(["plan", str(TINY), "--simulate-steps", "0", "--no-baseline",
                     "--placement", "disaggregated", "--json"]) == 0
    result = Plan.model_validate_json(capsys.readouterr().out)
    assert result.placement == "disaggregated" and result.placements is None   # one weighed
    with pytest.raises(SystemExit):
        cli.main(["plan", str(TINY), "--placement", "everywhere"])


@pytest.mark.parametrize("name", ["tiny_cpu", "mllm_9b"])
def test_phased_plans_run_their_encoders_on_every_backbone_gpu(name):
    """``--placement phased``: an encoder's replicas are the backbone's ranks (its dp the
    backbone's dp x pp, its TP the backbone's, no GPU of its own), its backward
    recomputes, and the plan's time holds both phases on top of the pipeline."""
    priced = cost(name)
    found = colocated_layouts(priced, placement="phased")
    assert found, name
    assert [p.iteration_time_s for p in found] == sorted(p.iteration_time_s for p in found)
    for result in found:
        assert result.placement == "phased" and plan_fits(priced, result)
        backbone = next(u for u in result.units if u.role == "backbone")
        phased = [u for u in result.units if u.phased]
        assert phased and all(u.role == "encoder" for u in phased)
        for u in phased:
            assert (u.gpus, u.tp, u.dp, u.pp, u.first_rank) == (
                0, backbone.tp, backbone.dp * backbone.pp, 1, backbone.first_rank)
            assert u.recompute and not u.colocated
            assert math.isclose(u.microbatch_share, 1 / backbone.pp)
            # Both phases are in the iteration: on each pipeline rank a 1/pp share of
            # every microbatch of the step (a unit microbatch each).
            phases = result.num_microbatches * (u.fwd_time_s + u.bwd_time_s)
            assert result.warmup_time_s > phases
        assert sum(u.gpus for u in result.units) == result.gpus_used


def test_phased_needs_an_encoder():
    """A spec whose only modules beside the backbone are generators has nothing to run
    phased: ``--placement phased`` says so, ``auto`` weighs the others."""
    text = TINY.read_text()
    start = text.index("  encoder vit")
    no_encoder = text[:start] + text[text.index("  backbone llm"):]
    no_encoder = no_encoder.replace("  projector vit -> llm : mlp(depth=2)\n", "")
    priced = build_cost_model(from_text(no_encoder))
    with pytest.raises(Infeasible, match="no encoder to run phased"):
        plan(priced, placement="phased", compare_baseline=False)
    result = plan(priced, compare_baseline=False)
    assert "phased" not in result.placements


def test_a_small_encoder_runs_in_the_pipelines_bubbles():
    """A small encoder on the 9b backbone (3 stages, 16 microbatches): phased, its steps
    in the pipeline's bubbles (``Colocation.bubbles_s``), beats co-location by the
    planner's own figures, by more than the phases before and after the pipeline did
    (0.6%), and auto picks it; the plan's later stages encode steps."""
    from dtdsl.reorder.workload import phase_fit

    small = plan(_nine_b("arch = transformer(layers=8, hidden=768, heads=12, ffn=3072, "
                         "patch=14)"), compare_baseline=False)
    assert small.placement == "phased"
    assert small.placements["colocated"] > 1.015 * small.placements["phased"]
    fit = phase_fit(small)
    assert {1, 2} <= set(fit.owners)
    # What the bubbles leave exposed is less than the phases' 1/pp share each way.
    (enc,) = [u for u in small.units if u.phased]
    phases = small.num_microbatches * (enc.fwd_time_s + enc.bwd_time_s)
    assert fit.exposed_f + fit.exposed_b < 0.8 * phases


@pytest.mark.parametrize("placement", ["colocated", "phased"])
def test_layouts_that_cannot_win_are_left_unpriced_without_changing_the_result(
        placement, monkeypatch):
    """``_Mixed.best`` skips a depth whose time before the phased encoders' exposure
    already reaches the best found: the layouts are those of the search that prices every
    depth, to the bit."""
    from dtdsl.planner import placement as module

    priced = cost("mllm_9b")
    pruned = colocated_layouts(priced, placement=placement)
    skipped = []
    best = module._Mixed.best

    def every_depth(self, tp, dp, pps, to_beat=None):
        full = best(self, tp, dp, pps)
        kept = best(self, tp, dp, pps, to_beat)
        skipped.append(len(full) - len(kept))
        return full

    monkeypatch.setattr(module._Mixed, "best", every_depth)

    def timeless(plans):
        return [p.model_copy(update={"solve_time_s": 0.0}) for p in plans]

    assert timeless(colocated_layouts(priced, placement=placement)) == timeless(pruned)
    assert sum(skipped) > 0, "nothing was left unpriced"
