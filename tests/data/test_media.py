"""Audio and video files in datasets (issue 29): WebDataset members written by the
``webdataset`` library (flac by soundfile, mp4 by PyAV) and LLaVA JSON ``audio``/``video``
fields, indexed from their headers (tokens known before decoding, equal to the runtime's),
placed by ``<audio>``/``<video>``, hostile files skipped with a reason, counted by ``dtc data
stats``; a bundle with an image, an audio and a video encoder trains on them as ``dtc
reference`` does, every sample once per epoch per unit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from dtdsl import cli
from dtdsl.data.decode import Decoder
from dtdsl.data.media import ClipReader, index_media
from dtdsl.data.shards import EncodedClip
from dtdsl.data.sources import open_dataset
from dtdsl.ir.modal import encoder_inputs
from tests.helpers.media import (
    _flac,
    _llava,
    write_clip,
    write_media_shards,
)
from tests.text_models import make_tokenizer
from tests.train.modal_specs import tiny_modal


@pytest.mark.parametrize("frames, channels", [(False, 1), (True, 1), (False, 2)])
def test_clip_tokens_from_the_index_equal_the_decoded_clips(tmp_path, frames, channels):
    """Every audio and video clip's shape, and so its tokens, from its header alone
    equals what the workers decode and what the model's encoders make of it, under both
    encoders' rules (``frames``: an audio encoder without a patch, a token per fbank
    frame, on flac and wav members; ``channels``: the audio encoder's in_channels, the
    mono clips' one signal in each, ``[T, 2, 16]``)."""
    import torch

    from dtdsl.models.multimodal import build_model

    write_media_shards(tmp_path / "s", n=12, wav=frames)
    program = tiny_modal(audio=True, video=True, frames=frames, channels=channels)
    decoder = Decoder.for_program(program, seed=0)
    rules = encoder_inputs(program)
    torch.manual_seed(0)
    model = build_model(program)
    seen = {"beats": 0, "clip": 0}
    with open_dataset("s", base_dir=tmp_path) as ds:
        assert len(ds) == 12 and not ds.skipped
        for i in range(len(ds)):
            info = ds.info(i)
            predicted = decoder.input_shapes(info)
            decoded = decoder.decode(ds.read(i))
            for name, items in decoded.inputs.items():
                assert [x.shape for x in items] == list(predicted[name])
                assert all(x.dtype == np.float32 for x in items)
                rule = rules.rule(name)
                reader = decoder.readers[name]
                clips = info.audio_clips if rule.modality == "audio" else info.videos
                tokens = [reader.tokens(c) for c in clips]
                assert tokens == [rule.tokens(x.shape) for x in items]
                encoder = model.unit(name)
                with torch.no_grad():
                    made = [encoder.embed(rule.patchify(torch.from_numpy(x)[None]),
                                          rule.grid(x.shape)).shape[1] for x in items]
                assert made == tokens
                seen[name] += len(items)
    assert seen["beats"] == 16 and seen["clip"] == 4
    # The 16 kHz 0.2 s clip: 18 fbank frames; 4 whole rows of 4 -> 16 frames, 16 tokens
    # of 4x4 patches, or 18 frames, 18 tokens a frame a token.
    reader = decoder.readers["beats"]
    info = index_media(_flac(np.random.default_rng(1), 0.2, 16_000), "a.flac")
    want = 18 if frames else 16
    bins = (16,) if channels == 1 else (channels, 16)
    assert reader.shape(info) == (want, *bins) and reader.tokens(info) == want
    # Under a clamp high of audio.frames (12 tokens): at most 12 frames, or 3 rows of 4.
    data = program.data
    clamped = program.model_copy(update={"data": data.model_copy(update={"quantities": tuple(
        q.model_copy(update={"high": 12}) if q is data.get("audio", "frames") else q
        for q in data.quantities)})})
    reader = ClipReader.for_encoder(clamped, clamped.module("beats"))
    decoded = reader.read(EncodedClip(info, _flac(np.random.default_rng(1), 0.2, 16_000)))
    assert reader.shape(info) == decoded.shape == (12, *bins) and reader.tokens(info) == 12
    # A video of 9 frames of 24x16 at 10 fps: 0.9 s -> 4 frames (2 fps, at least 4),
    # 2 temporal patches of 4 x 6 patches of 4 pixels.
    info = index_media(write_clip(9, width=24, height=16), "v.mp4")
    assert decoder.readers["clip"].shape(info) == (4, 3, 16, 24)
    assert decoder.readers["clip"].tokens(info) == 2 * 4 * 6


