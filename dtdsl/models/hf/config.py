"""Hugging Face configs to dtdsl architectures, and architectures back to configs.

``read_hf(path, role=..., feature_layer=...)`` reads a directory as ``transformers`` or
``diffusers`` wrote it and returns an ``HFModel``: the ``ir`` architecture that computes
exactly what the Hugging Face model computes, where its weights are, and an
``ir.HFSource`` that remembers the config (``dtc export`` writes it back). It reads:

- decoders (backbones): ``model_type`` ``llama`` (Llama 2/3, with ``rope_scaling`` or
  ``rope_parameters``: default, linear, llama3, yarn, dynamic), ``mistral``, ``qwen2``
  (Qwen2 and Qwen2.5: biases on Q, K and V), ``qwen3`` (QK-norm), and the MoE decoders
  ``qwen2_moe``, ``qwen3_moe`` and ``mixtral`` (``ir.MoEArch``, ``models.moe``);
- vision towers (encoders): ``clip`` / ``clip_vision_model`` and ``siglip`` /
  ``siglip_vision_model`` (a full CLIP or SigLIP directory gives its vision tower), read up
  to ``feature_layer`` (the ``hidden_states`` index a projector reads, as LLaVA's
  ``vision_feature_layer``: -2 is the penultimate layer's output; default: the model's
  ``last_hidden_state``);
- audio towers (encoders): ``whisper``'s encoder (a whole Whisper directory gives its
  encoder; ``WhisperEncoder``'s ``last_hidden_state``, over 30 s log-mel clips);
- generators: diffusers' ``UNet2DConditionModel`` (a ``unet`` folder, or a pipeline folder
  with ``model_index.json``) with the noise schedule and prediction type of the
  ``scheduler_config.json`` beside it.

Keys a config leaves out take the ``transformers`` / ``diffusers`` class defaults (older
files store only what differs from them). Every value is read through ``fields.Fields``:
typed and bounded, an HFError naming the key otherwise, before anything is built from it.
Anything these architectures do not compute (another ``model_type``, sliding-window
attention shorter than the sequence, SDXL's extra embeddings, ...) is an ``HFError``
naming it, never a silently different model.

No ``transformers`` or ``diffusers`` import: the configs are JSON, read here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtdsl.ir import program as ir
from dtdsl.models.hf.fields import Fields, HFError, named, open_regular, read_json, shown

__all__ = [
    "BACKBONE_TYPES", "ENCODER_TYPES", "HFError", "HFModel", "MOE_TYPES", "config_for",
    "native_family", "read_hf", "scheduler_config_for",
]

BACKBONE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
# The decoders whose feed-forward is a mixture of experts in some layers (``models.moe``).
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
_CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}
ENCODER_TYPES = ("clip", "clip_vision_model", "siglip", "siglip_vision_model", "whisper")

# transformers' config-class defaults (5.x; unchanged since 4.40) for the keys read here.
_DECODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "sliding_window": None},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": True,
              "mlp_bias": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "hidden_act": "silu",
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0, "tie_word_embeddings": False, "qkv_bias": True,
                  "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
                  "router_aux_loss_coef": 0.001, "mlp_only_layers": []},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "hidden_act": "silu", "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": 4096, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                  "mlp_only_layers": []},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
                "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
}
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
             "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
               "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
# WhisperConfig's defaults (transformers 4.27 to 5.x) for the encoder's keys.
_WHISPER_DEFAULTS: dict[str, Any] = {
    "d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6,
    "encoder_ffn_dim": 1536, "num_mel_bins": 80, "max_source_positions": 1500,
    "activation_function": "gelu",
}
_UNET_DEFAULTS: dict[str, Any] = {
    "sample_size": None, "in_channels": 4, "out_channels": 4, "center_input_sample": False,
    "flip_sin_to_cos": True, "freq_shift": 0,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                         "CrossAttnDownBlock2D", "DownBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                       "CrossAttnUpBlock2D"],
    "only_cross_attention": False, "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2, "downsample_padding": 1, "mid_block_scale_factor": 1,
    "act_fn": "silu", "norm_num_groups": 32, "norm_eps": 1e-5, "cross_attention_dim": 1280,
    "transformer_layers_per_block": 1, "attention_head_dim": 8, "num_attention_heads": None,
    "dual_cross_attention": False, "use_linear_projection": False,
    "resnet_time_scale_shift": "default", "time_embedding_type": "positional",
    "conv_in_kernel": 3, "conv_out_kernel": 3,
}
# What must keep its default for the U-Net to be SD 1.x/2.x's (diffusers' name: default).
_UNET_FIXED: dict[str, Any] = {
    "center_input_sample": False, "flip_sin_to_cos": True, "freq_shift": 0,
    "mid_block_type": "UNetMidBlock2DCrossAttn", "only_cross_attention": False,
    "dual_cross_attention": False, "downsample_padding": 1, "mid_block_scale_factor": 1,
    "act_fn": "silu", "resnet_time_scale_shift": "default",
    "time_embedding_type": "positional", "conv_in_kernel": 3, "conv_out_kernel": 3,
    "class_embed_type": None, "addition_embed_type": None, "encoder_hid_dim": None,
    "encoder_hid_dim_type": None, "time_cond_proj_dim": None, "num_class_embeds": None,
    "time_embedding_dim": None, "time_embedding_act_fn": None, "timestep_post_act": None,
    "resnet_skip_time_act": False, "resnet_out_scale_factor": 1.0,
    "class_embeddings_concat": False, "cross_attention_norm": None,
    "attention_type": "default", "reverse_transformer_layers_per_block": None,
    "mid_block_only_cross_attention": None,
}
_SCHEDULER_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02,
    "beta_schedule": "linear", "trained_betas": None, "prediction_type": "epsilon",
    "rescale_betas_zero_snr": False,
}
_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "silu": "silu"}
_ACT_NAMES = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
              "silu": "silu"}


# Bounds of the values read from a config: the language's own for `transformer(...)` and
# `unet(...)` (frontend.check) where it has one, so that an hf() model is held to about
# what a written one is.
# Each is far above any published model (the deepest LLMs have about 128 layers, the
# widest a hidden size of 25_600, the largest vocabularies 262_144 tokens, SD's U-Nets 4
# levels of at most 1280 channels), and small enough that what dtdsl does per unit of
# them (a meta module's layers, the checker's loops) stays quick.
_MAX_LAYERS = 1024
_MAX_HIDDEN = 1 << 17
_MAX_HEADS = 4096
_MAX_FFN = 1 << 20
_MAX_EXPERTS = 1 << 12              # DeepSeek-V3: 256 routed experts
_MAX_VOCAB = 1 << 24
_MAX_POSITIONS = 1 << 27            # Llama 4 Scout reads 10M tokens: 2^23.3
_MAX_IMAGE = 1 << 14                # pixels along a side
_MAX_PATCH = 1024
_MAX_IN_CHANNELS = 64
_MAX_MEL_BINS = 1024                # Whisper reads 80 or 128
_MAX_SOURCE_POSITIONS = 1 << 16     # Whisper: 1500 (30 s)
_MAX_LEVELS = 8
_MAX_UNET_CHANNELS = 1 << 16
_MAX_RES_BLOCKS = 16
_MAX_DEPTH = 64                     # SDXL's deepest level has 10 transformer layers
_MAX_LATENT = 1024                  # latent pixels along a side (SD: 64 or 96)
_MAX_CONTEXT = 1 << 17
_MAX_TIMESTEPS = 1 << 20            # a schedule's table has one entry per timestep
_PER_LEVEL = " (one per level of block_out_channels)"


@dataclass(frozen=True)
class HFModel:
    """What ``read_hf`` found."""

    role: str                                  # encoder, backbone or generator
    arch: ir.TransformerArch | ir.UNetArch
    source: ir.HFSource
    weights_dir: Path                          # where its safetensors files are
    notes: tuple[str, ...] = field(default=())  # worth a warning (a missing scheduler, ...)
    # The config's quantization_config method (gptq, awq, fp8, bitsandbytes_4bit, ...):
    # its weights are not floating-point tensors dtdsl can train.
    quantization: str | None = None


# ---- decoders ----------------------------------------------------------------------------

def _rope(f: Fields) -> ir.RoPE:
    params = f.object("rope_parameters")
    if params is not None and not params.has("rope_theta") and params.data and \
            all(isinstance(v, dict) for v in params.data.values()):
        raise HFError("per-layer-type rope_parameters are not supported")
    spec = params if params is not None else f.object("rope_scaling")
    spec = spec if spec is not None else Fields({}, prefix="rope_scaling.")
    # rope_theta lives in rope_parameters (transformers 5) or beside it (4.x); one beside
    # it that rope_parameters overrides must be a number all the same.
    theta = f.number("rope_theta", gt=0)
    if spec.has("rope_theta"):
        theta = spec.number("rope_theta", gt=0)
    kind = spec.text("rope_type", optional=True) or spec.text("type", optional=True) or \
        "default"
    where = spec if spec.has("partial_rotary_factor") else f
    partial = where.number("partial_rotary_factor", gt=0, le=1, optional=True)
    if partial not in (None, 1.0):
        raise HFError(f"partial_rotary_factor {partial} (rotary embeddings on part of each "
                      "head) is not supported")
    max_positions = f.integer("max_position_embeddings", high=_MAX_POSITIONS)
    common = {"theta": theta, "max_positions": max_positions}
    if kind == "default":
        return ir.RoPE(**common)
    if kind in ("linear", "dynamic"):
        if not spec.has("factor"):
            raise HFError(f"{kind} rope scaling without a factor")
        return ir.RoPE(scaling=kind, factor=spec.number("factor", gt=0), **common)
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if not spec.has(k)]
        if missing:
            raise HFError(f"llama3 rope scaling without {', '.join(missing)}")
        low, high = spec.number("low_freq_factor", gt=0), spec.number("high_freq_factor", gt=0)
        spec.require(high > low, "high_freq_factor", high,
                     f"above low_freq_factor {low:g} (the band between them is smoothed)")
        return ir.RoPE(scaling="llama3", factor=spec.number("factor", gt=0),
                       low_freq_factor=low, high_freq_factor=high,
                       original_max_positions=spec.integer(
                           "original_max_position_embeddings", high=_MAX_POSITIONS),
                       **common)
    if kind == "yarn":
        original = spec.integer("original_max_position_embeddings", high=_MAX_POSITIONS,
                                optional=True) or max_positions
        factor = spec.number("factor", gt=0, optional=True)
        truncate = spec.flag("truncate") if spec.has("truncate") else True
        return ir.RoPE(scaling="yarn", factor=factor if factor is not None else
                       max_positions / original, original_max_positions=original,
                       attention_factor=spec.number("attention_factor", gt=0, optional=True),
                       beta_fast=spec.number("beta_fast", gt=0, optional=True) or 32.0,
                       beta_slow=spec.number("beta_slow", gt=0, optional=True) or 1.0,
                       mscale=spec.number("mscale", optional=True),
                       mscale_all_dim=spec.number("mscale_all_dim", optional=True),
                       truncate=truncate, **common)
    raise HFError(f"rope_type {named(kind)} is not supported",
                  hint="dtdsl computes default, linear, llama3, yarn and dynamic rotary "
                  "embeddings")


def _heads(f: Fields, hidden: int) -> int:
    """num_attention_heads: at most one per dimension of the hidden state."""
    heads = f.integer("num_attention_heads", high=_MAX_HEADS)
    f.require(heads <= hidden, "num_attention_heads", heads,
              f"at most hidden_size {hidden} (a head has at least one dimension)")
    return heads


_DROPOUT = re.compile(r"dropout|layerdrop|pdrop")


def _no_dropout(cfg: dict[str, Any], unused: Sequence[str] = ()) -> None:
    """HFError for a dropout the config sets: dtdsl's modules have none, and training
    without what the config asks would differ from transformers' in silence."""
    for key, value in cfg.items():
        if (_DROPOUT.search(key) and key not in unused and isinstance(value, (int, float))
                and not isinstance(value, bool) and value != 0):
            shown = f"{value:g}" if abs(value) < 1e300 else \
                f"an integer of {len(str(abs(value)))} digits"   # past a float's range
            raise HFError(f"{key} {shown}: dtdsl trains without dropout",
                          hint="set it to 0 (most published checkpoints do)")


