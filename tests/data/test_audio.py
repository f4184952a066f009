"""Audio decoding and features (``data.audio``): clips written here with soundfile (and
PyAV) read back; fbank and Whisper log-mel held to transformers' feature extractors;
hostile files refused in one line, in bounded memory."""

from __future__ import annotations

import io
import struct
import tracemalloc
import warnings

import numpy as np
import pytest
import soundfile as sf

from dtdsl.data.audio import (
    SAMPLE_RATE,
    AudioError,
    FbankFeatures,
    WhisperFeatures,
    decode_audio,
)
from dtdsl.data.shards import DatasetError

RATE = 44_100
BEATS = FbankFeatures.beats


def _tone(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    """A stereo clip: a tone on the left, half of it on the right (mono mean: 0.75 x)."""
    t = np.arange(int(seconds * rate)) / rate
    left = 0.4 * np.sin(2 * np.pi * freq * t)
    return np.stack([left, 0.5 * left], axis=1).astype(np.float32)


def _encode(clip: np.ndarray, fmt: str, rate: int = RATE, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, clip, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Mono 16 kHz: two tones, a chirp and noise, with a silent stretch (the floors)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    wave = 0.2 * np.sin(2 * np.pi * 300 * t) + 0.1 * np.sin(2 * np.pi * 2500 * t) + \
        0.1 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.02 * rng.standard_normal(t.size)
    wave[len(t) // 3:len(t) // 2] = 0.0
    return wave.astype(np.float32)


def _peak_hz(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(wave.size)))
    return float(np.fft.rfftfreq(wave.size, 1 / rate)[spectrum.argmax()])


# ---- decoding ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_24"),
                                         ("WAV", "FLOAT")])
def test_lossless_clips_decode_to_mono_16k(fmt, subtype):
    clip = _tone(1.5)
    wave = decode_audio(_encode(clip, fmt, subtype=subtype), f"a.{fmt.lower()}")
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert wave.size == int(1.5 * SAMPLE_RATE)
    t = np.arange(wave.size) / SAMPLE_RATE
    want = 0.75 * 0.4 * np.sin(2 * np.pi * 440 * t)
    inner = slice(200, -200)            # the resampler's edges
    assert np.abs(wave[inner] - want[inner]).max() < 2e-3


@pytest.mark.parametrize("fmt", ["MP3", "OGG"])
def test_lossy_clips_decode_to_mono_16k(fmt):
    wave = decode_audio(_encode(_tone(2.0), fmt), f"a.{fmt.lower()}")
    assert wave.dtype == np.float32 and wave.ndim == 1
    # Codecs add a priming delay and pad the last frame: about the clip's length.
    assert abs(wave.size - 2 * SAMPLE_RATE) < 0.1 * SAMPLE_RATE
    assert abs(_peak_hz(wave, SAMPLE_RATE) - 440) < 2
    assert 0.25 < np.abs(wave[4000:-4000]).max() < 0.35      # 0.75 x 0.4


def test_other_rates_resample_and_mono_stays_mono():
    mono = _tone(1.0, rate=22_050)[:, :1]
    wave = decode_audio(_encode(mono, "FLAC", rate=22_050), "m.flac")
    assert wave.size == SAMPLE_RATE
    assert abs(_peak_hz(wave, SAMPLE_RATE) - 440) < 2
    slow = _tone(1.0, rate=8_000)[:, :1]
    same = decode_audio(_encode(slow, "WAV", rate=8_000, subtype="FLOAT"), "w.wav", rate=8_000)
    assert np.array_equal(same, slow[:, 0])


def test_formats_libsndfile_lacks_decode_with_pyav():
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="ipod") as out:             # .m4a, AAC
        stream = out.add_stream("aac", rate=RATE, layout="stereo")
        clip = _tone(1.0)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(clip.T), format="fltp",
                                           layout="stereo")
        frame.sample_rate = RATE
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    with pytest.raises(sf.LibsndfileError):
        sf.SoundFile(io.BytesIO(buf.getvalue()))
    wave = decode_audio(buf.getvalue(), "a.m4a")
    assert abs(wave.size - SAMPLE_RATE) < 0.1 * SAMPLE_RATE
    assert abs(_peak_hz(wave, SAMPLE_RATE) - 440) < 2


def test_max_seconds_cuts_a_long_clip():
    wave = decode_audio(_encode(_tone(3.0), "FLAC"), "long.flac", max_seconds=1.0)
    assert wave.size == SAMPLE_RATE


def _wav_header(data: bytes, **fields: int) -> bytes:
    """A PCM WAV with header fields overwritten (channels, rate, data_bytes)."""
    out = bytearray(data)
    assert out[:4] == b"RIFF" and out[12:16] == b"fmt "
    if "channels" in fields:
        out[22:24] = struct.pack("<H", fields["channels"])
    if "rate" in fields:
        out[24:28] = struct.pack("<I", fields["rate"])
    if "data_bytes" in fields:
        at = out.index(b"data")
        out[at + 4:at + 8] = struct.pack("<I", fields["data_bytes"])
    return bytes(out)


