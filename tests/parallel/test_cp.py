"""Context-parallel attention (dtdsl.parallel.cp) equal to full attention in one process.

Every rank makes the same random q, k, v and upstream gradient of the whole sequence, the
reference is a dense masked SDPA over the unsharded tensors (float64), and each rank
compares its shard of the output (real positions) and of the q, k, v gradients (padding
included: it must get none) within 1e-5 (float32 inputs). Tiny: S <= 64, heads <= 4,
head_dim 8.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtdsl.models.attention import document_ids
from dtdsl.parallel import cp
from dtdsl.parallel.cp import (
    CAUSAL,
    FULL,
    MASKED,
    CPDocuments,
    cp_attention,
    padded_length,
    shard,
    shard_documents,
    shard_index,
    unshard,
)
from dtdsl.parallel.p2p import P2P
from tests.dist import run

TOL = 1e-5
D = 8


def _docs(spans: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and positions ``[B, length]`` of sequences of documents of the given
    lengths (what is left after them: one more document, as document_ids does)."""
    rows = []
    for lengths in spans:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rows.append(list(zip(starts, lengths, strict=True)))
    docs, positions = document_ids(rows, length)
    return docs[:, :length].long(), positions


def _allowed(docs, causal=True):
    """The document mask ``[B, S, S]``: same document (and the key not after the query)."""
    s = docs.shape[1]
    allowed = docs[:, :, None] == docs[:, None, :]
    return allowed & torch.ones(s, s, dtype=torch.bool).tril() if causal else allowed


