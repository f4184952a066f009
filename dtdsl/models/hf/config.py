"""Hugging Face configs to dtdsl architectures, and architectures back to configs.

``read_hf(path, role=..., feature_layer=...)`` reads a directory as ``transformers`` or
``diffusers`` wrote it and returns an ``HFModel``: the ``ir`` architecture that computes
exactly what the Hugging Face model computes, where its weights are, and an
``ir.HFSource`` that remembers the config (``dtc export`` writes it back). It reads:

- decoders (backbones): ``model_type`` ``llama`` (Llama 2/3, with ``rope_scaling`` or
  ``rope_parameters``: default, linear, llama3, yarn, dynamic), ``mistral``, ``qwen2``
  (Qwen2 and Qwen2.5: biases on Q, K and V);
- vision towers (encoders): ``clip`` / ``clip_vision_model`` and ``siglip`` /
  ``siglip_vision_model`` (a full CLIP or SigLIP directory gives its vision tower), read up
  to ``feature_layer`` (the ``hidden_states`` index a projector reads, as LLaVA's
  ``vision_feature_layer``: -2 is the penultimate layer's output; default: the model's
  ``last_hidden_state``);
- generators: diffusers' ``UNet2DConditionModel`` (a ``unet`` folder, or a pipeline folder
  with ``model_index.json``) with the noise schedule and prediction type of the
  ``scheduler_config.json`` beside it.

Keys a config leaves out take the ``transformers`` / ``diffusers`` class defaults (older
files store only what differs from them). Anything these architectures do not compute
(another ``model_type``, sliding-window attention shorter than the sequence, SDXL's extra
embeddings, ...) is an ``HFError`` naming it, never a silently different model.

No ``transformers`` or ``diffusers`` import: the configs are JSON, read here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtdsl.ir import program as ir

__all__ = [
    "BACKBONE_TYPES", "ENCODER_TYPES", "HFError", "HFModel", "config_for", "read_hf",
    "scheduler_config_for",
]

BACKBONE_TYPES = ("llama", "mistral", "qwen2")
ENCODER_TYPES = ("clip", "clip_vision_model", "siglip", "siglip_vision_model")
_MAX_CONFIG_BYTES = 4 << 20

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
}
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
             "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
               "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
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


class HFError(ValueError):
    """A Hugging Face directory dtdsl cannot read, with what to do about it."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class HFModel:
    """What ``read_hf`` found."""

    role: str                                  # encoder, backbone or generator
    arch: ir.TransformerArch | ir.UNetArch
    source: ir.HFSource
    weights_dir: Path                          # where its safetensors files are
    notes: tuple[str, ...] = field(default=())  # worth a warning (a missing scheduler, ...)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise HFError(f"{path} is {path.stat().st_size} bytes; a {what} is a few KB")
        data = json.loads(path.read_bytes())
    except OSError as err:
        raise HFError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise HFError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HFError(f"{path} holds a JSON {type(data).__name__}, not the object of a {what}")
    return data


def _get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    """``cfg[key]``, or the class default when the file leaves it out (or writes null for a
    key whose default is not null)."""
    value = cfg.get(key)
    return defaults.get(key) if value is None else value


def _int(cfg: dict[str, Any], key: str, defaults: dict[str, Any], *, low: int = 1) -> int:
    value = _get(cfg, key, defaults)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HFError(f"config key {key!r} is {value!r}, not an integer of at least {low}")
    return value


