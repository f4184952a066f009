"""Two encoders of one modality on real data (issue 29; hybrid towers such as DeepSeek-VL's
SigLIP and SAM): every encoder of a modality encodes each of the sample's items of that
modality at its own size (``data.decode``), as the cost model prices them (one draw of a
modality's items, a ``SampleSet.items`` key per encoder) and synthetic samples draw them.
A dataset written by ``dtc data synth`` and one written by the ``webdataset`` library (jpg,
flac, mp4 members) feed a spec with two image and two audio encoders: no DT601, the cost
model's token accounting is the runtime's sample by sample, and a launched bundle trains
as ``dtc reference`` does, every sample once per epoch per unit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dtdsl import cli
from dtdsl.cost.samples import draw_samples, positions
from dtdsl.data.batch import SyntheticSource, normalizer_of, sample_set
from dtdsl.driver import run_frontend
from dtdsl.ir.layout import layout_of
from dtdsl.ir.modal import encoder_inputs
from dtdsl.models.multimodal import build_model, encode, loss_normalizer
from tests.specs import TINY
from tests.text_models import make_tokenizer
from tests.train import modal_specs as m

# A second image tower of coarser patches (a SAM-like one beside the ViT) and a second
# audio tower of coarser patches over the same 16-bin features.
_VIT2 = """  encoder vit2 (image) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=16)
  }
