"""The measured data distribution of a dataset, from its index alone (``dtc data stats``).

``measure`` gives one list of values per spec quantity:

- ``text.tokens``: per sample, its tokens under the given tokenizer (``data.text``: special
  tokens and chat format included, as the backbone reads them), or else the index's
  ``text_tokens`` (``shards.count_text_tokens``: words and punctuation marks, the pieces
  the hashing tokenizer of synthetic data gives one id each). Samples whose text does
  not go with their images under that tokenizer are left out, as a run leaves them out;
- ``image.count`` and ``image.gen_count``: input images and images to generate per
  sample; ``image.patches``: per input image, the patches the encoder's
  ``images.ImagePolicy`` gives it (a Hugging Face tower's fixed size; else its sides
  rounded to whole patches, at most the spec's clamp high when given);
- ``audio.count``, ``audio.gen_count``: clips per sample; ``audio.frames``: per input
  clip, its frames when stored as ``.npy`` features, else its tokens (the spec's meaning of
  ``audio.frames``) under the audio encoder's rule (``data.media.ClipReader``: the spec's
  first audio encoder, or without a spec BEATs' 16 x 16 patches of 128 fbank bins),
  from its header: nothing is decoded;
- ``video.count``: clips per sample; ``video.frames`` and ``video.patches``: per clip,
  the frames the video encoder reads (sampled, rounded up to whole temporal patches) and
  the patches of one of them (the spec's first video encoder, or without a spec
  Qwen2-VL's 14-pixel patches of 2 frames), from its header.

Clips that would give no token (shorter than a row of patches) are left out of the
sizes, as a run leaves their samples out.

Counts of a modality are listed when any sample carries an item of it, per-item sizes
when there is at least one item, so every list is usable as it is. ``stats_json`` writes
them as ``{"text.tokens": [...], ...}``, the object form of an empirical file: a spec can
say ``text.tokens ~ empirical("stats.json")``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtdsl.data.images import ImagePolicy
from dtdsl.data.shards import Dataset, DatasetError

__all__ = ["DEFAULT_PATCH", "QuantityStats", "default_readers", "measure", "stats_json",
           "stats_table", "summarize"]

DEFAULT_PATCH = 14


def default_readers() -> dict[str, Any]:
    """The clip readers ``measure`` counts with when no spec says: BEATs' (16 x 16
    patches of 128 fbank bins) and Qwen2-VL's (14-pixel patches of 2 frames, 2 frames a
    second)."""
    from dtdsl.data.audio import AudioPolicy, FbankFeatures
    from dtdsl.data.media import DEFAULT_FPS, ClipReader
    from dtdsl.data.video import FrameSampling
    from dtdsl.ir.modal import InputRule

    return {"audio": ClipReader(rule=InputRule(name="", modality="audio", patch=16,
                                               channels=1, mel_bins=128),
                                audio=AudioPolicy(FbankFeatures.beats(128))),
            "video": ClipReader(rule=InputRule(name="", modality="video", patch=14,
                                               temporal_patch=2),
                                video=ImagePolicy(patch=14),
                                sampling=FrameSampling(fps=DEFAULT_FPS, multiple=2))}


def _shapes(reader: Any, clips: Any) -> list[tuple[int, ...]]:
    out = []
    for c in clips:
        try:
            out.append(reader.shape(c))
        except DatasetError:
            pass            # gives no token: its sample is left out of a run
    return out


def measure(dataset: Dataset, *, patch: int = DEFAULT_PATCH,
            max_patches: int | None = None, tokenizer: Any = None,
            progress: Any = None, images: ImagePolicy | None = None,
            readers: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """The values of each quantity over the dataset (see the module docstring);
    ``tokenizer``: a ``data.text`` tokenizer to count text with; ``images``: the image
    encoder's policy (a Hugging Face tower's fixed size), else native resolution in
    patches of ``patch`` under ``max_patches``; ``readers``: per modality (``audio``,
    ``video``) the ``data.media.ClipReader`` to count clips with (``default_readers``
    for those not given)."""
    given = readers or {}
    readers = {**default_readers(), **given}
    if patch < 1:
        raise ValueError(f"patch must be at least 1, not {patch}")
    if images is None:
        images = ImagePolicy(patch=patch, max_patches=max_patches)
    infos = [dataset.info(i) for i in range(len(dataset))]
    if tokenizer is not None:
        from dtdsl.data.text import token_layouts

        layouts = token_layouts(dataset, tokenizer, progress=progress, kinds=tuple(given))
        infos = [s for s, lay in zip(infos, layouts, strict=True) if lay is not None]
        text = [lay[0] for lay in layouts if lay is not None]
    else:
        text = [s.text_tokens for s in infos]
    out: dict[str, list[int]] = {"text.tokens": text}
    if any(s.images or s.gen_images for s in infos):
        out["image.count"] = [len(s.images) for s in infos]
        patches = [(ih // images.patch) * (iw // images.patch) for s in infos
                   for w, h in s.images for ih, iw in [images.shape(w, h)]]
        if patches:
            out["image.patches"] = patches
        out["image.gen_count"] = [len(s.gen_images) for s in infos]
    if any(s.audio_count or s.gen_audio_count for s in infos):
        out["audio.count"] = [s.audio_count for s in infos]
        audio = readers["audio"]
        frames = [n for s in infos for n in s.audio] + [
            audio.rule.tokens(shape) for s in infos for shape in _shapes(audio, s.audio_clips)]
        if frames:
            out["audio.frames"] = frames
        out["audio.gen_count"] = [s.gen_audio_count for s in infos]
    if any(s.videos for s in infos):
        out["video.count"] = [len(s.videos) for s in infos]
        video = readers["video"]
        shapes = [shape for s in infos for shape in _shapes(video, s.videos)]
        if shapes:
            p = video.rule.patch
            out["video.frames"] = [shape[0] for shape in shapes]
            out["video.patches"] = [(shape[-2] // p) * (shape[-1] // p) for shape in shapes]
    return out


@dataclass(frozen=True)
class QuantityStats:
    name: str
    count: int
    mean: float
    min: int
    p50: int
    p90: int
    p99: int
    max: int


def summarize(values: dict[str, list[int]]) -> list[QuantityStats]:
    """Count, mean, extremes and percentiles (values that occur: the inverted CDF) of each
    non-empty list."""
    out = []
    for name, items in values.items():
        if not items:
            continue
        array = np.asarray(items)
        p50, p90, p99 = np.percentile(array, [50, 90, 99], method="inverted_cdf")
        out.append(QuantityStats(name=name, count=len(array), mean=float(array.mean()),
                                 min=int(array.min()), p50=int(p50), p90=int(p90),
                                 p99=int(p99), max=int(array.max())))
    return out


def stats_table(stats: list[QuantityStats]):
    """A rich Table, one row per quantity."""
    from rich.table import Table

    table = Table()
    table.add_column("quantity", no_wrap=True)
    for column in ("count", "mean", "min", "p50", "p90", "p99", "max"):
        table.add_column(column, justify="right", no_wrap=True)
    for s in stats:
        table.add_row(s.name, f"{s.count:,}", f"{s.mean:.2f}", str(s.min), str(s.p50),
                      str(s.p90), str(s.p99), str(s.max))
    return table


def is_stats_json(data: bytes) -> bool:
    """Whether ``data`` is ``stats_json``'s: an object of quantities, each a list of
    numbers."""
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(found, dict) and all(
        isinstance(k, str) and isinstance(v, list) and
        all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        for k, v in found.items())


def stats_json(values: dict[str, list[int]]) -> str:
    """``{"quantity": [values...]}`` with one quantity per line."""
    lines = [f"  {json.dumps(name)}: {json.dumps(items)}" for name, items in values.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"
