"""The stage graph: what runs where and how much data flows between, per sample.

``build_graph`` turns a Program (and optionally a Plan) into a networkx ``DiGraph``.
It is a DAG, not a chain: any number of encoders feed the backbone and any number
of generators hang off it. Node ids are strings:

- ``data`` (kind ``"data"``): the data source, attrs ``name``, ``source``.
- a module's name (kind ``"module"``): ``role``, ``modality``, ``arch`` (the
  architecture's kind), ``layers`` (what pipeline parallelism splits), ``params``,
  ``frozen``; with a plan also its unit's ``gpus``, ``tp``, ``dp``, ``pp``, ``vpp``.
- a projector's name, e.g. ``vit_to_llm`` (kind ``"projector"``): ``source``,
  ``target``, ``depth``, ``in_dim``, ``out_dim``, ``params``, ``frozen``, ``unit``
  (the module whose ranks run it: an encoder's projector runs on the encoder, a
  generator's on the generator, as in the cost model); with a plan also ``stage``.
- with a plan, ``<module>.s<i>`` per pipeline stage (kind ``"stage"``): ``module``,
  ``index``, ``layers`` (the plan's split), ``first_layer``, ``gpus`` (tp x dp),
  ``tp``, ``dp``, ``first_rank``. The same names as the schedule's ``llm.s1:F3``.

The names of modules and projectors are identifiers and cannot contain a dot, so a
projector or data node whose name a module already has is renamed ``<name>.<kind>``.

Edges have a ``kind``:

- ``"input"``: ``data`` -> module, what the preprocessing workers ship per sample:
  text token ids to the backbone (int64), patches to an encoder (bf16 pixels, width
  channels x patch^2), and to a generator the latents of the items it learns to
  produce (bf16, width the latent channels; a DiT's patches).
- ``"activation"``: encoder -> projector -> backbone -> projector -> generator,
  the hidden states crossing between units (bf16, width the sender's hidden size).
  A generator's projector carries 77 conditioning tokens per generated item.
- ``"pipeline"`` (plan only): stage i -> stage i+1 of a module, what crosses a
  pipeline boundary: transformer hidden states; for a U-Net its hidden state, the
  skip connections still to be consumed, the timestep embedding and the
  conditioning; for a DiT its hidden state and the conditioning.
- ``"contains"`` (plan only): module -> each of its stages; carries no data. A
  module's stages are its ``contains`` successors (DOT draws them as a cluster).

Data-carrying edges have ``what`` (``"text"``, a modality, ``"image.gen"``,
``"hidden"``, ``"cond"``, ``"boundary"``), ``width`` (elements per token, or
None), ``elem_bytes``, and per-sample statistics over ``samples`` synthetic samples
drawn from the data block (``draw_samples``): ``items_mean``/``items_p99`` (None
where the edge is not counted in items), ``tokens_mean``/``tokens_p99`` (None where
tokens mean nothing, a U-Net's boundary), ``bytes_mean``/``bytes_p99``. Means
include samples that carry no such item; the 99th percentile shows the tail that
memory and reordering must handle. The backbone's pipeline edges count text plus
every encoder's tokens per sample, before packing into ``seq_len`` sequences.

``graph_text`` is the text form (``--emit graph``) and ``graph_dot`` writes
Graphviz DOT (``dtc graph SPEC --dot``); both are deterministic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import networkx as nx
import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.samples import SampleSet, draw_samples, item_key
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan

__all__ = ["EDGE_KINDS", "NODE_KINDS", "build_graph", "graph_dot", "graph_text"]

NODE_KINDS = ("data", "module", "projector", "stage")
EDGE_KINDS = ("input", "activation", "pipeline", "contains")

_BF16_BYTES = 2
_TOKEN_ID_BYTES = 8   # int64 ids, what the backbone's embedding takes
_QUANTILE = 0.99


# ---- building ----------------------------------------------------------------------------

def build_graph(program: ir.Program, plan: Plan | None = None, *, samples: int = 4096,
                seed: int = 0) -> nx.DiGraph:
    """The stage graph of ``program``, with the stages of ``plan`` if one is given.

    Edge sizes are statistics over ``samples`` samples drawn with ``seed``. Raises
    ValueError if ``plan`` does not describe this program's modules, or if the graph
    has a cycle (the checker rejects cyclic specs; this is a safety net)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, not {samples}")
    drawn = draw_samples(program, samples, seed)
    g = nx.DiGraph(spec=program.name, samples=samples, seed=seed,
                   plan=plan.search if plan is not None else None)
    taken = {m.name for m in program.modules}
    data_id = _fresh("data", "data", taken)
    g.add_node(data_id, kind="data", name=program.data.name, source=program.data.source)

    if plan is not None:
        _check_plan(program, plan)
    for module in program.modules:
        g.add_node(module.name, kind="module", role=module.role, modality=module.modality,
                   arch=module.arch.kind, layers=module.arch.pipeline_layers,
                   params=float(flops.module_params(module)), frozen=module.frozen)
        if plan is not None:
            _add_stage_nodes(g, module, plan)
    proj_ids = {}
    for proj in program.projectors:
        proj_ids[proj.name] = _fresh(proj.name, "projector", taken)
        unit = proj.source if program.module(proj.source).role == "encoder" else proj.target
        g.add_node(proj_ids[proj.name], kind="projector", source=proj.source,
                   target=proj.target, depth=proj.arch.depth, in_dim=proj.arch.in_dim,
                   out_dim=proj.arch.out_dim, params=float(flops.projector_params(proj.arch)
                                                      + flops.compression_params(proj)),
                   frozen=proj.frozen, unit=unit)

    _add_inputs(g, program, drawn, data_id)
    _add_activations(g, program, drawn, proj_ids)
    if plan is not None:
        _add_stage_edges(g, program, plan, drawn, proj_ids)

    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        raise ValueError(f"the stage graph of {program.name} has a cycle: {path}")
    return g


