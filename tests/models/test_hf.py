"""Hugging Face models in and out (``dtdsl.models.hf``): tiny models made here with
``transformers`` and ``diffusers``, loaded into dtdsl's modules, compared with the
libraries' forwards, written back and loaded by the libraries."""

from __future__ import annotations

import json

import pytest
import torch

from dtdsl.cost import flops
from dtdsl.ir import program as ir
from dtdsl.models.hf import Checkpoint, HFError, load_hf, read_hf, save_hf
from tests.hf_models import make_clip, make_decoder, make_siglip, make_unet, quiet

LOAD_RTOL = 1e-4     # the bound: our forward against the library's, fp32
SAVE_RTOL = 1e-6     # the library on what we wrote against our forward


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


DECODERS = {
    "llama3-rope-scaling": ("llama", {}),
    "llama2-biases": ("llama", dict(rope_scaling=None, rope_theta=10000.0, attention_bias=True,
                                    mlp_bias=True, rms_norm_eps=1e-6)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 256})),
    "mistral-head-dim": ("mistral", dict(head_dim=32, rope_theta=1e6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-mha": ("qwen2", dict(num_key_value_heads=4)),
    "qwen3-head-dim": ("qwen3", dict(head_dim=24)),
    # MoE decoders: experts of their own width, Qwen2-MoE's gated shared expert and
    # dense layers between the MoE ones, Qwen3-MoE's renormalised top-k and QK-norm.
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=40,
                                    shared_expert_intermediate_size=56,
                                    decoder_sparse_step=2)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=40, norm_topk_prob=True)),
    "qwen3-moe-stacked": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=40,
                                            original_format=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-stacked": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                        original_format=False)),
}


@pytest.mark.parametrize("case", sorted(DECODERS))
def test_decoders_equal_transformers(case, tmp_path):
    import transformers

    family, config = DECODERS[case]
    path = make_decoder(tmp_path / "in", family, **config)
    ours = load_hf(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert num_params(ours) == num_params(theirs)
    assert num_params(ours) == flops.module_params(ir.Module(
        name="llm", role="backbone", modality=None, arch=ours.arch,
        span=_span()))
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids)
    assert rel(got, want) < LOAD_RTOL
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(theirs)
    with torch.no_grad():
        assert rel(back(ids).logits, got) < SAVE_RTOL


@pytest.mark.parametrize("kind", ["clip", "clip-full", "siglip", "clip-gelu"])
def test_vision_towers_equal_transformers(kind, tmp_path):
    from transformers import CLIPVisionModel, SiglipVisionModel

    if kind == "siglip":
        path, cls = make_siglip(tmp_path / "in"), SiglipVisionModel
    else:
        extra = {"hidden_act": "gelu"} if kind == "clip-gelu" else {}
        path = make_clip(tmp_path / "in", full=kind == "clip-full", **extra)
        cls = CLIPVisionModel
    ours = load_hf(path)
    theirs = cls.from_pretrained(path).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    other = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(ours(pixels), theirs(pixels).last_hidden_state) < LOAD_RTOL
        # Another image size: the learned positions interpolated as transformers does.
        assert rel(ours(other), theirs(other, interpolate_pos_encoding=True)
                   .last_hidden_state) < LOAD_RTOL
        got = ours(pixels)
    save_hf(ours, tmp_path / "out")
    back, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert rel(back.eval()(pixels).last_hidden_state, got) < SAVE_RTOL
        # What dtdsl's tower does not hold (CLIP's pooling norm, SigLIP's head) is the
        # original's: the directory stands in for it.
        assert rel(back(pixels).pooler_output, theirs(pixels).pooler_output) < LOAD_RTOL


def test_a_full_siglip_gives_its_vision_tower(tmp_path):
    from transformers import SiglipConfig, SiglipModel

    quiet()
    model = SiglipModel(SiglipConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4)))
    model.save_pretrained(tmp_path / "in")
    ours = load_hf(tmp_path / "in")
    assert ours.arch.post_norm and ours.arch.patch_bias and not ours.arch.cls_token
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = model.vision_model(pixel_values=pixels).last_hidden_state
        assert rel(ours(pixels), want) < LOAD_RTOL


