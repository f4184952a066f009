"""The stage graph: nodes and edges of every shipped spec, edge sizes checked by hand,
a DAG that is not a chain, stages from a plan, and the text and DOT forms."""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx
import pytest

from dtdsl.cost.graph import build_graph, graph_dot, graph_text
from dtdsl.driver import read_spec, run_frontend
from dtdsl.ir.plan import Plan, UnitPlan, split_layers
from dtdsl.ir.program import Program

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.dt"))
SAMPLES = 512   # enough for the statistics, small enough to keep the tests fast

# Every distribution a constant, so every edge size can be computed by hand.
CONSTANT = """
spec const
model {
  encoder vit (image) { arch = transformer(layers=2, hidden=64, heads=4, ffn=128, patch=8) }
  backbone llm {
    arch = transformer(layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, swiglu)
  }
  generator gen (image) {
    arch = unet(channels=32, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, head_dim=16,
                context_dim=64, groups=8)
  }
  projector vit -> llm : mlp(depth=2)
  projector llm -> gen : mlp(depth=2)
}
data fixed {
  text.tokens     ~ constant(100)
  image.count     ~ 2
  image.patches   ~ 64
  image.gen_count ~ 1
}
cluster { gpu = H100  gpus = 16 }
train { global_batch = 16  micro_batch = 1  seq_len = 512 }
"""


