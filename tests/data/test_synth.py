"""Synthetic data follows the spec's distribution, deterministically."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dtdsl.cost.samples import draw
from dtdsl.data.shards import Dataset, count_text_tokens
from dtdsl.data.synth import _ASPECTS, image_grid, synthesize
from dtdsl.ir import program as ir

from .conftest import NUM_SAMPLES, check_spec


def _reference(quantity: ir.Quantity, n: int = 200_000) -> np.ndarray:
    return draw(quantity, n, np.random.default_rng(99)).astype(float)


def _close(values: list[int] | np.ndarray, expected_mean: float, expected_std: float) -> None:
    """The mean within 4 standard errors of the expected mean."""
    values = np.asarray(values, dtype=float)
    error = 4 * expected_std / np.sqrt(len(values))
    assert abs(values.mean() - expected_mean) <= error, (values.mean(), expected_mean, error)


def test_follows_the_spec_distribution(tiny, tiny_dataset: Path):
    data = tiny.data
    with Dataset.open(tiny_dataset) as ds:
        infos = [ds.info(i) for i in range(len(ds))]
        assert ds.provenance["spec"] == "tiny_cpu" and ds.provenance["seed"] == 5
    assert len(infos) == NUM_SAMPLES
    for name, values in (("text.tokens", [s.text_tokens for s in infos]),
                         ("image.count", [len(s.images) for s in infos]),
                         ("image.gen_count", [len(s.gen_images) for s in infos])):
        ref = _reference(data.get(*name.split(".")))
        _close(values, ref.mean(), ref.std())
        assert min(values) >= ref.min() and max(values) <= ref.max()
    # Patches: the drawn count reshaped to one of three aspect ratios, so the expected
    # mean is that of the grids, not of the draws.
    patch = tiny.module("vit").arch.patch
    sides = [side for s in infos for side in s.images]
    assert all(w % patch == 0 and h % patch == 0 for w, h in sides)
    patches = [w * h // patch**2 for w, h in sides]
    ref = _reference(data.get("image", "patches"))
    grids = np.array([np.prod(image_grid(int(p), a)) for p in ref[:3000] for a in _ASPECTS],
                     dtype=float)
    _close(patches, grids.mean(), grids.std())
    assert len({(w, h) for w, h in sides if w * h == 64 * 64}) == 1
    assert len(set(sides)) >= 5     # 32x32, 64x64 and their 4:3 and 3:4 cousins
    assert {g for s in infos for g in s.gen_images} == {(64, 64)}    # 8 x the latent


def test_text_has_the_drawn_token_count(tiny):
    sample = next(synthesize(tiny, 1, seed=0))
    quantity = tiny.data.get("text", "tokens")
    assert quantity.low <= count_text_tokens(sample.text) <= quantity.high
    words = sample.text.split()
    assert all(w.rstrip(".,").isalpha() for w in words)


def test_deterministic_and_prefix_stable(tiny, tiny_dataset: Path):
    # The fixture is synthesize(tiny, 2000, seed=5): its first 300 samples (past the first
    # block of sizes) are those of a shorter run.
    a = list(synthesize(tiny, 300, seed=5))
    with Dataset.open(tiny_dataset) as ds:
        assert [ds.read(i) for i in range(300)] == a
    assert list(synthesize(tiny, 10, seed=6)) != a[:10]


def test_images_decode_to_their_stated_size(tiny):
    seen = set()
    for sample in synthesize(tiny, 60, seed=4):
        for image in sample.images + sample.gen_images:
            with Image.open(io.BytesIO(image.data)) as img:
                assert img.size == (image.width, image.height)
                assert img.format.lower() == image.format and img.mode == "RGB"
                seen.add(image.format)
    assert seen == {"png", "jpeg"}


def test_audio_and_every_modality(av):
    samples = list(synthesize(av, 200, seed=0))
    frames = av.data.get("audio", "frames")
    clips = [a for s in samples for a in s.audio]
    gen_clips = [a for s in samples for a in s.gen_audio]
    assert clips and gen_clips
    for clip in clips + gen_clips:
        array = clip.array()
        assert array.dtype == np.float32 and array.shape == (clip.frames, 128)
        assert frames.low <= clip.frames <= frames.high
    stacked = np.concatenate([c.array() for c in clips])
    assert abs(stacked.mean()) < 0.5 and 0.3 < stacked.std() < 2
    _close([len(s.audio) for s in samples], 0.9, 0.83)
    # image.patches is clamped at 40: no image is drawn larger
    assert max(i.width * i.height // 64 for s in samples for i in s.images) <= 40


def test_video_is_refused(av):
    video = av.model_copy(update={"modules": tuple(
        m.model_copy(update={"modality": "video"}) if m.name == "ear" else m
        for m in av.modules)})
    with pytest.raises(ValueError, match="'ear' reads video"):
        next(synthesize(video, 1))


def test_missing_quantity_is_named():
    spec = """spec s
model {
  encoder vit (image) { arch = transformer(layers=1, hidden=32, heads=2, ffn=64, patch=8) }
  backbone llm { arch = transformer(layers=1, hidden=32, heads=2, ffn=64, vocab=64) }
  projector vit -> llm : mlp(depth=1)
}
data { text.tokens ~ constant(5)  image.count ~ constant(1)  image.patches ~ constant(4) }
cluster { gpu = H100  gpus = 8 }
train { global_batch = 8  seq_len = 64 }
"""
    program = check_spec(spec)
    sample = next(synthesize(program, 1))
    assert count_text_tokens(sample.text) == 5
    assert [(i.width, i.height) for i in sample.images] == [(16, 16)]  # 2 x 2 patches
    data = program.data.model_copy(update={"quantities": tuple(
        q for q in program.data.quantities if q.key != "image.patches")})
    with pytest.raises(ValueError, match="no image.patches"):
        next(synthesize(program.model_copy(update={"data": data}), 1))
