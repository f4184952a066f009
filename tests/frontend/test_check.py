"""The checker: what a good spec resolves to, and the rules it enforces."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir.program import IntDomain, Program
from tests.helpers.checks import (
    BASE,
    GENERATOR,
    diagnostics,
    errors,
    program,
)

ROOT = Path(__file__).resolve().parents[2]







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
    # Values no measurement gives: one diagnostic each, never an internal error.
    for text, words in (("[1" + "0" * 400 + "]", "value 1 is larger than a count can be"),
                        ("[" * 100_000, "nested too deep"),
                        ("[1" + "0" * 5000 + "]", "a number too long")):
        (tmp_path / "stats.json").write_text(text)
        result = run_frontend("t.dt", spec.encode(), base_dir=tmp_path)
        assert [d.code for d in result.diagnostics] == ["DT309"], result.diagnostics
        assert words in result.diagnostics[0].message, result.diagnostics[0].message


def test_int_domain():
    d = IntDomain(values=(1, 2, 4, 8)).intersect(IntDomain(low=2, high=4))
    assert d.values == (2, 4) and 4 in d and 8 not in d and d.smallest == 2
    assert IntDomain(low=3).candidates(5) == (3, 4, 5)
    assert IntDomain(values=(5,)).pinned() == 5 and IntDomain(low=2, high=2).pinned() == 2
    assert IntDomain(low=4, high=2).is_empty()


# ---- regressions from review ------------------------------------------------------------





def test_default_optimizer_is_the_same_as_adamw():
    implicit = program(BASE).train.optimizer
    explicit = program(BASE.replace("seq_len = 512", "seq_len = 512  optimizer = adamw"))
    assert implicit == explicit.train.optimizer
    assert implicit.name == "adamw" and implicit.weight_decay == 0.01


@pytest.mark.parametrize("mult, attn_res", [
    ("[1]", (1,)), ("[1, 2]", (2, 1)), ("[1, 2, 4]", (4, 2, 1)), ("[1, 2, 4, 4]", (4, 2, 1)),
])
def test_unet_default_attn_res_fits_any_number_of_levels(mult, attn_res):
    sd = program(GENERATOR.replace("MULT", mult)).module("sd")
    assert sd.arch.attn_res == attn_res


def test_unet_attn_res_given_is_still_checked():
    spec = GENERATOR.replace("MULT", "[1, 2]").replace("latent=32", "latent=32, attn_res=[4]")
    assert errors(spec) == ["DT305"]


def test_memory_size_alone_replaces_the_default_share():
    p = program(BASE + "constraints { memory(*) <= 76 GB }")
    gpu = p.cluster.gpu.memory_bytes  # 94 GB: 90% would be 84.6 GB, more than the 76 asked
    assert [c.memory_limit_bytes(gpu) for c in p.constraints] == [76 * 10**9] * 2
    p = program(BASE + "constraints { memory(llm) <= 90 GB }")  # above the 90% default
    assert p.constraints_for("llm").memory_limit_bytes(gpu) == 90 * 10**9
    assert p.constraints_for("vit").memory_limit_bytes(gpu) == int(gpu * 0.9)
    p = program(BASE + "constraints { memory(*) <= 50% memory(llm) <= 90 GB }")
    assert p.constraints_for("llm").memory_limit_bytes(gpu) == gpu // 2


def test_memory_size_above_the_gpu_is_one_error():
    found = diagnostics(BASE + "constraints { memory(*) <= 100 GB }")
    assert [(d.code, d.severity.value) for d in found] == [("DT404", "error")]
    assert "100 GB" in found[0].message and "94 GB" in found[0].message


def test_tp_above_the_cluster_says_what_was_asked_and_what_works():
    found = diagnostics(BASE + "constraints { tp(*) == 128 }")
    assert [d.code for d in found] == ["DT402"]
    (d,) = found
    assert "tp(*) == 128" in d.message and "64" in d.message and "none" not in d.message
    assert "tp(*) in {1, 2}" in d.hint
    (d,) = diagnostics(BASE + "constraints { tp(vit) >= 100 }")
    assert d.code == "DT402" and "at least 100" in d.message and "tp(vit) in {1, 2, 4}" in d.hint


def test_contradicting_wildcard_constraints_are_reported_once():
    found = diagnostics(BASE + "constraints { tp(*) in {1, 2} tp(*) >= 4 }")
    assert [d.code for d in found] == ["DT403"]
    assert "tp(*)" in found[0].message


def test_a_link_slower_than_any_network_is_not_believable():
    for field in ("inter_node_bw = 1e-12 Mb/s", "intra_node_bw = 1e-300 GB/s",
                  "host_bw = 0.5 Mb/s"):
        found = diagnostics(BASE.replace("inter_node_bw = 200 Gb/s", field))
        assert [d.code for d in found] == ["DT208"], [d.message for d in found]
    assert not errors(BASE.replace("inter_node_bw = 200 Gb/s", "inter_node_bw = 1 Mb/s"))


def test_a_global_batch_past_any_trained_is_refused_before_planning():
    found = diagnostics(BASE.replace("global_batch = 32", "global_batch = 10M"))
    assert [d.code for d in found] == ["DT208"], [d.message for d in found]
    assert not errors(BASE.replace("global_batch = 32", "global_batch = 64k"))


def test_a_name_of_any_length_is_shown_in_one_short_line():
    from dtdsl.diagnostics import render_text
    from dtdsl.driver import run_frontend as frontend

    text = BASE.replace("train {", "train {\n  " + "x" * 100_000 + " = 1\n", 1)
    result = frontend("long.dt", text.encode())
    shown = render_text(result.diagnostics, result.source, "long.dt")
    assert max(len(line) for line in shown.splitlines()) < 1_200, shown[:300]
    assert "unknown field 'xxx" in shown and "more characters)" in shown


def test_too_long_module_name_is_the_only_error():
    for name in ("llm", "vit"):
        found = diagnostics(BASE.replace(name, "m" * 70))
        assert [d.code for d in found] == ["DT208"], [d.message for d in found]


@pytest.mark.parametrize("old, new, message", [
    ("transformer(layers=4, hidden=64, heads=4, patch=8)",
     "unet(channels=64, mult=[1], res_blocks=1, latent=8)", "an encoder cannot be a unet"),
    ("transformer(layers=8, hidden=128, heads=8, kv_heads=2, vocab=100, swiglu)",
     "dit(layers=2, hidden=64, heads=4, latent=8)", "the backbone cannot be a dit"),
])
def test_role_messages_use_the_right_article(old, new, message):
    (d,) = [d for d in diagnostics(BASE.replace(old, new)) if d.code == "DT306"]
    assert d.message == message
    assert d.notes[0] in ('an encoder is a transformer, or a Hugging Face model: hf("DIR")',
                          'the backbone is a transformer, or a Hugging Face model: hf("DIR")')


def test_data_samples_reach_the_program():
    p = program(BASE.replace("image.patches ~ 64", "image.patches ~ 64\n  samples = 40M"))
    assert p.data.samples == 40_000_000
    assert Program.model_validate_json(p.model_dump_json()) == p
    assert program(BASE).data.samples is None


@pytest.mark.parametrize("tokens, reaches", [
    ("constant(64) clamp [1, 1000]", None),           # the clamp is never reached
    ("constant(600)", 600),
    ("constant(64) clamp [600, 700]", 600),          # clamped up
    ("uniform(16, 1000)", 1000),
    ("uniform(16, 1000) clamp [16, 800]", 800),
    ("choice([64, 2048], p=[1, 0])", None),
    ("choice([64, 2048])", 2048),
    ("lognormal(median=64, sigma=0.5) clamp [8, 1024]", 1024),
    ("lognormal(median=64, sigma=0.5) clamp [8, 512]", None),
    ('empirical("tokens.txt")', 900),
])
def test_dt503_compares_the_largest_sample(tokens, reaches, tmp_path: Path):
    (tmp_path / "tokens.txt").write_text("100\n900\n")
    spec = BASE.replace("lognormal(median=64, sigma=0.5) clamp [8, 256]", tokens)
    found = [d for d in diagnostics(spec, base_dir=tmp_path) if d.code == "DT503"]
    if reaches is None:
        assert not found
    else:
        (d,) = found
        assert d.message.startswith(f"text.tokens reaches {reaches} but seq_len is 512")


# ---- learning-rate schedules --------------------------------------------------------------

def _train(fields: str) -> str:
    return BASE.replace("train { global_batch = 32  micro_batch = 2  seq_len = 512 }",
                        f"train {{ global_batch = 32  micro_batch = 2  seq_len = 512 {fields} }}")


def test_lr_schedule_default_is_constant_without_warmup():
    s = program(BASE).train.lr_schedule
    assert (s.name, s.warmup, s.min_lr) == ("constant", 0, 0.0)
    assert program(_train("lr_schedule = constant")).train.lr_schedule == s
    assert program(_train("lr_schedule = constant()")).train.lr_schedule == s


@pytest.mark.parametrize("fields, expected", [
    ("lr_schedule = cosine(warmup=100, min_lr=1e-5)", ("cosine", 100, 1e-5)),
    ("lr_schedule = linear(warmup=10)", ("linear", 10, 0.0)),
    ("lr_schedule = cosine", ("cosine", 0, 0.0)),
    ("lr_schedule = constant(warmup=1k)", ("constant", 1000, 0.0)),
    # the edges: a warmup of the whole run, a decay that ends at the peak
    ("steps = 50  lr_schedule = linear(warmup=50)", ("linear", 50, 0.0)),
    ("optimizer = adamw(lr=3e-4)  lr_schedule = cosine(min_lr=3e-4)", ("cosine", 0, 3e-4)),
])
def test_lr_schedules_resolve(fields, expected):
    s = program(_train(fields)).train.lr_schedule
    assert (s.name, s.warmup, s.min_lr) == expected


@pytest.mark.parametrize("fields, code, message", [
    ("lr_schedule = cosin(warmup=5)", "DT205", "did you mean 'cosine'?"),
    ("lr_schedule = cosine(warmup=-1)", "DT208", "between 0 and"),
    ("lr_schedule = cosine(warmup=2.5)", "DT206", "whole number"),
    ("steps = 100  lr_schedule = cosine(warmup=101)", "DT208", "train.steps is 100"),
    ("lr_schedule = linear(warmup=1001)", "DT208", "train.steps is 1,000 by default"),
    ("optimizer = adam(lr=1e-4)  lr_schedule = cosine(min_lr=2e-4)", "DT208",
     "lr=0.0001 of adam()"),
    ("lr_schedule = linear(min_lr=2e-4)", "DT208", "above the peak"),    # the default lr
    ("lr_schedule = cosine(min_lr=-1e-5)", "DT208", "between 0 and 10"),
    ("lr_schedule = constant(min_lr=1e-5)", "DT201", "unknown argument 'min_lr'"),
    ("lr_schedule = cosine(100)", "DT206", "name this one"),
    ('lr_schedule = "cosine"', "DT206", "must be a call"),
])
def test_lr_schedule_errors(fields, code, message):
    result = run_frontend("t.dt", _train(fields).encode())
    found = [d for d in result.diagnostics if d.severity.value == "error"]
    assert [d.code for d in found] == [code], [d.message for d in found]
    shown = found[0].message + " " + (found[0].hint or "")
    assert message in shown, shown


def test_lr_schedule_round_trips_through_fmt_and_json():
    from dtdsl.frontend.fmt import format_spec

    text = _train("lr_schedule = cosine(warmup = 100 , min_lr=1e-5,)")
    result = run_frontend("t.dt", text.encode())
    formatted = format_spec(result.spec)
    assert "  lr_schedule  = cosine(warmup=100, min_lr=1e-5)\n" in formatted
    again = run_frontend("t.dt", formatted.encode())
    assert format_spec(again.spec) == formatted
    assert again.program.train.lr_schedule == result.program.train.lr_schedule
    assert Program.model_validate_json(again.program.model_dump_json()) == again.program


def test_train_field_spans_for_later_stages():
    p = program(_train("precision = fp16  schedule = gpipe"))
    assert p.train.precision_span.line == p.train.schedule_span.line
    assert p.train.precision_span.column < p.train.schedule_span.column
    assert program(BASE).train.precision_span is None


def test_checking_a_generator_without_files_does_not_import_torch():
    # dtc check (and every dtc plan) of a spec that names no files stays free of torch's
    # seconds of import: a generator with no VAE and no Hugging Face folder reads nothing.
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\n"
            "from dtdsl.driver import read_spec, run_frontend\n"
            "for name in ('mllm_72b', 'tiny_cpu', 'audio_image'):\n"
            "    path, data = read_spec(f'specs/{name}.dt')\n"
            "    assert run_frontend(path, data).ok, name\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_an_encoder_or_generator_may_need_no_gpu_of_its_own():
    """tiny_cpu on one GPU checks: its ViT and U-Net can share the backbone's GPU
    (co-located); pinned to GPUs of their own they need three."""
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text().replace(
        "gpus          = 4", "gpus          = 1").replace('  source = "data/tiny"\n', "")
    assert "DT402" not in errors(text)
    pinned = text.replace("tp(*) in {1, 2}", "tp(*) in {1, 2}\n  gpus(vit) == 1  gpus(gen) == 1")
    (d,) = [d for d in diagnostics(pinned) if d.code == "DT402"]
    assert "at least 3 GPUs" in d.message
    assert "llm: at least 1" in "\n".join(d.notes)
    deep = text.replace("tp(*) in {1, 2}", "tp(*) in {1, 2}\n  pp(vit) == 2")
    assert "DT402" in errors(deep)


def test_a_backbone_head_of_odd_dimensions_is_dt305_and_an_encoders_is_not():
    # Rotary embeddings turn pairs of a head's dimensions: the backbone's (120 / 8 = 15)
    # cannot be odd; a ViT's heads (sinusoidal positions, 60 / 4 = 15) can.
    backbone = "transformer(layers=8, hidden=128, heads=8, kv_heads=2, vocab=100, swiglu)"
    (d,) = [d for d in diagnostics(BASE.replace(backbone, backbone.replace("128", "120")))
            if d.code == "DT305"]
    assert "15 dimensions (hidden 120 / heads 8), an odd number" in d.message
    assert "e.g. 128" in d.hint and "heads=6" in d.hint       # 120 / 6 = 20, kv_heads 2
    vit = "transformer(layers=4, hidden=64, heads=4, patch=8)"
    assert errors(BASE.replace(vit, vit.replace("64", "60"))) == []


@pytest.mark.parametrize("old, new, where", [
    ("image.gen_count ~ 1", "image.gen_count ~ choice([0, 5000000], p=[0.7, 0.3])",
     "image.gen_count reaches 5,000,000, more items than one sample can have (4,096)"),
    ("image.count   ~ zipf(1.5) clamp [0, 4]", "image.count ~ zipf(1.5) clamp [0, 10000]",
     "image.count reaches 10,000, more items"),
    ("image.patches ~ 64", "image.patches ~ choice([9223372036854775808, 1])",
     "image.patches reaches 9,223,372,036,854,775,808, more positions than one sample "
     "can have (2,147,483,647)"),
    ("image.patches ~ 64", "image.patches ~ uniform(1, 1e12)", "more positions"),
])
def test_a_quantity_no_sample_could_have_is_dt208(old, new, where):
    # A count or size past the bound made the planner allocate one element per drawn
    # item (45 GiB for 5M targets a sample) or overflow int64.
    text = GENERATOR.replace("MULT", "[1]")
    assert old in text
    found = [d for d in diagnostics(text.replace(old, new)) if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT208"] and where in found[0].message, \
        [d.message for d in found]


def test_an_unclamped_count_is_drawn_within_the_bound():
    import numpy as np

    from dtdsl.cost.samples import draw
    from dtdsl.ir.bounds import largest

    p = program(BASE.replace("zipf(1.5) clamp [0, 4]", "zipf(1.01)"))
    q = p.data.get("image", "count")
    assert largest(q) is None
    values = draw(q, 20000, np.random.default_rng(0))
    assert values.max() == 4096 and values.min() >= 0       # the tail, clipped


UNET = "unet(channels=320, mult=MULT, res_blocks=1, latent=32)"


@pytest.mark.parametrize("unet, where", [
    # The middle block attends at the deepest level whatever attn_res lists: 32 channels
    # there made 0 heads of 64, which passed check and failed every rank at build time.
    ("unet(channels=32, mult=[1, 1], res_blocks=1, attn_res=[], latent=32, head_dim=64)",
     "level 1 (the middle block's attention) has 32 channels, not a multiple of head_dim 64"),
    ("unet(channels=32, mult=[2, 3], res_blocks=1, attn_res=[1], latent=32, head_dim=64, "
     "groups=8)", "level 1 (the middle block's attention) has 96 channels"),
    ("unet(channels=64, mult=[2, 3], res_blocks=1, attn_res=[1], latent=32, head_dim=24, "
     "groups=8)", "level 0 has 128 channels, not a multiple of head_dim 24"),
])
def test_every_level_a_u_net_attends_at_fits_its_heads(unet, where):
    text = GENERATOR.replace(UNET, unet)
    assert unet in text
    found = [d for d in diagnostics(text) if d.severity.value == "error"]
    assert [d.code for d in found] == ["DT305"] and where in found[0].message, \
        [d.message for d in found]


def test_a_u_net_whose_middle_block_splits_into_heads_is_accepted():
    text = GENERATOR.replace(UNET, "unet(channels=320, mult=[1, 2], res_blocks=1, "
                                   "attn_res=[], latent=32, head_dim=64)")
    assert program(text).module("sd").arch.level_heads(1) == 10
