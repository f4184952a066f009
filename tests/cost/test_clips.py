"""The cost model prices audio and video encoders as the runtime runs them (issue 29):
their parameters are the torch model's (Whisper's convolutional stem, a video patch of
``temporal_patch`` frames), their patch-embedding FLOPs count the stem's convolutions,
and the tokens it predicts per sample equal the runtime's, for drawn samples and for
real clips (tokens from the index equal the decoded clips')."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from dtdsl.cost import flops
from dtdsl.data.batch import sample_set
from dtdsl.data.modal import encoder_inputs
from dtdsl.models import build_module
from tests.train.modal_specs import tiny_modal

WHISPER = {"stem": "whisper_conv", "max_source_positions": 6, "in_channels": 16,
           "patch": None, "qkv_bias": True, "k_bias": False}


def _whisper(program):
    return program.model_copy(update={"modules": tuple(
        m.model_copy(update={"arch": m.arch.model_copy(update=WHISPER)})
        if m.name == "beats" else m for m in program.modules)})


def _params(module) -> int:
    return sum(p.numel() for p in build_module(module, 1).parameters())


def test_audio_and_video_encoder_params_are_the_torch_models():
    program = tiny_modal(audio=True, video=True)
    for name in ("beats", "clip"):
        module = program.module(name)
        assert flops.module_params(module) == _params(module), name
    whisper = _whisper(program).module("beats")
    assert flops.module_params(whisper) == _params(whisper)


def test_patch_embedding_flops_are_the_stems():
    """encoder_item_forward's matmul FLOPs less its layers' equal what torch counts for
    the stem (Whisper's convolutions over 2P frames; a video's Linear over 3 x 2 x p^2)."""
    program = tiny_modal(audio=True, video=True)
    for module, tokens in ((_whisper(program).module("beats"), 6),
                           (program.module("clip"), 8)):
        model = build_module(module, 1)
        arch = module.arch
        layers = arch.layers * tokens * flops.transformer_layer_matmul_per_token(arch)
        want = flops.encoder_item_forward(arch, tokens).matmul - layers
        x = torch.randn(1, 2 * tokens, arch.in_channels) if model.whisper else \
            torch.randn(1, tokens, model.patch_dim)
        with FlopCounterMode(display=False) as counter:
            model.patch_embed(x)
        assert counter.get_total_flops() == want, module.name


def test_the_cost_models_tokens_of_real_clips_are_the_runtimes(tmp_path):
    """Over WebDataset audio and video: the cost model's view of a step's samples
    (``sample_set`` of the sizes the index predicts, nothing decoded) has, per sample,
    the tokens of the items the runtime decodes and encodes."""
    from dtdsl.feed.source import DatasetSource
    from tests.helpers.media import write_media_shards
    from tests.text_models import make_tokenizer

    write_media_shards(tmp_path / "s", n=16, per_shard=8)
    make_tokenizer(tmp_path / "tok")
    program = tiny_modal(audio=True, video=True, batch=8)
    program = program.model_copy(update={"data": program.data.model_copy(
        update={"tokenizer": str(tmp_path / "tok")})})
    source = DatasetSource(program, tmp_path / "s")
    rules = encoder_inputs(program)
    seen = 0
    for step in range(2):
        drawn = sample_set(program, source.sizes(step))
        samples = [source.sample(step, i) for i in range(8)]
        for key, name in (("audio", "beats"), ("video", "clip")):
            rule = rules.rule(name)
            assert drawn.items[key].counts.tolist() == \
                [len(s.inputs.get(name, ())) for s in samples]
            got = [rule.tokens(tuple(x.shape)) for s in samples for x in s.inputs.get(name, ())]
            assert drawn.items[key].sizes.tolist() == got, (key, step)
            seen += len(got)
    assert seen > 16
