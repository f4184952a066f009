"""Attention over packed documents (``models.attention``) against a dense masked SDPA.

The two are different implementations of one function (FlexAttention's over the
document-causal block mask; SDPA's math kernel over a boolean ``[B, 1, S, S]`` mask with
K/V heads repeated for grouped-query attention), so they agree to rounding: within
``TOL`` = 1e-5 (absolute and relative) in fp32, forward and backward."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from dtdsl.ir import program as ir
from dtdsl.ir.layout import concat, sequence_layout
from dtdsl.models import attention as attn
from dtdsl.models import transformer
from dtdsl.models.attention import BLOCK, document_attention, document_ids, document_mask
from dtdsl.models.multimodal import document_masks

TOL = {"atol": 1e-5, "rtol": 1e-5}   # between two implementations, fp32
EXAMPLES = int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 150))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=list(HealthCheck))
# A layer's forward and backward are slower per example: a fifth of the examples.
LAYER_PROPERTY = settings(max_examples=max(10, EXAMPLES // 5), deadline=None,
                          suppress_health_check=list(HealthCheck))


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in lengths:
        out.append((at, n))
        at += n
    return out


@st.composite
def packed_batches(draw, max_width: int = 300):
    """Sequences of one width (crossing block boundaries or not), each with its own
    split into documents (length 1 included) and padding after them or none."""
    width = draw(st.integers(1, max_width))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        used = draw(st.integers(1, width))
        lengths: list[int] = []
        while sum(lengths) < used:
            lengths.append(draw(st.integers(1, used - sum(lengths))))
        rows.append(_spans(lengths))
    return width, rows


def dense_mask(spans, width: int) -> torch.Tensor:
    """The reference: ``[B, 1, S, S]`` True where a query attends a key (its own document
    up to itself; the padding after the documents one more document)."""
    docs = torch.empty(len(spans), width, dtype=torch.int64)
    for b, row in enumerate(spans):
        end = 0
        for d, (start, n) in enumerate(row):
            docs[b, start:start + n] = d
            end = start + n
        docs[b, end:] = len(row)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def dense_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                          v.repeat_interleave(group, dim=1), attn_mask=mask)


def _qkv(batch: int, width: int, heads: int, kv_heads: int, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, width, dim, generator=g, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


@PROPERTY
@given(packed_batches(), st.sampled_from([(4, 4), (4, 2), (6, 1)]))
def test_flex_attention_equals_the_dense_mask_forward_and_backward(batch, heads):
    width, spans = batch
    q, k, v = _qkv(len(spans), width, *heads)
    _, mask = document_mask(spans, width, "cpu")
    out = document_attention(q, k, v, mask)
    ref = dense_attention(q, k, v, dense_mask(spans, width))
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=f"d{name}")


@PROPERTY
@given(packed_batches(max_width=700))
def test_the_block_lists_are_what_create_block_mask_derives(batch):
    """Built from the spans alone, the BlockMask's partial and full block lists (and their
    transposes for backward) equal those torch derives by evaluating the mask on every
    pair of positions."""
    width, spans = batch
    positions, mask = document_mask(spans, width, "cpu")
    ours = mask.block_mask
    theirs = create_block_mask(ours.mask_mod, len(spans), 1, width, width, device="cpu",
                               BLOCK_SIZE=BLOCK)
    for name in attn._BLOCK_TENSORS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape and torch.equal(a, b), name
    assert ours.seq_lengths == theirs.seq_lengths == (width, width)
    # positions restart in every document and in the padding
    for row, pos in zip(spans, positions, strict=True):
        for start, n in row:
            assert torch.equal(pos[start:start + n], torch.arange(n))
        end = row[-1][0] + row[-1][1]
        assert torch.equal(pos[end:], torch.arange(width - end))


def test_the_blocks_touched_follow_the_documents():
    """One document fills the causal half of the blocks (diagonal ones partial, the
    others full); 16 documents of one block each touch only the diagonal."""
    _, one = document_mask([[(0, 16 * BLOCK)]], 16 * BLOCK, "cpu")
    bm = one.block_mask
    assert bm.kv_num_blocks.tolist() == [[[1] * 16]]
    assert bm.full_kv_num_blocks.tolist() == [[list(range(16))]]
    assert one.block_fraction() == pytest.approx(136 / 256)
    _, many = document_mask([_spans([BLOCK] * 16)], 16 * BLOCK, "cpu")
    assert many.block_fraction() == pytest.approx(16 / 256)
    assert many.block_mask.full_kv_num_blocks.sum() == 0


def test_spans_that_are_not_a_packed_sequence_are_refused():
    with pytest.raises(ValueError, match="does not follow"):
        document_ids([[(0, 3), (4, 2)]], 8)
    with pytest.raises(ValueError, match="does not follow"):
        document_ids([[(0, 3), (3, 0)]], 8)
    with pytest.raises(ValueError, match="exceed 4"):
        document_ids([[(0, 3), (3, 2)]], 4)


def _arch(heads: int, kv_heads: int) -> ir.TransformerArch:
    return ir.TransformerArch(layers=1, hidden=32, heads=heads, kv_heads=kv_heads, ffn=64,
                              vocab=64, swiglu=True, causal=True, rope=ir.RoPE())


@LAYER_PROPERTY
@given(packed_batches(max_width=200), st.sampled_from([(4, 4), (4, 2)]))
def test_a_backbone_layer_equals_its_dense_mask_reference(batch, heads):
    """A whole backbone layer (norms, rotary positions restarting per document, GQA, the
    MLP): output, input gradient and every parameter's gradient."""
    width, spans = batch
    torch.manual_seed(0)
    layer = transformer.TransformerLayer(_arch(*heads), role="backbone")
    x = torch.randn(len(spans), width, 32, requires_grad=True)
    positions, mask = document_mask(spans, width, "cpu")
    dense = dense_mask(spans, width)

    def run(attention):
        old = transformer.document_attention
        transformer.document_attention = attention
        try:
            out = layer(x, positions, mask)
            grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        finally:
            transformer.document_attention = old
        return out, grads

    out, grads = run(document_attention)
    ref, ref_grads = run(lambda q, k, v, _: dense_attention(q, k, v, dense))
    torch.testing.assert_close(out, ref, **TOL)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_unpacked_sequences_keep_plain_causal_attention():
    """No sequence with two documents: no mask at all (SDPA's causal kernel, positions
    0..S-1); one packed sequence among them: every sequence gets the document mask."""
    one = sequence_layout(5, [], [], [(0, 5)], 16)
    assert document_masks([one, one], 8, "cpu") == (None, None)
    two = concat([sequence_layout(3, [], [], [(0, 3)], 16),
                  sequence_layout(2, [], [], [(0, 2)], 16)], 16)
    positions, mask = document_masks([one, two], 8, "cpu")
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 0, 1, 2]]
    assert mask.docs[:, :8].tolist() == [[0] * 5 + [1] * 3, [0, 0, 0, 1, 1, 2, 2, 2]]