def _float(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> float:
    value = _get(cfg, key, defaults)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFError(f"config key {key!r} is {value!r}, not a number")
    return float(value)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- decoders ----------------------------------------------------------------------------

def _rope(cfg: dict[str, Any], defaults: dict[str, Any]) -> ir.RoPE:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and \
            all(isinstance(v, dict) for v in params.values()):
        raise HFError("per-layer-type rope_parameters are not supported")
    spec = params if isinstance(params, dict) else cfg.get("rope_scaling") or {}
    if not isinstance(spec, dict):
        raise HFError(f"rope_scaling is {spec!r}, not an object")
    theta = spec.get("rope_theta", cfg.get("rope_theta"))
    theta = float(defaults["rope_theta"] if theta is None else theta)
    kind = spec.get("rope_type") or spec.get("type") or "default"
    partial = spec.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFError(f"partial_rotary_factor {partial} (rotary embeddings on part of each "
                      "head) is not supported")
    max_positions = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
    common = {"theta": theta, "max_positions": max_positions}
    if kind == "default":
        return ir.RoPE(**common)
    factor = spec.get("factor")
    original = spec.get("original_max_position_embeddings")
    if kind in ("linear", "dynamic"):
        if factor is None:
            raise HFError(f"{kind} rope scaling without a factor")
        return ir.RoPE(scaling=kind, factor=float(factor), **common)
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if spec.get(k) is None]
        if missing:
            raise HFError(f"llama3 rope scaling without {', '.join(missing)}")
        return ir.RoPE(scaling="llama3", factor=float(factor),
                       low_freq_factor=float(spec["low_freq_factor"]),
                       high_freq_factor=float(spec["high_freq_factor"]),
                       original_max_positions=int(original), **common)
    if kind == "yarn":
        if original is None:
            original = max_positions
        if factor is None:
            factor = max_positions / original
        return ir.RoPE(scaling="yarn", factor=float(factor), original_max_positions=int(original),
                       attention_factor=spec.get("attention_factor"),
                       beta_fast=float(spec.get("beta_fast") or 32),
                       beta_slow=float(spec.get("beta_slow") or 1),
                       mscale=spec.get("mscale"), mscale_all_dim=spec.get("mscale_all_dim"),
                       truncate=bool(spec.get("truncate", True)), **common)
    raise HFError(f"rope type {kind!r} is not supported",
                  hint="dtdsl computes default, linear, llama3, yarn and dynamic rotary "
                  "embeddings")


def _decoder(cfg: dict[str, Any], family: str) -> ir.TransformerArch:
    d = _DECODER_DEFAULTS[family]
    hidden = _int(cfg, "hidden_size", d)
    heads = _int(cfg, "num_attention_heads", d)
    # Left out: the class default (Mistral's 8, Qwen2's 32); null, or Llama's default: MHA.
    kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else \
        d.get("num_key_value_heads")
    kv = kv or heads
    layers = _int(cfg, "num_hidden_layers", d)
    act = _get(cfg, "hidden_act", d)
    if act != "silu":
        raise HFError(f"hidden_act {act!r}: the {family} MLP dtdsl builds gates with silu")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise HFError(f"hidden_size {hidden} is not divisible by {heads} heads and the "
                      "config gives no head_dim")
    if heads % kv:
        raise HFError(f"{heads} attention heads cannot share {kv} key-value heads evenly")
    # Sliding-window attention changes nothing while a sequence fits in the window; the
    # checker holds seq_len to it.
    window = None
    if family == "mistral":
        window = cfg.get("sliding_window", d["sliding_window"])   # null: none
    elif family == "qwen2" and cfg.get("use_sliding_window", False):
        if _int(cfg, "max_window_layers", d, low=0) < layers:
            window = cfg.get("sliding_window", d["sliding_window"])
    elif family == "llama" and cfg.get("sliding_window") is not None:
        window = cfg["sliding_window"]
    if family == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif family == "mistral":          # MistralAttention has no biases, whatever the config
        qkv_bias = out_bias = mlp_bias = False
    else:
        qkv_bias = out_bias = bool(_get(cfg, "attention_bias", d))
        mlp_bias = bool(_get(cfg, "mlp_bias", d))
    return ir.TransformerArch(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
        ffn=_int(cfg, "intermediate_size", d), vocab=_int(cfg, "vocab_size", d), swiglu=True,
        causal=True, kv_channels=head_dim if head_dim * heads != hidden else None,
        norm="rms", norm_eps=_float(cfg, "rms_norm_eps", d), activation="silu",
        qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias, rope=_rope(cfg, d),
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings", d)),
        sliding_window=int(window) if window is not None else None)


# ---- vision towers -----------------------------------------------------------------------

