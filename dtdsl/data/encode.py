"""Images and log-mel frames encoded as a dtdsl dataset stores them (``data.shards``):
what ``synth`` and tests write samples with."""

from __future__ import annotations

import io
from typing import Literal

import numpy as np

from dtdsl.data.shards import EncodedAudio, EncodedImage

__all__ = ["encode_audio", "encode_image"]


def encode_image(pixels: np.ndarray, format: Literal["png", "jpeg"], *,
                 quality: int = 90) -> EncodedImage:
    """Encode uint8 ``[H, W, 3]`` pixels as PNG (fast, level 1) or JPEG (``quality``)."""
    from PIL import Image

    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected uint8 [H, W, 3] pixels, not {pixels.dtype} "
                         f"{list(pixels.shape)}")
    buf = io.BytesIO()
    image = Image.fromarray(pixels, "RGB")
    if format == "png":
        image.save(buf, "PNG", compress_level=1)
    elif format == "jpeg":
        image.save(buf, "JPEG", quality=quality)
    else:
        raise ValueError(f"image format must be png or jpeg, not {format!r}")
    return EncodedImage(format=format, data=buf.getvalue(), width=pixels.shape[1],
                        height=pixels.shape[0])


def encode_audio(frames: np.ndarray) -> EncodedAudio:
    """Store a ``[frames, bins]`` or ``[frames, channels, bins]`` array (converted to
    little-endian float32)."""
    if frames.ndim not in (2, 3) or (frames.ndim == 3 and frames.shape[1] < 2):
        raise ValueError("expected [frames, bins] or [frames, channels > 1, bins] audio, "
                         f"not shape {list(frames.shape)}")
    array = np.ascontiguousarray(frames, dtype="<f4")
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return EncodedAudio(data=buf.getvalue(), frames=array.shape[0], bins=array.shape[-1],
                        channels=array.shape[1] if array.ndim == 3 else 1)
