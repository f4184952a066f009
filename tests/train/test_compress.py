"""Token compression at run time: multi-rank runs of the tiny spec with each compression
(the projector under the encoder's FSDP, its TP, its pipeline's last stage) train as the
single-process reference does; a compiled bundle's run against ``dtc reference`` is
tests/codegen/test_slurm.py's three-node job's."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.data.batch import SyntheticSource
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model, encode
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.runs import PARAM_RMS, PARAM_RTOL, plan_for, reference
from tests.specs import variant

STEPS = 3
RTOL = 1e-4
SHORT = "projector vit -> llm : mlp(depth=2)"


def _program(compress: str, batch: int = 8) -> ir.Program:
    p = variant(SHORT, f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})


def test_the_reference_hands_the_backbone_the_compressed_tokens():
    program = _program("pixel_shuffle(2)")
    torch.manual_seed(0)
    model = build_model(program)
    source = SyntheticSource(program)
    samples = [source.sample(0, i) for i in range(8)]
    embeds = encode(model, samples)
    rule = program.image_tokens()
    assert any(s.images for s in samples)
    for s, e in zip(samples, embeds, strict=True):
        patches = sum((im.shape[-2] // 8) * (im.shape[-1] // 8) for im in s.images)
        assert e.shape == (sum(rule(im.shape[-2], im.shape[-1]) for im in s.images), 128)
        assert 4 * e.shape[0] == patches


def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    results = ex.train(STEPS)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=RTOL), (r["step"], r["loss"], want)
    full = ex.full_parameters()       # collective over the stage's ranks
    assert full
    for name, p in full.items():
        init, want = params[name]
        err = (p.detach() - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


@pytest.mark.slow
@pytest.mark.parametrize(("compress", "vit"), [
    ("pixel_shuffle(2)", ("vit", "encoder", 1, 2, 1)),        # FSDP over two replicas
    ("avg_pool(3)", ("vit", "encoder", 2, 1, 1)),             # under the encoder's TP
    ("resampler(queries=4)", ("vit", "encoder", 1, 1, 2)),    # on its pipeline's last stage
])
def test_multi_rank_runs_match_the_reference(compress, vit):
    program = _program(compress)
    plan = plan_for(program, vit, ("llm", "backbone", 1, 1, 1), ("gen", "generator", 1, 1, 1))
    losses, params = reference(program, STEPS)
    if compress.startswith("resampler"):      # the resampler's own weights train too
        moved = params["vit_to_llm.compress.queries"]
        assert not torch.equal(moved[0], moved[1])
    run(_train, plan.gpus_used, program, plan, losses, params, timeout=240)


# The compiled bundle of a compressing projector (avg_pool(2)) against dtc reference:
# tests/codegen/test_slurm.py's three-node job carries it.


@pytest.mark.parametrize("compress", ["pixel_shuffle(2)", "avg_pool(2)", "resampler(queries=4)"])
def test_memcheck_measures_a_compressing_projector(compress):
    """``dtc memcheck``'s stand-in images are grids the compression divides (pixel
    shuffle: whole k x k blocks), as the data's own images are."""
    from dtdsl.train.memplan import check_memory

    program = _program(compress)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    # The encoder's and the backbone's stages, whose rows the compression sets (the
    # generator's replay, a third of the CPU, holds no compressed token).
    stages = check_memory(program, plan, jobs=1, units=("vit", "llm"))
    assert [s.unit for s in stages] == ["vit", "llm"]
    assert all(s.measured_bytes > 0 for s in stages)
