"""Video clips as a video encoder reads them: frames sampled from a clip's bytes and
decoded in the preprocessing workers with PyAV, sized as images are, and cut into
Qwen2-VL-style temporal patches.

``decode_clip(data, name, policy=..., sampling=...)`` gives uint8 ``[F, 3, H, W]``:

- **which frames** (``FrameSampling``): a fixed count evenly over the clip, or ``fps``
  frames per second of it (Qwen2-VL's default: 2) bounded by ``min_frames`` and
  ``max_frames`` (4 and 768) and by the frames the clip has, floored to a multiple of
  ``multiple`` (the encoder's temporal patch: whole temporal patches, as qwen-vl-utils
  samples). The frames are the clip's ``round(linspace(0, total - 1, F))``-th in
  presentation order (qwen-vl-utils' rule); a fixed count above the clip's frames repeats
  frames, so a clip always gives what the spec's ``video.frames`` says;
- **decoding only what it needs**: a first pass reads the packets' headers only (no
  decoding): their timestamps, which are keyframes. The frame count, the duration and
  the sampled frames come from them, not from the container's header, which a damaged
  or hostile file can make say anything. The second pass decodes only the packets a
  sampled frame needs: in each group of pictures (a keyframe up to the next) that holds
  one, from the keyframe up to its last sampled frame in decode order; the decoder is
  drained and flushed at each gap and never sees the packets between. Frame threads
  (``thread_type`` AUTO). Only the sampled frames are kept, each resized as soon as it
  is decoded: memory is the output's, whatever the clip's length;
- **sized as images are**: every frame of a clip to the one ``(height, width)`` the
  encoder's ``images.ImagePolicy`` gives the clip's frame size (native resolution in
  whole patches, or a tower's fixed size), with Pillow and the policy's filter, as
  ``decode`` sizes an image; pixels stay uint8 up to the encoder's device
  (``images.Pixels`` normalises them there).

Hostile input costs bounded memory and time (``VideoLimits``): frames above
``max_pixels`` are refused from the header and by the decoder itself (FFmpeg's
``max_pixels``), clips of more than ``max_frames`` packets when indexed, and clips whose
sampled frames need more than ``max_decoded_pixels`` pixels decoded, before any is (and
while decoding, should a stream grow its frames). Every problem is one ``VideoError``
(a ``DatasetError``) naming the clip. A packet the decoder refuses is skipped (FFmpeg
conceals what it can); a sampled frame that does not come out takes the nearest sampled
frame that did; a clip none of whose sampled frames decodes is refused.

``patchify(frames, patch, temporal_patch)`` cuts ``[F, C, H, W]`` frames into the
``[ceil(F / tp) * gh * gw, C * tp * p * p]`` patches Qwen2-VL's vision tower reads
(transformers' ``Qwen2VLVideoProcessor.patchify``): the last frame repeated to whole
temporal patches, tokens in temporal then raster order, each patch's values in channel,
frame, row, column order, which is the order of the weights of its ``Conv3d`` patch
embedding (``linear_patch_weight``). ``merge`` > 1 orders the tokens as transformers
does for its ``PatchMerger`` (each ``merge x merge`` block of a grid consecutive); only
an encoder that merges so may read that order. ``ir.clips.clip_tokens`` is what a clip
costs in tokens.
"""

from __future__ import annotations

import io
import math
from array import array
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dtdsl.data.images import ImagePolicy
from dtdsl.data.shards import DatasetError
from dtdsl.ir.clips import clip_tokens, padded_frames, temporal_groups

__all__ = [
    "ClipIndex",
    "FrameSampling",
    "VideoError",
    "VideoLimits",
    "clip_tokens",
    "decode_clip",
    "index_clip",
    "linear_patch_weight",
    "padded_frames",
    "patchify",
    "sample_indices",
    "temporal_groups",
]


class VideoError(DatasetError):
    """A clip that cannot be read: the message names it and says why."""


