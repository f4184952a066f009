"""Constraints: what the planner may choose for each module, checked up front.

``tp(vit) in {1, 2, 4}``, ``pp(llm) == 8``, ``cp(llm) in {1, 2, 4}``, ``ep(llm) in {1, 2}``,
``gpus(vit) >= 16``, ``memory(*) <= 90%``.
Each module gets one ``ModuleConstraints``: the intersection of the wildcard
and the module's own constraints, with defaults where nothing is said (TP from
{1, 2, 4, 8}, context parallelism 1, 90% of GPU memory). Here too are the checks Megatron-LM users
otherwise meet at launch time: a TP degree that cannot split a module's heads,
pinned layouts whose GPU counts cannot be tiled, or constraints that need more
GPUs than the cluster has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtdsl.codes import (
    DT203,
    DT205,
    DT206,
    DT401,
    DT402,
    DT403,
    DT404,
    DT406,
    DT407,
    DT620,
    DT621,
    DT643,
    DT644,
    DT645,
)
from dtdsl.diagnostics import did_you_mean
from dtdsl.frontend import ast
from dtdsl.frontend.fmt import expr_text
from dtdsl.frontend.schema import (
    INVALID,
    Ctx,
    FractionKind,
    IntKind,
    QuantityKind,
    describe_expr,
)
from dtdsl.ir.plan import cp_conflict
from dtdsl.ir.program import Cluster, IntDomain, Module, ModuleConstraints, Train
from dtdsl.source import Span

__all__ = ["AXES", "DEFAULT_CP", "DEFAULT_EP", "DEFAULT_MEMORY_FRACTION", "DEFAULT_TP",
           "resolve_constraints"]

AXES = ("tp", "dp", "pp", "cp", "ep", "gpus", "memory")
DEFAULT_TP = (1, 2, 4, 8)
# Context parallelism only where a constraint asks for it: the runtime's attention is
# whole-sequence by default, and every shipped spec plans without it.
DEFAULT_CP = (1,)
# Expert parallelism likewise: the shipped specs' plans stay as they were.
DEFAULT_EP = (1,)
DEFAULT_MEMORY_FRACTION = 0.9
_MAX_DEGREE = 1_000_000
_DEGREE = IntKind(1, _MAX_DEGREE)


@dataclass(frozen=True)
class _Rule:
    axis: str
    target: str
    domain: IntDomain | None   # tp/dp/pp/cp/ep/gpus
    fraction: float | None     # memory as a share of the GPU
    mem_bytes: int | None      # memory as a size
    explicit_values: bool      # a set or a pin: every value was named by the user
    node: ast.Constraint


def _domain(c: ast.Constraint, ctx: Ctx) -> tuple[IntDomain, bool] | Any:
    what = f"{c.axis}({c.target})"
    value = c.value
    if c.op == "in":
        if isinstance(value, (ast.SetExpr, ast.ListExpr)):
            items = [_DEGREE.convert(v, ctx, f"each value of {what}") for v in value.items]
            if any(v is INVALID for v in items):
                return INVALID
            if not items:
                return ctx.error(DT403, f"{what} in {{}} allows no value", value.span)
            return IntDomain(values=tuple(sorted(set(items)))), True
        if isinstance(value, ast.Range):
            low = _DEGREE.convert(value.low, ctx, f"the low end of {what}")
            high = _DEGREE.convert(value.high, ctx, f"the high end of {what}")
            if low is INVALID or high is INVALID:
                return INVALID
            if low > high:
                return ctx.error(DT403, f"{what} in {low}..{high} is empty", value.span,
                                 hint=f"write {high}..{low}")
            return IntDomain(low=low, high=high), False
        return ctx.error(DT206, f"{what} in ... needs a set such as {{1, 2, 4}}, a list or "
                         f"a range such as 1..8, not {describe_expr(value)}", value.span)
    if isinstance(value, (ast.SetExpr, ast.ListExpr, ast.Range)):
        return ctx.error(DT206, f"{what} {c.op} ... compares with one number; use 'in' for "
                         f"{describe_expr(value)}", value.span,
                         hint=f"write `{what} in ...`")
    n = _DEGREE.convert(value, ctx, what)
    if n is INVALID:
        return INVALID
    if c.op == "==":
        return IntDomain(values=(n,)), True
    if c.op == "<=":
        return IntDomain(high=n), False
    if c.op == "<":
        if n <= 1:
            return ctx.error(DT403, f"{what} < {n} allows no value", value.span)
        return IntDomain(high=n - 1), False
    if c.op == ">=":
        return IntDomain(low=n), False
    return IntDomain(low=n + 1), False  # ">"


def _rule(c: ast.Constraint, modules: Mapping[str, Module], declared: set[str],
          ctx: Ctx) -> _Rule | None:
    if c.axis not in AXES:
        guess = did_you_mean(c.axis, AXES)
        ctx.error(DT205, f"unknown constraint '{c.axis}'", c.axis_span,
                  notes=["constraints: tp, dp, pp, cp, ep, gpus (per module or *) and memory"],
                  hint=f"did you mean '{guess}'?" if guess else None)
        return None
    if c.target != "*" and c.target in declared and c.target not in modules:
        return None  # the module itself has errors, already reported
    if c.target != "*" and c.target not in modules:
        guess = did_you_mean(c.target, declared)
        ctx.error(DT203, f"'{c.target}' in {c.axis}({c.target}) is not a module",
                  c.target_span, notes=["modules: " + (", ".join(modules) or "none")],
                  hint=f"did you mean '{guess}'?" if guess else "use * for every module")
        return None
    if c.axis == "memory":
        if c.op not in ("<=", "<"):
            ctx.error(DT404, f"memory({c.target}) takes an upper bound: "
                      f"`memory({c.target}) <= 90%` or `<= 70 GiB`", c.span)
            return None
        if isinstance(c.value, ast.Number) and c.value.unit in ("%", None):
            frac = FractionKind().convert(c.value, ctx, f"memory({c.target})")
            return None if frac is INVALID else _Rule(c.axis, c.target, None, frac, None,
                                                      False, c)
        size = QuantityKind(dim="size", low=0, high=2**50).convert(
            c.value, ctx, f"memory({c.target})")
        return None if size is INVALID else _Rule(c.axis, c.target, None, None, int(size),
                                                  False, c)
    result = _domain(c, ctx)
    if result is INVALID:
        return None
    domain, explicit = result
    return _Rule(c.axis, c.target, domain, None, None, explicit, c)


def _rule_text(r: _Rule) -> str:
    """A constraint as written: ``tp(*) == 128``."""
    return f"{r.axis}({r.target}) {r.node.op} {expr_text(r.node.value)}"


def _where(rules: Sequence[_Rule]) -> str:
    return ", ".join(f"{r.axis}({r.target}) at line {r.node.span.line}" for r in rules)


def _divisor_hint(module: Module, upper: int) -> str:
    good = [t for t in range(1, min(upper, 1024) + 1) if not module.arch.tp_conflicts(t)]
    return ", ".join(map(str, good[:10])) or "1"


class _Resolver:
    def __init__(self, modules: Mapping[str, Module], cluster: Cluster, train: Any,
                 gpus_span: Span | None, ctx: Ctx) -> None:
        self.modules = modules
        self.cluster = cluster
        self.train = train
        self.gpus_span = gpus_span
        self.ctx = ctx
        # Problems that come from `*` constraints alone are the same for every module:
        # each is reported once, keyed by the rules that cause it.
        self._reported: set[tuple] = set()

    def _once(self, key: tuple) -> bool:
        """True the first time ``key`` is seen."""
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    def run(self, rules: Sequence[_Rule]) -> tuple[ModuleConstraints, ...] | Any:
        memory_ok = self._memory_sizes(rules)
        result = []
        for module in self.modules.values():
            mine = [r for r in rules if r.target in ("*", module.name)]
            result.append(self._module(module, mine))
        # Even with some modules in error, the rest may already need more than the cluster.
        self._fits_cluster([c for c in result if c is not INVALID])
        if any(c is INVALID for c in result) or not memory_ok:
            return INVALID
        return tuple(result)

    def _memory_sizes(self, rules: Sequence[_Rule]) -> bool:
        """A memory size is a limit the GPU must be able to give: once per constraint."""
        gpu = self.cluster.gpu
        ok = True
        for r in rules:
            if r.mem_bytes is not None and r.mem_bytes > gpu.memory_bytes:
                ok = False
                self.ctx.error(
                    DT404, f"{_rule_text(r)} is more than the GPU's memory "
                    f"({gpu.name}: {_size_text(gpu.memory_bytes)})", r.node.value.span,
                    notes=[("an explicit size replaces the default share of "
                            f"{DEFAULT_MEMORY_FRACTION:.0%}, so it must fit on the GPU")],
                    hint=f"write at most {gpu.memory_bytes / 1e9:g} GB, or a share such as "
                    f"`memory({r.target}) <= 95%`")
        return ok

    def _axis(self, module: Module, axis: str, rules: Sequence[_Rule],
              default: IntDomain) -> IntDomain | Any:
        mine = [r for r in rules if r.axis == axis]
        if not mine:
            return default
        domain = IntDomain()
        for r in mine:
            domain = domain.intersect(r.domain)
        if domain.is_empty():
            target = "*" if all(r.target == "*" for r in mine) else module.name
            if self._once((DT403, axis, tuple(map(id, mine)))):
                self.ctx.error(
                    DT403, f"the constraints on {axis}({target}) allow no value",
                    mine[-1].node.span, notes=[f"together: {_where(mine)}"],
                    hint="loosen one of them")
            return INVALID
        return domain

    def _module(self, module: Module, rules: Sequence[_Rule]) -> ModuleConstraints | Any:
        ctx = self.ctx
        tp = self._axis(module, "tp", rules, IntDomain(values=DEFAULT_TP))
        dp = self._axis(module, "dp", rules, IntDomain())
        pp = self._axis(module, "pp", rules, IntDomain())
        gpus = self._axis(module, "gpus", rules, IntDomain())
        cp = self._axis(module, "cp", rules, IntDomain(values=DEFAULT_CP))
        ep = self._axis(module, "ep", rules, IntDomain(values=DEFAULT_EP))
        if any(d is INVALID for d in (tp, dp, pp, cp, ep, gpus)):
            return INVALID
        tp = self._tp(module, tp, [r for r in rules if r.axis == "tp"])
        if tp is INVALID:
            return INVALID
        cp = self._cp(module, tp, cp, [r for r in rules if r.axis == "cp"])
        if cp is INVALID:
            return INVALID
        ep = _ep_domain(module, ep, dp, [r for r in rules if r.axis == "ep"],
                        min(self.cluster.num_gpus, 1024), self.ctx)
        if ep is INVALID:
            return INVALID

        ok = True
        layers = module.arch.pipeline_layers
        pp_rules = [r for r in rules if r.axis == "pp"]
        if pp.smallest > layers:
            ok = ctx.error(DT407, f"pp({module.name}) needs at least {pp.smallest} pipeline "
                           f"stages, but {module.name} has only {layers} layer"
                           f"{'s' if layers != 1 else ''} to split",
                           pp_rules[-1].node.span if pp_rules else _header(module),
                           hint=f"allow pp <= {layers}")
        if module.arch.kind == "unet" and 1 not in pp.candidates(max(layers, 1)):
            # Its skip connections join every down-level to the up-level at the other end
            # of the network: any cut between stages is crossed by all the levels above it.
            ok = ctx.error(DT407, f"pp({module.name}) allows no single stage, but a U-Net "
                           f"generator runs on one pipeline stage",
                           pp_rules[-1].node.span if pp_rules else _header(module),
                           notes=["a U-Net's skip connections cross every cut between "
                                  "stages; the planner keeps it on one stage"],
                           hint=f"allow pp 1: `pp({module.name}) == 1`, or remove the "
                                "constraint")
        pinned_pp = pp.pinned()
        if pinned_pp and self.train is not INVALID and self.train.schedule == "interleaved":
            chunks = pinned_pp * self.train.virtual_stages
            if layers % chunks:
                ok = ctx.error(
                    DT407, f"interleaved 1F1B with {self.train.virtual_stages} virtual stages "
                    f"splits {module.name} into pp x {self.train.virtual_stages} = {chunks} "
                    f"chunks, which do not divide its {layers} layers",
                    pp_rules[-1].node.span,
                    hint="pin a pp for which pp x virtual_stages divides the layers")

        dp_rules = [r for r in rules if r.axis == "dp"]
        pinned_dp = dp.pinned()
        if module.role == "backbone" and pinned_dp and self.train is not INVALID:
            micro = self.train.num_microbatches
            if micro % pinned_dp:
                good = [d for d in range(1, min(micro, 4096) + 1) if micro % d == 0][-6:]
                ok = ctx.error(
                    DT406, f"dp({module.name}) == {pinned_dp} does not divide the "
                    f"{micro} microbatches of a global batch ({self.train.global_batch} / "
                    f"micro_batch {self.train.micro_batch}); every backbone replica must get "
                    "the same number", dp_rules[-1].node.span,
                    hint=f"use a dp that divides {micro}: e.g. {', '.join(map(str, good))}")

        if not self._tiles(module, tp, pp, dp, gpus, rules, cp) or ok is INVALID:
            return INVALID

        fractions = [r.fraction for r in rules if r.fraction is not None]
        sizes = [r.mem_bytes for r in rules if r.mem_bytes is not None]
        # The default share is only a default: an explicit size alone replaces it.
        fraction = min(fractions) if fractions else 1.0 if sizes else DEFAULT_MEMORY_FRACTION
        return ModuleConstraints(
            module=module.name, tp=tp, dp=dp, pp=pp, gpus=gpus,
            memory_fraction=fraction, memory_bytes=min(sizes) if sizes else None, cp=cp, ep=ep)

    def _cp(self, module: Module, tp: IntDomain, domain: IntDomain,
            rules: Sequence[_Rule]) -> IntDomain | Any:
        """Keep the CP degrees that can split the module at some allowed TP
        (``ir.plan.cp_conflict``); a degree the module's own constraint names that none
        can is an error, one a ``*`` constraint allows is dropped quietly."""
        upper = min(self.cluster.num_gpus, 1024)
        candidates = domain.candidates(upper)
        if not candidates:
            rule = rules[-1]
            return self.ctx.error(
                DT402, f"{_rule_text(rule)} asks for CP groups of at least "
                f"{domain.smallest} GPUs, but the cluster has only {self.cluster.num_gpus}",
                rule.node.span, hint=f"allow cp({module.name}) <= {self.cluster.num_gpus}")
        tps = tp.candidates(upper)
        node = self.cluster.gpus_per_node
        method = module.context_parallel

        def why(c: int) -> str | None:
            reasons = [cp_conflict(module.arch, method, c, t, node) for t in tps]
            return None if any(r is None for r in reasons) else reasons[0]

        bad = {c: why(c) for c in candidates if why(c) is not None}
        good = tuple(c for c in candidates if c not in bad)
        code = DT620 if module.arch.kind == "unet" else DT621
        for rule in rules:
            if rule.target != module.name:
                continue
            named = [c for c in (rule.domain.values or ()) if c in bad] if \
                rule.explicit_values else [c for c in bad if not good]
            for c in named[:1]:
                self.ctx.error(
                    code, f"cp {c} cannot split {module.name} "
                    f"(context_parallel = {method}): {bad[c]}", rule.node.value.span,
                    notes=["context parallelism splits each sequence over cp ranks "
                           "(dtdsl.parallel.cp)"],
                    hint="allow cp 1 only (remove the constraint)" if code == DT620 else
                    f"use context_parallel = ring for {module.name}, or a cp that divides "
                    "its heads" + (f": e.g. {', '.join(map(str, good))}" if good else ""))
                return INVALID
        if not good:
            rule = rules[-1]
            return self.ctx.error(
                code, f"no CP degree allowed for {module.name} can split it: "
                f"{bad[candidates[0]]}", rule.node.span,
                hint=f"allow cp 1: `cp({module.name}) in {{1, ...}}`")
        return IntDomain(values=good)

    def _tp(self, module: Module, domain: IntDomain, rules: Sequence[_Rule]) -> IntDomain | Any:
        """Keep the TP degrees that split the module evenly; explain the ones that do not."""
        ctx = self.ctx
        upper = min(self.cluster.num_gpus, 1024)
        candidates = domain.candidates(upper)
        if not candidates:  # the constraints only allow TP groups larger than the cluster
            return self._tp_too_large(module, domain, rules)
        good = [t for t in candidates if not module.arch.tp_conflicts(t)]
        bad = [t for t in candidates if module.arch.tp_conflicts(t)]
        named = {v for r in rules if r.target == module.name and r.explicit_values
                 for v in r.domain.values or ()}
        hint_values = _divisor_hint(module, min(upper, self.cluster.gpus_per_node))
        explicit = [r for r in rules if r.target == module.name and r.explicit_values]
        for rule in explicit:
            wrong = [t for t in bad if t in (rule.domain.values or ())]
            if wrong:
                ctx.error(DT401, f"tp {_listing_tp(wrong)} cannot split {module.name}: "
                          + "; ".join(f"{' and '.join(module.arch.tp_conflicts(t))} cannot "
                                      f"be split {t} ways" for t in wrong),
                          rule.node.value.span,
                          notes=["tensor parallelism shards heads and FFN columns evenly "
                                 "across the TP group (Megatron-LM fails at launch otherwise)"],
                          hint=f"TP degrees that work for {module.name}: {hint_values}")
        if any(t in named for t in bad):
            return INVALID
        if not good:
            source = f"the constraints ({_where(rules)})" if rules else \
                f"the default candidates {{{', '.join(map(str, DEFAULT_TP))}}}"
            return ctx.error(DT401, f"no TP degree allowed for {module.name} can split it: "
                             f"{source} allow only {_listing_tp(candidates)}",
                             rules[-1].node.span if rules else _header(module),
                             notes=[f"tp {t}: {' and '.join(module.arch.tp_conflicts(t))} not "
                                    f"divisible by {t}" for t in bad[:4]],
                             hint=f"allow one that works: `tp({module.name}) in "
                             f"{{{hint_values}}}`")
        dropped = [t for t in bad if t <= self.cluster.gpus_per_node]
        # The default candidates are a guess, not a request: only say something when they
        # leave no tensor parallelism at all. Values the user wrote are always explained.
        if dropped and (rules or good == [1]):
            ctx.warning(DT401, f"{module.name} cannot use tp {_listing_tp(dropped, 'or')}; the "
                        f"planner will choose from tp {_listing_tp(good)}",
                        rules[-1].node.span if rules else _header(module),
                        notes=[f"tp {t}: {' and '.join(module.arch.tp_conflicts(t))} cannot "
                               f"be split {t} ways" for t in dropped],
                        hint=f"TP degrees that work for {module.name}: {hint_values}; say so "
                        f"with `tp({module.name}) in {{...}}` to silence this")
        return IntDomain(values=tuple(good))

    def _tp_too_large(self, module: Module, domain: IntDomain,
                      rules: Sequence[_Rule]) -> Any:
        if not self._once(("tp-cluster", tuple(map(id, rules)))):
            return INVALID
        cluster = self.cluster
        everyone = all(r.target == "*" for r in rules)
        target = "*" if everyone else module.name
        covered = list(self.modules.values()) if everyone else [module]
        node_size = min(cluster.num_gpus, cluster.gpus_per_node, 1024)
        works = [t for t in range(1, node_size + 1)
                 if not any(m.arch.tp_conflicts(t) for m in covered)] or [1]
        size = f"{domain.smallest}" if domain.pinned() else f"at least {domain.smallest}"
        self.ctx.error(
            DT402, f"{' and '.join(_rule_text(r) for r in rules)} "
            f"{'asks' if len(rules) == 1 else 'ask'} for TP groups of "
            f"{size} GPUs, but the cluster has only {cluster.num_gpus}",
            rules[-1].node.span,
            notes=["a TP group spans tp GPUs, usually within one node "
                   + f"({cluster.gpus_per_node} GPUs here)"] +
            [f"tp that works for {m.name}: {_divisor_hint(m, node_size)}" for m in covered
             if len(covered) > 1],
            hint=f"allow TP degrees the cluster can hold, e.g. `tp({target}) in "
            f"{{{', '.join(map(str, works))}}}`")
        return INVALID

    def _tiles(self, module: Module, tp: IntDomain, pp: IntDomain, dp: IntDomain,
               gpus: IntDomain, rules: Sequence[_Rule], cp: IntDomain) -> bool:
        """A pinned GPU count must be tp x cp x pp x dp for some allowed tp, cp, pp, dp."""
        g = gpus.pinned()
        if g is None:
            return True
        layers = module.arch.pipeline_layers
        tps = [t * c for t in tp.candidates(g) for c in cp.candidates(g)]
        pps = pp.candidates(min(g, layers))
        for t in tps:
            for p in pps:
                if g % (t * p) == 0 and (g // (t * p)) in dp:
                    return True
        rule = next(r for r in reversed(rules) if r.axis == "gpus")
        unit_sizes = sorted({t * p for t in tps for p in pps})[:4] or [1]
        options = sorted({k * s for s in unit_sizes for k in range(1, 64)
                          if (k * s) // s in dp and k * s <= max(2 * g, 8)})[:6]
        self.ctx.error(
            DT402, f"gpus({module.name}) == {g} cannot be tiled by tp x pp x dp with "
            f"{_axis_text('tp', tp)}, {_axis_text('pp', pp)} and {_axis_text('dp', dp)}",
            rule.node.span,
            notes=[f"{module.name}'s GPUs are split into TP groups of tp GPUs, pipelines of pp "
                   "stages and dp replicas: gpus = tp x pp x dp"],
            hint=f"GPU counts that work: {', '.join(map(str, options))}" if options else
            "loosen the tp, pp or dp constraints")
        return False

    def _fits_cluster(self, result: Sequence[ModuleConstraints]) -> None:
        """Together, the modules' smallest layouts must fit in the cluster. An encoder or
        generator may need no GPU of its own: the planner can co-locate it on the
        backbone's first or last stage (``planner.placement``), unless a constraint gives
        it GPUs (a ``gpus`` bound) or more than one stage."""
        need = []
        for c in result:
            smallest = c.tp.smallest * c.cp.smallest * c.pp.smallest * c.dp.smallest
            module = self.modules.get(c.module)
            if module is not None and module.role != "backbone" and c.pp.smallest <= 1 \
                    and c.gpus.values is None and c.gpus.high is None and c.gpus.low <= 1:
                need.append((c.module, 0, c))
                continue
            need.append((c.module, max(smallest, c.gpus.smallest), c))
        total = sum(n for _, n, _ in need)
        if total <= self.cluster.num_gpus:
            return
        notes = []
        for name, n, c in need:
            if n == 0:
                notes.append(f"{name}: none of its own (it can share the backbone's)")
                continue
            why = f"gpus >= {c.gpus.smallest}" if c.gpus.smallest >= n else \
                f"tp {c.tp.smallest} x pp {c.pp.smallest} x dp {c.dp.smallest}"
            notes.append(f"{name}: at least {n} ({why})")
        self.ctx.error(
            DT402, f"the constraints need at least {total} GPUs, but the cluster has "
            f"{self.cluster.num_gpus}", self.gpus_span or Span.point(1, 1), notes=notes,
            hint=f"raise gpus to {total} or loosen the constraints")


def _ep_domain(module: Module, domain: IntDomain, dp: IntDomain, rules: Sequence[_Rule],
               upper: int, ctx: Ctx) -> IntDomain | Any:
    """Keep the EP degrees that split the module's experts and fit in its data-parallel
    ranks (EP groups are carved from them: ep divides dp). A degree the module's own
    constraint names that cannot is an error: on a dense module (DT643), not dividing the
    experts (DT644), dividing no allowed dp (DT645); one a ``*`` constraint allows is
    dropped quietly."""
    moe = getattr(module.arch, "moe", None)
    candidates = domain.candidates(upper)
    dps = dp.candidates(upper)

    def why(e: int) -> tuple[str, str] | None:
        if e == 1:
            return None
        if moe is None:
            return DT643, f"{module.name} is dense: it has no experts to split"
        if moe.ep_conflicts(e):
            return DT644, f"{moe.experts} experts do not split {e} ways"
        if not any(d % e == 0 for d in dps):
            return DT645, (f"EP groups are carved from the data-parallel ranks, and no "
                             f"allowed dp ({dp.describe()}) is a multiple of {e}")
        return None

    bad = {e: why(e) for e in candidates if why(e) is not None}
    good = tuple(e for e in candidates if e not in bad)
    for rule in rules:
        if rule.target != module.name:
            continue
        if rule.explicit_values:
            named = [e for e in (rule.domain.values or ()) if e in bad]
        else:
            named = list(bad) if not good else []
        for e in named[:1]:
            code, reason = bad[e]
            return ctx.error(code, f"ep {e} cannot split {module.name}: {reason}",
                             rule.node.value.span, notes=[
                                 "expert parallelism spreads each MoE layer's experts over ep "
                                 "of the module's data-parallel ranks (dtdsl.parallel.ep)"],
                             hint=_ep_hint(module, moe, code))
    if not good:
        return IntDomain(values=(1,)) if moe is None else ctx.error(
            DT644, f"no EP degree allowed for {module.name} can split it: "
            f"{bad[candidates[0]][1]}" if candidates else
            f"the constraints on ep({module.name}) allow no EP degree of at most {upper}",
            rules[-1].node.span, hint=f"allow ep 1: `ep({module.name}) in {{1, ...}}`")
    return IntDomain(values=good)


def _ep_hint(module: Module, moe: Any, code: str) -> str:
    if code == DT643:
        return f"remove the ep({module.name}) constraint (only an MoE backbone has experts)"
    if code == DT644:
        good = [e for e in range(1, min(moe.experts, 1024) + 1) if moe.experts % e == 0]
        return f"use an ep that divides {moe.experts}: {', '.join(map(str, good[:8]))}"
    return f"allow a dp that ep divides, e.g. `dp({module.name}) in {{...}}` with multiples of it"


def _header(module: Module) -> Span:
    """The ``encoder vit`` part of a module declaration."""
    span = module.span
    width = len(f"{module.role} {module.name}")
    return Span(line=span.line, column=span.column, end_line=span.line,
                end_column=span.column + width)


def _size_text(n_bytes: int) -> str:
    """80 GB, and the GiB when they differ visibly: '80 GB = 74.5 GiB'."""
    gb, gib = n_bytes / 1e9, n_bytes / 2**30
    return f"{gb:g} GB" if abs(gb - gib) < 0.05 else f"{gb:g} GB = {gib:.3g} GiB"


def _axis_text(axis: str, domain: IntDomain) -> str:
    if domain == IntDomain():
        return f"any {axis}"
    return f"{axis} in {domain.describe()}"


def _listing_tp(values: Sequence[int], last: str = "and") -> str:
    values = [str(v) for v in values]
    if len(values) <= 1:
        return "".join(values) or "none"
    return ", ".join(values[:-1]) + f" {last} " + values[-1]


def resolve_constraints(block: ast.ConstraintsBlock | None, modules: Mapping[str, Module],
                        declared: set[str], cluster: Cluster | Any, train: Train | Any,
                        gpus_span: Span | None,
                        ctx: Ctx) -> tuple[ModuleConstraints, ...] | Any:
    """Per-module constraints, checked against the architectures and the cluster."""
    rules = []
    for c in block.constraints if block is not None else ():
        rule = _rule(c, modules, declared, ctx)
        if rule is not None:
            rules.append(rule)
    if cluster is INVALID:
        return INVALID
    return _Resolver(modules, cluster, train, gpus_span, ctx).run(rules)