def _decoder(cfg: dict[str, Any], family: str) -> ir.TransformerArch:
    d = _DECODER_DEFAULTS[family]
    f = Fields(cfg, defaults=d)
    hidden = f.integer("hidden_size", high=_MAX_HIDDEN)
    heads = _heads(f, hidden)
    # Left out: the class default (Mistral's 8, Qwen2's 32); null, or Llama's default: MHA.
    kv = f.integer("num_key_value_heads", high=_MAX_HEADS, optional=True, null_default=False)
    kv = kv or heads
    f.require(heads % kv == 0, "num_key_value_heads", kv,
              f"a divisor of num_attention_heads {heads} (each key-value head serves as "
              "many query heads as the others)")
    layers = f.integer("num_hidden_layers", high=_MAX_LAYERS)
    act = f.text("hidden_act")
    if act != "silu":
        raise HFError(f"hidden_act {named(act)}: the {family} MLP dtdsl builds gates with "
                      "silu")
    head_dim = f.integer("head_dim", high=_MAX_HIDDEN, optional=True)
    if head_dim is None:
        if hidden % heads:
            raise HFError(f"hidden_size {hidden} is not divisible by num_attention_heads "
                          f"{heads} and the config gives no head_dim")
        head_dim = hidden // heads
    if head_dim % 2:
        raise HFError(f"head_dim {head_dim} is odd: rotary position embeddings turn pairs of "
                      "a head's dimensions")
    return ir.TransformerArch(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
        ffn=f.integer("intermediate_size", high=_MAX_FFN),
        vocab=f.integer("vocab_size", high=_MAX_VOCAB), swiglu=True,
        causal=True, kv_channels=head_dim if head_dim * heads != hidden else None,
        norm="rms", norm_eps=f.number("rms_norm_eps", gt=0, lt=1), activation="silu",
        rope=_rope(f), tie_embeddings=f.flag("tie_word_embeddings"),
        sliding_window=_window(f, family, layers), qk_norm=family in ("qwen3", "qwen3_moe"),
        moe=_moe(f, family, layers), **_biases(f, family))