def test_hostile_header_claiming_hours_reads_what_is_there_in_bounded_memory():
    one_second = _encode(_tone(1.0, rate=SAMPLE_RATE), "WAV", rate=SAMPLE_RATE,
                         subtype="PCM_16")
    # 10 hours of 16 kHz stereo 16-bit, claimed; 1 s held.
    liar = _wav_header(one_second, data_bytes=10 * 3600 * SAMPLE_RATE * 4)
    assert sf.info(io.BytesIO(liar)).frames >= SAMPLE_RATE
    tracemalloc.start()
    try:
        wave = decode_audio(liar, "liar.wav")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert wave.size == SAMPLE_RATE
    assert peak < 8 << 20


def test_hostile_or_damaged_files_are_one_line_errors_naming_them():
    good = _encode(_tone(0.5), "WAV", subtype="PCM_16")
    nan = _tone(0.5)
    nan[100, 1] = np.nan
    inf = _tone(0.5)
    inf[7, 0] = np.inf
    cases = {
        "empty.wav": (b"", "empty"),
        "noise.flac": (bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8)),
                       "not an audio file"),
        "nan.wav": (_encode(nan, "WAV", subtype="FLOAT"), "NaN"),
        "inf.flac": (_encode(inf, "WAV", subtype="FLOAT"), "NaN or infinite"),
        "rate.wav": (_wav_header(good, rate=2_000_000_000), "sample rate"),
        "header.wav": (good[:44], "no samples"),
        "cut.mp3": (_encode(_tone(1.0), "MP3")[:60], "cut.mp3"),
    }
    for name, (data, words) in cases.items():
        with pytest.raises(AudioError) as err:
            decode_audio(data, name)
        message = str(err.value)
        assert message.startswith(f"{name}: ") and words in message, message
        assert "\n" not in message and len(message) < 300
        assert isinstance(err.value, DatasetError)


# ---- features ------------------------------------------------------------------------

def test_fbank_equals_transformers_ast_feature_extractor():
    from transformers import ASTFeatureExtractor

    wave = _speech_like(3.0)
    ours = FbankFeatures(bins=128, window_name="hann").features(wave)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # its 128 Kaldi banks leave one empty
        extractor = ASTFeatureExtractor(num_mel_bins=128, do_normalize=False)
    ref = extractor._extract_fbank_features(wave, max_length=10_000)
    assert ours.dtype == np.float32 and ours.shape == (298, 128)
    # Natural-log fbank, float32 against transformers' float64: within 5e-4 (1e-5 of the
    # features' range), most within 1e-6.
    np.testing.assert_allclose(ours, ref[:298], atol=5e-4, rtol=0)
    assert np.median(np.abs(ours - ref[:298])) < 1e-5
    assert not ref[298:].any()                                      # its zero padding


