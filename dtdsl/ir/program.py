"""The Program: a checked spec with every name resolved, every default filled in
and every quantity in base units (bytes, bytes/s, FLOP/s, seconds).

It is what the later stages (stage graph, cost model, planner) consume; they
never look at the AST. ``Program.model_dump_json()`` is its text form (``--emit
program``), and ``Program.model_validate_json`` reads it back.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dtdsl.ir.hardware import HOST_BW_BYTES_PER_S
from dtdsl.ir.recompute import Recompute, RecomputeMode
from dtdsl.source import Span

__all__ = [
    "Arch", "AvgPool", "Choice", "Cluster", "Compression", "COND_TOKENS", "Constant", "Data",
    "Dist", "DiTArch", "Empirical", "Gpu", "HFSource", "ImageTokens", "IntDomain", "LogNormal",
    "LR_SCHEDULES", "LRSchedule", "MLPArch", "MODALITIES", "Module", "ModuleConstraints",
    "MoEArch", "Optimizer", "PENALTY_WARMUP", "PixelShuffle", "Program", "Projector",
    "QUANTITIES", "Quantity", "Recompute", "RecomputeMode", "Resampler", "ROLES", "RoPE",
    "SCHEDULES", "Sync", "Train", "TransformerArch", "UNetArch", "Uniform", "Zipf",
]

ROLES = ("encoder", "backbone", "generator")
MODALITIES = ("image", "audio", "video")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
LR_SCHEDULES = ("constant", "linear", "cosine")
# The backbone states a generator is conditioned on, per document: its last 77 (all when
# fewer), the CLIP text context a Stable Diffusion U-Net cross-attends to; the runtime
# (models.multimodal) and the cost model (cost.profile, cost.model, cost.graph) read it.
COND_TOKENS = 77
# Local SGD syncs before its penalty's z-test applies: local_sgd(penalty_warmup=...)'s default.
PENALTY_WARMUP = 10
# What a sample carries, per modality. `count`: items encoded by the modality's
# encoder; `gen_count`: items its generator learns to produce; `patches`: tokens
# per image (per frame for video); `frames`: tokens per audio clip, frames per video.
QUANTITIES = {
    "text": ("tokens",),
    "image": ("count", "patches", "gen_count"),
    "video": ("count", "frames", "patches", "gen_count"),
    "audio": ("count", "frames", "gen_count"),
}


class IRModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)


# ---- architectures -------------------------------------------------------------

class RoPE(IRModel):
    """A backbone's rotary position embedding, as Hugging Face's ``rope_parameters`` give it:
    the base ``theta`` and a frequency scaling (``models.rope`` computes it)."""

    theta: float = 500_000.0
    scaling: Literal["default", "linear", "llama3", "yarn", "dynamic"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0              # llama3
    high_freq_factor: float = 4.0             # llama3
    original_max_positions: int | None = None  # llama3, yarn
    max_positions: int | None = None          # the model's max_position_embeddings
    attention_factor: float | None = None     # yarn: scales cos and sin
    beta_fast: float = 32.0                   # yarn
    beta_slow: float = 1.0                    # yarn
    mscale: float | None = None               # yarn
    mscale_all_dim: float | None = None       # yarn
    truncate: bool = True                     # yarn


class HFSource(IRModel):
    """Where a module's architecture came from: a Hugging Face directory (``arch =
    hf("DIR")``). Kept so that ``dtc export`` writes the same kind of model back."""

    path: str                  # the directory, absolute
    family: Literal["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                    "clip", "siglip", "unet", "whisper"]
    config: str                # the model's config.json (a CLIP/SigLIP's vision part), JSON
    config_sha256: str         # of the config file as read
    scheduler: str | None = None   # a U-Net's scheduler_config.json, JSON, when there is one
    source_layers: int | None = None  # layers in the checkpoint (a tower read below its top)
    feature_layer: int | None = None  # hidden_states[feature_layer] a projector reads


class MoEArch(IRModel):
    """A backbone's mixture-of-experts feed-forward (``models.moe``; transformers'
    Qwen2-MoE, Qwen3-MoE and Mixtral configs): ``experts`` routed SwiGLU experts of
    ``ffn`` columns (``moe_intermediate_size``), ``top_k`` of them per token
    (``num_experts_per_tok``), renormalised when ``norm_topk`` (``norm_topk_prob``); an
    always-on shared expert of ``shared_ffn`` columns (0: none), behind Qwen2-MoE's sigmoid
    gate when ``shared_gate``; ``capacity_factor`` None for dropless routing. Layer ``i``
    (from 0) is an MoE layer when ``(i + 1) % every == 0`` (``decoder_sparse_step``), the
    others keep the dense MLP. ``aux_loss_coef`` (``router_aux_loss_coef``) weighs the
    load-balancing loss, summed over the MoE layers, added to the LM loss."""

    experts: int
    top_k: int
    ffn: int
    shared_ffn: int = 0
    shared_gate: bool = False
    norm_topk: bool = True
    capacity_factor: float | None = None
    every: int = 1
    aux_loss_coef: float = 0.001

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) holds experts."""
        return (layer + 1) % self.every == 0

    def num_moe_layers(self, layers: int) -> int:
        """How many of ``layers`` layers hold experts."""
        return layers // self.every

    def ep_conflicts(self, ep: int) -> tuple[str, ...]:
        """What expert parallelism of degree ``ep`` cannot split evenly."""
        return (f"{self.experts} experts",) if self.experts % ep else ()


