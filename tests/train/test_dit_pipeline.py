"""A DiT generator over two pipeline stages (``train.generator``): its blocks split as
the plan says, the projector and patch embedding on the first stage, the unembedding and
the loss on the last, the tokens and the context sent between them; it trains as the
single-process reference does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dtdsl.codegen.support import runtime_support
from dtdsl.ir import program as ir
from dtdsl.models.dit import DiT
from tests.helpers.runs import check, plan_for
from tests.specs import variant

# 4 steps: a block on the wrong stage or a context passed wrongly shows from the first
# step, and Adam's moments go through several updates.
STEPS = 4


_UNET = """arch = unet(channels=32, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, head_dim=16,
                context_dim=64, groups=8)"""
_DIT = "arch = dit(layers=4, hidden=32, heads=2, ffn=64, patch=2, latent=8, latent_channels=4)"


def dit_program(batch: int = 8) -> ir.Program:
    """tiny_cpu with its U-Net generator a 4-block DiT, a global batch of ``batch``."""
    p = variant(_UNET, _DIT)
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


# The DiT on two stages, plain: test_a_dit_on_two_stages_under_tensor_parallelism and
# test_an_interleaved_dit_trains_as_the_reference train the same split against the
# reference (parameters too), and the resume test's first leg runs this very plan.


def test_a_recomputed_dit_on_three_stages_trains_as_the_reference():
    # A middle stage passes the context on, its gradient summed with its own blocks'
    # (and, in a microbatch without targets, both tensors through untouched); each block
    # recomputed in backward.
    program = dit_program()
    modules = tuple(m.model_copy(update={"recompute": ir.Recompute.FULL})
                    if m.name == "gen" else m for m in program.modules)
    program = program.model_copy(update={"modules": modules})
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 3))
    assert plan.unit("gen").layers_per_stage == (2, 1, 1)
    check(program, plan, steps=STEPS)


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


@pytest.mark.usefixtures("deterministic")   # compares losses bitwise
def test_a_split_dit_resumes_bitwise_and_under_one_stage(tmp_path):
    # A checkpoint holds the whole model under its single-process names, whatever stage
    # held a block: the same plan resumes bitwise, a plan with the DiT on one stage
    # reshards it and stays on the reference. (Saved after step 2 of 4: two steps on
    # either side of the checkpoint.)
    from torch.distributed.checkpoint import FileSystemReader

    from dtdsl.ir.checkpoint import checkpoint_root, read_manifest
    from dtdsl.models.multimodal import build_model
    from tests.dist import run
    from tests.helpers.checkpoints import _close, _phase
    from tests.helpers.runs import reference

    program = dit_program()
    two = _plan(program)
    one = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                   ("gen", "generator", 1, 1, 1))

    def go(plan, run_dir, steps, saves, name):
        out = tmp_path / name
        run(_phase, plan.gpus_used, program, plan, str(run_dir), steps, saves, str(out),
            None, timeout=240)
        return json.loads(out.read_text())

    ref, _ = reference(program, 4)
    a_dir = tmp_path / "a"
    a = go(two, a_dir, 4, {2: "sync"}, "a.json")
    assert a["first"] == 0
    _close(a["losses"], ref)
    ckpt = checkpoint_root(a_dir) / "ckpt-2"
    assert [u.text for u in read_manifest(ckpt).units] == [
        "vit:tp1dp1pp1", "llm:tp1dp1pp1", "gen:tp1dp1pp2"]
    keys = {k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
            if k.startswith("model.")}
    whole = dict(build_model(program).named_parameters())
    assert keys == {f"model.{n}" for n in whole}
    # `dtc export` writes the DiT under dtdsl's names, whole, from the split run's save.
    from safetensors import safe_open

    from dtdsl.train.export import export_checkpoint

    export_checkpoint(ckpt, tmp_path / "export", units=["gen"])
    with safe_open(str(tmp_path / "export" / "gen" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}   # noqa: SIM118
    assert shapes == {n.removeprefix("units.gen."): tuple(p.shape)
                      for n, p in whole.items() if n.startswith("units.gen.")}
    for name, plan in (("same", two), ("one", one)):
        shutil.copytree(ckpt, checkpoint_root(tmp_path / name) / "ckpt-2")
        b = go(plan, tmp_path / name, 2, {}, f"{name}.json")
        assert b["first"] == 2
        if plan is two:
            assert b["losses"] == a["losses"][2:]
        else:
            assert "resharded from" in b["logs"][0]
            _close(b["losses"], ref[2:])


def test_memcheck_measures_each_stage_of_a_split_dit():
    # `dtc memcheck` builds each of the DiT's stages alone on fake tensors and runs its
    # passes: the first from the conditioning, the second from the tokens and context.
    from dtdsl.train.memplan import check_memory
    from tests.helpers.plans import chunked, interleaved

    program = dit_program()
    for prog, plan in ((program, _plan(program)),
                       (interleaved(program), chunked(_plan(program), "gen"))):
        # The DiT's stages only (the encoder's and the backbone's measure as in any plan).
        stages = {(s.unit, s.stage): s for s in check_memory(
            prog, plan, jobs=1, stages={("gen", 0), ("gen", 1)})}
        first, last = stages[("gen", 0)], stages[("gen", 1)]
        for s in (first, last):
            assert s.measured_bytes > 0 and s.predicted_bytes > 0
            assert sum(s.by_category.values()) == s.measured_bytes
        # The projector into the DiT (fp32 weights, Adam's moments) lives on the first.
        assert first.by_category["params"] > last.by_category["params"]


def test_a_bundle_with_a_split_dit_comes_up(tmp_path):
    # `dtc compile` plans the DiT pinned to two stages; the dry run brings every rank up:
    # the DiT's PP group, and both its stages read their samples' targets.
    from dtdsl import cli
    from dtdsl.ir.plan import Plan
    from dtdsl.train import dryrun
    from tests.specs import TINY

    spec = tmp_path / "dit.dt"
    spec.write_text(TINY.read_text().replace(_UNET, _DIT).replace(
        "  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  pp(gen) == 2"))
    assert cli.main(["compile", str(spec), "-o", str(tmp_path / "b"), "--synthetic"]) == 0
    plan = Plan.model_validate_json((tmp_path / "b" / "plan.json").read_bytes())
    assert plan.unit("gen").pp == 2
    report = dryrun.dry_run(tmp_path / "b", steps=2)
    assert report.ok, report.problems[:20]
    gen = [c for c in report.ranks if c.unit == "gen"]
    assert {c.stage for c in gen} == {0, 1}
    assert all("pp" in c.groups for c in gen)
    for stage in (0, 1):
        assert sum(sum(c.samples_per_step) for c in gen if c.stage == stage) > 0


def test_a_dit_on_two_stages_under_tensor_parallelism():
    # Each TP rank sends its peer of the next stage the whole tokens and context (the
    # blocks' activations are replicated over TP); its heads and MLP split on both stages.
    from tests.helpers.runs import check_tp

    program = dit_program()
    check_tp(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                               ("llm", "backbone", 1, 1, 1), ("gen", "generator", 2, 1, 2)),
             STEPS)     # not TP_STEPS: TP matches from its first step