"""
_BEATS2 = m._AUDIO.replace("beats", "beats2").replace("patch=4", "patch=8")


def hybrid_text(source: str, *, video: bool = False, tokenizer: bool = False) -> str:
    """tiny_cpu.dt with ``vit2`` beside ``vit``, ``beats`` and ``beats2`` (and with
    ``video`` the video encoder ``clip``), each with its projector, a global batch of 8,
    trained on ``source``. Clips have at least 8 frames: one row of ``beats2``'s
    patches."""
    text = TINY.read_text()
    encoders = _VIT2 + m._AUDIO + _BEATS2 + (m._VIDEO if video else "")
    names = ["vit2", "beats", "beats2"] + (["clip"] if video else [])
    text = text.replace("  backbone llm {", encoders + "  backbone llm {")
    text = text.replace("projector vit -> llm : mlp(depth=2)", "projector vit -> llm : "
                        "mlp(depth=2)" + "".join(f"\n  projector {e} -> llm : mlp(depth=2)"
                                                 for e in names))
    data = m._AUDIO_DATA.replace("uniform(6, 40)", "uniform(8, 40)") + \
        (m._VIDEO_DATA if video else "")
    text = text.replace("  image.gen_count", data + "  image.gen_count")
    text = text.replace('source = "data/tiny"', f'source = "{source}"' +
                        ('\n  tokenizer = "tok"' if tokenizer else ""))
    return text.replace("global_batch     = 16", "global_batch     = 8") \
        .replace("gpus          = 4", "gpus          = 7") \
        .replace("gpus_per_node = 4", "gpus_per_node = 7")


def _program(spec: Path):
    return run_frontend(str(spec), spec.read_bytes()).program


def test_drawn_items_are_shared_by_the_encoders_of_a_modality():
    # The cost model and synthetic samples draw a modality's items once; each encoder
    # of the modality has its own tokens of them.
    from tests.specs import program as checked

    program = checked(hybrid_text("data"))
    drawn = draw_samples(program, 64, seed=3)
    for first, second in (("image", "image@vit2"), ("audio", "audio@beats2")):
        assert drawn.items[first].counts.tolist() == drawn.items[second].counts.tolist()
        assert drawn.items[first].counts.sum() > 0
    # One drawn size per item, which each encoder's rule reads as its own: image patches
    # as drawn; audio tokens rounded to whole rows of each tower's patches (4 and 2
    # columns), so within half a row of each.
    assert drawn.items["image"].sizes.tolist() == drawn.items["image@vit2"].sizes.tolist()
    gap = np.abs(drawn.items["audio"].sizes - drawn.items["audio@beats2"].sizes)
    assert gap.max() <= 3 and gap.any()
    # The stage graph (and the cost model and simulator, by the same key) reads each
    # encoder's own items.
    from dtdsl.cost.graph import build_graph

    graph = build_graph(program, samples=64, seed=3)
    for name, key in (("beats", "audio"), ("beats2", "audio@beats2")):
        assert graph.edges["data", name]["tokens_mean"] == pytest.approx(
            drawn.items[key].tokens().mean())
    sizes = SyntheticSource(program).sizes(0)
    assert [len(s.inputs["vit2"]) for s in sizes] == [len(s.image_shapes) for s in sizes]
    assert [len(s.inputs["beats2"]) for s in sizes] == [len(s.inputs["beats"]) for s in sizes]


def test_a_synth_dataset_feeds_every_encoder_of_a_modality(tmp_path):
    # dtc data synth writes the images and 16-bin features both towers of each modality
    # read; dtc compile takes the spec (no DT601); per sample of an epoch the cost
    # model's positions are the layout's, each encoder's items are the sample's, and
    # the model encodes exactly the tokens the layout places.
    spec = tmp_path / "hybrid.dt"
    spec.write_text(hybrid_text("data"))
    assert cli.main(["data", "synth", str(spec), "-o", str(tmp_path / "data"), "--samples",
                     "24", "-q"]) == 0
    assert cli.main(["compile", str(spec), "-o", str(tmp_path / "bundle")]) == 0
    from dtdsl.feed.source import DatasetSource

    program = _program(spec)
    source = DatasetSource(program, tmp_path / "data")
    assert source.skipped == 0 and len(source.usable) == 24
    rules, seq_len = encoder_inputs(program), program.train.seq_len
    torch.manual_seed(0)
    model = build_model(program)
    seen = []
    for step in range(3):                               # one epoch
        sizes = source.sizes(step)
        seen.extend(source.keys(step))
        priced = sample_set(program, sizes)
        assert positions(priced).tolist() == [layout_of(sz, rules, seq_len).length
                                              for sz in sizes]
        for a, b in (("image", "image@vit2"), ("audio", "audio@beats2")):
            assert priced.items[a].counts.tolist() == priced.items[b].counts.tolist()
        assert priced.items["image@vit2"].counts.sum() > 0
        samples = [source.sample(step, i) for i in range(len(sizes))]
        for s, sz in zip(samples, sizes, strict=True):
            assert len(s.inputs["vit2"]) == len(s.images) == len(sz.image_shapes)
            assert {k: tuple(tuple(x.shape) for x in v) for k, v in s.inputs.items()} == \
                sz.inputs
        assert normalizer_of(program, sizes) == loss_normalizer(model, samples)
        with torch.no_grad():
            rows = encode(model, samples)
        for r, sz in zip(rows, sizes, strict=True):
            assert r.shape[0] == sum(layout_of(sz, rules, seq_len).image_tokens)
    assert sorted(seen) == sorted(source.dataset.key(i) for i in range(24))


def test_the_second_tower_reads_each_image_at_its_own_size(tmp_path):
    # The same image, sized by each encoder's policy; the second tower's pixels are
    # normalised with its mean and std (0.5, 0.5: [-1, 1]), the first's stay uint8.
    from dtdsl.data.decode import Decoder
    from dtdsl.data.sources import open_dataset

    spec = tmp_path / "hybrid.dt"
    spec.write_text(hybrid_text("data"))
    assert cli.main(["data", "synth", str(spec), "-o", str(tmp_path / "data"), "--samples",
                     "8", "-q"]) == 0
    program = _program(spec)
    decoder = Decoder.for_program(program, seed=0)
    with open_dataset(str(tmp_path / "data"), program=program) as ds:
        i = next(i for i in range(len(ds)) if ds.info(i).images)
        info, decoded = ds.info(i), decoder.decode(ds.read(i))
    assert len(decoded.inputs["vit2"]) == len(decoded.images) == len(info.images)
    for image, item, (w, h) in zip(decoded.images, decoded.inputs["vit2"], info.images,
                                   strict=True):
        assert image.dtype == np.uint8 and item.dtype == np.float32
        assert image.shape == (3, *decoder.images.shape(w, h))
        assert item.shape == (3, *decoder.image_inputs["vit2"].shape(w, h))
        assert item.shape[1] % 16 == 0 and item.shape[2] % 16 == 0
        assert -1.0 <= item.min() and item.max() <= 1.0
    assert decoded.inputs_at["vit2"] == decoded.image_at
    assert decoded.inputs_at["beats2"] == decoded.inputs_at["beats"]


@pytest.mark.slow
def test_a_bundle_with_two_towers_per_modality_trains_on_webdataset_media(tmp_path):
    # jpg, flac and mp4 members written by webdataset's ShardWriter; each audio tower
    # makes its own fbank of each clip. The run's sizes (an epoch) priced as the layout
    # places them and decoded to those shapes; one launch of 3 ranks (beats2 a unit of
    # its own, the other encoders on the backbone's 2 replicas; not hybrid_text's 7, where
    # beats2 has DP 2: test_media's bundle launches an encoder unit of its own at DP 2,
    # and the towers' claims need no more): 6 steps as dtc reference
    # trains them, every sample once per epoch per unit (24 samples, 3 steps an epoch:
    # 6 steps are the two whole epochs checked).
    from tests.helpers.bundle import (
        consumed,
        launch_ok,
        read_jsonl,
        reference_losses,
    )
    from tests.helpers.media import write_media_shards

    keys = write_media_shards(tmp_path / "shards", n=24, per_shard=8)
    make_tokenizer(tmp_path / "tok")
    spec = tmp_path / "hybrid.dt"
    text = hybrid_text("shards/{000000..000002}.tar", video=True, tokenizer=True)
    for old, new in (("gpus          = 7", "gpus          = 3"),
                     ("gpus_per_node = 7", "gpus_per_node = 3"),
                     ("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  dp(beats2) == 1\n")):
        assert old in text, old
        text = text.replace(old, new)
    spec.write_text(text)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--workers", "2"]) == 0
    import json

    units = {u["name"]: u for u in json.loads((bundle / "plan.json").read_text())["units"]}
    assert units["beats2"]["gpus"] == 1 and units["vit2"]["colocated"]
    assert units["llm"]["dp"] == 2
    from dtdsl.feed.source import DatasetSource

    program = _program(spec)
    source = DatasetSource(program, tmp_path / "shards" / "{000000..000002}.tar")
    assert source.skipped == 0
    rules, seq_len = encoder_inputs(program), program.train.seq_len
    for step in range(3):
        sizes = source.sizes(step)
        assert positions(sample_set(program, sizes)).tolist() == [
            layout_of(sz, rules, seq_len).length for sz in sizes]
        assert [len(sz.inputs["beats2"]) for sz in sizes] == \
            [len(sz.inputs["beats"]) for sz in sizes]
    for i, sz in enumerate(source.sizes(0)):
        got = source.sample(0, i).inputs
        assert {k: tuple(tuple(x.shape) for x in v) for k, v in got.items()} == sz.inputs
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "6")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 6 and all(x["cut_samples"] == 0 for x in metrics)
    want = reference_losses(6, tmp_path / "shards" / "{000000..000002}.tar", spec)
    assert [x["loss"] for x in metrics] == pytest.approx(want, rel=1e-4)
    ran = sorted({r["unit"] for r in read_jsonl(run_dir / "samples.jsonl")})
    assert ran == sorted(units)
    for unit in ran:
        per_step = consumed(run_dir, unit)
        for epoch in range(2):
            got = [k for step in range(3 * epoch, 3 * epoch + 3)
                   for k in per_step.get(step, [])]
            assert sorted(got) == keys, (unit, epoch)


def test_llava_records_feed_both_towers_at_each_placeholder(tmp_path):
    # A LLaVA record's image, two audio clips and video: each audio tower reads both
    # clips from the files (its own fbank), vit2 the image; every tower's items sit at
    # their modality's placeholders.
    from dtdsl.data.decode import Decoder
    from dtdsl.data.sources import open_dataset
    from tests.helpers.media import _llava
    from tests.specs import program as checked

    path = _llava(tmp_path)
    make_tokenizer(tmp_path / "tok")
    program = checked(hybrid_text("data", video=True))
    program = program.model_copy(update={"data": program.data.model_copy(
        update={"tokenizer": str(tmp_path / "tok"), "image_folder": str(tmp_path / "media")})})
    decoder = Decoder.for_program(program, seed=0)
    assert decoder.kinds == ("audio", "video")
    with open_dataset(str(path), program=program) as ds:
        info, both = ds.info(0), decoder.decode(ds.read(0))
    shapes = decoder.input_shapes(info)
    assert {k: tuple(x.shape for x in v) for k, v in both.inputs.items()} == shapes
    assert len(shapes["beats"]) == len(shapes["beats2"]) == 2 and len(shapes["vit2"]) == 1
    # One fbank per clip, cut to whole rows of each tower's patches (4 and 8 frames).
    for (t4, bins4), (t8, bins8) in zip(shapes["beats"], shapes["beats2"], strict=True):
        assert bins4 == bins8 == 16 and t4 % 4 == 0 and t8 % 8 == 0 and 0 <= t4 - t8 < 8
    assert both.inputs_at["vit2"] == both.image_at
    assert both.inputs_at["beats2"] == both.inputs_at["beats"]
    (image,), audio = both.image_at, both.inputs_at["beats"]
    assert audio[0] < image < audio[1] < both.inputs_at["clip"][0]