class TransformerArch(IRModel):
    """A pre-norm transformer: ViT-style encoders (CLIP and SigLIP vision towers among them)
    and Llama-style backbones (Llama, Mistral, Qwen2).

    The fields after ``causal`` are the details that make a module the very architecture of
    a Hugging Face model (``arch = hf(...)`` sets them from its config); their defaults are
    what ``transformer(...)`` builds."""

    kind: Literal["transformer"] = "transformer"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 0
    swiglu: bool = False
    patch: int | None = None
    in_channels: int | None = None  # encoders only: image/video 3, audio 1
    # Audio encoders: the mel bins of the fbank / log-mel spectrogram they read (BEATs:
    # 128), cut into patch x patch patches along time and frequency, or (no patch: the
    # "frames" stem) each frame's bins one token.
    mel_bins: int = 128
    # Video encoders: frames per patch in time (Qwen2-VL: 2); 1 patches each frame alone.
    temporal_patch: int = 1
    causal: bool = False
    kv_channels: int | None = None  # the width of a head when it is not hidden / heads
    # None: RMSNorm (eps 1e-5) on a backbone, LayerNorm (eps 1e-6) on an encoder.
    norm: Literal["layer", "rms"] | None = None
    norm_eps: float | None = None
    # None: SiLU gating with swiglu, exact GELU otherwise.
    activation: Literal["silu", "gelu", "gelu_tanh", "quick_gelu"] | None = None
    qkv_bias: bool = False
    out_bias: bool = False          # the attention output projection's bias
    # Qwen3's QK-norm: an RMSNorm of each query and key head (weights of head_dim, eps
    # norm_eps) after the projections, before the rotation.
    qk_norm: bool = False
    mlp_bias: bool = False
    rope: RoPE = RoPE()             # backbones only
    tie_embeddings: bool = False    # backbones: the LM head is the token embedding
    # A sliding attention window (Mistral): equal to full causal attention on sequences
    # that fit in it, which is all the checker lets a spec train.
    sliding_window: int | None = None
    # Vision towers: learned positions (for an ``image_size`` square image, interpolated
    # for other sizes) or dtdsl's sinusoidal code; CLIP's class token (dropped from what
    # the projector reads); a biased patch embedding (SigLIP); a norm before the layers
    # (CLIP's ``pre_layrnorm``) and after them (SigLIP's ``post_layernorm``).
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    image_size: int | None = None
    cls_token: bool = False
    patch_bias: bool = False
    pre_norm: bool = False
    post_norm: bool = False
    # Audio towers: Whisper's key projection has no bias where Q, V and O have one (None:
    # as qkv_bias). Its stem is two convolutions over [frames, in_channels = mel bins]
    # (GELU, the second of stride 2) and Whisper's fixed sinusoids of max_source_positions
    # (the positions field does not apply), on clips of exactly 2 x max_source_positions
    # frames; "patch": a linear map of flattened patches (every other encoder); "frames":
    # an audio encoder without a patch size, a linear map of each fbank frame's mel_bins x
    # in_channels values to one token (frame-level audio encoders; the checker sets it).
    k_bias: bool | None = None
    stem: Literal["patch", "whisper_conv", "frames"] = "patch"
    max_source_positions: int | None = None
    # Backbones: a mixture of experts in place of the MLP (of its MoE layers); None: dense.
    moe: MoEArch | None = None

    def clip_tokens(self, frames: int) -> int:
        """The rows an audio encoder with Whisper's stem runs its layers on for a clip of
        ``frames`` feature frames: always ``max_source_positions`` (1500), as every clip
        is cut or padded to 30 s (``data.audio.WhisperFeatures``). ValueError for a patch
        stem, whose count is its patch grid's."""
        if self.stem != "whisper_conv" or self.max_source_positions is None:
            raise ValueError("clip_tokens applies to an encoder with Whisper's stem")
        if frames < 0:
            raise ValueError(f"a clip of {frames} frames")
        return self.max_source_positions

    @property
    def patch_dim(self) -> int:
        """The width of what the stem maps to one token's input (its linear map's input,
        Whisper's first convolution's channels): a flattened patch of ``in_channels`` x
        ``temporal_patch`` x ``patch^2`` values, a frame of ``in_channels`` x ``mel_bins``,
        Whisper's ``in_channels`` mel bins. The model, the data layer's patches
        (``ir.modal.InputRule``) and the cost model all read this one number."""
        channels = self.in_channels or 3
        if self.stem == "whisper_conv":
            return self.in_channels or 80
        if self.stem == "frames":
            return channels * self.mel_bins
        return channels * self.temporal_patch * (self.patch or 1) ** 2

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    def norm_kind(self, role: str) -> str:
        """``"rms"`` or ``"layer"``: the norm of a module of ``role``."""
        return self.norm or ("rms" if role == "backbone" else "layer")

    def eps(self, role: str) -> float:
        """The norms' epsilon for a module of ``role``."""
        if self.norm_eps is not None:
            return self.norm_eps
        return 1e-5 if self.norm_kind(role) == "rms" else 1e-6

    @property
    def act(self) -> str:
        """The MLP's activation (the gate's, with swiglu)."""
        return self.activation or ("silu" if self.swiglu else "gelu")

    @property
    def pipeline_layers(self) -> int:
        """How many layers pipeline parallelism can split."""
        return self.layers

    def tp_conflicts(self, tp: int) -> tuple[str, ...]:
        """What tensor parallelism of degree ``tp`` cannot split evenly (Megatron's rules:
        attention heads, KV heads and the FFN width are sharded column-wise)."""
        out = []
        if self.heads % tp:
            out.append(f"{self.heads} attention heads")
        if self.kv_heads != self.heads and self.kv_heads % tp:
            out.append(f"{self.kv_heads} KV heads")
        if self.ffn % tp:
            out.append(f"an FFN width of {self.ffn}")
        if self.moe is not None and self.moe.ffn % tp:
            out.append(f"an expert FFN width of {self.moe.ffn}")
        if self.moe is not None and self.moe.shared_ffn % tp:
            out.append(f"a shared expert width of {self.moe.shared_ffn}")
        return tuple(out)


