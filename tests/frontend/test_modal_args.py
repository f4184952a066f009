"""mel_bins and temporal_patch: an audio encoder's fbank splits into whole patches
(DT612), temporal patching belongs to a video encoder (DT613), mel_bins elsewhere is
ignored with a warning (DT501)."""

from __future__ import annotations

import pytest

from dtdsl.driver import run_frontend
from tests.specs import TINY

_AUDIO = """  encoder beats (audio) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=4, in_channels=1%s)
  }
  backbone llm {"""


def _check(text: str):
    return run_frontend("modal.dt", text.encode())


def _with_audio(args: str) -> str:
    text = TINY.read_text().replace("  backbone llm {", _AUDIO % args)
    text = text.replace("projector vit -> llm : mlp(depth=2)",
                        "projector vit -> llm : mlp(depth=2)\n  projector beats -> llm : "
                        "mlp(depth=2)")
    return text.replace("  image.gen_count", "  audio.count ~ 1\n  audio.frames ~ 32\n"
                        "  image.gen_count")


def test_mel_bins_default_to_beats_and_reach_the_program():
    result = _check(_with_audio(""))
    assert result.ok, [d.message for d in result.diagnostics]
    arch = result.program.module("beats").arch
    assert (arch.mel_bins, arch.temporal_patch) == (128, 1)
    result = _check(_with_audio(", mel_bins=80"))
    assert result.ok and result.program.module("beats").arch.mel_bins == 80


@pytest.mark.parametrize(("args", "bins"), [(", mel_bins=18", 18), (", mel_bins=6", 6)])
def test_an_fbank_that_does_not_split_into_patches_is_dt612(args, bins):
    result = _check(_with_audio(args))
    (d,) = [d for d in result.diagnostics if d.severity == "error"]
    assert d.code == "DT612" and f"{bins}-bin fbank" in d.message
    assert "mel_bins=" in d.hint


def test_temporal_patch_on_an_image_encoder_is_dt613_and_mel_bins_there_dt501():
    text = TINY.read_text().replace("patch=8)", "patch=8, temporal_patch=2)")
    (d,) = _check(text).diagnostics
    assert d.code == "DT613" and "encoder vit reads image" in d.message
    text = TINY.read_text().replace("patch=8)", "patch=8, mel_bins=64)")
    result = _check(text)
    assert result.ok and [d.code for d in result.diagnostics] == ["DT501"]
