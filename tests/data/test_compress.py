"""Token compression in the data layer: the layout counts an image's compressed tokens
(``ImageTokens``), and images under a pixel-shuffling projector come in whole blocks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dtdsl.data.batch import SyntheticSource, normalizer_of, sample_set
from dtdsl.data.decode import Decoder
from dtdsl.data.images import ImagePolicy, patch_grid
from dtdsl.ir import program as ir
from dtdsl.ir.layout import fit, layout_of
from dtdsl.ir.sizes import SampleSizes
from tests.specs import variant

SHUFFLE = ir.ImageTokens(patch=8, compress=ir.PixelShuffle(factor=2))


def _compressed(compress: str) -> ir.Program:
    return variant("projector vit -> llm : mlp(depth=2)",
                   f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")


def test_the_layout_places_the_compressed_tokens():
    # Two images: 4 x 4 and 8 x 6 patches of 8 px, 16 and 48 patches, 4 and 12 tokens.
    sizes = SampleSizes(text_tokens=20, image_shapes=((32, 32), (64, 48)), gen_counts={},
                        image_at=(0, 10))
    plain = layout_of(sizes, ir.ImageTokens(patch=8), 512)
    lay = layout_of(sizes, SHUFFLE, 512)
    assert plain.image_tokens == (16, 48) and plain.length == 84
    assert lay.image_tokens == (4, 12) and lay.length == 36
    assert lay.image_starts == (0, 14)      # 4 image rows, then 10 text tokens
    pooled = layout_of(sizes, ir.ImageTokens(patch=8, compress=ir.AvgPool(factor=3)), 512)
    assert pooled.image_tokens == (4, 6)    # ceil(4/3)^2, ceil(8/3) * ceil(6/3)
    queries = layout_of(sizes, ir.ImageTokens(patch=8, compress=ir.Resampler(
        queries=7, heads=1)), 512)
    assert queries.image_tokens == (7, 7)
    # What fits in seq_len is decided on the compressed tokens: both images fit in 40.
    assert fit(sizes, SHUFFLE, 40) is sizes
    assert fit(sizes, ir.ImageTokens(patch=8), 40).image_shapes == ((32, 32),)


def test_synthetic_images_come_in_whole_blocks_and_count_compressed():
    program = _compressed("pixel_shuffle(2)")
    program = program.model_copy(update={"data": program.data.model_copy(update={
        "quantities": tuple(q.model_copy(update={"dist": ir.Choice(values=(9.0, 36.0, 50.0),
                                                                   probs=(0.4, 0.3, 0.3))})
                            if q.key == "image.patches" else q
                            for q in program.data.quantities)})})
    source = SyntheticSource(program)
    sizes = [z for step in range(3) for z in source.sizes(step)]
    shapes = {hw for z in sizes for hw in z.image_shapes}
    # 9 patches: a 3 x 3 grid rounds to 4 x 4; 36: 6 x 6; 50: round(7.07 / 2) * 2 = 8.
    assert shapes == {(32, 32), (48, 48), (64, 64)}
    rule = program.image_tokens()
    assert [rule(h, w) for h, w in sorted(shapes)] == [4, 9, 16]
    # The cost model's view of these samples: patches for the encoder, tokens for the
    # backbone, by the same rule; and the loss's denominators from the same layouts.
    view = sample_set(program, sizes)
    image = view.items["image"]
    flat = [hw for z in sizes for hw in z.image_shapes]
    assert image.sizes.tolist() == [(h // 8) * (w // 8) for h, w in flat]
    assert image.backbone.tolist() == [rule(h, w) for h, w in flat]
    assert normalizer_of(program, sizes).text_tokens == sum(
        layout_of(z, rule, program.train.seq_len).loss_tokens for z in sizes)
    # The drawn samples of the cost model have the same grids.
    assert rule.of_patches(9) == 4 and rule.of_patches(50) == 16


def test_native_resolution_grids_are_whole_blocks():
    assert patch_grid(100, 70, 8) == (13, 9)
    assert patch_grid(100, 70, 8, block=2) == (12, 8)             # 6 x 4 blocks of 2 x 2
    assert patch_grid(100, 70, 8, block=3) == (12, 9)
    gw, gh = patch_grid(400, 300, 8, max_patches=100, block=2)
    assert gw % 2 == gh % 2 == 0 and gw * gh <= 100
    assert patch_grid(8, 8, 8, max_patches=1, block=2) == (2, 2)   # one block at least
    vit = SimpleNamespace(arch=SimpleNamespace(patch=8, image_size=None), hf=None)
    policy = ImagePolicy.for_encoder(vit, max_patches=64, block=4)
    h, w = policy.shape(90, 50)
    assert h % 32 == w % 32 == 0
    decoder = Decoder.for_program(_compressed("pixel_shuffle(4)"), seed=0)
    assert decoder.images is not None and decoder.images.block == 4
    assert Decoder.for_program(_compressed("avg_pool(4)"), seed=0).images.block == 1
    assert np.all(np.array(policy.shape(300, 200)) % 32 == 0)