def _moe(f: Fields, family: str, layers: int) -> ir.MoEArch | None:
    """The mixture of experts of an MoE decoder (None for a dense one): transformers'
    routing is dropless, Mixtral's top-k weights always renormalised, Qwen2-MoE's shared
    expert behind a sigmoid gate. Layer ``i`` holds experts when ``(i + 1) %
    decoder_sparse_step == 0``; other layer choices (``mlp_only_layers``) and a router
    that adds noise while training (Mixtral's ``router_jitter_noise``) are refused."""
    if family not in MOE_TYPES:
        return None
    experts_key = "num_local_experts" if family == "mixtral" or (
        not f.has("num_experts") and f.has("num_local_experts")) else "num_experts"
    experts = f.integer(experts_key, high=_MAX_EXPERTS)
    top_k = f.integer("num_experts_per_tok", high=experts)
    if family == "mixtral":
        jitter = f.number("router_jitter_noise", optional=True) or 0.0
        if jitter:
            raise HFError(f"router_jitter_noise {jitter:g}: dtdsl's router adds no noise "
                          "to the routing logits", hint="set it to 0")
        return ir.MoEArch(experts=experts, top_k=top_k,
                          ffn=f.integer("intermediate_size", high=_MAX_FFN),
                          aux_loss_coef=f.number("router_aux_loss_coef", ge=0))
    only = f.raw("mlp_only_layers")
    if only not in ([], None):
        raise HFError(f"mlp_only_layers {shown(only)}: dtdsl's MoE layers are every "
                      "decoder_sparse_step-th layer, with no exceptions",
                      hint="give mlp_only_layers [] and choose decoder_sparse_step")
    every = f.integer("decoder_sparse_step", high=layers)
    shared = f.integer("shared_expert_intermediate_size", high=_MAX_FFN) \
        if family == "qwen2_moe" else 0
    return ir.MoEArch(experts=experts, top_k=top_k,
                      ffn=f.integer("moe_intermediate_size", high=_MAX_FFN),
                      shared_ffn=shared, shared_gate=shared > 0,
                      norm_topk=f.flag("norm_topk_prob"), every=every,
                      aux_loss_coef=f.number("router_aux_loss_coef", ge=0))


