"""A DiT generator over two pipeline stages (``train.generator``): its blocks split as
the plan says, the projector and patch embedding on the first stage, the unembedding and
the loss on the last, the tokens and the context sent between them; it trains as the
single-process reference does."""

from __future__ import annotations

import torch

from dtdsl.codegen.support import runtime_support
from dtdsl.ir import program as ir
from dtdsl.models.dit import DiT
from tests.helpers.runs import check, plan_for
from tests.specs import variant

STEPS = 8


def dit_program(batch: int = 8) -> ir.Program:
    """tiny_cpu with its U-Net generator a 4-block DiT, a global batch of ``batch``."""
    p = variant("""arch = unet(channels=32, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, head_dim=16,
                context_dim=64, groups=8)""",
                "arch = dit(layers=4, hidden=32, heads=2, ffn=64, patch=2, latent=8, "
                "latent_channels=4)")
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})


def test_the_dit_forward_is_its_stages_in_turn():
    arch = dit_program().module("gen").arch
    torch.manual_seed(0)
    dit = DiT(arch)
    for block in dit.blocks.values():      # adaLN-Zero starts every block as the identity
        torch.nn.init.normal_(block.ada.weight, std=0.02)
    latent, steps = torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 999])
    context = torch.randn(3, ir.COND_TOKENS, arch.context_dim)
    x = dit.embed(latent)
    code = dit.timestep_code(steps, x.dtype)
    x = dit.run_blocks(dit.run_blocks(x, code, context, stop=1), code, context, start=1)
    assert torch.equal(dit.unembed(x, latent.shape), dit(latent, steps, context))
    assert list(dit.blocks.keys()) == ["0", "1", "2", "3"]


def _plan(program: ir.Program):
    return plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 2))


def test_a_dit_on_two_stages_compiles():
    program = dit_program()
    plan = _plan(program)
    assert plan.unit("gen").layers_per_stage == (2, 2)
    assert runtime_support(program, plan) == []


def test_a_dit_on_two_stages_trains_as_the_reference():
    program = dit_program()
    check(program, _plan(program), steps=STEPS)


def test_an_interleaved_dit_trains_as_the_reference():
    # Two model chunks per stage (the planner interleaves a DiT whose blocks split into
    # pp x vpp chunks): stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3; the
    # conditioning enters at the first virtual stage, the loss leaves the last.
    from dtdsl.schedule.lower import lower
    from tests.helpers.plans import chunked, interleaved

    program = interleaved(dit_program())
    plan = chunked(_plan(program), "gen")
    assert {a.chunk for a in lower(plan, program).stage("gen", 0).actions} == {0, 1}
    check(program, plan, steps=STEPS)