def test_placeholders_place_clips_and_the_rest_go_first(tmp_path):
    write_media_shards(tmp_path / "s", n=3)
    make_tokenizer(tmp_path / "tok")
    program = tiny_modal(audio=True, video=True)
    program = program.model_copy(update={"data": program.data.model_copy(
        update={"tokenizer": str(tmp_path / "tok")})})
    decoder = Decoder.for_program(program, seed=0)
    with open_dataset("s", base_dir=tmp_path) as ds:
        first, third = decoder.decode(ds.read(0)), decoder.decode(ds.read(2))
        plain = decoder.tokenizer.encode("a photo of a cat ")
    # "a photo of a cat <audio> ...": BOS, then the text up to the placeholder.
    assert first.inputs_at == {"beats": (1 + len(plain),), "clip": ()}
    # "<video> ... <audio> ...": the video first, the audio after its text.
    assert third.inputs_at["clip"] == (1,) and third.inputs_at["beats"][0] > 1
    # Without an audio or video encoder, the placeholders are plain text.
    image_only = program.model_copy(update={"modules": tuple(
        m for m in program.modules if m.modality not in ("audio", "video"))})
    assert Decoder.for_program(image_only, seed=0).kinds == ()


def test_hostile_clips_are_skipped_with_a_reason(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "s"
    root.mkdir()
    good = _flac(rng, 0.3, 16_000)
    clip = write_clip(6)
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        sink.write({"__key__": "ok", "txt": "fine", "flac": good, "mp4": clip})
        sink.write({"__key__": "junk_audio", "txt": "bad", "flac": b"\0" * 512})
        sink.write({"__key__": "empty_audio", "txt": "bad", "wav": b""})
        sink.write({"__key__": "junk_video", "txt": "bad",
                    "mp4": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()})
        sink.write({"__key__": "cut_video", "txt": "bad", "mp4": clip[:40]})
    with open_dataset("s", base_dir=tmp_path) as ds:
        assert [ds.key(i) for i in range(len(ds))] == ["ok"]
        assert dict(ds.skipped) == {"unreadable audio": 2, "unreadable video": 2}
    # A clip too short for one row of patches gives no token: the decode check says so.
    program = tiny_modal(audio=True)
    reader = ClipReader.for_encoder(program, program.module("beats"))
    short = index_media(_flac(rng, 0.02, 16_000), "short.flac")
    with pytest.raises(Exception, match="shorter than one row of 4 frames"):
        reader.shape(short)
    # A clip that gives more tokens than the backbone's seq_len fits no sequence: refused
    # from its header, before anything decodes (what it would allocate is bounded).
    program = tiny_modal(video=True)
    video = ClipReader.for_encoder(program, program.module("clip"))
    info = index_media(write_clip(9, width=24, height=16), "v.mp4")
    fits = video.tokens(info)
    tight = ClipReader.for_encoder(program.model_copy(update={"train": program.train.model_copy(
        update={"seq_len": fits - 1})}), program.module("clip"))
    with pytest.raises(Exception, match=f"{fits} tokens, more than the backbone's seq_len"):
        tight.shape(info)


def _spec(tmp_path: Path, source: str, frames: bool = False) -> Path:
    from tests.train.modal_specs import _modal_text, _root

    text = _modal_text((_root() / "specs" / "tiny_cpu.dt").read_text(), frames)
    text = text.replace('source = "data/tiny"', f'source = "{source}"\n  tokenizer = "tok"')
    text = text.replace("global_batch     = 16", "global_batch     = 8")
    spec = tmp_path / "modal.dt"
    spec.write_text(text)
    return spec


@pytest.mark.slow
# (The patched audio encoder, on flac, trains in tests/data/test_hybrid.py's bundle test.)
@pytest.mark.parametrize("frames", [True])
def test_a_bundle_with_audio_and_video_encoders_trains_on_webdataset_media(tmp_path, frames):
    # frames: the audio encoder without a patch (a token per fbank frame), on flac and
    # wav members.
    from tests.helpers.bundle import consumed, launch_ok, read_jsonl, reference_losses

    keys = write_media_shards(tmp_path / "shards", n=24, per_shard=8, wav=frames)
    make_tokenizer(tmp_path / "tok")
    spec = _spec(tmp_path, "shards/{000000..000002}.tar", frames)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--workers", "2"]) == 0
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "3")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 3 and all(m["cut_samples"] == 0 for m in metrics)
    want = reference_losses(3, tmp_path / "shards" / "{000000..000002}.tar", spec)
    assert [m["loss"] for m in metrics] == pytest.approx(want, rel=1e-4)
    units = sorted({r["unit"] for r in read_jsonl(run_dir / "samples.jsonl")})
    assert units == ["beats", "clip", "gen", "llm", "vit"]
    for unit in units:
        per_step = consumed(run_dir, unit)
        assert sorted(k for step in range(3) for k in per_step.get(step, [])) == keys, unit