def test_weight_variants_beside_the_checkpoint_are_not_read(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_decoder(tmp_path / "in")
    tensors = load_file(str(path / "model.safetensors"))
    # A Hub directory's fp16 variant, and another format's file under other names.
    save_file({k: v.half() for k, v in tensors.items()}, str(path / "model.fp16.safetensors"))
    save_file({"tok_embeddings.weight": tensors["model.embed_tokens.weight"]},
              str(path / "consolidated.safetensors"))
    with Checkpoint(path) as ckpt:
        assert ckpt.dtype("model.embed_tokens.weight") == torch.float32
        assert "tok_embeddings.weight" not in ckpt
    (path / "model.safetensors").unlink()
    (path / "consolidated.safetensors").unlink()
    with Checkpoint(path) as ckpt:          # the variant alone is the checkpoint
        assert ckpt.dtype("model.embed_tokens.weight") == torch.float16


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_a_feature_layer_reads_that_hidden_state(kind, tmp_path):
    from transformers import CLIPVisionModel, SiglipVisionModel

    path = (make_siglip if kind == "siglip" else make_clip)(tmp_path / "in")
    cls = SiglipVisionModel if kind == "siglip" else CLIPVisionModel
    ours = load_hf(path, feature_layer=-2)
    assert len(ours.layers) == 2          # the last layer is never run, so never built
    theirs = cls.from_pretrained(path).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(pixels, output_hidden_states=True).hidden_states[-2]
        assert rel(ours(pixels), want) < LOAD_RTOL
    # Written back whole: its layers, then the original's top layer above them. Never into
    # the folder it came from, which transformers wrote: that is refused, untouched.
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(HFError, match=f"{path} holds files dtdsl did not write"):
        save_hf(ours, path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    # Into a folder save_hf wrote, from weights read there (read before it is replaced).
    save_hf(ours, tmp_path / "mine")
    again = load_hf(tmp_path / "mine", feature_layer=-2)
    save_hf(again, tmp_path / "mine")
    assert rel(load_hf(tmp_path / "mine", feature_layer=-2)(pixels), ours(pixels)) < SAVE_RTOL
    save_hf(ours, tmp_path / "out")
    back, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and back.config.num_hidden_layers == 3
    with torch.no_grad():
        assert rel(back.eval()(pixels).last_hidden_state,
                   theirs(pixels).last_hidden_state) < SAVE_RTOL


@pytest.mark.parametrize("sd,prediction", [(2, "v_prediction"), (1, "epsilon")])
def test_unets_equal_diffusers(sd, prediction, tmp_path):
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from dtdsl.models.diffusion import alphas_cumprod, noisy_and_target

    quiet()
    path = make_unet(tmp_path / "in", sd=sd, prediction=prediction)
    ours = load_hf(path)
    assert ours.arch.prediction == prediction and ours.arch.beta_schedule == "scaled_linear"
    assert ours.arch.linear_proj == (sd == 2)
    theirs = UNet2DConditionModel.from_pretrained(path / "unet").eval()
    assert num_params(ours) == num_params(theirs)
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    steps = torch.tensor([3, 700])
    context = torch.randn(2, 7, 24, generator=gen)
    with torch.no_grad():
        got = ours(latents, steps, context)
        assert rel(got, theirs(latents, steps, context).sample) < LOAD_RTOL
    # The noise schedule and the training target are the scheduler's.
    scheduler = DDPMScheduler.from_pretrained(path / "scheduler")
    assert torch.equal(alphas_cumprod(ours.arch), scheduler.alphas_cumprod)
    noise = torch.randn(latents.shape, generator=gen)
    noisy, target = noisy_and_target(ours.arch, latents, noise, steps)
    assert torch.allclose(noisy, scheduler.add_noise(latents, noise, steps))
    want = scheduler.get_velocity(latents, noise, steps) if prediction == "v_prediction" \
        else noise
    assert torch.allclose(target, want)
    save_hf(ours, tmp_path / "out")
    back = UNet2DConditionModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert rel(back(latents, steps, context).sample, got) < SAVE_RTOL
    saved = json.loads((tmp_path / "out" / "scheduler_config.json").read_text())
    assert saved["prediction_type"] == prediction


def test_sharded_checkpoints_read_and_write(tmp_path):
    import transformers

    path = make_decoder(tmp_path / "in")
    ours = load_hf(path)
    written = save_hf(ours, tmp_path / "out", max_shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json") in written
    assert len([p for p in written if p.suffix == ".safetensors"]) > 2
    again = load_hf(tmp_path / "out")      # our reader follows the index too
    for (n, a), (_, b) in zip(ours.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        assert rel(theirs(ids).logits, ours(ids)) < SAVE_RTOL


def test_writing_again_replaces_the_checkpoint_there(tmp_path):
    import transformers

    ours = load_hf(make_decoder(tmp_path / "in"))
    save_hf(ours, tmp_path / "out", max_shard_bytes=20_000)       # sharded, with an index
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(2)
    save_hf(ours, tmp_path / "out")                               # one file
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "dtdsl-manifest.json", "model.safetensors"]
    ids = torch.randint(0, 128, (1, 20))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert rel(theirs(ids).logits, ours(ids)) < SAVE_RTOL
        assert rel(load_hf(tmp_path / "out")(ids), ours(ids)) < SAVE_RTOL


def test_a_block_is_read_without_the_rest(tmp_path):
    path = make_decoder(tmp_path / "in")
    with Checkpoint(path) as ckpt:
        from dtdsl.models.hf.weights import Source

        key = "model.layers.1.mlp.down_proj.weight"
        block = ckpt.read(Source(key), (8, 32), (4, 16))
        assert block.shape == (4, 16)
        assert ckpt.bytes_read == 4 * 16 * 4
        full = ckpt.read(Source(key), (0, 0), ckpt.shape(key))
        assert torch.equal(block, full[8:12, 32:48])


def test_keys_a_config_leaves_out_take_the_class_defaults(tmp_path):
    path = tmp_path / "mistral"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 64, "num_attention_heads": 16,
        "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 128,
        "attention_bias": True}))          # MistralAttention has no biases regardless
    arch = read_hf(path).arch
    assert arch.kv_heads == 8 and not arch.qkv_bias and not arch.out_bias
    assert arch.sliding_window == 4096 and arch.rope.theta == 10000.0
    assert arch.eps("backbone") == 1e-6


