"""Video clips to frames (``data.video``): clips written here with PyAV, read back by
count and by fps; the patch layout against transformers' Qwen2-VL; hostile files."""

from __future__ import annotations

import ast
import importlib.util
import io
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from dtdsl.data.images import ImagePolicy, normalize, patch_grid
from dtdsl.data.shards import DatasetError
from dtdsl.data.video import (
    FrameSampling,
    VideoError,
    VideoLimits,
    clip_tokens,
    decode_clip,
    index_clip,
    linear_patch_weight,
    patchify,
    sample_indices,
)
from dtdsl.ir.modal import CLIP_MEAN, CLIP_STD
from tests.helpers.media import (
    BASE,
    CYCLE,
    STEP,
    level,
    write_clip,
)


def shown(frames: np.ndarray, texture: bool = False) -> list[int]:
    """Which frame of ``write_clip`` each decoded frame is (nearest grey level; modulo
    ``CYCLE``)."""
    region = frames[:, 0, 4:12, 4:12] if texture else frames[:, 0]
    means = region.reshape(len(frames), -1).mean(axis=1)
    return [int(round((m - BASE) / STEP)) for m in means]


def evenly(count: int, total: int) -> list[int]:
    """What ``shown`` gives for ``count`` frames sampled evenly from ``total``."""
    return [int(i) % CYCLE for i in np.linspace(0, total - 1, count).round()]


POLICY = ImagePolicy(patch=8)
FORMATS = [("libx264", "mp4", {"bf": "3", "g": "5"}), ("mpeg4", "mp4", {"qscale": "2"}),
           ("libvpx", "webm", None), ("libx264", "matroska", {"g": "4"})]


@pytest.mark.parametrize(("codec", "fmt", "options"), FORMATS)
def test_samples_a_fixed_count_evenly(codec, fmt, options):
    clip = write_clip(24, codec=codec, fmt=fmt, options=options, width=48, height=32,
                      texture=codec == "libx264")
    for count in (1, 5, 8, 24):
        frames = decode_clip(clip, "c", policy=POLICY, sampling=FrameSampling(frames=count))
        assert frames.dtype == np.uint8 and frames.shape == (count, 3, 32, 48)
        expected = evenly(count, 24)
        assert shown(frames, codec == "libx264") == expected


def test_b_frames_are_sampled_in_presentation_order():
    clip = write_clip(30, options={"bf": "3", "g": "10", "b-pyramid": "none"},
                      width=64, height=64, texture=True)
    index = index_clip(clip, "c")
    assert (np.diff(index.pts) < 0).any(), "the clip should have reordered B-frames"
    frames = decode_clip(clip, "c", policy=POLICY, sampling=FrameSampling(frames=7))
    assert shown(frames, texture=True) == evenly(7, 30)


def test_more_frames_than_the_clip_repeats_them():
    frames = decode_clip(write_clip(3), "c", policy=POLICY, sampling=FrameSampling(frames=6))
    assert shown(frames) == [0, 0, 1, 1, 2, 2]


def test_samples_by_fps_with_qwen2_vl_bounds():
    clip = write_clip(40, fps=10)                   # 4 seconds
    index = index_clip(clip, "c")
    assert index.frames == 40 and index.duration == pytest.approx(4.0)

    def read(**kw):
        return shown(decode_clip(clip, "c", policy=POLICY, sampling=FrameSampling(**kw)))

    assert read() == evenly(8, 40)                  # 2 fps
    assert len(read(fps=2.5)) == 10
    assert len(read(fps=2.5, multiple=4)) == 8      # whole temporal patches
    assert len(read(fps=0.5)) == 4                  # min_frames
    assert len(read(fps=100.0, max_frames=16)) == 16
    assert len(read(fps=100.0, max_frames=1000)) == 40     # not above the clip's frames
    short = write_clip(3, fps=10)                   # fewer frames than min_frames
    assert shown(decode_clip(short, "c", policy=POLICY)) == [0, 1, 2]