def compile_text(text: str) -> Program:
    result = run_frontend("const.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def compile_spec(path: Path) -> Program:
    name, data = read_spec(str(path))
    result = run_frontend(name, data)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def make_plan(program: Program, pp: dict[str, int], splits: dict[str, tuple] | None = None,
              tp: int = 1, dp: int = 2) -> Plan:
    """A hand-made plan: every unit at ``tp`` x ``dp``, ``pp`` stages as given (default 1)."""
    units, first = [], 0
    for m in program.modules:
        stages = pp.get(m.name, 1)
        split = (splits or {}).get(m.name) or split_layers(m.arch.pipeline_layers, stages)
        gpus = tp * dp * stages
        units.append(UnitPlan(
            name=m.name, role=m.role, projectors=(), gpus=gpus, tp=tp, dp=dp, pp=stages,
            first_rank=first, layers_per_stage=split, microbatch_share=1.0, fwd_time_s=1.0,
            bwd_time_s=2.0, dp_sync_time_s=0.1, memory_bytes=1e9, memory_limit_bytes=8e10))
        first += gpus
    return Plan(spec=program.name, spec_sha256=program.source_sha256, search="exhaustive",
                num_gpus=first, gpus_used=first, global_batch=16, micro_batch=1,
                num_microbatches=8, schedule="1f1b", iteration_time_s=1.0, warmup_time_s=0.1,
                steady_time_s=0.8, dp_sync_time_s=0.1, model_flops_per_iteration=1e15,
                mfu=0.5, solve_time_s=0.0, candidates=1, convex_solves=0, evaluated=1,
                units=tuple(units))


def kinds(g: nx.DiGraph, kind: str) -> list[str]:
    return [n for n, a in g.nodes(data=True) if a["kind"] == kind]


# ---- shipped specs ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_every_shipped_spec_builds_a_dag(path):
    program = compile_spec(path)
    g = build_graph(program, samples=SAMPLES)
    assert nx.is_directed_acyclic_graph(g)
    assert kinds(g, "data") == ["data"]
    assert sorted(kinds(g, "module")) == sorted(m.name for m in program.modules)
    assert sorted(kinds(g, "projector")) == sorted(p.name for p in program.projectors)
    # One input edge per module (text to the backbone, items to encoders and generators),
    # two activation edges per projector.
    assert g.number_of_nodes() == 1 + len(program.modules) + len(program.projectors)
    assert g.number_of_edges() == len(program.modules) + 2 * len(program.projectors)
    assert sorted(g.successors("data")) == sorted(m.name for m in program.modules)
    for p in program.projectors:
        assert g.has_edge(p.source, p.name) and g.has_edge(p.name, p.target)
    for u, v, e in g.edges(data=True):
        assert e["bytes_mean"] > 0 and e["bytes_p99"] > 0, (u, v)
        assert e["tokens_mean"] > 0 and e["tokens_p99"] >= e["tokens_mean"], (u, v)
    assert all(a["params"] > 0 for _, a in g.nodes(data=True) if a["kind"] != "data")


def test_known_counts():
    g = build_graph(compile_spec(ROOT / "specs" / "mllm_9b.dt"), samples=SAMPLES)
    assert (g.number_of_nodes(), g.number_of_edges()) == (6, 7)
    assert list(nx.topological_sort(g)) == ["data", "vit", "vit_to_llm", "llm", "llm_to_sd",
                                            "sd"]
    g = build_graph(compile_spec(ROOT / "specs" / "audio_image.dt"), samples=SAMPLES)
    assert (g.number_of_nodes(), g.number_of_edges()) == (10, 13)


def test_two_encoders_and_two_generators_make_a_dag_not_a_chain():
    g = build_graph(compile_spec(ROOT / "specs" / "audio_image.dt"), samples=SAMPLES)
    modules_and_projectors = g.subgraph(n for n in g if n != "data")
    assert nx.is_directed_acyclic_graph(modules_and_projectors)
    assert max(d for _, d in modules_and_projectors.in_degree()) == 2     # llm: two encoders
    assert max(d for _, d in modules_and_projectors.out_degree()) == 2    # llm: two generators
    assert nx.dag_longest_path_length(g) < g.number_of_nodes() - 1   # a chain's is n - 1
    assert set(g.predecessors("llm")) == {"data", "vit_to_llm", "beats_to_llm"}
    assert set(g.successors("llm")) == {"llm_to_sd", "llm_to_audiogen"}
    assert g.nodes["llm_to_sd"]["unit"] == "sd" and g.nodes["beats_to_llm"]["unit"] == "beats"
    # Each generator is conditioned only on its own items: 77 tokens per generated item.
    sd, audio = g.edges["llm", "llm_to_sd"], g.edges["llm", "llm_to_audiogen"]
    assert sd["tokens_mean"] == pytest.approx(77 * sd["items_mean"])
    assert audio["tokens_mean"] == pytest.approx(77 * audio["items_mean"])
    assert sd["items_mean"] != audio["items_mean"]


# ---- sizes by hand ---------------------------------------------------------------------------

def test_edge_sizes_match_a_hand_computation():
    g = build_graph(compile_text(CONSTANT), samples=64)
    expected = {
        # (items, tokens, width, bytes per sample)
        ("data", "vit"): (2, 2 * 64, 3 * 8 * 8, 2 * 64 * 192 * 2),      # bf16 pixels
        ("data", "llm"): (None, 100, 1, 100 * 8),                        # int64 token ids
        ("data", "gen"): (1, 8 * 8, 4, 64 * 4 * 2),                      # the item's latent
        ("vit", "vit_to_llm"): (2, 128, 64, 128 * 64 * 2),
        ("vit_to_llm", "llm"): (2, 128, 128, 128 * 128 * 2),
        ("llm", "llm_to_gen"): (1, 77, 128, 77 * 128 * 2),               # conditioning tokens
        ("llm_to_gen", "gen"): (1, 77, 64, 77 * 64 * 2),
    }
    assert set(g.edges) == set(expected)
    for (u, v), (items, tokens, width, nbytes) in expected.items():
        e = g.edges[u, v]
        assert (e["items_mean"], e["tokens_mean"], e["width"], e["bytes_mean"]) == \
            (items, tokens, width, nbytes), (u, v)
        # Constant distributions: the tail is the mean.
        assert (e["items_p99"], e["tokens_p99"], e["bytes_p99"]) == (items, tokens, nbytes)
    assert g.edges["data", "vit"]["kind"] == "input"
    assert g.edges["vit", "vit_to_llm"]["kind"] == "activation"


def test_text_lines_for_constant_spec():
    text = graph_text(build_graph(compile_text(CONSTANT), samples=64))
    assert text.splitlines()[0] == "graph const: 6 nodes, 7 edges, 64 samples (seed 0)"
    assert "  vit -> vit_to_llm: 2 items/sample (p99 2), 128 tokens/sample (p99 128), " \
           "16.4 kB/sample (p99 16.4 kB); activation hidden, width 64" in text
    assert "  data -> llm: 100 tokens/sample (p99 100), 800 B/sample (p99 800 B); " \
           "input text, width 1" in text


def test_skewed_data_has_a_tail():
    g = build_graph(compile_spec(ROOT / "specs" / "mllm_9b.dt"), samples=SAMPLES)
    e = g.edges["vit", "vit_to_llm"]
    assert e["tokens_p99"] > 3 * e["tokens_mean"] > 0
    assert e["bytes_mean"] == pytest.approx(e["tokens_mean"] * 1280 * 2)


# ---- stages from a plan ---------------------------------------------------------------------

def test_plan_adds_stages_with_the_layer_split():
    program = compile_text(CONSTANT)
    plan = make_plan(program, {"llm": 2, "gen": 2, "vit": 1}, splits={"gen": (4, 3)})
    g = build_graph(program, plan, samples=64)
    assert kinds(g, "stage") == ["vit.s0", "llm.s0", "llm.s1", "gen.s0", "gen.s1"]
    assert [g.nodes[s]["layers"] for s in ("llm.s0", "llm.s1", "gen.s0", "gen.s1")] == \
        [2, 2, 4, 3]
    s1 = g.nodes["llm.s1"]
    assert (s1["module"], s1["index"], s1["first_layer"], s1["gpus"], s1["tp"], s1["dp"],
            s1["first_rank"]) == ("llm", 1, 2, 2, 1, 2, 4)
    assert g.nodes["llm"]["pp"] == 2 and g.nodes["llm"]["gpus"] == 4
    assert g.edges["llm", "llm.s0"] == {"kind": "contains"}
    assert [v for _, v, k in g.out_edges("llm", data="kind") if k == "contains"] == \
        ["llm.s0", "llm.s1"]
    # The backbone's stages pass text and image tokens on: 100 + 2 * 64.
    pipe = g.edges["llm.s0", "llm.s1"]
    assert (pipe["kind"], pipe["tokens_mean"], pipe["bytes_mean"]) == \
        ("pipeline", 228, 228 * 128 * 2)
    # The U-Net after 4 of its 7 layers (down, down, middle, up): hidden state 64 x 4 x 4,
    # pending skips 32 x 8 x 8 twice and 32 x 4 x 4; plus the timestep embedding (4 x 32)
    # and the conditioning (77 x 64).
    unet = g.edges["gen.s0", "gen.s1"]
    elements = 64 * 16 + 2 * 32 * 64 + 32 * 16 + 4 * 32 + 77 * 64
    assert (unet["items_mean"], unet["tokens_mean"], unet["bytes_mean"]) == \
        (1, None, elements * 2)
    assert g.nodes["vit_to_llm"]["stage"] == "vit.s0"
    assert g.nodes["llm_to_gen"]["stage"] == "gen.s0"
    assert nx.is_directed_acyclic_graph(g)
    text = graph_text(g)
    assert "  gen.s1" in text and "layers=3 first_layer=4" in text
    assert "  llm -> llm.s1: contains" in text
    order = [line.split()[0] for line in text.split("edges:")[0].splitlines()[2:]]
    assert order.index("llm.s0") == order.index("llm") + 1


def test_plan_for_another_program_is_rejected():
    program = compile_text(CONSTANT)
    other = compile_spec(ROOT / "specs" / "audio_image.dt")
    with pytest.raises(ValueError, match="units"):
        build_graph(program, make_plan(other, {}), samples=16)
    with pytest.raises(ValueError, match="layers of llm"):
        build_graph(program, make_plan(program, {"llm": 2}, splits={"llm": (1, 2)}), samples=16)


def test_cycle_is_rejected():
    program = compile_text(CONSTANT)
    back = program.projectors[0].model_copy(update={"name": "llm_to_vit", "source": "llm",
                                                    "target": "vit"})
    cyclic = program.model_copy(update={"projectors": (*program.projectors, back)})
    with pytest.raises(ValueError, match=r"cycle: .*vit.*llm"):
        build_graph(cyclic, samples=16)


def test_node_named_like_the_data_source_is_kept_apart():
    text = CONSTANT.replace("encoder vit (image)", "encoder data (image)").replace(
        "projector vit -> llm", "projector data -> llm")
    g = build_graph(compile_text(text), samples=16)
    assert g.nodes["data"]["kind"] == "module"
    assert g.nodes["data.data"]["kind"] == "data"
    assert g.has_edge("data.data", "data") and g.has_edge("data", "data_to_llm")


# ---- text and DOT forms ---------------------------------------------------------------------

def test_text_form_is_deterministic():
    program = compile_spec(ROOT / "specs" / "audio_image.dt")
    plan = make_plan(program, {"llm": 4, "vit": 2, "sd": 3})
    a = graph_text(build_graph(program, plan, samples=SAMPLES, seed=3))
    b = graph_text(build_graph(program, plan, samples=SAMPLES, seed=3))
    assert a == b and a.endswith("\n")
    assert a != graph_text(build_graph(program, plan, samples=SAMPLES, seed=4))
    assert graph_dot(build_graph(program, plan, samples=SAMPLES)) == \
        graph_dot(build_graph(program, plan, samples=SAMPLES))
    nodes = a.split("edges:")[0].splitlines()[2:]
    assert len(nodes) == 10 + 4 + 2 + 3 + 1 + 1       # every node, one line each
    assert nodes[0].split()[0] == "data"


_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<arrow>->)|(?P<id>[A-Za-z0-9_.#]+)'
                    r'|(?P<punct>[{}\[\];,=]))')


def _tokens(dot: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(dot.rstrip()):
        m = _TOKEN.match(dot, pos)
        assert m, f"cannot lex DOT at {dot[pos:pos + 40]!r}"
        kind = m.lastgroup
        value = m.group(kind)
        out.append((kind, value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
                    if kind == "str" else value))
        pos = m.end()
    return out


def parse_dot(dot: str) -> tuple[list[str], list[tuple[str, str]], dict[str, list[str]]]:
    """A structural check of our own DOT (no pydot): statements end with ';', braces
    and brackets balance. Returns declared nodes, edges and each cluster's nodes."""
    toks = _tokens(dot)
    assert toks[0] == ("id", "digraph") and toks[-1] == ("punct", "}")
    depth, clusters, stack = 0, {}, []
    nodes, edges = [], []
    i = 0
    while i < len(toks):
        kind, value = toks[i]
        if value == "{" and kind == "punct":
            depth += 1
            i += 1
        elif value == "}" and kind == "punct":
            depth -= 1
            assert depth >= 0
            if stack:
                stack.pop()
            i += 1
        elif kind == "id" and value in ("digraph", "subgraph"):
            assert toks[i + 1][0] == "str" and toks[i + 2] == ("punct", "{")
            if value == "subgraph":
                stack.append(toks[i + 1][1])
                clusters[toks[i + 1][1]] = []
            i += 2
        else:
            # A statement: up to ';', with at most one balanced [...] attribute list.
            j = i
            while toks[j] != ("punct", ";"):
                j += 1
            stmt = toks[i:j]
            if ("punct", "[") in stmt:
                k = stmt.index(("punct", "["))
                assert stmt[-1] == ("punct", "]") and stmt.count(("punct", "]")) == 1
                head = stmt[:k]
            else:
                head = stmt
            default = head[0] in (("id", "node"), ("id", "edge"))   # node [...]; edge [...];
            if default or (len(head) == 3 and head[1] == ("punct", "=")):   # rankdir=LR;
                pass
            elif len(head) == 3 and head[1] == ("arrow", "->"):
                assert head[0][0] == head[2][0] == "str"
                edges.append((head[0][1], head[2][1]))
            else:
                assert len(head) == 1 and head[0][0] == "str", stmt
                nodes.append(head[0][1])
                if stack:
                    clusters[stack[-1]].append(head[0][1])
            i = j + 1
    assert depth == 0
    return nodes, edges, clusters


def test_dot_is_structurally_valid():
    program = compile_text(CONSTANT)
    g = build_graph(program, samples=16)
    dot = graph_dot(g)
    nodes, edges, clusters = parse_dot(dot)
    assert sorted(nodes) == sorted(g.nodes) and len(nodes) == len(set(nodes))
    assert sorted(edges) == sorted(g.edges)
    assert clusters == {}
    assert '"vit" -> "vit_to_llm" [label="2 items (p99 2)\\n128 tok (p99 128)\\n' in dot


def test_dot_with_plan_has_clusters_of_stages():
    program = compile_spec(ROOT / "specs" / "audio_image.dt")
    g = build_graph(program, make_plan(program, {"llm": 4, "sd": 2}), samples=SAMPLES)
    nodes, edges, clusters = parse_dot(graph_dot(g))
    assert set(nodes) == set(g.nodes) and len(nodes) == len(set(nodes))
    assert sorted(edges) == sorted(g.edges)
    assert clusters["cluster_llm"] == ["llm", "llm.s0", "llm.s1", "llm.s2", "llm.s3"]
    assert clusters["cluster_vit"] == ["vit", "vit.s0"]
    assert len(clusters) == len(program.modules)


def test_dot_escapes_quotes_and_backslashes():
    program = compile_text(
        CONSTANT.replace("data fixed {", 'data fixed {\n  source = "a\\"b\\\\c"'))
    assert program.data.source == 'a"b\\c'
    g = build_graph(program, samples=16)
    dot = graph_dot(g)
    assert r'label="data fixed\na\"b\\c"' in dot
    nodes, _, _ = parse_dot(dot)
    assert "data" in nodes
    assert 'source="a\\"b\\\\c"' in graph_text(g)
