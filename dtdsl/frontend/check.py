"""The checker: from an AST to a typed, resolved ``Program``, or every reason why not.

It resolves names (with "did you mean" for near misses), checks structure (one
backbone, projectors that join existing modules in the right direction, no
cycles, every module connected), types, units and ranges, the architecture's
own consistency (hidden divisible by heads, heads by KV heads, ...), the data
distributions, and hands the constraints to ``dtdsl.frontend.constraints`` for
the parallelism checks. All findings are reported, not just the first. It reads
no file: what a spec names on disk it asks of a ``frontend.files.Files``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtdsl.codes import (
    DT202,
    DT203,
    DT204,
    DT205,
    DT206,
    DT208,
    DT301,
    DT302,
    DT303,
    DT304,
    DT305,
    DT306,
    DT310,
    DT312,
    DT313,
    DT318,
    DT501,
    DT503,
    DT504,
    DT612,
    DT613,
)
from dtdsl.diagnostics import Diagnostic, did_you_mean, has_errors
from dtdsl.frontend import ast
from dtdsl.frontend import moe as _moe
from dtdsl.frontend.check_data import DataChecks
from dtdsl.frontend.check_train import TrainChecks
from dtdsl.frontend.constraints import resolve_constraints
from dtdsl.frontend.files import Files
from dtdsl.frontend.schema import (
    INVALID,
    Ctx,
    head_span,
    resolve_call,
    resolve_fields,
)
from dtdsl.frontend.tables import (
    _DEFAULT_ATTN_RES,
    ARCHS,
    COMPRESSIONS,
    MAX_NAME_LENGTH,
    MLP_ARGS,
    MODULE_FIELDS,
    PROJECTOR_FIELDS,
    ROLE_ARCHS,
    _article,
    _divisors,
    _field,
    _largest,
    _listing,
    _ok,
)
from dtdsl.ir import program as ir
from dtdsl.source import Source, Span

__all__ = ["CheckResult", "check"]

@dataclass(frozen=True)
class CheckResult:
    program: ir.Program | None
    diagnostics: tuple[Diagnostic, ...]


class _Checker(DataChecks, TrainChecks):
    def __init__(self, spec: ast.Spec, source: Source, files: Files) -> None:
        self.spec = spec
        self.source = source
        self.files = files
        self.ctx = Ctx()
        self.declared: dict[str, ast.Module] = {}  # every module, valid or not

    # ---- top level -------------------------------------------------------------
    def run(self) -> ir.Program | None:
        ctx = self.ctx
        blocks: dict[str, Any] = {}
        for block in self.spec.blocks:
            if block.kind in blocks:
                ctx.error(DT202, f"a second '{block.kind}' block; a spec has one",
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
                ctx.error(DT204, f"the spec has no '{kind}' block", start,
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
                ctx.error(DT208, f"module name is {len(item.name)} characters long; "
                          f"names are limited to {MAX_NAME_LENGTH}", item.name_span,
                          hint="choose a shorter name")
            if item.name in decls:
                ctx.error(DT202, f"a second module named '{item.name}'", item.name_span,
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
            ctx.error(DT301, "the model has no backbone", head,
                      hint="add one: backbone llm { arch = transformer(layers=32, hidden=4096, "
                      "heads=32, vocab=128256) }")
        for extra in backbones[1:]:
            ctx.error(DT301, f"the model has {len(backbones)} backbones "
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
                ctx.error(DT206, f"the backbone reads text and every projected modality; "
                          f"it takes no modality, but '{modality}' is given",
                          decl.modality_span, hint=f"write `backbone {decl.name} {{`")
                modality = INVALID
        elif modality is None:
            ctx.error(DT204, f"{where} needs a modality", decl.name_span,
                      hint=f"write `{decl.role} {decl.name} (image) {{` "
                      f"(one of {', '.join(ir.MODALITIES)})")
            modality = INVALID
        elif modality not in ir.MODALITIES:
            guess = did_you_mean(modality, ir.MODALITIES)
            ctx.error(DT205, f"unknown modality '{modality}'", decl.modality_span,
                      notes=["modalities: " + ", ".join(ir.MODALITIES)],
                      hint=f"did you mean '{guess}'?" if guess else None)
            modality = INVALID
        arch = source = INVALID
        call, pretrained = fields["arch"], fields["pretrained"]
        if call is None and pretrained is None:
            arch = ctx.error(DT204, f"{where} needs an architecture", decl.name_span,
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
            return ctx.error(DT306, f"only an image generator has a VAE; {decl.role} "
                             f"{decl.name} does not", field.value.span,
                             hint="remove the vae field")
        hf_unet = decl.role == "generator" and source not in (None, INVALID) and \
            source.family == "unet"
        if text is None and not hf_unet:
            return None     # no file named: nothing to resolve
        return self.files.vae(ctx, text, field.value.span if text is not None else None,
                              source, decl.name, decl.name_span,
                              getattr(arch, "latent_channels", None))

    def _arch(self, call: ast.Call, decl: ast.Module, modality: Any) -> Any:
        ctx = self.ctx
        allowed = ROLE_ARCHS[decl.role]
        if call.func not in ARCHS:
            guess = did_you_mean(call.func, ARCHS)
            return ctx.error(DT205, f"unknown architecture '{call.func}'", call.func_span,
                             notes=["architectures: transformer (encoders, backbone), "
                                    "unet and dit (generators)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        if call.func not in allowed:
            return ctx.error(DT306, f"{_article(decl.role)} cannot be a {call.func}",
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

    def _hf_model(self, text: str, feature_layer: int | None, decl: ast.Module, modality: Any,
                  span: Span) -> tuple[Any, Any]:
        """``(architecture, ir.HFSource)`` of the Hugging Face model in directory ``text``
        (``hf("DIR")``, or ``pretrained`` alone), or ``(INVALID, INVALID)``."""
        ctx = self.ctx
        model = self.files.hf_model(ctx, text, decl.role, feature_layer, span)
        if model is INVALID:
            return INVALID, INVALID
        arch, source, notes = model
        # A tower reads what it was trained on: Whisper audio, CLIP and SigLIP images.
        reads = "audio" if source.family == "whisper" else "image"
        if decl.role == "encoder" and modality not in (INVALID, reads):
            tower = "an audio" if reads == "audio" else "a vision"
            ctx.error(DT306, f"{source.family} is {tower} tower; encoder {decl.name} "
                      f"reads {modality}", span, hint=f"write `encoder {decl.name} ({reads}) {{`")
            return INVALID, INVALID
        for note in notes:
            ctx.warning(DT504, note, span)
        return arch, source

    def _pretrained(self, text: str, decl: ast.Module, arch: Any, source: Any) -> Any:
        """The absolute directory of a module's pretrained weights, checked against its
        architecture by ``self.files``."""
        span = _field(decl.fields, "pretrained").value.span
        if source is INVALID or source is None:
            return self.ctx.error(DT312, f"pretrained weights of {decl.role} {decl.name} are "
                                  f"read into a Hugging Face architecture, and {arch.kind}(...) "
                                  "is dtdsl's own", span,
                                  hint=f'write `arch = hf("{text}")`, or leave arch out')
        return self.files.pretrained(self.ctx, text, decl.role, decl.name, arch, source, span)

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
            ctx.error(DT305, f"hidden {hidden} is not divisible by heads {heads}: each head "
                      f"would get {hidden / heads:g} dimensions", call.arg_span("hidden"),
                      hint=f"use hidden={' or '.join(map(str, sizes))}, or heads="
                      f"{' or '.join(map(str, sorted(near)))}")
        elif decl.role == "backbone" and (hidden // heads) % 2:
            ok = False
            even = sorted((h for h in _divisors(hidden, 4096)
                           if (hidden // h) % 2 == 0 and h % kv_heads == 0),
                          key=lambda h: (abs(h - heads), h))
            ctx.error(DT305, f"the backbone's heads have {hidden // heads} dimensions "
                      f"(hidden {hidden} / heads {heads}), an odd number: rotary position "
                      "embeddings turn pairs of a head's dimensions", call.arg_span("hidden"),
                      hint=f"use a hidden that is an even multiple of {heads} (e.g. "
                      f"{(hidden // heads + 1) * heads})" + (f", or heads={even[0]}" if even
                                                             else ""))
        if heads % kv_heads:
            ok = False
            ctx.error(DT305, f"heads {heads} is not a multiple of kv_heads {kv_heads}: "
                      "grouped-query attention shares each KV head among an equal number of "
                      "query heads", call.arg_span("kv_heads"),
                      hint=f"kv_heads must divide {heads}: {_listing(_divisors(heads))}")
        if decl.role == "backbone" and not args["vocab"]:
            ok = False
            ctx.error(DT204, "the backbone's transformer needs a vocabulary size",
                      call.span, hint="add vocab=128256 (Llama 3) or your tokenizer's size")
        if decl.role != "backbone" and args["vocab"]:
            ctx.warning(DT501, f"{decl.role} {decl.name} has a vocabulary, which only the "
                        "backbone uses; it is ignored", call.arg_span("vocab"))
        if modality in ("image", "video") and args["patch"] is None:
            ok = False
            ctx.error(DT204, f"encoder {decl.name} reads {modality}s and needs a patch size",
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
            ctx.error(DT612, f"encoder {decl.name} cuts its {bins}-bin fbank into {patch} x "
                      f"{patch} patches, but {patch} does not divide {bins}",
                      call.arg_span("mel_bins"),
                      hint=f"use mel_bins={' or '.join(map(str, fits[:3]))}, or a patch that "
                           f"divides {bins}")
        if args["temporal_patch"] > 1 and not (decl.role == "encoder" and modality == "video"):
            ok = False
            what = f"{decl.role} {decl.name}" + (f" reads {modality}" if modality else "")
            ctx.error(DT613, f"temporal_patch={args['temporal_patch']} patches frames in "
                      f"time, but {what}; only a video encoder has frames",
                      call.arg_span("temporal_patch"),
                      hint="remove temporal_patch, or read video with this encoder")
        if "mel_bins" in given and not (decl.role == "encoder" and modality == "audio"):
            ctx.warning(DT501, f"{decl.role} {decl.name} has mel_bins, which only an audio "
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
                ctx.error(DT305, f"attn_res {res} is never reached: a U-Net with {levels} "
                          f"levels downsamples by {_listing(reachable)}",
                          call.arg_span("attn_res"),
                          hint="list downsampling factors where attention runs, e.g. "
                          f"[{', '.join(map(str, reversed(reachable[:3])))}]")
        if args["latent"] % (2 ** (levels - 1)):
            ok = False
            ctx.error(DT305, f"latent {args['latent']} cannot be halved {levels - 1} times "
                      f"for a U-Net with {levels} levels", call.arg_span("latent"),
                      hint=f"use a multiple of {2 ** (levels - 1)}, e.g. 64")
        for i, m in enumerate(args["mult"]):
            ch = args["channels"] * m
            if ch % args["groups"]:
                ok = False
                ctx.error(DT305, f"level {i} has {ch} channels, which GroupNorm cannot split "
                          f"into {args['groups']} groups", call.arg_span("channels"),
                          hint="use channels divisible by groups (e.g. channels=320, groups=32)")
            # Attention runs at the attn_res levels and in the middle block, at the
            # deepest level whatever attn_res says.
            middle = i == len(args["mult"]) - 1
            if (2 ** i in args["attn_res"] or middle) and ch % args["head_dim"]:
                ok = False
                where = " (the middle block's attention)" if middle and \
                    2 ** i not in args["attn_res"] else ""
                ctx.error(DT305, f"level {i}{where} has {ch} channels, not a multiple of "
                          f"head_dim {args['head_dim']}", call.arg_span("head_dim"),
                          hint=f"use a head_dim that divides {ch}, e.g. "
                          f"{math.gcd(ch, args['head_dim'])}")
        if not ok:
            return INVALID
        return ir.UNetArch(**args)

    def _dit(self, call, args) -> Any:
        ctx = self.ctx
        ok = True
        if args["hidden"] % args["heads"]:
            ok = False
            ctx.error(DT305, f"hidden {args['hidden']} is not divisible by heads "
                      f"{args['heads']}", call.arg_span("hidden"))
        if args["latent"] % args["patch"]:
            ok = False
            ctx.error(DT305, f"latent {args['latent']} is not divisible by patch "
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
                    ctx.error(DT203, f"projector refers to '{name}', which is not a module",
                              span, notes=["modules: " + (", ".join(decls) or "none")],
                              hint=f"did you mean '{guess}'?" if guess else None)
            if not ok:
                continue
            key = (item.source, item.target)
            if key in edges:
                ctx.error(DT202, f"a second projector {item.source} -> {item.target}",
                          item.span, notes=[f"the first is at line {edges[key].span.line}"])
                continue
            if item.source == item.target:
                ctx.error(DT303, f"projector {item.source} -> {item.target} connects a module "
                          "to itself", item.span)
                continue
            edges[key] = item

        # Cycles first: a cycle makes every edge in it wrong in a way direction cannot explain.
        in_cycle: set[tuple[str, str]] = set()
        for (a, b), item in edges.items():
            if (b, a) in edges and (b, a) not in in_cycle:
                in_cycle |= {(a, b), (b, a)}
                later = max(item, edges[(b, a)], key=lambda p: (p.span.line, p.span.column))
                ctx.error(DT303, f"projectors {a} -> {b} and {b} -> {a} form a cycle",
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
                    ctx.error(DT302, f"projector {a} -> {b} points the wrong way: "
                              f"{'encoders feed' if rb == 'encoder' else 'the backbone feeds'} "
                              f"the {'backbone' if rb == 'encoder' else 'generators'}",
                              item.span, hint=f"write `projector {b} -> {a}`")
                else:
                    ctx.error(DT302, f"projector {a} -> {b} joins {_article(ra)} to "
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
                    ctx.error(DT304, f"encoder {decl.name} feeds nothing", decl.name_span,
                              hint=f"add `projector {decl.name} -> {backbone.name} : "
                              "mlp(depth=2)`")
                if decl.role == "generator" and not any(b == decl.name for _, b in edges):
                    ctx.error(DT304, f"generator {decl.name} is fed by nothing",
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
            return ctx.error(DT205, f"unknown projector architecture '{call.func}'",
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
            return ctx.error(DT205, f"unknown token compression '{call.func}'",
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
            return ctx.error(DT318, f"{call.func}() compresses an image's patch grid, but "
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
                DT318, f"a resampler of {heads} heads cannot split encoder {src.name}'s "
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
            DT318, f"pixel_shuffle({spec.factor}) needs a patch grid divisible by "
            f"{spec.factor}, but encoder {src.name} reads {arch.image_size} x "
            f"{arch.image_size} images in patches of {patch}: a {side} x {side} grid",
            call.args[0].span if call.args else call.span,
            hint=(f"use pixel_shuffle({' or '.join(map(str, fits))})" if fits else
                  "use no pixel shuffle") + f", or avg_pool({spec.factor}), which pools the "
            "edge blocks (ceil mode)")

    # ---- data ----------------------------------------------------------------------------
    def _cross_checks(self, modules, projectors, data, train) -> None:
        ctx = self.ctx
        if modules and all(m.frozen for m in modules.values()) and \
                all(p.frozen for p in projectors) and \
                not has_errors(ctx.diagnostics):
            first = next(iter(modules.values()))
            ctx.error(DT310, "every module and projector is frozen: nothing would be trained",
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
            ctx.warning(DT503, f"text.tokens reaches {longest:g} but seq_len is "
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
                self.ctx.error(DT313, f"seq_len {train.seq_len} is longer than {what} "
                               f"({limit} tokens) of backbone {module.name}", train.span,
                               hint=f"set seq_len to at most {limit}")


def check(spec: ast.Spec, source: Source, *, files: Files) -> CheckResult:
    """Resolve a parsed spec into a Program, the files it names read through ``files``."""
    checker = _Checker(spec, source, files)
    program = checker.run()
    return CheckResult(program=program, diagnostics=tuple(checker.ctx.diagnostics))
