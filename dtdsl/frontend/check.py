"""The checker: from an AST to a typed, resolved ``Program``, or every reason why not.

It resolves names (with "did you mean" for near misses), checks structure (one
backbone, projectors that join existing modules in the right direction, no
cycles, every module connected), types, units and ranges, the architecture's
own consistency (hidden divisible by heads, heads by KV heads, ...), the data
distributions, and hands the constraints to ``dtdsl.frontend.constraints`` for
the parallelism checks. All findings are reported, not just the first.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtdsl.diagnostics import Diagnostic, did_you_mean, has_errors
from dtdsl.frontend import ast
from dtdsl.frontend import moe as _moe
from dtdsl.frontend.constraints import resolve_constraints
from dtdsl.frontend.schema import (
    INVALID,
    BoolKind,
    CallKind,
    Ctx,
    EnumKind,
    FloatKind,
    IntKind,
    Kind,
    ListKind,
    Param,
    QuantityKind,
    StrKind,
    describe_expr,
    head_span,
    resolve_call,
    resolve_fields,
)
from dtdsl.ir import program as ir
from dtdsl.ir.hardware import GPU_PRESETS, HOST_BW_BYTES_PER_S
from dtdsl.source import Source, Span

__all__ = ["CheckResult", "check"]

MAX_NAME_LENGTH = 64
MAX_EMPIRICAL_BYTES = 64 << 20
MAX_EMPIRICAL_VALUES = 10_000_000

# ---- parameter tables (docs/language.md lists the same) -------------------------

MODULE_FIELDS = (
    # Required unless `pretrained` is given (then it defaults to hf(pretrained)).
    Param("arch", CallKind(),
          doc='arch = transformer(...), unet(...), dit(...) or hf("DIR")'),
    Param("pretrained", StrKind(), doc='pretrained = "models/llama-3-8b"'),
    Param("frozen", BoolKind(), default=False),
    Param("recompute", BoolKind(), default=False),
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

CLUSTER_FIELDS = (
    Param("gpu", CallKind(allow_bare=True), required=True,
          doc="gpu = H800, or custom(memory=..., peak=...)"),
    Param("gpus", IntKind(1, 1_000_000), required=True, doc="gpus = 64"),
    Param("gpus_per_node", IntKind(1, 64)),
    Param("intra_node_bw", QuantityKind(dim="bandwidth", low=0, high=1e14)),
    Param("inter_node_bw", QuantityKind(dim="bandwidth", low=0, high=1e14)),
    Param("cpu_workers", IntKind(0, 100_000), default=1),
    # The host link (PCIe) per GPU, which optimizer offload crosses (ir.hardware).
    Param("host_bw", QuantityKind(dim="bandwidth", low=0, high=1e14)),
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
            return ctx.error("DT635", f"{what} is NaN: it must be a fraction between 0 and "
                             "1", expr.span, hint="write offload=0.5, or offload=auto")
        value = FloatKind(expects=self.expects).convert(expr, ctx, what)
        if value is INVALID:
            return value
        if not 0.0 <= value <= 1.0:      # false for NaN and infinities too
            return ctx.error("DT635", f"{what} of {describe_expr(expr)} is not a fraction: "
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
    Param("global_batch", IntKind(1, 10**7), required=True, doc="global_batch = 1920"),
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
    Param("sync", CallKind(allow_bare=True)),
)
_SCHEDULE_ARGS = {
    "gpipe": (),
    "1f1b": (),
    "interleaved": (Param("virtual_stages", IntKind(2, 64), default=2),),
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
)
# (argument, code, test, what it must be, what to write instead) of local_sgd's bounds.
_SYNC_RULES = (
    ("period", "DT630", lambda v: v >= 1, "must be at least 1 step",
     "write period=1 or more (4 to 100 in EDiT's experiments)"),
    ("outer_lr", "DT631", lambda v: math.isfinite(v) and v > 0, "must be above 0",
     "write a positive outer_lr (1.0: the plain average of the replicas; DiLoCo uses 0.7)"),
    ("outer_momentum", "DT632", lambda v: 0 <= v < 1, "must be in [0, 1)",
     "write outer_momentum=0 for none, or e.g. 0.9 (DiLoCo's Nesterov momentum)"),
    ("interval", "DT634", lambda v: math.isfinite(v) and v > 0, "s must be above 0",
     "write a positive duration such as interval=30 s"),
)
_WARMUP = Param("warmup", IntKind(0, 10**9), default=0)
_MIN_LR = Param("min_lr", FloatKind(low=0, high=10), default=0.0)
_LR_SCHEDULE_ARGS = {
    "constant": (_WARMUP,),
    "linear": (_WARMUP, _MIN_LR),
    "cosine": (_WARMUP, _MIN_LR),
}


@dataclass(frozen=True)
class CheckResult:
    program: ir.Program | None
    diagnostics: tuple[Diagnostic, ...]


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


class _Checker:
    def __init__(self, spec: ast.Spec, source: Source, base_dir: Path) -> None:
        self.spec = spec
        self.source = source
        self.base_dir = base_dir
        self.ctx = Ctx()
        self.declared: dict[str, ast.Module] = {}  # every module, valid or not

    # ---- top level -------------------------------------------------------------
    def run(self) -> ir.Program | None:
        ctx = self.ctx
        blocks: dict[str, Any] = {}
        for block in self.spec.blocks:
            if block.kind in blocks:
                ctx.error("DT202", f"a second '{block.kind}' block; a spec has one",
                          head_span(block.span, len(block.kind)),
                          notes=[f"the first is at line {blocks[block.kind].span.line}"],
                          hint="merge the two blocks")
                continue
            blocks[block.kind] = block
        start = self.spec.name_span or Span.point(1, 1)
        for kind, example in (("model", "model { backbone llm { arch = transformer(...) } }"),
                              ("data", "data { text.tokens ~ constant(512) }"),
                              ("cluster", "cluster { gpu = H100  gpus = 8 }"),
                              ("train", "train { global_batch = 64  seq_len = 4096 }")):
            if kind not in blocks:
                ctx.error("DT204", f"the spec has no '{kind}' block", start,
                          hint=f"add one, e.g. {example}")

        modules, projectors = self._model(blocks.get("model"))
        cluster = self._cluster(blocks["cluster"]) if "cluster" in blocks else INVALID
        train = self._train(blocks["train"]) if "train" in blocks else INVALID
        data = self._data(blocks["data"], modules) if "data" in blocks else INVALID
        constraints = resolve_constraints(blocks.get("constraints"), modules, set(self.declared),
                                          cluster, train, self._gpus_span(blocks.get("cluster")),
                                          ctx)
        self._cross_checks(modules, projectors, data, train)
        if has_errors(ctx.diagnostics) or not _ok(cluster, train, data, constraints):
            return None
        name = self.spec.name or re.sub(r"\W", "_", Path(self.source.name).stem) or "spec"
        return ir.Program(
            name=name, source_name=self.source.name,
            source_sha256=hashlib.sha256(self.source.text.encode("utf-8")).hexdigest(),
            modules=tuple(modules.values()), projectors=tuple(projectors), data=data,
            cluster=cluster, train=train, constraints=constraints)

    @staticmethod
    def _gpus_span(block: ast.ClusterBlock | None) -> Span | None:
        if block is None:
            return None
        f = _field(block.fields, "gpus")
        return f.span if f else head_span(block.span, len("cluster"))

    # ---- model -----------------------------------------------------------------
    def _model(self, block: ast.ModelBlock | None) -> tuple[dict[str, ir.Module], list]:
        ctx = self.ctx
        if block is None:
            return {}, []
        decls: dict[str, ast.Module] = {}
        modules: dict[str, ir.Module] = {}
        for item in block.items:
            if not isinstance(item, ast.Module):
                continue
            if len(item.name) > MAX_NAME_LENGTH:
                # Still declared, so that projectors, constraints and the backbone count
                # do not report it a second time as missing.
                ctx.error("DT208", f"module name is {len(item.name)} characters long; "
                          f"names are limited to {MAX_NAME_LENGTH}", item.name_span,
                          hint="choose a shorter name")
            if item.name in decls:
                ctx.error("DT202", f"a second module named '{item.name}'", item.name_span,
                          notes=[f"the first is at line {decls[item.name].span.line}"],
                          hint="give each module its own name")
                continue
            decls[item.name] = item
            self.declared[item.name] = item
            module = self._module(item)
            if module is not INVALID:
                modules[item.name] = module
        head = head_span(block.span, len("model"))
        backbones = [d for d in decls.values() if d.role == "backbone"]
        if not backbones:
            ctx.error("DT301", "the model has no backbone", head,
                      hint="add one: backbone llm { arch = transformer(layers=32, hidden=4096, "
                      "heads=32, vocab=128256) }")
        for extra in backbones[1:]:
            ctx.error("DT301", f"the model has {len(backbones)} backbones "
                      f"({_listing([b.name for b in backbones])}); a spec trains exactly one",
                      extra.name_span, hint=f"make '{extra.name}' an encoder or a generator, "
                      "or remove it")
        projectors = self._projectors(block, decls, modules)
        return modules, projectors

    def _module(self, decl: ast.Module) -> ir.Module | Any:
        ctx = self.ctx
        where = f"{decl.role} {decl.name}"
        fields = resolve_fields(decl.fields, MODULE_FIELDS, ctx, where,
                                head_span(decl.span, len(decl.role)))
        modality = decl.modality
        if decl.role == "backbone":
            if modality is not None:
                ctx.error("DT206", f"the backbone reads text and every projected modality; "
                          f"it takes no modality, but '{modality}' is given",
                          decl.modality_span, hint=f"write `backbone {decl.name} {{`")
                modality = INVALID
        elif modality is None:
            ctx.error("DT204", f"{where} needs a modality", decl.name_span,
                      hint=f"write `{decl.role} {decl.name} (image) {{` "
                      f"(one of {', '.join(ir.MODALITIES)})")
            modality = INVALID
        elif modality not in ir.MODALITIES:
            guess = did_you_mean(modality, ir.MODALITIES)
            ctx.error("DT205", f"unknown modality '{modality}'", decl.modality_span,
                      notes=["modalities: " + ", ".join(ir.MODALITIES)],
                      hint=f"did you mean '{guess}'?" if guess else None)
            modality = INVALID
        arch = source = INVALID
        call, pretrained = fields["arch"], fields["pretrained"]
        if call is None and pretrained is None:
            arch = ctx.error("DT204", f"{where} needs an architecture", decl.name_span,
                             hint='write `arch = transformer(...)` (or unet, dit), `arch = '
                             'hf("DIR")` for a Hugging Face model, or `pretrained = "DIR"` '
                             "for its weights too")
        elif call is None and pretrained is not INVALID:
            # pretrained alone: the architecture is the checkpoint's own.
            path_span = _field(decl.fields, "pretrained").value.span
            arch, source = self._hf_model(pretrained, None, decl, modality, path_span)
        elif call is not INVALID:
            arch = self._arch(call, decl, modality)
            if call.func == "hf" and arch is not INVALID:
                arch, source = arch
        weights = None
        if pretrained not in (None, INVALID) and arch is not INVALID:
            weights = self._pretrained(pretrained, decl, arch, source)
        vae = self._vae(decl, fields["vae"], arch, source, modality)
        if not _ok(modality, arch, fields["frozen"], fields["recompute"], weights, pretrained,
                   vae, fields["context_parallel"]):
            return INVALID
        return ir.Module(name=decl.name, role=decl.role, modality=modality, arch=arch,
                         frozen=fields["frozen"], recompute=fields["recompute"],
                         span=decl.span, hf=source if source is not INVALID else None,
                         pretrained=weights, vae=vae,
                         context_parallel=fields["context_parallel"])

    def _vae(self, decl: ast.Module, text: Any, arch: Any, source: Any, modality: Any) -> Any:
        """A generator's VAE: the ``vae`` field's folder, else its pipeline's ``vae``; None
        without one (targets then come as latents: synthetic data's stand-in)."""
        ctx = self.ctx
        field = _field(decl.fields, "vae")
        if text is INVALID or arch is INVALID:
            return INVALID
        if text is not None and (decl.role != "generator" or modality != "image"):
            return ctx.error("DT306", f"only an image generator has a VAE; {decl.role} "
                             f"{decl.name} does not", field.value.span,
                             hint="remove the vae field")
        hf_unet = decl.role == "generator" and source not in (None, INVALID) and \
            source.family == "unet"
        if text is None and not hf_unet:
            return None     # no file to read: no torch import (dtc check stays light)
        from dtdsl.models.hf import HFError, WeightsFileError
        from dtdsl.models.vae import VAEConfig, VAEError, find_vae, vae_problems

        if text is not None:
            path, span = self._path(text), field.value.span
        elif (found := find_vae(source.path)) is not None:
            path, span = found, decl.name_span
        else:
            return None
        try:
            cfg = VAEConfig.read(path)
        except VAEError as err:
            return ctx.error("DT311", str(err), span,
                             hint="point vae at a diffusers AutoencoderKL folder (config.json "
                             "and safetensors)")
        want = getattr(arch, "latent_channels", None)
        if want is not None and cfg.latent_channels != want:
            return ctx.error("DT312", f"the VAE in {path} makes {cfg.latent_channels}-channel "
                             f"latents; generator {decl.name} denoises {want}", span,
                             hint="use the VAE the generator was trained with")
        # Its weights are read on every generator rank: checked here, headers only.
        try:
            problems = vae_problems(cfg)
        except WeightsFileError as err:
            return ctx.error("DT316", err.message, span, hint=err.hint)
        except HFError as err:
            return ctx.error("DT312", f"the VAE in {path}: {err.message}", span,
                             hint=err.hint)
        if problems:
            return ctx.error("DT312", f"the weights of the VAE in {path} do not fit its "
                             f"config: {problems[0]}", span, notes=problems[1:5])
        return cfg.arch()

    def _arch(self, call: ast.Call, decl: ast.Module, modality: Any) -> Any:
        ctx = self.ctx
        allowed = ROLE_ARCHS[decl.role]
        if call.func not in ARCHS:
            guess = did_you_mean(call.func, ARCHS)
            return ctx.error("DT205", f"unknown architecture '{call.func}'", call.func_span,
                             notes=["architectures: transformer (encoders, backbone), "
                                    "unet and dit (generators)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        if call.func not in allowed:
            return ctx.error("DT306", f"{_article(decl.role)} cannot be a {call.func}",
                             call.func_span, notes=[
                                 f"{_article(decl.role)} is "
                                 + " or ".join(f"a {a}" for a in allowed if a != "hf")
                                 + ", or a Hugging Face model: hf(\"DIR\")"])
        where = f"{call.func}() of {decl.role} {decl.name}"
        args = resolve_call(call, ARCHS[call.func], ctx, where,
                            positional=1 if call.func == "hf" else 0)
        if not _ok(*args.values()):
            return INVALID
        if call.func == "hf":
            span = call.args[0].span if call.args and call.args[0].name is None else \
                call.arg_span("path")
            arch, source = self._hf_model(args["path"], args["feature_layer"], decl, modality,
                                          span)
            return INVALID if arch is INVALID else (arch, source)
        if call.func == "transformer":
            return self._transformer(call, decl, modality, args)
        if call.func == "unet":
            return self._unet(call, args)
        return self._dit(call, args)

    def _path(self, text: str) -> Path:
        """A path of the spec: relative to the spec's folder, ``~`` expanded, absolute."""
        path = Path(text).expanduser()
        return (path if path.is_absolute() else self.base_dir / path).resolve()

    def _hf_model(self, text: str, feature_layer: int | None, decl: ast.Module, modality: Any,
                  span: Span) -> tuple[Any, Any]:
        """``(architecture, ir.HFSource)`` of the Hugging Face model in directory ``text``
        (``hf("DIR")``, or ``pretrained`` alone), or ``(INVALID, INVALID)`` with a DT311."""
        from dtdsl.models.hf.config import HFError, read_hf

        ctx = self.ctx
        try:
            model = read_hf(self._path(text), role=decl.role, feature_layer=feature_layer)
        except HFError as err:
            missing = not self._path(text).exists() and not Path(text).is_absolute()
            ctx.error("DT311", err.message, span, hint=err.hint or (
                "paths are relative to the spec's folder" if missing else None))
            return INVALID, INVALID
        # A tower reads what it was trained on: Whisper audio, CLIP and SigLIP images.
        reads = "audio" if model.source.family == "whisper" else "image"
        if decl.role == "encoder" and modality not in (INVALID, reads):
            tower = "an audio" if reads == "audio" else "a vision"
            ctx.error("DT306", f"{model.source.family} is {tower} tower; encoder {decl.name} "
                      f"reads {modality}", span, hint=f"write `encoder {decl.name} ({reads}) {{`")
            return INVALID, INVALID
        for note in model.notes:
            ctx.warning("DT504", note, span)
        return model.arch, model.source

    def _pretrained(self, text: str, decl: ast.Module, arch: Any, source: Any) -> Any:
        """The absolute directory of a module's pretrained weights, checked against its
        architecture (every tensor there, in its shape, floating point; every file's
        header checked against the file; nothing read but the headers)."""
        from dtdsl.models.hf import HFError, WeightsFileError, pretrained_problems, read_hf

        ctx = self.ctx
        span = _field(decl.fields, "pretrained").value.span
        if source is INVALID or source is None:
            return ctx.error("DT312", f"pretrained weights of {decl.role} {decl.name} are read "
                             f"into a Hugging Face architecture, and {arch.kind}(...) is "
                             "dtdsl's own", span,
                             hint=f'write `arch = hf("{text}")`, or leave arch out')
        try:
            weights = read_hf(self._path(text), role=decl.role)
        except HFError as err:
            return ctx.error("DT311", err.message, span, hint=err.hint)
        if weights.source.family != source.family:
            return ctx.error("DT312", f"{text} holds a {weights.source.family} model, but "
                             f"the architecture is a {source.family}", span)
        try:
            problems = pretrained_problems(weights, decl.role, arch)
        except WeightsFileError as err:
            return ctx.error("DT316", err.message, span, hint=err.hint)
        except HFError as err:
            return ctx.error("DT312", err.message, span, hint=err.hint)
        if problems:
            more = len(problems) - 5
            return ctx.error("DT312", f"the weights in {text} do not fit {decl.role} "
                             f"{decl.name}: {problems[0]}", span,
                             notes=problems[1:5] + ([f"and {more} more"] if more > 0 else []),
                             hint="point pretrained at the checkpoint of this architecture")
        return str(weights.weights_dir)

    def _transformer(self, call, decl, modality, args) -> Any:
        ctx = self.ctx
        ok = True
        hidden, heads = args["hidden"], args["heads"]
        kv_heads = args["kv_heads"] or heads
        if hidden % heads:
            ok = False
            below = hidden // heads * heads
            sizes = [h for h in (below, below + heads) if h > 0]
            near = sorted(_divisors(hidden, 4096), key=lambda d: (abs(d - heads), d))[:3]
            ctx.error("DT305", f"hidden {hidden} is not divisible by heads {heads}: each head "
                      f"would get {hidden / heads:g} dimensions", call.arg_span("hidden"),
                      hint=f"use hidden={' or '.join(map(str, sizes))}, or heads="
                      f"{' or '.join(map(str, sorted(near)))}")
        if heads % kv_heads:
            ok = False
            ctx.error("DT305", f"heads {heads} is not a multiple of kv_heads {kv_heads}: "
                      "grouped-query attention shares each KV head among an equal number of "
                      "query heads", call.arg_span("kv_heads"),
                      hint=f"kv_heads must divide {heads}: {_listing(_divisors(heads))}")
        if decl.role == "backbone" and not args["vocab"]:
            ok = False
            ctx.error("DT204", "the backbone's transformer needs a vocabulary size",
                      call.span, hint="add vocab=128256 (Llama 3) or your tokenizer's size")
        if decl.role != "backbone" and args["vocab"]:
            ctx.warning("DT501", f"{decl.role} {decl.name} has a vocabulary, which only the "
                        "backbone uses; it is ignored", call.arg_span("vocab"))
        if modality in ("image", "video") and args["patch"] is None:
            ok = False
            ctx.error("DT204", f"encoder {decl.name} reads {modality}s and needs a patch size",
                      call.span, hint="add patch=14 (ViT-H/14) or patch=16")
        ok = self._modal_args(decl, call, args, modality) and ok
        moe = _moe.resolve_moe(call, decl.role, decl.name, args["layers"],
                               args["ffn"] or 4 * hidden, args, ctx)
        if not ok or moe is INVALID:
            return INVALID
        return ir.TransformerArch(moe=moe,
            layers=args["layers"], hidden=hidden, heads=heads, kv_heads=kv_heads,
            ffn=args["ffn"] or 4 * hidden, vocab=args["vocab"], swiglu=args["swiglu"],
            patch=args["patch"], stem="patch" if args["patch"] or modality != "audio" else "frames",
            in_channels=None if decl.role == "backbone" else
            args["in_channels"] or (1 if modality == "audio" else 3),
            causal=decl.role == "backbone" if args["causal"] is None else args["causal"],
            mel_bins=args["mel_bins"], temporal_patch=args["temporal_patch"])

    def _modal_args(self, decl, call, args, modality) -> bool:
        """``mel_bins`` (audio encoders) and ``temporal_patch`` (video encoders): an
        audio encoder's fbank must split into whole patches along its mel bins (DT612);
        temporal patching belongs to a video encoder (DT613). False on an error."""
        ctx = self.ctx
        ok = True
        given = {a.name for a in call.args}
        patch, bins = args["patch"], args["mel_bins"]
        if modality == "audio" and decl.role == "encoder" and patch and bins % patch:
            ok = False
            fits = [m for m in (64, 80, 128, 256) if m % patch == 0] or [patch * 8]
            ctx.error("DT612", f"encoder {decl.name} cuts its {bins}-bin fbank into {patch} x "
                      f"{patch} patches, but {patch} does not divide {bins}",
                      call.arg_span("mel_bins"),
                      hint=f"use mel_bins={' or '.join(map(str, fits[:3]))}, or a patch that "
                           f"divides {bins}")
        if args["temporal_patch"] > 1 and not (decl.role == "encoder" and modality == "video"):
            ok = False
            what = f"{decl.role} {decl.name}" + (f" reads {modality}" if modality else "")
            ctx.error("DT613", f"temporal_patch={args['temporal_patch']} patches frames in "
                      f"time, but {what}; only a video encoder has frames",
                      call.arg_span("temporal_patch"),
                      hint="remove temporal_patch, or read video with this encoder")
        if "mel_bins" in given and not (decl.role == "encoder" and modality == "audio"):
            ctx.warning("DT501", f"{decl.role} {decl.name} has mel_bins, which only an audio "
                        "encoder uses; it is ignored", call.arg_span("mel_bins"))
        return ok

    def _unet(self, call, args) -> Any:
        ctx = self.ctx
        ok = True
        levels = len(args["mult"])
        reachable = [2 ** i for i in range(levels)]
        if args["attn_res"] is None:
            args["attn_res"] = tuple(f for f in _DEFAULT_ATTN_RES if f in reachable)
        for res in args["attn_res"]:
            if res not in reachable:
                ok = False
                ctx.error("DT305", f"attn_res {res} is never reached: a U-Net with {levels} "
                          f"levels downsamples by {_listing(reachable)}",
                          call.arg_span("attn_res"),
                          hint="list downsampling factors where attention runs, e.g. "
                          f"[{', '.join(map(str, reversed(reachable[:3])))}]")
        if args["latent"] % (2 ** (levels - 1)):
            ok = False
            ctx.error("DT305", f"latent {args['latent']} cannot be halved {levels - 1} times "
                      f"for a U-Net with {levels} levels", call.arg_span("latent"),
                      hint=f"use a multiple of {2 ** (levels - 1)}, e.g. 64")
        for i, m in enumerate(args["mult"]):
            ch = args["channels"] * m
            if ch % args["groups"]:
                ok = False
                ctx.error("DT305", f"level {i} has {ch} channels, which GroupNorm cannot split "
                          f"into {args['groups']} groups", call.arg_span("channels"),
                          hint="use channels divisible by groups (e.g. channels=320, groups=32)")
            if 2 ** i in args["attn_res"] and ch % args["head_dim"]:
                ok = False
                ctx.error("DT305", f"level {i} has {ch} channels, not a multiple of "
                          f"head_dim {args['head_dim']}", call.arg_span("head_dim"))
        if not ok:
            return INVALID
        return ir.UNetArch(**args)

    def _dit(self, call, args) -> Any:
        ctx = self.ctx
        ok = True
        if args["hidden"] % args["heads"]:
            ok = False
            ctx.error("DT305", f"hidden {args['hidden']} is not divisible by heads "
                      f"{args['heads']}", call.arg_span("hidden"))
        if args["latent"] % args["patch"]:
            ok = False
            ctx.error("DT305", f"latent {args['latent']} is not divisible by patch "
                      f"{args['patch']}", call.arg_span("patch"))
        if not ok:
            return INVALID
        return ir.DiTArch(layers=args["layers"], hidden=args["hidden"], heads=args["heads"],
                          ffn=args["ffn"] or 4 * args["hidden"], patch=args["patch"],
                          latent=args["latent"], latent_channels=args["latent_channels"],
                          context_dim=args["context_dim"] or args["hidden"])

    # ---- projectors -----------------------------------------------------------------
    def _projectors(self, block: ast.ModelBlock, decls: dict[str, ast.Module],
                    modules: dict[str, ir.Module]) -> list[ir.Projector]:
        ctx = self.ctx
        edges: dict[tuple[str, str], ast.Projector] = {}
        named = {n for item in block.items if isinstance(item, ast.Projector)
                 for n in (item.source, item.target)}
        for item in block.items:
            if not isinstance(item, ast.Projector):
                continue
            ok = True
            for name, span in ((item.source, item.source_span), (item.target, item.target_span)):
                if name not in decls:
                    ok = False
                    guess = did_you_mean(name, decls)
                    ctx.error("DT203", f"projector refers to '{name}', which is not a module",
                              span, notes=["modules: " + (", ".join(decls) or "none")],
                              hint=f"did you mean '{guess}'?" if guess else None)
            if not ok:
                continue
            key = (item.source, item.target)
            if key in edges:
                ctx.error("DT202", f"a second projector {item.source} -> {item.target}",
                          item.span, notes=[f"the first is at line {edges[key].span.line}"])
                continue
            if item.source == item.target:
                ctx.error("DT303", f"projector {item.source} -> {item.target} connects a module "
                          "to itself", item.span)
                continue
            edges[key] = item

        # Cycles first: a cycle makes every edge in it wrong in a way direction cannot explain.
        in_cycle: set[tuple[str, str]] = set()
        for (a, b), item in edges.items():
            if (b, a) in edges and (b, a) not in in_cycle:
                in_cycle |= {(a, b), (b, a)}
                later = max(item, edges[(b, a)], key=lambda p: (p.span.line, p.span.column))
                ctx.error("DT303", f"projectors {a} -> {b} and {b} -> {a} form a cycle",
                          later.span, hint="data flows encoder -> backbone -> generator; "
                          "remove the projector that points back")
        valid = {("encoder", "backbone"), ("backbone", "generator")}
        projectors = []
        for (a, b), item in edges.items():
            if (a, b) in in_cycle:
                continue
            ra, rb = decls[a].role, decls[b].role
            if (ra, rb) not in valid:
                if (rb, ra) in valid:
                    ctx.error("DT302", f"projector {a} -> {b} points the wrong way: "
                              f"{'encoders feed' if rb == 'encoder' else 'the backbone feeds'} "
                              f"the {'backbone' if rb == 'encoder' else 'generators'}",
                              item.span, hint=f"write `projector {b} -> {a}`")
                else:
                    ctx.error("DT302", f"projector {a} -> {b} joins {_article(ra)} to "
                              f"{_article(rb)}; a projector joins an encoder to the backbone or "
                              "the backbone to a generator", item.span)
                continue
            projector = self._projector(item, modules)
            if projector is not INVALID:
                projectors.append(projector)

        backbone = next((d for d in decls.values() if d.role == "backbone"), None)
        if backbone is not None:
            for decl in decls.values():
                if decl.name in named and not any(decl.name in e for e in edges):
                    continue  # its projectors have errors of their own
                if decl.role == "encoder" and not any(a == decl.name for a, _ in edges):
                    ctx.error("DT304", f"encoder {decl.name} feeds nothing", decl.name_span,
                              hint=f"add `projector {decl.name} -> {backbone.name} : "
                              "mlp(depth=2)`")
                if decl.role == "generator" and not any(b == decl.name for _, b in edges):
                    ctx.error("DT304", f"generator {decl.name} is fed by nothing",
                              decl.name_span, hint=f"add `projector {backbone.name} -> "
                              f"{decl.name} : mlp(depth=2)`")
        return projectors

    def _projector(self, item: ast.Projector, modules: dict[str, ir.Module]) -> Any:
        ctx = self.ctx
        where = f"projector {item.source} -> {item.target}"
        fields = resolve_fields(item.fields, PROJECTOR_FIELDS, ctx, where,
                                head_span(item.span, len("projector")))
        call = fields["arch"]
        if call is INVALID:
            return INVALID
        if call.func != "mlp":
            guess = did_you_mean(call.func, ["mlp"])
            return ctx.error("DT205", f"unknown projector architecture '{call.func}'",
                             call.func_span, notes=["projectors are mlp(depth=..., hidden=...)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, MLP_ARGS, ctx, f"mlp() of {where}")
        compress = self._compression(fields["compress"], item, modules, where)
        if not _ok(*args.values(), fields["frozen"], compress) or \
                item.source not in modules or item.target not in modules:
            return INVALID
        src, dst = modules[item.source], modules[item.target]
        in_dim = src.output_dim if compress is None else compress.mlp_width(src.output_dim)
        return ir.Projector(
            name=f"{item.source}_to_{item.target}", source=item.source, target=item.target,
            arch=ir.MLPArch(depth=args["depth"], in_dim=in_dim,
                            hidden=args["hidden"] or dst.input_dim, out_dim=dst.input_dim,
                            activation=args["activation"]),
            frozen=fields["frozen"], span=item.span, compress=compress)

    def _compression(self, call: Any, item: ast.Projector, modules: dict[str, ir.Module],
                     where: str) -> Any:
        """``compress = ...`` of a projector: None when it has none (``_ok`` takes None)."""
        ctx = self.ctx
        if call is None or call is INVALID:
            return call if call is None else INVALID
        table = COMPRESSIONS.get(call.func)
        if table is None:
            guess = did_you_mean(call.func, COMPRESSIONS)
            return ctx.error("DT205", f"unknown token compression '{call.func}'",
                             call.func_span, notes=["compress is one of: "
                                                    + ", ".join(f"{n}(...)" for n in
                                                                COMPRESSIONS)],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, table, ctx, f"{call.func}() of {where}", positional=1)
        src = modules.get(item.source)
        if not _ok(*args.values()) or src is None:
            return INVALID
        if src.role != "encoder" or src.modality != "image":
            what = f"encoder {src.name} reads {src.modality}" if src.role == "encoder" \
                else f"{src.name} is the {src.role}"
            return ctx.error("DT318", f"{call.func}() compresses an image's patch grid, but "
                             f"{what}", call.span,
                             hint="remove `compress` here: only an image encoder's projector "
                             "into the backbone compresses tokens")
        if call.func == "resampler":
            return self._resampler(call, args, src)
        spec = ir.PixelShuffle(factor=args["factor"]) if call.func == "pixel_shuffle" \
            else ir.AvgPool(factor=args["factor"])
        return self._fixed_grid(call, spec, src)

    def _resampler(self, call: ast.Call, args: dict[str, Any], src: ir.Module) -> Any:
        width = src.output_dim
        heads = args["heads"] or getattr(src.arch, "heads", 1)
        if width % heads:
            return self.ctx.error(
                "DT318", f"a resampler of {heads} heads cannot split encoder {src.name}'s "
                f"width of {width}", call.arg_span("heads") if args["heads"] else call.span,
                hint=f"heads must divide {width}: {_listing(_divisors(width, 1024))}")
        return ir.Resampler(queries=args["queries"], heads=heads)

    def _fixed_grid(self, call: ast.Call, spec: Any, src: ir.Module) -> Any:
        """A pixel shuffle whose factor does not divide the patch grid of an encoder that
        reads images of one fixed size (a Hugging Face CLIP or SigLIP tower, resized to
        its ``image_size``: ``data.images``); native-resolution images are sized to whole
        blocks of the factor instead (``ImageTokens.block``)."""
        arch = src.arch
        fixed = src.hf is not None and src.hf.family in ("clip", "siglip") and \
            isinstance(arch, ir.TransformerArch) and arch.image_size
        if not isinstance(spec, ir.PixelShuffle) or not fixed:
            return spec
        patch = arch.patch or 1
        side = arch.image_size // patch
        if side % spec.factor == 0:
            return spec
        fits = [k for k in range(2, 17) if side % k == 0]
        return self.ctx.error(
            "DT318", f"pixel_shuffle({spec.factor}) needs a patch grid divisible by "
            f"{spec.factor}, but encoder {src.name} reads {arch.image_size} x "
            f"{arch.image_size} images in patches of {patch}: a {side} x {side} grid",
            call.args[0].span if call.args else call.span,
            hint=(f"use pixel_shuffle({' or '.join(map(str, fits))})" if fits else
                  "use no pixel shuffle") + f", or avg_pool({spec.factor}), which pools the "
            "edge blocks (ceil mode)")

    # ---- data ----------------------------------------------------------------------------
    def _data(self, block: ast.DataBlock, modules: Mapping[str, Any]) -> Any:
        ctx = self.ctx
        fields = [i for i in block.items if isinstance(i, ast.Field)]
        values = resolve_fields(fields, DATA_FIELDS, ctx, "data", head_span(block.span, 4))
        tokenizer = self._tokenizer(fields, values, modules)
        quantities: dict[str, ir.Quantity] = {}
        seen: dict[str, ast.Distribution] = {}
        ok = _ok(*values.values())
        for item in block.items:
            if not isinstance(item, ast.Distribution):
                continue
            key = f"{item.modality}.{item.quantity}"
            if item.modality not in ir.QUANTITIES:
                guess = did_you_mean(item.modality, ir.QUANTITIES)
                ctx.error("DT205", f"unknown modality '{item.modality}' in data",
                          item.target_span, notes=["modalities: " + ", ".join(ir.QUANTITIES)],
                          hint=f"did you mean '{guess}'?" if guess else None)
                ok = False
                continue
            names = ir.QUANTITIES[item.modality]
            if item.quantity not in names:
                guess = did_you_mean(item.quantity, names)
                ctx.error("DT201", f"unknown quantity '{key}'", item.target_span,
                          notes=[f"{item.modality} samples carry: " +
                                 ", ".join(f"{item.modality}.{n}" for n in names)],
                          hint=f"did you mean '{item.modality}.{guess}'?" if guess else None)
                ok = False
                continue
            if key in seen:
                ctx.error("DT202", f"'{key}' is given two distributions", item.target_span,
                          notes=[f"the first is at line {seen[key].span.line}"])
                ok = False
                continue
            seen[key] = item
            quantity = self._quantity(item, key)
            if quantity is INVALID:
                ok = False
            else:
                quantities[key] = quantity

        head = head_span(block.span, len("data"))
        needed = {"text.tokens": "the backbone"}
        for m in self.declared.values():  # invalid modules too: their data is not "unused"
            if m.modality not in ir.MODALITIES:
                continue
            if m.role == "encoder":
                sizes = {"image": ("count", "patches"), "video": ("count", "frames", "patches"),
                         "audio": ("count", "frames")}[m.modality]
                needed.update({f"{m.modality}.{q}": f"encoder {m.name}" for q in sizes})
            elif m.role == "generator":
                needed[f"{m.modality}.gen_count"] = f"generator {m.name}"
        for key, user in needed.items():
            if key not in seen:
                ok = False
                ctx.error("DT204", f"{user} needs a distribution for '{key}', which data does "
                          "not give", head,
                          hint=f"add e.g. `{key} ~ {_EXAMPLES[key.split('.')[1]]}`")
        unsure = any(m.modality not in ir.MODALITIES for m in self.declared.values()
                     if m.role != "backbone")
        for key, item in seen.items():
            if key not in needed and not unsure:
                ctx.warning("DT501", f"data describes '{key}', but no module reads it",
                            item.target_span, hint="remove it, or add the module that uses it")
        if not ok or tokenizer is INVALID:
            return INVALID
        source_field = _field(fields, "source")
        folder = values["image_folder"]
        return ir.Data(name=block.name or "data", source=values["source"],
                       samples=values["samples"], quantities=tuple(quantities.values()),
                       span=block.span,
                       source_span=source_field.value.span if source_field else None,
                       tokenizer=tokenizer, chat=values["chat"],
                       image_folder=str(self._path(folder)) if folder is not None else None)

    def _tokenizer(self, fields: Sequence[ast.Field], values: Mapping[str, Any],
                   modules: Mapping[str, Any]) -> Any:
        """The absolute path of the data's tokenizer: the ``tokenizer`` field, else the
        backbone's pretrained directory when it holds a ``tokenizer.json``; None for the
        hashing tokenizer of synthetic data. Loaded here once (DT315 when it cannot be, or
        its ids do not fit the backbone's vocabulary)."""
        from dtdsl.data.text import TokenizerError, load_tokenizer

        backbone = next((m for m in modules.values()
                         if m is not INVALID and m.role == "backbone"), None)
        field = _field(fields, "tokenizer")
        if field is not None and values["tokenizer"] is not None:
            path, span = self._path(values["tokenizer"]), field.value.span
        elif backbone is not None and backbone.pretrained is not None and \
                (Path(backbone.pretrained) / "tokenizer.json").is_file():
            path, span = Path(backbone.pretrained), None
        else:
            return None
        if backbone is None or not isinstance(getattr(backbone.arch, "vocab", None), int):
            return str(path)
        try:
            load_tokenizer(path, backbone.arch.vocab, values["chat"])
        except TokenizerError as err:
            chat = _field(fields, "chat")
            where = span or (chat.value.span if chat is not None else backbone.span)
            return self.ctx.error("DT315", f"the tokenizer cannot be used: {err}", where,
                                  hint="point `tokenizer` at a tokenizer.json or a Hugging "
                                  "Face folder holding one, made for the backbone")
        return str(path)

    def _quantity(self, item: ast.Distribution, key: str) -> Any:
        ctx = self.ctx
        expr = item.dist
        if isinstance(expr, ast.Number):  # `image.patches ~ 256` means constant(256)
            expr = ast.Call(func="constant", func_span=expr.span, span=expr.span,
                            args=(ast.Arg(name=None, value=expr, span=expr.span),))
        if not isinstance(expr, ast.Call):
            return ctx.error("DT206", f"'{key}' must follow a distribution such as "
                             "lognormal(median=256, sigma=0.8)", expr.span)
        if expr.func not in DISTRIBUTIONS:
            guess = did_you_mean(expr.func, DISTRIBUTIONS)
            return ctx.error("DT205", f"unknown distribution '{expr.func}'", expr.func_span,
                             notes=["distributions: " + ", ".join(DISTRIBUTIONS)],
                             hint=f"did you mean '{guess}'?" if guess else None)
        params, positional = DISTRIBUTIONS[expr.func]
        args = resolve_call(expr, params, ctx, f"{expr.func}() of {key}", positional)
        low = high = None
        if item.clamp is not None:
            low = _COUNT.convert(item.clamp[0], ctx, f"the lower clamp of {key}")
            high = _COUNT.convert(item.clamp[1], ctx, f"the upper clamp of {key}")
            if _ok(low, high) and low > high:
                ctx.error("DT208", f"clamp [{low:g}, {high:g}] of {key} is empty: the lower "
                          "bound is above the upper", item.clamp[0].span)
                low = INVALID
        if not _ok(*args.values(), low, high):
            return INVALID
        dist = self._dist(expr, args, key)
        if dist is INVALID:
            return INVALID
        if expr.func in _UNBOUNDED and high is None:
            ctx.warning("DT502", f"{key} ~ {expr.func}(...) has no upper bound", expr.span,
                        hint="add `clamp [low, high]` so one sample cannot take over a batch")
        return ir.Quantity(modality=item.modality, name=item.quantity, dist=dist, low=low,
                           high=high, span=item.span)

    def _dist(self, call: ast.Call, args: dict[str, Any], key: str) -> Any:
        ctx = self.ctx
        func = call.func
        if func == "constant":
            return ir.Constant(value=args["value"])
        if func == "uniform":
            if args["low"] > args["high"]:
                return ctx.error("DT208", f"uniform({args['low']:g}, {args['high']:g}) is "
                                 "empty: low is above high", call.span)
            return ir.Uniform(low=args["low"], high=args["high"])
        if func == "lognormal":
            return ir.LogNormal(median=args["median"], sigma=args["sigma"])
        if func == "zipf":
            return ir.Zipf(a=args["a"])
        if func == "choice":
            values = args["values"]
            probs = args["p"] or tuple(1 / len(values) for _ in values)
            if len(probs) != len(values):
                return ctx.error("DT208", f"choice() has {len(values)} values but "
                                 f"{len(probs)} probabilities", call.arg_span("p"))
            total = math.fsum(probs)
            if abs(total - 1) > 1e-6:
                return ctx.error("DT208", f"the probabilities of choice() sum to {total:g}, "
                                 "not 1", call.arg_span("p"),
                                 hint="scale them so they add up to 1")
            return ir.Choice(values=values, probs=probs)
        return self._empirical(call, args, key)

    def _empirical(self, call: ast.Call, args: dict[str, Any], key: str) -> Any:
        ctx = self.ctx
        span = call.arg_span("path")
        if call.args and call.args[0].name is None:
            span = call.args[0].span
        path = Path(args["path"])
        if not path.is_absolute():
            path = self.base_dir / path
        try:
            size = path.stat().st_size
            if size > MAX_EMPIRICAL_BYTES:
                return ctx.error("DT309", f"{args['path']} is {size:,} bytes; empirical "
                                 f"files are limited to {MAX_EMPIRICAL_BYTES:,}", span)
            raw = path.read_bytes()
        except FileNotFoundError:
            return ctx.error("DT309", f"no such file: {args['path']}", span,
                             notes=[f"looked for {_shown(path)}"],
                             hint="paths are relative to the spec's folder")
        except OSError as err:
            return ctx.error("DT309", f"cannot read {args['path']}: {err.strerror or err}",
                             span)
        try:
            values = _parse_samples(raw, path.suffix, args["key"] or key)
        except ValueError as err:
            return ctx.error("DT309", f"{args['path']}: {err}", span,
                             hint="give a JSON list of numbers, a JSON object of such lists "
                             "by quantity, or one number per line")
        return ir.Empirical(path=args["path"], key=args["key"],
                            sha256=hashlib.sha256(raw).hexdigest(), values=values)

    # ---- cluster ------------------------------------------------------------------------
    def _cluster(self, block: ast.ClusterBlock) -> Any:
        ctx = self.ctx
        head = head_span(block.span, len("cluster"))
        values = resolve_fields(block.fields, CLUSTER_FIELDS, ctx, "cluster", head)
        gpu_call = values["gpu"]
        gpu = INVALID
        preset = None
        if gpu_call is not INVALID:
            if gpu_call.func == "custom":
                args = resolve_call(gpu_call, _CUSTOM_GPU, ctx, "custom() gpu")
                if _ok(*args.values()):
                    gpu = ir.Gpu(name=args["name"], memory_bytes=int(args["memory"]),
                                 peak_flops=args["peak"])
            elif gpu_call.func in GPU_PRESETS:
                preset = GPU_PRESETS[gpu_call.func]
                args = resolve_call(gpu_call, _GPU_OVERRIDES, ctx, f"gpu {gpu_call.func}")
                if _ok(*args.values()):
                    gpu = ir.Gpu(name=gpu_call.func,
                                 memory_bytes=int(args["memory"] or preset.memory_bytes),
                                 peak_flops=args["peak"] or preset.peak_flops)
            else:
                guess = did_you_mean(gpu_call.func, GPU_PRESETS)
                ctx.error("DT205", f"unknown GPU '{gpu_call.func}'", gpu_call.func_span,
                          notes=["presets: " + ", ".join(GPU_PRESETS) +
                                 "; any other GPU: custom(memory=..., peak=...)"],
                          hint=f"did you mean '{guess}'?" if guess else None)
        for bw in ("intra_node_bw", "inter_node_bw"):
            if values[bw] is None and preset is None and gpu is not INVALID:
                values[bw] = ctx.error("DT204", f"cluster needs '{bw}' for a custom GPU",
                                       head, hint=f"add `{bw} = "
                                       f"{'400 GB/s' if bw.startswith('intra') else '400 Gb/s'}`")
        if not _ok(*values.values(), gpu):
            return INVALID
        gpus = values["gpus"]
        per_node = values["gpus_per_node"]
        if per_node is None:
            per_node = min(8, gpus)
        elif per_node > gpus:
            ctx.warning("DT501", f"gpus_per_node {per_node} is more than the cluster's {gpus} "
                        f"GPUs; dtdsl uses {gpus}", _field(block.fields, "gpus_per_node").span)
            per_node = gpus
        return ir.Cluster(
            name=block.name or "cluster", gpu=gpu, num_gpus=gpus, gpus_per_node=per_node,
            intra_node_bw_bytes_per_s=values["intra_node_bw"] or
            preset.intra_node_bw_bytes_per_s,
            inter_node_bw_bytes_per_s=values["inter_node_bw"] or
            preset.inter_node_bw_bytes_per_s,
            cpu_workers=values["cpu_workers"], span=block.span, gpus_span=self._gpus_span(block),
            host_bw_bytes_per_s=values["host_bw"] or HOST_BW_BYTES_PER_S)

    # ---- train -----------------------------------------------------------------------------
    def _train(self, block: ast.TrainBlock) -> Any:
        ctx = self.ctx
        values = resolve_fields(block.fields, TRAIN_FIELDS, ctx, "train",
                                head_span(block.span, len("train")))
        schedule, virtual = self._schedule(values["schedule"])
        optimizer = self._optimizer(values["optimizer"])
        lr_schedule = self._lr_schedule(values["lr_schedule"], optimizer, values["steps"],
                                        _field(block.fields, "steps") is not None)
        gb, mb = values["global_batch"], values["micro_batch"]
        if _ok(gb, mb) and gb % mb:
            f = _field(block.fields, "micro_batch")
            good = [d for d in _divisors(gb, 4096) if d <= max(mb * 4, 8)][-4:]
            ctx.error("DT307", f"global_batch {gb} is not divisible by micro_batch {mb}",
                      f.span if f else block.span,
                      hint=f"micro_batch must divide {gb}: e.g. {_listing(good)}")
            values["micro_batch"] = INVALID
        sync = self._sync(values["sync"])
        if not _ok(*values.values(), schedule, virtual, optimizer, lr_schedule, sync):
            return INVALID
        spans = {f"{key}_span": f.span for key in ("schedule", "precision")
                 if (f := _field(block.fields, key)) is not None}
        values.update(schedule=schedule, virtual_stages=virtual, optimizer=optimizer,
                      lr_schedule=lr_schedule, sync=sync, span=block.span, **spans)
        return ir.Train(**values)

    def _schedule(self, call: ast.Call | None | Any) -> tuple[Any, Any]:
        ctx = self.ctx
        if call is None:
            return "1f1b", 1
        if call is INVALID:
            return INVALID, INVALID
        if call.func not in _SCHEDULE_ARGS:
            guess = did_you_mean(call.func, _SCHEDULE_ARGS)
            ctx.error("DT205", f"unknown schedule '{call.func}'", call.func_span,
                      notes=["schedules: gpipe, 1f1b, interleaved(virtual_stages=2)"],
                      hint=f"did you mean '{guess}'?" if guess else None)
            return INVALID, INVALID
        args = resolve_call(call, _SCHEDULE_ARGS[call.func], ctx, f"{call.func} schedule", 1)
        if not _ok(*args.values()):
            return INVALID, INVALID
        return call.func, args.get("virtual_stages", 1)

    def _optimizer(self, call: ast.Call | None | Any) -> Any:
        ctx = self.ctx
        if call is None:  # the same as `optimizer = adamw`
            return ir.Optimizer(name="adamw", **{p.name: p.default for p in _OPTIMIZER_ARGS})
        if call is INVALID:
            return INVALID
        if call.func not in ("adamw", "adam"):
            guess = did_you_mean(call.func, ("adamw", "adam"))
            return ctx.error("DT205", f"unknown optimizer '{call.func}'", call.func_span,
                             notes=["optimizers: adamw, adam"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _OPTIMIZER_ARGS, ctx, f"{call.func}()")
        if args["zero"] is not INVALID and args["zero"] > 1:
            return ctx.error("DT208", f"ZeRO stage {args['zero']} is not supported; dtdsl "
                             "shards optimizer state across data parallelism (stage 1), as "
                             "DistTrain does", call.arg_span("zero"),
                             hint="use zero=1 (or zero=0 to replicate optimizer state)")
        if not _ok(*args.values()):
            return INVALID
        if call.func == "adam":
            args["weight_decay"] = 0.0 if "weight_decay" not in \
                {a.name for a in call.args} else args["weight_decay"]
        return ir.Optimizer(name=call.func, **args)

    def _sync(self, call: ast.Call | None | Any) -> Any:
        """``sync = allreduce`` (the default) or ``sync = local_sgd(period=H | interval=T,
        outer_lr=..., outer_momentum=..., penalty=...)``."""
        ctx = self.ctx
        if call is None:
            return ir.Sync()
        if call is INVALID:
            return INVALID
        if call.func not in ("allreduce", "local_sgd"):
            guess = did_you_mean(call.func, ("allreduce", "local_sgd"))
            return ctx.error("DT205", f"unknown sync '{call.func}'", call.func_span,
                             notes=["sync: allreduce (every step), local_sgd(period=4, "
                                    "outer_lr=0.7, outer_momentum=0.9, penalty=false) or "
                                    "local_sgd(interval=30 s, ...)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _SYNC_ARGS if call.func == "local_sgd" else (),
                            ctx, f"{call.func}()")
        if call.func == "allreduce":
            return ir.Sync() if _ok(*args.values()) else INVALID
        checked = [self._sync_bound(call, args, *rule) for rule in _SYNC_RULES]
        if _ok(*args.values()) and args["period"] is not None and \
                args["interval"] is not None:
            checked.append(ctx.error(
                "DT633", "local_sgd takes a period in steps or an interval in seconds, not "
                "both", call.arg_span("interval"),
                notes=[f"period={args['period']} syncs every {args['period']} steps; "
                       f"interval={args['interval']:g} s syncs when that much time has "
                       "passed (A-EDiT)"],
                hint="remove one of them"))
        if not _ok(*args.values(), *checked):
            return INVALID
        return ir.Sync(kind="local_sgd", period=args["period"] or 1,
                       interval_s=args["interval"], outer_lr=args["outer_lr"],
                       outer_momentum=args["outer_momentum"], penalty=args["penalty"])

    def _sync_bound(self, call: ast.Call, args: dict[str, Any], name: str, code: str,
                    ok: Any, need: str, hint: str) -> Any:
        value = args[name]
        if value is INVALID or value is None or ok(value):
            return value
        return self.ctx.error(code, f"local_sgd {name} {value:g} {need}",
                              call.arg_span(name), hint=hint)

    def _lr_schedule(self, call: ast.Call | None | Any, optimizer: Any, steps: Any,
                     steps_given: bool) -> Any:
        """``lr_schedule = cosine(warmup=..., min_lr=...)``: the warmup must fit in the
        training steps and the decay must end at or below the optimizer's peak lr."""
        ctx = self.ctx
        if call is None:
            return ir.LRSchedule()
        if call is INVALID:
            return INVALID
        if call.func not in _LR_SCHEDULE_ARGS:
            guess = did_you_mean(call.func, _LR_SCHEDULE_ARGS)
            return ctx.error("DT205", f"unknown learning-rate schedule '{call.func}'",
                             call.func_span,
                             notes=["learning-rate schedules: constant(warmup=0), "
                                    "linear(warmup=0, min_lr=0), cosine(warmup=0, min_lr=0)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _LR_SCHEDULE_ARGS[call.func], ctx, f"{call.func}()")
        warmup, min_lr = args["warmup"], args.get("min_lr", 0.0)
        if _ok(warmup, steps) and warmup > steps:
            default = "" if steps_given else " by default"
            warmup = ctx.error("DT208", f"a warmup of {warmup:,} steps is longer than the "
                               f"training: train.steps is {steps:,}{default}",
                               call.arg_span("warmup"),
                               notes=["the learning rate would never reach its peak"],
                               hint=f"warm up for at most {steps:,} steps, or raise steps")
        if _ok(min_lr, optimizer) and min_lr > optimizer.lr:
            min_lr = ctx.error("DT208", f"min_lr {min_lr:g} is above the peak learning rate: "
                               f"lr={optimizer.lr:g} of {optimizer.name}()",
                               call.arg_span("min_lr"),
                               notes=[f"{call.func}() decays from lr down to min_lr"],
                               hint=f"write a min_lr of at most {optimizer.lr:g} (0 by "
                               "default), or raise lr in the optimizer")
        if not _ok(warmup, min_lr):
            return INVALID
        return ir.LRSchedule(name=call.func, warmup=warmup, min_lr=min_lr)

    # ---- checks across blocks ----------------------------------------------------------------
    def _cross_checks(self, modules, projectors, data, train) -> None:
        ctx = self.ctx
        if modules and all(m.frozen for m in modules.values()) and \
                all(p.frozen for p in projectors) and \
                not has_errors(ctx.diagnostics):
            first = next(iter(modules.values()))
            ctx.error("DT310", "every module and projector is frozen: nothing would be trained",
                      first.span, hint="unfreeze at least one module or projector")
        if train is not INVALID:
            for m in modules.values():
                self._attention_reach(m, train)
        if data is INVALID or train is INVALID:
            return
        tokens = data.get("text", "tokens")
        longest = _largest(tokens) if tokens is not None else None
        if longest is not None and longest > train.seq_len:
            by_clamp = tokens.high is not None and longest == tokens.high
            ctx.warning("DT503", f"text.tokens reaches {longest:g} but seq_len is "
                        f"{train.seq_len}: longer samples will be truncated", tokens.span,
                        notes=[f"the {'clamp' if by_clamp else 'distribution'} allows "
                               f"{longest:g} text tokens in one sample"],
                        hint=f"clamp text.tokens at {train.seq_len} or raise seq_len to "
                        f"{math.ceil(longest)}")


    def _attention_reach(self, module: ir.Module, train: ir.Train) -> None:
        """A backbone whose attention differs beyond some length (a sliding window, NTK
        rope scaling past the trained positions) trains only sequences within it."""
        arch = module.arch
        if not isinstance(arch, ir.TransformerArch) or module.role != "backbone":
            return
        limits = []
        if arch.sliding_window is not None:
            limits.append((arch.sliding_window, "its sliding attention window"))
        if arch.rope.scaling == "dynamic" and arch.rope.max_positions is not None:
            limits.append((arch.rope.max_positions, "the positions its dynamic rope scaling "
                                                    "leaves unscaled"))
        for limit, what in limits:
            if train.seq_len > limit:
                self.ctx.error("DT313", f"seq_len {train.seq_len} is longer than {what} "
                               f"({limit} tokens) of backbone {module.name}", train.span,
                               hint=f"set seq_len to at most {limit}")


_EXAMPLES = {
    "tokens": "lognormal(median=256, sigma=0.8) clamp [16, 2048]",
    "count": "zipf(a=1.6) clamp [0, 8]",
    "gen_count": "choice([0, 1], p=[0.7, 0.3])",
    "patches": "choice([256, 1024], p=[0.7, 0.3])",
    "frames": "uniform(100, 1500)",
}


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


def _shown(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _parse_samples(raw: bytes, suffix: str, key: str) -> tuple[float, ...]:
    """Measured values from JSON (a list, or an object of lists by quantity) or text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    stripped = text.lstrip()
    if suffix == ".json" or stripped.startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON at line {err.lineno}: {err.msg}") from None
        if isinstance(doc, dict):
            if key not in doc:
                raise ValueError(f"no key '{key}' (keys: {', '.join(list(doc)[:10])})")
            doc = doc[key]
            if isinstance(doc, dict) and "values" in doc:
                doc = doc["values"]
        if not isinstance(doc, list):
            raise ValueError("expected a list of numbers")
        items = doc
    else:
        items = [line.split("#")[0].strip() for line in text.splitlines()]
        items = [i for i in items if i]
    if not items:
        raise ValueError("no values")
    if len(items) > MAX_EMPIRICAL_VALUES:
        raise ValueError(f"{len(items):,} values; at most {MAX_EMPIRICAL_VALUES:,}")
    values = []
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (int, float, str)):
            raise ValueError(f"value {i + 1} is not a number")
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"value {i + 1} ({str(item)[:20]!r}) is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"value {i + 1} ({value:g}) is not a finite count >= 0")
        values.append(value)
    return tuple(values)


def check(spec: ast.Spec, source: Source, *, base_dir: Path | None = None) -> CheckResult:
    """Resolve a parsed spec into a Program; paths in the spec are relative to ``base_dir``."""
    checker = _Checker(spec, source, base_dir or Path.cwd())
    program = checker.run()
    return CheckResult(program=program, diagnostics=tuple(checker.ctx.diagnostics))
