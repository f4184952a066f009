"""Selective recomputation (issue 30 item 4): the planner raises a unit to the lightest
recomputation that fits, the attention core where that is enough, every layer where
only that is."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from dtdsl.cost.model import build_cost_model
from dtdsl.ir import program as ir
from dtdsl.planner import Infeasible, plan, plan_convex
from dtdsl.planner.baseline import with_recompute
from dtdsl.report import plan_table
from tests.helpers.planning import from_text

# A text-only backbone on two GPUs whose memory is mostly activations: at 74 MiB the
# layout (tp 2) fits with its attention cores recomputed but not without; at 68 MiB
# only with every layer recomputed.
TEXT = """spec text_only
model {
  backbone llm {
    arch = transformer(layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, swiglu)
  }
}
data tiny {
  text.tokens ~ lognormal(median=400, sigma=0.1) clamp [8, 512]
  source = "data/tiny"
}
cluster local {
  gpu = custom(name="cpu", memory=MEM MiB, peak=0.1 TFLOPS)
  gpus = 2
  gpus_per_node = 2
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}
train {
  global_batch = 32
  micro_batch = 8
  seq_len = 512
  schedule = 1f1b
  optimizer = adamw(lr=1e-3, zero=1)
  precision = fp32
}
"""


def _cost(mib: int):
    return build_cost_model(from_text(TEXT.replace("MEM", str(mib))))


def _table(chosen) -> str:
    out = io.StringIO()
    Console(file=out, width=300).print(plan_table(chosen))
    return out.getvalue()


def _searched(cost, mode: ir.Recompute | None):
    """The convex search's plan of ``cost`` with every unit at ``mode`` (None: as the
    spec says), or None where nothing fits so."""
    priced = cost if mode is None else with_recompute(cost, mode=mode)
    try:
        return plan_convex(priced, 2)
    except Infeasible:
        return None


def test_selective_is_chosen_where_it_fits_and_costs_less_than_full():
    cost = _cost(77)
    assert _searched(cost, None) is None            # memory forces recomputation
    selective = _searched(cost, ir.Recompute.SELECTIVE)
    full = _searched(cost, ir.Recompute.FULL)
    assert selective is not None and full is not None
    assert selective.iteration_time_s < full.iteration_time_s
    chosen = plan(cost, 2, compare_baseline=False)
    assert [u.recompute for u in chosen.units] == [ir.Recompute.SELECTIVE]
    assert chosen.iteration_time_s == pytest.approx(selective.iteration_time_s)
    # The plan table says which recomputation each unit runs.
    assert "recompute selective" in _table(chosen)


def test_full_is_chosen_where_only_it_fits():
    cost = _cost(68)
    assert _searched(cost, None) is None
    assert _searched(cost, ir.Recompute.SELECTIVE) is None
    chosen = plan(cost, 2, compare_baseline=False)
    assert [u.recompute for u in chosen.units] == [ir.Recompute.FULL]
    assert "recompute" in _table(chosen) and "selective" not in _table(chosen)


def test_no_recomputation_where_the_layout_fits_without():
    chosen = plan(_cost(80), 2, compare_baseline=False)
    assert [u.recompute for u in chosen.units] == [ir.Recompute.NONE]


def test_an_old_plans_bool_reads_as_full_or_none():
    """Plans written before the modes stored ``recompute`` as a bool."""
    chosen = plan(_cost(68), 2, compare_baseline=False)
    data = chosen.model_dump(mode="json")
    assert data["units"][0]["recompute"] == "full"
    for old, mode in ((True, ir.Recompute.FULL), (False, ir.Recompute.NONE)):
        data["units"][0]["recompute"] = old
        assert type(chosen).model_validate(data).units[0].recompute is mode
