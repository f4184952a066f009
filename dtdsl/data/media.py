"""Audio and video files as their encoders read them: what an index records of a clip
without decoding it, the shape (and so the tokens) a clip will have, and the clip decoded
into exactly that shape in the preprocessing workers (NumPy; no torch here).

**Formats.** A member or path whose last extension is ``flac``, ``wav``, ``mp3`` or
``ogg`` is audio, ``mp4``, ``webm`` or ``mkv`` video (``media_kind``).

**Indexing** (``index_media``): an audio file's samples and rate from its header
(``soundfile.info``; nothing decoded), a video file's frames, duration and frame size
from its packets' headers (``data.video.index_clip``; no frame decoded). A file that
does not read is a ``DatasetError`` naming it: the indexes skip its sample with the
reason (``unreadable audio``, ``unreadable video``).

**Shapes before decoding** (``ClipReader.shape``), by the one rule of the runtime
(``ir.modal.InputRule``) and the cost model:

- audio, an encoder with a patch stem (BEATs-class): the clip decoded to mono at 16 kHz
  (``data.audio``: at most ``AudioPolicy.max_seconds``; a rate other than 16 kHz is
  resampled, ``ceil(samples * 16000 / rate)`` samples), its fbank frames (25 ms every
  10 ms) cut to the clamp high of ``audio.frames`` (tokens per clip: whole rows of
  ``mel_bins / patch`` patches) and floored to whole rows of ``patch`` frames: ``[T,
  mel_bins]``, ``T / patch * mel_bins / patch`` tokens. A clip shorter than one row of
  patches is refused (it would give no token). An encoder of ``C = in_channels > 1``
  reads ``[T, C, mel_bins]``, an fbank of each of the clip's first ``C`` channels (a
  mono clip's one signal in every channel; a clip of ``1 < channels < C`` is refused
  when it decodes, as its header's channels are not indexed), the same tokens;
- audio, an encoder without a patch size (a frame stem, a token per frame): the same
  fbank frames, cut to the clamp high of ``audio.frames``: ``[T, mel_bins]`` (``[T, C,
  mel_bins]``), ``T`` tokens;
- audio, an encoder with Whisper's convolutional stem: ``[2 * max_source_positions,
  in_channels]`` log-mel whatever the clip's length (30 s, cut or zero-padded), and
  ``max_source_positions`` tokens (``ir.program.TransformerArch.clip_tokens``);
- video: ``F`` frames sampled from the clip (``data.video.FrameSampling``: by default
  2 frames per second, as Qwen2-VL samples, at least 4 and at most the clamp high of
  ``video.frames`` (768 without one), at most the clip's frames, floored to whole
  temporal patches), then rounded up to whole temporal patches (``ir.clips.padded_frames``:
  the last frame repeated), each sized by the image rule (``images.ImagePolicy``: native
  resolution in whole patches under the clamp high of ``video.patches``, or a tower's
  fixed size): ``[F, 3, H, W]``. A clip whose header gives no frame size is refused.

**Decoding** (``ClipReader.read``): the clip decoded as ``data.audio`` /
``data.video.decode_clip`` do, into float32 of the shape ``shape`` gives: audio features
as they are, video pixels normalised with the encoder's mean and std (``ImagePolicy``;
0.5 and 0.5 for a tower of its own). A clip that decodes to fewer frames than its header
promised (a header that lies) is a ``DatasetError``: the decode check (``data.usable``)
leaves its sample out before any batch is formed, so the sizes the batches are routed
with are the sizes trained on.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtdsl.data.audio import (
    AUDIO_EXTENSIONS,
    AudioError,
    AudioPolicy,
    WhisperFeatures,
    check_format,
)
from dtdsl.data.images import ImagePolicy
from dtdsl.data.shards import ClipInfo, DatasetError, EncodedClip
from dtdsl.ir import program as ir
from dtdsl.ir.clips import padded_frames
from dtdsl.ir.modal import InputRule

__all__ = ["AUDIO_EXTENSIONS", "DEFAULT_FPS", "VIDEO_EXTENSIONS", "ClipReader",
           "index_media", "media_kind"]

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv")
DEFAULT_FPS = 2.0           # frames sampled per second of a clip (Qwen2-VL's default)
_MIN_FRAMES = 4             # and at least this many (qwen-vl-utils' FPS_MIN_FRAMES)
_MAX_FRAMES = 768           # at most, without a clamp on video.frames (its FPS_MAX_FRAMES)


def media_kind(name: str) -> str | None:
    """``"audio"``, ``"video"`` or None, by the last extension of ``name``."""
    ext = name.rsplit(".", 1)[-1].lower()
    if ext in AUDIO_EXTENSIONS:
        return "audio"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    return None


def index_media(data: bytes, name: str) -> ClipInfo:
    """What an index records of the audio or video file ``data`` (module docstring).
    DatasetError for a file that does not read as its extension says."""
    kind = media_kind(name)
    if kind == "video":
        from dtdsl.data.video import index_clip

        clip = index_clip(data, name)
        return ClipInfo(name=name, frames=clip.frames, duration=clip.duration,
                        width=clip.width, height=clip.height)
    if kind != "audio":
        raise DatasetError(f"{name}: not an audio or video file (extensions: "
                           f"{', '.join(AUDIO_EXTENSIONS + VIDEO_EXTENSIONS)})")
    import soundfile as sf

    if len(data) == 0:
        raise AudioError(f"{name}: an empty file (0 bytes), not audio")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as err:  # noqa: BLE001 - libsndfile raises several kinds on junk
        raise AudioError(f"{name}: cannot be read as audio ({str(err)[:160]})") from None
    check_format(name, int(info.samplerate), int(info.channels))
    if info.frames <= 0:
        raise AudioError(f"{name}: holds no samples")
    return ClipInfo(name=name, samples=int(info.frames), rate=int(info.samplerate))


@dataclass(frozen=True, eq=False)
class ClipReader:
    """How one audio or video encoder's items are read from files (module docstring)."""

    rule: InputRule
    audio: AudioPolicy | None = None
    video: ImagePolicy | None = None
    sampling: Any = None            # data.video.FrameSampling (video)
    # The most tokens one clip may give: the backbone's seq_len (a longer clip fits no
    # sequence). It also bounds what decoding a clip allocates, before anything decodes.
    max_tokens: int | None = None

    @classmethod
    def for_encoder(cls, program: ir.Program, module: ir.Module) -> ClipReader:
        """The reader of encoder ``module`` (audio or video) of ``program``."""
        rule = InputRule.of(program, module)
        if module.modality == "audio":
            max_frames = None
            high = program.data.high("audio", "frames")
            if high is not None and not rule.whisper_positions:
                max_frames = max(1, high // rule.columns) * rule.patch
            return cls(rule=rule, audio=AudioPolicy.for_encoder(module, max_frames),
                       max_tokens=program.train.seq_len)
        if module.modality != "video":
            raise ValueError(f"'{module.name}' reads {module.modality}, not audio or video")
        from dtdsl.data.video import FrameSampling

        most = program.data.high("video", "frames") or _MAX_FRAMES
        sampling = FrameSampling(fps=DEFAULT_FPS, min_frames=min(_MIN_FRAMES, most),
                                 max_frames=most, multiple=rule.temporal_patch)
        policy = ImagePolicy.for_encoder(module, program.data.high("video", "patches"))
        return cls(rule=rule, video=policy, sampling=sampling,
                   max_tokens=program.train.seq_len)

    @property
    def modality(self) -> str:
        return self.rule.modality

    def shape(self, info: ClipInfo) -> tuple[int, ...]:
        """The float32 shape ``read`` gives this clip (module docstring); DatasetError
        for a clip that gives no token, whose frames cannot be sampled, or that gives more
        tokens than ``max_tokens`` (read from its header: nothing is decoded)."""
        shape = self._shape(info)
        tokens = self.rule.tokens(shape)
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise DatasetError(f"{info.name}: {tokens} tokens, more than the backbone's "
                               f"seq_len of {self.max_tokens}")
        return shape

    def _shape(self, info: ClipInfo) -> tuple[int, ...]:
        rule = self.rule
        if self.audio is not None:
            if info.rate < 1:
                raise DatasetError(f"{info.name}: not an audio file")
            e = self.audio.extractor
            if isinstance(e, WhisperFeatures):
                return (e.frames, e.bins)
            rows = self.audio.num_frames(info.samples, info.rate) // rule.patch
            if rows < 1 and rule.frames:
                raise AudioError(f"{info.name}: {info.samples / info.rate:.3f} s, shorter "
                                 f"than one fbank frame ({e.frame_ms:g} ms)")
            if rows < 1:
                raise AudioError(f"{info.name}: {info.samples / info.rate:.3f} s, shorter "
                                 f"than one row of {rule.patch} frames of patches "
                                 f"({((rule.patch - 1) * e.hop_ms + e.frame_ms):g} ms)")
            return (rows * rule.patch, *rule.item_shape)
        assert self.video is not None
        if info.frames < 1:
            raise DatasetError(f"{info.name}: not a video file")
        try:
            count = self.sampling.count(info.frames, info.duration)
        except ValueError as err:
            raise DatasetError(f"{info.name}: {err}") from None
        if self.video.size is not None:
            h, w = self.video.size
        elif info.width < 1 or info.height < 1:
            raise DatasetError(f"{info.name}: its header gives no frame size")
        else:
            h, w = self.video.shape(info.width, info.height)
        return (padded_frames(count, rule.temporal_patch), 3, h, w)

    def tokens(self, info: ClipInfo) -> int:
        """The clip's tokens in the backbone's sequence (``InputRule.tokens``)."""
        return self.rule.tokens(self.shape(info))

    def read(self, clip: EncodedClip) -> np.ndarray:
        """The clip decoded into float32 of ``shape`` (module docstring). DatasetError for
        a clip that does not decode or gives fewer frames than its header says."""
        shape = self.shape(clip.info)
        name = clip.info.name
        if self.audio is not None:
            out = self.audio.features(clip.data, name)
            if out.shape[0] < shape[0] or out.shape[1:] != shape[1:]:
                raise DatasetError(f"{name}: decodes to {list(out.shape)} features, not the "
                                   f"{list(shape)} its header promises")
            return np.ascontiguousarray(out[:shape[0]], dtype=np.float32)
        from dtdsl.data.video import decode_clip

        assert self.video is not None
        frames = decode_clip(clip.data, name, policy=self.video, sampling=self.sampling)
        if frames.shape[1:] != shape[1:] or frames.shape[0] > shape[0]:
            raise DatasetError(f"{name}: decodes to frames {list(frames.shape)}, not the "
                               f"{list(shape)} its header promises")
        if frames.shape[0] < shape[0]:      # whole temporal patches: the last repeated
            frames = np.concatenate([frames, np.repeat(frames[-1:], shape[0] -
                                                       frames.shape[0], axis=0)])
        mean = np.asarray(self.video.mean, np.float32).reshape(3, 1, 1)
        std = np.asarray(self.video.std, np.float32).reshape(3, 1, 1)
        return ((frames.astype(np.float32) / np.float32(255.0) - mean) / std).astype(
            np.float32, copy=False)

    def stand_in(self, info: ClipInfo) -> np.ndarray:
        """Zeros of the clip's shape (a sample that stopped decoding, ``Decoder.stand_in``)."""
        return np.zeros(self.shape(info), dtype=np.float32)