class UNetArch(IRModel):
    """A Stable-Diffusion-style latent U-Net with cross-attention (diffusers'
    ``UNet2DConditionModel`` of SD 1.x/2.x), with the noise schedule it is trained on."""

    kind: Literal["unet"] = "unet"
    channels: int
    mult: tuple[int, ...]
    res_blocks: int
    attn_res: tuple[int, ...]
    latent: int
    latent_channels: int = 4
    head_dim: int = 64
    context_dim: int = 1024
    transformer_depth: int = 1
    groups: int = 32
    # Attention heads per level (SD 1.x: 8 everywhere; SD 2.x: 5, 10, 20, 20); None:
    # ``channels // head_dim`` at each level.
    heads: tuple[int, ...] | None = None
    linear_proj: bool = True        # the spatial transformers' proj_in/out (SD 2.x), or 1x1 convs
    norm_eps: float = 1e-5          # the residual blocks' GroupNorms
    # The training objective: the noise (epsilon) or the velocity (v_prediction) at integer
    # timesteps in [0, timesteps) of a beta schedule (DDPM's linear 1e-4..0.02 by default;
    # SD's scaled_linear 0.00085..0.012).
    prediction: Literal["epsilon", "v_prediction"] = "epsilon"
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    timesteps: int = 1000

    @property
    def level_channels(self) -> tuple[int, ...]:
        return tuple(self.channels * m for m in self.mult)

    def level_heads(self, level: int) -> int:
        """The attention heads of the spatial transformers at ``level`` (the middle
        block's are the deepest level's)."""
        if self.heads is not None:
            return self.heads[level]
        return self.level_channels[level] // self.head_dim

    @property
    def pipeline_layers(self) -> int:
        """Residual blocks down, the middle block and residual blocks up."""
        levels = len(self.mult)
        return levels * self.res_blocks + 1 + levels * (self.res_blocks + 1)

    @property
    def attention_levels(self) -> tuple[int, ...]:
        """Indices of the levels whose downsampling factor 2^i is listed in attn_res."""
        return tuple(i for i in range(len(self.mult)) if 2 ** i in self.attn_res)

    def tp_conflicts(self, tp: int) -> tuple[str, ...]:
        """Attention heads and the GEGLU width split across TP (the runtime shards the
        attention and MLP blocks; convolutions and norms are replicated)."""
        out = []
        levels = len(self.mult)
        for i in (*self.attention_levels, levels - 1):
            heads = self.level_heads(i)
            where = "the middle block" if i == levels - 1 and i not in self.attention_levels \
                else f"level {i}"
            if heads % tp:
                out.append(f"{heads} attention head{'s' if heads != 1 else ''} at {where}")
            elif (4 * self.level_channels[i]) % tp:
                out.append(f"a GEGLU width of {4 * self.level_channels[i]} at {where}")
        return tuple(dict.fromkeys(out))


