"""What a video clip costs in the backbone's sequence: the one rule for the cost model's
samples and the runtime (``data.video``), free of torch and of PyAV.

A clip of ``frames`` sampled frames is cut into temporal patches of ``temporal_patch``
frames (Qwen2-VL: 2), the last frame repeated to fill the last one, and each temporal
patch into the grid of one frame: ``ceil(frames / temporal_patch)`` grids of ``patches``
tokens each (``patches``: a frame's tokens, after any compression of its grid).
"""

from __future__ import annotations

from typing import Any

__all__ = ["clip_tokens", "padded_frames", "temporal_groups"]


def temporal_groups(frames: Any, temporal_patch: int = 1) -> Any:
    """The temporal patches of a clip of ``frames`` frames: ``ceil(frames /
    temporal_patch)``. Integers or NumPy integer arrays (elementwise)."""
    if temporal_patch < 1:
        raise ValueError(f"temporal_patch {temporal_patch}: must be at least 1")
    return -(-frames // temporal_patch)


def padded_frames(frames: Any, temporal_patch: int = 1) -> Any:
    """The frames a clip of ``frames`` frames has once its last frame is repeated up to
    a whole number of temporal patches."""
    return temporal_groups(frames, temporal_patch) * temporal_patch


def clip_tokens(frames: Any, patches: Any, temporal_patch: int = 1) -> Any:
    """The tokens of a clip of ``frames`` sampled frames of ``patches`` tokens each, cut
    into temporal patches of ``temporal_patch`` frames (module docstring). Integers or
    NumPy integer arrays (elementwise)."""
    return temporal_groups(frames, temporal_patch) * patches
