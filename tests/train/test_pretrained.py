"""Training from pretrained Hugging Face weights across gloo ranks: a tiny spec whose
encoder (CLIP vision) and backbone (Llama 3 with rope scaling; Qwen2 with tied embeddings;
Qwen3-MoE) are ``pretrained`` directories made here with ``transformers``. Each rank reads only the
blocks of the checkpoint its shards cover; the run equals ``dtc reference``; ``dtc export``
of its checkpoint loads in ``transformers`` with the reference's logits."""

from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.init import local_block
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import Checkpointer
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.runs import LOSS_RTOL, PARAM_RMS, PARAM_RTOL, plan_for
from tests.helpers.runs import reference as executor_reference
from tests.hf_models import make_clip, make_decoder, make_unet, quiet

STEPS = 5       # the acceptance: losses equal `dtc reference` over 5 steps
SPEC = """
spec pretrained_tiny

model {{
  encoder vit (image) {{
    arch       = hf("clip", feature_layer={feature_layer})
    pretrained = "clip"
  }}
  backbone llm {{
    pretrained = "{backbone}"
  }}
  projector vit -> llm : mlp(depth=2)
}}

data tiny {{
  text.tokens   ~ lognormal(median=48, sigma=0.5) clamp [8, 192]
  image.count   ~ zipf(a=2.0) clamp [0, 3]
  image.patches ~ choice([16, 64], p=[0.7, 0.3])  # 32x32 (CLIP's size) and 64x64 images
}}

cluster local {{
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 8
  gpus_per_node = 8
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}}

train {{
  global_batch     = 8
  micro_batch      = 2
  seq_len          = 512
  schedule         = 1f1b
  optimizer        = adamw(lr=1e-3, weight_decay=0.01)
  precision        = fp32
  steps            = {steps}
  seed             = 7
  checkpoint_every = {steps}
}}
"""


