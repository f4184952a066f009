"""Synthetic datasets that follow a spec's data distribution (``dtc data synth``).

``synthesize(program, n, seed)`` yields n ``RawSample``s. Sample ``i`` depends only on the
spec, the seed and ``i`` (its own random stream, seeded by a SHA-256 of them), so a
longer dataset starts with the shorter one's samples. Sizes are drawn with
``dtdsl.cost.samples.draw``, the draws the cost model and the simulator make, and only
for what the spec's modules read:

- text: ``text.tokens`` tokens (at least 1) of a walk on a fixed Markov chain over a small
  made-up vocabulary (``NUM_WORDS`` words and a few punctuation marks, each with
  ``_SUCCESSORS`` Zipf-skewed successors), so a language model has something to learn;
  ``shards.count_text_tokens`` of the text is exactly the drawn count;
- input images (an image encoder): ``image.count`` images, each with about
  ``image.patches`` patches: a grid of ``gw x gh`` patches of the first image encoder's
  ``patch`` pixels, ``gw = round(g sqrt(a))``, ``gh = round(g / sqrt(a))`` with ``g =
  sqrt(patches)`` and the aspect ratio ``a`` one of 1, 4/3, 3/4 (so packing by shape
  sees several shapes); PNG or JPEG with even odds. Pixels are a two-colour gradient
  with one to three rectangles (JPEGs get mild noise as well). Every image encoder of
  the spec reads them, each at its own size (``data.decode``);
- images to generate (an image generator): ``image.gen_count`` square PNGs of side 8 x
  the generator's ``latent`` (the first image generator's, when there are several);
- audio (an audio encoder): ``audio.count`` clips of ``audio.frames`` standardised
  log-mel frames (harmonic stripes under an envelope, plus noise) of the bins the spec's
  first audio encoder reads (its ``mel_bins``, default ``MEL_BINS``; a Whisper stem's
  ``in_channels``), so the dataset trains the spec: they are precomputed features
  (``data.decode``), which a second audio encoder reads too when it has as many bins; an
  encoder of ``C = in_channels > 1`` gets ``[frames, C, bins]``, a clip drawn per channel;
- audio to generate (an audio generator): ``audio.gen_count`` clips, ``audio.frames``
  frames each when the spec has that quantity, else 8 x the generator's ``latent``.

Video is not synthesised yet (ValueError).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtdsl.cost.samples import draw
from dtdsl.data.encode import encode_audio, encode_image
from dtdsl.data.shards import RawSample, sample_key
from dtdsl.ir import program as ir
from dtdsl.ir.modal import InputRule

__all__ = ["MEL_BINS", "NUM_WORDS", "image_grid", "provenance", "synthesize"]

MEL_BINS = 128
NUM_WORDS = 240
_PUNCTUATION = (".", ",")
_SUCCESSORS = 4
_ZIPF_A = 1.2
_ASPECTS = (1.0, 4 / 3, 3 / 4)
_BLOCK = 256                # samples whose sizes are drawn together
_DRAW_SCALE = 4             # pictures are drawn this many times smaller, then scaled up
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


def _seed(*parts: object) -> int:
    """A 63-bit seed from a SHA-256 of ``parts`` (stable across processes and versions)."""
    text = ":".join(map(str, ("dtdsl-synth", *parts)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def image_grid(patches: int, aspect: float) -> tuple[int, int]:
    """Patches across and down for an image of about ``patches`` patches and width/height
    ratio ``aspect``."""
    g = math.sqrt(max(patches, 1))
    return max(1, round(g * math.sqrt(aspect))), max(1, round(g / math.sqrt(aspect)))


@dataclass(frozen=True)
class _Language:
    """The fixed vocabulary and its Markov chain (the same for every spec and seed)."""

    words: tuple[str, ...]
    successors: tuple[tuple[int, ...], ...]   # per word, _SUCCESSORS distinct next words

    @classmethod
    def build(cls) -> _Language:
        rng = np.random.default_rng(_seed("language"))
        words: list[str] = []
        while len(words) < NUM_WORDS:
            syllables = rng.integers(len(_SYLLABLES), size=int(rng.integers(1, 4)))
            word = "".join(_SYLLABLES[s] for s in syllables)
            if word not in words:
                words.append(word)
        words += _PUNCTUATION
        n = len(words)
        weights = np.arange(1, n + 1, dtype=float) ** -_ZIPF_A
        weights = weights[rng.permutation(n)]     # which words are common
        rows = []
        for w in range(n):
            p = weights.copy()
            p[w] = 0                              # no word follows itself
            if words[w] in _PUNCTUATION:
                p[[words.index(m) for m in _PUNCTUATION]] = 0
            rows.append(tuple(rng.choice(n, size=_SUCCESSORS, replace=False,
                                         p=p / p.sum()).tolist()))
        return cls(words=tuple(words), successors=tuple(rows))

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        """``num_tokens`` tokens of a walk on the chain (a punctuation mark is glued to
        the word before it, and stays one token)."""
        steps = rng.integers(_SUCCESSORS, size=num_tokens).tolist()
        words, rows = self.words, self.successors
        state = int(rng.integers(NUM_WORDS))
        out = []
        for k in steps:
            word = words[state]
            if word in _PUNCTUATION and out:
                out[-1] += word
            else:
                out.append(word)
            state = rows[state][k]
        return " ".join(out)


@dataclass(frozen=True)
class _Plan:
    """What to draw for each sample, from the spec once."""

    text: ir.Quantity
    image_count: ir.Quantity | None
    image_patches: ir.Quantity | None
    patch: int
    gen_count: ir.Quantity | None
    gen_side: int
    audio_count: ir.Quantity | None
    audio_frames: ir.Quantity | None
    audio_gen_count: ir.Quantity | None
    audio_gen_frames: int
    mel_bins: int = MEL_BINS            # bins of the input clips' frames
    channels: int = 1                   # and their channels (an fbank per channel)


def _require(data: ir.Data, modality: str, name: str) -> ir.Quantity:
    quantity = data.get(modality, name)
    if quantity is None:
        raise ValueError(f"the data block has no {modality}.{name}, which the spec's "
                         f"{modality} modules need")
    return quantity


def _plan(program: ir.Program) -> _Plan:
    data = program.data
    for module in program.modules:
        if module.modality == "video":
            raise ValueError(f"'{module.name}' reads video; dtc data synth makes text, "
                             "images and audio only")
    image_enc = next((m for m in program.encoders if m.modality == "image"), None)
    image_gen = next((m for m in program.generators if m.modality == "image"), None)
    audio_enc = next((m for m in program.encoders if m.modality == "audio"), None)
    audio_gen = next((m for m in program.generators if m.modality == "audio"), None)
    patch = 1
    if image_enc is not None:
        patch = getattr(image_enc.arch, "patch", None) or 1
    bins, channels = MEL_BINS, 1
    if audio_enc is not None:       # the bins of the features it reads (Decoder._npy_shape)
        rule = InputRule.of(program, audio_enc)
        bins = rule.channels if rule.whisper_positions else rule.mel_bins
        channels = 1 if rule.whisper_positions else rule.channels
    return _Plan(
        text=_require(data, "text", "tokens"),
        image_count=_require(data, "image", "count") if image_enc else None,
        image_patches=_require(data, "image", "patches") if image_enc else None,
        patch=patch,
        gen_count=_require(data, "image", "gen_count") if image_gen else None,
        gen_side=8 * image_gen.arch.latent if image_gen else 0,
        audio_count=_require(data, "audio", "count") if audio_enc else None,
        audio_frames=(_require(data, "audio", "frames") if audio_enc
                      else data.get("audio", "frames")),
        audio_gen_count=_require(data, "audio", "gen_count") if audio_gen else None,
        audio_gen_frames=8 * audio_gen.arch.latent if audio_gen else 0,
        mel_bins=bins, channels=channels)


def _counts(quantity: ir.Quantity | None, n: int, rng: np.random.Generator,
            low: int = 0) -> list[int]:
    if quantity is None:
        return [0] * n
    return np.maximum(draw(quantity, n, rng), low).tolist()


@dataclass(frozen=True)
class _Sizes:
    """The sizes of a block of samples, drawn together (vectorised)."""

    tokens: list[int]
    images: list[list[tuple[int, float, bool]]]   # per sample: (patches, aspect, jpeg)
    gen: list[int]
    audio: list[list[int]]                        # per sample: frames per clip
    gen_audio: list[list[int]]

    @classmethod
    def draw(cls, plan: _Plan, n: int, rng: np.random.Generator) -> _Sizes:
        tokens = _counts(plan.text, n, rng, low=1)
        image_counts = _counts(plan.image_count, n, rng)
        gen = _counts(plan.gen_count, n, rng)
        audio_counts = _counts(plan.audio_count, n, rng)
        gen_audio_counts = _counts(plan.audio_gen_count, n, rng)
        total = sum(image_counts)
        patches = _counts(plan.image_patches, total, rng, low=1)
        aspects = rng.integers(len(_ASPECTS), size=total).tolist()
        jpeg = (rng.random(total) < 0.5).tolist()
        items = iter(zip(patches, [_ASPECTS[a] for a in aspects], jpeg, strict=True))
        frames = iter(_counts(plan.audio_frames, sum(audio_counts), rng, low=1))
        gen_frames = iter(_counts(plan.audio_frames, sum(gen_audio_counts), rng, low=1)
                          if plan.audio_frames is not None
                          else [plan.audio_gen_frames] * sum(gen_audio_counts))
        return cls(tokens=tokens, gen=gen,
                   images=[[next(items) for _ in range(c)] for c in image_counts],
                   audio=[[next(frames) for _ in range(c)] for c in audio_counts],
                   gen_audio=[[next(gen_frames) for _ in range(c)] for c in gen_audio_counts])


def _picture(width: int, height: int, rng: np.random.Generator, noisy: bool) -> np.ndarray:
    """uint8 [height, width, 3]: a gradient in a random direction, one to three rectangles
    (and mild noise), drawn at a quarter of the size and scaled up (bilinear): cheap even
    for large images, and smooth enough to compress."""
    from PIL import Image

    w, h = -(-width // _DRAW_SCALE), -(-height // _DRAW_SCALE)
    colors = rng.integers(0, 256, size=(5, 3)).astype(np.float32)
    u = rng.random(14)
    dx, dy = math.cos(2 * math.pi * u[0]), math.sin(2 * math.pi * u[0])
    t = np.add.outer(np.arange(h, dtype=np.float32) * (dy / max(h - 1, 1)),
                     np.arange(w, dtype=np.float32) * (dx / max(w - 1, 1)))
    t -= min(dx, 0) + min(dy, 0)
    t *= 1 / max(abs(dx) + abs(dy), 1e-6)
    pixels = colors[0] + (colors[1] - colors[0]) * t[..., None]
    for k in range(1 + int(u[1] * 3)):
        x0, x1 = sorted((int(u[2 + 4 * k] * w), int(u[3 + 4 * k] * w) + 1))
        y0, y1 = sorted((int(u[4 + 4 * k] * h), int(u[5 + 4 * k] * h) + 1))
        pixels[y0:y1, x0:x1] = colors[2 + k]
    if noisy:
        pixels += 12 * rng.standard_normal(size=pixels.shape, dtype=np.float32)
    small = Image.fromarray(np.clip(pixels, 0, 255, out=pixels).astype(np.uint8), "RGB")
    return np.asarray(small.resize((width, height), Image.Resampling.BILINEAR))


def _mel(frames: int, rng: np.random.Generator, num_bins: int = MEL_BINS) -> np.ndarray:
    """float32 [frames, num_bins]: standardised log-mel-like frames."""
    f0 = rng.uniform(4, 16)
    bins = np.arange(num_bins, dtype=np.float32)
    harmonics = np.cos(2 * math.pi * bins / f0) * np.exp(-bins / num_bins)
    t = np.arange(frames, dtype=np.float32)
    envelope = 0.5 + 0.5 * np.sin(2 * math.pi * t / rng.uniform(20, 200) + rng.uniform(0, 6))
    out = envelope[:, None] * harmonics[None, :] * 2
    out += 0.5 * rng.standard_normal(size=out.shape, dtype=np.float32)
    return out.astype(np.float32)


def _input_mel(frames: int, rng: np.random.Generator, plan: _Plan) -> np.ndarray:
    """An input clip: ``_mel``'s, or one per channel ``[frames, channels, bins]``."""
    if plan.channels == 1:
        return _mel(frames, rng, plan.mel_bins)
    return np.stack([_mel(frames, rng, plan.mel_bins) for _ in range(plan.channels)], axis=1)


