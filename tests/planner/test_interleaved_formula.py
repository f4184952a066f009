"""The planner's pipeline formula (``Evaluator.evaluate``: warm-up + steady) against the
lowered schedule's simulated time for a lone backbone, interleaved or not, with every
pass as long as the evaluator prices it and transfers free."""

from __future__ import annotations

import math
from functools import cache

import pytest

from dtdsl.cost.model import CostModel, CostParams, build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.planner.evaluate import Evaluator
from dtdsl.schedule.lower import GradientFlow, lower_units
from dtdsl.sim.simulate import Durations, simulate

LAYERS = 48
SPEC = """
spec lone
model {{
  backbone llm {{
    arch = transformer(layers={layers}, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512,
                       swiglu)
  }}
}}
data text {{
  text.tokens ~ constant(64)
}}
cluster {{ gpu = H100  gpus = 64 }}
train {{
  global_batch = {m}
  micro_batch  = 1
  seq_len      = 128
  schedule     = interleaved(virtual_stages={v})
}}
"""


@cache
def cost(m: int, v: int) -> CostModel:
    result = run_frontend("lone.dt", SPEC.format(layers=LAYERS, m=m, v=v).encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return build_cost_model(result.program, CostParams(samples=64))


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (8, 2), (2, 3), (4, 3), (8, 3)])
def test_formula_equals_the_simulated_schedule(p: int, v: int, monkeypatch):
    # Transfers free: the formula's hops and the simulator's links are another matter.
    monkeypatch.setattr(CostModel, "p2p_time_s", lambda self, num_bytes: 0.0)
    interleaved = 0
    for m in range(1, 3 * p + 1):
        ev = Evaluator(cost(m, v), 64)
        assert ev.microbatches(1) == m and ev.edge_s == 0.0
        est = ev.evaluate([1], [1], [p])
        vpp = int(est.vpp[0])
        interleaved += vpp > 1
        fwd, bwd = ev.fwd_bwd(0, 1)
        share = math.ceil(LAYERS / p) / LAYERS
        assert float(est.stage_time_s[0]) == pytest.approx((fwd + bwd) * share, rel=1e-12)
        unit = ScheduleUnit(name="llm", role="backbone", tp=1, dp=1, pp=p, vpp=vpp)
        base = Schedule.skeleton("interleaved", m, (unit,))
        schedule = lower_units(base, GradientFlow.everywhere(base))
        simulated = simulate(schedule, Durations.uniform(schedule, fwd * share, bwd * share)
                             ).iteration_time_s
        assert float(est.warmup_s + est.steady_s) == pytest.approx(simulated, rel=1e-9, abs=0), m
    # The evaluator interleaves from pp microbatches on (Evaluator.vpp): 2p + 1 counts.
    assert interleaved == 2 * p + 1