def _fresh(name: str, kind: str, taken: set[str]) -> str:
    node_id = name if name not in taken else f"{name}.{kind}"
    taken.add(node_id)
    return node_id


def _flow(kind: str, what: str, *, bytes_per_sample: np.ndarray, width: int | None,
          elem_bytes: int, tokens: np.ndarray | None = None,
          items: np.ndarray | None = None) -> dict:
    """Edge attributes: per-sample mean and 99th percentile of what crosses."""

    def stats(values: np.ndarray | None) -> tuple[float | None, float | None]:
        if values is None:
            return None, None
        values = np.asarray(values, dtype=float)
        return float(values.mean()), float(np.quantile(values, _QUANTILE))

    items_mean, items_p99 = stats(items)
    tokens_mean, tokens_p99 = stats(tokens)
    bytes_mean, bytes_p99 = stats(bytes_per_sample)
    return {"kind": kind, "what": what, "width": width, "elem_bytes": elem_bytes,
            "items_mean": items_mean, "items_p99": items_p99,
            "tokens_mean": tokens_mean, "tokens_p99": tokens_p99,
            "bytes_mean": bytes_mean, "bytes_p99": bytes_p99}


def _tokens_flow(kind: str, what: str, tokens: np.ndarray, width: int, elem_bytes: int,
                 items: np.ndarray | None = None) -> dict:
    tokens = np.asarray(tokens, dtype=float)
    return _flow(kind, what, bytes_per_sample=tokens * width * elem_bytes, width=width,
                 elem_bytes=elem_bytes, tokens=tokens, items=items)


def _latent_item(arch: ir.UNetArch | ir.DiTArch) -> tuple[int, int]:
    """(tokens, width) of one generated item's latent as the generator reads it."""
    if isinstance(arch, ir.UNetArch):
        return arch.latent ** 2, arch.latent_channels
    return flops.dit_tokens(arch), arch.latent_channels * arch.patch ** 2


def _add_inputs(g: nx.DiGraph, program: ir.Program, drawn: SampleSet, data_id: str) -> None:
    g.add_edge(data_id, program.backbone.name,
               **_tokens_flow("input", "text", drawn.text_tokens, 1, _TOKEN_ID_BYTES))
    for module in program.modules:
        arch = module.arch
        if module.role == "encoder":
            items = drawn.items[item_key(program, module)]
            width = arch.patch_dim
            g.add_edge(data_id, module.name, **_tokens_flow(
                "input", module.modality, items.tokens(), width, _BF16_BYTES,
                items=items.counts))
        elif module.role == "generator":
            counts = drawn.items[f"{module.modality}.gen"].counts
            per_item, width = _latent_item(arch)
            g.add_edge(data_id, module.name, **_tokens_flow(
                "input", f"{module.modality}.gen", counts * per_item, width, _BF16_BYTES,
                items=counts))


