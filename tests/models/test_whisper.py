"""Whisper's encoder from a Hugging Face folder (``arch = hf(DIR)``): tiny random Whispers
made here with ``transformers``, loaded into dtdsl's ``Encoder``, compared with
``WhisperEncoder`` (fp32, within 1e-4), run a slice of layers at a time as pipeline stages
do, written back and loaded by ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.models.audio import whisper_positions
from dtdsl.models.hf import HFError, load_hf, pretrained_problems, read_hf, save_hf
from tests.hf_models import quiet, randomize

LOAD_RTOL = 1e-4     # the bound: our forward against the library's, fp32
SAVE_RTOL = 1e-6


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def make_whisper(path: Path, *, kind: str = "full", seed: int = 0, hidden: int = 32,
                 layers: int = 3, heads: int = 4, ffn: int = 48, mel_bins: int = 16,
                 positions: int = 20, **config: Any) -> Path:
    """A tiny Whisper (``kind``: ``full`` WhisperForConditionalGeneration, ``model``
    WhisperModel, ``encoder`` WhisperEncoder alone), every weight random but its fixed
    positions (what transformers initialises them to, as OpenAI's checkpoints hold)."""
    import transformers
    from transformers.models.whisper.modeling_whisper import sinusoids

    quiet()
    cfg = transformers.WhisperConfig(
        d_model=hidden, encoder_layers=layers, encoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_layers=1, decoder_attention_heads=heads,
        decoder_ffn_dim=ffn, num_mel_bins=mel_bins, max_source_positions=positions,
        max_target_positions=16, vocab_size=100, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, **config)
    cls = {"full": transformers.WhisperForConditionalGeneration,
           "model": transformers.WhisperModel,
           "encoder": transformers.models.whisper.modeling_whisper.WhisperEncoder}[kind]
    model = randomize(cls(cfg), seed)
    encoder = model if kind == "encoder" else model.get_encoder()
    with torch.no_grad():
        encoder.embed_positions.weight.copy_(sinusoids(positions, hidden))
    model.save_pretrained(path)
    return path


def theirs_encoder(path: Path, kind: str = "full"):
    import transformers

    if kind == "encoder":
        return transformers.models.whisper.modeling_whisper.WhisperEncoder.from_pretrained(
            path).eval()
    cls = transformers.WhisperForConditionalGeneration if kind == "full" else \
        transformers.WhisperModel
    return cls.from_pretrained(path).eval().get_encoder()


def features(batch: int, mel_bins: int, frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, mel_bins, frames, generator=torch.Generator().manual_seed(seed))


CASES = {
    "full-80": dict(kind="full", mel_bins=80),
    "model-128-gelu-new": dict(kind="model", mel_bins=128, activation_function="gelu_new"),
    "encoder-only": dict(kind="encoder"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whisper_encoder_equals_transformers(case, tmp_path):
    spec = dict(CASES[case])
    kind = spec["kind"]
    path = make_whisper(tmp_path / "in", **spec)
    ours = load_hf(path)
    theirs = theirs_encoder(path, kind)
    assert ours.arch.stem == "whisper_conv" and ours.hf_source.family == "whisper"
    ours_params = sum(p.numel() for p in ours.parameters())
    # Everything but the fixed positions, which dtdsl computes and does not train.
    assert ours_params == sum(p.numel() for n, p in theirs.named_parameters()
                              if "embed_positions" not in n)
    x = features(2, spec.get("mel_bins", 16), 40)
    with torch.no_grad():
        want = theirs(x).last_hidden_state
        got = ours(x)
    assert got.shape == want.shape == (2, 20, 32)
    assert rel(got, want) < LOAD_RTOL


def test_pipeline_stages_run_slices_of_layers(tmp_path):
    ours = load_hf(make_whisper(tmp_path / "w", layers=4))
    x = features(3, 16, 40, seed=5)
    with torch.no_grad():
        whole = ours(x)
        h = ours.embed(x.transpose(1, 2))                 # the first stage: [B, frames, mel]
        for key in ("0", "1"):
            h = ours.layers[key](h)
        for key in ("2", "3"):                            # the second stage
            h = ours.layers[key](h)
        staged = ours.finish(h)
    assert torch.equal(staged, whole)
    with pytest.raises(ValueError, match="clips of 40 frames .padded to 30 s., not 38"):
        ours.embed(x.transpose(1, 2)[:, :38])


def test_clip_tokens_are_max_source_positions(tmp_path):
    model = read_hf(make_whisper(tmp_path / "w", positions=24))
    assert model.arch.clip_tokens(48) == 24 == model.arch.max_source_positions
    assert model.arch.clip_tokens(10) == 24           # padded to 30 s: always the same
    ours = load_hf(tmp_path / "w")
    with torch.no_grad():
        assert ours(features(1, 16, 48)).shape[1] == model.arch.clip_tokens(48)
    with pytest.raises(ValueError, match="Whisper's stem"):
        ir.TransformerArch(layers=1, hidden=8, heads=1, kv_heads=1, ffn=8).clip_tokens(10)
    # Whisper large: 1500 tokens for 30 s of 10 ms frames.
    cfg = {"model_type": "whisper", "d_model": 1280, "encoder_layers": 32,
           "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128}
    (tmp_path / "large").mkdir()
    (tmp_path / "large" / "config.json").write_text(json.dumps(cfg))
    large = read_hf(tmp_path / "large").arch
    assert large.clip_tokens(3000) == 1500 and large.in_channels == 128


def test_save_hf_writes_a_whisper_transformers_loads_whole(tmp_path):
    import transformers

    path = make_whisper(tmp_path / "in")
    ours = load_hf(path)
    with torch.no_grad():
        for p in ours.parameters():                       # as if trained
            p.add_(0.01)
    save_hf(ours, tmp_path / "out")
    back, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = features(2, 16, 40, seed=2)
    with torch.no_grad():
        assert rel(back.eval().get_encoder()(x).last_hidden_state, ours(x)) < SAVE_RTOL
    # The decoder is the pretrained one, untouched.
    before = transformers.WhisperForConditionalGeneration.from_pretrained(path).state_dict()
    after = back.state_dict()
    for key, value in before.items():
        if ".decoder." in key:
            assert torch.equal(after[key], value), key
    assert json.loads((tmp_path / "out" / "config.json").read_text())["decoder_layers"] == 1


def test_positions_that_are_not_the_sinusoids_are_refused(tmp_path):
    import transformers

    path = make_whisper(tmp_path / "w")
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path)
    with torch.no_grad():
        model.model.encoder.embed_positions.weight.add_(0.05)
    model.save_pretrained(tmp_path / "trained")
    found = read_hf(tmp_path / "trained")
    problems = pretrained_problems(found, "encoder", found.arch)
    assert len(problems) == 1 and "not Whisper's fixed sinusoidal positions" in problems[0]
    with pytest.raises(HFError, match="fixed sinusoidal positions"):
        load_hf(tmp_path / "trained")
    assert pretrained_problems(read_hf(path), "encoder", read_hf(path).arch) == []
    # Stored in fp16, the sinusoids round: still Whisper's.
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path)
    model.half().save_pretrained(tmp_path / "half")
    assert pretrained_problems(read_hf(tmp_path / "half"), "encoder",
                               read_hf(path).arch) == []
    assert torch.allclose(whisper_positions(20, 32),
                          model.model.encoder.embed_positions.weight.float(), atol=1e-3)


@pytest.mark.parametrize("change,message", [
    ({"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ({"d_model": 35, "encoder_attention_heads": 5}, "'d_model' is 35, not even"),
    ({"encoder_attention_heads": 5}, "encoder_attention_heads"),
    ({"num_mel_bins": 0}, "num_mel_bins"),
    ({"dropout": 0.1}, "dropout 0.1: dtdsl trains without dropout"),
    ({"encoder_layerdrop": 0.1}, "encoder_layerdrop 0.1: dtdsl trains without dropout"),
])
def test_unsupported_whisper_configs_name_the_key(change, message, tmp_path):
    cfg = {"model_type": "whisper", "d_model": 32, "encoder_layers": 1,
           "encoder_attention_heads": 4, "encoder_ffn_dim": 64, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFError, match=message):
        read_hf(tmp_path)


def test_whisper_roles_and_feature_layer(tmp_path):
    path = make_whisper(tmp_path / "w")
    with pytest.raises(HFError, match="holds an audio tower, which cannot be the backbone"):
        read_hf(path, role="backbone")
    with pytest.raises(HFError, match="feature_layer applies to vision towers only"):
        read_hf(path, feature_layer=-2)


SPEC = """
model {
  encoder ear (MODALITY) {
    pretrained = "whisper"
  }
  backbone llm {
    arch = transformer(layers=2, hidden=64, heads=2, ffn=128, vocab=300)
  }
  projector ear -> llm : mlp(depth=2)
}

data {
  text.tokens   ~ 64
  audio.count   ~ 1
  audio.frames  ~ 40
}

cluster {
  gpu  = H100
  gpus = 8
}

train {
  global_batch = 8
  seq_len      = 512
}
"""


def test_a_whisper_tower_is_an_audio_encoder_in_a_spec(tmp_path):
    make_whisper(tmp_path / "whisper")

    def check(modality: str):
        text = SPEC.replace("MODALITY", modality)
        return run_frontend(str(tmp_path / "spec.dt"), text.encode(), base_dir=tmp_path)

    result = check("audio")
    assert result.ok and not result.diagnostics, [d.message for d in result.diagnostics]
    ear = result.program.module("ear")
    assert ear.hf.family == "whisper" and ear.arch.stem == "whisper_conv"
    assert ear.pretrained == str((tmp_path / "whisper").resolve())
    wrong = check("image")
    assert [d.message for d in wrong.diagnostics if d.code == "DT306"] == [
        "whisper is an audio tower; encoder ear reads image"]


def test_a_stage_built_on_meta_loads_only_its_layers(tmp_path):
    from dtdsl.models import build_arch
    from dtdsl.models.hf import Checkpoint, load_weights
    from dtdsl.models.init import init_module

    path = make_whisper(tmp_path / "w", layers=4)
    whole = load_hf(path)
    arch = whole.arch
    with torch.device("meta"):
        stage = build_arch("encoder", arch)
    for key in ("0", "1"):                       # the second of two pipeline stages
        del stage.layers[key]
    stage.patch_embed = None
    stage.to_empty(device="cpu")
    with Checkpoint(path) as checkpoint:
        report = load_weights(stage, "whisper", arch, checkpoint)
    assert report.tensors == sum(1 for _ in stage.parameters())
    x = features(2, 16, 40, seed=7)
    with torch.no_grad():
        h = whole.embed(x.transpose(1, 2))
        for key in ("0", "1"):
            h = whole.layers[key](h)
        mid = h
        for layer in stage.layers.values():
            h = layer(h)
        assert torch.equal(stage.finish(h), whole(x))
    # Without pretrained weights the runtime initialises the stem like any convolution.
    with torch.device("meta"):
        fresh = build_arch("encoder", arch)
    fresh.to_empty(device="cpu")
    init_module(fresh, seed=0, unit="ear", num_layers=arch.layers)
    with torch.no_grad():
        out = fresh(x)
    assert torch.isfinite(out).all() and out.shape == mid.shape


def test_a_clip_file_through_the_policy_and_ours_equals_transformers_pipeline(tmp_path):
    """Bytes of a FLAC clip to hidden states: dtdsl's decode, log-mel and encoder against
    soundfile, WhisperFeatureExtractor and WhisperEncoder (30 s windows: 1500 positions)."""
    import io

    import numpy as np
    import soundfile as sf
    from transformers import WhisperFeatureExtractor

    from dtdsl.data.audio import AudioPolicy, WhisperFeatures

    path = make_whisper(tmp_path / "w", mel_bins=80, positions=1500, layers=2)
    model = read_hf(path)
    ear = ir.Module(name="ear", role="encoder", modality="audio", arch=model.arch,
                    hf=model.source, span=_span())
    policy = AudioPolicy.for_encoder(ear)
    assert isinstance(policy.extractor, WhisperFeatures) and policy.max_seconds == 30.0
    t = np.arange(int(4.5 * 16_000)) / 16_000
    wave = (0.3 * np.sin(2 * np.pi * 330 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, wave, 16_000, format="FLAC", subtype="PCM_24")
    mel = policy.features(buf.getvalue(), "clip.flac")
    assert mel.shape == (3000, 80)
    raw, rate = sf.read(io.BytesIO(buf.getvalue()), dtype="float32")
    want_mel = WhisperFeatureExtractor(feature_size=80)(
        raw, sampling_rate=rate, return_tensors="pt").input_features
    with torch.no_grad():
        got = load_hf(path)(torch.from_numpy(mel).T[None])
        want = theirs_encoder(path)(want_mel).last_hidden_state
    assert got.shape == (1, 1500, 32)
    assert rel(got, want) < LOAD_RTOL


def _span():
    from dtdsl.source import Span

    return Span.point(1, 1)
