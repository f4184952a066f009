"""The checker: what a good spec resolves to, and the rules it enforces."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir.program import IntDomain, Program

ROOT = Path(__file__).resolve().parents[2]

BASE = """
model {
  encoder vit (image) { arch = transformer(layers=4, hidden=64, heads=4, patch=8) }
  backbone llm { arch = transformer(layers=8, hidden=128, heads=8, kv_heads=2, vocab=100, swiglu) }
  projector vit -> llm : mlp()
}
data {
  text.tokens   ~ lognormal(median=64, sigma=0.5) clamp [8, 256]
  image.count   ~ zipf(1.5) clamp [0, 4]
  image.patches ~ 64
}
cluster { gpu = H100(memory = 94 GB)  gpus = 64  inter_node_bw = 200 Gb/s }
train { global_batch = 32  micro_batch = 2  seq_len = 512 }
"""


def program(text: str, **kwargs) -> Program:
    result = run_frontend("t.dt", text.encode(), **kwargs)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def errors(text: str) -> list[str]:
    result = run_frontend("t.dt", text.encode())
    return [d.code for d in result.diagnostics if d.severity.value == "error"]


def test_defaults_units_and_presets():
    p = program(BASE)
    vit, llm = p.modules
    assert (vit.arch.kv_heads, vit.arch.ffn, vit.arch.causal, vit.arch.in_channels) == \
        (4, 256, False, 3)
    assert (llm.arch.kv_heads, llm.arch.causal, llm.arch.swiglu) == (2, True, True)
    proj = p.projectors[0]
    assert (proj.name, proj.arch.in_dim, proj.arch.out_dim, proj.arch.depth) == \
        ("vit_to_llm", 64, 128, 2)
    assert p.cluster.gpu.memory_bytes == 94 * 10**9
    assert p.cluster.gpu.peak_flops == 989e12
    assert p.cluster.inter_node_bw_bytes_per_s == 25e9       # 200 Gb/s
    assert p.cluster.intra_node_bw_bytes_per_s == 450e9      # H100 preset
    assert p.cluster.gpus_per_node == 8
    assert p.train.schedule == "1f1b" and p.train.virtual_stages == 1
    assert p.train.optimizer.zero == 1 and p.train.num_microbatches == 16
    assert p.train.reorder == ("intra", "inter")
    patches = p.data.get("image", "patches")
    assert patches.dist.kind == "constant" and patches.dist.value == 64
    assert p.data.get("image", "count").dist.a == 1.5
    c = p.constraints_for("llm")
    assert c.tp.values == (1, 2)  # kv_heads=2: tp 4 and 8 cannot split the KV heads
    assert c.memory_fraction == 0.9


def test_program_json_round_trips():
    p = program(BASE)
    assert Program.model_validate_json(p.model_dump_json()) == p


def test_shipped_specs_resolve():
    for path in sorted((ROOT / "specs").glob("*.dt")):
        result = run_frontend(str(path), path.read_bytes())
        assert result.ok and not result.diagnostics, (path, result.diagnostics)
    p72 = run_frontend("x", (ROOT / "specs/mllm_72b.dt").read_bytes()).program
    assert p72.cluster.num_gpus == 1172 and p72.backbone.arch.layers == 80
    assert p72.constraints_for("sd").tp.values == (1,)


def test_constraints_combine():
    p = program(BASE + """
constraints {
  tp(*)     in {1, 2, 4, 8}
  tp(vit)   <= 2
  pp(llm)   in 2..4
  gpus(vit) >= 4
  dp(vit)   == 2
  memory(*) <= 80%
  memory(llm) <= 40 GiB
}""")
    vit, llm = p.constraints_for("vit"), p.constraints_for("llm")
    assert vit.tp.values == (1, 2) and vit.dp.pinned() == 2 and vit.gpus.smallest == 4
    assert (llm.pp.low, llm.pp.high) == (2, 4)
    assert llm.memory_limit_bytes(p.cluster.gpu.memory_bytes) == 40 * 2**30
    assert vit.memory_limit_bytes(p.cluster.gpu.memory_bytes) == int(94e9 * 0.8)


@pytest.mark.parametrize("extra, code", [
    ("constraints { tp(vit) in {3} }", "DT401"),
    ("constraints { tp(*) in {1} tp(vit) >= 2 }", "DT403"),
    ("constraints { gpus(vit) == 6 tp(vit) == 4 }", "DT402"),
    ("constraints { gpus(vit) >= 100 }", "DT402"),
    ("constraints { pp(llm) == 16 }", "DT407"),
    ("constraints { dp(llm) == 3 }", "DT406"),
    ("constraints { memory(llm) in {1} }", "DT404"),
    ("constraints { gpus(vit) in 5..4 }", "DT403"),
])
def test_constraint_errors(extra: str, code: str):
    assert code in errors(BASE + extra)


def test_empirical_distribution(tmp_path: Path):
    (tmp_path / "stats.json").write_text('{"image.patches": [256, 1024, 256]}')
    (tmp_path / "tokens.txt").write_text("# measured\n100\n200\n")
    spec = BASE.replace("image.patches ~ 64", 'image.patches ~ empirical("stats.json")')
    spec = spec.replace("lognormal(median=64, sigma=0.5) clamp [8, 256]",
                        'empirical("tokens.txt")')
    p = program(spec, base_dir=tmp_path)
    assert p.data.get("image", "patches").dist.values == (256.0, 1024.0, 256.0)
    assert p.data.get("text", "tokens").dist.values == (100.0, 200.0)


def test_int_domain():
    d = IntDomain(values=(1, 2, 4, 8)).intersect(IntDomain(low=2, high=4))
    assert d.values == (2, 4) and 4 in d and 8 not in d and d.smallest == 2
    assert IntDomain(low=3).candidates(5) == (3, 4, 5)
    assert IntDomain(values=(5,)).pinned() == 5 and IntDomain(low=2, high=2).pinned() == 2
    assert IntDomain(low=4, high=2).is_empty()
