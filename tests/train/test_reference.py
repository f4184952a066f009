"""The per-unit model steps and single-process reference training on the tiny spec."""

from __future__ import annotations

import json
import math

import torch

from dtdsl import cli
from dtdsl.data.sample import make_batch
from dtdsl.models.inputs import pack_images
from dtdsl.models.multimodal import (
    IGNORE,
    backbone_input,
    backbone_layers,
    build_model,
    build_unit,
    encode,
    encoder_input,
    encoder_layers,
    loss_normalizer,
    microbatch_loss,
    sample_layout,
)
from dtdsl.train.reference import make_optimizer, train_reference
from tests.specs import TINY, program, small, variant


def test_initialisation_is_seeded_per_unit():
    p = program()
    state = torch.random.get_rng_state()
    a, b = build_model(p), build_model(p)
    assert torch.equal(state, torch.random.get_rng_state())     # global RNG untouched
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    alone = build_unit(p, "llm", p.train.seed)
    for name, x in alone.state_dict().items():
        assert torch.equal(x, a.unit("llm").state_dict()[name])
    other = build_model(p, seed=7)
    assert not torch.equal(other.unit("llm").output.weight, a.unit("llm").output.weight)
    assert not torch.equal(a.unit("vit_to_llm").layers[0].weight[:64, :64],
                           a.unit("llm_to_gen").layers[0].weight[:64, :64])


def test_layer_ranges_compose():
    p = program()
    model = build_model(p)
    samples = make_batch(p, 0)[:6]
    enc = model.unit("vit")
    packed = pack_images([s.images for s in samples], 8)
    xs = encoder_input(enc, packed.groups, packed.grids)
    whole = encoder_layers(enc, xs)
    split = encoder_layers(enc, encoder_layers(enc, xs, 0, 1), 1, None)
    images = {}
    for s in samples:
        for im in s.images:
            images.setdefault(tuple(im.shape), []).append(im)
    for w, s, stack in zip(whole, split, images.values(), strict=True):
        assert torch.allclose(w, enc(torch.stack(stack)), atol=1e-6) and torch.equal(w, s)
    llm = model.unit("llm")
    batch = backbone_input(llm, encode(model, samples), [s.tokens for s in samples],
                           [sample_layout(s, model.image_tokens, 512) for s in samples])
    full = backbone_layers(llm, batch.embeds)
    assert torch.equal(full, backbone_layers(llm, backbone_layers(llm, batch.embeds, 0, 3), 3))


def test_sequences_and_loss_tokens():
    p = variant("seq_len          = 512", "seq_len = 112")       # long texts get cut
    model = build_model(p)
    samples = make_batch(p, 0)
    norm = loss_normalizer(model, samples)
    embeds = encode(model, samples)
    layouts = [sample_layout(s, model.image_tokens, 112) for s in samples]
    batch = backbone_input(model.unit("llm"), embeds, [s.tokens for s in samples], layouts)
    assert batch.embeds.shape[:2] == batch.targets.shape == (16, max(batch.lengths))
    assert max(batch.lengths) == 112
    assert int((batch.targets != IGNORE).sum()) == norm.text_tokens
    for s, e, n, t in zip(samples, embeds, batch.lengths, batch.targets, strict=True):
        # Synthetic samples: images first, then text; every text token but the first is a
        # target, predicted at the position before it. Sources cut them to seq_len.
        kept = n - e.shape[0]
        assert kept == len(s.tokens) <= 112 - e.shape[0]
        assert torch.equal(t[e.shape[0]:n - 1], s.tokens[1:kept])
        assert bool((t[:e.shape[0]] == IGNORE).all()) and bool((t[n - 1:] == IGNORE).all())
    assert norm.gen_targets == sum(len(s.targets["gen"]) for s in samples)


def test_splits_of_the_batch_sum_to_the_whole():
    p = small(6)
    model = build_model(p)
    samples = make_batch(p, 1)
    norm = loss_normalizer(model, samples)
    whole = microbatch_loss(model, samples, norm)
    parts = [microbatch_loss(model, samples[i:i + 2], norm) for i in range(0, 6, 2)]
    assert math.isclose(sum(x.total.item() for x in parts), whole.total.item(), rel_tol=1e-5)
    fixed = microbatch_loss(model, samples, norm, pad_to=512)
    assert math.isclose(fixed.total.item(), whole.total.item(), rel_tol=1e-5)


def test_microbatching_does_not_change_the_losses():
    p = small(4)
    runs = [[r["loss"] for r in train_reference(p, 2, micro_batch=mb)] for mb in (1, 2, 4)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (runs[0], other)


def test_loss_is_finite_and_falls():
    records = list(train_reference(small(4), 20, micro_batch=4))
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(20))
    assert all(math.isfinite(x) for x in losses)
    assert all(math.isclose(r["loss"], r["lm_loss"] + r["gen_loss"], rel_tol=1e-6)
               for r in records)
    assert sum(losses[-3:]) < 0.75 * sum(losses[:3]), losses


def test_frozen_generator_gets_no_gradients():
    text = TINY.read_text().replace("context_dim=64, groups=8)\n",
                                    "context_dim=64, groups=8)\n    frozen = true\n")
    p = program(text)
    assert p.module("gen").frozen
    model = build_model(p)
    assert not any(q.requires_grad for q in model.unit("gen").parameters())
    samples = [s for s in make_batch(p, 0) if len(s.targets["gen"])][:2]
    microbatch_loss(model, samples, loss_normalizer(model, samples)).total.backward()
    assert all(q.grad is None for q in model.unit("gen").parameters())
    assert all(q.grad is not None and q.grad.abs().sum() > 0
               for q in model.unit("llm_to_gen").parameters())
    optimised = {id(q) for g in make_optimizer(p, model).param_groups for q in g["params"]}
    assert not optimised & {id(q) for q in model.unit("gen").parameters()}


def test_cli_writes_one_line_per_step(tmp_path, capsys):
    out = tmp_path / "losses.jsonl"
    code = cli.main(["reference", str(TINY), "--steps", "2", "--out", str(out),
                     "--micro-batch", "4", "--threads", "1"])
    assert code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and all(math.isfinite(r["loss"]) for r in lines)
    assert "step 2/2" in capsys.readouterr().err
    assert cli.main(["reference", str(TINY), "--steps", "1", "--out", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err
    # An earlier output is replaced; any other file is left as it was, checked before training.
    assert cli.main(["reference", str(TINY), "--steps", "1", "--out", str(out), "-q"]) == 0
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [0]
    mine = tmp_path / "notes.txt"
    mine.write_text("precious\n")
    assert cli.main(["reference", str(TINY), "--steps", "1", "--out", str(mine)]) == 2
    assert "is not a dtc reference output dtdsl wrote" in capsys.readouterr().err
    assert mine.read_text() == "precious\n" and not list(tmp_path.glob(".*.tmp"))
    assert cli.main(["reference", str(tmp_path / "missing.dt"), "--steps", "1"]) == 2