def test_unreadable_directories_say_why(tmp_path):
    with pytest.raises(HFError, match="does not exist"):
        read_hf(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match="no config.json"):
        read_hf(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(HFError, match="model_type 'gpt2' is not supported"):
        read_hf(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(HFError, match="not valid JSON"):
        read_hf(bad)
    clip = make_clip(tmp_path / "clip")
    with pytest.raises(HFError, match="cannot be the backbone"):
        read_hf(clip, role="backbone")
    llama = make_decoder(tmp_path / "llama", rope_scaling={"rope_type": "longrope",
                                                           "short_factor": [1.0] * 8,
                                                           "long_factor": [1.0] * 8})
    with pytest.raises(HFError, match="rope_type 'longrope'"):
        read_hf(llama)
    (llama / "model.safetensors").rename(llama / "pytorch_model.bin")
    with pytest.raises(HFError, match="no safetensors"):
        Checkpoint(llama)


def _span():
    from dtdsl.source import Span

    return Span.point(1, 1)


@pytest.mark.parametrize("stacked", [False, True])
def test_an_expert_parallel_rank_reads_only_its_experts(stacked, tmp_path):
    """A rank holding experts 2 and 3 of 4 reads their tensors (Hub per-expert keys, or
    rows of transformers 5's stacked ones) and nothing of experts 0 and 1."""
    from dtdsl.models.hf import checkpoint_prefixes, load_weights
    from dtdsl.models.moe import MoE, moe_config

    path = make_decoder(tmp_path / "in", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=40, original_format=not stacked)
    whole = load_hf(path)
    arch = whole.arch
    mine = MoE(moe_config(arch), first_expert=2, local_experts=2)
    with Checkpoint(path) as ckpt:
        assert ("experts" in checkpoint_prefixes("qwen3_moe", ckpt)) == stacked
        report = load_weights(mine, "qwen3_moe", arch, ckpt, prefix="layers.1.mlp")
    block = whole.layers["1"].mlp
    for name in ("w1", "w3", "w2"):
        assert torch.equal(getattr(mine, name), getattr(block, name)[2:4]), name
    assert torch.equal(mine.router.weight, block.router.weight)
    experts = 3 * 2 * 40 * 64 * 4
    assert report.bytes_read == experts + 4 * 64 * 4        # two experts and the router


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_spec_written_moe_backbone_exports_as_its_family(family, tmp_path):
    """An MoE backbone written in the language (no hf()) is written as the Hugging Face
    family whose block computes it: Mixtral without a shared expert, Qwen2-MoE with one."""
    import transformers

    from dtdsl.models.build import build_arch

    shared = 24 if family == "qwen2_moe" else 0
    arch = ir.TransformerArch(layers=2, hidden=32, heads=4, kv_heads=2, ffn=40, vocab=64,
                              swiglu=True, causal=True, qkv_bias=family == "qwen2_moe",
                              moe=ir.MoEArch(experts=4, top_k=2, ffn=40, shared_ffn=shared,
                                             shared_gate=bool(shared)))
    ours = build_arch("backbone", arch)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (p.dim() == 1))
    ours.eval()
    save_hf(ours, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == {"mixtral": "MixtralForCausalLM",
                                     "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    with torch.no_grad():
        assert rel(theirs(ids).logits, ours(ids)) < SAVE_RTOL


def test_moe_configs_dtdsl_cannot_compute_are_refused(tmp_path):
    path = make_decoder(tmp_path / "q", "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=40, shared_expert_intermediate_size=56,
                        mlp_only_layers=[0])
    with pytest.raises(HFError, match="mlp_only_layers"):
        read_hf(path)
    path = make_decoder(tmp_path / "m", "mixtral", num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.1)
    with pytest.raises(HFError, match="router_jitter_noise"):
        read_hf(path)


def test_a_config_that_sets_dropout_is_refused(tmp_path):
    """dtdsl's modules have no dropout: training without the config's would differ from
    transformers' in silence. Zero (what published checkpoints store) reads."""
    read_hf(make_decoder(tmp_path / "zero", "llama", attention_dropout=0.0))
    with pytest.raises(HFError, match="attention_dropout 0.1: dtdsl trains without dropout"):
        read_hf(make_decoder(tmp_path / "llama", "llama", attention_dropout=0.1))
    with pytest.raises(HFError, match="attention_dropout 0.2: dtdsl trains without dropout"):
        read_hf(make_clip(tmp_path / "clip", full=True, attention_dropout=0.2))
    # an integer past a float's range: said as written, not an OverflowError
    with pytest.raises(HFError, match="attention_dropout an integer of 401 digits: dtdsl"):
        read_hf(make_decoder(tmp_path / "huge", "llama", attention_dropout=10**400))


def _sliding_layers(config) -> bool:
    """Whether transformers' model of ``config`` has a layer whose attention slides."""
    window = getattr(config, "sliding_window", None)
    if not window or config.model_type == "llama":      # Llama's attention never slides
        return False
    kinds = getattr(config, "layer_types", None)
    return kinds is None or "sliding_attention" in kinds


@pytest.mark.parametrize(("family", "extra"), [
    ("llama", dict(sliding_window=64)),               # a key Llama's attention ignores
    ("mistral", dict(sliding_window=64)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=4)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=64, max_window_layers=1)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64, max_window_layers=9)),
    # written by hand: layer_types says what slides, whatever max_window_layers says
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=9,
                   layer_types=["full_attention", "sliding_attention"])),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0,
                   layer_types=["full_attention", "full_attention"])),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in sorted(v)
                                                        if k != "sliding_window"))