def _window(f: Fields, family: str, layers: int) -> int | None:
    """The sliding attention window if any layer slides (as transformers decides it), or
    None. It changes nothing while a sequence fits in it; the checker holds seq_len to it."""
    def window() -> int | None:       # left out: the class default; null: none
        return f.integer("sliding_window", high=_MAX_POSITIONS, optional=True,
                         null_default=False)

    if family in ("mistral", "mixtral"):
        return window()
    if family not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or \
            not f.flag("use_sliding_window"):
        return None     # Llama has no sliding attention, whatever its config says
    if family == "qwen3_moe":           # every layer slides
        return window()
    if f.has("layer_types"):            # written by transformers >= 4.53, and what it reads
        kinds = f.texts("layer_types", count=layers, per=" (one per layer)")
        for kind in kinds:
            f.require(kind in ("full_attention", "sliding_attention"), "layer_types", kinds,
                      "a list of 'full_attention' and 'sliding_attention'")
        slides = "sliding_attention" in kinds
    else:
        # max_window_layers (any count): Qwen2 and Qwen3 slide the layers from it on,
        # Qwen2-MoE every other layer below it.
        below = f.integer("max_window_layers", low=0, high=1 << 20)
        slides = below > 0 if family == "qwen2_moe" else below < layers
    return window() if slides else None


def _biases(f: Fields, family: str) -> dict[str, bool]:
    if family == "qwen2":
        return {"qkv_bias": True, "out_bias": False, "mlp_bias": False}
    if family == "qwen2_moe":
        return {"qkv_bias": f.flag("qkv_bias"), "out_bias": False, "mlp_bias": False}
    if family in ("mistral", "mixtral"):   # no biases in their attention, whatever the config
        return {"qkv_bias": False, "out_bias": False, "mlp_bias": False}
    if family in ("qwen3", "qwen3_moe"):
        attention = f.flag("attention_bias")
        return {"qkv_bias": attention, "out_bias": attention, "mlp_bias": False}
    attention = f.flag("attention_bias")
    return {"qkv_bias": attention, "out_bias": attention, "mlp_bias": f.flag("mlp_bias")}


# ---- vision towers -----------------------------------------------------------------------

def _vision(f: Fields, family: str, feature_layer: int | None
            ) -> tuple[ir.TransformerArch, int]:
    hidden = f.integer("hidden_size", high=_MAX_HIDDEN)
    heads = _heads(f, hidden)
    if hidden % heads:
        raise HFError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    total = f.integer("num_hidden_layers", high=_MAX_LAYERS)
    act = f.text("hidden_act")
    if act not in _ACTIVATIONS or act == "silu":
        raise HFError(f"hidden_act {named(act)} is not supported in a vision tower",
                      hint="dtdsl computes quick_gelu, gelu and gelu_pytorch_tanh")
    image = f.integer("image_size", high=_MAX_IMAGE)
    patch = f.integer("patch_size", high=_MAX_PATCH)
    if image < patch:
        raise HFError(f"image_size {image} is smaller than patch_size {patch}")
    layers, post_norm = total, family == "siglip"
    if feature_layer is not None:
        layers = total + 1 + feature_layer if feature_layer < 0 else feature_layer
        if not 1 <= layers <= total:
            raise HFError(f"feature_layer {feature_layer} is outside the tower's "
                          f"hidden_states (num_hidden_layers {total}: 1..{total}, or "
                          f"-{total}..-1)")
        post_norm = False      # hidden_states[k] is a layer's output, before any final norm
    clip = family == "clip"
    arch = ir.TransformerArch(
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
        ffn=f.integer("intermediate_size", high=_MAX_FFN), patch=patch,
        in_channels=f.integer("num_channels", high=_MAX_IN_CHANNELS), causal=False,
        norm="layer", norm_eps=f.number("layer_norm_eps", gt=0, lt=1),
        activation=_ACTIVATIONS[act], qkv_bias=True, out_bias=True, mlp_bias=True,
        positions="learned", image_size=image, cls_token=clip, patch_bias=not clip,
        pre_norm=clip, post_norm=post_norm)
    return arch, total


# ---- audio towers ------------------------------------------------------------------------

def _whisper(f: Fields) -> ir.TransformerArch:
    """Whisper's encoder: a conv stem over log-mel frames, fixed sinusoids, pre-LN layers
    with biases on Q, V, O and the MLP but not on K, exact-GELU stem, a final LayerNorm
    (PyTorch's default epsilon: Whisper's config has none)."""
    hidden = f.integer("d_model", high=_MAX_HIDDEN)
    heads = f.integer("encoder_attention_heads", high=_MAX_HEADS)
    f.require(hidden % heads == 0, "encoder_attention_heads", heads,
              f"a divisor of d_model {hidden}")
    f.require(hidden % 2 == 0 and hidden >= 4, "d_model", hidden,
              "even and at least 4 (Whisper's sinusoidal positions pair sines and cosines)")
    act = f.text("activation_function")
    if act not in _ACTIVATIONS or act == "silu":
        raise HFError(f"activation_function {named(act)} is not supported in Whisper's "
                      "encoder", hint="dtdsl computes gelu, gelu_new and quick_gelu")
    return ir.TransformerArch(
        layers=f.integer("encoder_layers", high=_MAX_LAYERS), hidden=hidden, heads=heads,
        kv_heads=heads, ffn=f.integer("encoder_ffn_dim", high=_MAX_FFN),
        in_channels=f.integer("num_mel_bins", high=_MAX_MEL_BINS), causal=False,
        norm="layer", norm_eps=1e-5, activation=_ACTIVATIONS[act], qkv_bias=True,
        k_bias=False, out_bias=True, mlp_bias=True, post_norm=True, stem="whisper_conv",
        max_source_positions=f.integer("max_source_positions", high=_MAX_SOURCE_POSITIONS))


