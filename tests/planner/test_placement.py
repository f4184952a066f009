"""Units placed on node boundaries: no TP group spans two nodes where one node can hold it,
a group that must span them is priced at the network's bandwidth, and the planner's GPU
accounting is the rank map's span (``ir.plan.place_units``, one rule for all three)."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from dtdsl.cost.model import build_cost_model
from dtdsl.ir.plan import Plan, place_units, straddling_tp_groups, tp_spans_nodes
from dtdsl.planner import plan_convex
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import make_plan
from dtdsl.planner.shortlist import near_layouts
from tests.helpers.planning import cost, program
from tests.specs import TINY
from tests.specs import program as tiny_program

SHIPPED = ("tiny_cpu", "mllm_9b", "mllm_15b", "mllm_72b", "audio_image", "llava_sd")


def _tiny(**edits: str) -> str:
    text = TINY.read_text()
    for old, new in edits.values():
        assert old in text, old
        text = text.replace(old, new)
    return text


# Nodes of 2 GPUs: a tp 2 unit after one of an odd GPU count would straddle.
PAIRS = _tiny(node=("gpus_per_node = 4", "gpus_per_node = 2"))

def _threes(llm_gpus: int) -> str:
    """Nodes of 3 GPUs, a network 4x slower than NVLink, llm pinned to tp 2 on
    ``llm_gpus`` GPUs and vit and gen on one each."""
    return _tiny(
        cluster=("gpus          = 4\n  gpus_per_node = 4\n  intra_node_bw = 4 GB/s\n"
                 "  inter_node_bw = 4 GB/s",
                 f"gpus          = {llm_gpus + 2}\n  gpus_per_node = 3\n"
                 "  intra_node_bw = 4 GB/s\n  inter_node_bw = 1 GB/s"),
        llm=("tp(*) in {1, 2}", f"tp(*) in {{1, 2}}\n  tp(llm) == 2\n  gpus(llm) == {llm_gpus}"
             "\n  gpus(vit) == 1\n  gpus(gen) == 1"))


# Eight ranks of tp 2 on nodes of 3 cross at least two node boundaries, and 2 does not
# divide 3: some group of llm spans two nodes wherever it starts.
FORCED = _threes(8)


def _check_placed(plan: Plan, gpus_per_node: int) -> None:
    """Units tile 0..gpus_used-1; no TP group of a degree that divides the node size
    spans two nodes, and a unit with one that does is priced so."""
    ranks = sorted(r for u in plan.units for r in u.ranks)
    assert ranks == list(range(plan.gpus_used)), "units tile the ranks"
    for u in plan.units:
        straddling = straddling_tp_groups(u, gpus_per_node)
        if gpus_per_node % u.tp == 0:
            assert not straddling, (plan.spec, u.name, u.first_rank, straddling[:3])
        assert u.tp_across_nodes == bool(straddling), (u.name, u.tp_across_nodes)


# ---- the rule -----------------------------------------------------------------------------------

def test_the_closed_form_agrees_with_the_rank_map():
    """``tp_spans_nodes`` (vectorised, for the planner) says what enumerating the groups
    (the compile check's way) says, for every start, tp and size on several node sizes."""
    from dtdsl.ir.plan import UnitPlan

    def unit(first: int, tp: int, groups: int) -> UnitPlan:
        return UnitPlan(name="u", role="encoder", projectors=(), gpus=tp * groups, tp=tp,
                        dp=groups, pp=1, first_rank=first, layers_per_stage=(1,),
                        microbatch_share=1.0, fwd_time_s=0.0, bwd_time_s=0.0,
                        dp_sync_time_s=0.0, memory_bytes=0.0, memory_limit_bytes=1.0)

    for per_node in (1, 2, 3, 4, 6, 8):
        for tp, groups in itertools.product((1, 2, 3, 4, 5, 6, 8, 12, 16), (1, 2, 3, 5)):
            firsts = np.arange(0, 3 * per_node + 1)
            closed = tp_spans_nodes(firsts, tp, tp * groups, per_node)
            for first, got in zip(firsts, closed, strict=True):
                want = bool(straddling_tp_groups(unit(int(first), tp, groups), per_node))
                assert bool(got) == want, (per_node, tp, groups, int(first))


def test_a_tp_2_unit_after_an_odd_count_starts_at_an_even_rank():
    placed = place_units([1, 2, 4], [3, 6, 4], 8)
    assert placed.first_rank[1] % 2 == 0 and placed.first_rank[2] % 4 == 0
    assert not any(placed.across_nodes)
    assert placed.span == 13
    # And through the planner, on nodes of two GPUs: the budget leaves vit one GPU.
    c = build_cost_model(tiny_program(PAIRS))
    result = plan_convex(c, 7)
    llm = result.unit("llm")
    assert llm.tp == 2 and llm.first_rank % 2 == 0
    assert any(u.gpus % 2 for u in result.units)
    _check_placed(result, 2)


@pytest.mark.parametrize("gpus", [672, 864, 1152])
def test_no_tp_group_across_nodes_on_the_72b_spec(gpus):
    """``dtc plan specs/mllm_72b.dt --gpus N`` chooses among the convex search's plan and
    the layouts near it (on drawn batches): none of them puts a TP group across nodes."""
    c = cost("mllm_72b")
    best = plan_convex(c, gpus)
    ev = Evaluator(c, gpus)
    near = [make_plan(ev, "convex", layout, solve_time_s=0.0, candidates=0,
                      convex_solves=0, evaluated=0)
            for layout in near_layouts(c, gpus, ceiling=best.iteration_time_s)]
    assert len(near) > 1
    for candidate in (best, *near):
        _check_placed(candidate, 8)
        assert not any(u.tp_across_nodes for u in candidate.units)


@pytest.mark.parametrize("name", SHIPPED)
def test_no_tp_group_across_nodes_on_the_shipped_specs(name):
    result = plan_convex(cost(name))
    _check_placed(result, program(name).cluster.gpus_per_node)


# ---- what cannot be avoided is priced ----------------------------------------------------------

def test_a_group_that_must_span_nodes_is_priced_at_the_network():
    p = tiny_program(FORCED)
    c = build_cost_model(p)
    result = plan_convex(c)
    llm = result.unit("llm")
    assert (llm.tp, llm.gpus) == (2, 8)
    assert llm.tp_across_nodes and straddling_tp_groups(llm, 3)
    _check_placed(result, 3)
    unit = c.unit("llm")
    intra, inter = c.tp_comm_time_s(unit, 2), c.tp_comm_time_s(unit, 2, True)
    # A ring all-reduce of 2 ranks moves its bytes once per layer: over 1 GB/s between
    # nodes instead of 4 GB/s within one.
    cluster = p.cluster
    assert inter - intra == pytest.approx(unit.tp_comm_bytes * (
        1 / cluster.inter_node_bw_bytes_per_s - 1 / cluster.intra_node_bw_bytes_per_s))
    assert cluster.intra_node_bw_bytes_per_s == 4 * cluster.inter_node_bw_bytes_per_s
    # The plan's stage time carries the network's price, by exactly the difference.
    heaviest = max(llm.layers_per_stage) / sum(llm.layers_per_stage)
    fwd_in, _ = c.fwd_bwd_time_s(unit, 2)
    fwd_x, _ = c.fwd_bwd_time_s(unit, 2, True)
    assert fwd_x - fwd_in == pytest.approx(inter - intra)
    assert llm.fwd_time_s == pytest.approx(llm.microbatch_share * fwd_x * heaviest)
    # The evaluator prices the same layout so; on nodes that hold the group, it does not.
    ev = Evaluator(c, p.cluster.num_gpus)
    tps = tuple(u.tp for u in result.units)
    dps = tuple(u.dp for u in result.units)
    pps = tuple(u.pp for u in result.units)
    est = ev.evaluate(tps, dps, pps)
    assert float(est.iteration_time_s) == pytest.approx(result.iteration_time_s)
    roomy = tiny_program(FORCED.replace("gpus_per_node = 3", "gpus_per_node = 6"))
    est_roomy = Evaluator(build_cost_model(roomy), 6).evaluate(tps, dps, pps)
    assert not any(bool(x) for x in est_roomy.tp_across_nodes)
    assert float(est_roomy.iteration_time_s) < float(est.iteration_time_s)


def test_a_tp_that_does_not_divide_the_node_is_placed_where_it_fits():
    """Four ranks of tp 2 on nodes of 3: from rank 0 or 2 a group crosses a boundary,
    from rank 1 (after a one-GPU unit) none does; the placement finds that order."""
    for tps, gpus in (((1, 2, 1), (1, 4, 1)), ((2, 1, 1), (4, 1, 1))):
        placed = place_units(tps, gpus, 3)
        at = tps.index(2)
        assert placed.first_rank[at] == 1 and not any(placed.across_nodes)
    result = plan_convex(build_cost_model(tiny_program(_threes(4))))
    llm = result.unit("llm")
    assert (llm.gpus, llm.first_rank, llm.tp_across_nodes) == (4, 1, False)
    _check_placed(result, 3)
    # Grids: the order is chosen per layout. Two ranks of tp 2 fit after one rank of
    # tp 1 (from rank 1), not after two (from rank 2): then they go first.
    placed = place_units((2, 1), (2, np.array([1, 2])), 3)
    assert placed.first_rank[0].tolist() == [1, 0]
    assert placed.first_rank[1].tolist() == [0, 2]
    assert not np.any(placed.across_nodes[0]) and placed.span.tolist() == [3, 4]


# ---- one account of GPUs -----------------------------------------------------------------------

@cache
def _pairs_cost():
    return build_cost_model(tiny_program(PAIRS))


def test_the_planners_gpu_count_is_the_rank_maps_span():
    c = _pairs_cost()
    ev = Evaluator(c, 16)
    pps = np.arange(1, 3)
    est = ev.evaluate((1, 2, 1), (3, 2, 1), (pps[:, None, None], pps[None, :, None],
                                            pps[None, None, :]))
    grid = np.broadcast_to(est.gpus, (2, 2, 2))
    for k in itertools.product(range(2), repeat=3):
        counts = [3 * int(pps[k[0]]), 4 * int(pps[k[1]]), int(pps[k[2]])]
        firsts = [int(np.broadcast_to(f, (2, 2, 2))[k]) for f in est.first_rank]
        ends = sorted(zip(firsts, counts, strict=True))
        # Back to back from 0, the tp 2 unit first: the span is what the units hold.
        assert ends[0][0] == 0 and all(a + n == b for (a, n), (b, _) in
                                       itertools.pairwise(ends))
        assert int(grid[k]) == ends[-1][0] + ends[-1][1] == sum(counts)
        assert firsts[1] == 0
    result = plan_convex(c, 7)
    assert result.gpus_used == max(u.first_rank + u.gpus for u in result.units) == \
        sum(u.gpus for u in result.units)
