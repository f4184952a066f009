"""Generation targets through a real VAE: a pretrained SD-style pipeline (U-Net, scheduler
and VAE made here with diffusers) whose VAE turns the data's target images into latents on
the generator's ranks; the latents are diffusers' own, and a run over TP ranks equals the
reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dtdsl.driver import run_frontend
from tests.hf_models import make_unet, make_vae
from tests.text_models import make_tokenizer

SPEC = """
spec vae_tiny

model {
  encoder vit (image) {
    arch = transformer(layers=2, hidden=32, heads=4, ffn=64, patch=8)
  }
  backbone llm {
    arch = transformer(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=512, swiglu)
  }
  generator gen (image) {
    pretrained = "sd"
  }
  projector vit -> llm : mlp(depth=2)
  projector llm -> gen : mlp(depth=2)
}

data shards {
  text.tokens     ~ lognormal(median=16, sigma=0.5) clamp [4, 64]
  image.count     ~ constant(1)
  image.patches   ~ choice([16, 30], p=[0.5, 0.5])
  image.gen_count ~ choice([0, 1], p=[0.6, 0.4])
  source    = "shards"
  tokenizer = "tok"
}

cluster local {
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 4
  gpus_per_node = 4
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}

train {
  global_batch = 8
  micro_batch  = 2
  seq_len      = 128
  optimizer    = adamw(lr=1e-3, weight_decay=0.01)
  precision    = fp32
  steps        = 3
  seed         = 5
}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from tests.helpers.media import write_shards

    root = tmp_path_factory.mktemp("vae")
    make_unet(root / "sd", sd=2, prediction="epsilon", context=24, latent=8)
    make_vae(root / "sd" / "vae", channels=(16, 32))          # 16x16 images -> 8x8 latents
    make_tokenizer(root / "tok")
    write_shards(root / "shards", n=24, per_shard=8, gen_every=2)
    (root / "spec.dt").write_text(SPEC)
    return root


def program(root: Path):
    result = run_frontend(str(root / "spec.dt"), SPEC.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def test_targets_are_the_vaes_latents_of_the_images(root):
    from diffusers import AutoencoderKL

    from dtdsl.feed.source import DatasetSource
    from dtdsl.models.multimodal import build_model

    prog = program(root)
    gen = prog.module("gen")
    assert gen.vae is not None and gen.vae.path == str((root / "sd" / "vae").resolve())
    source = DatasetSource(prog, root / "shards")
    samples = [source.sample(0, i) for i in range(8)]
    with_targets = [s.targets["gen"] for s in samples if len(s.targets["gen"])]
    assert with_targets
    theirs = AutoencoderKL.from_pretrained(root / "sd" / "vae").eval()
    vae = build_model(prog).vaes["gen"]
    for t in with_targets:
        assert t.latents is None and t.pixels.dtype == torch.uint8
        assert t.pixels.shape[1:] == (3, 16, 16) and t.eps.shape[1:] == (4, 8, 8)
        x = t.pixels.float() / 127.5 - 1
        with torch.no_grad():
            dist = theirs.encode(x).latent_dist
            want = (dist.mean + dist.std * t.eps) * theirs.config.scaling_factor
            torch.testing.assert_close(vae.latents(x, t.eps), want, rtol=1e-4, atol=1e-5)


def test_the_cost_model_prices_the_vae(root):
    from dtdsl.cost.model import build_cost_model

    prog = program(root)
    cost = build_cost_model(prog)
    unit = cost.unit("gen")
    assert unit.frozen_fwd_work.conv > 0
    without = prog.model_copy(update={"modules": tuple(
        m.model_copy(update={"vae": None}) for m in prog.modules)})
    plain = build_cost_model(without).unit("gen")
    fwd, bwd = cost.fwd_bwd_time_s(unit, 1)
    fwd0, bwd0 = build_cost_model(without).fwd_bwd_time_s(plain, 1)
    assert fwd > fwd0 and bwd == bwd0          # forward only, no gradient through the VAE


def test_a_vae_on_the_wrong_module_or_of_the_wrong_width_is_refused(root, tmp_path):
    bad = SPEC.replace('    arch = transformer(layers=2, hidden=32, heads=4, ffn=64, patch=8)',
                       '    arch = transformer(layers=2, hidden=32, heads=4, ffn=64, patch=8)\n'
                       '    vae = "sd/vae"')
    result = run_frontend(str(root / "spec.dt"), bad.encode())
    assert [d.code for d in result.diagnostics if d.severity.name == "ERROR"] == ["DT306"]
    make_vae(tmp_path / "vae8", channels=(16, 32), latent_channels=8)
    wide = SPEC.replace('    pretrained = "sd"\n', f'    pretrained = "sd"\n    vae = '
                        f'"{tmp_path / "vae8"}"\n')
    result = run_frontend(str(root / "spec.dt"), wide.encode())
    (d,) = [d for d in result.diagnostics if d.code == "DT312"]
    assert "8-channel latents" in d.message


def _train(rank: int, world: int, prog, plan, losses, data: str) -> None:
    from dtdsl.data.batch import LocalBatches
    from dtdsl.feed.source import DatasetSource
    from dtdsl.parallel.mesh import build_groups
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor
    from tests.helpers.runs import LOSS_RTOL

    groups = build_groups(plan)
    feed = LocalBatches(prog, plan, groups.role, source=DatasetSource(prog, data))
    ex = StageExecutor(prog, plan, lower(plan, prog), rank=rank, groups=groups, feed=feed)
    for r, want in zip(ex.train(len(losses)), losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
        assert r["gen_loss"] > 0


@pytest.mark.slow
def test_a_run_with_vae_targets_equals_the_reference(root):
    from dtdsl.feed.source import DatasetSource
    from dtdsl.train.reference import train_reference
    from tests.dist import run
    from tests.helpers.runs import plan_for

    prog = program(root)
    source = DatasetSource(prog, root / "shards")
    # Two steps: the second's loss is of the weights the VAE targets' gradients trained.
    losses = [r["loss"] for r in train_reference(prog, 2, source=source)]
    plan = plan_for(prog, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 2, 1, 1))
    run(_train, plan.gpus_used, prog, plan, losses, str(root / "shards"), timeout=300)
