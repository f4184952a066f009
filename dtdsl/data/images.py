"""Images as the encoder that reads them expects: size and normalisation from its
configuration.

``ImagePolicy.for_encoder(module, max_patches)`` gives one of two policies:

- **fixed size** for a Hugging Face vision tower (``arch = hf(...)``: CLIP, SigLIP), as its
  image processor does it: the folder's ``preprocessor_config.json`` when there is one
  (``size``, ``crop_size``, ``do_center_crop``, ``resample``, ``image_mean``,
  ``image_std``), else the family's defaults: CLIP resizes the shorter side to the tower's
  ``image_size`` (bicubic) and crops the centre square, with OpenAI's mean and std; SigLIP
  resizes to the square (bicubic), mean and std 0.5;
- **native resolution** for dtdsl's own ViT: each side rounded to whole patches (to whole
  blocks of ``block x block`` patches under a pixel-shuffling projector, whose grid must
  divide: ``ImageTokens.block``), both scaled down together to at most ``max_patches``
  (the clamp high of ``image.patches``), bilinear, mean and std 0.5 (pixels to
  ``[-1, 1]``).

Resizing runs in the preprocessing workers (``decode``), which ship uint8 pixels: a
quarter of the bytes of float32 ones on the wire, on the host-to-device copy and in pinned
memory. Samples keep them uint8 up to the encoder's device, where ``models.inputs.Pixels``
normalises each packed group of same-sized images in one pass (``normalize``'s arithmetic: a
per-channel affine, the same float32 operations in the same order, so equal to the bit):
no float32 conversion on the feed's thread, no per-image work on the training thread.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtdsl.ir.modal import HALF, encoder_norm

__all__ = ["ImagePolicy", "normalize", "patch_grid"]

_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def patch_grid(width: int, height: int, patch: int, max_patches: int | None = None,
               block: int = 1) -> tuple[int, int]:
    """Patches across and down for a ``width x height`` image: each side rounded to a
    whole number of ``block``s of patches (halves up, at least one), then both scaled down
    together, a block at a time, until there are at most ``max_patches`` (but one block
    of ``block x block`` patches at least)."""
    unit = patch * block
    gw, gh = max(1, int(width / unit + 0.5)), max(1, int(height / unit + 0.5))
    if max_patches is not None and gw * gh * block * block > max_patches:
        limit = max(1, max_patches // (block * block))
        scale = math.sqrt(limit / (gw * gh))
        gw, gh = max(1, math.floor(gw * scale)), max(1, math.floor(gh * scale))
        while gw * gh > limit:
            if gw >= gh:
                gw -= 1
            else:
                gh -= 1
    return gw * block, gh * block


@dataclass(frozen=True)
class ImagePolicy:
    """How images are sized and normalised for one encoder (module docstring)."""

    patch: int
    size: tuple[int, int] | None = None        # fixed (height, width); None: native
    shortest_edge: int | None = None           # fixed: resize the shorter side, then crop
    max_patches: int | None = None             # native: the patch budget
    block: int = 1                             # native: grid sides a multiple of this
    resample: str = "bilinear"
    mean: tuple[float, float, float] = HALF
    std: tuple[float, float, float] = HALF

    @classmethod
    def for_encoder(cls, module: Any, max_patches: int | None = None,
                    block: int = 1) -> ImagePolicy:
        """``block``: the multiple of patches a native-resolution grid's sides are
        (``ImageTokens.block`` of the encoder's projector). Mean and std: the encoder's
        (``ir.modal.encoder_norm``)."""
        arch = module.arch
        patch = getattr(arch, "patch", None) or 1
        mean, std = encoder_norm(module)
        hf = getattr(module, "hf", None)
        if hf is None or hf.family not in ("clip", "siglip") or not arch.image_size:
            return cls(patch=patch, max_patches=max_patches, block=block, mean=mean, std=std)
        side = int(arch.image_size)
        if hf.family == "clip":
            base = cls(patch=patch, size=(side, side), shortest_edge=side, resample="bicubic",
                       mean=mean, std=std)
        else:
            base = cls(patch=patch, size=(side, side), resample="bicubic", mean=mean, std=std)
        return base._with_processor(Path(hf.path) / "preprocessor_config.json")

    def _with_processor(self, file: Path) -> ImagePolicy:
        """This policy with the sizes a ``preprocessor_config.json`` says instead."""
        if not file.is_file():
            return self
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError, RecursionError):
            return self
        if not isinstance(config, dict):
            return self
        size, edge = self.size, self.shortest_edge
        given = config.get("size")
        if isinstance(given, int):
            given = {"shortest_edge": given}
        if isinstance(given, dict) and "shortest_edge" in given:
            edge = int(given["shortest_edge"])
            crop = config.get("crop_size", edge)
            crop = crop if isinstance(crop, dict) else {"height": crop, "width": crop}
            size = (int(crop["height"]), int(crop["width"])) if config.get(
                "do_center_crop", True) else (edge, edge)
        elif isinstance(given, dict) and "height" in given:
            size, edge = (int(given["height"]), int(given["width"])), None
        resample = _RESAMPLE.get(config.get("resample"), self.resample)
        return ImagePolicy(patch=self.patch, size=size, shortest_edge=edge,
                           resample=resample, mean=self.mean, std=self.std)

    def shape(self, width: int, height: int) -> tuple[int, int]:
        """The ``(height, width)`` in pixels an image of this size is given to the encoder.
        A fixed size is cut to whole patches: a patch embedding (a convolution, kernel =
        stride = patch) never reads the pixels right of and below the last whole patch
        (SigLIP-so400m: 384 x 384 in patches of 14, a 27 x 27 grid of 378 pixels)."""
        if self.size is not None:
            h, w = self.size
            return h // self.patch * self.patch, w // self.patch * self.patch
        gw, gh = patch_grid(width, height, self.patch, self.max_patches, self.block)
        return gh * self.patch, gw * self.patch

    def resize(self, img: Any) -> np.ndarray:
        """A Pillow RGB image to uint8 ``[3, H, W]`` of ``shape``."""
        from PIL import Image

        method = getattr(Image.Resampling, self.resample.upper())
        kept = self.shape(img.width, img.height)
        h, w = self.size if self.size is not None else kept
        if self.shortest_edge is not None:
            # transformers' rule: the shorter side exact, the longer int(edge * long / short)
            edge, short, long = self.shortest_edge, min(img.size), max(img.size)
            new = ((edge, int(edge * long / short)) if img.width <= img.height
                   else (int(edge * long / short), edge))
            if img.size != new:
                img = img.resize(new, method)
            left, top = (img.width - w) // 2, (img.height - h) // 2
            img = img.crop((left, top, left + w, top + h))
        elif img.size != (w, h):
            img = img.resize((w, h), method)
        if kept != (h, w):                  # the pixels no patch reads
            img = img.crop((0, 0, kept[1], kept[0]))
        return np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))


def normalize(pixels: Any, mean: tuple[float, ...] = HALF, std: tuple[float, ...] = HALF):
    """uint8 ``[3, H, W]`` pixels (numpy or torch) to the float32 tensor the encoder reads:
    ``(x / 255 - mean) / std`` per channel."""
    import torch

    if isinstance(pixels, torch.Tensor):
        x = pixels.to(torch.float32)
    else:                  # a copy in float32 (the wire's arrays are read-only)
        x = torch.from_numpy(np.asarray(pixels).astype(np.float32))
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return x.div_(255.0).sub_(m).div_(s)