# ---- U-Net ----------------------------------------------------------------------------

def _unet_levels(f: Fields) -> tuple[tuple[int, ...], list[int]]:
    """The channels of each level, and the levels with cross-attention."""
    boc = f.integers("block_out_channels", high=_MAX_UNET_CHANNELS, max_len=_MAX_LEVELS)
    levels = len(boc)
    f.require(all(c % boc[0] == 0 for c in boc), "block_out_channels", list(boc),
              "multiples of the first")
    down = f.texts("down_block_types", count=levels, per=_PER_LEVEL)
    up = f.texts("up_block_types", count=levels, per=_PER_LEVEL)
    attention = []
    for i, (kind, mirror) in enumerate(zip(down, reversed(up), strict=True)):
        if kind not in ("CrossAttnDownBlock2D", "DownBlock2D"):
            raise HFError(f"down_block_types: {named(kind)} is not supported")
        want = "CrossAttnUpBlock2D" if kind == "CrossAttnDownBlock2D" else "UpBlock2D"
        if mirror != want:
            raise HFError(f"up_block_types: {named(mirror)} at level {i} does not mirror "
                          f"its down block {kind!r}")
        if kind == "CrossAttnDownBlock2D":
            attention.append(i)
    return boc, attention


def _one(f: Fields, key: str, levels: int, high: int) -> int:
    """A per-level key that dtdsl's U-Net needs the same at every level."""
    values = set(f.integers(key, high=high, count=levels, per=_PER_LEVEL))
    if len(values) != 1:
        raise HFError(f"different {key} per level are not supported")
    return values.pop()