class DiTArch(IRModel):
    """A diffusion transformer over latent patches, conditioned by cross-attention."""

    kind: Literal["dit"] = "dit"
    layers: int
    hidden: int
    heads: int
    ffn: int
    patch: int
    latent: int
    latent_channels: int = 4
    context_dim: int
    timesteps: int = 1000      # DDPM's linear schedule, the noise as the target

    @property
    def pipeline_layers(self) -> int:
        return self.layers

    def tp_conflicts(self, tp: int) -> tuple[str, ...]:
        out = []
        if self.heads % tp:
            out.append(f"{self.heads} attention heads")
        if self.ffn % tp:
            out.append(f"an FFN width of {self.ffn}")
        return tuple(out)


class MLPArch(IRModel):
    """A projector: ``depth`` linear layers from ``in_dim`` to ``out_dim``."""

    kind: Literal["mlp"] = "mlp"
    depth: int
    in_dim: int
    hidden: int
    out_dim: int
    activation: Literal["gelu", "silu", "relu"] = "gelu"


Arch = Annotated[TransformerArch | UNetArch | DiTArch, Field(discriminator="kind")]


class VAEArch(IRModel):
    """A generator's VAE encoder (diffusers' ``AutoencoderKL``): what turns its target
    images into latents (``models.vae``)."""

    path: str                           # the folder, absolute
    in_channels: int = 3
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    latent_channels: int
    norm_num_groups: int
    scaling_factor: float
    shift_factor: float = 0.0
    mid_attention: bool = True
    quant_conv: bool = True

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


class Module(IRModel):
    name: str
    role: Literal["encoder", "backbone", "generator"]
    modality: str | None
    arch: Arch
    frozen: bool = False
    recompute: RecomputeMode = Recompute.NONE
    span: Span
    hf: HFSource | None = None       # arch = hf("DIR"): where the architecture came from
    pretrained: str | None = None    # pretrained = "DIR": the weights, absolute
    vae: VAEArch | None = None       # a generator's: its targets' images to latents
    # How its attention is split when cp(...) > 1 (``dtdsl.parallel.cp``): a ring of K/V
    # blocks, Ulysses' all-to-all over heads, or both (Ulysses inside a node, ring across).
    context_parallel: Literal["ring", "ulysses", "hybrid"] = "ring"

    @property
    def input_dim(self) -> int:
        """The width a projector into this module must produce."""
        arch = self.arch
        return arch.hidden if isinstance(arch, TransformerArch) else arch.context_dim

    @property
    def output_dim(self) -> int:
        """The width of the hidden states this module hands on."""
        arch = self.arch
        return arch.hidden if isinstance(arch, (TransformerArch, DiTArch)) else arch.channels


