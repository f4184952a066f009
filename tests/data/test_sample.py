"""Synthetic training data: determinism, sizes following the spec, image packing."""

from __future__ import annotations

import pytest
import torch

from dtdsl.data.sample import DIFFUSION_STEPS, image_side, make_batch, make_sample
from dtdsl.models import Encoder
from dtdsl.models.inputs import Sample, pack_images, unpack_images
from tests.specs import program, variant


def same(a: Sample, b: Sample) -> bool:
    if (a.step, a.index) != (b.step, b.index) or not torch.equal(a.tokens, b.tokens):
        return False
    if len(a.images) != len(b.images) or a.targets.keys() != b.targets.keys():
        return False
    if not all(torch.equal(x, y) for x, y in zip(a.images, b.images, strict=True)):
        return False
    return all(torch.equal(getattr(a.targets[k], f), getattr(b.targets[k], f))
               for k in a.targets for f in ("latents", "noise", "timesteps"))


def test_batches_are_deterministic():
    p = program()
    first, again = make_batch(p, 3), make_batch(p, 3)
    assert len(first) == p.train.global_batch
    assert all(same(a, b) for a, b in zip(first, again, strict=True))
    assert [s.index for s in first] == list(range(p.train.global_batch))


def test_steps_and_samples_differ():
    p = program()
    a, b = make_batch(p, 0), make_batch(p, 1)
    assert not any(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert len({tuple(s.tokens.tolist()) for s in a}) == len(a)


def test_sample_alone_equals_sample_in_batch():
    p = program()
    batch = make_batch(p, 5)
    for i in (0, 7, 15):
        assert same(make_sample(p, 5, i), batch[i])


def test_sizes_follow_the_distributions():
    p = program()
    samples = [s for step in range(4) for s in make_batch(p, step)]
    lengths = [len(s.tokens) for s in samples]
    assert min(lengths) >= 8 and max(lengths) <= 192
    assert len(set(lengths)) > 10
    counts = [len(s.images) for s in samples]
    assert set(counts) <= {0, 1, 2, 3} and 0 in counts and max(counts) >= 2
    sides = {im.shape for s in samples for im in s.images}
    assert sides == {(3, 32, 32), (3, 64, 64)}      # 16 and 64 patches of 8 pixels
    gen = [len(s.targets["gen"]) for s in samples]
    assert set(gen) == {0, 1}
    for s in samples:
        t = s.targets["gen"]
        assert t.latents.shape == t.noise.shape == (len(t), 4, 8, 8)
        assert t.timesteps.dtype == torch.int64 and t.timesteps.shape == (len(t),)
        assert bool(((t.timesteps >= 0) & (t.timesteps < DIFFUSION_STEPS)).all())
        assert s.tokens.dtype == torch.int64
        assert 0 <= int(s.tokens.min()) and int(s.tokens.max()) < 512
        assert all(im.dtype == torch.float32 for im in s.images)


def test_clamps_and_constants_are_honoured():
    p = variant("clamp [8, 192]", "clamp [10, 12]")
    lengths = {len(s.tokens) for s in make_batch(p, 0)}
    assert lengths <= {10, 11, 12}
    q = variant("zipf(a=2.0) clamp [0, 3]", "2")
    assert {len(s.images) for s in make_batch(q, 0)} == {2}


def test_image_side_rounds_to_a_square_grid():
    assert image_side(16, 8) == 32 and image_side(64, 8) == 64
    assert image_side(20, 14) == 4 * 14 and image_side(0, 8) == 8


def test_packing_round_trip_without_padding():
    p = program()
    samples = make_batch(p, 2)
    images = [s.images for s in samples]
    packed = pack_images(images, 8)
    rows = sum(g.shape[0] * g.shape[1] for g in packed.groups)
    assert rows == sum((im.shape[1] // 8) ** 2 for s in images for im in s)   # no padding
    assert len({g.shape[1] for g in packed.groups}) == len(packed.groups)
    back = unpack_images(packed, list(packed.groups))
    for sample_images, got in zip(images, back, strict=True):
        want = [Encoder.patchify(im[None], 8)[0] for im in sample_images]
        expected = torch.cat(want) if want else torch.zeros(0, 3 * 64)
        assert torch.equal(got, expected)


def test_unpack_without_images_needs_a_width():
    packed = pack_images([(), ()], 8)
    assert packed.groups == ()
    out = unpack_images(packed, [], width=5)
    assert [t.shape for t in out] == [(0, 5), (0, 5)]
    with pytest.raises(ValueError, match="width"):
        unpack_images(packed, [])