def synthesize(program: ir.Program, num_samples: int, seed: int = 0) -> Iterator[RawSample]:
    """``num_samples`` samples following the spec's data block, keys ``sample_key(i)``.
    ValueError for a spec whose modules need data this cannot make (video)."""
    plan = _plan(program)
    language = _Language.build()
    sizes = None
    for i in range(num_samples):
        block, j = divmod(i, _BLOCK)
        if j == 0:
            # Sizes come in blocks of a fixed length, so sample i does not depend on how
            # many samples follow it.
            sizes = _Sizes.draw(plan, _BLOCK, np.random.default_rng(_seed(seed, "sizes",
                                                                          block)))
        assert sizes is not None
        rng = np.random.default_rng(_seed(seed, i))
        text = language.text(sizes.tokens[j], rng)
        images = tuple(
            encode_image(_picture(gw * plan.patch, gh * plan.patch, rng, noisy=jpeg),
                         "jpeg" if jpeg else "png")
            for patches, aspect, jpeg in sizes.images[j]
            for gw, gh in [image_grid(patches, aspect)])
        gen_images = tuple(
            encode_image(_picture(plan.gen_side, plan.gen_side, rng, noisy=False), "png")
            for _ in range(sizes.gen[j]))
        audio = tuple(encode_audio(_input_mel(n, rng, plan)) for n in sizes.audio[j])
        gen_audio = tuple(encode_audio(_mel(n, rng)) for n in sizes.gen_audio[j])
        yield RawSample(key=sample_key(i), text=text, images=images, gen_images=gen_images,
                        audio=audio, gen_audio=gen_audio)


def provenance(program: ir.Program, seed: int) -> dict[str, Any]:
    """What the index records about a synthesised dataset."""
    return {"generator": "dtdsl.data.synth", "spec": program.name,
            "spec_sha256": program.source_sha256, "seed": seed}
