"""Several encoders of any modality in the runtime (issue 29): the tiny spec with an audio
encoder, and with a video encoder too, trains with the schedule executor (gloo ranks) as
the single-process reference does; every sample reaches every unit once a step; the cost
model counts the runtime's tokens; a tiny counterpart of specs/audio_image.dt (two
encoders, two generators) compiles and trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtdsl.codegen.support import runtime_support
from dtdsl.cost.flops import encoder_ends_params
from dtdsl.cost.samples import _draw_documents, draw
from dtdsl.data.batch import SyntheticSource, normalizer_of, route_batch, sample_set
from dtdsl.data.sample import make_sample, sample_seed, sample_sizes
from dtdsl.ir.layout import layout_of
from dtdsl.ir.modal import drawn_tokens, encoder_inputs
from dtdsl.models.multimodal import build_model, encode, loss_normalizer, sample_sizes_of
from tests.helpers.runs import check, plan_for
from tests.train.modal_specs import (
    _modal_text,
    _root,
    tiny_audio_image,
    tiny_modal,
)

# 4 steps: an encoder's items spliced or routed wrongly show from the first step, and
# Adam's moments go through several updates.
STEPS = 4
ACCEPTANCE_STEPS = 8    # the acceptance: an audio encoder, with a video one, 8+ steps


def test_audio_items_are_fbank_patches_and_their_tokens_follow_the_rule():
    program = tiny_modal(audio=True)
    rule = encoder_inputs(program).rule("beats")
    assert (rule.patch_dim, rule.columns) == (16, 4)
    seen = 0
    for i in range(64):
        sample = make_sample(program, 0, i)
        sizes = sample_sizes(program, 0, i)
        for clip, shape in zip(sample.inputs["beats"], sizes.inputs["beats"], strict=True):
            assert tuple(clip.shape) == shape and shape[1] == 16 and shape[0] % 4 == 0
            assert rule.tokens(shape) == shape[0] // 4 * 4
            seen += 1
        # The layout places every clip's tokens: the sequence is text plus every item.
        lay = layout_of(sizes, encoder_inputs(program), program.train.seq_len)
        items = sum(rule.tokens(s) for s in sizes.inputs["beats"]) + \
            sum(encoder_inputs(program)(h, w) for h, w in sizes.image_shapes)
        assert lay.length == sizes.text_tokens + items
    assert seen > 20


def test_video_frames_round_up_to_whole_temporal_patches():
    program = tiny_modal(audio=False, video=True)
    rule = encoder_inputs(program).rule("clip")
    assert rule.patch_dim == 3 * 2 * 4 * 4
    assert rule.synthetic_shape(5, 9) == (6, 3, 12, 12)
    assert rule.tokens((6, 3, 12, 12)) == 3 * 9
    clip = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(1, 2, 3, 8, 8)
    patches = rule.patchify(clip)
    assert patches.shape == (1, 4, 96)
    # The first patch: channel-major, then the two frames, then the 4x4 pixels.
    want = clip[0, :, :, :4, :4].permute(1, 0, 2, 3).reshape(-1)
    assert torch.equal(patches[0, 0], want)


def test_an_audio_encoder_without_a_patch_reads_a_frame_a_token():
    # Neither a patch nor Whisper's stem: a frame stem, a linear map of each fbank frame's
    # mel_bins x in_channels values. A clip of T frames is T tokens in the model, what
    # the cost model prices for a drawn `audio.frames` of T (unrounded).
    program = tiny_modal(audio=True, frames=True, batch=8)
    arch = program.module("beats").arch
    rule = encoder_inputs(program).rule("beats")
    assert arch.stem == "frames" and rule.frames
    assert (rule.patch_dim, arch.patch_dim, rule.columns) == (16, 16, 1)
    assert runtime_support(program) == []
    torch.manual_seed(0)
    encoder = build_model(program).unit("beats")
    assert encoder.patch_embed.in_features == 16
    drawn = np.arange(0, 41)
    assert drawn_tokens(rule, drawn).tolist() == [1] + list(range(1, 41))
    with torch.no_grad():
        for n in (1, 7, 40):
            shape = rule.synthetic_shape(n)
            assert shape == (n, 16) and rule.grid(shape) == (n, 1)
            clip = torch.randn(1, *shape)
            assert torch.equal(rule.patchify(clip), clip)       # a frame is a patch
            assert encoder(clip).shape[1] == n == rule.tokens(shape)
            # The packed path (what a step runs) embeds the same frames alike.
            x = encoder.embed(rule.patchify(clip), rule.grid(shape))
            for layer in encoder.layers.values():
                x = layer(x)
            assert torch.allclose(encoder.finish(x), encoder(clip), atol=1e-6)


@pytest.mark.parametrize("frames", [False, True])
def test_a_two_channel_audio_encoder_reads_an_fbank_per_channel(frames):
    # [T, C, M], time first: the patch (or frame) widens by C, the grid and the tokens
    # are one channel's, so the cost model's tokens (drawn_tokens, no C in it) stay the
    # model's. A patch holds its C channels' p x p values channel-major, as a C-channel
    # image's; a frame its C x M values.
    one = encoder_inputs(tiny_modal(audio=True, frames=frames)).rule("beats")
    program = tiny_modal(audio=True, frames=frames, channels=2)
    arch = program.module("beats").arch
    rule = encoder_inputs(program).rule("beats")
    assert runtime_support(program) == []
    assert rule.patch_dim == arch.patch_dim == 2 * one.patch_dim
    torch.manual_seed(0)
    encoder = build_model(program).unit("beats")
    assert encoder.patch_embed.in_features == rule.patch_dim
    # The cost model prices the wider stem as the model builds it.
    assert encoder_ends_params(arch) == sum(p.numel() for p in encoder.patch_embed.parameters())
    drawn = np.arange(0, 41)
    assert drawn_tokens(rule, drawn).tolist() == drawn_tokens(one, drawn).tolist()
    for n in (1, 7, 40):
        shape = rule.synthetic_shape(n)
        assert shape == (*one.synthetic_shape(n)[:1], 2, 16)
        assert rule.grid(shape) == one.grid(one.synthetic_shape(n))
        clip = torch.randn(1, *shape)
        patches = rule.patchify(clip)
        p = rule.patch
        assert patches.shape == (1, rule.tokens(shape), rule.patch_dim)
        # Frame 0: channel 0's M bins, then channel 1's; patch (row 0, column 1):
        # channel 0's p x p values, then channel 1's.
        col = 0 if frames else 1
        want = clip[0, 0].reshape(-1) if frames else \
            clip[0, :p, :, p:2 * p].transpose(0, 1).reshape(-1)
        assert torch.equal(patches[0, col], want)
        with torch.no_grad():
            x = encoder.embed(patches, rule.grid(shape))
        assert x.shape[1] == rule.tokens(shape) == int(drawn_tokens(rule, [n])[0])


@pytest.mark.parametrize("video, frames, channels", [(False, False, 1), (True, False, 1),
                                                     (False, True, 1), (False, False, 2)])
def test_cost_model_counts_the_runtime_tokens(video, frames, channels):
    # The cost model draws an item's size and prices drawn_tokens of it; the runtime's
    # synthetic item of that drawn size has exactly those tokens, per sample (an audio
    # frame stem's: the drawn frames themselves; a two-channel encoder's: one channel's).
    program = tiny_modal(audio=True, video=video, frames=frames, channels=channels)
    rules = encoder_inputs(program)
    for i in range(200):
        sizes = sample_sizes(program, 3, i)
        # Redraw the sample's stream as sample_sizes draws it: the drawn sizes.
        rng = np.random.default_rng(sample_seed(program.train.seed, 3, i, "sizes"))
        data = program.data
        draw(data.get("text", "tokens"), 1, rng)
        count = int(draw(data.get("image", "count"), 1, rng)[0])
        if count:
            draw(data.get("image", "patches"), count, rng)
        for rule in rules.others:
            m = rule.modality
            n = int(draw(data.get(m, "count"), 1, rng)[0])
            if not n:
                continue
            frames = draw(data.get(m, "frames"), n, rng)
            patches = draw(data.get(m, "patches"), n, rng) if m == "video" else None
            priced = drawn_tokens(rule, frames, patches)
            kept = sizes.inputs[rule.name]
            got = [rule.tokens(s) for s in kept]
            assert got == priced[:len(kept)].tolist(), (i, rule.name)
    # And the cost model's own draws follow the same rule: every audio item a whole
    # number of patch rows, every video item whole temporal patches of square frames.
    drawn = _draw_documents(program, 500, np.random.default_rng(0))
    assert (drawn.items["audio"].sizes % rules.rule("beats").columns == 0).all()
    if video:
        assert set(np.unique(drawn.items["video"].sizes)) <= {
            f * g for f in (1, 2, 3) for g in (4, 9)}


def test_the_runtime_sample_set_prices_what_the_model_encodes():
    program = tiny_modal(audio=True, video=True, batch=8)
    sizes = SyntheticSource(program).sizes(0)
    drawn = sample_set(program, sizes)
    rules = encoder_inputs(program)
    for key, name in (("audio", "beats"), ("video", "clip")):
        assert drawn.items[key].tokens().tolist() == [
            sum(rules.rule(name).patches(s) for s in sz.inputs[name]) for sz in sizes]


@pytest.mark.parametrize("frames", [False, True])
def test_the_model_splices_every_encoder_at_its_items_places(frames):
    program = tiny_modal(audio=True, video=True, batch=8, frames=frames)
    torch.manual_seed(0)
    model = build_model(program)
    samples = [make_sample(program, 0, i) for i in range(8)]
    with torch.no_grad():
        rows = encode(model, samples)
    for s, r in zip(samples, rows, strict=True):
        lay = layout_of(sample_sizes_of(s), model.image_tokens, program.train.seq_len)
        assert r.shape[0] == sum(lay.image_tokens)
    # The normaliser from sizes alone equals the model's from the tensors.
    assert normalizer_of(program, SyntheticSource(program).sizes(0)) == \
        loss_normalizer(model, samples)


@pytest.mark.parametrize("policy", [frozenset(), frozenset({"intra", "inter"})])
def test_every_sample_reaches_every_unit_once_a_step(policy):
    from dtdsl.cost.model import build_cost_model
    from dtdsl.reorder.workload import WorkModel

    program = tiny_modal(audio=True, video=True, batch=8)
    plan = plan_for(program, ("vit", "encoder", 1, 2, 1), ("beats", "encoder", 1, 1, 1),
                    ("clip", "encoder", 1, 2, 1), ("llm", "backbone", 1, 2, 1),
                    ("gen", "generator", 1, 1, 1))
    work = WorkModel(build_cost_model(program)) if policy else None
    for step in range(3):
        steps = route_batch(plan, program, SyntheticSource(program).sizes(step), policy,
                            work)
        ids = [i for s in steps for i in s.sample_ids]
        assert sorted(ids) == list(range(8))
        for u in plan.units:
            replicas = [r for s in steps for r in s.assignment[u.name]]
            assert len(replicas) == 8 and all(0 <= r < u.dp for r in replicas)


# The two-channel audio encoder trains in
# test_co_located_audio_encoder_beside_an_image_encoder_unit (co-located: one run for
# both); as a unit of its own, the audio stems of the tests below.


def test_audio_and_video_encoders_train_as_the_reference():
    # The audio encoder here has no patch (a token per fbank frame; the one above cuts
    # 4x4 patches): both stems train in the suite with no launch of its own.
    program = tiny_modal(audio=True, video=True, batch=8, frames=True)
    assert runtime_support(program) == []
    # The video encoder on two pipeline stages: its packed clips' activations pass
    # between them (``packed_item_shapes``).
    check(program, plan_for(program, ("vit", "encoder", 1, 1, 1), ("beats", "encoder", 1, 1, 1),
                            ("clip", "encoder", 1, 1, 2), ("llm", "backbone", 1, 1, 1),
                            ("gen", "generator", 1, 1, 1)), steps=ACCEPTANCE_STEPS)


def test_tiny_audio_image_trains_as_the_reference():
    # Two encoders and two generators (a frozen U-Net, an audio DiT), 1F1B over a
    # two-stage backbone.
    program = tiny_audio_image()
    assert runtime_support(program) == []
    check(program, plan_for(program, ("vit", "encoder", 1, 1, 1), ("beats", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("sd", "generator", 1, 1, 1),
                            ("audiogen", "generator", 1, 1, 1)), steps=STEPS)


def test_co_located_audio_encoder_beside_an_image_encoder_unit():
    # The backbone's first stage runs beats itself and splices its embeddings with
    # those vit's unit sends, as `dtc plan` places tiny_audio_image. Two input channels
    # (an fbank per channel, [T, 2, M]); the one-channel patch stem trains in
    # test_tiny_audio_image_trains_as_the_reference.
    from tests.helpers.plans import colocate

    program = tiny_modal(audio=True, batch=8, channels=2)
    assert program.module("beats").arch.in_channels == 2
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("beats", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 1, 2),
                                      ("gen", "generator", 1, 1, 1)), "beats")
    assert runtime_support(program, plan) == []
    check(program, plan, steps=ACCEPTANCE_STEPS)


def _train_phased(rank: int, world: int, program, plan, losses, params) -> None:
    """``plan``'s losses and parameters against the reference's."""
    import math

    from dtdsl.parallel.mesh import build_groups
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor
    from tests.helpers.runs import LOSS_RTOL, PARAM_RMS, PARAM_RTOL

    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    results = ex.train(len(losses))
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    for name, p in ex.full_parameters().items():
        init, want = params[name]
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


def test_phased_image_encoder_beside_an_audio_encoder_unit():
    # vit runs phased on the backbone's ranks; beats, a unit of its own, sends the
    # backbone's first stage its embeddings, spliced with the phased ones.
    from tests.dist import run
    from tests.helpers.plans import phase
    from tests.helpers.runs import reference

    program = tiny_modal(audio=True, batch=8)
    plan = phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                   ("beats", "encoder", 1, 1, 1),
                                   ("llm", "backbone", 1, 2, 1),
                                   ("gen", "generator", 1, 1, 1)), "vit")
    assert runtime_support(program, plan) == []
    losses, params = reference(program, STEPS)
    run(_train_phased, plan.gpus_used, program, plan, losses, params, timeout=300)


def test_two_co_located_encoders_train_and_a_phased_one_beside_another_is_refused():
    # Both encoders inside the backbone's first stage, spliced in the layout's order, as
    # `dtc plan` places specs/audio_image.dt.
    from tests.helpers.plans import colocate, phase

    program = tiny_modal(audio=True, batch=8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("beats", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 2, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit", "beats")
    assert runtime_support(program, plan) == []
    check(program, plan, steps=STEPS)
    one = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                     ("beats", "encoder", 1, 1, 1),
                                     ("llm", "backbone", 1, 2, 1),
                                     ("gen", "generator", 1, 1, 1)), "beats")
    (d,) = runtime_support(program, phase(program, one, "vit"))
    assert d.code == "DT601" and "vit is phased and encoder beats is co-located" in d.message


def test_the_wire_carries_audio_and_video_items(tmp_path):
    # A worker's batch messages, read back, equal the batches a rank builds itself.
    from dtdsl import cli
    from dtdsl.data.batch import LocalBatches
    from dtdsl.feed.protocol import read_batch
    from dtdsl.feed.worker import FeedContext, build_messages
    from dtdsl.parallel.mesh import role_of
    from tests.helpers.feed import _Message

    spec = tmp_path / "modal.dt"
    text = (_root() / "specs" / "tiny_cpu.dt").read_text()
    spec.write_text(_modal_text(text))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--placement", "disaggregated", "--workers", "1"]) == 0
    ctx = FeedContext(bundle)
    units = [u.name for u in ctx.plan.units]
    generators = [g.name for g in ctx.program.generators]
    seen = 0
    for step in (0, 1):
        for rank, (meta, arrays) in enumerate(build_messages(ctx, step)):
            got = read_batch(_Message(meta, arrays), units, generators)
            want = LocalBatches(ctx.program, ctx.plan, role_of(ctx.plan, rank),
                                policy=ctx.policy, work_model=ctx.work_model).batch(step)
            assert got.sizes == want.sizes and got.normalizer == want.normalizer
            assert got.samples.keys() == want.samples.keys()
            for i, s in want.samples.items():
                g = got.samples[i]
                for k, items in s.inputs.items():
                    assert len(g.inputs.get(k, ())) == len(items)
                    for a, b in zip(g.inputs.get(k, ()), items, strict=True):
                        assert torch.equal(a, b)
                        seen += 1
    assert seen > 0
    # A message whose item does not have its sizes' shape is refused.
    meta, arrays = build_messages(ctx, 0)[_rank_of(ctx, "beats")]
    key = next(k for k in arrays if ".in.beats." in k and k.startswith("p"))
    arrays = dict(arrays)
    arrays[key] = arrays[key][:-4]
    with pytest.raises(ValueError, match="expected uint8 or float32"):
        read_batch(_Message(meta, arrays), units, generators)






def _rank_of(ctx, unit: str) -> int:
    u = ctx.plan.unit(unit)
    return u.first_rank


@pytest.mark.parametrize("spec", ["tiny", "specs/audio_image.dt"])
def test_audio_image_specs_compile(tmp_path, spec, planned_compile):
    # The planner co-locates encoders and generators on the backbone's ranks (the tiny
    # one, one encoder of two): dtc compile writes a bundle for the plan it makes. The
    # shipped spec's compile is run once per test run (``planned_compile``, the same
    # command) and shared with tests/codegen/test_compile.py.
    from dtdsl import cli
    from tests.train.modal_specs import AUDIO_IMAGE

    if spec == "tiny":
        path = tmp_path / "tiny_audio_image.dt"
        path.write_text(AUDIO_IMAGE)
        assert cli.main(["compile", str(path), "-o", str(tmp_path / "bundle"),
                         "--synthetic"]) == 0
        bundle = tmp_path / "bundle"
    else:
        bundle = planned_compile(spec.removeprefix("specs/").removesuffix(".dt"))
    assert (bundle / "launch.sh").exists()


def test_two_image_encoders_train_as_the_reference():
    # A second image encoder encodes the sample's images too, at its own size (its items
    # are the sample's inputs), and the cost model places them in the sequence too
    # (tests/data/test_hybrid.py trains such towers on datasets).
    from tests.specs import program as checked

    text = (_root() / "specs" / "tiny_cpu.dt").read_text()
    text = text.replace("  backbone llm {", "  encoder vit2 (image) {\n    arch = transformer("
                        "layers=2, hidden=32, heads=2, ffn=64, patch=8)\n  }\n  backbone llm {")
    text = text.replace("  projector vit -> llm : mlp(depth=2)",
                        "  projector vit -> llm : mlp(depth=2)\n"
                        "  projector vit2 -> llm : mlp(depth=2)")
    program = checked(text)
    program = program.model_copy(update={"train": program.train.model_copy(
        update={"global_batch": 8})})
    sizes = SyntheticSource(program).sizes(0)
    assert sum(len(s.inputs["vit2"]) for s in sizes) > 0
    drawn = sample_set(program, sizes)
    assert drawn.items["image@vit2"].counts.tolist() == [len(s.inputs["vit2"]) for s in sizes]
    assert runtime_support(program) == []
    check(program, plan_for(program, ("vit", "encoder", 1, 1, 1), ("vit2", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 1), ("gen", "generator", 1, 1, 1)),
          steps=STEPS)


def test_packed_sequences_carry_every_encoders_items():
    # Packed documents keep their audio and video clips, each at its document's place:
    # the normaliser from sizes equals the model's, every row is encoded and spliced.
    program = tiny_modal(audio=True, video=True, batch=4)
    program = program.model_copy(update={"train": program.train.model_copy(
        update={"packing": True})})
    source = SyntheticSource(program)
    sizes = source.sizes(0)
    assert any(s.doc_text is not None and len(s.doc_text) > 1 for s in sizes)
    samples = [source.sample(0, i) for i in range(4)]
    for s, sz in zip(samples, sizes, strict=True):
        assert sample_sizes_of(s).inputs == sz.inputs
        assert [len(d.inputs["beats"]) for d in sz.docs()] == list(sz.doc_inputs["beats"])
    torch.manual_seed(0)
    model = build_model(program)
    assert normalizer_of(program, sizes) == loss_normalizer(model, samples)
    with torch.no_grad():
        rows = encode(model, samples)
    for r, sz in zip(rows, sizes, strict=True):
        lay = layout_of(sz, model.image_tokens, program.train.seq_len)
        assert r.shape[0] == sum(lay.image_tokens) and len(lay.items) == len(lay.image_tokens)


def test_an_audio_tower_with_whispers_stem_trains_beside_the_vit():
    # Whisper's stem reads whole clips of 2 x max_source_positions frames (no patches);
    # the cost model prices max_source_positions tokens per clip, as the runtime runs.
    program = tiny_modal(audio=True, batch=8)
    whisper = {"stem": "whisper_conv", "max_source_positions": 6, "in_channels": 16,
               "patch": None, "qkv_bias": True, "k_bias": False}
    program = program.model_copy(update={"modules": tuple(
        m.model_copy(update={"arch": m.arch.model_copy(update=whisper)})
        if m.name == "beats" else m for m in program.modules)})
    sizes = SyntheticSource(program).sizes(0)
    assert {s for sz in sizes for s in sz.inputs["beats"]} == {(12, 16)}
    assert set(sample_set(program, sizes).items["audio"].sizes.tolist()) == {6}
    assert runtime_support(program) == []
    check(program, plan_for(program, ("vit", "encoder", 1, 1, 1), ("beats", "encoder", 1, 1, 2),
                            ("llm", "backbone", 1, 1, 1), ("gen", "generator", 1, 1, 1)),
          steps=STEPS)


def test_a_checkpoint_resumes_with_the_audio_encoder_moved_onto_the_backbone(tmp_path):
    # Saved with beats a unit of its own, resumed with it co-located (resharded by DCP):
    # the losses and the final parameters are the reference's.
    import json

    from tests.dist import run
    from tests.helpers.checkpoints import _phase
    from tests.helpers.plans import colocate
    from tests.helpers.runs import reference

    program = tiny_modal(audio=True, batch=8)
    losses, params = reference(program, 4)
    units = (("vit", "encoder", 1, 1, 1), ("beats", "encoder", 1, 1, 1),
             ("llm", "backbone", 1, 1, 1), ("gen", "generator", 1, 1, 1))
    own, hosted = plan_for(program, *units), colocate(program, plan_for(program, *units),
                                                      "beats")
    run_dir = tmp_path / "run"
    for plan, saves, out in ((own, {2: "sync"}, tmp_path / "a.json"),
                             (hosted, {}, tmp_path / "b.json")):
        run(_phase, plan.gpus_used, program, plan, str(run_dir), 2, saves, str(out),
            params if plan is hosted else None, timeout=240)
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert (a["first"], b["first"]) == (0, 2)
    for got, want in zip(a["losses"] + b["losses"], losses, strict=True):
        assert got == pytest.approx(want, rel=1e-4)