def _add_activations(g: nx.DiGraph, program: ir.Program, drawn: SampleSet,
                     proj_ids: dict[str, str]) -> None:
    for proj in program.projectors:
        node = proj_ids[proj.name]
        source, target = program.module(proj.source), program.module(proj.target)
        if source.role == "encoder":
            items = drawn.items[item_key(program, source)]
            # A compressing projector reads the patches and hands on fewer tokens.
            tokens, counts, what = items.tokens(), items.counts, "hidden"
            out = items.backbone_tokens()
        else:
            counts = drawn.items[f"{target.modality}.gen"].counts
            tokens, what = counts * ir.COND_TOKENS, "cond"
            out = tokens
        g.add_edge(source.name, node, **_tokens_flow(
            "activation", what, tokens, source.output_dim, _BF16_BYTES, items=counts))
        g.add_edge(node, target.name, **_tokens_flow(
            "activation", what, out, proj.arch.out_dim, _BF16_BYTES, items=counts))


# ---- stages -----------------------------------------------------------------------------------

def _check_plan(program: ir.Program, plan: Plan) -> None:
    names = [m.name for m in program.modules]
    planned = [u.name for u in plan.units]
    if sorted(names) != sorted(planned):
        raise ValueError(f"the plan of {plan.spec} has units {', '.join(planned)}; "
                         f"{program.name} has modules {', '.join(names)}")
    for module in program.modules:
        unit = plan.unit(module.name)
        layers = module.arch.pipeline_layers
        split = unit.layers_per_stage
        if len(split) != unit.pp or sum(split) != layers or min(split) < 1:
            raise ValueError(f"the plan splits the {layers} layers of {module.name} into "
                             f"{list(split)}, which is not {unit.pp} stages of at least "
                             "one layer each")


def _add_stage_nodes(g: nx.DiGraph, module: ir.Module, plan: Plan) -> None:
    """The module's unit layout, and one node per pipeline stage (inserted right after
    the module so that ties in the topological order keep them together)."""
    unit = plan.unit(module.name)
    g.nodes[module.name].update(gpus=unit.gpus, tp=unit.tp, dp=unit.dp, pp=unit.pp,
                                vpp=unit.vpp)
    per_stage = unit.tp * unit.dp
    first_layer = 0
    for i, layers in enumerate(unit.layers_per_stage):
        g.add_node(f"{module.name}.s{i}", kind="stage", module=module.name, index=i,
                   layers=layers, first_layer=first_layer, gpus=per_stage, tp=unit.tp,
                   dp=unit.dp, first_rank=unit.first_rank + i * per_stage)
        first_layer += layers


def _add_stage_edges(g: nx.DiGraph, program: ir.Program, plan: Plan, drawn: SampleSet,
                     proj_ids: dict[str, str]) -> None:
    for module in program.modules:
        unit = plan.unit(module.name)
        for i in range(unit.pp):
            stage = f"{module.name}.s{i}"
            g.add_edge(module.name, stage, kind="contains")
            if i:
                g.add_edge(f"{module.name}.s{i - 1}", stage, **_boundary_flow(
                    program, module, drawn, g.nodes[stage]["first_layer"]))
    for proj in program.projectors:
        node = g.nodes[proj_ids[proj.name]]
        unit = plan.unit(node["unit"])
        last = unit.pp - 1 if node["unit"] == proj.source else 0
        node["stage"] = f"{node['unit']}.s{last}"


def _boundary_flow(program: ir.Program, module: ir.Module, drawn: SampleSet,
                   layers_before: int) -> dict:
    """What crosses into the stage whose first layer is ``layers_before``."""
    arch = module.arch
    if module.role == "backbone":
        tokens = drawn.text_tokens.astype(float)
        for encoder in program.encoders:
            tokens = tokens + drawn.items[item_key(program, encoder)].backbone_tokens()
        return _tokens_flow("pipeline", "hidden", tokens, arch.hidden, _BF16_BYTES)
    if module.role == "encoder":
        items = drawn.items[item_key(program, module)]
        return _tokens_flow("pipeline", "hidden", items.tokens(), arch.hidden, _BF16_BYTES,
                            items=items.counts)
    counts = drawn.items[f"{module.modality}.gen"].counts.astype(float)
    cond = ir.COND_TOKENS * arch.context_dim
    if isinstance(arch, ir.DiTArch):
        n = flops.dit_tokens(arch)
        per_item = n * arch.hidden + arch.hidden + cond   # hidden, adaLN condition, context
        return _flow("pipeline", "hidden", bytes_per_sample=counts * per_item * _BF16_BYTES,
                     width=arch.hidden, elem_bytes=_BF16_BYTES, tokens=counts * n,
                     items=counts)
    per_item = _unet_boundaries(arch)[layers_before - 1] + 4 * arch.channels + cond
    return _flow("pipeline", "boundary", bytes_per_sample=counts * per_item * _BF16_BYTES,
                 width=None, elem_bytes=_BF16_BYTES, items=counts)