def _kaldi_fbank(wave: np.ndarray, bins: int = 128) -> np.ndarray:
    """Kaldi's fbank (torchaudio.compliance.kaldi.fbank's defaults, dither 0) from its
    definition, in float64: the reference for the Povey-window features."""
    length, hop, n_fft, rate = 400, 160, 512, SAMPLE_RATE
    n = 1 + (wave.size - length) // hop
    frames = np.stack([wave[i * hop:i * hop + length] for i in range(n)]).astype(np.float64)
    frames -= frames.mean(axis=1, keepdims=True)
    frames = np.concatenate([frames[:, :1] * (1 - 0.97),
                             frames[:, 1:] - 0.97 * frames[:, :-1]], axis=1)
    a = 2 * np.pi / (length - 1)
    frames *= (0.5 - 0.5 * np.cos(a * np.arange(length))) ** 0.85
    power = np.abs(np.fft.rfft(frames, n=n_fft)) ** 2

    def mel(f):
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    low, high = mel(20.0), mel(rate / 2)
    delta = (high - low) / (bins + 1)
    freqs = mel(np.arange(n_fft // 2) * rate / n_fft)
    banks = np.zeros((n_fft // 2 + 1, bins))
    for b in range(bins):
        left, centre, right = low + b * delta, low + (b + 1) * delta, low + (b + 2) * delta
        up = (freqs - left) / (centre - left)
        down = (right - freqs) / (right - centre)
        banks[:n_fft // 2, b] = np.maximum(0.0, np.minimum(up, down))
    return np.log(np.maximum(power @ banks, np.finfo(np.float32).eps))


def test_beats_fbank_is_kaldi_fbank_of_the_16_bit_scaled_clip_normalised():
    wave = _speech_like(2.0, seed=3)
    ours = BEATS().features(wave)
    ref = (_kaldi_fbank(wave * 32768.0) - 15.41663) / (2 * 6.55582)
    assert ours.shape == (198, 128) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=5e-5, rtol=0)


def test_fbank_refuses_a_clip_shorter_than_a_frame():
    with pytest.raises(AudioError, match="short.wav: 399 samples, shorter than one 25 ms"):
        BEATS().features(np.zeros(399, np.float32), "short.wav")
    assert BEATS().num_frames(400) == 1 and BEATS().num_frames(16_000) == 98


@pytest.mark.parametrize("bins,seconds", [(80, 4.0), (128, 4.0), (80, 31.5), (80, 0.01)])
def test_whisper_log_mel_equals_transformers(bins, seconds):
    from transformers import WhisperFeatureExtractor

    wave = _speech_like(seconds, seed=bins)
    ours = WhisperFeatures(bins=bins).features(wave)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extractor = WhisperFeatureExtractor(feature_size=bins)
    ref = extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    assert ours.shape == (3000, bins) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref.T, atol=1e-4, rtol=0)


def test_features_are_deterministic_and_do_not_touch_their_input():
    wave = _speech_like(1.0)
    before = wave.copy()
    for extractor in (BEATS(), WhisperFeatures()):
        a, b = extractor.features(wave), extractor.features(wave)
        assert np.array_equal(a, b)
    assert np.array_equal(wave, before)


def test_a_patch_stem_encoder_reads_beats_fbank_cut_to_its_frames():
    from dtdsl.data.audio import AudioPolicy
    from dtdsl.ir import program as ir
    from dtdsl.source import Span

    arch = ir.TransformerArch(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, patch=16,
                              in_channels=1)
    ear = ir.Module(name="ear", role="encoder", modality="audio", arch=arch,
                    span=Span.point(1, 1))
    policy = AudioPolicy.for_encoder(ear, max_frames=50)
    assert policy.max_seconds == (49 * 160 + 400) / SAMPLE_RATE
    clip = _encode(_tone(3.0, rate=SAMPLE_RATE), "FLAC", rate=SAMPLE_RATE)
    got = policy.features(clip, "a.flac")
    assert got.shape == (50, 128) and got.dtype == np.float32
    wave = decode_audio(clip, "a.flac")
    np.testing.assert_array_equal(got, BEATS().features(wave)[:50])
    whole = AudioPolicy.for_encoder(ear).features(clip, "a.flac")
    assert whole.shape == (BEATS().num_frames(3 * SAMPLE_RATE), 128)


# ---- several input channels -----------------------------------------------------------

def _channels(seconds: float, freqs: tuple[float, ...], rate: int = RATE) -> np.ndarray:
    """A clip of one tone per channel, ``[samples, len(freqs)]``."""
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * f * t) for f in freqs], axis=1).astype(np.float32)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_a_two_channel_encoder_reads_an_fbank_of_each_channel(fmt):
    # [frames, 2, bins]: each channel's own fbank, as the one-channel policy computes it
    # from that channel alone (left 440 Hz, right 3 kHz: the channels differ).
    from dtdsl.data.audio import AudioPolicy

    policy = AudioPolicy(BEATS(16), max_frames=40, channels=2)
    clip = _channels(1.0, (440.0, 3000.0))
    got = policy.features(_encode(clip, fmt), f"a.{fmt.lower()}")
    assert got.shape == (40, 2, 16) and got.dtype == np.float32
    assert np.abs(got[:, 0] - got[:, 1]).max() > 1.0
    one = AudioPolicy(BEATS(16), max_frames=40)
    for c in range(2):
        alone = one.features(_encode(clip[:, c], fmt), "c.wav")
        np.testing.assert_allclose(got[:, c], alone, atol=1e-5)
    # The frames follow from the header as for one channel (what an index predicts).
    assert policy.num_frames(clip.shape[0], RATE) == got.shape[0]


def test_mono_feeds_every_channel_and_extra_channels_are_cut():
    from dtdsl.data.audio import AudioPolicy

    policy = AudioPolicy(BEATS(16), channels=2)
    mono = _encode(_channels(0.5, (440.0,)), "WAV")
    got = policy.features(mono, "m.wav")
    assert np.array_equal(got[:, 0], got[:, 1])
    np.testing.assert_array_equal(got[:, 0], AudioPolicy(BEATS(16)).features(mono, "m.wav"))
    # Three channels for two: the first two, as a two-channel file of them decodes.
    three = _channels(0.5, (440.0, 3000.0, 1000.0))
    np.testing.assert_array_equal(policy.features(_encode(three, "FLAC"), "t.flac"),
                                  policy.features(_encode(three[:, :2], "FLAC"), "s.flac"))
    wave = decode_audio(_encode(three, "FLAC"), "t.flac", channels=2)
    assert wave.shape == (8000, 2)
    # Two channels for four: which would fill the other two is a guess; refused.
    with pytest.raises(AudioError, match=r"s\.flac: 2 channels, fewer than the encoder's 4"):
        decode_audio(_encode(three[:, :2], "FLAC"), "s.flac", channels=4)
