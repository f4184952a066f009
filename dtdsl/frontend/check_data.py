"""The checker's data part: a data block's fields, its tokenizer, and every quantity's
distribution (an empirical one's file, and the tokenizer, read through ``frontend.files``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dtdsl.codes import DT201, DT202, DT204, DT205, DT206, DT208, DT501, DT502
from dtdsl.diagnostics import did_you_mean
from dtdsl.frontend import ast
from dtdsl.frontend.schema import (
    INVALID,
    head_span,
    resolve_call,
    resolve_fields,
)
from dtdsl.frontend.tables import (
    _COUNT,
    _UNBOUNDED,
    DATA_FIELDS,
    DISTRIBUTIONS,
    _field,
    _ok,
)
from dtdsl.ir import program as ir
from dtdsl.ir.bounds import QUANTITY_LIMITS, largest, quantity_limit

_EXAMPLES = {
    "tokens": "lognormal(median=256, sigma=0.8) clamp [16, 2048]",
    "count": "zipf(a=1.6) clamp [0, 8]",
    "gen_count": "choice([0, 1], p=[0.7, 0.3])",
    "patches": "choice([256, 1024], p=[0.7, 0.3])",
    "frames": "uniform(100, 1500)",
}


class DataChecks:
    """``_Checker``'s data block (a mixin: ``self.ctx``, ``self.files``)."""

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
                ctx.error(DT205, f"unknown modality '{item.modality}' in data",
                          item.target_span, notes=["modalities: " + ", ".join(ir.QUANTITIES)],
                          hint=f"did you mean '{guess}'?" if guess else None)
                ok = False
                continue
            names = ir.QUANTITIES[item.modality]
            if item.quantity not in names:
                guess = did_you_mean(item.quantity, names)
                ctx.error(DT201, f"unknown quantity '{key}'", item.target_span,
                          notes=[f"{item.modality} samples carry: " +
                                 ", ".join(f"{item.modality}.{n}" for n in names)],
                          hint=f"did you mean '{item.modality}.{guess}'?" if guess else None)
                ok = False
                continue
            if key in seen:
                ctx.error(DT202, f"'{key}' is given two distributions", item.target_span,
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
                ctx.error(DT204, f"{user} needs a distribution for '{key}', which data does "
                          "not give", head,
                          hint=f"add e.g. `{key} ~ {_EXAMPLES[key.split('.')[1]]}`")
        unsure = any(m.modality not in ir.MODALITIES for m in self.declared.values()
                     if m.role != "backbone")
        for key, item in seen.items():
            if key not in needed and not unsure:
                ctx.warning(DT501, f"data describes '{key}', but no module reads it",
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
                       image_folder=str(self.files.path(folder)) if folder is not None else None)

    def _tokenizer(self, fields: Sequence[ast.Field], values: Mapping[str, Any],
                   modules: Mapping[str, Any]) -> Any:
        """The data's tokenizer, resolved by ``self.files`` (the ``tokenizer`` field, else
        the backbone's pretrained folder; None for the hashing tokenizer of synthetic data)."""
        backbone = next((m for m in modules.values()
                         if m is not INVALID and m.role == "backbone"), None)
        field, chat = _field(fields, "tokenizer"), _field(fields, "chat")
        given = field is not None and values["tokenizer"] is not None
        if not given and (backbone is None or backbone.pretrained is None):
            return None     # no file named: synthetic data's hashing tokenizer
        if values["chat"] is INVALID:
            return INVALID  # the chat format's own error says it; no tokenizer to load
        return self.files.tokenizer(self.ctx, values["tokenizer"] if given else None,
                                    field.value.span if given else None, backbone,
                                    values["chat"], chat.value.span if chat is not None else None)

    def _quantity(self, item: ast.Distribution, key: str) -> Any:
        ctx = self.ctx
        expr = item.dist
        if isinstance(expr, ast.Number):  # `image.patches ~ 256` means constant(256)
            expr = ast.Call(func="constant", func_span=expr.span, span=expr.span,
                            args=(ast.Arg(name=None, value=expr, span=expr.span),))
        if not isinstance(expr, ast.Call):
            return ctx.error(DT206, f"'{key}' must follow a distribution such as "
                             "lognormal(median=256, sigma=0.8)", expr.span)
        if expr.func not in DISTRIBUTIONS:
            guess = did_you_mean(expr.func, DISTRIBUTIONS)
            return ctx.error(DT205, f"unknown distribution '{expr.func}'", expr.func_span,
                             notes=["distributions: " + ", ".join(DISTRIBUTIONS)],
                             hint=f"did you mean '{guess}'?" if guess else None)
        params, positional = DISTRIBUTIONS[expr.func]
        args = resolve_call(expr, params, ctx, f"{expr.func}() of {key}", positional)
        low = high = None
        if item.clamp is not None:
            low = _COUNT.convert(item.clamp[0], ctx, f"the lower clamp of {key}")
            high = _COUNT.convert(item.clamp[1], ctx, f"the upper clamp of {key}")
            if _ok(low, high) and low > high:
                ctx.error(DT208, f"clamp [{low:g}, {high:g}] of {key} is empty: the lower "
                          "bound is above the upper", item.clamp[0].span)
                low = INVALID
        if not _ok(*args.values(), low, high):
            return INVALID
        dist = self._dist(expr, args, key)
        if dist is INVALID:
            return INVALID
        if expr.func in _UNBOUNDED and high is None:
            ctx.warning(DT502, f"{key} ~ {expr.func}(...) has no upper bound", expr.span,
                        hint="add `clamp [low, high]` so one sample cannot take over a batch")
        quantity = ir.Quantity(modality=item.modality, name=item.quantity, dist=dist,
                               low=low, high=high, span=item.span)
        top, limit = largest(quantity), quantity_limit(quantity)
        if top is not None and top > limit:
            what = "items" if item.quantity in QUANTITY_LIMITS else "positions"
            return ctx.error(
                DT208, f"{key} reaches {top:,.0f}, more {what} than one sample can have "
                f"({limit:,})", item.clamp[1].span if item.clamp is not None and
                high == top else expr.span,
                hint=f"keep {key} at most {limit:,} (`clamp [low, high]` bounds it)")
        return quantity

    def _dist(self, call: ast.Call, args: dict[str, Any], key: str) -> Any:
        ctx = self.ctx
        func = call.func
        if func == "constant":
            return ir.Constant(value=args["value"])
        if func == "uniform":
            if args["low"] > args["high"]:
                return ctx.error(DT208, f"uniform({args['low']:g}, {args['high']:g}) is "
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
                return ctx.error(DT208, f"choice() has {len(values)} values but "
                                 f"{len(probs)} probabilities", call.arg_span("p"))
            total = math.fsum(probs)
            if abs(total - 1) > 1e-6:
                return ctx.error(DT208, f"the probabilities of choice() sum to {total:g}, "
                                 "not 1", call.arg_span("p"),
                                 hint="scale them so they add up to 1")
            return ir.Choice(values=values, probs=probs)
        return self._empirical(call, args, key)

    def _empirical(self, call: ast.Call, args: dict[str, Any], key: str) -> Any:
        span = call.arg_span("path")
        if call.args and call.args[0].name is None:
            span = call.args[0].span
        return self.files.empirical(self.ctx, args["path"], args["key"], key, span)
