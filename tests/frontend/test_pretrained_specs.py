"""Specs that name Hugging Face models: ``arch = hf("DIR")`` and ``pretrained = "DIR"``, and
the diagnostics of directories that cannot be used (DT311, DT312, DT313, DT504)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from tests.hf_models import make_clip, make_decoder, make_unet

SPEC = """
model {
  encoder vit (image) {
    ENCODER
  }
  backbone llm {
    BACKBONE
  }
  generator gen (image) {
    GENERATOR
  }
  projector vit -> llm : mlp(depth=2)
  projector llm -> gen : mlp(depth=2)
}

data {
  text.tokens     ~ 64
  image.count     ~ 1
  image.patches   ~ 16
  image.gen_count ~ 1
}

cluster {
  gpu  = H100
  gpus = 8
}

train {
  global_batch = 8
  seq_len      = SEQ
}
"""


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_clip(root / "clip", full=True)
    make_decoder(root / "llama")
    make_decoder(root / "mistral", "mistral", sliding_window=256)
    make_unet(root / "sd", sd=2, prediction="v_prediction")
    make_unet(root / "bare", sd=1, pipeline=False)
    return root


def check(hf: Path, *, encoder: str = 'pretrained = "clip"',
          backbone: str = 'pretrained = "llama"',
          generator: str = 'arch = hf("sd")', seq: int = 512):
    text = (SPEC.replace("ENCODER", encoder).replace("BACKBONE", backbone)
            .replace("GENERATOR", generator).replace("SEQ", str(seq)))
    return run_frontend(str(hf / "spec.dt"), text.encode(), base_dir=hf)


def codes(result) -> list[str]:
    return [d.code for d in result.diagnostics]


def test_hugging_face_modules_resolve(hf):
    result = check(hf)
    assert result.ok, [d.message for d in result.diagnostics]
    p = result.program
    vit, llm, gen = p.module("vit"), p.module("llm"), p.module("gen")
    assert llm.pretrained == str((hf / "llama").resolve()) and llm.hf.family == "llama"
    assert llm.arch.rope.scaling == "llama3" and llm.arch.vocab == 128
    assert vit.hf.family == "clip" and vit.arch.cls_token and vit.pretrained is not None
    assert gen.pretrained is None and gen.arch.prediction == "v_prediction"
    assert gen.arch.beta_schedule == "scaled_linear"
    # Projectors take their widths from the models.
    assert p.projectors[0].arch.in_dim == 32 and p.projectors[0].arch.out_dim == 64
    assert p.projectors[1].arch.out_dim == gen.arch.context_dim == 24
    # The Program's text form keeps all of it.
    assert ir.Program.model_validate_json(p.model_dump_json()) == p


def test_a_feature_layer_shortens_the_tower(hf):
    result = check(hf, encoder='arch = hf("clip", feature_layer=-2)\n    pretrained = "clip"')
    assert result.ok
    assert result.program.module("vit").arch.layers == 2
    assert result.program.module("vit").hf.source_layers == 3
    bad = check(hf, encoder='arch = hf("clip", feature_layer=-7)')
    assert codes(bad) == ["DT311"] and "feature_layer -7" in bad.diagnostics[0].message


@pytest.mark.parametrize("encoder, message", [
    ('arch = hf("missing")', "does not exist"),
    ('arch = hf("llama")', "cannot be an encoder"),
    ('pretrained = "sd"', "cannot be an encoder"),
])
def test_unusable_directories_are_dt311_at_the_path(hf, encoder, message):
    result = check(hf, encoder=encoder)
    (d,) = result.diagnostics
    assert d.code == "DT311" and message in d.message
    assert d.span.line == 4          # the path, on the encoder's line


def test_weights_that_do_not_fit_are_dt312(hf, tmp_path):
    other = make_decoder(tmp_path / "wide", ffn=128)
    result = check(hf, backbone=f'arch = hf("llama")\n    pretrained = "{other}"')
    (d,) = result.diagnostics
    assert d.code == "DT312" and "mlp.gate_proj.weight' has shape [128, 64]" in d.message
    # A missing tensor.
    broken = tmp_path / "broken"
    shutil.copytree(hf / "llama", broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = check(hf, backbone=f'pretrained = "{broken}"')
    assert codes(result) == ["DT312"]
    assert "no tensor 'model.layers.2.self_attn.k_proj.weight'" in result.diagnostics[0].message
    # Pretrained weights into dtdsl's own architecture.
    result = check(hf, backbone='arch = transformer(layers=2, hidden=64, heads=4, vocab=128)\n'
                   '    pretrained = "llama"')
    assert codes(result) == ["DT312"] and "hf(" in result.diagnostics[0].hint


def test_sliding_windows_bound_the_sequence(hf):
    ok = check(hf, backbone='pretrained = "mistral"', seq=256)
    assert ok.ok and ok.program.backbone.arch.sliding_window == 256
    bad = check(hf, backbone='pretrained = "mistral"', seq=512)
    assert codes(bad) == ["DT313"] and "sliding attention window (256 tokens)" in \
        bad.diagnostics[0].message


def test_a_unet_without_its_scheduler_warns(hf):
    result = check(hf, generator='pretrained = "bare"')
    assert result.ok and codes(result) == ["DT504"]
    gen = result.program.module("gen")
    assert gen.arch.prediction == "epsilon" and gen.arch.beta_schedule == "linear"
    assert not gen.arch.linear_proj      # SD 1.x: 1x1-conv projections


def test_unsupported_configs_name_what(hf, tmp_path):
    sdxl = tmp_path / "sdxl"
    shutil.copytree(hf / "sd", sdxl)
    config = json.loads((sdxl / "unet" / "config.json").read_text())
    config["addition_embed_type"] = "text_time"
    (sdxl / "unet" / "config.json").write_text(json.dumps(config))
    result = check(hf, generator=f'arch = hf("{sdxl}")')
    assert codes(result) == ["DT311"]
    assert "addition_embed_type = 'text_time' is not supported" in result.diagnostics[0].message


def test_a_module_needs_an_architecture(hf):
    result = check(hf, backbone="frozen = true")
    assert codes(result) == ["DT204"] and "needs an architecture" in result.diagnostics[0].message


# ---- the data's tokenizer ----------------------------------------------------------------

def _with_data(hf: Path, fields: str, backbone: str):
    text = (SPEC.replace("ENCODER", 'pretrained = "clip"').replace("BACKBONE", backbone)
            .replace("GENERATOR", 'arch = hf("sd")').replace("SEQ", "512")
            .replace("  image.gen_count ~ 1\n", "  image.gen_count ~ 1\n" + fields))
    return run_frontend(str(hf / "spec.dt"), text.encode(), base_dir=hf)


def test_the_tokenizer_defaults_to_the_backbones_folder(hf):
    from tests.text_models import make_tokenizer

    make_decoder(hf / "llama512", vocab=512)
    make_tokenizer(hf / "llama512")
    result = _with_data(hf, "", 'pretrained = "llama512"')
    assert result.ok, [d.message for d in result.diagnostics]
    assert result.program.data.tokenizer == str((hf / "llama512").resolve())
    # weights without a tokenizer: none (synthetic data only)
    assert check(hf).program.data.tokenizer is None
    # the data block's own wins, relative to the spec
    make_tokenizer(hf / "other", vocab=300)
    result = _with_data(hf, '  tokenizer = "other/tokenizer.json"\n',
                        'pretrained = "llama512"')
    assert result.program.data.tokenizer == str((hf / "other" / "tokenizer.json").resolve())


def test_tokenizers_that_do_not_fit_are_dt315_at_the_field(hf):
    from tests.text_models import make_tokenizer

    result = _with_data(hf, '  tokenizer = "nowhere"\n', 'pretrained = "llama"')
    (d,) = [d for d in result.diagnostics if d.code == "DT315"]
    line = next(i for i, t in enumerate(SPEC.splitlines(), 1) if "image.gen_count" in t) + 1
    assert d.message.endswith("nowhere does not exist") and d.span.line == line
    make_tokenizer(hf / "big")                       # 400 ids for a vocabulary of 128
    result = _with_data(hf, '  tokenizer = "big"\n', 'pretrained = "llama"')
    assert "beyond the backbone's vocabulary of 128" in result.diagnostics[0].message
    make_decoder(hf / "llama512b", vocab=512)
    result = _with_data(hf, '  tokenizer = "big"\n  chat = "llama3"\n',
                        'pretrained = "llama512b"')
    assert codes(result) == ["DT315"] and "<|start_header_id|>" in \
        result.diagnostics[0].message
    # an unknown chat format is its own error, and the only one (no tokenizer loaded for it)
    result = _with_data(hf, '  tokenizer = "big"\n  chat = "gemma"\n',
                        'pretrained = "llama512b"')
    assert codes(result) == ["DT205"] and "unknown data.chat 'gemma'" in \
        result.diagnostics[0].message