@dataclass(frozen=True)
class FrameSampling:
    """Which frames of a clip an encoder reads (module docstring): ``frames`` evenly
    over the clip, or (``frames`` None) ``fps`` frames per second of it, between
    ``min_frames`` and ``max_frames`` and at most the clip's frames, floored to a
    multiple of ``multiple`` (at least one frame)."""

    frames: int | None = None
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    multiple: int = 1

    def __post_init__(self) -> None:
        if self.frames is not None and self.frames < 1:
            raise ValueError(f"frames={self.frames}: sample at least one frame per clip")
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps={self.fps}: give a positive number of frames per second")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"min_frames={self.min_frames}, max_frames={self.max_frames}: "
                             "need 1 <= min_frames <= max_frames")
        if self.multiple < 1:
            raise ValueError(f"multiple={self.multiple}: must be at least 1")

    def count(self, total: int, duration: float | None) -> int:
        """The frames sampled from a clip of ``total`` frames lasting ``duration``
        seconds (None: unknown, which only a fixed count can do without)."""
        if self.frames is not None:
            return self.frames
        if duration is None:
            raise ValueError("it has no timestamps or frame rate to sample frames per "
                             "second by; sample a fixed count of frames instead")
        n = min(max(duration * self.fps, self.min_frames), self.max_frames, total)
        n = math.floor(n)
        if n >= self.multiple:
            n -= n % self.multiple
        return max(1, n)


@dataclass(frozen=True)
class VideoLimits:
    """What one clip may cost (module docstring). The defaults take 8K frames and hours
    of video and refuse what no real clip needs."""

    max_pixels: int = 1 << 25             # per frame: 7680 x 4320 is 33.2M
    max_frames: int = 1 << 20             # packets in the clip: 9.7 hours at 30 fps
    max_decoded_pixels: int = 1 << 36     # to sample one clip: 33k frames of 1080p


def sample_indices(count: int, total: int) -> np.ndarray:
    """The positions (presentation order) of ``count`` frames evenly over ``total``:
    ``round(linspace(0, total - 1, count))``, qwen-vl-utils' rule (repeats when
    ``count`` > ``total``)."""
    if total < 1 or count < 1:
        raise ValueError(f"cannot sample {count} of {total} frames")
    return np.linspace(0, total - 1, count).round().astype(np.int64)


@dataclass(frozen=True, eq=False)
class ClipIndex:
    """A clip's video packets in decode order, read without decoding (``index_clip``)."""

    width: int                  # the header's frame size (0: not given)
    height: int
    pts: np.ndarray             # int64 per packet: its timestamp (``ordinal``: its position)
    gop: np.ndarray             # int64 per packet: its group of pictures (keyframes start one)
    shown: np.ndarray           # bool per packet: makes a frame the clip shows (not discarded)
    ordinal: bool               # the packets carry no timestamps: positions stand in for them
    duration: float | None      # seconds (None: no timestamps, no frame rate)

    @property
    def frames(self) -> int:
        """The frames the clip shows."""
        return int(self.shown.sum())

    def sampled(self, sampling: FrameSampling) -> int:
        """The frames ``decode_clip`` gives for this clip under ``sampling``
        (ValueError: sampling by fps a clip with no timing)."""
        return sampling.count(self.frames, self.duration)

    def shape(self, policy: ImagePolicy) -> tuple[int, int] | None:
        """The ``(height, width)`` ``decode_clip`` gives this clip's frames under
        ``policy`` (None: the header gives no frame size; the first frame decoded
        decides). With ``sampled``, a clip's tokens before decoding it
        (``ir.clips.clip_tokens``)."""
        if policy.size is not None:
            return policy.size
        if self.width < 1 or self.height < 1:
            return None
        return policy.shape(self.width, self.height)

    def order(self) -> np.ndarray:
        """The shown packets' positions in presentation order (by timestamp, ties in
        decode order)."""
        shown = np.flatnonzero(self.shown)
        return shown[np.argsort(self.pts[shown], kind="stable")]


def _fail(name: str, why: str) -> VideoError:
    return VideoError(f"video {name}: {why}")


def _why(err: Exception) -> str:
    """FFmpeg's words for an error, without PyAV's errno and call."""
    return str(getattr(err, "strerror", None) or err)