def _unet(cfg: dict[str, Any], scheduler: dict[str, Any] | None) -> ir.UNetArch:
    cls = cfg.get("_class_name")
    if cls != "UNet2DConditionModel":
        raise HFError(f"_class_name {named(cls)}: dtdsl trains UNet2DConditionModel "
                      "generators (Stable Diffusion 1.x/2.x)")
    for key, want in _UNET_FIXED.items():
        got = cfg.get(key, want)
        if isinstance(want, float) and isinstance(got, (int, float)):
            got = float(got)
        if got != want:
            raise HFError(f"{key} = {named(got)} is not supported (dtdsl's U-Net is SD "
                          f"1.x/2.x's: {key} = {json.dumps(want)})")
    f = Fields(cfg, defaults=_UNET_DEFAULTS)
    boc, attention = _unet_levels(f)
    levels = len(boc)
    res_blocks = _one(f, "layers_per_block", levels, _MAX_RES_BLOCKS)
    depth = _one(f, "transformer_layers_per_block", levels, _MAX_DEPTH)
    head_key = "num_attention_heads" if f.has("num_attention_heads") else "attention_head_dim"
    heads = f.integers(head_key, high=_MAX_UNET_CHANNELS, count=levels, per=_PER_LEVEL)
    context = _one(f, "cross_attention_dim", levels, _MAX_CONTEXT)
    if not f.has("sample_size"):
        raise HFError("the U-Net config has no sample_size (its latent side)",
                      hint="add \"sample_size\": 64 (512x512 images) to its config.json")
    sample = _one(f, "sample_size", 1, _MAX_LATENT) if not isinstance(
        cfg["sample_size"], list) else _square(f)
    if sample % (2 ** (levels - 1)):
        raise HFError(f"sample_size {sample} cannot be halved {levels - 1} times")
    channels = f.integer("in_channels", high=_MAX_IN_CHANNELS)
    out = f.integer("out_channels", high=_MAX_IN_CHANNELS)
    if out != channels:
        raise HFError(f"in_channels {channels} and out_channels {out} differ; dtdsl's U-Net "
                      "predicts noise of its input's shape")
    groups = f.integer("norm_num_groups", high=_MAX_UNET_CHANNELS)
    for level, ch in enumerate(boc):
        if ch % groups:
            raise HFError(f"block_out_channels: {ch} channels at level {level} cannot form "
                          f"norm_num_groups {groups} groups")
        if (level in attention or level == levels - 1) and ch % heads[level]:
            raise HFError(f"{head_key}: block_out_channels {ch} at level {level} are not a "
                          f"whole number of {heads[level]} heads")
    first = attention[0] if attention else levels - 1
    return ir.UNetArch(
        channels=boc[0], mult=tuple(c // boc[0] for c in boc), res_blocks=res_blocks,
        attn_res=tuple(2 ** i for i in attention), latent=sample, latent_channels=channels,
        head_dim=boc[first] // heads[first], context_dim=context, transformer_depth=depth,
        groups=groups, heads=heads, linear_proj=f.flag("use_linear_projection"),
        norm_eps=f.number("norm_eps", gt=0, lt=1), **_schedule(scheduler))


def _square(f: Fields) -> int:
    sides = set(f.integers("sample_size", high=_MAX_LATENT, max_len=2))
    if len(sides) != 1:
        raise HFError(f"sample_size {shown(f.raw('sample_size'))} is not square")
    return sides.pop()


def _schedule(scheduler: dict[str, Any] | None) -> dict[str, Any]:
    """The noise schedule and prediction type of a scheduler config (DDPM's defaults)."""
    s = Fields(scheduler or {}, defaults=_SCHEDULER_DEFAULTS, what="scheduler config key")
    if s.has("trained_betas"):
        raise HFError("a scheduler with trained_betas is not supported")
    if s.flag("rescale_betas_zero_snr"):
        raise HFError("rescale_betas_zero_snr is not supported")
    beta_schedule, prediction = s.text("beta_schedule"), s.text("prediction_type")
    if beta_schedule not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
        raise HFError(f"beta_schedule {named(beta_schedule)} is not supported",
                      hint="dtdsl trains on linear, scaled_linear and squaredcos_cap_v2")
    if prediction not in ("epsilon", "v_prediction"):
        raise HFError(f"prediction_type {named(prediction)} is not supported",
                      hint="dtdsl trains epsilon and v_prediction U-Nets")
    # A beta is a share of variance added per step: in [0, 1).
    return dict(prediction=prediction, beta_schedule=beta_schedule,
                beta_start=s.number("beta_start", ge=0, lt=1),
                beta_end=s.number("beta_end", ge=0, lt=1),
                timesteps=s.integer("num_train_timesteps", high=_MAX_TIMESTEPS))

# ---- directories -------------------------------------------------------------------------

def _scheduler_file(unet_dir: Path) -> Path | None:
    for candidate in (unet_dir / "scheduler_config.json",
                      unet_dir.parent / "scheduler" / "scheduler_config.json"):
        if candidate.is_file():
            return candidate
    return None


def _model_dir(path: str | Path) -> Path:
    """The folder holding the model's config.json (a pipeline's ``unet``), absolute."""
    root = Path(path).expanduser()
    if not root.exists():
        raise HFError(f"{root} does not exist")
    if not root.is_dir():
        raise HFError(f"{root} is a file, not a Hugging Face model directory",
                      hint="give the directory that holds config.json")
    root = root.resolve()
    if (root / "model_index.json").is_file() and not (root / "config.json").is_file():
        if not (root / "unet" / "config.json").is_file():
            raise HFError(f"{root} is a diffusers pipeline without a unet/config.json")
        root = root / "unet"
    if not (root / "config.json").is_file():
        raise HFError(f"{root} has no config.json", hint=_hub_hint(root) or
                      "a Hugging Face model directory, as save_pretrained writes it")
    return root


def _hub_hint(root: Path) -> str | None:
    """Where the model is when ``root`` is a Hub cache's repository folder
    (``models--org--name``, whose ``refs/main`` names the snapshot to read)."""
    if not (root / "snapshots").is_dir():
        return None
    try:
        with open_regular(root / "refs" / "main") as f:
            rev = f.read(64).decode("ascii").strip()
    except (HFError, UnicodeDecodeError):
        rev = ""
    rev = rev if re.fullmatch(r"[0-9a-f]{7,40}", rev) else "<revision>"
    return f"a Hugging Face hub cache folder: point at {root / 'snapshots' / rev}"


def _role_of(cfg: dict[str, Any], config_path: Path) -> str:
    if cfg.get("_class_name") is not None or cfg.get("_diffusers_version") is not None:
        return "generator"
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in BACKBONE_TYPES:
        return "backbone"
    if isinstance(model_type, str) and model_type in ENCODER_TYPES:
        return "encoder"
    raise HFError(f"model_type {named(model_type)} is not supported" if model_type else
                  f"{config_path} has no model_type",
                  hint="dtdsl reads llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe "
                  "and mixtral (backbones), clip and "
                  "siglip (vision towers), whisper (audio towers) and diffusers' "
                  "UNet2DConditionModel (generators)")


def _plain(value: Any) -> str | None:
    """A short string as it is (to say what a directory holds), else None."""
    return value if isinstance(value, str) and len(value) <= 64 else None


def _quantization(cfg: dict[str, Any]) -> str | None:
    """The quantisation method a config declares (None: the weights are plain)."""
    for key in ("quantization_config", "compression_config"):
        qc = cfg.get(key)
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            return method if isinstance(method, str) and len(method) < 64 else "unknown"
    return None


def read_hf(path: str | Path, *, role: str | None = None,
            feature_layer: int | None = None) -> HFModel:
    """The model in Hugging Face directory ``path`` (module docstring); ``role``: the role
    the spec gives it (an error when the model cannot play it); ``feature_layer``: for a
    vision tower, the ``hidden_states`` index its projector reads. Every value read from
    the config is typed and bounded (``fields``): an HFError names the key that is not."""
    root = _model_dir(path)
    config_path = root / "config.json"
    cfg, sha = read_json(config_path, "model config")
    found_role = _role_of(cfg, config_path)
    if role is not None and role != found_role:
        tower = "an audio tower" if cfg.get("model_type") == "whisper" else "a vision tower"
        what = {"backbone": "a language model", "encoder": tower,
                "generator": f"a diffusers {_plain(cfg.get('_class_name')) or 'model'}"
                }[found_role]
        article = {"backbone": "the", "encoder": "an", "generator": "a"}[role]
        raise HFError(f"{root} holds {what}, which cannot be {article} {role}")
    if feature_layer is not None and (found_role != "encoder" or
                                      cfg.get("model_type") == "whisper"):
        raise HFError("feature_layer applies to vision towers only")
    notes: list[str] = []
    source_layers = None
    scheduler_text = None
    if found_role == "backbone":
        family = cfg["model_type"]
        _no_dropout(cfg)
        arch = _decoder(cfg, family)
        stored = cfg
    elif cfg.get("model_type") == "whisper":
        family = "whisper"
        _no_dropout(cfg, unused=("decoder_layerdrop",))     # dtdsl trains the encoder
        arch = _whisper(Fields(cfg, defaults=_WHISPER_DEFAULTS))
        stored = cfg            # the whole model's: dtc export writes its decoder back too
    elif found_role == "encoder":
        family = "clip" if cfg["model_type"].startswith("clip") else "siglip"
        f = Fields(cfg, defaults=_VISION_DEFAULTS[family])
        if cfg["model_type"] in ("clip", "siglip"):
            f = f.object("vision_config", defaults=_VISION_DEFAULTS[family]) or Fields(
                {}, defaults=_VISION_DEFAULTS[family])
        _no_dropout(f.data)
        arch, source_layers = _vision(f, family, feature_layer)
        stored = {**f.data, "model_type": f"{family}_vision_model"}
    else:
        family = "unet"
        scheduler_path = _scheduler_file(root)
        scheduler = None
        if scheduler_path is None:
            notes.append(f"no scheduler_config.json beside {root}: training on DDPM's linear "
                         "beta schedule with epsilon prediction (diffusers' defaults)")
        else:
            scheduler, _ = read_json(scheduler_path, "scheduler config")
            scheduler_text = json.dumps(scheduler, sort_keys=True)
        arch = _unet(cfg, scheduler)
        stored = cfg
    source = ir.HFSource(path=str(root), family=family, config=json.dumps(stored, sort_keys=True),
                         config_sha256=sha, scheduler=scheduler_text,
                         source_layers=source_layers, feature_layer=feature_layer)
    return HFModel(role=found_role, arch=arch, source=source, weights_dir=root,
                   notes=tuple(notes), quantization=_quantization(cfg))


# ---- architectures back to configs -------------------------------------------------------

def _rope_config(rope: ir.RoPE) -> dict[str, Any] | None:
    if rope.scaling == "default":
        return None
    out: dict[str, Any] = {"rope_type": rope.scaling, "factor": rope.factor}
    if rope.scaling == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_positions)
    if rope.scaling == "yarn":
        out.update(original_max_position_embeddings=rope.original_max_positions,
                   beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, key) is not None:
                out[key] = getattr(rope, key)
    return out