@cache
def models(root: str) -> Path:
    """The pretrained directories (made once per test session)."""
    path = Path(root)
    make_unet(path / "sd", sd=2, prediction="v_prediction", context=24, latent=8)
    make_clip(path / "clip", layers=3, hidden=32, heads=4, ffn=64, image=32, patch=8)
    make_decoder(path / "llama", "llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn=96,
                 vocab=128)
    make_decoder(path / "qwen", "qwen2", layers=4, hidden=64, heads=4, kv_heads=2, ffn=96,
                 vocab=128, tie_word_embeddings=True)
    make_decoder(path / "qwen3moe", "qwen3_moe", layers=4, hidden=64, heads=4, kv_heads=2,
                 ffn=96, vocab=128, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    quiet()
    return models(str(tmp_path_factory.mktemp("hf")))


GENERATOR = """  generator gen (image) {
    pretrained = "sd"
  }
  projector llm -> gen : mlp(depth=2)
"""


@cache
def program(root: str, backbone: str = "llama", feature_layer: int = -2,
            generator: bool = False, weights: bool = True) -> ir.Program:
    text = SPEC.format(backbone=backbone, feature_layer=feature_layer, steps=STEPS)
    if not weights:          # the backbone's architecture only, initialised by dtdsl
        text = text.replace(f'pretrained = "{backbone}"', f'arch = hf("{backbone}")')
    if generator:
        text = text.replace("  projector vit -> llm : mlp(depth=2)\n",
                            "  projector vit -> llm : mlp(depth=2)\n" + GENERATOR).replace(
            "clamp [0, 3]\n", "clamp [0, 3]\n  image.gen_count ~ choice([0, 1], p=[0.5, 0.5])\n")
    spec = Path(root) / f"spec_{backbone}_{feature_layer}_{int(generator)}_{int(weights)}.dt"
    spec.write_text(text)
    result = run_frontend(str(spec), text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def reference(prog: ir.Program) -> tuple[list[float], dict[str, tuple[torch.Tensor, ...]]]:
    """The reference's losses over STEPS, and per parameter its (initial, final) values."""
    return executor_reference(prog, STEPS)


def _stored(prog: ir.Program, unit: str, name: str) -> torch.Tensor | None:
    """The pretrained tensor behind a unit's parameter, read whole with safetensors (the
    test's own reading, independent of dtdsl's loader); None for a projector."""
    from safetensors.torch import load_file

    module = next((m for m in prog.modules if m.name == unit), None)
    if module is None or module.pretrained is None or module.hf.family == "unet":
        return None     # the reference's loading (held against diffusers in tests/models)
    tensors = load_file(str(Path(module.pretrained) / "model.safetensors"))
    if module.hf.family == "clip":
        key = name.replace("patch_embed", "embeddings.patch_embedding").replace(
            "cls_embedding", "embeddings.class_embedding").replace(
            "pos_embed", "embeddings.position_embedding").replace("pre_norm", "pre_layrnorm")
        key = re.sub(r"^layers\.", "encoder.layers.", key)
        for a, b in (("attn_norm", "layer_norm1"), ("mlp_norm", "layer_norm2"),
                     ("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"),
                     ("attn.wv", "self_attn.v_proj"), ("attn.wo", "self_attn.out_proj"),
                     ("mlp.w1", "mlp.fc1"), ("mlp.w2", "mlp.fc2")):
            key = key.replace(a, b)
        t = tensors[key]
        return t.flatten(1) if name == "patch_embed.weight" else t
    key = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}.get(name)
    moe = re.fullmatch(r"layers\.(\d+)\.mlp\.(w1|w3|w2|router\.weight)", name)
    if moe is not None and module.arch.moe is not None:     # the Hub's per-expert tensors
        layer = f"model.layers.{moe.group(1)}.mlp."
        if moe.group(2) == "router.weight":
            return tensors[layer + "gate.weight"]
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[moe.group(2)]
        return torch.stack([tensors[f"{layer}experts.{e}.{proj}.weight"]
                            for e in range(module.arch.moe.experts)])
    if key is None:
        key = "model." + name
        for a, b in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                     ("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"),
                     ("attn.wv", "self_attn.v_proj"), ("attn.wo", "self_attn.o_proj"),
                     ("mlp.w1", "mlp.gate_proj"), ("mlp.w3", "mlp.up_proj"),
                     ("mlp.w2", "mlp.down_proj"), ("attn.q_norm", "self_attn.q_norm"),
                     ("attn.k_norm", "self_attn.k_norm")):
            key = key.replace(a, b)
    if key not in tensors and module.arch.tie_embeddings:
        key = "model.embed_tokens.weight"
    return tensors[key]


def _train(rank: int, world: int, prog: ir.Program, plan: Plan, losses: list[float],
           params: dict[str, tuple[torch.Tensor, ...]], run_dir: str) -> None:
    groups = build_groups(plan)
    ex = StageExecutor(prog, plan, lower(plan, prog), rank=rank, groups=groups)
    # Step 0: every parameter the rank holds is its block of the pretrained tensor.
    for name, p in ex.named_parameters().items():
        unit, _, local_name = name.partition(".")
        want = _stored(prog, unit, local_name)
        local, _, offsets = local_block(p.detach())
        if want is None:
            assert torch.equal(local, _block_of(params[name][0], offsets, local.shape)), name
            continue
        assert torch.equal(local, _block_of(want.float(), offsets, local.shape)), name
    ckpt = Checkpointer(ex, run_dir, mode="sync")
    results = ex.train(STEPS)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    ckpt.save(STEPS)
    ckpt.close()
    for name, p in ex.full_parameters().items():
        init, want = params[name]
        err = (p - want).norm().item()
        # A key projection's bias adds the same q.b to every score of a query, which the
        # softmax ignores: its gradient is rounding noise, which Adam turns into full
        # steps in both runs, so only the absolute bound applies to it.
        if not name.endswith("attn.wk.bias"):
            assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