def _unet_boundaries(arch: ir.UNetArch) -> list[float]:
    """Feature-map elements of one item that cross after each pipeline layer but the
    last: the hidden state and the skip connections the up path has yet to consume.

    Mirrors ``flops.unet_ops``: a layer is a down residual block (with its attention
    and the level's downsampling), the middle block, or an up residual block (with
    its attention and upsampling). On the way down the hidden state is itself the
    newest skip, so it is counted once."""
    c0, res = arch.channels, arch.latent
    skips = [(c0, res)]
    out: list[float] = []

    def pending() -> float:
        return float(sum(ch * r * r for ch, r in skips))

    levels = len(arch.mult)
    for level, mult in enumerate(arch.mult):
        for block in range(arch.res_blocks):
            skips.append((c0 * mult, res))
            if block == arch.res_blocks - 1 and level != levels - 1:
                res //= 2
                skips.append((c0 * mult, res))
            out.append(pending())
    ch = c0 * arch.mult[-1]
    out.append(ch * res * res + pending())   # after the middle block
    for level in reversed(range(levels)):
        for i in range(arch.res_blocks + 1):
            skips.pop()
            ch = c0 * arch.mult[level]
            if level and i == arch.res_blocks:
                res *= 2
            out.append(ch * res * res + pending())
    assert not skips and len(out) == arch.pipeline_layers, (skips, len(out))
    return out[:-1]


# ---- text form ----------------------------------------------------------------------------------

def _order(g: nx.DiGraph) -> list[str]:
    """Topological order, ties broken by insertion order (program order)."""
    rank = {n: i for i, n in enumerate(g.nodes)}
    return list(nx.lexicographical_topological_sort(g, key=rank.__getitem__))


def _edges(g: nx.DiGraph, order: list[str]) -> list[tuple[str, str, dict]]:
    index = {n: i for i, n in enumerate(order)}
    return sorted(g.edges(data=True), key=lambda e: (index[e[0]], index[e[1]]))


def _si(x: float, unit: str = "") -> str:
    """Three significant digits with a decimal prefix: 1234 -> 1.23k, 9.4e6 bytes -> 9.4 MB."""
    r = float(f"{x:.3g}")
    scale, prefix = next(((s, p) for s, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
                          if abs(r) >= s), (1.0, ""))
    num = f"{r / scale:.3g}"
    return f"{num} {prefix}{unit}" if unit else f"{num}{prefix}"


_BARE = re.compile(r"[A-Za-z0-9_.+\-]+\Z")


