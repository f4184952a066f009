"""What an audio or video clip costs in the backbone's sequence: the one rule for the cost
model's samples, the data layer (``ir.modal``, ``data.media``) and the runtime, free of
torch, NumPy-optional and of PyAV.

Audio (an encoder with a patch stem): a clip of about ``tokens`` tokens with ``columns``
patches across its mel bins has ``audio_rows(tokens, columns)`` rows of patches in time
(``max(1, round(tokens / columns))``); a clip decoded from a file has ``frames // patch``
rows of its fbank frames. An encoder without a patch (a frame stem) has one column: a clip
is its tokens in frames. An encoder with Whisper's stem reads every clip as 30 s and gives
``TransformerArch.clip_tokens`` (``max_source_positions``) tokens, whatever its length.

Video: a clip of ``frames`` sampled frames is cut into temporal patches of ``temporal_patch``
frames (Qwen2-VL: 2), the last frame repeated to fill the last one, and each temporal
patch into the grid of one frame: ``ceil(frames / temporal_patch)`` grids of ``patches``
tokens each (``patches``: a frame's tokens, after any compression of its grid).
"""

from __future__ import annotations

from typing import Any

__all__ = ["audio_rows", "clip_tokens", "padded_frames", "temporal_groups"]


def audio_rows(tokens: Any, columns: int) -> Any:
    """Rows of patches (in time) of an audio clip of about ``tokens`` tokens with
    ``columns`` patches across its mel bins: ``max(1, round(tokens / columns))``. Integers
    or NumPy arrays (elementwise, int64)."""
    if hasattr(tokens, "shape"):
        import numpy as np

        return np.maximum(1, np.rint(np.asarray(tokens) / columns)).astype(np.int64)
    return max(1, round(tokens / columns))


def temporal_groups(frames: Any, temporal_patch: int = 1) -> Any:
    """The temporal patches of a clip of ``frames`` frames: ``ceil(frames /
    temporal_patch)``. Integers or NumPy integer arrays (elementwise)."""
    if temporal_patch < 1:
        raise ValueError(f"temporal_patch {temporal_patch}: must be at least 1")
    return -(-frames // temporal_patch)


def padded_frames(frames: Any, temporal_patch: int = 1) -> Any:
    """The frames a clip of ``frames`` frames has once its last frame is repeated up to
    a whole number of temporal patches (at least one: a clip of no frame is given one)."""
    if hasattr(frames, "shape"):
        import numpy as np

        frames = np.maximum(frames, 1)
    else:
        frames = max(frames, 1)
    return temporal_groups(frames, temporal_patch) * temporal_patch


def clip_tokens(frames: Any, patches: Any, temporal_patch: int = 1) -> Any:
    """The tokens of a clip of ``frames`` sampled frames of ``patches`` tokens each, cut
    into temporal patches of ``temporal_patch`` frames (module docstring). Integers or
    NumPy integer arrays (elementwise)."""
    return temporal_groups(frames, temporal_patch) * patches