def config_for(arch: ir.TransformerArch | ir.UNetArch, role: str,
               source: ir.HFSource | None = None, *, layers: int | None = None
               ) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model that computes what a dtdsl module of
    ``arch`` computes: the ``source`` config the architecture was read from, with the
    architecture's own values written over it (a tower read below its top layer is
    written with ``layers``, default the layers it has), or, without a source, the family
    that matches (a SwiGLU RMSNorm backbone is a Llama; a U-Net a UNet2DConditionModel).
    HFError when no Hugging Face model computes it (dtdsl's sinusoidal ViT, a GELU
    backbone)."""
    base: dict[str, Any] = json.loads(source.config) if source is not None else {}
    if isinstance(arch, ir.UNetArch):
        levels = len(arch.mult)
        attention = set(arch.attention_levels)
        out = {**base, "_class_name": "UNet2DConditionModel",
               "sample_size": arch.latent, "in_channels": arch.latent_channels,
               "out_channels": arch.latent_channels,
               "down_block_types": ["CrossAttnDownBlock2D" if i in attention else "DownBlock2D"
                                    for i in range(levels)],
               "up_block_types": ["CrossAttnUpBlock2D" if i in attention else "UpBlock2D"
                                  for i in reversed(range(levels))],
               "block_out_channels": list(arch.level_channels),
               "layers_per_block": arch.res_blocks, "norm_num_groups": arch.groups,
               "norm_eps": arch.norm_eps, "cross_attention_dim": arch.context_dim,
               "transformer_layers_per_block": arch.transformer_depth,
               "attention_head_dim": [arch.level_heads(i) for i in range(levels)],
               "use_linear_projection": arch.linear_proj}
        out.pop("num_attention_heads", None)
        return out
    if role == "backbone":
        if not (arch.swiglu and arch.norm_kind("backbone") == "rms" and arch.act == "silu"):
            raise HFError("no Hugging Face decoder computes this backbone (Llama, Mistral and "
                          "Qwen2 need swiglu and RMSNorm)")
        family = source.family if source is not None else native_family(arch)
        out = {**base, "model_type": family, "architectures": [_CAUSAL_LM[family]],
               "hidden_size": arch.hidden, "intermediate_size": arch.ffn,
               "num_hidden_layers": arch.layers, "num_attention_heads": arch.heads,
               "num_key_value_heads": arch.kv_heads, "vocab_size": arch.vocab,
               "hidden_act": "silu", "rms_norm_eps": arch.eps("backbone"),
               "head_dim": arch.head_dim, "tie_word_embeddings": arch.tie_embeddings,
               "rope_theta": arch.rope.theta, "rope_scaling": _rope_config(arch.rope)}
        out.pop("rope_parameters", None)
        if arch.qk_norm != (family in ("qwen3", "qwen3_moe")):
            raise HFError(f"a {family} has {'no ' if arch.qk_norm else ''}QK-norm")
        if (arch.moe is not None) != (family in MOE_TYPES):
            raise HFError(f"a {family} is {'dense' if arch.moe is not None else 'an MoE'}")
        if arch.moe is not None:
            out.update(_moe_config(arch, family))
        if family == "qwen2":
            if not arch.qkv_bias or arch.out_bias or arch.mlp_bias:
                raise HFError("a Qwen2 has biases on Q, K and V only")
        elif family == "qwen2_moe":
            if arch.out_bias or arch.mlp_bias:
                raise HFError("a Qwen2-MoE has biases on Q, K and V or on none")
            out["qkv_bias"] = arch.qkv_bias
        else:
            if arch.qkv_bias != arch.out_bias:
                raise HFError(f"a {family} has biases on all of Q, K, V and O or on none")
            out["attention_bias"] = arch.qkv_bias
            if family == "llama":
                out["mlp_bias"] = arch.mlp_bias
            elif arch.mlp_bias:
                raise HFError(f"a {family} has no MLP biases")
            if family in ("mistral", "mixtral") and arch.qkv_bias:
                raise HFError(f"a {family} has no attention biases")
        if arch.rope.max_positions is not None:
            out["max_position_embeddings"] = arch.rope.max_positions
        if arch.sliding_window is not None:
            out["sliding_window"] = arch.sliding_window
        return out
    if arch.stem == "whisper_conv":
        return _whisper_config(arch, base)
    if arch.positions != "learned" or not arch.qkv_bias:
        raise HFError("no Hugging Face vision tower computes this encoder (dtdsl's ViT has "
                      "sinusoidal positions and no biases); only towers read with hf() export")
    family = "clip" if arch.cls_token else "siglip"
    out = {**base, "model_type": f"{family}_vision_model",
           "architectures": ["CLIPVisionModel" if family == "clip" else "SiglipVisionModel"],
           "hidden_size": arch.hidden, "intermediate_size": arch.ffn,
           "num_hidden_layers": layers or arch.layers, "num_attention_heads": arch.heads,
           "num_channels": arch.in_channels or 3, "image_size": arch.image_size,
           "patch_size": arch.patch, "layer_norm_eps": arch.eps("encoder"),
           "hidden_act": _ACT_NAMES[arch.act]}
    return out


def native_family(arch: ir.TransformerArch) -> str:
    """The Hugging Face family of a backbone written in the language (no ``hf()``)."""
    moe = arch.moe
    if moe is None:
        return "qwen3" if arch.qk_norm else "llama"
    if moe.shared_ffn:
        return "qwen2_moe"
    return "qwen3_moe" if arch.qk_norm else "mixtral"


def _moe_config(arch: ir.TransformerArch, family: str) -> dict[str, Any]:
    """The MoE keys of a ``family`` config for ``arch.moe`` (HFError where the family's
    block cannot compute it)."""
    moe = arch.moe
    if moe.capacity_factor is not None:
        raise HFError(f"a {family} routes without capacity: give capacity_factor none")
    if family == "mixtral":
        if not moe.norm_topk or moe.every != 1 or moe.shared_ffn:
            raise HFError("a Mixtral renormalises its top-k weights in every layer and has "
                          "no shared expert")
        if moe.ffn != arch.ffn:
            raise HFError(f"a Mixtral's experts are as wide as its ffn ({arch.ffn}), not "
                          f"{moe.ffn}")
        return {"num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k,
                "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0}
    if bool(moe.shared_ffn) != (family == "qwen2_moe") or (moe.shared_ffn and
                                                          not moe.shared_gate):
        raise HFError(f"a {family} has {'a gated' if family == 'qwen2_moe' else 'no'} "
                      "shared expert")
    out = {"num_experts": moe.experts, "num_experts_per_tok": moe.top_k,
           "moe_intermediate_size": moe.ffn, "decoder_sparse_step": moe.every,
           "norm_topk_prob": moe.norm_topk, "mlp_only_layers": [],
           "router_aux_loss_coef": moe.aux_loss_coef}
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = moe.shared_ffn
    return out


def _whisper_config(arch: ir.TransformerArch, base: dict[str, Any]) -> dict[str, Any]:
    """A Whisper model's config with this encoder (its decoder as ``base`` has it, else
    WhisperConfig's defaults)."""
    if arch.k_bias is not False or not (arch.qkv_bias and arch.out_bias and arch.mlp_bias) \
            or not arch.post_norm or arch.norm_kind("encoder") != "layer":
        raise HFError("no Hugging Face Whisper encoder computes this audio tower (Whisper's "
                      "has biases on Q, V, O and the MLP, none on K, and a final LayerNorm)")
    return {**base, "model_type": "whisper",
            "architectures": base.get("architectures") or ["WhisperForConditionalGeneration"],
            "d_model": arch.hidden, "encoder_layers": arch.layers,
            "encoder_attention_heads": arch.heads, "encoder_ffn_dim": arch.ffn,
            "num_mel_bins": arch.in_channels, "max_source_positions": arch.max_source_positions,
            "activation_function": _ACT_NAMES[arch.act]}


def scheduler_config_for(arch: ir.UNetArch, source: ir.HFSource | None = None) -> dict[str, Any]:
    """The DDPMScheduler config of a U-Net's noise schedule (over its source's, if any)."""
    base: dict[str, Any] = json.loads(source.scheduler) if source and source.scheduler else {
        "_class_name": "DDPMScheduler"}
    return {**base, "num_train_timesteps": arch.timesteps, "beta_start": arch.beta_start,
            "beta_end": arch.beta_end, "beta_schedule": arch.beta_schedule,
            "prediction_type": arch.prediction}