def test_frame_sampling_count_rule():
    rule = FrameSampling(fps=2.0, min_frames=4, max_frames=768, multiple=2)
    assert rule.count(total=300, duration=10.0) == 20
    assert rule.count(total=300, duration=10.9) == 20        # 21.8 floored to even
    assert rule.count(total=5, duration=0.5) == 4
    assert rule.count(total=1, duration=0.1) == 1
    assert rule.count(total=10**6, duration=1e9) == 768
    assert FrameSampling(frames=9).count(total=3, duration=None) == 9
    with pytest.raises(ValueError, match="fixed count"):
        FrameSampling().count(total=3, duration=None)
    for bad in ({"frames": 0}, {"fps": 0.0}, {"fps": float("nan")},
                {"min_frames": 5, "max_frames": 4}, {"multiple": 0}):
        with pytest.raises(ValueError):
            FrameSampling(**bad)
    assert sample_indices(3, 10).tolist() == [0, 4, 9]


def _all_frames(clip: bytes) -> list:
    with av.open(io.BytesIO(clip)) as container:
        return [f.to_image() for f in container.decode(video=0)]


@pytest.mark.parametrize("policy", [
    ImagePolicy(patch=8),                                   # native: 40x24 -> 40x24
    ImagePolicy(patch=8, max_patches=6),                    # native, scaled down
    ImagePolicy(patch=4, max_patches=16, block=2),          # whole 2x2 blocks
    ImagePolicy(patch=8, size=(16, 16), shortest_edge=16, resample="bicubic"),  # CLIP
])
def test_frames_are_sized_as_images_are(policy):
    clip = write_clip(6, width=40, height=24, texture=True)
    frames = decode_clip(clip, "c", policy=policy, sampling=FrameSampling(frames=6))
    expected = np.stack([policy.resize(image) for image in _all_frames(clip)])
    assert frames.shape == expected.shape and frames.dtype == np.uint8
    assert np.array_equal(frames, expected)
    if policy.size is None:
        gw, gh = patch_grid(40, 24, policy.patch, policy.max_patches, policy.block)
        assert frames.shape[2:] == (gh * policy.patch, gw * policy.patch)


def test_decodes_only_the_packets_its_frames_need():
    clip = write_clip(60, options={"g": "5", "keyint_min": "5", "sc_threshold": "0",
                                   "bf": "0"}, width=16, height=16)
    index = index_clip(clip, "c")
    assert np.bincount(index.gop).tolist() == [5] * 12
    frame = 16 * 16
    # frames 0 and 59: the first keyframe alone, the last group whole (55..59)
    two = FrameSampling(frames=2)
    frames = decode_clip(clip, "c", policy=POLICY, sampling=two,
                         limits=VideoLimits(max_decoded_pixels=6 * frame))
    assert shown(frames) == [0, 59 % CYCLE]
    with pytest.raises(VideoError, match="keyframes closer together"):
        decode_clip(clip, "c", policy=POLICY, sampling=two,
                    limits=VideoLimits(max_decoded_pixels=6 * frame - 1))
    # frames 0, 30 and 59: two gaps, each drained and skipped
    frames = decode_clip(clip, "c", policy=POLICY, sampling=FrameSampling(frames=3),
                         limits=VideoLimits(max_decoded_pixels=7 * frame))
    assert shown(frames) == [0, 30 % CYCLE, 59 % CYCLE]
    # frames 0, 12, 24, ...: within groups too, up to the sampled frame and no further
    six = FrameSampling(frames=6)
    decoded = (1 + 3 + 5 + 1 + 3 + 5) * frame           # up to 0, 12, 24, 35, 47, 59
    frames = decode_clip(clip, "c", policy=POLICY, sampling=six,
                         limits=VideoLimits(max_decoded_pixels=decoded))
    assert shown(frames) == evenly(6, 60)
    with pytest.raises(VideoError, match="keyframes closer together"):
        decode_clip(clip, "c", policy=POLICY, sampling=six,
                    limits=VideoLimits(max_decoded_pixels=decoded - 1))