def _open(data: bytes, name: str) -> tuple[Any, Any]:
    """The container and its first video stream."""
    import av

    try:
        # metadata that is not UTF-8 is no reason to refuse the pictures
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError, EOFError, UnicodeDecodeError) as err:
        raise _fail(name, f"not a video container PyAV reads ({_why(err)})") from None
    if not container.streams.video:
        container.close()
        raise _fail(name, "has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:     # a codec FFmpeg does not know (or a damaged id)
        container.close()
        raise _fail(name, "its video stream's codec is not one FFmpeg decodes")
    return container, stream


def _check_size(name: str, width: int, height: int, limits: VideoLimits) -> None:
    if width < 0 or height < 0 or width * height > limits.max_pixels:
        raise _fail(name, f"frames of {width}x{height} pixels, above the limit of "
                    f"{limits.max_pixels} pixels a frame; scale the clip down")


def _duration(stream: Any, pts: np.ndarray, shown: np.ndarray, ordinal: bool,
              last_duration: int) -> float | None:
    """The clip's length in seconds from its packets' timestamps (the span of the shown
    frames, with one frame's length more), or from its frame rate without timestamps."""
    total = int(shown.sum())
    if ordinal or stream.time_base is None or not stream.time_base:
        rate = stream.guessed_rate or stream.average_rate
        return total / float(rate) if rate and float(rate) > 0 else None
    seen = pts[shown]
    span = (float(seen.max()) - float(seen.min())) * float(stream.time_base)
    if total > 1:
        return span * total / (total - 1)
    return max(last_duration, 0) * float(stream.time_base)


def _read_index(name: str, container: Any, stream: Any, limits: VideoLimits) -> ClipIndex:
    import av

    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    _check_size(name, width, height, limits)
    pts, gop, shown = array("q"), array("q"), bytearray()
    ordinal, group, last_duration = False, -1, 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:             # the demuxer's end-of-stream packet
                continue
            if len(pts) >= limits.max_frames:
                raise _fail(name, f"more than {limits.max_frames} frames, above the limit; "
                            "cut it into shorter clips")
            if packet.is_keyframe or group < 0:
                group += 1
            stamp = packet.pts if packet.pts is not None else packet.dts
            ordinal = ordinal or stamp is None
            pts.append(stamp if stamp is not None else len(pts))
            gop.append(group)
            shown.append(not packet.is_discard)
            last_duration = packet.duration or 0
    except av.FFmpegError as err:
        raise _fail(name, f"damaged after {len(pts)} frames ({_why(err)})") from None
    pts_arr = np.frombuffer(pts, dtype=np.int64) if pts else np.zeros(0, np.int64)
    shown_arr = np.frombuffer(bytes(shown), dtype=np.bool_)
    if ordinal:      # some packets without timestamps: trust none, count frames shown
        pts_arr = np.cumsum(shown_arr, dtype=np.int64) - 1
    gop_arr = np.frombuffer(gop, dtype=np.int64) if gop else np.zeros(0, np.int64)
    if not shown_arr.any():
        raise _fail(name, "has no frames")
    return ClipIndex(width=width, height=height, pts=pts_arr, gop=gop_arr, shown=shown_arr,
                     ordinal=ordinal,
                     duration=_duration(stream, pts_arr, shown_arr, ordinal, last_duration))


def index_clip(data: bytes, name: str, limits: VideoLimits = VideoLimits()) -> ClipIndex:
    """The clip's packets (frame count, duration, keyframes) read without decoding a
    frame: what sampling and the data's statistics need. VideoError for a clip that
    cannot be read or is beyond ``limits``."""
    container, stream = _open(data, name)
    with container:
        return _read_index(name, container, stream, limits)


@dataclass
class _Picks:
    """The sampled frames as they are decoded: per slot its frame once decoded."""

    wanted: dict[int, list[int]]          # timestamp -> the slots that show it
    frames: list[np.ndarray | None]
    base: ImagePolicy
    policy: ImagePolicy | None            # frames' size: the header's, else the first frame's

    def take(self, frame: Any, stamp: int) -> None:
        slots = self.wanted.pop(stamp, None)
        if not slots:
            return
        if self.policy is None:
            self.policy = _frame_policy(self.base, frame.width, frame.height)
        pixels = self.policy.resize(frame.to_image())
        for slot in slots:
            self.frames[slot] = pixels


def _frame_policy(policy: ImagePolicy, width: int, height: int) -> ImagePolicy:
    """The policy that sizes every frame of a clip whose frames are ``width x height``
    as ``policy`` sizes an image of that size: one size for all of them, whatever a
    frame's own (a stream may change its size midway)."""
    if policy.size is not None:
        return policy
    return replace(policy, size=policy.shape(width, height))


def _needed(index: ClipIndex, targets: np.ndarray) -> np.ndarray:
    """Which packets (decode order) to decode for the ``targets`` packets: in each group
    of pictures holding one, from its keyframe up to its last target (a frame's
    references come before it in decode order); every packet of a clip without
    timestamps (its frames are known by their count)."""
    if index.ordinal:
        return np.ones(len(index.gop), dtype=bool)
    last = np.full(int(index.gop.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last, index.gop[targets], targets)
    return np.arange(len(index.gop)) <= last[index.gop]


def _decode(name: str, container: Any, stream: Any, index: ClipIndex, picks: _Picks,
            needed: np.ndarray, threads: int, limits: VideoLimits) -> None:
    """Decode the ``needed`` packets (skipping the others), handing each frame that
    comes out to ``picks``."""
    import av

    context = stream.codec_context
    context.options = {"max_pixels": str(limits.max_pixels)}
    context.thread_type = "AUTO"
    context.thread_count = threads
    decoded = 0
    position = 0                        # decode-order position of the next packet
    shown = 0                           # frames out so far (``ordinal`` clips' stamps)
    live = False                        # the decoder holds packets of a decoded run

    def out(frames: Any) -> None:
        nonlocal decoded, shown
        for frame in frames:
            decoded += frame.width * frame.height
            if decoded > limits.max_decoded_pixels:
                raise _fail(name, f"decoding it would take more than "
                            f"{limits.max_decoded_pixels} pixels (frames larger than "
                            "its header says)")
            stamp = shown if index.ordinal or frame.pts is None else frame.pts
            shown += 1
            picks.take(frame, stamp)

    def feed(packet: Any) -> None:
        try:
            out(context.decode(packet))
        except av.error.InvalidDataError:
            pass                        # a damaged packet: FFmpeg conceals the rest
        except av.FFmpegError as err:
            raise _fail(name, f"cannot decode it ({_why(err)})") from None

    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            if position >= len(needed):
                break                   # cannot happen: the same bytes demux the same
            position += 1
            if needed[position - 1]:
                feed(packet)
                live = True
            elif live:                  # a gap: drain this run, then start afresh
                feed(None)
                context.flush_buffers()
                live = False
            if not picks.wanted:
                return
        if live:
            feed(None)
    except av.FFmpegError as err:
        raise _fail(name, f"damaged after {position} frames ({_why(err)})") from None


def decode_clip(data: bytes, name: str, *, policy: ImagePolicy,
                sampling: FrameSampling = FrameSampling(),
                limits: VideoLimits = VideoLimits(), threads: int = 0) -> np.ndarray:
    """The sampled frames of a clip's bytes (any container and codec PyAV opens: mp4,
    webm, mkv, ...) as uint8 ``[F, 3, H, W]`` sized by ``policy`` (module docstring).
    ``name`` names the clip in errors; ``threads``: the decoder's threads (0: FFmpeg's
    choice). VideoError for a clip that cannot be read or is beyond ``limits``."""
    container, stream = _open(data, name)
    with container:
        index = _read_index(name, container, stream, limits)
    try:
        count = index.sampled(sampling)
    except ValueError as err:
        raise _fail(name, str(err)) from None
    targets = index.order()[sample_indices(count, index.frames)]
    wanted: dict[int, list[int]] = {}
    for slot, packet in enumerate(targets):
        wanted.setdefault(int(index.pts[packet]), []).append(slot)
    needed = _needed(index, targets)
    cost = int(needed.sum()) * max(index.width * index.height, 1)
    if cost > limits.max_decoded_pixels:
        raise _fail(name, f"sampling {count} frames needs decoding {cost} pixels (from "
                    f"keyframes on, frames of {index.width}x{index.height}), above the "
                    f"limit of {limits.max_decoded_pixels}; sample fewer frames or "
                    "re-encode the clip with keyframes closer together")
    fixed = index.shape(policy)         # the header's size decides, as ``shape`` says
    picks = _Picks(wanted=wanted, frames=[None] * count, base=policy,
                   policy=None if fixed is None else replace(policy, size=fixed))
    container, stream = _open(data, name)
    with container:
        _decode(name, container, stream, index, picks, needed, threads, limits)
    return _stack(name, picks.frames)


def _stack(name: str, frames: list[np.ndarray | None]) -> np.ndarray:
    """The frames as one array, each missing one (its packets damaged) replaced by the
    nearest one decoded."""
    have = [k for k, f in enumerate(frames) if f is not None]
    if not have:
        raise _fail(name, "none of its sampled frames decodes")
    near = np.asarray(have)
    filled = [f if f is not None else frames[int(near[np.abs(near - k).argmin()])]
              for k, f in enumerate(frames)]
    return np.stack(filled)


def patchify(frames: Any, patch: int, temporal_patch: int = 1, merge: int = 1) -> Any:
    """``[F, C, H, W]`` frames (NumPy or torch, any dtype) to ``[ceil(F / tp) * gh * gw,
    C * tp * p * p]`` patches in Qwen2-VL's order (module docstring); ``gh = H / p``,
    ``gw = W / p``. ValueError for frames whose sides are not whole patches (whole
    ``merge x merge`` blocks of them)."""
    if frames.ndim != 4 or frames.shape[0] < 1:
        raise ValueError(f"frames of shape {tuple(frames.shape)}: expected [F, C, H, W] "
                         "with at least one frame")
    if patch < 1 or temporal_patch < 1 or merge < 1:
        raise ValueError(f"patch {patch}, temporal_patch {temporal_patch}, merge {merge}: "
                         "each must be at least 1")
    count, channels, height, width = (int(s) for s in frames.shape)
    unit = patch * merge
    if height % unit or width % unit:
        raise ValueError(f"frames of {height}x{width} pixels: sides must be multiples of "
                         f"{unit} (patch {patch} x merge {merge})")
    torch_like = not isinstance(frames, np.ndarray)
    pad = padded_frames(count, temporal_patch) - count
    if pad:
        last = frames[-1:]
        if torch_like:
            import torch

            frames = torch.cat([frames, last.expand(pad, -1, -1, -1)])
        else:
            frames = np.concatenate([frames, np.repeat(last, pad, axis=0)])
    groups = temporal_groups(count, temporal_patch)
    gh, gw = height // patch, width // patch
    x = frames.reshape(groups, temporal_patch, channels, gh // merge, merge, patch,
                       gw // merge, merge, patch)
    # -> [t, gh/m, gw/m, m, m, C, tp, p, p]: transformers' permute(1, 4, 7, 5, 8, 3, 2, 6, 9)
    axes = (0, 3, 6, 4, 7, 2, 1, 5, 8)
    x = x.permute(*axes) if torch_like else x.transpose(axes)
    return x.reshape(groups * gh * gw, channels * temporal_patch * patch * patch)


def linear_patch_weight(conv_weight: Any) -> Any:
    """A ``Conv3d`` patch embedding's weight ``[D, C, tp, p, p]`` as the ``[D, C * tp *
    p * p]`` weight of the ``Linear`` over ``patchify``'s patches that computes the same
    (Qwen2-VL's ``PatchEmbed``; a ``Conv2d``'s ``[D, C, p, p]`` with ``tp`` 1)."""
    return conv_weight.reshape(conv_weight.shape[0], -1)