@pytest.mark.slow
def test_a_tied_architecture_over_two_stages_starts_as_the_reference(hf_dir):
    """Tied embeddings initialised by dtdsl (no weights): both stages' copies start as the
    reference's one tensor, so the run equals the reference."""
    prog = program(str(hf_dir), "qwen", -2, weights=False)
    assert prog.backbone.pretrained is None and prog.backbone.arch.tie_embeddings
    plan = plan_for(prog, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2))
    losses, params = reference(prog)
    run(_train_only, plan.gpus_used, prog, plan, losses, params, timeout=300)


def _train_only(rank: int, world: int, prog: ir.Program, plan: Plan, losses: list[float],
                params: dict[str, tuple[torch.Tensor, ...]]) -> None:
    groups = build_groups(plan)
    ex = StageExecutor(prog, plan, lower(plan, prog), rank=rank, groups=groups)
    for name, p in ex.named_parameters().items():
        local, _, offsets = local_block(p.detach())
        assert torch.equal(local, _block_of(params[name][0], offsets, local.shape)), name
    for r, want in zip(ex.train(STEPS), losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)


def _resume(rank: int, world: int, prog: ir.Program, plan: Plan,
            params: dict[str, tuple[torch.Tensor, ...]], run_dir: str) -> None:
    groups = build_groups(plan)
    ex = StageExecutor(prog, plan, lower(plan, prog), rank=rank, groups=groups,
                       initialize=False)
    ckpt = Checkpointer(ex, run_dir, mode="sync")
    assert ckpt.resume() == STEPS and ckpt.loaded == STEPS
    ckpt.close()
    full = ex.full_parameters()
    trained = _trained(run_dir, full)
    for name, p in full.items():
        assert torch.equal(p, trained[name]), name