def test_a_stream_without_timestamps_is_read_in_decode_order():
    clip = write_clip(12, fmt="h264", fps=5, options={"bf": "2"}, texture=True)
    index = index_clip(clip, "c")                   # raw H.264: no timestamps at all
    assert index.ordinal and index.duration == pytest.approx(2.4)     # the SPS's 5 fps
    frames = decode_clip(clip, "c", policy=POLICY, sampling=FrameSampling(frames=5))
    assert shown(frames, texture=True) == [0, 3, 6, 8, 11]
    assert shown(decode_clip(clip, "c", policy=POLICY), texture=True) == [0, 4, 7, 11]


def test_absurd_header_timing_and_counts_stay_bounded():
    clip = bytearray(write_clip(12, codec="libvpx", fmt="ivf"))
    # IVF's header: a time base of 100000 seconds a tick, 2**32 - 1 frames
    clip[16:28] = struct.pack("<III", 1, 100000, 0xFFFFFFFF)
    index = index_clip(bytes(clip), "c")
    assert index.frames == 12 and index.duration > 1e6      # what its timestamps say
    frames = decode_clip(bytes(clip), "c", policy=POLICY)   # 2 fps: every frame, no more
    assert shown(frames) == list(range(12))


def test_index_reads_packets_not_the_header_counts():
    clip = write_clip(12)
    patched = bytearray(clip)
    for box in (b"mvhd", b"mdhd"):          # durations claiming 136 years
        at = clip.find(box)
        patched[at + 20:at + 24] = struct.pack(">I", 0xFFFFFFF0)
    index = index_clip(bytes(patched), "c")
    assert index.frames == 12 and index.duration == pytest.approx(1.2)


def _hostile(name: str, data: bytes, **kw) -> str:
    with pytest.raises(VideoError) as caught:
        decode_clip(data, name, policy=POLICY, sampling=FrameSampling(frames=3), **kw)
    message = str(caught.value)
    assert message.startswith(f"video {name}: ") and "\n" not in message
    assert isinstance(caught.value, DatasetError)
    return message


