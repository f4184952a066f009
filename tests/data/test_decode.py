"""Decoding: shapes, dtypes, patch multiples, the clamp, determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtdsl.data.decode import DIFFUSION_STEPS, Decoder, decode_sample, patch_grid
from dtdsl.data.encode import encode_image
from dtdsl.data.shards import Dataset, DatasetError, RawSample, text_pieces
from dtdsl.data.synth import synthesize
from dtdsl.data.text import HashTokenizer as Tokenizer


def test_tokenizer_is_fixed_and_in_range():
    tok = Tokenizer(512)
    ids = tok.encode("Hello, world. hello")
    assert ids.dtype == np.int64 and ids.tolist() == Tokenizer(512).encode(
        "Hello, world. hello").tolist()
    assert len(ids) == len(text_pieces("Hello, world. hello")) == 5
    assert ids[0] != ids[4]                      # case matters
    # Pinned: the ids are part of the data format (a change would silently retrain).
    assert Tokenizer(2**31).encode("abc").tolist() == [1477753816]
    assert all(0 <= i < 7 for i in Tokenizer(7).encode("a b c d e f g h i j"))
    assert Tokenizer(5).encode("").shape == (0,)
    with pytest.raises(ValueError):
        Tokenizer(0)


@pytest.mark.parametrize("size, patch, limit, grid", [
    ((32, 32), 8, None, (4, 4)),
    ((30, 20), 8, None, (4, 3)),       # rounded to the nearest whole patch, halves up
    ((3, 3), 8, None, (1, 1)),         # at least one patch
    ((896, 448), 14, None, (64, 32)),
    ((896, 448), 14, 1024, (45, 22)),  # scaled down together under the clamp
    ((800, 16), 8, 20, (20, 1)),
    ((64, 64), 8, 0, (1, 1)),
])
def test_patch_grid(size, patch, limit, grid):
    assert patch_grid(*size, patch, limit) == grid
    if limit:
        assert grid[0] * grid[1] <= max(limit, 1)


def test_decoded_shapes_and_dtypes(tiny, tiny_dataset: Path):
    decoder = Decoder.for_program(tiny, seed=0)
    patch = tiny.module("vit").arch.patch
    gen = tiny.module("gen").arch
    with Dataset.open(tiny_dataset) as ds:
        for i in range(60):
            raw, info = ds.read(i), ds.info(i)
            out = decoder.decode(raw)
            assert out.key == raw.key
            assert out.tokens.dtype == np.int64 and out.tokens.shape == (info.text_tokens,)
            assert out.tokens.min(initial=0) >= 0 and out.tokens.max(initial=0) < 512
            assert len(out.images) == len(info.images)
            for image, (w, h) in zip(out.images, info.images, strict=True):
                assert image.dtype == np.uint8 and image.shape == (3, h, w)
                assert h % patch == 0 and w % patch == 0
            assert out.audio == ()
            targets = out.gen["gen"]
            g = len(info.gen_images)
            assert len(targets) == g
            shape = (g, gen.latent_channels, gen.latent, gen.latent)
            assert targets.latents.shape == targets.noise.shape == shape
            assert targets.latents.dtype == targets.noise.dtype == np.float32
            assert targets.timesteps.dtype == np.int64 and targets.timesteps.shape == (g,)
            assert np.all((targets.timesteps >= 0) & (targets.timesteps < DIFFUSION_STEPS))


def test_latents_have_about_unit_variance(tiny):
    decoder = Decoder.for_program(tiny, seed=0)
    latents = [decoder.decode(s).gen["gen"].latents for s in synthesize(tiny, 200, seed=8)]
    stacked = np.concatenate(latents)
    assert len(stacked) > 40
    assert abs(float(stacked.mean())) < 0.3 and 0.5 < float(stacked.std()) < 1.5


def test_deterministic_and_seeded_by_key_and_generator(tiny):
    raw = next(s for s in synthesize(tiny, 50, seed=0) if s.gen_images and s.images)
    a = Decoder.for_program(tiny, seed=3).decode(raw)
    b = decode_sample(tiny, raw, seed=3)
    c = decode_sample(tiny, raw, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for x, y in zip(a.images, b.images, strict=True):
        np.testing.assert_array_equal(x, y)
    for field in ("latents", "noise", "timesteps"):
        np.testing.assert_array_equal(getattr(a.gen["gen"], field),
                                      getattr(b.gen["gen"], field))
    np.testing.assert_array_equal(a.gen["gen"].latents, c.gen["gen"].latents)
    assert not np.array_equal(a.gen["gen"].noise, c.gen["gen"].noise)
    other = RawSample(key="00000999", text=raw.text, gen_images=raw.gen_images)
    assert not np.array_equal(decode_sample(tiny, other, seed=3).gen["gen"].noise,
                              a.gen["gen"].noise)


def test_synthetic_text_layout(tiny):
    """The hashing tokenizer's layout: one id per piece, images first, every token but
    the first trained."""
    raw = RawSample(key="00000000", text="a b c d e f")
    out = decode_sample(tiny, raw, seed=0)
    assert out.tokens.shape == (6,) and out.image_at == () and out.trained == ((1, 6),)


def test_resized_to_patches_under_the_clamp(av):
    pixels = np.zeros((100, 203, 3), dtype=np.uint8)
    raw = RawSample(key="00000000", text="x", images=(encode_image(pixels, "png"),
                                                      encode_image(pixels[:20, :20], "jpeg")))
    out = decode_sample(av, raw, seed=0)
    (c, h, w), (c2, h2, w2) = (i.shape for i in out.images)
    assert (c, c2) == (3, 3)
    assert h % 8 == 0 and w % 8 == 0 and (w // 8) * (h // 8) <= 40   # clamp [1, 40]
    assert (h, w) == (32, 64)              # 25 x 13 patches scaled down to 8 x 4
    assert (h2, w2) == (24, 24)            # 20 px rounds to 3 patches


def test_audio_and_audio_generator(av):
    decoder = Decoder.for_program(av, seed=1)
    voice = av.module("voice").arch
    samples = [s for s in synthesize(av, 40, seed=2) if s.audio and s.gen_audio]
    assert samples
    for raw in samples:
        out = decoder.decode(raw)
        assert [a.shape for a in out.audio] == [(min(a.frames, 48), 128) for a in raw.audio]
        assert all(a.dtype == np.float32 for a in out.audio)
        t = out.gen["voice"]
        assert t.latents.shape == (len(raw.gen_audio), voice.latent_channels, 8, 8)
        assert set(out.gen) == {"gen", "voice"}


def test_undecodable_image(tiny):
    image = encode_image(np.zeros((8, 8, 3), dtype=np.uint8), "png")
    broken = type(image)(format="png", data=image.data[:30], width=8, height=8)
    with pytest.raises(DatasetError, match="sample 00000000: cannot decode a png image"):
        decode_sample(tiny, RawSample(key="00000000", text="", images=(broken,)), seed=0)