@pytest.mark.slow
def test_compiled_flex_attention_runs_the_block_lists_on_the_cpu():
    """What a GPU runs: ``torch.compile(flex_attention)`` over our BlockMask, here through
    inductor's CPU kernel (forward only: torch 2.13 has no compiled CPU backward), which
    skips the blocks our lists leave out; equal to the dense mask. A second batch with
    other documents (new mask_mod closure, new block lists, same shape) reuses the
    compiled kernel, and other widths stop compiling once the length is dynamic."""
    from torch._dynamo.utils import counters

    width = 2 * BLOCK + 44
    frames = counters["stats"]["unique_graphs"]
    for seed, spans in enumerate([[_spans([100, 1, 150]), _spans([300])],
                                  [_spans([5, 200, 95]), _spans([1] * 7 + [60])]]):
        q, k, v = (t.detach() for t in _qkv(2, width, 4, 2, dim=16, seed=seed))
        _, mask = document_mask(spans, width, "cpu")
        with torch.no_grad():
            out = attn.flex_kernel()(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
        torch.testing.assert_close(out, dense_attention(q, k, v, dense_mask(spans, width)),
                                   **TOL)
    assert counters["stats"]["unique_graphs"] - frames == 1
    # Packed microbatches pad to their longest row, so widths vary: the sequence length
    # turns dynamic and the compiled kernels stop growing (no recompile per width).
    for width in (2 * BLOCK + 84, 3 * BLOCK + 6, 3 * BLOCK + 66, 4 * BLOCK + 8):
        q, k, v = (t.detach() for t in _qkv(1, width, 4, 2, dim=16))
        spans = [_spans([width // 2, width - width // 2 - 3])]
        _, mask = document_mask(spans, width, "cpu")
        with torch.no_grad():
            out = attn.flex_kernel()(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
        torch.testing.assert_close(out, dense_attention(q, k, v, dense_mask(spans, width)),
                                   **TOL)
        if width == 3 * BLOCK + 66:
            settled = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == settled <= frames + 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_on_cuda_equals_the_dense_mask():
    """The compiled Triton kernel, forward and backward, fp32, GQA, several documents."""
    width = 4 * BLOCK + 17
    spans = [_spans([100, 1, 300, 50]), _spans([width]), _spans([7] * 20)]
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(3, width, 8, 2, dim=64))
    _, mask = document_mask(spans, width, "cuda")
    out = document_attention(q, k, v, mask)
    ref = dense_attention(q, k, v, dense_mask(spans, width).cuda())
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("heads,kv_heads,causal,keys", [(4, 4, True, 37), (4, 2, True, 37),
                                                        (4, 4, False, 11), (6, 2, False, 11)])
def test_dense_attention_is_the_softmax_of_scaled_scores(heads, kv_heads, causal, keys):
    from dtdsl.models.attention import dense_attention

    torch.manual_seed(0)
    q = torch.randn(2, heads, 37, 16, dtype=torch.float64)
    k = torch.randn(2, kv_heads, keys, 16, dtype=torch.float64)
    v = torch.randn(2, kv_heads, keys, 16, dtype=torch.float64)
    rep = heads // kv_heads
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / 4.0
    if causal:
        scores = scores.masked_fill(torch.ones(37, keys, dtype=torch.bool).triu(1), -math.inf)
    want = scores.softmax(-1) @ v.repeat_interleave(rep, 1)
    torch.testing.assert_close(dense_attention(q, k, v, causal=causal), want,
                               rtol=1e-10, atol=1e-10)
