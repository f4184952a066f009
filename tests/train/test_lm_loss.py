"""The LM head's loss over chunks of rows (issue 28 item 6): equal to the unchunked
cross-entropy, and no full [tokens, vocab] fp32 logits kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtdsl.cost import flops
from dtdsl.ir import program as ir
from dtdsl.models.multimodal import IGNORE, backbone_output, lm_loss
from dtdsl.models.transformer import Backbone
from tests.dist import run

VOCAB, HIDDEN, ROWS = 97, 16, 50
# fp32: the chunks' sums differ from one sum over all rows in summation order only.
RTOL, ATOL = 1e-5, 1e-6


def _case(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
    rows = torch.randn(ROWS, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    labels[::7] = IGNORE
    return head, rows, labels


def _loss_and_grads(fn, head, rows):
    head.zero_grad()
    x = rows.clone().requires_grad_()
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
def test_chunked_loss_equals_the_whole_cross_entropy(chunk):
    head, rows, labels = _case()
    want = _loss_and_grads(lambda x: F.cross_entropy(head(x).float(), labels,
                                                     ignore_index=IGNORE, reduction="sum"),
                           head, rows)
    got = _loss_and_grads(lambda x: lm_loss(head, x, labels, chunk_rows=chunk), head, rows)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)


def test_no_rows_is_a_zero_loss_and_a_bad_chunk_is_refused():
    head, rows, labels = _case()
    assert lm_loss(head, rows[:0], labels[:0]).item() == 0.0
    with pytest.raises(ValueError, match="chunk_rows 0"):
        lm_loss(head, rows, labels, chunk_rows=0)


def test_the_chunk_is_a_byte_budget_of_fp32_logits():
    assert flops.lm_loss_chunk_rows(128256) == flops.LM_LOSS_CHUNK_BYTES // (4 * 128256)
    assert flops.lm_loss_chunk_rows(128256 // 8) > 4000
    assert flops.lm_loss_chunk_rows(10 ** 12) == 1


def _saved_numels(fn) -> list[int]:
    """The sizes of the tensors autograd keeps for backward while ``fn`` runs (those
    activation checkpointing keeps are its inputs only)."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_backbone_output_keeps_no_full_logits():
    arch = ir.TransformerArch(layers=1, hidden=HIDDEN, heads=2, kv_heads=2, ffn=32,
                              vocab=VOCAB, swiglu=True)
    backbone = Backbone(arch)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, HIDDEN, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 24), generator=gen)
    sizes = _saved_numels(lambda: backbone_output(backbone, x, targets))
    assert max(sizes) < 48 * VOCAB, sizes       # nothing of [48, vocab] is kept
    loss, _ = backbone_output(backbone, x, targets, chunk_rows=8)
    whole, _ = backbone_output(backbone, x, targets, chunk_rows=48)
    torch.testing.assert_close(loss, whole, rtol=RTOL, atol=ATOL)


def _tp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from dtdsl.parallel.tp import local_tensor, parallelize_unit

    torch.manual_seed(0)        # the same weights and rows on both ranks
    arch = ir.TransformerArch(layers=1, hidden=HIDDEN, heads=2, kv_heads=2, ffn=32,
                              vocab=96, swiglu=True)
    backbone = Backbone(arch)
    parallelize_unit(backbone, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    head = backbone.output
    _, rows, labels = _case()
    labels = labels.remainder(96).masked_fill(labels == IGNORE, IGNORE)
    results = []
    for chunk in (ROWS, 7):
        head.zero_grad()
        x = rows.clone().requires_grad_()
        loss = lm_loss(head, x, labels, chunk_rows=chunk)
        with loss_parallel():
            loss.backward()
        results.append((loss.detach(), x.grad, local_tensor(head.weight.grad).clone()))
    for g, w in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    # The whole vocabulary's cross-entropy, on one process, as the reference computes it.
    full = torch.nn.Linear(HIDDEN, 96, bias=False)
    with torch.no_grad():
        full.weight.copy_(head.weight.full_tensor())
    want = F.cross_entropy(full(rows).float(), labels, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(results[1][0], want, rtol=RTOL, atol=ATOL)


def test_vocabulary_parallel_head_chunks_the_rows_of_its_shard():
    run(_tp, 2, timeout=120)