def test_the_sliding_window_is_the_one_transformers_applies(family, extra, tmp_path):
    # dtdsl computes full attention and holds seq_len to a window where any layer of
    # transformers' model slides (DT313): the window must be there exactly then.
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, **extra)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    if "layer_types" not in extra:          # what transformers reads when a config has none
        written.pop("layer_types", None)
        (tmp_path / "config.json").write_text(json.dumps(written))
    want = 64 if _sliding_layers(AutoConfig.from_pretrained(tmp_path)) else None
    assert read_hf(tmp_path).arch.sliding_window == want


def test_layer_types_that_are_not_one_kind_per_layer_are_refused(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "use_sliding_window": True, "sliding_window": 64}
    for bad in (["sliding_attention"], ["full_attention", "chunked_attention"], "sliding"):
        (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": bad}))
        with pytest.raises(HFError, match="layer_types"):
            read_hf(tmp_path)


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_a_tower_whose_image_is_not_whole_patches_reads_what_transformers_reads(kind,
                                                                              tmp_path):
    # SigLIP-so400m reads 384 x 384 images in patches of 14 (27 x 27, the last 6 pixels of
    # each side unread by its patch convolution): here 40 x 40 in patches of 6. The data
    # path gives the tower the pixels it reads, and it computes what transformers does on
    # the image processor's whole image.
    import numpy as np
    from PIL import Image
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionModel,
        SiglipImageProcessorPil,
        SiglipVisionModel,
    )

    from dtdsl.data.images import ImagePolicy, normalize

    make = make_siglip if kind == "siglip" else make_clip
    path = make(tmp_path / "in", image=40, patch=6)
    ours = load_hf(path)
    assert ours.pos_embed.weight.shape[0] == 36 + (kind == "clip")    # (40 // 6)^2 (+ CLS)
    cls = SiglipVisionModel if kind == "siglip" else CLIPVisionModel
    theirs = cls.from_pretrained(path).eval()
    processor = SiglipImageProcessorPil(size={"height": 40, "width": 40}) if kind == "siglip" \
        else CLIPImageProcessorPil(size={"shortest_edge": 40},
                                   crop_size={"height": 40, "width": 40})
    module = type("M", (), {"arch": ours.arch, "hf": type("H", (), {
        "family": kind, "path": str(path)})})()
    policy = ImagePolicy.for_encoder(module)
    img = Image.fromarray(np.random.default_rng(5).integers(0, 255, (50, 70, 3),
                                                            dtype=np.uint8))
    pixels = policy.resize(img)
    assert pixels.shape == (3, 36, 36) and policy.shape(70, 50) == (36, 36)
    whole = torch.from_numpy(processor(images=img, return_tensors="np")["pixel_values"])
    with torch.no_grad():
        got = ours(normalize(pixels, policy.mean, policy.std)[None])
        assert rel(got, theirs(whole).last_hidden_state) < LOAD_RTOL
        assert rel(ours(whole), got) == 0.0          # the unread pixels change nothing


def test_a_config_that_writes_a_key_twice_is_refused(tmp_path):
    # Python's json keeps the last value, other readers the first: neither is trusted.
    path = make_decoder(tmp_path / "llama", "llama")
    text = (path / "config.json").read_text()
    assert text.rstrip().endswith("}")
    (path / "config.json").write_text(text.rstrip()[:-1] + ', "hidden_size": 4096}')
    with pytest.raises(HFError, match="key 'hidden_size' is written twice in one object"):
        read_hf(path)


def test_a_decoder_head_of_odd_dimensions_is_refused(tmp_path):
    # (transformers refuses to make one: the config is edited by hand)
    path = make_decoder(tmp_path / "qwen", "qwen3", head_dim=16)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "head_dim": 15}))
    with pytest.raises(HFError, match="head_dim 15 is odd: rotary position embeddings"):
        read_hf(path)
