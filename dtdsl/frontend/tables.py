"""The language's parameter tables: every block's fields, every call's arguments, their
kinds, ranges and defaults (docs/language.md lists the same), and the small helpers the
checker's parts share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dtdsl.codes import DT630, DT631, DT632, DT634, DT635, DT636, DT637
from dtdsl.frontend import ast
from dtdsl.frontend import moe as _moe
from dtdsl.frontend.schema import (
    INVALID,
    BoolKind,
    CallKind,
    EnumKind,
    FloatKind,
    IntKind,
    Kind,
    ListKind,
    Param,
    QuantityKind,
    StrKind,
    SwitchKind,
    describe_expr,
)
from dtdsl.ir import program as ir
from dtdsl.ir.bounds import MAX_CLUSTER_GPUS

MAX_NAME_LENGTH = 64
MAX_EMPIRICAL_BYTES = 64 << 20
MAX_EMPIRICAL_VALUES = 10_000_000
# Samples a step: beyond the largest batches trained (CLIP's 32K), and what the planner
# simulates in about a minute on a few GPUs (its drawn batches grow with it: a 16K batch on
# 4 GPUs took 35 s and 1.5 GB).
MAX_GLOBAL_BATCH = 65_536

# ---- parameter tables (docs/language.md lists the same) -------------------------

MODULE_FIELDS = (
    # Required unless `pretrained` is given (then it defaults to hf(pretrained)).
    Param("arch", CallKind(),
          doc='arch = transformer(...), unet(...), dit(...) or hf("DIR")'),
    Param("pretrained", StrKind(), doc='pretrained = "models/llama-3-8b"'),
    Param("frozen", BoolKind(), default=False),
    # What backward recomputes (``ir.program.Recompute``): true is full, false none.
    Param("recompute", SwitchKind(choices=("none", "selective", "full"),
                                  expects="true, false, none, selective or full"),
          default=False),
    # How cp(...) > 1 splits its attention (dtdsl.parallel.cp).
    Param("context_parallel", EnumKind(choices=("ring", "ulysses", "hybrid")),
          default="ring"),
    # Generators: the VAE that turns target images into latents (default: the `vae`
    # folder of the diffusers pipeline the U-Net comes from).
    Param("vae", StrKind(), doc='vae = "sd-2-1/vae"'),
)
PROJECTOR_FIELDS = (
    Param("arch", CallKind(), required=True, doc="arch = mlp(depth=2)"),
    Param("frozen", BoolKind(), default=False),
    # An image encoder's projector: fewer tokens per image for the backbone.
    Param("compress", CallKind(), doc="compress = pixel_shuffle(2)"),
)
TRANSFORMER_ARGS = (
    Param("layers", IntKind(1, 1024), required=True, doc="layers=32"),
    Param("hidden", IntKind(8, 1 << 17), required=True, doc="hidden=4096"),
    Param("heads", IntKind(1, 4096), required=True, doc="heads=32"),
    Param("kv_heads", IntKind(1, 4096)),
    Param("ffn", IntKind(1, 1 << 20)),
    Param("vocab", IntKind(0, 1 << 24), default=0),
    Param("swiglu", BoolKind(), default=False),
    Param("patch", IntKind(1, 1024)),
    Param("in_channels", IntKind(1, 64)),
    Param("causal", BoolKind()),
    Param("mel_bins", IntKind(1, 4096), default=128),
    Param("temporal_patch", IntKind(1, 64), default=1),
    *_moe.MOE_ARGS,     # a mixture of experts (frontend.moe)
)
UNET_ARGS = (
    Param("channels", IntKind(8, 8192), required=True, doc="channels=320"),
    Param("mult", ListKind(IntKind(1, 64), 1, 8), required=True, doc="mult=[1, 2, 4, 4]"),
    Param("res_blocks", IntKind(1, 16), required=True, doc="res_blocks=2"),
    # Default: attention at downsampling factors 4, 2 and 1 where the U-Net reaches them
    # (SD 1.x/2.x: every level but the deepest of four); see _unet.
    Param("attn_res", ListKind(IntKind(1, 1024), 0, 8)),
    Param("latent", IntKind(1, 1024), required=True, doc="latent=64 (a 512x512 image)"),
    Param("latent_channels", IntKind(1, 64), default=4),
    Param("head_dim", IntKind(1, 1024), default=64),
    Param("context_dim", IntKind(1, 1 << 17), default=1024),
    Param("transformer_depth", IntKind(1, 64), default=1),
    Param("groups", IntKind(1, 1024), default=32),
)
DIT_ARGS = (
    Param("layers", IntKind(1, 1024), required=True, doc="layers=28"),
    Param("hidden", IntKind(8, 1 << 17), required=True, doc="hidden=1152"),
    Param("heads", IntKind(1, 4096), required=True, doc="heads=16"),
    Param("ffn", IntKind(1, 1 << 20)),
    Param("patch", IntKind(1, 64), default=2),
    Param("latent", IntKind(1, 1024), required=True, doc="latent=32"),
    Param("latent_channels", IntKind(1, 64), default=4),
    Param("context_dim", IntKind(1, 1 << 17)),
)
HF_ARGS = (
    Param("path", StrKind(), required=True, doc='hf("models/clip-vit-large-patch14")'),
    # The vision tower's hidden_states index the projector reads (LLaVA: -2); default: its
    # last_hidden_state.
    Param("feature_layer", IntKind(-1024, 1024)),
)
MLP_ARGS = (
    Param("depth", IntKind(1, 16), default=2),
    Param("hidden", IntKind(1, 1 << 17)),
    Param("activation", EnumKind(choices=("gelu", "silu", "relu")), default="gelu"),
)
# Token compression (``compress = ...``), the factor by position: pixel_shuffle(2).
FACTOR_ARGS = (
    Param("factor", IntKind(2, 16), required=True, doc="pixel_shuffle(2)"),
)
RESAMPLER_ARGS = (
    Param("queries", IntKind(1, 4096), required=True, doc="resampler(queries=64)"),
    # Default: the encoder's heads.
    Param("heads", IntKind(1, 1024)),
)
COMPRESSIONS = {"pixel_shuffle": FACTOR_ARGS, "avg_pool": FACTOR_ARGS,
                "resampler": RESAMPLER_ARGS}
_DEFAULT_ATTN_RES = (4, 2, 1)
ARCHS = {"transformer": TRANSFORMER_ARGS, "unet": UNET_ARGS, "dit": DIT_ARGS, "hf": HF_ARGS}
ROLE_ARCHS = {"encoder": ("transformer", "hf"), "backbone": ("transformer", "hf"),
              "generator": ("unet", "dit", "hf")}

_COUNT = FloatKind(low=0)
DISTRIBUTIONS: dict[str, tuple[tuple[Param, ...], int]] = {
    # name: (parameters, how many may be given by position)
    "constant": ((Param("value", _COUNT, required=True),), 1),
    "uniform": ((Param("low", _COUNT, required=True), Param("high", _COUNT, required=True)), 2),
    "lognormal": ((Param("median", FloatKind(low=0, low_exclusive=True), required=True),
                   Param("sigma", FloatKind(low=0, high=5, low_exclusive=True),
                         required=True)), 2),
    "zipf": ((Param("a", FloatKind(low=1, high=10, low_exclusive=True), required=True),), 1),
    "choice": ((Param("values", ListKind(_COUNT, 1, 1024, expects="a list of numbers"),
                      required=True),
                Param("p", ListKind(FloatKind(low=0, high=1), 1, 1024,
                                    expects="a list of probabilities"))), 2),
    "empirical": ((Param("path", StrKind(), required=True), Param("key", StrKind())), 1),
}
_UNBOUNDED = frozenset({"lognormal", "zipf"})

DATA_FIELDS = (
    Param("source", StrKind(), doc='source = "shards/{000000..000099}.tar"'),
    Param("samples", IntKind(1, 10**12)),
    Param("tokenizer", StrKind(), doc='tokenizer = "llama-3.1-8b/tokenizer.json"'),
    Param("chat", EnumKind(choices=("chatml", "llama3", "llava"))),
    Param("image_folder", StrKind(), doc='image_folder = "coco/train2017"'),
)

# A link slower than 100 kB/s (0.8 Mb/s) carries no training job: the planner's solver
# fails on transfer times some 1e12 times its compute times.
MIN_LINK_BW = 1e5

CLUSTER_FIELDS = (
    Param("gpu", CallKind(allow_bare=True), required=True,
          doc="gpu = H800, or custom(memory=..., peak=...)"),
    Param("gpus", IntKind(1, MAX_CLUSTER_GPUS), required=True, doc="gpus = 64"),
    Param("gpus_per_node", IntKind(1, 64)),
    Param("intra_node_bw", QuantityKind(dim="bandwidth", low=MIN_LINK_BW, high=1e14)),
    Param("inter_node_bw", QuantityKind(dim="bandwidth", low=MIN_LINK_BW, high=1e14)),
    Param("cpu_workers", IntKind(0, 100_000), default=1),
    # The host link (PCIe) per GPU, which optimizer offload crosses (ir.hardware).
    Param("host_bw", QuantityKind(dim="bandwidth", low=MIN_LINK_BW, high=1e14)),
)
_GPU_OVERRIDES = (
    Param("memory", QuantityKind(dim="size", low=2**20, high=2**50)),
    Param("peak", QuantityKind(dim="flops", low=1e6, high=1e19)),
)
_CUSTOM_GPU = (
    Param("name", StrKind(max_len=64), default="custom"),
    Param("memory", QuantityKind(dim="size", low=2**20, high=2**50), required=True,
          doc="memory = 80 GiB"),
    Param("peak", QuantityKind(dim="flops", low=1e6, high=1e19), required=True,
          doc="peak = 989 TFLOPS (dense bf16)"),
)



@dataclass(frozen=True)
class _ReorderKind(Kind):
    """``reorder = [intra, inter]``, a single policy name, or ``none``."""

    expects: str = field(
        default="a list of reorder policies such as [intra, inter], or none", kw_only=True)

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Name) and expr.name == "none":
            return ()
        items = expr.items if isinstance(expr, ast.ListExpr) else (expr,)
        policy = EnumKind(choices=("intra", "inter"))
        values = [policy.convert(item, ctx, "reorder policy") for item in items]
        if any(v is INVALID for v in values):
            return INVALID
        return tuple(dict.fromkeys(values))


@dataclass(frozen=True)
class _OffloadKind(Kind):
    """``offload = 0.5``: the fraction of each rank's optimizer state and update that lives
    on the CPU, a number in [0, 1]; or ``auto``, for the planner to choose."""

    expects: str = field(default="a fraction between 0 and 1, or auto", kw_only=True)

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Name) and expr.name == "auto":
            return "auto"
        if isinstance(expr, ast.Name) and expr.name.lower() == "nan":
            return ctx.error(DT635, f"{what} is NaN: it must be a fraction between 0 and "
                             "1", expr.span, hint="write offload=0.5, or offload=auto")
        value = FloatKind(expects=self.expects).convert(expr, ctx, what)
        if value is INVALID:
            return value
        if not 0.0 <= value <= 1.0:      # false for NaN and infinities too
            return ctx.error(DT635, f"{what} of {describe_expr(expr)} is not a fraction: "
                             "it must lie between 0 (all optimizer state on the GPU) and 1 "
                             "(all of it on the CPU)", expr.span,
                             hint="write offload=0.5, or offload=auto to let the planner "
                             "choose")
        return value


@dataclass(frozen=True)
class _SecondsKind(Kind):
    """A duration: ``30 s``, ``500 ms``, or a plain number of seconds."""

    expects: str = field(default="a duration such as 30 s", kw_only=True)

    def convert(self, expr, ctx, what):
        if isinstance(expr, ast.Number) and expr.unit is None:
            return float(expr.value)
        return QuantityKind(dim="time", expects=self.expects).convert(expr, ctx, what)


TRAIN_FIELDS = (
    Param("global_batch", IntKind(1, MAX_GLOBAL_BATCH), required=True,
          doc="global_batch = 1920"),
    Param("micro_batch", IntKind(1, 10**6), default=1),
    Param("seq_len", IntKind(16, 10**7), required=True, doc="seq_len = 8192"),
    Param("schedule", CallKind(allow_bare=True)),
    Param("optimizer", CallKind(allow_bare=True)),
    Param("lr_schedule", CallKind(allow_bare=True)),
    Param("precision", EnumKind(choices=("bf16", "fp16", "fp32")), default="bf16"),
    Param("reorder", _ReorderKind(), default=("intra", "inter")),
    Param("steps", IntKind(1, 10**9), default=1000),
    Param("seed", IntKind(0, 2**63 - 1), default=0),
    Param("checkpoint_every", IntKind(0, 10**9), default=0),
    Param("keep_checkpoints", IntKind(1, 1000), default=3),
    Param("grad_clip", FloatKind(low=0, high=1e6), default=1.0),
    Param("packing", BoolKind(), default=False),
    # None (unset): compiled where the rank runs on a CUDA device (ir.Train.compiles).
    Param("compile", BoolKind(), default=None),
    Param("async_tp", BoolKind(), default=False),
    Param("sync", CallKind(allow_bare=True)),
)
_SCHEDULE_ARGS = {
    "gpipe": (),
    "1f1b": (),
    "interleaved": (Param("virtual_stages", IntKind(2, 64), default=2),),
    "zero_bubble": (),
}
_OPTIMIZER_ARGS = (
    Param("lr", FloatKind(low=0, high=10, low_exclusive=True), default=1e-4),
    Param("betas", ListKind(FloatKind(low=0, high=0.999999), 2, 2,
                            expects="two numbers such as [0.9, 0.95]"), default=(0.9, 0.95)),
    Param("eps", FloatKind(low=0, high=1, low_exclusive=True), default=1e-8),
    Param("weight_decay", FloatKind(low=0, high=10), default=0.01),
    Param("zero", IntKind(0, 3), default=1),
    # 0: everything on the device; "auto": the planner picks (ir.Optimizer.offload).
    Param("offload", _OffloadKind(), default=0.0),
)
# Local SGD's arguments: bounds are checked by ``_sync`` with codes of their own.
_SYNC_ARGS = (
    Param("period", IntKind(), default=None),
    Param("interval", _SecondsKind(), default=None),
    Param("outer_lr", FloatKind(), default=1.0),
    Param("outer_momentum", FloatKind(), default=0.0),
    Param("penalty", BoolKind(), default=False),
    Param("penalty_warmup", IntKind(), default=ir.PENALTY_WARMUP),
    Param("replica_dp", IntKind(), default=1),
)
# (argument, code, test, what it must be, what to write instead) of local_sgd's bounds.
_SYNC_RULES = (
    ("period", DT630, lambda v: v >= 1, "must be at least 1 step",
     "write period=1 or more (4 to 100 in EDiT's experiments)"),
    ("outer_lr", DT631, lambda v: math.isfinite(v) and v > 0, "must be above 0",
     "write a positive outer_lr (1.0: the plain average of the replicas; DiLoCo uses 0.7)"),
    ("outer_momentum", DT632, lambda v: 0 <= v < 1, "must be in [0, 1)",
     "write outer_momentum=0 for none, or e.g. 0.9 (DiLoCo's Nesterov momentum)"),
    ("interval", DT634, lambda v: math.isfinite(v) and v > 0, "s must be above 0",
     "write a positive duration such as interval=30 s"),
    ("penalty_warmup", DT637, lambda v: v >= 0, "must be at least 0 synchronisations",
     f"write penalty_warmup=0 (the z-test from the first synchronisation) or more "
     f"({ir.PENALTY_WARMUP} by default)"),
    ("replica_dp", DT636, lambda v: v >= 1, "must be at least 1 rank",
     "write replica_dp=1 (every DP rank a replica) or the DP ranks one replica shards over"),
)
_WARMUP = Param("warmup", IntKind(0, 10**9), default=0)
_MIN_LR = Param("min_lr", FloatKind(low=0, high=10), default=0.0)
_LR_SCHEDULE_ARGS = {
    "constant": (_WARMUP,),
    "linear": (_WARMUP, _MIN_LR),
    "cosine": (_WARMUP, _MIN_LR),
}



def _ok(*values: Any) -> bool:
    return all(v is not INVALID for v in values)


def _field(fields: Sequence[ast.Field], key: str) -> ast.Field | None:
    return next((f for f in fields if f.key == key), None)


def _divisors(n: int, limit: int = 1 << 20) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _article(role: str) -> str:
    return "the backbone" if role == "backbone" else f"an {role}" if role[0] in "aeiou" \
        else f"a {role}"


def _listing(values: Sequence[Any]) -> str:
    values = [str(v) for v in values]
    if len(values) <= 1:
        return "".join(values)
    return ", ".join(values[:-1]) + " and " + values[-1]



def _largest(q: ir.Quantity) -> float | None:
    """The largest value a quantity can take (its distribution's, then clamped), or None
    when it has no bound (an unclamped lognormal or zipf: DT502 says so)."""
    dist = q.dist
    if isinstance(dist, ir.Constant):
        top = dist.value
    elif isinstance(dist, ir.Uniform):
        top = dist.high
    elif isinstance(dist, ir.Choice):
        top = max(v for v, p in zip(dist.values, dist.probs, strict=True) if p > 0)
    elif isinstance(dist, ir.Empirical):
        top = max(dist.values)
    else:
        top = math.inf
    if q.high is not None:
        top = min(top, q.high)
    if q.low is not None:
        top = max(top, q.low)
    return None if math.isinf(top) else top
