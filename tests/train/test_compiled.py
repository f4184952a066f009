"""Compiled blocks (train.compiled): a compiled stage trains as the eager one does, with a
bounded number of graphs over microbatches of drawn lengths. On the CPU with inductor (gcc):
the first compile of a kind of block takes seconds; inductor's cache makes later runs
faster."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.train.test_executor import plan_for

# Compiled and eager differ by float summation order only (inductor fuses and reorders
# reductions), which Adam's first steps amplify: a relative tolerance on the losses.
LOSS_RTOL = 1e-4
STEPS = 6

TEXT_SPEC = """spec compiled_text
model {
  backbone llm {
    arch = transformer(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, swiglu)
  }
}
data text {
  text.tokens ~ lognormal(median=40, sigma=0.6) clamp [8, 120]
}
cluster c {
  gpu = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus = 2
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}
train {
  global_batch = 8
  micro_batch = 2
  seq_len = 128
  optimizer = adamw(lr=1e-3)
  precision = fp32
  reorder = []
  seed = 7
  COMPILE
}
"""


def text_program(compile: str = "") -> ir.Program:
    result = run_frontend("compiled_text.dt", TEXT_SPEC.replace("COMPILE", compile).encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def _losses(rank: int, world: int, program: ir.Program, plan: Plan, steps: int,
            out: dict) -> None:
    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    results = [ex.run_step(s) for s in range(steps)]
    compiled = ex.stage.compiled
    out_file = out["file"]
    if rank == 0:
        with open(out_file, "w") as f:
            f.write(repr({"losses": [r["loss"] for r in results],
                          "blocks": compiled.blocks if compiled else None,
                          "graphs": compiled.graphs if compiled else None}))


def _run(program: ir.Program, plan: Plan, steps: int, tmp_path, tag: str) -> dict:
    path = tmp_path / f"{tag}.txt"
    run(_losses, plan.gpus_used, program, plan, steps, {"file": str(path)}, timeout=600)
    import ast

    return ast.literal_eval(path.read_text())


@pytest.mark.parametrize("tp", [1, 2], ids=["one-rank", "tp2"])
def test_compiled_stage_trains_as_eager(tmp_path, tp):
    eager = text_program()
    compiled = text_program("compile = true")
    assert eager.train.compile is None and compiled.train.compile is True
    plan = plan_for(eager, ("llm", "backbone", tp, 1, 1))
    want = _run(eager, plan, STEPS, tmp_path, "eager")
    got = _run(compiled, plan, STEPS, tmp_path, "compiled")
    assert want["blocks"] is None     # unset: eager on the CPU
    assert got["blocks"] == ["llm.layers.0", "llm.layers.1"]
    for g, w in zip(got["losses"], want["losses"], strict=True):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (got["losses"], want["losses"])
    # Drawn lengths every microbatch, one kind of layer: the first compile is dynamic, so
    # a small constant number of graphs, not one per length.
    assert 1 <= got["graphs"] <= 4, got["graphs"]


def test_the_rule_is_one_function():
    assert text_program().train.compiles("cuda")
    assert not text_program().train.compiles("cpu")
    assert text_program("compile = true").train.compiles("cpu")
    assert not text_program("compile = false").train.compiles("cuda")
    assert torch is not None