def test_hostile_files_give_one_plain_error_naming_them():
    rng = np.random.default_rng(1)
    clip = write_clip(12)
    assert "not a video container" in _hostile("empty.mp4", b"")
    assert "not a video container" in _hostile(
        "noise.mp4", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert "Errno" not in _hostile("zeros.mp4", bytes(1000))
    _hostile("half.mp4", clip[:len(clip) // 2])
    audio = io.BytesIO()
    with av.open(audio, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
    assert "no video stream" in _hostile("audio.mkv", audio.getvalue())


def test_a_video_stream_without_frames_is_refused():
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        video = container.add_stream("mpeg4", rate=5)
        video.width = video.height = 16
        audio = container.add_stream("aac", rate=8000)       # only audio is written
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4096), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in [*audio.encode(frame), *audio.encode()]:
            container.mux(packet)
    assert "has no frames" in _hostile("empty.mkv", buf.getvalue())


def test_limits_refuse_big_frames_and_long_clips():
    clip = write_clip(12, width=32, height=32)
    assert "32x32 pixels, above the limit" in _hostile(
        "big.mp4", clip, limits=VideoLimits(max_pixels=32 * 32 - 1))
    assert "more than 11 frames" in _hostile("long.mp4", clip,
                                             limits=VideoLimits(max_frames=11))
    assert index_clip(clip, "c", VideoLimits(max_frames=12)).frames == 12


def _jpeg(value: int, claim: int | None = None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (value,) * 3).save(buf, "JPEG", quality=95)
    data = bytearray(buf.getvalue())
    if claim is not None:               # the frame header claims claim x claim pixels
        at = data.find(b"\xff\xc0")
        data[at + 5:at + 9] = struct.pack(">HH", claim, claim)
    return bytes(data)


def _mjpeg(images: list[bytes]) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("mjpeg", rate=5)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuvj420p"
        stream.time_base = Fraction(1, 5)
        for i, image in enumerate(images):
            packet = av.Packet(image)
            packet.pts = packet.dts = i
            packet.stream = stream
            container.mux(packet)
    return buf.getvalue()


def test_a_frame_claiming_absurd_dimensions_is_not_decoded():
    images = [_jpeg(level(i), claim=15000 if i == 3 else None) for i in range(6)]
    frames = decode_clip(_mjpeg(images), "c", policy=POLICY,
                         sampling=FrameSampling(frames=6))
    assert frames.shape == (6, 3, 16, 16)
    assert shown(frames) == [0, 1, 2, 2, 4, 5]      # the nearest sampled frame stands in
    broken = _mjpeg([_jpeg(level(i), claim=15000) for i in range(6)])
    assert "none of its sampled frames decodes" in _hostile("broken.avi", broken)


def test_damaged_clips_decode_or_fail_plainly():
    clip = write_clip(16, options={"g": "4"}, texture=True)
    rng = np.random.default_rng(2)
    for _ in range(40):
        damaged = bytearray(clip)
        for at in rng.integers(0, len(clip), 8):
            damaged[at] = rng.integers(0, 256)
        try:
            frames = decode_clip(bytes(damaged), "c", policy=POLICY,
                                 sampling=FrameSampling(frames=4))
        except VideoError as err:
            assert str(err).startswith("video c: ")
        else:
            assert frames.shape == (4, 3, 32, 32) and frames.dtype == np.uint8


# ---- temporal patches ---------------------------------------------------------------

def _transformers_video_patchify():
    """transformers' ``Qwen2VLVideoProcessor.patchify``: imported, or, where its module
    cannot be (it imports torchvision), compiled from the installed module's source."""
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
            Qwen2VLVideoProcessor,
        )
        return Qwen2VLVideoProcessor.patchify
    except ImportError:
        pass
    spec = importlib.util.find_spec("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    if spec is None or spec.origin is None:
        pytest.skip("this transformers has no Qwen2-VL video processor")
    tree = ast.parse(Path(spec.origin).read_text())
    found = [f for c in tree.body if isinstance(c, ast.ClassDef)
             and c.name == "Qwen2VLVideoProcessor" for f in c.body
             if isinstance(f, ast.FunctionDef) and f.name == "patchify"]
    if not found:
        pytest.skip("this transformers' Qwen2-VL video processor has no patchify")
    found[0].decorator_list = []
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=found, type_ignores=[]), spec.origin, "exec"), namespace)
    return namespace["patchify"]


@pytest.mark.parametrize(("count", "tp", "merge"), [(4, 2, 1), (3, 2, 1), (5, 2, 2),
                                                    (2, 1, 2), (3, 3, 1)])
