"""Token compression in the cost model and the simulator's samples: the backbone sees an
image's compressed tokens (k^2 fewer, or N per image), and its work, the encoder's boundary
and the projector's FLOPs follow."""

from __future__ import annotations

import numpy as np
import pytest

from dtdsl.cost import flops
from dtdsl.cost.graph import build_graph
from dtdsl.cost.model import build_cost_model
from dtdsl.cost.samples import draw_samples, positions
from dtdsl.ir import program as ir
from dtdsl.reorder.workload import WorkModel
from tests.specs import program, variant

SHORT = "projector vit -> llm : mlp(depth=2)"
N = 4000


def compressed(compress: str) -> ir.Program:
    return variant(SHORT, f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")


@pytest.mark.parametrize(("compress", "tokens"), [
    # The tiny spec's images: 16 or 64 patches, 4 x 4 or 8 x 8 grids.
    ("pixel_shuffle(2)", {16: 4, 64: 16}),
    ("pixel_shuffle(4)", {16: 1, 64: 4}),
    ("avg_pool(3)", {16: 4, 64: 9}),          # ceil(4 / 3)^2, ceil(8 / 3)^2
    ("resampler(queries=5)", {16: 5, 64: 5}),
])
def test_the_backbone_sees_the_compressed_tokens(compress, tokens):
    plain, packed = draw_samples(program(), N), draw_samples(compressed(compress), N)
    before, after = plain.items["image"], packed.items["image"]
    # The same draw: the encoder's patches are unchanged (no sample is cut at seq_len 512).
    assert np.array_equal(before.sizes, after.sizes)
    assert np.array_equal(plain.text_tokens, packed.text_tokens)
    assert after.backbone_sizes.tolist() == [tokens[int(p)] for p in after.sizes]
    assert np.array_equal(positions(packed),
                          packed.text_tokens + after.backbone_tokens().astype(np.int64))
    assert np.array_equal(positions(plain) - positions(packed),
                          (before.tokens() - after.backbone_tokens()).astype(np.int64))


def test_pixel_shuffle_divides_the_image_tokens_by_its_factor_squared():
    plain, shuffled = draw_samples(program(), N), draw_samples(compressed("pixel_shuffle(2)"), N)
    assert np.array_equal(plain.items["image"].tokens(),
                          4 * shuffled.items["image"].backbone_tokens())


def test_the_cost_model_prices_the_compressed_backbone_and_projector():
    plain, shuffled = build_cost_model(program()), build_cost_model(compressed("pixel_shuffle(2)"))
    resampled = build_cost_model(compressed("resampler(queries=4)"))
    pooled = build_cost_model(compressed("avg_pool(2)"))
    lm = [c.unit("llm") for c in (plain, shuffled, resampled, pooled)]
    # Fewer positions in the backbone: less work per microbatch, in every compression.
    for other in lm[1:]:
        assert other.fwd_work.total < 0.9 * lm[0].fwd_work.total
    # The encoder hands the backbone a quarter of the rows under a 2 x 2 shuffle or pool.
    vit = [c.unit("vit") for c in (plain, shuffled, resampled, pooled)]
    assert vit[1].boundary_bytes == pytest.approx(vit[0].boundary_bytes / 4)
    assert vit[3].boundary_bytes == pytest.approx(vit[0].boundary_bytes / 4)
    # The shuffled projector's MLP runs on a quarter of the tokens at 4x the input width:
    # its first layer costs the same, its second a quarter.
    p0, p1 = program().projectors[0], compressed("pixel_shuffle(2)").projectors[0]
    assert p1.arch.in_dim == 4 * p0.arch.in_dim
    images = plain.program  # the same draw in both
    samples = draw_samples(images, plain.params.samples, plain.params.seed)
    mb = images.train.micro_batch
    patches = float(samples.items["image"].tokens().mean()) * mb
    w0 = flops.mlp_forward_per_token(p0.arch) * patches
    w1 = flops.mlp_forward_per_token(p1.arch) * patches / 4
    assert vit[0].fwd_work.total - vit[1].fwd_work.total == pytest.approx(w0 - w1)
    assert w0 - w1 == pytest.approx(2 * 128 * 128 * patches * 3 / 4)
    # The resampler adds its projections and cross-attention, and its parameters.
    p2 = compressed("resampler(queries=4)").projectors[0]
    count = float(samples.items["image"].counts.mean()) * mb
    extra = flops.compression_forward(p2, patches, count)
    assert extra.attention == pytest.approx(4 * 4 * patches * 64) and extra.matmul > 0
    mlp2 = flops.mlp_forward_per_token(p2.arch) * 4 * count
    assert vit[2].fwd_work.total - vit[0].fwd_work.total == pytest.approx(
        extra.total + mlp2 - w0)
    assert vit[2].params - vit[0].params == flops.compression_params(p2) == \
        4 * 64 + 4 * 64 * 64 + 4 * 64


def test_the_simulators_work_and_the_graph_follow():
    p = compressed("pixel_shuffle(2)")
    plain, shuffled = draw_samples(program(), 64, seed=5), draw_samples(p, 64, seed=5)
    # The same samples' backbone work, in FLOPs relative to the uncompressed mean: the
    # simulator's routing and durations see the compressed sequences as lighter.
    work = WorkModel(build_cost_model(program()))
    before = work.relative(plain, timed=False)["llm"]
    after = work.relative(shuffled, timed=False)["llm"]
    assert np.all(after <= before) and after.sum() < 0.9 * before.sum()
    assert positions(shuffled).sum() < positions(plain).sum()
    graph = build_graph(p)
    into_llm = graph.edges["vit_to_llm", "llm"]
    into_proj = graph.edges["vit", "vit_to_llm"]
    assert into_llm["tokens_mean"] == pytest.approx(into_proj["tokens_mean"] / 4)