def test_llava_audio_and_video_fields(tmp_path):
    path = _llava(tmp_path)
    make_tokenizer(tmp_path / "tok")
    program = tiny_modal(audio=True, video=True)
    program = program.model_copy(update={"data": program.data.model_copy(
        update={"tokenizer": str(tmp_path / "tok"), "image_folder": str(tmp_path / "media")})})
    decoder = Decoder.for_program(program, seed=0)
    with open_dataset(str(path), program=program) as ds:
        assert [ds.key(i) for i in range(len(ds))] == ["both", "one"]
        skipped = dict(ds.skipped)
        assert [k for k in skipped if k.startswith("audio path refused")] and \
            skipped.pop("missing video") == 1 and skipped.pop("unreadable video") == 1 and \
            list(skipped.values()) == [1]
        info = ds.info(0)
        assert [c.samples for c in info.audio_clips] == [4800, 5512] and \
            info.videos[0].frames == 6
        both = decoder.decode(ds.read(0))
        assert [x.shape for x in both.inputs["beats"]] == list(
            decoder.input_shapes(info)["beats"])
        assert both.inputs["clip"][0].shape == (4, 3, 16, 16)
        # Two clips, one <audio>: the other goes first in the user turn (as images
        # without a placeholder do), then <image>, the placed clip, the video last.
        (image,), audio, (video,) = both.image_at, both.inputs_at["beats"], \
            both.inputs_at["clip"]
        assert audio[0] < image < audio[1] < video
        one = decoder.decode(ds.read(1))
        assert len(one.inputs["beats"]) == 1 and one.inputs["clip"] == ()