def _vision(cfg: dict[str, Any], family: str, feature_layer: int | None
            ) -> tuple[ir.TransformerArch, int]:
    d = _VISION_DEFAULTS[family]
    hidden = _int(cfg, "hidden_size", d)
    heads = _int(cfg, "num_attention_heads", d)
    if hidden % heads:
        raise HFError(f"hidden_size {hidden} is not divisible by {heads} heads")
    total = _int(cfg, "num_hidden_layers", d)
    act = _get(cfg, "hidden_act", d)
    if act not in _ACTIVATIONS or act == "silu":
        raise HFError(f"hidden_act {act!r} is not supported in a vision tower",
                      hint="dtdsl computes quick_gelu, gelu and gelu_pytorch_tanh")
    image, patch = _int(cfg, "image_size", d), _int(cfg, "patch_size", d)
    if image % patch:
        raise HFError(f"image_size {image} is not a multiple of patch_size {patch}")
    layers, post_norm = total, family == "siglip"
    if feature_layer is not None:
        layers = total + 1 + feature_layer if feature_layer < 0 else feature_layer
        if not 1 <= layers <= total:
            raise HFError(f"feature_layer {feature_layer} is outside the tower's "
                          f"hidden_states (layers 1..{total}, or -{total}..-1)")
        post_norm = False      # hidden_states[k] is a layer's output, before any final norm
    clip = family == "clip"
    arch = ir.TransformerArch(
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
        ffn=_int(cfg, "intermediate_size", d), patch=patch,
        in_channels=_int(cfg, "num_channels", d), causal=False, norm="layer",
        norm_eps=_float(cfg, "layer_norm_eps", d), activation=_ACTIVATIONS[act],
        qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned", image_size=image,
        cls_token=clip, patch_bias=not clip, pre_norm=clip, post_norm=post_norm)
    return arch, total


# ---- U-Net ----------------------------------------------------------------------------

def _per_level(value: Any, levels: int, key: str) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * levels
    if len(values) != levels or not all(isinstance(v, int) and not isinstance(v, bool)
                                        and v > 0 for v in values):
        raise HFError(f"config key {key!r} is {value!r}, not a positive integer per level "
                      f"({levels} levels)")
    return values