def _value(key: str, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if key == "params":
        return _si(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str) and _BARE.match(value):
        return value
    return json.dumps(value) if isinstance(value, str) else str(value)


def _node_attrs(attrs: dict) -> str:
    return " ".join(f"{k}={_value(k, v)}" for k, v in attrs.items()
                    if k != "kind" and v is not None)


def _sizes(e: dict, sep: str = ", ") -> list[str]:
    """The statistics of a data-carrying edge, one phrase each."""
    parts = []
    if e["items_mean"] is not None:
        parts.append(f"{_si(e['items_mean'])} items/sample (p99 {_si(e['items_p99'])})")
    if e["tokens_mean"] is not None:
        parts.append(f"{_si(e['tokens_mean'])} tokens/sample (p99 {_si(e['tokens_p99'])})")
    parts.append(f"{_si(e['bytes_mean'], 'B')}/sample (p99 {_si(e['bytes_p99'], 'B')})")
    return parts


def _describe(e: dict) -> str:
    """``what, width W`` of a data-carrying edge."""
    return e["what"] if e["width"] is None else f"{e['what']}, width {e['width']}"


def graph_text(g: nx.DiGraph) -> str:
    """The text form: a header, one line per node in topological order with its
    attributes, then one line per edge in the same order with its per-sample sizes."""
    order = _order(g)
    edges = _edges(g, order)
    head = f"graph {g.graph.get('spec', '')}: {g.number_of_nodes()} nodes, " \
           f"{g.number_of_edges()} edges, {g.graph.get('samples')} samples " \
           f"(seed {g.graph.get('seed')})"
    if g.graph.get("plan"):
        head += f", {g.graph['plan']} plan"
    lines = [head, "nodes:"]
    width = max((len(n) for n in order), default=0)
    for n in order:
        attrs = g.nodes[n]
        lines.append(f"  {n:<{width}}  {attrs['kind']:<9}  {_node_attrs(attrs)}".rstrip())
    lines.append("edges:")
    for u, v, e in edges:
        if e["kind"] == "contains":
            lines.append(f"  {u} -> {v}: contains")
        else:
            lines.append(f"  {u} -> {v}: {', '.join(_sizes(e))}; {e['kind']} {_describe(e)}")
    return "\n".join(lines) + "\n"


# ---- DOT ---------------------------------------------------------------------------------------

def _quote(s: str) -> str:
    """A DOT double-quoted string; ``\\n`` in ``s`` (a real newline) becomes a line break."""
    escaped = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


_SHAPES = {"data": "cylinder", "module": "box", "projector": "ellipse", "stage": "box"}


def _node_label(n: str, a: dict) -> str:
    kind = a["kind"]
    if kind == "data":
        return "\n".join(x for x in (f"data {a['name']}", a.get("source")) if x)
    if kind == "module":
        head = f"{a['role']} ({a['modality']})" if a["modality"] else a["role"]
        lines = [n, head, f"{a['arch']}, {a['layers']} layers, {_si(a['params'])} params"]
        if "gpus" in a:
            lines.append(f"{a['gpus']} GPUs: tp {a['tp']} dp {a['dp']} pp {a['pp']}"
                         + (f" vpp {a['vpp']}" if a["vpp"] > 1 else ""))
        if a["frozen"]:
            lines.append("frozen")
        return "\n".join(lines)
    if kind == "projector":
        lines = [n, f"mlp depth {a['depth']}: {a['in_dim']} -> {a['out_dim']}",
                 f"{_si(a['params'])} params, on {a.get('stage') or a['unit']}"]
        return "\n".join(lines + (["frozen"] if a["frozen"] else []))
    last = a["first_layer"] + a["layers"] - 1
    return f"{n}\nlayers {a['first_layer']}-{last} ({a['layers']})\n" \
           f"{a['gpus']} GPUs from rank {a['first_rank']}"


def _node_stmt(n: str, a: dict) -> str:
    style = ', style="rounded,filled", fillcolor="#eef3fb"' if a["kind"] == "stage" else ""
    return f"{_quote(n)} [shape={_SHAPES[a['kind']]}, label={_quote(_node_label(n, a))}{style}];"


def _dot_lines(g: nx.DiGraph, order: list[str]) -> Iterator[str]:
    stages = {n: [s for s in g.successors(n) if g.edges[n, s]["kind"] == "contains"]
              for n in order}
    placed: set[str] = set()
    for n in order:
        if n in placed:
            continue
        if stages.get(n):
            yield f"  subgraph {_quote('cluster_' + n)} {{"
            yield f"    label={_quote(n)};"
            yield '    style="dashed";'
            for m in [n, *stages[n]]:
                yield "    " + _node_stmt(m, g.nodes[m])
                placed.add(m)
            yield "  }"
        else:
            yield "  " + _node_stmt(n, g.nodes[n])
            placed.add(n)
    for u, v, e in _edges(g, order):
        if e["kind"] == "contains":
            yield f"  {_quote(u)} -> {_quote(v)} [style=dotted, arrowhead=none];"
        else:
            label = "\n".join(_sizes(e)).replace(" tokens/sample", " tok").replace(
                " items/sample", " items").replace("/sample", "")
            yield f"  {_quote(u)} -> {_quote(v)} [label={_quote(label)}];"


def graph_dot(g: nx.DiGraph) -> str:
    """Graphviz DOT of the graph: a module's stages in a cluster with it, edges
    labelled with their per-sample sizes (mean and 99th percentile)."""
    order = _order(g)
    head = [f"digraph {_quote(str(g.graph.get('spec', 'stages')))} {{",
            "  rankdir=LR;",
            '  node [fontname="Helvetica", fontsize=10];',
            '  edge [fontname="Helvetica", fontsize=9];']
    return "\n".join([*head, *_dot_lines(g, order), "}"]) + "\n"
