"""Media written for data tests: WebDataset shards of images, audio and video (as
webdataset's ShardWriter writes them), single clips, and images broken on purpose."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import webdataset as wds

from dtdsl.data.shards import write_dataset


def write_shards(root: Path, n: int = 48, per_shard: int = 10, *, gen_every: int = 3,
                 seed: int = 0) -> list[str]:
    """``n`` samples of a JPEG and a caption (every ``gen_every``-th also an image to
    generate, ``gen.jpg``), ``per_shard`` to a tar, written by webdataset's ShardWriter.
    Returns the keys."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    with wds.ShardWriter(str(root / "%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            w, h = SIZES[i % len(SIZES)]
            sample = {"__key__": f"s{i:05d}", "jpg": _jpeg(rng, w, h),
                      "txt": " ".join(f"word{rng.integers(100)}" for _ in range(5 + i % 7)),
                      "json": {"source": "test", "i": i}}
            if gen_every and i % gen_every == 0:
                sample["gen.jpg"] = _jpeg(rng, 32, 32)
            sink.write(sample)
            keys.append(f"s{i:05d}")
    return keys


def write_media_shards(root: Path, n: int = 24, per_shard: int = 8, seed: int = 0,
                       wav: bool = False) -> list[str]:
    """``n`` samples, written by webdataset's ShardWriter: a caption (some with
    placeholders), most with an image, one or two flac clips (22.05 or 16 kHz, 0.2 to
    0.55 s; ``wav``: the second clip, and the first of every other sample, 16-bit WAV),
    every third an mp4 (4 to 9 frames of 16x16 or 24x16). Returns the keys."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    with wds.ShardWriter(str(root / "%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            sample = {"__key__": f"m{i:04d}", "txt": TEXTS[i % len(TEXTS)]}
            if i % 4:
                sample["jpg"] = _jpeg(rng, 32, 32)
            first = "wav" if wav and i % 2 else "flac"
            sample[f"0.{first}"] = _flac(rng, 0.2 + 0.05 * (i % 8),
                                         22_050 if i % 2 else 16_000, first.upper())
            if i % 3 == 1:
                second = "wav" if wav else "flac"
                sample[f"1.{second}"] = _flac(rng, 0.3, 16_000, second.upper())
            if i % 3 == 2:                  # the samples whose text has <video>
                sample["mp4"] = write_clip(4 + i % 6, width=16 + 8 * (i % 2), height=16)
            sink.write(sample)
            keys.append(f"m{i:04d}")
    return keys


def _llava(tmp_path: Path) -> Path:
    """A LLaVA JSON with audio and video fields beside an image folder: a clip list, a
    single path, a hostile path, a missing clip, a damaged clip."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.flac").write_bytes(_flac(rng, 0.3, 16_000))
    (folder / "b.wav").write_bytes(_flac(rng, 0.25, 22_050))     # a FLAC named .wav reads
    (folder / "v.mp4").write_bytes(write_clip(6, width=16, height=16))
    (folder / "bad.mp4").write_bytes(b"\0" * 100)
    (tmp_path / "secret.flac").write_bytes(_flac(rng, 0.3, 16_000))
    (folder / "c.jpg").write_bytes(_jpeg(rng, 32, 32))

    def turn(text: str) -> list[dict]:
        return [{"from": "human", "value": text}, {"from": "gpt", "value": "a cat sitting"}]

    records = [
        {"id": "both", "image": "c.jpg", "audio": ["a.flac", "b.wav"], "video": "v.mp4",
         "conversations": turn("<image> What is in the image? <audio> then <video>")},
        {"id": "one", "audio": "a.flac", "conversations": turn("Describe the picture.")},
        {"id": "out", "audio": "../secret.flac", "conversations": turn("a dog")},
        {"id": "gone", "video": "nope.mp4", "conversations": turn("a dog")},
        {"id": "junk", "video": "bad.mp4", "conversations": turn("a dog")},
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records))
    return path


def write_clip(frames: int = 12, *, codec: str = "libx264", fmt: str = "mp4",
               width: int = 32, height: int = 32, fps: int = 10,
               options: dict[str, str] | None = None, texture: bool = False) -> bytes:
    """A clip whose frame i is grey level ``level(i)``; with ``texture`` only its 16x16
    top-left block is, over moving noise (which makes x264 use B-frames)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = options or {}
        for i in range(frames):
            if texture:
                pixels = np.roll(noise, 2 * i, axis=1)
                pixels[:16, :16] = level(i)
            else:
                pixels = np.full((height, width, 3), level(i), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def image_samples(program, n: int) -> list[int]:
    """The synthesised samples (``corrupt_dataset``'s) that carry an input image."""
    from dtdsl.data.synth import synthesize

    return [k for k, s in enumerate(synthesize(program, n, seed=5)) if s.images]


def corrupt_dataset(root: Path, program, n: int, bad: dict[int, tuple[str, float]]) -> Path:
    """``n`` synthesised samples of ``program`` in a dataset, the first image of each sample
    ``k`` in ``bad`` broken as ``bad[k]`` says (a PNG when scrambled)."""
    from dtdsl.data.synth import synthesize

    samples = list(synthesize(program, n, seed=5))
    for k, (how, at) in bad.items():
        image = samples[k].images[0]
        if how == "scramble" and image.format != "png":
            from PIL import Image

            from dtdsl.data.encode import encode_image

            pixels = np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB"))
            image = encode_image(pixels, "png")
        broken = dataclasses.replace(image, data=_broken(image.data, how, at))
        samples[k] = dataclasses.replace(samples[k], images=(broken, *samples[k].images[1:]))
    write_dataset(root, samples, samples_per_shard=16)
    return root


SIZES = [(32, 32), (64, 64), (48, 40)]     # (width, height)


def _jpeg(rng: np.random.Generator, w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


TEXTS = ["a photo of a cat <audio> sitting on a red chair",
         "What is in the image? There is a dog running in the park.",
         "<video> Describe the picture in detail. A man rides a bicycle <audio> along it."]


def _flac(rng: np.random.Generator, seconds: float, rate: int, fmt: str = "FLAC") -> bytes:
    buf = io.BytesIO()
    wave = (0.1 * rng.standard_normal(int(seconds * rate))).astype(np.float32)
    sf.write(buf, wave, rate, format=fmt)
    return buf.getvalue()


STEP, BASE, CYCLE = 8, 8, 30     # frame i shows grey level BASE + STEP * (i % CYCLE)


def level(i: int) -> int:
    return BASE + STEP * (i % CYCLE)


def _broken(data: bytes, how: str, at: float) -> bytes:
    """The image with its body cut off (``at``: the fraction kept) or scrambled; its
    header still reads (the index takes it), its pixels do not decode."""
    from PIL import Image

    start = _body(data)
    if how == "cut":
        out = data[:start + int((len(data) - start) * at)]
    else:           # a PNG's IDAT: its CRC and its zlib stream broken
        out = bytearray(data)
        for j in range(start, min(len(out) - 12, start + 16)):
            out[j] ^= 0x5A
        out = bytes(out)
    with Image.open(io.BytesIO(out)) as img:
        assert img.size                                 # the header reads
    with pytest.raises(Exception), Image.open(io.BytesIO(out)) as img:  # noqa: B017
        img.load()
    return out


def _body(data: bytes) -> int:
    """Where an image's pixel data starts (after the header Pillow reads to size it)."""
    if data.startswith(b"\x89PNG"):
        return data.index(b"IDAT") + 4
    at = data.index(b"\xff\xda")                      # JPEG: the start of scan
    return at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