# ---- token compression ------------------------------------------------------------------
# What an image encoder's projector does to the patch grid before its MLP: fewer tokens
# for the backbone. Each kind says how many tokens a grid of ``rows x cols`` patches
# becomes (``tokens``), the width its MLP then reads (``mlp_width``) and the multiple of
# patches an image's sides are rounded to so that its grid always fits (``block``).

class PixelShuffle(IRModel):
    """InternVL's pixel shuffle: each ``factor x factor`` block of neighbouring patches
    concatenated on channels, one token per block (``models.mlp.pixel_shuffle``)."""

    kind: Literal["pixel_shuffle"] = "pixel_shuffle"
    factor: int

    @property
    def block(self) -> int:
        return self.factor

    def tokens(self, rows: int, cols: int) -> int:
        k = self.factor
        if rows % k or cols % k:
            raise ValueError(f"pixel_shuffle({k}) needs a patch grid divisible by {k}, not "
                             f"{rows} x {cols}")
        return (rows // k) * (cols // k)

    def mlp_width(self, width: int) -> int:
        return width * self.factor ** 2


class AvgPool(IRModel):
    """LLaVA-OneVision's 2D average pooling of the patch grid by ``factor`` (stride =
    kernel), in ceil mode: a grid that ``factor`` does not divide keeps its last row and
    column of blocks, averaged over the patches they hold."""

    kind: Literal["avg_pool"] = "avg_pool"
    factor: int

    @property
    def block(self) -> int:
        return 1

    def tokens(self, rows: int, cols: int) -> int:
        k = self.factor
        return -(-rows // k) * -(-cols // k)

    def mlp_width(self, width: int) -> int:
        return width


class Resampler(IRModel):
    """A Perceiver/Q-Former-style resampler: ``queries`` learned queries cross-attend (with
    ``heads`` heads, in the encoder's width) to an image's patches: ``queries`` tokens per
    image, whatever its size."""

    kind: Literal["resampler"] = "resampler"
    queries: int
    heads: int

    @property
    def block(self) -> int:
        return 1

    def tokens(self, rows: int, cols: int) -> int:
        return self.queries

    def mlp_width(self, width: int) -> int:
        return width


Compression = Annotated[PixelShuffle | AvgPool | Resampler, Field(discriminator="kind")]


class Projector(IRModel):
    name: str
    source: str
    target: str
    arch: MLPArch
    frozen: bool = False
    span: Span
    # An image encoder's projector may compress the patch grid before its MLP (whose
    # ``in_dim`` is then ``compress.mlp_width`` of the encoder's width); None: one token
    # per patch.
    compress: Compression | None = None


class ImageTokens(IRModel):
    """How many positions one image takes in the backbone's sequence: its encoder's patch
    grid, compressed by the projector into the backbone. The one rule for the data layout,
    the cost model's samples, the simulator, the runtime and the reference
    (``Program.image_tokens``)."""

    patch: int = 1
    compress: Compression | None = None

    @property
    def block(self) -> int:
        """The multiple of patches an image's sides are rounded to (pixel shuffle's
        factor: its grid then always divides), 1 without compression."""
        return self.compress.block if self.compress is not None else 1

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of an image of ``height x width`` pixels."""
        return height // self.patch, width // self.patch

    def of_grid(self, rows: int, cols: int) -> int:
        """The tokens of an image of ``rows x cols`` patches (ValueError for a grid that
        its compression cannot take)."""
        if self.compress is None:
            return rows * cols
        return self.compress.tokens(rows, cols)

    def __call__(self, height: int, width: int) -> int:
        """The tokens of an image of ``height x width`` pixels."""
        return self.of_grid(*self.grid(height, width))

    def square_side(self, patches: float) -> int:
        """The side, in patches, of the square grid a synthetic image of about ``patches``
        patches has: ``round(sqrt(patches))``, rounded to a multiple of ``block``."""
        b = self.block
        return max(b, round(math.sqrt(max(patches, 0)) / b) * b)

    def of_patches(self, patches: int) -> int:
        """The tokens of a drawn item of ``patches`` patches (the cost model's samples):
        the patches themselves without compression; with it, those of the square grid a
        synthetic image of that many patches has (``square_side``)."""
        if self.compress is None:
            return int(patches)
        side = self.square_side(patches)
        return self.of_grid(side, side)


# ---- data -------------------------------------------------------------------------

class Constant(IRModel):
    kind: Literal["constant"] = "constant"
    value: float


class Uniform(IRModel):
    """Integers (or reals for non-count quantities) uniform on [low, high]."""

    kind: Literal["uniform"] = "uniform"
    low: float
    high: float


class LogNormal(IRModel):
    """exp(N(ln median, sigma^2))."""

    kind: Literal["lognormal"] = "lognormal"
    median: float
    sigma: float


class Zipf(IRModel):
    """P(k) proportional to (k + 1)^-a for k = 0, 1, 2, ...: most samples carry few items."""

    kind: Literal["zipf"] = "zipf"
    a: float


class Choice(IRModel):
    kind: Literal["choice"] = "choice"
    values: tuple[float, ...]
    probs: tuple[float, ...]


class Empirical(IRModel):
    """Measured values read from a file; sampling draws from them uniformly."""

    kind: Literal["empirical"] = "empirical"
    path: str
    key: str | None = None
    sha256: str
    values: tuple[float, ...]


Dist = Annotated[Constant | Uniform | LogNormal | Zipf | Choice | Empirical,
                 Field(discriminator="kind")]


class Quantity(IRModel):
    """``modality.name ~ dist clamp [low, high]``."""

    modality: str
    name: str
    dist: Dist
    low: float | None = None
    high: float | None = None
    span: Span

    @property
    def key(self) -> str:
        return f"{self.modality}.{self.name}"


class Data(IRModel):
    name: str
    source: str | None = None
    samples: int | None = None      # how many samples the data set has, if the spec says
    quantities: tuple[Quantity, ...]
    span: Span
    source_span: Span | None = None  # the `source = ...` value, for data diagnostics
    tokenizer: str | None = None     # a tokenizer.json or a folder holding one (absolute);
                                     # None: the hashing tokenizer of synthetic data
    chat: str | None = None          # the chat format of conversations (data.text)
    image_folder: str | None = None  # where a LLaVA-style JSON's image paths start

    def get(self, modality: str, name: str) -> Quantity | None:
        for q in self.quantities:
            if q.modality == modality and q.name == name:
                return q
        return None

    def high(self, modality: str, name: str) -> int | None:
        """The clamp's upper end of quantity ``modality.name``, or None without one."""
        quantity = self.get(modality, name)
        if quantity is None or quantity.high is None:
            return None
        return int(quantity.high)


# ---- cluster and training -------------------------------------------------------------

class Gpu(IRModel):
    name: str
    memory_bytes: int
    peak_flops: float


class Cluster(IRModel):
    name: str
    gpu: Gpu
    num_gpus: int
    gpus_per_node: int
    intra_node_bw_bytes_per_s: float
    inter_node_bw_bytes_per_s: float
    cpu_workers: int
    span: Span
    gpus_span: Span | None = None   # the `gpus = ...` field, for planner diagnostics
    # The host link (PCIe) per GPU and direction, which optimizer offload crosses; the
    # default (ir.hardware.HOST_BW_BYTES_PER_S) also lets earlier Programs read.
    host_bw_bytes_per_s: float = HOST_BW_BYTES_PER_S


class Optimizer(IRModel):
    name: Literal["adamw", "adam"] = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01   # AdamW's usual default, as the checker fills in
    zero: int = 1
    # The fraction of each rank's optimizer state and update on the CPU (train.offload), or
    # "auto" (the planner's, Plan.offload); defaulted, so older program.json files read.
    offload: float | Literal["auto"] = 0.0

    @field_validator("offload")
    @classmethod
    def _fraction(cls, value: float | str) -> float | str:
        if value != "auto" and not 0.0 <= value <= 1.0:
            raise ValueError(f"offload {value}: a fraction between 0 and 1, or auto")
        return value


class LRSchedule(IRModel):
    """The learning rate over the training steps, relative to the optimizer's peak ``lr``:
    a linear warmup over ``warmup`` steps, then ``constant``, or a ``linear`` or ``cosine``
    decay that reaches ``min_lr`` at ``train.steps``. ``dtdsl.train.lr`` computes it;
    docs/language.md gives the formula."""

    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup: int = 0          # steps; 0: the first step runs at the peak lr
    min_lr: float = 0.0      # where a decay ends (constant has none: 0)


class Sync(IRModel):
    """How data-parallel replicas agree (``train { sync = ... }``). ``allreduce``: gradients
    reduced over DP every step. ``local_sgd``: EDiT's Local SGD (``train.local_sgd``): every
    DP rank is a replica stepping on its own samples; every ``period`` steps (A-EDiT: every
    ``interval_s`` seconds) the replicas average their pseudo-gradients and take a DiLoCo
    outer step (``outer_lr``, Nesterov ``outer_momentum``), with EDiT's pseudo-gradient
    penalty when ``penalty`` (its z-test from sync ``penalty_warmup`` on, counted from 0).
    ``replica_dp``: DP ranks per replica (EDiT's model sharding group: FSDP shards the
    replica's parameters over them; 1: every DP rank is a whole replica)."""

    kind: Literal["allreduce", "local_sgd"] = "allreduce"
    period: int = 1
    interval_s: float | None = None
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    penalty: bool = False
    penalty_warmup: int = PENALTY_WARMUP
    replica_dp: int = 1

    @property
    def local(self) -> bool:
        return self.kind == "local_sgd"

    def replica_ranks(self, dp: int) -> int:
        """The DP ranks of one replica of a unit of ``dp`` DP ranks: ``replica_dp``, or
        1 for a unit of one rank (DT636 refuses a ``replica_dp`` dividing neither)."""
        return math.gcd(dp, self.replica_dp) if self.local else dp


class Train(IRModel):
    global_batch: int
    micro_batch: int
    seq_len: int
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
    virtual_stages: int
    optimizer: Optimizer
    # Defaulted (a constant rate) so that earlier Programs (program.json) still read.
    lr_schedule: LRSchedule = LRSchedule()
    precision: Literal["bf16", "fp16", "fp32"]
    reorder: tuple[Literal["intra", "inter"], ...]
    steps: int
    seed: int
    checkpoint_every: int
    keep_checkpoints: int
    grad_clip: float
    span: Span
    # Sequence packing: each sequence is documents packed up to seq_len (ir.layout.pack),
    # as Megatron-LM counts batches; False: one sample per sequence.
    packing: bool = False
    # torch.compile of every transformer layer and U-Net block (train.compiled): True on
    # every device, False never, None (unset) where the rank runs on a CUDA device. Read
    # through ``compiles``, the one rule the runtime and dtc memcheck share.
    compile: bool | None = None
    # Micro-pipelined TP in the compiled blocks (parallel.tp.enable_async_tp; priced by
    # cost.comm.async_tp_exposed_s). Defaulted so that earlier Programs still read.
    async_tp: bool = False
    # The `schedule` and `precision` fields' spans, for later stages' diagnostics.
    schedule_span: Span | None = None
    precision_span: Span | None = None
    # Defaulted (synchronous DP, as before the field existed) so earlier Programs read.
    sync: Sync = Sync()

    @property
    def mesh_zero(self) -> int:
        """The ZeRO stage a unit's DP mesh is laid out for (``parallel.mesh``): the
        optimizer's, except under Local SGD, where every DP rank is a whole replica (the
        (replicate, shard) mesh of ZeRO 0: one replica per ``dp_replicate`` index)."""
        return 0 if self.sync.local else self.optimizer.zero

    @property
    def replica_dp(self) -> int:
        """DP ranks per Local SGD replica (``Sync.replica_dp``; 1 without Local SGD): the
        ``dp_shard`` size of the ZeRO-0 mesh (``parallel.mesh.unit_mesh_shape``)."""
        return self.sync.replica_dp if self.sync.local else 1

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    def compiles(self, device_type: str) -> bool:
        """Whether a rank whose device is of ``device_type`` ("cuda", "cpu", ...) runs its
        blocks compiled: ``compile`` when the spec sets it; unset, on CUDA only (on a CPU
        inductor's C++ builds cost more than they save for the tests' tiny models)."""
        if self.compile is not None:
            return self.compile
        return device_type == "cuda"


# ---- constraints --------------------------------------------------------------------

class IntDomain(IRModel):
    """Allowed positive integers: an explicit set, or the range [low, high] (None: unbounded)."""

    low: int = 1
    high: int | None = None
    values: tuple[int, ...] | None = None

    def __contains__(self, x: int) -> bool:
        if x < self.low or (self.high is not None and x > self.high):
            return False
        return self.values is None or x in self.values

    def intersect(self, other: IntDomain) -> IntDomain:
        low = max(self.low, other.low)
        highs = [h for h in (self.high, other.high) if h is not None]
        high = min(highs) if highs else None
        values = None
        if self.values is not None or other.values is not None:
            pool = set(self.values if self.values is not None else other.values)
            if self.values is not None and other.values is not None:
                pool &= set(other.values)
            values = tuple(sorted(v for v in pool if v >= low and (high is None or v <= high)))
        return IntDomain(low=low, high=high, values=values)

    def is_empty(self) -> bool:
        if self.values is not None:
            return not self.values
        return self.high is not None and self.high < self.low

    @property
    def smallest(self) -> int:
        """The smallest allowed value (``low`` alone ignores an explicit set)."""
        return min(self.values) if self.values else self.low

    def pinned(self) -> int | None:
        """The single allowed value, if there is exactly one."""
        if self.values is not None and len(self.values) == 1:
            return self.values[0]
        if self.values is None and self.high == self.low:
            return self.low
        return None

    def candidates(self, upper: int) -> tuple[int, ...]:
        """Allowed values no larger than ``upper``, ascending."""
        top = upper if self.high is None else min(upper, self.high)
        if self.values is not None:
            return tuple(v for v in self.values if self.low <= v <= top)
        return tuple(range(self.low, top + 1))

    def describe(self) -> str:
        if self.values is not None:
            return "{" + ", ".join(map(str, self.values)) + "}"
        if self.high is None:
            return f">= {self.low}"
        return f"{self.low}..{self.high}"


class ModuleConstraints(IRModel):
    """Everything the planner may choose for one module."""

    module: str
    tp: IntDomain
    dp: IntDomain
    pp: IntDomain
    gpus: IntDomain
    memory_fraction: float
    memory_bytes: int | None = None
    # Context parallelism (``cp(MODULE)``): 1 unless a constraint allows more.
    cp: IntDomain = IntDomain(values=(1,))
    # Expert parallelism (``ep(MODULE)``, MoE backbones): 1 unless a constraint allows more.
    ep: IntDomain = IntDomain(values=(1,))

    def memory_limit_bytes(self, gpu_memory_bytes: int) -> int:
        """The per-GPU memory this module's ranks may use."""
        limit = int(gpu_memory_bytes * self.memory_fraction)
        return min(limit, self.memory_bytes) if self.memory_bytes is not None else limit


# ---- the program ------------------------------------------------------------------------

class Program(IRModel):
    name: str
    source_name: str
    source_sha256: str
    modules: tuple[Module, ...]
    projectors: tuple[Projector, ...]
    data: Data
    cluster: Cluster
    train: Train
    constraints: tuple[ModuleConstraints, ...]

    def module(self, name: str) -> Module:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def backbone(self) -> Module:
        (backbone,) = [m for m in self.modules if m.role == "backbone"]
        return backbone

    @property
    def encoders(self) -> tuple[Module, ...]:
        return tuple(m for m in self.modules if m.role == "encoder")

    @property
    def generators(self) -> tuple[Module, ...]:
        return tuple(m for m in self.modules if m.role == "generator")

    def image_tokens(self) -> ImageTokens:
        """The rule for an image's tokens in the backbone (``ImageTokens``): the image
        encoder's patch and its projector's compression (patch 1 without an image
        encoder)."""
        encoder = next((m for m in self.encoders if m.modality == "image"), None)
        if encoder is None:
            return ImageTokens()
        patch = getattr(encoder.arch, "patch", None) or 1
        proj = next((p for p in self.projectors
                     if p.source == encoder.name and p.target == self.backbone.name), None)
        return ImageTokens(patch=patch, compress=proj.compress if proj is not None else None)

    def constraints_for(self, module: str) -> ModuleConstraints:
        for c in self.constraints:
            if c.module == module:
                return c
        raise KeyError(module)