def _trained(run_dir: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters named in ``like`` as the checkpoint holds them (read with DCP in this
    process, all in one load: one per parameter took seconds)."""
    import torch.distributed.checkpoint as dcp

    out = {f"model.units.{name}": torch.empty_like(p) for name, p in like.items()}
    dcp.load(out, checkpoint_id=str(Path(run_dir) / "checkpoints" / f"ckpt-{STEPS}"),
             no_dist=True)
    return {name: out[f"model.units.{name}"] for name in like}


@pytest.mark.slow
def test_a_pretrained_unet_trains_and_a_resume_reads_no_pretrained_weights(hf_dir, tmp_path):
    from diffusers import UNet2DConditionModel

    prog = program(str(hf_dir), "llama", -2, generator=True)
    assert prog.module("gen").arch.prediction == "v_prediction"
    plan = plan_for(prog, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 2, 1, 1))
    losses, params = reference(prog)
    run_dir = str(tmp_path / "run")
    run(_train, plan.gpus_used, prog, plan, losses, params, run_dir, timeout=300)
    # Resuming takes every parameter, frozen or pretrained, from the checkpoint: with the
    # pretrained directories gone it resumes all the same.
    gone = prog.model_copy(update={"modules": tuple(
        m.model_copy(update={"pretrained": str(tmp_path / "gone")}) if m.pretrained else m
        for m in prog.modules)})
    run(_resume, plan.gpus_used, gone, plan, params, run_dir, timeout=120)
    # The exported U-Net is diffusers' with the trained weights.
    from dtdsl.train.export import export_checkpoint

    export_checkpoint(run_dir, tmp_path / "out", units=["gen"])
    theirs = UNet2DConditionModel.from_pretrained(tmp_path / "out" / "gen").eval()
    model = build_model(prog)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n.removeprefix("units.")][1])
        gen = torch.Generator().manual_seed(4)
        x, t, c = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 900]),
                   torch.randn(2, 5, 24, generator=gen))
        want = model.unit("gen")(x, t, c)
        got = theirs(x, t, c).sample
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


def _block_of(full: torch.Tensor, offsets, shape) -> torch.Tensor:
    index = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
    return full[index]


@pytest.mark.slow
@pytest.mark.parametrize("backbone,feature_layer,layout", [
    ("llama", -2, (("vit", "encoder", 2, 1, 1), ("llm", "backbone", 2, 1, 2))),
    # Tied embeddings over two pipeline stages: the head on the last stage is the first
    # stage's embedding, their gradients summed (and the CLIP tower's own top, no
    # feature layer).
    ("qwen", None, (("vit", "encoder", 1, 1, 2), ("llm", "backbone", 1, 2, 2))),
    # An MoE backbone with QK-norm (Qwen3-MoE): its experts read from the Hub's
    # per-expert tensors, exported back to them.
    ("qwen3moe", -2, (("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2))),
])
def test_pretrained_modules_train_as_the_reference(hf_dir, tmp_path, backbone, feature_layer,
                                                   layout):
    import transformers
    from transformers import CLIPVisionModel

    from dtdsl.models.hf import load_hf
    from dtdsl.train.export import export_checkpoint

    prog = program(str(hf_dir), backbone, feature_layer if feature_layer is not None else -1)
    if feature_layer is None:
        prog = _without_feature_layer(hf_dir, backbone)
    plan = plan_for(prog, *layout)
    losses, params = reference(prog)
    # The pretrained weights, not a random start: the first loss is the pretrained model's.
    run(_train, plan.gpus_used, prog, plan, losses, params, str(tmp_path / "run"), timeout=300)

    # dtc export: Hugging Face directories that transformers loads, holding the trained
    # weights (the reference's, up to the run's rounding).
    out = tmp_path / "export"
    exported = {u.name: u for u in export_checkpoint(tmp_path / "run", out)}
    assert exported["llm"].hf and exported["vit"].hf and not exported["vit_to_llm"].hf
    model = build_model(prog)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n.removeprefix("units.")][1])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "llm").eval()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.unit("llm")(ids)
        got = theirs(ids).logits
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
        assert torch.allclose(load_hf(out / "llm")(ids), got, rtol=1e-5, atol=1e-5)
    tower = CLIPVisionModel.from_pretrained(out / "vit").eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = tower(pixels, output_hidden_states=True).hidden_states
        layer = feature_layer if feature_layer is not None else -1
        want = model.unit("vit")(pixels)
        got = hidden[layer] if feature_layer is not None else tower(pixels).last_hidden_state
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


def _without_feature_layer(hf_dir: Path, backbone: str) -> ir.Program:
    text = SPEC.format(backbone=backbone, feature_layer=0, steps=STEPS).replace(
        'arch       = hf("clip", feature_layer=0)\n', "")
    spec = hf_dir / f"spec_{backbone}_top.dt"
    spec.write_text(text)
    result = run_frontend(str(spec), text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


# ---- memory while loading ---------------------------------------------------------------

_LOAD = """
import json, re, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from dtdsl.driver import run_frontend
from dtdsl.models.init import local_block
from dtdsl.parallel.mesh import build_groups
from dtdsl.train.stage import build_stage
from tests.helpers.runs import plan_for

def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

spec, world, rank, layout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
prog = run_frontend(spec, open(spec, "rb").read()).program
plan = plan_for(prog, *[tuple(u) for u in layout])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
groups = build_groups(plan)
open("/proc/self/clear_refs", "w").write("5")     # reset the peak to now
before = hwm()
stage = build_stage(prog, plan, groups.role, groups.mesh, torch.device("cpu"),
                    initialize=False)
stage.initialize(prog, prog.train.seed)
peak = hwm() - before
share = sum(local_block(p)[0].numel() * 4 for p in stage.module.parameters())
print(json.dumps({"peak": peak, "share": share}))
"""


@pytest.mark.slow
def test_a_rank_reads_only_its_share(tmp_path):
    """A rank's peak memory while it builds its stage and loads its weights stays below its
    share of the module plus one tensor (measured: the process's peak resident set)."""
    import json
    import os
    import subprocess
    import sys

    quiet()
    # About 180 MB of fp32 weights, stored in bf16: the embedding and the head are the
    # largest tensors (64 MB each in fp32).
    make_decoder(tmp_path / "big", "llama", layers=4, hidden=512, heads=8, kv_heads=4,
                 ffn=1536, vocab=32000, dtype=torch.bfloat16)
    spec = tmp_path / "big.dt"
    spec.write_text(SPEC.format(backbone="big", feature_layer=-2, steps=1).replace(
        '''  encoder vit (image) {
    arch       = hf("clip", feature_layer=-2)
    pretrained = "clip"
  }
''', "").replace("  projector vit -> llm : mlp(depth=2)\n", "").replace(
        "  image.count   ~ zipf(a=2.0) clamp [0, 3]\n", "").replace(
        "  image.patches ~ choice([16, 64], p=[0.7, 0.3])  # 32x32 (CLIP's size) and 64x64 "
        "images\n", ""))
    largest = 32000 * 512 * 4
    total = 4 * (2 * 32000 * 512 + 512 + 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536
                                              + 2 * 512))
    root = Path(__file__).resolve().parents[2]
    for world, layout in ((4, [["llm", "backbone", 2, 2, 1]]), (2, [["llm", "backbone", 1, 1, 2]])):
        out = subprocess.run(
            [sys.executable, "-c", _LOAD, str(spec), str(world), str(world - 1),
             json.dumps(layout)], capture_output=True, text=True, cwd=root, timeout=300,
            env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(layout, got)
        assert got["share"] < 0.6 * total      # a quarter, or one stage of two
        assert got["peak"] < got["share"] + largest, (layout, got)


# ---- a bundle's launch, dtc export's command line -----------------------------------------

@pytest.mark.slow
def test_a_bundle_checks_its_pretrained_weights_before_it_starts(hf_dir, tmp_path):
    import shutil

    from dtdsl import cli
    from tests.helpers.bundle import launch, launch_ok

    # One rank: preflight's checks, the resume and the export need no second (a rank
    # reading only its share is test_a_rank_reads_only_its_share's).
    weights = tmp_path / "llama"
    shutil.copytree(hf_dir / "llama", weights)
    text = SPEC.format(backbone=weights, feature_layer=-2, steps=2).replace(
        '"clip"', f'"{hf_dir / "clip"}"').replace("gpus          = 8", "gpus          = 1")
    spec = tmp_path / "tiny.dt"
    spec.write_text(text)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    launch_ok(bundle, tmp_path / "run")
    # A file cut short after the compile (a copy that stopped): one line before torchrun
    # starts, not a SafetensorError on every rank and restart.
    data = (weights / "model.safetensors").read_bytes()
    (weights / "model.safetensors").write_bytes(data[:len(data) // 2])
    proc = launch(bundle, tmp_path / "run2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"launch.sh: backbone llm: pretrained {weights}: "
                               f"{weights / 'model.safetensors'} is truncated"), lines
    # Gone weights: one line before torchrun starts, no rank's traceback.
    shutil.rmtree(weights)
    proc = launch(bundle, tmp_path / "run2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"launch.sh: backbone llm: pretrained {weights}: {weights} "
                                   "does not exist")
    # The run's checkpoint holds everything: it resumes, and exports, without them.
    launch_ok(bundle, tmp_path / "run", "--resume", "--steps", "3")
    out = tmp_path / "out"
    assert cli.main(["export", str(tmp_path / "run"), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["llm", "vit", "vit_to_llm"]
    assert cli.main(["export", str(tmp_path / "run"), "-o", str(out)]) == 2   # not empty
    assert cli.main(["export", str(tmp_path / "run"), "--step", "7", "-o",
                     str(tmp_path / "o2")]) == 2

