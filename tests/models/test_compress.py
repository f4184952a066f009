"""Token compression in the projector (``models.mlp``) against hand-written definitions:
InternVL's ``pixel_shuffle``, ``avg_pool2d`` as LLaVA-OneVision calls it, and a resampler's
cross-attention written out per head."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dtdsl.cost import flops
from dtdsl.ir import program as ir
from dtdsl.models import build_projector
from dtdsl.models.mlp import AvgPool, PixelShuffle, Resampler
from dtdsl.models.multimodal import build_unit
from tests.specs import variant


def internvl_pixel_shuffle(x: torch.Tensor, scale_factor: float = 0.5) -> torch.Tensor:
    """InternVL-Chat's ``InternVLChatModel.pixel_shuffle`` (``ps_version='v2'``), as written
    there: ``x`` is ``[n, rows, cols, c]`` (it calls the two grid axes ``w, h``)."""
    n, w, h, c = x.size()
    # N, W, H, C --> N, W, H * scale, C // scale
    x = x.view(n, w, int(h * scale_factor), int(c / scale_factor))
    # N, W, H * scale, C // scale --> N, H * scale, W, C // scale
    x = x.permute(0, 2, 1, 3).contiguous()
    # N, H * scale, W, C // scale --> N, H * scale, W * scale, C // (scale ** 2)
    x = x.view(n, int(h * scale_factor), int(w * scale_factor),
               int(c / (scale_factor * scale_factor)))
    return x.permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(("rows", "cols", "k"), [(4, 4, 2), (4, 6, 2), (6, 6, 3), (6, 3, 3),
                                                  (8, 4, 4)])
def test_pixel_shuffle_is_internvls(rows, cols, k):
    torch.manual_seed(0)
    x = torch.randn(3, rows * cols, 8)
    got = PixelShuffle(ir.PixelShuffle(factor=k))(x, (rows, cols))
    want = internvl_pixel_shuffle(x.view(3, rows, cols, 8), 1 / k).reshape(3, -1, 8 * k * k)
    assert got.shape == (3, (rows // k) * (cols // k), 8 * k * k)
    assert torch.equal(got, want)
    # One token per block: the block's patches in row-major order, each patch's channels.
    block = x.view(3, rows, cols, 8)[:, :k, k:2 * k].reshape(3, -1) if cols >= 2 * k else None
    if block is not None:
        assert torch.equal(got[:, 1], block)


def test_pixel_shuffle_refuses_a_grid_it_does_not_divide():
    with pytest.raises(ValueError, match=r"divisible by 2, not 3 x 4"):
        PixelShuffle(ir.PixelShuffle(factor=2))(torch.zeros(1, 12, 4), (3, 4))
    with pytest.raises(ValueError, match="a patch grid of 3 x 3 for 12 tokens"):
        PixelShuffle(ir.PixelShuffle(factor=2))(torch.zeros(1, 12, 4), (3, 3))


@pytest.mark.parametrize(("rows", "cols", "k"), [(4, 4, 2), (6, 4, 2), (6, 9, 3)])
def test_average_pooling_is_avg_pool2d(rows, cols, k):
    torch.manual_seed(1)
    x = torch.randn(2, rows * cols, 5)
    got = AvgPool(ir.AvgPool(factor=k))(x, (rows, cols))
    # LLaVA-OneVision's get_2dPool: [n, c, rows, cols] through avg_pool2d(x, stride).
    image = x.view(2, rows, cols, 5).permute(0, 3, 1, 2)
    want = F.avg_pool2d(image, k).flatten(2).transpose(1, 2)
    assert got.shape == want.shape == (2, (rows // k) * (cols // k), 5)
    assert torch.allclose(got, want, atol=1e-6)


def test_average_pooling_in_ceil_mode_averages_the_edge_blocks():
    torch.manual_seed(2)
    rows, cols, k = 5, 7, 2
    x = torch.randn(2, rows * cols, 3)
    got = AvgPool(ir.AvgPool(factor=k))(x, (rows, cols))
    grid = x.view(2, rows, cols, 3)
    want = torch.stack([grid[:, r:r + k, c:c + k].mean(dim=(1, 2))
                        for r in range(0, rows, k) for c in range(0, cols, k)], dim=1)
    assert got.shape == (2, 3 * 4, 3) and 3 * 4 == ir.AvgPool(factor=k).tokens(rows, cols)
    assert torch.allclose(got, want, atol=1e-6)
    image = grid.permute(0, 3, 1, 2)
    assert torch.allclose(got, F.avg_pool2d(image, k, ceil_mode=True).flatten(2).transpose(1, 2),
                          atol=1e-6)


def _resampler(width: int = 16, queries: int = 5, heads: int = 4) -> Resampler:
    torch.manual_seed(3)
    module = Resampler(ir.Resampler(queries=queries, heads=heads), width)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module


def test_resampler_is_cross_attention_of_learned_queries():
    module = _resampler()
    x = torch.randn(3, 9, 16)
    got = module(x)
    assert got.shape == (3, 5, 16)
    q = module.wq(module.norm_q(module.queries))              # [M, C]
    kv = module.norm_kv(x)
    k, v = module.wk(kv), module.wv(kv)                       # [B, N, C]
    heads, d = 4, 4
    outs = []
    for h in range(heads):
        sl = slice(h * d, (h + 1) * d)
        scores = torch.einsum("md,bnd->bmn", q[:, sl], k[..., sl]) / math.sqrt(d)
        outs.append(torch.einsum("bmn,bnd->bmd", scores.softmax(-1), v[..., sl]))
    want = module.queries + module.wo(torch.cat(outs, dim=-1))
    assert torch.allclose(got, want, atol=1e-5)
    # A fixed number of tokens whatever the image's size.
    assert module(torch.randn(2, 30, 16)).shape == (2, 5, 16)


def test_resampler_passes_gradients_to_its_queries_projections_and_input():
    module = _resampler()
    x = torch.randn(2, 7, 16, requires_grad=True)
    module(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("compress", ["pixel_shuffle(2)", "avg_pool(2)",
                                      "resampler(queries=6, heads=2)"])
def test_projector_compresses_then_projects(compress):
    program = variant("projector vit -> llm : mlp(depth=2)",
                      f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")
    proj = program.projectors[0]
    assert proj.name == "vit_to_llm" and proj.compress is not None
    # The MLP reads what the compression hands it: pixel shuffle 4 times the ViT's 64.
    assert proj.arch.in_dim == (256 if compress.startswith("pixel") else 64)
    assert sum(p.numel() for p in build_projector(proj).parameters()) == \
        flops.projector_params(proj.arch) + flops.compression_params(proj)
    model = build_unit(program, proj.name, seed=0)      # initialised as a run's
    x = torch.randn(2, 8 * 8, 64)
    out = model(x, (8, 8))
    tokens = program.image_tokens().of_grid(8, 8)
    assert out.shape == (2, tokens, 128)
    assert tokens == {"p": 16, "a": 16, "r": 6}[compress[0]]
    assert torch.isfinite(out).all()
    assert torch.allclose(out, model.mlp(model.compress(x, (8, 8))))