def test_data_stats_count_audio_and_video_tokens(tmp_path, capsys):
    write_media_shards(tmp_path / "s", n=9, per_shard=9)
    make_tokenizer(tmp_path / "tok")
    spec = tmp_path / "modal.dt"
    spec.write_text(_spec(tmp_path, "s").read_text())
    assert cli.main(["data", "stats", str(tmp_path / "s"), "--spec", str(spec),
                     "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    program = tiny_modal(audio=True, video=True)
    decoder = Decoder.for_program(program, seed=0)
    rules = encoder_inputs(program)
    with open_dataset("s", base_dir=tmp_path) as ds:
        decoded = [decoder.decode(ds.read(i)) for i in range(len(ds))]
    assert stats["audio.count"] == [len(d.inputs["beats"]) for d in decoded]
    assert stats["audio.frames"] == [rules.rule("beats").tokens(x.shape)
                                     for d in decoded for x in d.inputs["beats"]]
    assert stats["video.count"] == [len(d.inputs["clip"]) for d in decoded]
    assert stats["video.frames"] == [x.shape[0] for d in decoded for x in d.inputs["clip"]]
    assert stats["video.patches"] == [(x.shape[2] // 4) * (x.shape[3] // 4)
                                      for d in decoded for x in d.inputs["clip"]]
    # Without a spec: BEATs' and Qwen2-VL's rules.
    assert cli.main(["data", "stats", str(tmp_path / "s"), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    # 16x16 and 24x16 frames at 14 pixels: 1x1 and 2x1 patches; 4 to 6 frames of 2 fps
    # clips of 10 fps floored to whole temporal patches of 2: 2 (at most the clip's).
    assert sorted(set(plain["video.patches"])) == [1, 2]
    assert plain["audio.count"] == stats["audio.count"]


def test_clamps_cut_clips_as_they_cut_images():
    """audio.count / video.count clamp a sample's clips to their first HIGH; a text.tokens
    cut drops the clips placed after it, as it drops images."""
    from dtdsl.data.clamps import Clamps
    from dtdsl.ir.sizes import SampleSizes

    program = tiny_modal(audio=True, video=True)
    data = program.data.model_copy(update={"quantities": tuple(
        q.model_copy(update={"high": 1.0}) if (q.modality, q.name) == ("audio", "count")
        else q.model_copy(update={"high": 20.0}) if (q.modality, q.name) == ("text", "tokens")
        else q for q in program.data.quantities)})
    clamps = Clamps.for_program(program.model_copy(update={"data": data}))
    sizes = SampleSizes(text_tokens=30, image_shapes=(), gen_counts={"gen": 0},
                        inputs={"beats": ((8, 16), (12, 16)), "clip": ((2, 3, 8, 8),
                                                                   (2, 3, 8, 8))},
                        inputs_at={"beats": (3, 5), "clip": (10, 25)})
    cut = clamps.apply(sizes)
    assert cut.text_tokens == 20
    assert cut.inputs == {"beats": ((8, 16),), "clip": ((2, 3, 8, 8),)}
    assert cut.inputs_at == {"beats": (3,), "clip": (10,)}


def test_gen_audio_members_are_an_audio_generators_targets(tmp_path):
    from tests.train.modal_specs import tiny_audio_image

    rng = np.random.default_rng(0)
    root = tmp_path / "s"
    root.mkdir()
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        sink.write({"__key__": "a", "txt": "a cat", "flac": _flac(rng, 0.3, 16_000),
                    "gen.flac": _flac(rng, 0.5, 22_050), "gen1.wav": _flac(rng, 0.2, 16_000)})
    program = tiny_audio_image()
    decoder = Decoder.for_program(program, seed=0)
    with open_dataset("s", base_dir=tmp_path) as ds:
        info = ds.info(0)
        assert (info.audio_count, info.gen_audio_count) == (1, 2)
        decoded = decoder.decode(ds.read(0))
    arch = program.module("audiogen").arch
    assert decoded.gen["audiogen"].latents.shape == (2, arch.latent_channels, arch.latent,
                                                     arch.latent)
    assert np.isfinite(decoded.gen["audiogen"].latents).all()
    assert [x.shape for x in decoded.inputs["beats"]] == [(28, 16)]


@pytest.mark.parametrize("rate", [8_000, 11_025, 16_000, 22_050, 44_100, 48_000, 44_101])
def test_an_audio_headers_length_predicts_the_decoded_waveforms(rate):
    from dtdsl.data.audio import AudioPolicy, FbankFeatures, decode_audio, resampled_length

    data = _flac(np.random.default_rng(rate), 0.37, rate)
    info = index_media(data, "a.flac")
    assert (info.rate, info.samples) == (rate, int(0.37 * rate))
    assert resampled_length(info.samples, rate) == decode_audio(data, "a.flac").size
    policy = AudioPolicy(FbankFeatures.beats(16), max_frames=30)
    assert policy.num_frames(info.samples, rate) == policy.features(data, "a.flac").shape[0]
    short = AudioPolicy(FbankFeatures.beats(16), max_frames=7)       # only 95 ms decoded
    assert short.num_frames(info.samples, rate) == short.features(data, "a.flac").shape[0] == 7


def test_a_clip_whose_header_promises_more_than_it_holds_is_left_out(tmp_path):
    """A cut-off FLAC indexes (its header says 1 s) but does not decode: the run's decode
    check leaves its sample out before any batch is formed, saying why."""
    from dtdsl.data.usable import DOES_NOT_DECODE
    from dtdsl.feed.source import DatasetSource

    rng = np.random.default_rng(0)
    whole = _flac(rng, 1.0, 16_000)
    root = tmp_path / "s"
    root.mkdir()
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"ok{i}", "txt": "a cat", "flac": whole})
        sink.write({"__key__": "cut", "txt": "a dog", "flac": whole[:len(whole) // 2]})
    make_tokenizer(tmp_path / "tok")
    program = tiny_modal(audio=True, batch=2)
    program = program.model_copy(update={"data": program.data.model_copy(
        update={"tokenizer": str(tmp_path / "tok")})})
    source = DatasetSource(program, root)
    assert len(source.dataset) == 4 and source.left_out == {DOES_NOT_DECODE: 1}
    assert sorted(source.dataset.key(i) for i in source.usable) == ["ok0", "ok1", "ok2"]
    sizes = source.sizes(0)
    assert [s.inputs["beats"] for s in sizes] == [((96, 16),)] * 2     # 98 frames, rows of 4


def test_precomputed_features_feed_a_frame_stem_a_frame_a_token(tmp_path):
    # .npy clips are fbank features already: an encoder without a patch reads them a
    # frame a token, every frame (audio.frames has no clamp here), and their bins must be
    # the encoder's mel_bins. The index's shapes are the decoded ones and the model's
    # tokens.
    import torch

    from dtdsl.data.encode import encode_audio
    from dtdsl.data.shards import RawSample, sample_key, write_dataset
    from dtdsl.models.multimodal import build_model

    rng = np.random.default_rng(0)
    features = [rng.standard_normal((n, 16)).astype(np.float32) for n in (1, 29, 57)]
    samples = [RawSample(key=sample_key(i), text="a clip", audio=(encode_audio(f),))
               for i, f in enumerate(features)]
    samples.append(RawSample(key=sample_key(3), text="wrong bins",
                             audio=(encode_audio(rng.standard_normal((9, 8))),)))
    write_dataset(tmp_path / "d", samples, samples_per_shard=4)
    program = tiny_modal(audio=True, frames=True)
    decoder = Decoder.for_program(program, seed=0)
    rule = encoder_inputs(program).rule("beats")
    torch.manual_seed(0)
    encoder = build_model(program).unit("beats")
    with open_dataset(str(tmp_path / "d")) as ds:
        for i, n in enumerate((1, 29, 57)):
            info = ds.info(i)
            [clip] = decoder.decode(ds.read(i)).inputs["beats"]
            assert decoder.input_shapes(info)["beats"] == ((n, 16),) and clip.shape == (n, 16)
            assert np.array_equal(clip, features[i])
            with torch.no_grad():
                x = encoder.embed(rule.patchify(torch.from_numpy(clip)[None]),
                                  rule.grid(clip.shape))
            assert x.shape[1] == rule.tokens(clip.shape) == n
        with pytest.raises(Exception, match="8 bins; encoder 'beats' reads 16"):
            decoder.decode(ds.read(3))


def test_precomputed_features_with_a_channel_axis_feed_a_two_channel_encoder(tmp_path):
    # .npy features of a two-channel encoder are [frames, 2, bins] (the record says
    # channels=2); one without the channel axis, or with another count, is refused by name.
    import torch

    from dtdsl.data.encode import encode_audio
    from dtdsl.data.shards import RawSample, sample_key, write_dataset
    from dtdsl.models.multimodal import build_model

    rng = np.random.default_rng(0)
    features = [rng.standard_normal((n, 2, 16)).astype(np.float32) for n in (8, 21)]
    wrong = [rng.standard_normal((8, 16)), rng.standard_normal((8, 3, 16))]
    samples = [RawSample(key=sample_key(i), text="a clip", audio=(encode_audio(f),))
               for i, f in enumerate(features + wrong)]
    write_dataset(tmp_path / "d", samples, samples_per_shard=4)
    program = tiny_modal(audio=True, channels=2)
    decoder = Decoder.for_program(program, seed=0)
    rule = encoder_inputs(program).rule("beats")
    torch.manual_seed(0)
    encoder = build_model(program).unit("beats")
    with open_dataset(str(tmp_path / "d")) as ds:
        for i, n in enumerate((8, 20)):         # 21 frames: 5 whole rows of 4
            [clip] = decoder.decode(ds.read(i)).inputs["beats"]
            assert decoder.input_shapes(ds.info(i))["beats"] == ((n, 2, 16),)
            assert np.array_equal(clip, features[i][:n])
            with torch.no_grad():
                x = encoder.embed(rule.patchify(torch.from_numpy(clip)[None]),
                                  rule.grid(clip.shape))
            assert x.shape[1] == rule.tokens(clip.shape) == n
        with pytest.raises(Exception, match=r"float32 \[8, 16\], not float32 \[frames, 2, "):
            decoder.decode(ds.read(2))
        with pytest.raises(Exception, match="3 channels of 16 bins; encoder 'beats' reads "
                                            "2 channels of 16 bins"):
            decoder.decode(ds.read(3))
    # dtc data synth writes what such an encoder reads: a clip drawn per channel.
    from dtdsl.data.synth import synthesize

    clips = [decoder.decode(raw).inputs["beats"] for raw in synthesize(program, 12, seed=1)]
    clips = [c for items in clips for c in items]
    assert clips and all(c.shape[1:] == (2, 16) for c in clips)
    assert all(not np.array_equal(c[:, 0], c[:, 1]) for c in clips)