def _unet(cfg: dict[str, Any], scheduler: dict[str, Any] | None) -> ir.UNetArch:
    cls = cfg.get("_class_name")
    if cls != "UNet2DConditionModel":
        raise HFError(f"a diffusers {cls or 'model'}: dtdsl trains UNet2DConditionModel "
                      "generators (Stable Diffusion 1.x/2.x)")
    d = _UNET_DEFAULTS
    for key, want in _UNET_FIXED.items():
        got = cfg.get(key, want)
        if isinstance(want, float) and isinstance(got, (int, float)):
            got = float(got)
        if got != want:
            raise HFError(f"{key} = {got!r} is not supported (dtdsl's U-Net is SD 1.x/2.x's: "
                          f"{key} = {want!r})")
    boc = _get(cfg, "block_out_channels", d)
    levels = len(boc)
    boc = _per_level(boc, levels, "block_out_channels")
    c0 = boc[0]
    if any(c % c0 for c in boc):
        raise HFError(f"block_out_channels {list(boc)} are not multiples of the first")
    down = list(_get(cfg, "down_block_types", d))
    up = list(_get(cfg, "up_block_types", d))
    if len(down) != levels or len(up) != levels:
        raise HFError(f"{len(down)} down and {len(up)} up blocks for {levels} levels")
    attention = []
    for i, (kind, mirror) in enumerate(zip(down, reversed(up), strict=True)):
        if kind not in ("CrossAttnDownBlock2D", "DownBlock2D"):
            raise HFError(f"down block {kind!r} is not supported")
        want = "CrossAttnUpBlock2D" if kind == "CrossAttnDownBlock2D" else "UpBlock2D"
        if mirror != want:
            raise HFError(f"up block {mirror!r} at level {i} does not mirror its down block "
                          f"{kind!r}")
        if kind == "CrossAttnDownBlock2D":
            attention.append(i)
    layers = set(_per_level(_get(cfg, "layers_per_block", d), levels, "layers_per_block"))
    depth = set(_per_level(_get(cfg, "transformer_layers_per_block", d), levels,
                           "transformer_layers_per_block"))
    if len(layers) != 1 or len(depth) != 1:
        raise HFError("different layers_per_block or transformer_layers_per_block per level "
                      "are not supported")
    heads = cfg.get("num_attention_heads") or _get(cfg, "attention_head_dim", d)
    heads = _per_level(heads, levels, "attention_head_dim")
    context = _get(cfg, "cross_attention_dim", d)
    if isinstance(context, (list, tuple)):
        if len(set(context)) != 1:
            raise HFError("a cross_attention_dim per level is not supported")
        context = context[0]
    sample = cfg.get("sample_size")
    if isinstance(sample, (list, tuple)):
        if len(set(sample)) != 1:
            raise HFError(f"sample_size {list(sample)} is not square")
        sample = sample[0]
    if not isinstance(sample, int) or sample < 1:
        raise HFError("the U-Net config has no sample_size (its latent side)",
                      hint="add \"sample_size\": 64 (512x512 images) to its config.json")
    if sample % (2 ** (levels - 1)):
        raise HFError(f"sample_size {sample} cannot be halved {levels - 1} times")
    channels = _int(cfg, "in_channels", d)
    if _int(cfg, "out_channels", d) != channels:
        raise HFError(f"in_channels {channels} and out_channels {cfg.get('out_channels')} "
                      "differ; dtdsl's U-Net predicts noise of its input's shape")
    groups = _int(cfg, "norm_num_groups", d)
    for level, ch in enumerate(boc):
        if ch % groups:
            raise HFError(f"{ch} channels at level {level} cannot form {groups} groups")
        if (level in attention or level == levels - 1) and ch % heads[level]:
            raise HFError(f"{ch} channels at level {level} are not a whole number of "
                          f"{heads[level]} heads")
    s = dict(_SCHEDULER_DEFAULTS)
    s.update({k: v for k, v in (scheduler or {}).items() if v is not None})
    if s.get("trained_betas") is not None:
        raise HFError("a scheduler with trained_betas is not supported")
    if s.get("rescale_betas_zero_snr"):
        raise HFError("rescale_betas_zero_snr is not supported")
    if s["beta_schedule"] not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
        raise HFError(f"beta_schedule {s['beta_schedule']!r} is not supported",
                      hint="dtdsl trains on linear, scaled_linear and squaredcos_cap_v2")
    if s["prediction_type"] not in ("epsilon", "v_prediction"):
        raise HFError(f"prediction_type {s['prediction_type']!r} is not supported",
                      hint="dtdsl trains epsilon and v_prediction U-Nets")
    first = attention[0] if attention else levels - 1
    return ir.UNetArch(
        channels=c0, mult=tuple(c // c0 for c in boc), res_blocks=layers.pop(),
        attn_res=tuple(2 ** i for i in attention), latent=sample, latent_channels=channels,
        head_dim=boc[first] // heads[first], context_dim=int(context),
        transformer_depth=depth.pop(), groups=groups, heads=heads,
        linear_proj=bool(_get(cfg, "use_linear_projection", d)),
        norm_eps=_float(cfg, "norm_eps", d), prediction=s["prediction_type"],
        beta_schedule=s["beta_schedule"], beta_start=float(s["beta_start"]),
        beta_end=float(s["beta_end"]), timesteps=int(s["num_train_timesteps"]))


# ---- directories -------------------------------------------------------------------------

def _scheduler_file(unet_dir: Path) -> Path | None:
    for candidate in (unet_dir / "scheduler_config.json",
                      unet_dir.parent / "scheduler" / "scheduler_config.json"):
        if candidate.is_file():
            return candidate
    return None


def read_hf(path: str | Path, *, role: str | None = None,
            feature_layer: int | None = None) -> HFModel:
    """The model in Hugging Face directory ``path`` (module docstring); ``role``: the role
    the spec gives it (an error when the model cannot play it); ``feature_layer``: for a
    vision tower, the ``hidden_states`` index its projector reads."""
    root = Path(path).expanduser()
    if not root.exists():
        raise HFError(f"{root} does not exist")
    if not root.is_dir():
        raise HFError(f"{root} is a file, not a Hugging Face model directory",
                      hint="give the directory that holds config.json")
    root = root.resolve()
    notes: list[str] = []
    if (root / "model_index.json").is_file() and not (root / "config.json").is_file():
        if not (root / "unet" / "config.json").is_file():
            raise HFError(f"{root} is a diffusers pipeline without a unet/config.json")
        root = root / "unet"
    config_path = root / "config.json"
    if not config_path.is_file():
        raise HFError(f"{root} has no config.json",
                      hint="a Hugging Face model directory, as save_pretrained writes it")
    cfg = _read_json(config_path, "model config")
    sha = _sha256(config_path)
    if cfg.get("_class_name") is not None or cfg.get("_diffusers_version") is not None:
        found_role = "generator"
    else:
        model_type = cfg.get("model_type")
        if model_type in BACKBONE_TYPES:
            found_role = "backbone"
        elif model_type in ENCODER_TYPES:
            found_role = "encoder"
        else:
            raise HFError(f"model_type {model_type!r} is not supported" if model_type else
                          f"{config_path} has no model_type",
                          hint="dtdsl reads llama, mistral and qwen2 (backbones), clip and "
                          "siglip (vision towers) and diffusers' UNet2DConditionModel "
                          "(generators)")
    if role is not None and role != found_role:
        what = {"backbone": "a language model", "encoder": "a vision tower",
                "generator": f"a diffusers {cfg.get('_class_name') or 'model'}"}[found_role]
        article = {"backbone": "the", "encoder": "an", "generator": "a"}[role]
        raise HFError(f"{root} holds {what}, which cannot be {article} {role}")
    if feature_layer is not None and found_role != "encoder":
        raise HFError("feature_layer applies to vision towers only")
    source_layers = None
    scheduler_text = None
    if found_role == "backbone":
        family = cfg["model_type"]
        arch = _decoder(cfg, family)
        stored = cfg
    elif found_role == "encoder":
        family = "clip" if cfg["model_type"].startswith("clip") else "siglip"
        vision = cfg
        if cfg["model_type"] in ("clip", "siglip"):
            vision = cfg.get("vision_config") or {}
            if not isinstance(vision, dict):
                raise HFError("vision_config is not an object")
        arch, source_layers = _vision(vision, family, feature_layer)
        stored = {**vision, "model_type": f"{family}_vision_model"}
    else:
        family = "unet"
        scheduler_path = _scheduler_file(root)
        scheduler = None
        if scheduler_path is None:
            notes.append(f"no scheduler_config.json beside {root}: training on DDPM's linear "
                         "beta schedule with epsilon prediction (diffusers' defaults)")
        else:
            scheduler = _read_json(scheduler_path, "scheduler config")
            scheduler_text = json.dumps(scheduler, sort_keys=True)
        arch = _unet(cfg, scheduler)
        stored = cfg
    source = ir.HFSource(path=str(root), family=family, config=json.dumps(stored, sort_keys=True),
                         config_sha256=sha, scheduler=scheduler_text,
                         source_layers=source_layers, feature_layer=feature_layer)
    return HFModel(role=found_role, arch=arch, source=source, weights_dir=root,
                   notes=tuple(notes))


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
        family = source.family if source is not None else "llama"
        out = {**base, "model_type": family,
               "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                  "qwen2": "Qwen2ForCausalLM"}[family]],
               "hidden_size": arch.hidden, "intermediate_size": arch.ffn,
               "num_hidden_layers": arch.layers, "num_attention_heads": arch.heads,
               "num_key_value_heads": arch.kv_heads, "vocab_size": arch.vocab,
               "hidden_act": "silu", "rms_norm_eps": arch.eps("backbone"),
               "head_dim": arch.head_dim, "tie_word_embeddings": arch.tie_embeddings,
               "rope_theta": arch.rope.theta, "rope_scaling": _rope_config(arch.rope)}
        out.pop("rope_parameters", None)
        if family == "qwen2":
            if not arch.qkv_bias or arch.out_bias or arch.mlp_bias:
                raise HFError("a Qwen2 has biases on Q, K and V only")
        else:
            if arch.qkv_bias != arch.out_bias:
                raise HFError(f"a {family} has biases on all of Q, K, V and O or on none")
            out["attention_bias"] = arch.qkv_bias
            if family == "llama":
                out["mlp_bias"] = arch.mlp_bias
            elif arch.mlp_bias:
                raise HFError("a Mistral has no MLP biases")
        if arch.rope.max_positions is not None:
            out["max_position_embeddings"] = arch.rope.max_positions
        if arch.sliding_window is not None:
            out["sliding_window"] = arch.sliding_window
        return out
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


def scheduler_config_for(arch: ir.UNetArch, source: ir.HFSource | None = None) -> dict[str, Any]:
    """The DDPMScheduler config of a U-Net's noise schedule (over its source's, if any)."""
    base: dict[str, Any] = json.loads(source.scheduler) if source and source.scheduler else {
        "_class_name": "DDPMScheduler"}
    return {**base, "num_train_timesteps": arch.timesteps, "beta_start": arch.beta_start,
            "beta_end": arch.beta_end, "beta_schedule": arch.beta_schedule,
            "prediction_type": arch.prediction}
