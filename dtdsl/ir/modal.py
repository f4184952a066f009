"""What each encoder reads, per modality: the one rule for an item's tensor, its patches
and its tokens in the backbone, read by the data layer, the model, the runtime and the
cost model (``cost.samples``) alike.

An *item* is one input of one encoder: an image, an audio clip, a video clip.

- image ``[3, H, W]``: a ViT's ``patch x patch`` patches, ``(H/p)(W/p)`` of them, which
  the projector may compress (``ir.program.ImageTokens``). A drawn item of ``P`` patches
  is a square image ``g * p`` pixels wide, ``g = round(sqrt(P))`` (a multiple of the
  compression's block).
- audio ``[T, M]``: a log-mel / fbank spectrogram of ``T`` frames and ``M = mel_bins``
  bins (BEATs: 128), read as a one-channel image: ``patch x patch`` patches along time
  and frequency, ``(T/p)(M/p)`` tokens. The data block's ``audio.frames`` is tokens per
  clip (``ir.program.QUANTITIES``): a drawn clip of ``n`` tokens has
  ``rows = max(1, round(n / (M/p)))`` rows of patches, ``T = rows * p`` frames and
  ``rows * (M/p)`` tokens (``ir.clips.audio_rows``, which the cost model applies too; a
  clip read from a file has the whole rows of its fbank frames, ``data.media``). An
  encoder of ``C = in_channels > 1`` (stereo, binaural, a microphone array) reads
  ``[T, C, M]``, an fbank per channel, time first as every audio item (a clip's frames
  are its first axis wherever it is cut or counted): its patches are ``C x patch x
  patch`` values in (channel, time, frequency) order, its tokens and grid those of one
  channel, so ``C`` changes the patch width alone, never the token count. An audio
  tower with Whisper's convolutional stem reads a clip whole, ``[2 * P, M]`` (30 s,
  ``P = max_source_positions``), and gives ``P`` tokens whatever ``audio.frames`` says.
  An audio encoder without a patch size (``TransformerArch.stem == "frames"``) reads its
  fbank a frame a token: ``[T, M]`` (``[T, C, M]``), grid ``(T, 1)``, each frame's
  ``in_channels x M`` values (channel-major) one patch, ``T`` tokens; a drawn clip of
  ``n`` tokens has ``max(1, n)`` frames (rows of one frame, one column: the cost model
  prices the drawn tokens as they are).
- video ``[F, 3, H, W]`` (Qwen2-VL style): patches of ``temporal_patch`` frames x
  ``patch x patch`` pixels, each flattened in (channel, frame, row, column) order,
  ``patch_dim = 3 * temporal_patch * p^2``; ``F`` is ``video.frames`` rounded up to a
  multiple of ``temporal_patch`` (``ir.clips.padded_frames``: the last frame repeated, as
  Qwen2-VL does; a clip read from a file: its sampled frames, ``data.media``), so a clip
  has ``F / temporal_patch * (H/p)(W/p)`` tokens. A drawn clip's frames are square,
  ``g = round(sqrt(video.patches))`` patches a side.

Audio and video tokens reach the backbone one per patch (their projectors do not
compress). ``EncoderInputs`` holds the rule of every encoder of a program, in spec order.

Several encoders of one modality encode the same items (hybrid towers, ``data.decode``):
a sample's items of a modality are drawn once, and each encoder's rule reads a drawn
item's size (``image.patches``, ``audio.frames``, ``video.frames`` and ``video.patches``)
as its own, so each has its own shape and tokens of it (``cost.samples``,
``data.sample.sample_sizes``); an item read from a file is sized by each encoder's own
policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dtdsl.ir import program as ir
from dtdsl.ir.clips import audio_rows, clip_tokens, padded_frames

if TYPE_CHECKING:       # the cost model reads these rules without importing torch
    import torch

__all__ = ["CLIP_MEAN", "CLIP_STD", "HALF", "EncoderInputs", "InputRule", "drawn_tokens",
           "encoder_inputs", "encoder_norm", "pixel_norm"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class InputRule:
    """One encoder's items: their shapes, patches and tokens (module docstring)."""

    name: str                       # the encoder
    modality: str                   # image, audio, video
    patch: int = 1
    channels: int = 3               # in_channels
    mel_bins: int = 128             # audio
    temporal_patch: int = 1         # video
    image: ir.ImageTokens | None = None   # image: the projector's compression
    # Audio towers with Whisper's convolutional stem (``TransformerArch.stem``): a clip is
    # ``2 * positions`` frames of ``channels`` mel bins, read whole (no patches), and
    # gives ``positions`` tokens. 0: a patch stem.
    whisper_positions: int = 0
    # Audio encoders without a patch size (``TransformerArch.stem == "frames"``): a token
    # per fbank frame of ``mel_bins`` bins (``patch`` is 1).
    frames: bool = False

    @property
    def item_shape(self) -> tuple[int, ...]:
        """An fbank clip's shape after its frames (patch and frame stems): ``(M,)`` for
        one channel, ``(C, M)`` for ``C`` (module docstring)."""
        return (self.mel_bins,) if self.channels == 1 else (self.channels, self.mel_bins)

    @staticmethod
    def of(program: ir.Program, module: ir.Module) -> InputRule:
        """The rule of encoder ``module``."""
        arch = module.arch
        stem = getattr(arch, "stem", "patch")
        whisper, frames = stem == "whisper_conv", module.modality == "audio" and stem == "frames"
        patch = 1 if frames else getattr(arch, "patch", None) or 1
        image = None
        if module.modality == "image":
            proj = next((p for p in program.projectors if p.source == module.name
                         and p.target == program.backbone.name), None)
            image = ir.ImageTokens(patch=patch, compress=proj.compress if proj else None)
        return InputRule(name=module.name, modality=module.modality or "image", patch=patch,
                         channels=getattr(arch, "in_channels", None) or
                         (1 if module.modality == "audio" else 3),
                         mel_bins=getattr(arch, "mel_bins", 128),
                         temporal_patch=getattr(arch, "temporal_patch", 1), image=image,
                         whisper_positions=arch.clip_tokens(0)
                         if whisper and arch.max_source_positions else 0,
                         frames=frames)

    @property
    def patch_dim(self) -> int:
        """The width of one flattened patch."""
        if self.whisper_positions:
            return self.channels            # a frame of mel bins
        if self.frames:
            return self.channels * self.mel_bins
        t = self.temporal_patch if self.modality == "video" else 1
        return self.channels * t * self.patch ** 2

    @property
    def columns(self) -> int:
        """Audio: patches across the mel bins (one: a frame stem's frame is one)."""
        return 1 if self.frames else max(1, self.mel_bins // self.patch)

    def grid(self, shape: Sequence[int]) -> tuple[int, int]:
        """An item's patch grid (rows, columns) as the encoder's positions see it: an
        image's; an audio clip's (time, frequency); a video's (frames / temporal_patch
        x rows, columns)."""
        p = self.patch
        if self.whisper_positions:
            return shape[0] // 2, 1         # the stem's stride 2 over the frames
        if self.frames:
            return shape[0], 1              # a token per frame
        if self.modality == "audio":       # [T, M] or [T, C, M]: frames first
            return shape[0] // p, shape[-1] // p
        if self.modality == "video":
            return (shape[0] // self.temporal_patch) * (shape[-2] // p), shape[-1] // p
        return shape[-2] // p, shape[-1] // p

    def patches(self, shape: Sequence[int]) -> int:
        """The patches (encoder tokens) of an item of tensor shape ``shape``."""
        rows, cols = self.grid(shape)
        return rows * cols

    def tokens(self, shape: Sequence[int]) -> int:
        """An item's positions in the backbone's sequence."""
        if self.image is not None:
            return self.image(shape[-2], shape[-1])
        return self.patches(shape)

    def synthetic_shape(self, size: int, patches: int = 0) -> tuple[int, ...]:
        """The tensor shape of a drawn item: image ``size`` patches; audio ``size`` tokens;
        video ``size`` frames of ``patches`` patches."""
        p = self.patch
        if self.whisper_positions:      # every clip padded or cut to 30 s
            return (2 * self.whisper_positions, self.channels)
        if self.modality == "audio":
            return (audio_rows(size, self.columns) * p, *self.item_shape)
        if self.modality == "video":
            side = max(1, round(math.sqrt(max(patches, 0)))) * p
            return (padded_frames(size, self.temporal_patch), self.channels, side, side)
        assert self.image is not None
        side = self.image.square_side(size) * p
        return (self.channels, side, side)

    def patchify(self, items: torch.Tensor) -> torch.Tensor:
        """Stacked items ``[B, *shape]`` to flattened patches ``[B, N, patch_dim]``, in the
        order of ``grid`` (a linear map of them is the patch embedding)."""
        p = self.patch
        if self.whisper_positions:
            return items                            # [B, T, M]: the stem reads frames
        if self.frames:                             # [B, T, (C,) M]: a frame a patch
            return items.reshape(items.shape[0], items.shape[1], -1)
        if self.modality == "audio":                # a C-channel image [B, C, T, M]
            items = items[:, None] if items.dim() == 3 else items.transpose(1, 2)
        if self.modality != "video":
            b, c, hgt, wid = items.shape
            x = items.reshape(b, c, hgt // p, p, wid // p, p)
            return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (hgt // p) * (wid // p), c * p * p)
        b, f, c, hgt, wid = items.shape
        t = self.temporal_patch
        x = items.reshape(b, f // t, t, c, hgt // p, p, wid // p, p)
        # Per (frame group, row, column) one patch in (channel, frame, row, column) order.
        x = x.permute(0, 1, 4, 6, 3, 2, 5, 7)
        return x.reshape(b, (f // t) * (hgt // p) * (wid // p), c * t * p * p)


@dataclass(frozen=True)
class EncoderInputs:
    """Every encoder's ``InputRule``, in spec order. ``image``: the encoder whose items
    are a sample's ``images`` (the first image encoder: uint8 pixels, normalised on its
    device); every other encoder's are in the sample's ``inputs``, by name (a second
    image encoder's are the same images at its size, float32, ``data.decode``)."""

    rules: tuple[InputRule, ...] = ()
    image: str | None = None

    @staticmethod
    def of_image(tokens: ir.ImageTokens) -> EncoderInputs:
        """The rule of a program whose only encoder is an image encoder (or none)."""
        return EncoderInputs(rules=(InputRule(name="", modality="image", patch=tokens.patch,
                                              image=tokens),), image="")

    def rule(self, name: str) -> InputRule:
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(f"no encoder '{name}' (encoders: {[r.name for r in self.rules]})")

    @property
    def image_tokens(self) -> ir.ImageTokens:
        """The image encoder's ``ImageTokens`` (patch 1 without one)."""
        if self.image is None:
            return ir.ImageTokens()
        tokens = self.rule(self.image).image
        assert tokens is not None
        return tokens

    @property
    def others(self) -> tuple[InputRule, ...]:
        """The encoders whose items are a sample's ``inputs``, in spec order."""
        return tuple(r for r in self.rules if r.name != self.image)

    def __call__(self, height: int, width: int) -> int:
        """An image's tokens (``ImageTokens``' call)."""
        return self.image_tokens(height, width)


def encoder_inputs(program: ir.Program) -> EncoderInputs:
    """The rules of ``program``'s encoders."""
    image = next((m.name for m in program.encoders if m.modality == "image"), None)
    return EncoderInputs(rules=tuple(InputRule.of(program, m) for m in program.encoders),
                         image=image)


def drawn_tokens(rule: InputRule, sizes: np.ndarray, patches: np.ndarray | None = None
                 ) -> np.ndarray:
    """Encoder tokens of drawn items (the cost model's ``ItemSet.sizes``), equal to
    ``rule.patches(rule.synthetic_shape(size, patches))`` item by item: audio ``sizes``
    tokens rounded to whole rows of patches; video ``sizes`` frames (rounded up to whole
    temporal patches) of ``patches`` patches (square grids); image patches as drawn."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if rule.whisper_positions:          # TransformerArch.clip_tokens: every clip is 30 s
        return np.full(sizes.shape, rule.whisper_positions, dtype=np.int64)
    if rule.modality == "audio":
        return audio_rows(sizes, rule.columns) * rule.columns
    if rule.modality == "video":
        assert patches is not None
        side = np.maximum(1, np.rint(np.sqrt(np.maximum(patches, 0)))).astype(np.int64)
        return clip_tokens(padded_frames(sizes, rule.temporal_patch), side * side,
                           rule.temporal_patch)
    return sizes


def encoder_norm(module: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std image encoder ``module`` normalises its pixels with: a Hugging Face
    CLIP or SigLIP tower's image processor's (``preprocessor_config.json``'s
    ``image_mean`` and ``image_std``), else its family's (CLIP's, SigLIP's 0.5); 0.5 for
    dtdsl's own ViT (pixels to ``[-1, 1]``)."""
    arch = module.arch
    hf = getattr(module, "hf", None)
    if hf is None or hf.family not in ("clip", "siglip") or not getattr(arch, "image_size",
                                                                        None):
        return HALF, HALF
    mean, std = (CLIP_MEAN, CLIP_STD) if hf.family == "clip" else (HALF, HALF)
    file = Path(hf.path) / "preprocessor_config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError, RecursionError):
        config = {}
    if not isinstance(config, dict):
        return mean, std
    return tuple(config.get("image_mean", mean)), tuple(config.get("image_std", std))


def pixel_norm(program: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std the spec's image encoder normalises its pixels with
    (``encoder_norm``; 0.5 and 0.5 without one)."""
    image = next((m for m in program.encoders if m.modality == "image"), None)
    return (HALF, HALF) if image is None else encoder_norm(image)