def _reference(q, k, v, docs, dout, causal=True):
    """Full attention in one process: dense SDPA with the document mask, float64."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    allowed = _allowed(docs, causal)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None],
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _case(b, h, hkv, length, spans, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, length, D, generator=g)
    k = torch.randn(b, hkv, length, D, generator=g)
    v = torch.randn(b, hkv, length, D, generator=g)
    dout = torch.randn(b, h, length, D, generator=g)
    docs, positions = _docs(spans, length)
    return q, k, v, dout, docs, positions


def _compare(case, size, rank, method, group=None, mesh=None, full_docs=False,
             dtype=torch.float32, tol=TOL, causal=True):
    q, k, v, dout, docs, positions = _case(*case)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    length = q.shape[2]
    ref_out, dq, dk, dv = _reference(q, k, v, docs, dout, causal)
    local = [shard(x, size, rank, dim=2).requires_grad_() for x in (q, k, v)]
    my_docs, _ = shard_documents(docs, positions, size, rank)
    given = CPDocuments.from_full(docs, size) if full_docs else my_docs
    out = cp_attention(*local, docs=given, method=method, group=group, mesh=mesh,
                       causal=causal)
    out.backward(shard(dout, size, rank, dim=2))
    real = shard_index(length, size, rank) < length
    want = shard(ref_out, size, rank, dim=2)
    assert out.shape == want.shape and out.dtype == dtype
    err = (out.double() - want)[:, :, real].abs().max().item()
    assert err < tol, f"rank {rank}: output off by {err}"
    for name, got, ref in zip("qkv", (x.grad for x in local), (dq, dk, dv), strict=True):
        assert got.dtype == dtype
        err = (got.double() - shard(ref, size, rank, dim=2)).abs().max().item()
        assert err < tol, f"rank {rank}: d{name} off by {err}"


# Document layouts over S positions: boundaries inside chunks and on their edges, a
# document across every chunk, odd lengths (padded to 2c chunks), padding after them.
SINGLE = (1, 2, 2, 32, [[32]])
PACKED = (2, 2, 2, 32, [[5, 11, 16], [1, 31]])
PACKED64 = (2, 4, 2, 64, [[16, 3, 29, 16], [2, 62]])
ODD = (2, 2, 1, 37, [[10, 20], [37]])          # 7 positions of padding in row 0
GQA = (1, 4, 1, 48, [[7, 9, 30, 2]])


def _ring(rank, world, cases, pairs):
    """Ring attention; ``pairs``: the ring is a group of two strided ranks (0, 2), (1, 3)."""
    group = None
    if pairs:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, size, me = groups[rank % 2], 2, rank // 2
    else:
        size, me = world, rank
    for i, case in enumerate(cases):
        _compare(case, size, me, "ring", group=group, full_docs=i % 2 == 1)
    # Bidirectional within each document (an encoder's attention).
    for case in (PACKED, ODD):
        _compare(case, size, me, "ring", group=group, causal=False)


@pytest.mark.parametrize("world,pairs", [(1, False), (2, False), (4, True), (4, False)])
def test_ring_equals_full_attention(world, pairs):
    run(_ring, world, [SINGLE, PACKED, PACKED64, ODD, GQA], pairs)


def _ring_bf16(rank, world):
    # bf16 inputs: blocks merged and gradients accumulated in float32, results in bf16
    # (bf16's own rounding: 2^-8 relative, on values of order 1).
    _compare(PACKED64, world, rank, "ring", dtype=torch.bfloat16, tol=3e-2)


def test_ring_in_bf16():
    run(_ring_bf16, 2)


# Bidirectional rows that share their documents, as an encoder group's do: one clip a
# row and its padding to whole chunks (a second document), or the same documents in
# every row. Ulysses attends each document densely (``_span_attention``).
CLIPS = (3, 4, 2, 37, [[37]] * 3)
SHARED = (2, 4, 4, 30, [[10, 20]] * 2)


def _ulysses(rank, world, cases):
    for i, case in enumerate(cases):
        _compare(case, world, rank, "ulysses", full_docs=i % 2 == 0)
    for i, case in enumerate((PACKED64, CLIPS, SHARED)):
        _compare(case, world, rank, "ulysses", causal=False, full_docs=i % 2 == 1)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_equals_full_attention(world):
    # world 4 over 1 and 2 KV heads: each repeated to 4 (gradients summed back); over 4:
    # one each.
    run(_ulysses, world, [PACKED64, ODD if world == 2 else (2, 4, 1, 37, [[10, 20], [37]]),
                          GQA, (1, 4, 4, 24, [[3, 21]])])


def _hybrid(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=cp.MESH_DIMS)
    assert cp.cp_rank(mesh) == rank
    for i, case in enumerate(cases):
        _compare(case, world, rank, "hybrid", mesh=mesh, full_docs=i % 2 == 1)
    _compare(PACKED64, world, rank, "hybrid", mesh=mesh, causal=False)


def test_hybrid_2x2_equals_full_attention():
    run(_hybrid, 4, [PACKED64, (2, 2, 2, 37, [[10, 20], [37]]), GQA, SINGLE])


def _heads_refused(rank, world):
    q = torch.zeros(1, 3, 4, D)
    docs = CPDocuments.from_full(torch.zeros(1, 8, dtype=torch.long), world)
    with pytest.raises(ValueError, match=r"over 2 ranks shards 3 attention heads and 3 KV"):
        cp_attention(q, q, q, docs=docs, method="ulysses")
    q = torch.zeros(1, 6, 4, D)
    with pytest.raises(ValueError, match=r"over 2 ranks shards 6 attention heads and 3 KV"):
        cp_attention(q, q[:, :3], q[:, :3], docs=docs, method="ulysses")


def test_ulysses_refuses_heads_that_do_not_divide():
    run(_heads_refused, 2, timeout=120)   # seconds alone; under a loaded suite, more


# ------------------------------------------------------------------ blocks skipped

def _brute_kind(docs, qc, kc, m, causal):
    allowed = _allowed(docs, causal)
    block = allowed[:, qc * m:(qc + 1) * m, kc * m:(kc + 1) * m]
    if not block.any():
        return None, block
    if block.all():
        return FULL, block
    if qc == kc and torch.equal(block, torch.ones(m, m, dtype=torch.bool).tril().expand_as(block)):
        return CAUSAL, block
    return MASKED, block


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case,size", [(SINGLE, 2), (SINGLE, 4), (PACKED, 2), (PACKED64, 4),
                                       (ODD, 4), (GQA, 2)])
def test_ring_blocks_are_exactly_the_nonempty_ones(case, size, causal):
    _, _, _, _, docs, _ = _case(*case)
    full = CPDocuments.from_full(docs, size)
    m = full.length // (2 * size)
    for rank in range(size):
        steps = full.ring_blocks(size, rank, torch.device("cpu"), torch.float32, causal)
        mine = (rank, 2 * size - 1 - rank)
        for s, blocks in enumerate(steps):
            src = (rank - s) % size
            theirs = (src, 2 * size - 1 - src)
            got = {(b.q, b.kv): b for b in blocks}
            for a, qc in enumerate(mine):
                for b, kc in enumerate(theirs):
                    kind, block = _brute_kind(full.docs, qc, kc, m, causal)
                    if kind is None:
                        assert (a, b) not in got, f"empty block {qc}x{kc} computed"
                        continue
                    blk = got[(a, b)]
                    # A causal diagonal inside one document may also run as a masked one
                    # (never the reverse); everything else must match exactly.
                    assert blk.kind == kind or (kind == CAUSAL and blk.kind == MASKED), \
                        f"block {qc}x{kc}: {blk.kind}, not {kind}"
                    if blk.kind == MASKED:
                        # A row without keys sees every key in the kernel (dropped
                        # after): no row of -inf reaches it.
                        empty = ~block.any(-1)
                        assert torch.equal(blk.bias[:, 0] == 0, block | empty[..., None])
                        assert torch.equal(blk.empty_rows[:, 0], empty)
                    else:
                        assert blk.bias is None and blk.empty_rows is None
    if case is SINGLE and causal:
        # One causal document: rank r computes 2c + 1 of its 4c blocks, two of them the
        # causal diagonals and none masked (the load balance of the layout).
        for rank in range(size):
            kinds = [b.kind for blocks in full.ring_blocks(size, rank, torch.device("cpu"),
                                                            torch.float32) for b in blocks]
            assert len(kinds) == 2 * size + 1 and kinds.count(CAUSAL) == 2 \
                and MASKED not in kinds


def _count_calls(rank, world, case, out_dir):
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = cp._block_forward, cp._block_backward

    def counting_forward(*args):
        calls["forward"] += 1
        return fwd(*args)

    def counting_backward(*args):
        calls["backward"] += 1
        return bwd(*args)

    cp._block_forward, cp._block_backward = counting_forward, counting_backward
    sent, received = [], []
    send, recv = P2P.send, P2P.recv

    def recording_send(self, peer, tensors, label):
        sent.append([peer, label])
        return send(self, peer, tensors, label)

    def recording_recv(self, peer, specs, label):
        received.append([peer, label])
        return recv(self, peer, specs, label)

    P2P.send, P2P.recv = recording_send, recording_recv
    try:
        _compare(case, world, rank, "ring")
    finally:
        cp._block_forward, cp._block_backward = fwd, bwd
        P2P.send, P2P.recv = send, recv
    _, _, _, _, docs, _ = _case(*case)
    planned = sum(len(blocks) for blocks in CPDocuments.from_full(docs, world).ring_blocks(
        world, rank, torch.device("cpu"), torch.float32))
    assert calls == {"forward": planned, "backward": planned}, (calls, planned)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"sent": sent, "received": received, "calls": calls}, f)


@pytest.mark.parametrize("world,case", [(2, SINGLE), (4, SINGLE), (4, PACKED64)])
def test_ring_skips_empty_blocks_and_matches_messages_in_order(world, case, tmp_path):
    run(_count_calls, world, case, str(tmp_path))
    logs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    if case is SINGLE:
        # Half the blocks are causally empty and never run.
        assert all(log["calls"]["forward"] == 2 * world + 1 for log in logs)
    for a in range(world):
        for b in range(world):
            sent = [label for peer, label in logs[a]["sent"] if peer == b]
            got = [label for peer, label in logs[b]["received"] if peer == a]
            # Everything rank a sends rank b is received there, in the same order.
            assert sent == got, (a, b, sent, got)
            # Ring: only to the next rank; K/V c-1 times each way, dK/dV c times.
            if b == (a + 1) % world:
                assert len(sent) == 2 * (world - 1) + world
            elif world > 2 or a == b:
                assert not sent


# ------------------------------------------------------------------ layout

def test_shard_and_unshard_round_trip_with_padding():
    x = torch.arange(2 * 37).reshape(2, 37)
    for size in (1, 2, 4):
        parts = [shard(x, size, r) for r in range(size)]
        assert all(p.shape == (2, padded_length(37, size) // size) for p in parts)
        assert torch.equal(unshard(parts, 37), x)
    # Rank 1 of 2 on 8 positions: chunks 1 and 2 of 4.
    assert shard_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_index(8, 4, 0).tolist() == [0, 7]
    docs, positions = _docs([[3, 2]], 5)
    d, p = shard_documents(docs, positions, 2, 1)   # padded to 8: chunks 1, 2
    assert d.tolist() == [[0, 1, 1, 2]] and p.tolist() == [[2, 0, 1, 0]]


def test_documents_must_not_decrease():
    with pytest.raises(ValueError, match="decrease"):
        CPDocuments.from_full(torch.tensor([[0, 0, 1, 0]]), 2)
    with pytest.raises(ValueError, match="not one of"):
        cp_attention(torch.zeros(1, 1, 2, D), torch.zeros(1, 1, 2, D), torch.zeros(1, 1, 2, D),
                     docs=CPDocuments.from_full(torch.zeros(1, 4, dtype=torch.long), 2),
                     method="rings")


@pytest.mark.parametrize("causal", [True, False])
def test_accelerator_kernels_take_the_blocks_on_meta_tensors(causal):
    # Off the CPU each block runs torch's memory-efficient kernel (K/V heads repeated, the
    # mask per head and 16-aligned); its meta functions check the calls' arguments and
    # give the shapes, with no GPU. Masked, causal and full blocks of a one-rank ring.
    docs = CPDocuments.from_full(torch.tensor([[0] * 5 + [1] * 11]), 1)
    meta = {"device": "meta", "dtype": torch.bfloat16, "requires_grad": True}
    q, k, v = torch.randn(1, 4, 16, D, **meta), torch.randn(1, 2, 16, D, **meta), \
        torch.randn(1, 2, 16, D, **meta)
    steps = docs.ring_blocks(1, 0, q.device, q.dtype, causal)
    assert {b.kind for b in steps[0]} == ({MASKED, CAUSAL} if causal else {MASKED, FULL})
    masked = next(b for b in steps[0] if b.kind == MASKED)
    assert masked.bias.stride(-2) % 16 == 0 and masked.bias.shape[-2:] == (8, 8)
    out = cp._Ring.apply(q, k, v, steps, cp._RingGroup(None, 1, 0, -1, -1), D ** -0.5)
    out.sum().backward()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    assert k.grad.dtype == torch.bfloat16


def _gather(rank, world):
    from dtdsl.parallel.cp import CPGroup, gather_sequence

    group = dist.new_group(list(range(world)))
    g = CPGroup(method="ring", size=world, rank=rank, group=group)
    torch.manual_seed(0)
    length = 11                                 # padded to 2 * world chunks
    whole = torch.randn(2, length, 3, dtype=torch.float64)
    ups = [torch.randn(2, length, 3, dtype=torch.float64) for _ in range(world)]
    x = g.shard(whole).requires_grad_(True)
    got = gather_sequence(x, g, length)
    assert torch.equal(got, whole)
    # Each rank's loss reads the whole; a shard's gradient sums every rank's.
    (got * ups[rank]).sum().backward()
    want = g.shard(sum(ups))
    assert torch.allclose(x.grad, want), (x.grad - want).abs().max()


@pytest.mark.parametrize("world", [2, 3])
def test_gather_sequence_is_unshard_and_its_gradient_sums_the_ranks(world):
    run(_gather, world)


def _single(rank, world):
    # One document without padding: plain causal attention, the same values as the ring.
    case = (1, 4, 2, 16, [[16]], 3)
    docs = _case(*case)[4]
    assert CPDocuments.from_full(docs, world).single
    assert not CPDocuments.from_full(docs[:, :15], world).single     # padded: a 2nd doc
    _compare(case, world, rank, "ulysses")
    _compare(case, world, rank, "ulysses", full_docs=True)


def test_ulysses_on_one_document_without_padding():
    run(_single, 2)


def test_bidirectional_rows_sharing_documents_keep_no_mask():
    """Ulysses' attention on the whole sequence (``cp._attend`` after the all-to-all; one
    process, so none) of clips padded to whole chunks: each document's dense attention
    gives what the ring's blocks on a ring of one rank gave (values and gradients within
    1e-5), and keeps for backward what attention needs (Q, K, V, the output and its
    log-sum-exp), not the blocks' additive masks: [B, 1, m, m] for each of the three
    blocks the padding crosses, 1.5 MB here against 0.3 MB."""
    from dtdsl.train.memcheck import measure_peak

    b, h, length, n = 2, 2, 509, 512          # 3 positions of padding
    docs = CPDocuments.from_full(torch.zeros(b, length, dtype=torch.long), 2)
    assert docs.length == n and docs.shared_spans == [(0, length), (length, n - length)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, D, generator=g) for _ in range(4))

    def span(q, k, v):
        return cp._attend(q, k, v, docs, None, None, 1, causal=False)

    def ring(q, k, v):
        steps = docs.ring_blocks(1, 0, q.device, q.dtype, False)
        return cp._Ring.apply(q, k, v, steps, cp._RingGroup(None, 1, 0, -1, -1), D ** -0.5)

    results = []
    for attend in (span, ring):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        out.backward(dout)
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, new, old in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert (new - old).abs().max().item() < TOL, name

    def held(attend) -> int:
        """The bytes one call keeps until its backward (its graph held across it)."""
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        kept = []
        report = measure_peak(lambda: kept.append(attend(*leaves)), track=leaves,
                              allocation_granularity_bytes=1)
        return report.peak_bytes - sum(x.numel() * 4 for x in leaves)

    docs._blocks.clear()
    need = 2 * q.numel() * 4 + b * h * n * 4      # the output and its own copy, lse
    assert held(span) <= 1.5 * need
    assert held(ring) > 3 * b * (n // 2) ** 2 * 4   # three masks of m = n / 2


@pytest.mark.parametrize("device, dtype, tol", [
    ("cpu", torch.float32, 1e-4),
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_ring_blocks_merge_to_document_causal_attention(device, dtype, tol):
    """One rank's ring blocks (``_ring_blocks`` at ring size 1: chunks of 40 positions,
    two documents, the second from position 60, so chunk 1's queries over chunk 0's keys
    are a MASKED block whose rows 60..79 have no key) through the per-block kernels,
    forward and backward (on CUDA the memory-efficient kernel with its log-sum-exp, GQA
    repeated, masks padded to 16, lse tiles of 32), merged by ``_merge`` and summed, equal
    dense document-causal attention in fp32. Tolerances: fp32 kernels against the dense
    one on the CPU; bf16 against fp32 on CUDA, relative to each tensor's largest entry.
    On an H200 a row of -inf in the block's mask made the backward NaN."""
    torch.manual_seed(7)
    dev, m, d = torch.device(device), 40, 64
    q = torch.randn(2, 4, 2 * m, d, device=dev)
    k, v = torch.randn(2, 2, 2 * m, d, device=dev), torch.randn(2, 2, 2 * m, d, device=dev)
    dout = torch.randn(2, 4, 2 * m, d, device=dev)
    docs = (torch.arange(2 * m) >= 60).long()
    pos = torch.arange(2 * m)
    allowed = (docs[:, None] == docs[None, :]) & (pos[None, :] <= pos[:, None])   # [L, L]
    scale = d ** -0.5

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1),
        attn_mask=allowed.to(dev), scale=scale)
    want.backward(dout)

    (blocks,) = cp._ring_blocks(docs[None].expand(2, -1), 1, 0, True, dev, dtype)
    assert [(b.q, b.kv, b.kind) for b in blocks] == [(0, 0, cp.CAUSAL), (1, 0, cp.MASKED),
                                                    (1, 1, cp.MASKED)]
    assert blocks[1].empty_rows is not None and int(blocks[1].empty_rows.sum()) == 2 * 20
    qs, ks, vs = ([x[:, :, i * m:(i + 1) * m].to(dtype) for i in (0, 1)] for x in (q, k, v))
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in blocks:
        merged[b.q] = cp._merge(merged.get(b.q), *cp._block_forward(qs[b.q], ks[b.kv],
                                                                    vs[b.kv], b, scale))
    out = torch.cat([merged[i][0] for i in (0, 1)], dim=2)
    dq = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
    dk = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dv = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    douts = [dout[:, :, i * m:(i + 1) * m].to(dtype) for i in (0, 1)]
    for b in blocks:
        o, lse = merged[b.q]
        gq, gk, gv = cp._block_backward(douts[b.q], qs[b.q], ks[b.kv], vs[b.kv],
                                        o.to(dtype), lse, b, scale)
        dq[b.q] += gq.float()
        dk[b.kv] += gk.float()
        dv[b.kv] += gv.float()
    for name, got, expect in (("out", out, want), ("dq", torch.cat(dq, 2), ref[0].grad),
                              ("dk", torch.cat(dk, 2), ref[1].grad),
                              ("dv", torch.cat(dv, 2), ref[2].grad)):
        err = (got.float() - expect).abs().max()
        assert err <= tol * expect.abs().max(), (name, float(err))


def test_out_reaches_the_cuda_backward_in_its_forward_layout():
    """``_in_kernel_layout`` (meta tensors stand in for CUDA ones): a [B, H, S, D] chunk is
    copied so its rows are H * D apart, a chunk of an already laid-out ``out`` is the
    same view, not a copy."""
    b, h, s, d = 2, 4, 80, 64
    plain = torch.empty(b, h, s, d, device="meta")
    got = cp._in_kernel_layout(cp._chunk(plain, 1, s // 2))
    assert got.shape == (b, h, s // 2, d)
    assert (got.stride(2), got.stride(3)) == (h * d, 1)
    laid = cp._in_kernel_layout(plain)
    chunk = cp._chunk(laid, 1, s // 2)
    assert cp._in_kernel_layout(chunk) is chunk
