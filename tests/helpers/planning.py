"""Planning in tests: programs and cost models of spec texts, and the exact optimum
over a planner's candidates to compare its answers with."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from dtdsl.cost.model import build_cost_model
from dtdsl.driver import read_spec, run_frontend
from dtdsl.ir import program as ir
from dtdsl.planner.space import Space


@cache
def program(name: str) -> ir.Program:
    spec_name, data = read_spec(str(ROOT / "specs" / f"{name}.dt"))
    result = run_frontend(spec_name, data)
    assert result.ok, result.diagnostics
    return result.program



@cache
def cost(name: str):
    return build_cost_model(program(name))



ROOT = Path(__file__).resolve().parents[2]


def from_text(text: str) -> ir.Program:
    result = run_frontend("random.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program



def exact_candidate_optimum(space: Space, tps, dps, *, allowed: bool = False) -> float:
    """The best iteration time of one TP/DP candidate over every pipeline depth (with
    ``allowed``, only the GPU counts the spec's constraints allow each unit)."""
    ev = space.evaluator
    stage = [t * d for t, d in zip(tps, dps, strict=True)]
    spare = space.num_gpus - sum(stage)
    pps = [np.asarray([p for p in space.pps(i) if (p - 1) * stage[i] <= spare])
           for i in range(space.n)]
    if any(p.size == 0 for p in pps):
        return np.inf
    grids = np.meshgrid(*pps, indexing="ij", sparse=True)
    est = ev.evaluate(tps, dps, grids)
    used = sum(s * g for s, g in zip(stage, grids, strict=True))
    ok = np.asarray(est.feasible) & (used <= space.num_gpus)
    if allowed:
        for i in range(space.n):
            ok = ok & space.gpus_allowed(i, stage[i] * grids[i])
    return float(np.where(ok, est.iteration_time_s, np.inf).min()) if ok.any() else np.inf


@cache
def spec_text(name: str) -> str:
    return read_spec(str(ROOT / "specs" / f"{name}.dt"))[1].decode()


def long_video(vit_cp: str) -> ir.Program:
    """The 128K spec with its ViT reading each sample's video as one clip (2-frame
    patches, Qwen2-VL style: 64 to 128 frames of 1024 patches, 32K to 64K rows), Ulysses
    on the ViT, and ``vit_cp`` its cp constraint."""
    text = spec_text("mllm_72b_128k")
    for old, new in (
            ("encoder vit (image) {", "encoder vit (video) {"),
            ("patch=14)", "patch=14, temporal_patch=2)\n    context_parallel = ulysses"),
            ("    compress = pixel_shuffle(2)", "    # no compress"),
            ("  image.count   ~ choice([96, 192, 256], p=[0.3, 0.4, 0.3])\n"
             "  image.patches ~ 1024",
             "  video.count   ~ constant(1)\n"
             "  video.frames  ~ choice([64, 96, 128], p=[0.3, 0.4, 0.3])\n"
             "  video.patches ~ 1024"),
            ("cp(llm)   in {1, 2, 4, 8}", f"cp(llm)   in {{1, 2, 4, 8}}\n  {vit_cp}")):
        assert old in text, old
        text = text.replace(old, new)
    return from_text(text)
