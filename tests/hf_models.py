"""Tiny Hugging Face models made in a test with ``transformers`` and ``diffusers`` (random
weights, ``save_pretrained``; nothing is downloaded), for the tests of ``dtdsl.models.hf``
and of training from pretrained weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["make_clip", "make_decoder", "make_siglip", "make_unet", "randomize", "quiet"]


def quiet() -> None:
    """Silence the libraries' progress bars and advice."""
    warnings.filterwarnings("ignore")
    from diffusers.utils import logging as dl
    from transformers.utils import logging as tl

    tl.set_verbosity_error()
    tl.disable_progress_bar()
    dl.set_verbosity_error()
    dl.disable_progress_bar()


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Every parameter drawn at a scale where a wrong connection shows (the libraries'
    initialisers leave norms at one and biases at zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * std
        owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if "norm" in owner and name.endswith(".weight"):
            p.copy_(1 + noise)
        else:
            p.copy_(noise)
    return model


def make_decoder(path: Path, family: str = "llama", *, seed: int = 0, layers: int = 4,
                 hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 96,
                 vocab: int = 128, dtype: torch.dtype | None = None,
                 original_format: bool = True, **config: Any) -> Path:
    """A Llama (3, with rope scaling by default), Mistral, Qwen2, Qwen3, Qwen2-MoE,
    Qwen3-MoE or Mixtral causal LM, stored in ``dtype`` (default fp32); MoE experts in the
    Hub's per-expert layout, or transformers 5's stacked one without ``original_format``."""
    import transformers

    quiet()
    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
           "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[family]
    kwargs = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=1024)
    if family == "llama":
        kwargs.update(rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    kwargs.update(config)
    cfg = getattr(transformers, f"{cls}Config")(**kwargs)
    model = randomize(getattr(transformers, f"{cls}ForCausalLM")(cfg), seed)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path, save_original_format=original_format)
    return path


def make_clip(path: Path, *, seed: int = 1, layers: int = 3, hidden: int = 32, heads: int = 4,
              ffn: int = 64, image: int = 32, patch: int = 8, full: bool = False,
              **config: Any) -> Path:
    """A CLIP vision tower (``full``: a whole CLIP model, text tower included)."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

    quiet()
    vision = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, image_size=image, patch_size=patch, **config)
    if full:
        model = CLIPModel(CLIPConfig(vision_config=vision, text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)))
    else:
        model = CLIPVisionModel(CLIPVisionConfig(**vision))
    randomize(model, seed).save_pretrained(path)
    return path


def make_siglip(path: Path, *, seed: int = 2, layers: int = 3, hidden: int = 32,
                heads: int = 4, ffn: int = 64, image: int = 32, patch: int = 8) -> Path:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    quiet()
    model = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, image_size=image, patch_size=patch))
    randomize(model, seed).save_pretrained(path)
    return path


def make_vae(path: Path, *, channels: tuple[int, ...] = (16, 32), latent_channels: int = 4,
             seed: int = 4, shift: float | None = None) -> Path:
    """A small diffusers AutoencoderKL (SD's layout: DownEncoderBlock2D, mid attention,
    quant_conv) saved in ``path``."""
    from diffusers import AutoencoderKL

    quiet()
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=channels,
                        down_block_types=("DownEncoderBlock2D",) * len(channels),
                        up_block_types=("UpDecoderBlock2D",) * len(channels),
                        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
                        sample_size=32, shift_factor=shift)
    randomize(vae, seed, std=0.05)
    vae.save_pretrained(path)
    return path


def make_unet(path: Path, *, sd: int = 2, seed: int = 3, prediction: str = "epsilon",
              context: int = 24, latent: int = 8, channels: tuple[int, ...] = (32, 64),
              pipeline: bool = True) -> Path:
    """An SD-1.x-style (8-wide 1x1-conv transformers) or SD-2.x-style (linear projections,
    heads per level) U-Net, in a pipeline folder with its scheduler (``pipeline``) or alone."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    quiet()
    heads: Any = [c // 16 for c in channels] if sd == 2 else 2
    unet = UNet2DConditionModel(
        sample_size=latent, in_channels=4, out_channels=4, block_out_channels=channels,
        layers_per_block=1, norm_num_groups=8, cross_attention_dim=context,
        down_block_types=("CrossAttnDownBlock2D",) * (len(channels) - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (len(channels) - 1),
        attention_head_dim=heads, use_linear_projection=sd == 2)
    randomize(unet, seed, std=0.05)
    target = path / "unet" if pipeline else path
    unet.save_pretrained(target)
    if pipeline:
        DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                      prediction_type=prediction).save_pretrained(path / "scheduler")
        (path / "model_index.json").write_text(json.dumps(
            {"_class_name": "StableDiffusionPipeline"}))
    return path