def test_patch_layout_is_transformers_qwen2_vl(count, tp, merge):
    reference = _transformers_video_patchify()
    p, height, width = 2, 8, 12
    frames = torch.arange(count * 3 * height * width).reshape(count, 3, height, width)
    theirs, t, gh, gw = reference(None, frames[None], patch_size=p, merge_size=merge,
                                  temporal_patch_size=tp)
    ours = patchify(frames, p, tp, merge=merge)
    assert (t, gh, gw) == (-(-count // tp), height // p, width // p)
    assert torch.equal(ours, theirs[0])
    assert np.array_equal(patchify(frames.numpy(), p, tp, merge=merge), theirs[0].numpy())
    assert ours.shape[0] == clip_tokens(count, gh * gw, tp)


def test_patches_equal_transformers_image_processor_on_a_frame():
    hf = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

    rng = np.random.default_rng(3)
    frame = rng.integers(0, 256, (3, 16, 24), dtype=np.uint8)    # already 16x24: no resize
    for merge in (1, 2):
        processor = hf.Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=merge, temporal_patch_size=2,
            size={"shortest_edge": 16, "longest_edge": 64 * 64})
        theirs = processor(images=[frame.transpose(1, 2, 0)], return_tensors="np")
        ours = patchify(normalize(frame, CLIP_MEAN, CLIP_STD)[None], 4, 2, merge=merge)
        assert theirs["image_grid_thw"].tolist() == [[1, 4, 6]]
        np.testing.assert_allclose(ours.numpy(), theirs["pixel_values"], atol=1e-5)


def _patch_embed():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    return getattr(hf, "Qwen2VisionPatchEmbed", None) or hf.PatchEmbed


def test_linear_over_patches_is_qwen2_vl_conv3d_patch_embedding():
    embed_cls = _patch_embed()
    torch.manual_seed(0)
    p, tp, dim = 4, 2, 24
    embed = embed_cls(patch_size=p, temporal_patch_size=tp, in_channels=3, embed_dim=dim)
    frames = torch.randn(5, 3, 12, 16)
    patches = patchify(frames, p, tp)
    linear = torch.nn.functional.linear(patches, linear_patch_weight(embed.proj.weight))
    with torch.no_grad():
        theirs = embed(patches)
        # the convolution over the whole clip (last frame repeated), read in raster order
        video = torch.cat([frames, frames[-1:]]).permute(1, 0, 2, 3)[None]
        conv = torch.nn.functional.conv3d(video, embed.proj.weight, stride=(tp, p, p))
    torch.testing.assert_close(linear, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear, conv[0].permute(1, 2, 3, 0).reshape(-1, dim),
                               rtol=1e-5, atol=1e-5)


def test_patchify_pads_with_the_last_frame_and_checks_sides():
    frames = np.stack([np.full((3, 4, 4), v, np.uint8) for v in (1, 2, 3)])
    patches = patchify(frames, 2, 2)
    assert patches.shape == (2 * 4, 3 * 2 * 2 * 2) and patches.dtype == np.uint8
    second = patches[4:].reshape(4, 3, 2, 2, 2)                 # [token, C, tp, p, p]
    assert (second[:, :, 0] == 3).all() and (second[:, :, 1] == 3).all()
    with pytest.raises(ValueError, match="multiples of 4"):
        patchify(np.zeros((1, 3, 6, 8)), 2, 1, merge=2)
    with pytest.raises(ValueError, match=r"\[F, C, H, W\]"):
        patchify(np.zeros((0, 3, 4, 4)), 2, 1)


def test_clip_tokens_predicted_from_the_index_match_the_decoded_clip():
    assert clip_tokens(5, 12, 2) == 36 and clip_tokens(4, 12, 2) == 24
    assert clip_tokens(np.array([1, 2, 3]), 4, 2).tolist() == [4, 4, 8]
    clip = write_clip(25, width=56, height=40, fps=10)
    index = index_clip(clip, "c")
    policies = (ImagePolicy(patch=8), ImagePolicy(patch=4, max_patches=30, block=2),
                ImagePolicy(patch=8, size=(16, 16), shortest_edge=16))
    samplings = (FrameSampling(frames=5), FrameSampling(frames=4),
                 FrameSampling(multiple=2), FrameSampling(fps=3.0))
    for policy in policies:
        for sampling in samplings:
            for tp in (1, 2):
                frames = decode_clip(clip, "c", policy=policy, sampling=sampling)
                height, width = index.shape(policy)
                assert frames.shape == (index.sampled(sampling), 3, height, width)
                grid = (height // policy.patch) * (width // policy.patch)
                tokens = clip_tokens(index.sampled(sampling), grid, tp)
                assert patchify(frames, policy.patch, tp).shape[0] == tokens
