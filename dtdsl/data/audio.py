"""Audio in: the bytes of a clip to a mono waveform at the encoder's rate, and the features
audio encoders read (NumPy, float32; no torch here: this runs in the preprocessing workers).

**Decoding** (``decode_audio(data, name)``): ``.wav``, ``.flac``, ``.mp3`` and ``.ogg``
(Vorbis, Opus) with ``soundfile`` (libsndfile 1.2); what libsndfile does not recognise
(``.m4a``/AAC, ...) with PyAV (FFmpeg). For a one-channel encoder the channels are mixed
down to mono by their mean (as librosa's ``to_mono`` and Hugging Face ``datasets``); an
encoder of ``C > 1`` input channels (``decode_audio(..., channels=C)``, stereo, binaural
or a microphone array) gets the file's first ``C`` channels as they are, ``[samples, C]``
(a file of more keeps its first ``C``, as a microphone array's extra channels say nothing
the encoder was built to read; a mono file feeds every channel the same signal, so a
stereo encoder still reads mono recordings; a file of ``1 < channels < C`` is refused:
which of its channels would fill the others is a guess). Then resampled to ``rate`` (16 kHz,
what BEATs and Whisper read) with ``scipy.signal.resample_poly`` (a polyphase FIR with a
Kaiser window). Nothing in a file is trusted: the clip is read a block at a time and at
most ``max_seconds`` of it, and never more than 2^26 samples (the rest is cut, as the
encoders cut long clips anyway), so memory is bounded by that, not by what a header
claims (of ``C`` channels, ``2^26 / C`` samples each); a sample rate or a channel count no
audio has, NaN or infinite samples, an empty
or undecodable file are an ``AudioError`` (a ``DatasetError``): one line naming the file.

**Features** (``FbankFeatures``, ``WhisperFeatures``): the conventions (mel scales, filter
normalisation, windows) are ``transformers.audio_utils``'s (``mel_filter_bank``,
``window_function``), the numbers those of the references the tests hold them to:

- ``FbankFeatures``: Kaldi's fbank as ``torchaudio.compliance.kaldi.fbank`` computes it
  (25 ms frames every 10 ms, ``snip_edges``, DC offset removed, pre-emphasis 0.97, a Povey
  window, a 512-point FFT, Kaldi's mel banks from 20 Hz to Nyquist, natural log floored at
  float32's epsilon, no dither), ``[frames, bins]``; ``FbankFeatures.beats()`` scales the
  waveform to 16-bit range first and normalises as BEATs does, ``(x - 15.41663) / (2 *
  6.55582)``. With a Hann window and no scaling it is ``transformers``'
  ``ASTFeatureExtractor`` (tests: within 5e-4 on log values, float32 against its float64;
  the Povey window within 5e-5 of a float64 Kaldi reference);
- ``WhisperFeatures``: Whisper's log-mel (the clip cut or zero-padded to ``frames`` = 3000
  hops, 30 s, a centred 400-point Hann STFT every 160 samples, Slaney mel filters to 8 kHz, log10
  floored at 1e-10 and at 8 below the clip's maximum, ``(x + 4) / 4``), ``[3000, bins]``
  for 80 or 128 bins: ``WhisperFeatureExtractor``'s (tests: within 1e-4).

``AudioPolicy.for_encoder(module, max_frames)`` says which an encoder reads (as
``images.ImagePolicy`` does for images): Whisper's log-mel for a tower with Whisper's stem
(``in_channels`` bins, ``2 x max_source_positions`` frames), BEATs' fbank otherwise (cut to
``max_frames``, the clamp high of ``audio.frames``), an fbank per channel ``[frames, C,
bins]`` for ``C = in_channels > 1`` (``ir.modal``'s layout); ``policy.features(data,
name)`` decodes only the seconds it uses.

Frames are cut and transformed in one vectorised pass (``_frames``; float32 FFTs), where
``audio_utils.spectrogram`` runs a Python loop per frame in float64: the same arithmetic,
several times cheaper per clip on a worker. Results are deterministic (no dither) and
independent of threads (NumPy's FFT and a matrix product per clip).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from dtdsl.data.shards import DatasetError

__all__ = [
    "AUDIO_EXTENSIONS", "MAX_SECONDS", "SAMPLE_RATE", "AudioError", "AudioPolicy",
    "FbankFeatures",
    "WhisperFeatures", "check_format", "decode_audio", "resampled_length",
]

SAMPLE_RATE = 16_000
# What is read of one clip by default: BEATs trains on AudioSet's 10 s clips, Whisper reads
# 30 s windows (AudioPolicy decodes only what its encoder uses).
MAX_SECONDS = 600.0
# And never more samples than this (256 MiB of float32: ten minutes at 96 kHz), whatever
# the rate: a worker's memory is bounded by it, not by what a file claims.
_MAX_SAMPLES = 1 << 26
AUDIO_EXTENSIONS = ("flac", "wav", "mp3", "ogg")
# Bounds no real recording reaches (DXD is 352.8 kHz; Ambisonics of order 7 has 64
# channels): a header beyond them is hostile or damaged.
_MAX_RATE = 384_000
_MIN_RATE = 1_000
_MAX_CHANNELS = 64
_BLOCK_FRAMES = 1 << 16
_MAX_RATIO = 1 << 16        # resample_poly's up and down factors (its filter grows with them)


class AudioError(DatasetError):
    """A clip that cannot be read: the message names it and says why, in one line."""


# ---- decoding --------------------------------------------------------------------------

def decode_audio(data: bytes, name: str, *, rate: int = SAMPLE_RATE,
                 max_seconds: float = MAX_SECONDS, channels: int = 1) -> np.ndarray:
    """The clip in ``data`` (the bytes of an audio file; ``name`` says which, in errors)
    as a float32 waveform at ``rate`` Hz, of at most ``max_seconds``: mono ``[samples]``,
    or ``[samples, channels]`` for ``channels > 1`` (module docstring). AudioError for
    anything that is not such a clip."""
    if not 0 < max_seconds <= 86_400:
        raise ValueError(f"max_seconds {max_seconds} is not in (0, 86400]")
    if not 1 <= channels <= _MAX_CHANNELS:
        raise ValueError(f"channels {channels} is not in 1..{_MAX_CHANNELS}")
    if len(data) == 0:
        raise AudioError(f"{name}: an empty file (0 bytes), not audio")
    wave, native = _read_soundfile(data, name, max_seconds, channels)
    if wave is None:
        wave, native = _read_pyav(data, name, max_seconds, channels)
    if wave.size == 0:
        raise AudioError(f"{name}: holds no samples")
    return _resample(wave, native, rate, name)


def check_format(name: str, samplerate: int, channels: int) -> None:
    """AudioError for a rate or channel count no audio has (a damaged or hostile header)."""
    if not _MIN_RATE <= samplerate <= _MAX_RATE:
        raise AudioError(f"{name}: a sample rate of {samplerate} Hz (audio has "
                         f"{_MIN_RATE}..{_MAX_RATE}); the file is damaged")
    if not 1 <= channels <= _MAX_CHANNELS:
        raise AudioError(f"{name}: {channels} channels (audio has 1..{_MAX_CHANNELS}); the "
                         "file is damaged")


def _mix_block(block: np.ndarray, name: str, channels: int) -> np.ndarray:
    """``[frames, file channels]`` float32 to what an encoder of ``channels`` reads: the
    mono mean ``[frames]`` (one), else ``[frames, channels]``: the first ``channels``, a
    mono file's one repeated (module docstring). AudioError for NaN or infinity, or for a
    file of more than one channel and fewer than ``channels``."""
    if not np.isfinite(block).all():
        raise AudioError(f"{name}: holds NaN or infinite samples")
    have = block.shape[1]
    if channels == 1:
        return block[:, 0].copy() if have == 1 else block.mean(axis=1, dtype=np.float32)
    if have == 1:
        return np.repeat(block, channels, axis=1)
    if have < channels:
        raise AudioError(f"{name}: {have} channels, fewer than the encoder's {channels} "
                         "(a mono file feeds every channel; write the clip with "
                         f"{channels} channels or mono)")
    return np.ascontiguousarray(block[:, :channels])


def _sample_limit(channels: int) -> int:
    """The most samples read per channel: ``_MAX_SAMPLES`` floats in all."""
    return _MAX_SAMPLES // max(1, channels)


def _read_soundfile(data: bytes, name: str, max_seconds: float, channels: int = 1
                    ) -> tuple[np.ndarray | None, int]:
    """The waveform (``_mix_block``'s) and its rate, read with libsndfile; ``(None, 0)``
    when libsndfile does not recognise the format (PyAV may)."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(data))
    except sf.LibsndfileError:
        return None, 0
    except (RuntimeError, ValueError, TypeError) as err:
        raise AudioError(f"{name}: cannot be read as audio ({_short(err)})") from None
    with f:
        check_format(name, f.samplerate, f.channels)
        limit = min(math.ceil(max_seconds * f.samplerate), _sample_limit(channels))
        parts, have = [], 0
        try:
            # Block by block up to the limit, whatever the header claims: a header may
            # promise hours and hold a second (each read returns what is there).
            while have < limit:
                block = f.read(min(_BLOCK_FRAMES, limit - have), dtype="float32",
                               always_2d=True)
                if block.shape[0] == 0:
                    break
                parts.append(_mix_block(block, name, channels))
                have += block.shape[0]
        except AudioError:
            raise
        except (RuntimeError, ValueError, MemoryError) as err:
            raise AudioError(f"{name}: a damaged {f.format} file ({_short(err)})") from None
        rate = f.samplerate
    return (np.concatenate(parts) if parts else _empty(channels)), rate


def _empty(channels: int) -> np.ndarray:
    return np.zeros(0 if channels == 1 else (0, channels), np.float32)


def _read_pyav(data: bytes, name: str, max_seconds: float, channels: int = 1
               ) -> tuple[np.ndarray, int]:
    """The waveform (``_mix_block``'s) and its rate, decoded with PyAV (FFmpeg): the
    first audio stream, converted to planar float32 at its own rate and layout."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError, UnicodeDecodeError) as err:
        raise AudioError(f"{name}: not an audio file dtdsl reads ({_short(err)}); "
                         f"write it as {', '.join(AUDIO_EXTENSIONS)}") from None
    with container:
        if not container.streams.audio:
            raise AudioError(f"{name}: holds no audio stream")
        stream = container.streams.audio[0]
        converter = av.AudioResampler(format="fltp")
        parts, have, rate = [], 0, None
        try:
            for frame in container.decode(stream):
                rate = rate or frame.sample_rate
                check_format(name, frame.sample_rate, len(frame.layout.channels))
                if frame.sample_rate != rate:
                    raise AudioError(f"{name}: its sample rate changes from {rate} to "
                                     f"{frame.sample_rate} Hz")
                for out in converter.resample(frame):
                    parts.append(_mix_block(out.to_ndarray().T, name, channels))
                    have += parts[-1].shape[0]
                if have >= min(max_seconds * rate, _sample_limit(channels)):
                    break
        except (av.FFmpegError, ValueError, OSError) as err:
            raise AudioError(f"{name}: a damaged audio file ({_short(err)})") from None
    if rate is None:
        raise AudioError(f"{name}: holds no samples")
    wave = np.concatenate(parts) if parts else _empty(channels)
    return wave[:min(math.ceil(max_seconds * rate), _sample_limit(channels))], rate


def _ratio(native: int, rate: int) -> Fraction:
    ratio = Fraction(rate, native)
    if ratio.numerator > _MAX_RATIO or ratio.denominator > _MAX_RATIO:
        # Coprime rates (an odd rate such as 44_101 Hz): the exact polyphase filter would
        # be enormous; a ratio within 1e-6 of it is inaudible.
        ratio = ratio.limit_denominator(_MAX_RATIO)
    return ratio


def resampled_length(samples: int, native: int, rate: int = SAMPLE_RATE,
                     max_seconds: float = MAX_SECONDS, channels: int = 1) -> int:
    """The samples (per channel) ``decode_audio`` gives a clip of ``samples`` samples at
    ``native`` Hz for ``channels``: at most ``max_seconds`` of it read, resampled to
    ``rate`` (``resample_poly``'s ``ceil(n * up / down)``). What an index predicts from a
    header, nothing decoded."""
    read = min(samples, math.ceil(max_seconds * native), _sample_limit(channels))
    if native == rate:
        return read
    ratio = _ratio(native, rate)
    return -(-read * ratio.numerator // ratio.denominator)


def _resample(wave: np.ndarray, native: int, rate: int, name: str) -> np.ndarray:
    """``wave`` (``[samples]`` or ``[samples, channels]``) from ``native`` to ``rate`` Hz,
    each channel alike."""
    if native == rate:
        return wave
    from scipy.signal import resample_poly

    ratio = _ratio(native, rate)
    out = resample_poly(wave, ratio.numerator, ratio.denominator, axis=0)
    return out.astype(np.float32, copy=False)


def _short(err: BaseException) -> str:
    # FFmpeg's errors carry their words in strerror (str() adds an errno and a file name).
    words = getattr(err, "strerror", None)
    text = " ".join((words if isinstance(words, str) and words else str(err)).split())
    return (text[:160] + "...") if len(text) > 160 else (text or type(err).__name__)


# ---- features --------------------------------------------------------------------------

def _frames(wave: np.ndarray, length: int, hop: int) -> np.ndarray:
    """``[n, length]`` frames every ``hop`` samples (a view: no copy)."""
    n = 1 + (wave.size - length) // hop
    return np.lib.stride_tricks.sliding_window_view(wave, length)[::hop][:n]


def _power(frames: np.ndarray, window: np.ndarray, n_fft: int) -> np.ndarray:
    """``|rfft(frames * window, n_fft)|^2``, float32 ``[n, n_fft // 2 + 1]``."""
    spectrum = np.fft.rfft(frames * window, n=n_fft, axis=-1)
    return (spectrum.real ** 2 + spectrum.imag ** 2).astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class FbankFeatures:
    """Kaldi's filter-bank features (module docstring): ``features(wave)`` of a mono
    float32 waveform at ``rate`` is float32 ``[frames, bins]``, one frame per 10 ms that
    fits whole (``snip_edges``; a clip shorter than one frame is an AudioError)."""

    bins: int = 128
    rate: int = SAMPLE_RATE
    window_name: str = "povey"
    scale: float = 1.0              # the waveform is multiplied by it first (BEATs: 2^15)
    mean: float = 0.0               # then (x - mean) / std
    std: float = 1.0
    frame_ms: float = 25.0
    hop_ms: float = 10.0
    _filters: np.ndarray = field(init=False, repr=False)
    _window: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from transformers.audio_utils import mel_filter_bank, window_function

        n_fft = self.n_fft
        with warnings.catch_warnings():
            # 128 Kaldi banks over 257 FFT bins leave one empty (torchaudio's too,
            # which BEATs was trained on); transformers warns of it each time.
            warnings.simplefilter("ignore", UserWarning)
            filters = mel_filter_bank(num_frequency_bins=n_fft // 2 + 1,
                                      num_mel_filters=self.bins, min_frequency=20,
                                      max_frequency=self.rate // 2, sampling_rate=self.rate,
                                      norm=None, mel_scale="kaldi",
                                      triangularize_in_mel_space=True)
        object.__setattr__(self, "_filters", np.ascontiguousarray(filters, np.float32))
        object.__setattr__(self, "_window", window_function(
            self.frame_length, self.window_name, periodic=False).astype(np.float32))

    @property
    def frame_length(self) -> int:
        return int(self.rate * self.frame_ms / 1000)

    @property
    def hop(self) -> int:
        return int(self.rate * self.hop_ms / 1000)

    @property
    def n_fft(self) -> int:
        return 1 << (self.frame_length - 1).bit_length()     # Kaldi's round_to_power_of_two

    @classmethod
    def beats(cls, bins: int = 128) -> FbankFeatures:
        """BEATs' fbank (its ``preprocess``): the waveform at 16-bit scale, ``bins`` (its
        128), normalised by BEATs' statistics, ``(x - 15.41663) / (2 * 6.55582)``."""
        return cls(bins=bins, scale=float(1 << 15), mean=15.41663, std=2 * 6.55582)

    def num_frames(self, samples: int) -> int:
        """The frames of a clip of ``samples`` samples (0 when shorter than one frame)."""
        return 0 if samples < self.frame_length else 1 + (samples - self.frame_length) // self.hop

    def features(self, wave: np.ndarray, name: str = "clip") -> np.ndarray:
        if self.num_frames(wave.size) == 0:
            raise AudioError(f"{name}: {wave.size} samples, shorter than one "
                             f"{self.frame_ms:g} ms frame ({self.frame_length} samples)")
        frames = _frames(np.asarray(wave, np.float32), self.frame_length, self.hop)
        frames = frames * np.float32(self.scale)
        frames = frames - frames.mean(axis=1, keepdims=True)           # remove_dc_offset
        frames[:, 1:] -= 0.97 * frames[:, :-1]                         # preemphasis
        frames[:, 0] *= 1 - 0.97
        mel = _power(frames, self._window, self.n_fft) @ self._filters
        out = np.log(np.maximum(mel, np.finfo(np.float32).eps))
        if self.mean != 0.0 or self.std != 1.0:
            out = (out - np.float32(self.mean)) / np.float32(self.std)
        return out.astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class WhisperFeatures:
    """Whisper's log-mel (module docstring): ``features(wave)`` of a mono float32
    waveform at ``rate`` is float32 ``[frames, bins]`` (``[3000, 80]`` or ``[3000, 128]``),
    the clip cut or zero-padded to ``frames`` hops (30 s: twice the encoder's
    ``max_source_positions``)."""

    bins: int = 80
    rate: int = SAMPLE_RATE
    n_fft: int = 400
    hop: int = 160
    frames: int = 3000
    _filters: np.ndarray = field(init=False, repr=False)
    _window: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from transformers.audio_utils import mel_filter_bank, window_function

        with warnings.catch_warnings():
            # 128 Slaney filters over 201 FFT bins leave a few empty (Whisper large-v3's
            # own, warned of by transformers each time): what the model was trained on.
            warnings.simplefilter("ignore", UserWarning)
            filters = mel_filter_bank(num_frequency_bins=1 + self.n_fft // 2,
                                      num_mel_filters=self.bins, min_frequency=0.0,
                                      max_frequency=8000.0, sampling_rate=self.rate,
                                      norm="slaney", mel_scale="slaney")
        object.__setattr__(self, "_filters", np.ascontiguousarray(filters, np.float32))
        object.__setattr__(self, "_window", window_function(self.n_fft, "hann")
                           .astype(np.float32))

    @property
    def seconds(self) -> float:
        """What a clip is cut or padded to (30 s)."""
        return self.frames * self.hop / self.rate

    def features(self, wave: np.ndarray, name: str = "clip") -> np.ndarray:
        samples = self.frames * self.hop
        wave = np.asarray(wave, np.float32)[:samples]
        padded = np.zeros(samples + self.n_fft, np.float32)           # centred, reflected
        padded[self.n_fft // 2:self.n_fft // 2 + wave.size] = wave
        body = padded[self.n_fft // 2:self.n_fft // 2 + samples]
        half = self.n_fft // 2
        padded[:half] = body[1:half + 1][::-1]
        padded[half + samples:] = body[-half - 1:-1][::-1]
        frames = _frames(padded, self.n_fft, self.hop)[:self.frames]   # Whisper drops the last
        mel = _power(frames, self._window, self.n_fft) @ self._filters
        log = np.log10(np.maximum(mel, np.float32(1e-10)))
        log = np.maximum(log, log.max() - np.float32(8.0))
        return ((log + np.float32(4.0)) / np.float32(4.0)).astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class AudioPolicy:
    """How one audio encoder's clips become its input (module docstring)."""

    extractor: FbankFeatures | WhisperFeatures
    max_frames: int | None = None       # fbank: at most this many frames (None: all)
    channels: int = 1                   # fbank: the encoder's in_channels

    @classmethod
    def for_encoder(cls, module: Any, max_frames: int | None = None) -> AudioPolicy:
        """The policy of ``module`` (an ``ir.Module`` of an audio encoder). A patch-stem
        encoder reads ``mel_bins`` bins where its architecture says (BEATs' 128
        otherwise), an fbank of each of its ``in_channels``."""
        arch = module.arch
        if getattr(arch, "stem", "patch") == "whisper_conv":
            return cls(WhisperFeatures(bins=arch.in_channels,
                                       frames=2 * arch.max_source_positions))
        bins = getattr(arch, "mel_bins", None) or 128
        return cls(FbankFeatures.beats(bins), max_frames,
                   channels=getattr(arch, "in_channels", None) or 1)

    @property
    def max_seconds(self) -> float:
        """What is decoded of a clip: Whisper's window, or the frames kept (MAX_SECONDS
        when every frame is)."""
        e = self.extractor
        if isinstance(e, WhisperFeatures):
            return e.seconds
        if self.max_frames is None:
            return MAX_SECONDS
        return min(MAX_SECONDS, ((self.max_frames - 1) * e.hop + e.frame_length) / e.rate)

    def num_frames(self, samples: int, native: int) -> int:
        """The frames ``features`` gives a clip of ``samples`` samples at ``native`` Hz
        (from its header, nothing decoded): Whisper's fixed count, or the fbank frames of
        what is decoded of it, at most ``max_frames``."""
        e = self.extractor
        if isinstance(e, WhisperFeatures):
            return e.frames
        n = e.num_frames(resampled_length(samples, native, e.rate, self.max_seconds,
                                          self.channels))
        return n if self.max_frames is None else min(n, self.max_frames)

    def features(self, data: bytes, name: str) -> np.ndarray:
        """The clip in ``data`` as this encoder's float32 ``[frames, bins]`` (``[frames,
        channels, bins]``: an fbank per channel); AudioError for a clip that cannot be read
        (or, for fbank, is shorter than one frame)."""
        wave = decode_audio(data, name, rate=self.extractor.rate, max_seconds=self.max_seconds,
                            channels=self.channels)
        out = self.extractor.features(wave, name) if wave.ndim == 1 else np.stack(
            [self.extractor.features(wave[:, c], name) for c in range(wave.shape[1])], axis=1)
        return out[:self.max_frames] if self.max_frames is not None else out
