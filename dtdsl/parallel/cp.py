"""Context parallelism for attention: ring, Ulysses and both (USP), with document masks.

**Layout.** A (packed) sequence of ``L`` positions is padded to ``L'``, a multiple of
``2c``, and cut into ``2c`` chunks of ``n = L'/2c``; CP rank ``r`` of ``c`` holds chunks
``r`` and ``2c-1-r``, in that order (the load-balanced causal sharding of torch's
``context_parallel`` and Megatron-LM: every rank gets as many causal score blocks as any
other). ``shard``/``unshard`` move tensors between the full sequence and a rank's shard;
``shard_documents`` does the per-position document ids and positions. **Padding** (``L'
- L`` positions at the end) is one more document of its own, as ``models.attention``
treats the padding after the documents: real positions never attend to it, its rows
attend to themselves (no empty row, no NaN), and ``unshard`` drops its outputs. Its
values are zeros; a loss that reads only the first ``L`` outputs gives it no gradient.

**Masks.** Document ids ``[B, L']`` never decrease along a sequence (``document_ids``
makes them so; ``CPDocuments`` checks): a query attends to the keys of its own document
at or before it. The mask of every (query chunk, key chunk) block is known on the host
from the ids and the layout alone: *empty* (skipped: causally after the queries, or every
key in an earlier document), *full* (every key earlier and in every query's document: no
mask), *causal* (a diagonal block inside one document: the kernel's own causal flag) or
*masked* (a document boundary inside: an additive mask, built once on the host and copied
to the device). ``CPDocuments`` caches the blocks per (ring size, rank, device, dtype),
so the model builds it once per microbatch and every layer reuses them.

**Ring** (``_Ring``, a ``torch.autograd.Function``): K and V travel around the ring group
(rank ``i`` sends to ``i+1``) over ``parallel.p2p.P2P`` (``batch_isend_irecv``; the next
block's transfer is posted before the current block is computed); every block is one fused
SDPA call that returns the log-sum-exp (CPU: ``_scaled_dot_product_flash_attention_for_cpu``,
which takes grouped K/V as they are; CUDA: ``_scaled_dot_product_efficient_attention``,
whose K/V heads are repeated per block and their gradients summed back), and the partial
outputs of a query chunk are merged by log-sum-exp in float32. The backward recomputes each
block with the *global* output and log-sum-exp (as FlashAttention's backward does), so a
block's gradients are exactly its share; dK/dV accumulators travel with K/V and reach
their owner after the last step. Every rank sends to its next and receives from its
previous rank in the same order, so NCCL's in-order matching pairs every message (the
tests run with the P2P ordering check on).

**Ulysses**: an all-to-all (``torch.distributed.nn.functional.all_to_all_single``,
differentiable) turns sequence shards into head shards: each rank gets ``H/c`` heads of the
whole sequence, runs ``models.attention.document_attention`` on it (bidirectional, on rows
that share their documents, as an encoder group's do: each document's dense attention,
``_span_attention``, with no mask at all), and a second all-to-all gives the sequence
shards back. The heads must divide by ``c``; KV heads too,
or, when fewer than ``c``, divide ``c``: then each is repeated ``c / H_kv`` times before the
exchange (as Megatron-LM does) and autograd sums the copies' gradients.

**Hybrid** (USP): a ``DeviceMesh`` with dims ``("cp_ring", "cp_ulysses")`` of shape
``(R, U)``; CP rank ``i*U + j`` (``cp_rank``) holds the layout's shard for ``c = R*U``.
The Ulysses all-to-all inside the ``U`` ranks of ring index ``i`` gathers chunks
``iU .. iU+U-1`` and their mirrors: exactly ring rank ``i``'s shard of the layout for ``R``
ranks (chunks ``U`` times longer), so the ring then runs over ``R`` ranks on ``H/U`` heads.
Plain ring and plain Ulysses are the cases ``U = 1`` and ``R = 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtdsl.models.attention import (
    DocumentMask,
    dense_attention,
    document_attention,
    document_mask,
)
from dtdsl.parallel.p2p import P2P, spec_of

__all__ = ["CAUSAL", "EMPTY", "FULL", "MASKED", "MESH_DIMS", "METHODS", "Block", "CPContext",
           "CPDocuments", "CPGroup", "cp_attention", "cp_rank", "gather_sequence",
           "padded_length", "shard", "shard_documents", "shard_index", "unshard"]

METHODS = ("ring", "ulysses", "hybrid")
MESH_DIMS = ("cp_ring", "cp_ulysses")

EMPTY, FULL, CAUSAL, MASKED = "empty", "full", "causal", "masked"


# ---------------------------------------------------------------------------- layout

def padded_length(length: int, size: int) -> int:
    """``length`` rounded up to a multiple of ``2 * size`` (whole chunks)."""
    if size < 1 or length < 1:
        raise ValueError(f"a sequence of {length} positions over {size} CP ranks: both must "
                         "be at least 1")
    return -(-length // (2 * size)) * (2 * size)


def _chunk_index(chunks: Sequence[int], n: int) -> torch.Tensor:
    """The positions of ``chunks`` (of ``n`` positions each), in that order."""
    return (torch.tensor(chunks, dtype=torch.int64)[:, None] * n
            + torch.arange(n, dtype=torch.int64)).reshape(-1)


def shard_index(length: int, size: int, rank: int) -> torch.Tensor:
    """The positions of the padded sequence (``padded_length``) that CP rank ``rank`` of
    ``size`` holds, in its local order: chunk ``rank``, then chunk ``2*size-1-rank``."""
    if not 0 <= rank < size:
        raise ValueError(f"CP rank {rank} is outside 0..{size - 1}")
    n = padded_length(length, size) // (2 * size)
    return _chunk_index([rank, 2 * size - 1 - rank], n)


def _pad(x: torch.Tensor, dim: int, to: int, value: float = 0) -> torch.Tensor:
    extra = to - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shard(x: torch.Tensor, size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``rank``'s shard of ``x`` along its sequence dimension ``dim``, padded with
    zeros to whole chunks first (module docstring)."""
    length = x.shape[dim]
    index = shard_index(length, size, rank).to(x.device)
    return _pad(x, dim, padded_length(length, size)).index_select(dim, index)


def unshard(shards: Sequence[torch.Tensor], length: int, dim: int = 1) -> torch.Tensor:
    """The full sequence of ``length`` positions from every CP rank's shard (in rank
    order) along ``dim``: the inverse of ``shard``, padding dropped."""
    size = len(shards)
    order = torch.cat([shard_index(length, size, r) for r in range(size)])
    whole = torch.cat(list(shards), dim=dim)
    if whole.shape[dim] != order.numel():
        raise ValueError(f"{size} shards of {whole.shape[dim]} positions in all do not hold "
                         f"a sequence of {length} ({order.numel()} once padded)")
    return whole.index_select(dim, torch.argsort(order).to(whole.device)).narrow(dim, 0, length)


def _check_documents(docs: torch.Tensor) -> None:
    if docs.dim() != 2 or docs.dtype.is_floating_point or docs.dtype == torch.bool:
        raise ValueError(f"document ids must be an integer tensor [batch, sequence], not "
                         f"{docs.dtype} {tuple(docs.shape)}")
    if docs.shape[1] > 1 and bool((docs[:, 1:] < docs[:, :-1]).any()):
        raise ValueError("document ids decrease along a sequence: number the documents of "
                         "a packed sequence in order (models.attention.document_ids does)")


def _pad_documents(docs: torch.Tensor, to: int) -> torch.Tensor:
    """``docs`` padded to ``to`` positions with one more document per sequence."""
    extra = to - docs.shape[1]
    if extra == 0:
        return docs
    pad = (docs[:, -1:] + 1).expand(-1, extra)
    return torch.cat([docs, pad], dim=1)


def shard_documents(docs: torch.Tensor, positions: torch.Tensor, size: int, rank: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """CP rank ``rank``'s shard of the document ids and positions ``[B, L]`` of packed
    sequences: the padding is one more document whose positions count from 0."""
    _check_documents(docs)
    if positions.shape != docs.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and document ids "
                         f"{tuple(docs.shape)} differ in shape")
    length = docs.shape[1]
    full = padded_length(length, size)
    pos = torch.cat([positions, torch.arange(full - length, dtype=positions.dtype,
                                             device=positions.device)
                     .expand(positions.shape[0], -1)], dim=1)
    index = shard_index(length, size, rank).to(docs.device)
    return _pad_documents(docs, full).index_select(1, index), pos.index_select(1, index)


def cp_rank(mesh: Any) -> int:
    """This rank's CP rank on a ``("cp_ring", "cp_ulysses")`` mesh: which shard of the
    layout (for ``c = R*U`` ranks) it holds."""
    return mesh.get_local_rank(MESH_DIMS[0]) * mesh.size(1) + mesh.get_local_rank(MESH_DIMS[1])


# ---------------------------------------------------------------------------- blocks

@dataclass(frozen=True, eq=False)
class Block:
    """One (query chunk, key chunk) block of a ring step: ``q`` and ``kv`` are which of the
    two local chunks (0 or 1), ``kind`` FULL, CAUSAL or MASKED; a MASKED block has its
    additive mask ``[B, 1, m, m]`` (on the device, in the queries' dtype) and the rows it
    leaves without any key ``[B, 1, m]`` (their partial result is dropped; the mask lets
    them see every key, so that the kernels never meet a row of -inf)."""

    q: int
    kv: int
    kind: str
    bias: torch.Tensor | None = None
    empty_rows: torch.Tensor | None = None


def _classify(docs: torch.Tensor, qc: int, kc: int, m: int, causal: bool
              ) -> tuple[str, torch.Tensor | None]:
    """The kind of the block of query chunk ``qc`` over key chunk ``kc`` (chunks of ``m``
    positions of ``docs [B, L']``, host) and, when MASKED, its boolean mask ``[B, m, m]``."""
    if causal and kc > qc:
        return EMPTY, None
    q0, q1, k0, k1 = qc * m, qc * m + m - 1, kc * m, kc * m + m - 1
    if kc != qc:
        # Ids never decrease: the earlier chunk's last position is in an earlier document
        # than the later chunk's first (empty), or the earlier chunk's first and the later
        # chunk's last share one document (full).
        (a0, a1), (b0, b1) = sorted([(q0, q1), (k0, k1)])
        if bool((docs[:, a1] < docs[:, b0]).all()):
            return EMPTY, None
        if bool((docs[:, a0] == docs[:, b1]).all()):
            return FULL, None
    elif bool((docs[:, q0] == docs[:, q1]).all()):
        return (CAUSAL if causal else FULL), None
    qd, kd = docs[:, q0:q1 + 1], docs[:, k0:k1 + 1]
    allowed = qd[:, :, None] == kd[:, None, :]
    if causal and kc == qc:
        allowed &= torch.ones(m, m, dtype=torch.bool).tril()
    if not bool(allowed.any()):
        return EMPTY, None
    if bool(allowed.all()):
        return FULL, None
    return MASKED, allowed


def _bias(allowed: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A block's boolean mask ``[B, m, m]`` as the additive mask ``[B, 1, m, m]`` the
    kernels take (0 or -inf, in the queries' dtype). For the memory-efficient CUDA kernel
    its rows start 16-element aligned (padded, then viewed back, as SDPA's own path
    does)."""
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    m = bias.shape[-1]
    if device.type != "cpu":
        bias = F.pad(bias, (0, -(-m // 16) * 16 - m))
    return bias[:, None].to(device)[..., :m]


def _ring_blocks(docs: torch.Tensor, size: int, rank: int, causal: bool,
                 device: torch.device, dtype: torch.dtype) -> tuple[tuple[Block, ...], ...]:
    """For each ring step ``s`` (K/V of ring rank ``rank - s``), the blocks to compute."""
    m = docs.shape[1] // (2 * size)
    mine = (rank, 2 * size - 1 - rank)
    steps = []
    for s in range(size):
        src = (rank - s) % size
        theirs = (src, 2 * size - 1 - src)         # the visiting K/V's chunks
        blocks = []
        for a, qc in enumerate(mine):
            for b, kc in enumerate(theirs):
                kind, allowed = _classify(docs, qc, kc, m, causal)
                if kind == EMPTY:
                    continue
                bias = rows = None
                if kind == MASKED:
                    # A row with no key here attends to every key in the kernels (no row
                    # of -inf reaches them: CUDA's memory-efficient backward returned NaN
                    # for one); its result is dropped (``empty_rows``).
                    empty = ~allowed.any(-1)
                    bias = _bias(allowed | empty[..., None], device, dtype)
                    rows = empty[:, None].to(device)
                blocks.append(Block(q=a, kv=b, kind=kind, bias=bias, empty_rows=rows))
        steps.append(tuple(blocks))
    return tuple(steps)


def _faked(block: Block, mode: Any) -> Block:
    """``block`` with its mask tensors as ``mode``'s fake tensors."""
    if block.bias is None:
        return block
    return Block(q=block.q, kv=block.kv, kind=block.kind, bias=mode.from_tensor(block.bias),
                 empty_rows=mode.from_tensor(block.empty_rows))


@dataclass(eq=False)
class CPDocuments:
    """The document ids of whole packed sequences ``[B, L']`` on the host (padded to whole
    chunks), with the ring blocks derived from them, cached per layout and device: build
    it once per microbatch (``from_full`` from the ids every rank has, or ``gather`` from
    the local shards) and pass it to every layer's ``cp_attention``."""

    docs: torch.Tensor
    _blocks: dict[tuple[Any, ...], tuple[tuple[Block, ...], ...]] = field(
        default_factory=dict, repr=False)
    _masks: dict[torch.device, DocumentMask] = field(default_factory=dict, repr=False)

    _single: bool = field(default=False, init=False, repr=False)
    _shared: list[tuple[int, int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.docs = self.docs.detach().to("cpu", torch.int64)
        _check_documents(self.docs)
        self._single = bool((self.docs == 0).all())
        if bool((self.docs == self.docs[:1]).all()):
            self._shared = self.spans()[0]

    @classmethod
    def from_full(cls, docs: torch.Tensor, size: int) -> CPDocuments:
        """From the ids of the whole sequences ``[B, L]``, padded for ``size`` CP ranks."""
        _check_documents(docs)
        return cls(_pad_documents(docs.cpu(), padded_length(docs.shape[1], size)))

    @classmethod
    def gather(cls, local: torch.Tensor, groups: Sequence[dist.ProcessGroup | None],
               device: torch.device) -> CPDocuments:
        """From this rank's shard of the ids ``[B, n2]``: all-gathered over ``groups``
        (innermost first: the CP ranks in ``cp_rank`` order), on ``device`` (the groups'
        backend's), then copied to the host (a wait for the device)."""
        parts = local.to(device, torch.int64)[None]
        for group in groups:
            size = dist.get_world_size(group)
            out = torch.empty((size * parts.shape[0], *parts.shape[1:]), dtype=parts.dtype,
                              device=device)
            dist.all_gather_into_tensor(out, parts.contiguous(), group=group)
            parts = out
        shards = list(parts.cpu().unbind(0))
        full = shards[0].shape[1] * len(shards)
        return cls(unshard(shards, full, dim=1))

    @property
    def length(self) -> int:
        return self.docs.shape[1]

    @property
    def single(self) -> bool:
        """Whether every sequence is one document, without padding: plain causal
        attention."""
        return self._single

    @property
    def shared_spans(self) -> list[tuple[int, int]] | None:
        """The documents as ``(first position, length)`` runs when every sequence has the
        same ones (an encoder group's rows: one image or clip each, then the padding to
        whole chunks), else None."""
        return self._shared

    def ring_blocks(self, size: int, rank: int, device: torch.device, dtype: torch.dtype,
                    causal: bool = True) -> tuple[tuple[Block, ...], ...]:
        """The blocks of every ring step of ring rank ``rank`` of ``size`` (cached);
        ``causal``: a query sees its document's keys at or before it, else all of them."""
        if self.length % (2 * size):
            raise ValueError(f"a sequence of {self.length} positions is not whole chunks "
                             f"for {size} ring ranks: pad it (CPDocuments.from_full)")
        key = (size, rank, causal, torch.device(device), dtype)
        if key not in self._blocks:
            from torch._guards import detect_fake_mode
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            # Host work on the real ids, also inside ``dtc memcheck``'s fake world; there
            # the masked blocks' masks then become fake tensors, as the kernels' other
            # inputs are (a padded encoder row, a document boundary inside a chunk).
            mode = detect_fake_mode()
            with unset_fake_temporarily():
                steps = _ring_blocks(self.docs, size, rank, causal, torch.device(device),
                                     dtype)
            if mode is not None:
                steps = tuple(tuple(_faked(b, mode) for b in step) for step in steps)
            self._blocks[key] = steps
        return self._blocks[key]

    def document_mask(self, device: torch.device) -> DocumentMask:
        """The whole sequences' ``models.attention.DocumentMask`` on ``device`` (cached)."""
        device = torch.device(device)
        if device not in self._masks:
            self._masks[device] = document_mask(self.spans(), self.length, device)[1]
        return self._masks[device]

    def spans(self) -> list[list[tuple[int, int]]]:
        """Each sequence's documents as ``(first position, length)`` runs."""
        out = []
        for row in self.docs:
            change = torch.nonzero(row[1:] != row[:-1]).reshape(-1) + 1
            starts = [0, *change.tolist()]
            ends = [*starts[1:], row.numel()]
            out.append([(a, b - a) for a, b in zip(starts, ends, strict=True)])
        return out


# ---------------------------------------------------------------------------- one block

def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse [B, H, m] float32)`` of ``q`` over one block of keys; rows the mask
    leaves without keys get out 0 and lse -inf (the kernels report lse 0 there)."""
    causal = block.kind == CAUSAL
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=block.bias, scale=scale)
    else:
        groups = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat(k, groups), _repeat(v, groups), _per_head(block.bias, q.shape[1]),
            True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]
    lse = lse.float()
    if block.empty_rows is not None:
        out = out.masked_fill(block.empty_rows[..., None], 0)
        lse = lse.masked_fill(block.empty_rows, float("-inf"))
    return out, lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, block: Block, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of ``(dq, dk, dv)``, from the GLOBAL ``out`` and ``lse``. Its
    empty rows contribute nothing: their ``dout`` is zeroed and their lse made +inf, so
    the kernels' probabilities there are exactly 0 whatever the scores."""
    causal = block.kind == CAUSAL
    if block.empty_rows is not None:
        dout = dout.masked_fill(block.empty_rows[..., None], 0)
        lse = lse.masked_fill(block.empty_rows, float("inf"))
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=block.bias, scale=scale)
    groups = q.shape[1] // k.shape[1]
    m = q.shape[2]
    # The kernel's log-sum-exp rows come in whole tiles of 32.
    lse = F.pad(lse, (0, -(-m // 32) * 32 - m))
    out = _in_kernel_layout(out)
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat(k, groups), _repeat(v, groups), _per_head(block.bias, q.shape[1]),
        out, lse, empty, empty, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _reduce(dk, groups), _reduce(dv, groups)


def _in_kernel_layout(out: torch.Tensor) -> torch.Tensor:
    """``out [B, H, M, D]`` as CUDA's memory-efficient backward reads it: in the layout its
    forward writes, [B, M, H, D] in memory. It takes the batch and head strides from the
    tensor but computes the row stride as H * D (``o_strideM`` in torch's
    mem_eff_attention/kernel_backward.h), so a [B, H, S, D] chunk would be read at the
    wrong rows. A copy only where the layout differs (the CPU kernel takes any)."""
    if out.device.type == "cpu" or (out.stride(2) == out.shape[1] * out.shape[3]
                                    and out.stride(3) == 1):
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: each KV head's copies summed."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.reshape(b, h // groups, groups, s, d).sum(2)


def _per_head(bias: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The mask as the memory-efficient kernel reads it: one per head (a broadcast view)."""
    return None if bias is None else bias.expand(bias.shape[0], heads, *bias.shape[2:])


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
           lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys as one, by log-sum-exp (float32)."""
    out = out.float()
    if acc is None:
        return out, lse
    a_out, a_lse = acc
    new = torch.logaddexp(a_lse, lse)
    # A row with no key in either part yet: -inf - -inf is NaN, its weight 0.
    wa = torch.exp(a_lse - new).nan_to_num_(0.0)[..., None]
    wb = torch.exp(lse - new).nan_to_num_(0.0)[..., None]
    return a_out * wa + out * wb, new


# ---------------------------------------------------------------------------- ring

@dataclass(frozen=True, eq=False)
class _RingGroup:
    """A ring's process group, this rank's place in it and its neighbours' global ranks."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    next: int
    prev: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> _RingGroup:
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        size, rank = len(ranks), dist.get_rank(group)
        return cls(group, size, rank, ranks[(rank + 1) % size], ranks[(rank - 1) % size])


def _chunk(x: torch.Tensor, i: int, m: int) -> torch.Tensor:
    return x[:, :, i * m:(i + 1) * m]


def _p2p(q: torch.Tensor, ring: _RingGroup) -> P2P:
    """The ring's channel; in ``dtc memcheck``'s fake world (fake tensors, a fake group
    that moves nothing) without the ordering check, whose descriptors are real data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return P2P(q.device, group=ring.group, check=False if isinstance(q, FakeTensor) else None)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  steps: tuple[tuple[Block, ...], ...], ring: _RingGroup, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    m = q.shape[2] // 2
    p2p = _p2p(q, ring)
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    kv = (k, v)
    specs = [spec_of(k), spec_of(v)]
    for s, blocks in enumerate(steps):
        src = (ring.rank - s) % ring.size
        incoming = None
        if s + 1 < ring.size:
            # Post the next block's K/V before computing this one's.
            p2p.send(ring.next, kv, f"cp.ring F{s} kv{src}")
            incoming = p2p.recv(ring.prev, specs, f"cp.ring F{s} kv{(src - 1) % ring.size}")
            p2p.flush()
        for blk in blocks:
            out, lse = _block_forward(_chunk(q, blk.q, m), _chunk(kv[0], blk.kv, m),
                                      _chunk(kv[1], blk.kv, m), blk, scale)
            acc[blk.q] = _merge(acc[blk.q], out, lse)
        if incoming is not None:
            kv = tuple(incoming.wait())
    p2p.wait_sends()
    # Every query chunk has its diagonal block at step 0: acc is never None here.
    out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
    lse = torch.cat([a[1] for a in acc], dim=2)
    return out, lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor,
                   steps: tuple[tuple[Block, ...], ...], ring: _RingGroup, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = q.shape[2] // 2
    p2p = _p2p(q, ring)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    specs = [spec_of(k), spec_of(v)]
    grad_specs = [spec_of(k.float()), spec_of(v.float())]
    dout = dout.contiguous()
    out = _in_kernel_layout(out)    # once: every block's chunk of it is then a view
    pending = None          # the dK/dV accumulator on its way from the previous rank
    for s, blocks in enumerate(steps):
        src = (ring.rank - s) % ring.size
        incoming = None
        if s + 1 < ring.size:
            p2p.send(ring.next, kv, f"cp.ring B{s} kv{src}")
            incoming = p2p.recv(ring.prev, specs, f"cp.ring B{s} kv{(src - 1) % ring.size}")
            p2p.flush()
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for blk in blocks:
            g = _block_backward(_chunk(dout, blk.q, m), _chunk(q, blk.q, m),
                                _chunk(kv[0], blk.kv, m), _chunk(kv[1], blk.kv, m),
                                _chunk(out, blk.q, m), _chunk(lse, blk.q, m),
                                blk, scale)
            _chunk(dq, blk.q, m).add_(g[0])
            _chunk(dk, blk.kv, m).add_(g[1])
            _chunk(dv, blk.kv, m).add_(g[2])
        if pending is not None:
            got = pending.wait()
            dk += got[0]
            dv += got[1]
        if ring.size > 1:
            # The accumulator of K/V ``src`` moves on with them; the last step's
            # (``src = rank + 1``) goes to its owner, and this rank's comes in.
            p2p.send(ring.next, [dk, dv], f"cp.ring B{s} dkv{src}")
            pending = p2p.recv(ring.prev, grad_specs,
                               f"cp.ring B{s} dkv{(src - 1) % ring.size}")
            p2p.flush()
        if incoming is not None:
            kv = tuple(incoming.wait())
    mine = pending.wait() if pending is not None else (dk, dv)
    p2p.wait_sends()
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


class _Ring(torch.autograd.Function):
    """Ring attention of local query chunks over the ring's K/V (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                steps: tuple[tuple[Block, ...], ...], ring: _RingGroup,
                scale: float) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, steps, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.steps, ctx.ring, ctx.scale = steps, ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.steps, ctx.ring, ctx.scale)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------- Ulysses

def _check_heads(heads: int, kv_heads: int, size: int) -> None:
    if heads % kv_heads:
        raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"Ulysses over {size} ranks shards {heads} attention heads and {kv_heads} KV "
            f"heads: the heads must be a multiple of {size}, the KV heads a multiple or a "
            f"divisor of it; choose a Ulysses size that fits, or ring attention")


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """``[B, H, S, D]`` sequence shard -> ``[B, H/size, size*S, D]`` (sources in rank order)."""
    from torch.distributed.nn.functional import all_to_all_single

    b, h, s, d = x.shape
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()
    got = all_to_all_single(torch.empty_like(send), send, group=group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_sequence(y: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """The inverse of ``_to_heads``."""
    from torch.distributed.nn.functional import all_to_all_single

    b, hl, full, d = y.shape
    s = full // size
    send = y.reshape(b, hl, size, s, d).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_single(torch.empty_like(send), send, group=group)
    return got.transpose(0, 1).reshape(b, size * hl, s, d)


def _ulysses_order(ring_size: int, ring_rank: int, uly: int, n: int) -> torch.Tensor:
    """After the all-to-all over the ``uly`` ranks of ring index ``ring_rank``, the local
    positions of each chunk of ring rank ``ring_rank``'s shard, in natural order."""
    c = ring_size * uly
    first = ring_rank * uly
    gathered = [x for j in range(uly) for x in (first + j, 2 * c - 1 - first - j)]
    where = {chunk: i for i, chunk in enumerate(gathered)}
    return _chunk_index([where[chunk] for chunk in sorted(gathered)], n)


def _span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Bidirectional attention of ``[B, H, L, D]`` queries within each of ``spans``
    (``(first position, length)`` runs covering ``0..L-1``, the same in every row) over
    the keys and values of the same span: ``dense_attention`` per span, on views of
    ``q``, ``k`` and ``v`` (no mask, no copy), the outputs joined along the sequence."""
    outs = [dense_attention(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n])
            for a, n in spans]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ---------------------------------------------------------------------------- API

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: CPDocuments,
            ring: _RingGroup | None, uly_group: dist.ProcessGroup | None, uly: int,
            causal: bool) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    if uly > 1:
        _check_heads(heads, kv_heads, uly)
    elif heads % kv_heads:
        raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    ring_size, ring_rank = (ring.size, ring.rank) if ring is not None else (1, 0)
    n = q.shape[2] // 2
    if docs.length != 2 * n * ring_size * uly:
        raise ValueError(f"local shards of {q.shape[2]} positions over {ring_size * uly} CP "
                         f"ranks do not match document ids of {docs.length} positions")
    if uly > 1:
        if kv_heads < uly:
            k, v = (x.repeat_interleave(uly // kv_heads, dim=1) for x in (k, v))
        order = _ulysses_order(ring_size, ring_rank, uly, n).to(q.device)
        q, k, v = (_to_heads(x, uly_group, uly).index_select(2, order) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if ring is None and causal and docs.single:
        # One document per sequence, no padding: plain causal attention (no mask to
        # build; ``dtc memcheck``'s fake world builds none).
        out = dense_attention(q, k, v, causal=True)
    elif ring is None and causal:
        out = document_attention(q, k, v, docs.document_mask(q.device))
    elif ring is None and not causal and docs.shared_spans is not None:
        # Bidirectional on the whole sequence, every row the same documents (an
        # encoder's rows and their padding): each document's own dense attention. The
        # ring's blocks would keep an additive [B, 1, m, m] mask for every block a
        # document boundary crosses, each microbatch until its backward.
        out = _span_attention(q, k, v, docs.shared_spans)
    else:
        # Bidirectional attention on the whole sequence, documents differing by row
        # (models.attention's masks are causal): the ring's blocks on a ring of one
        # rank, which sends nothing.
        ring = ring or _RingGroup(None, 1, 0, -1, -1)
        steps = docs.ring_blocks(ring.size, ring.rank, q.device, q.dtype, causal)
        out = _Ring.apply(q, k, v, steps, ring, scale)
    if uly > 1:
        out = _to_sequence(out.index_select(2, torch.argsort(order)), uly_group, uly)
    return out


@torch._disable_dynamo     # lazy: dynamo (over a second of CPU) is imported at the first call
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 docs: torch.Tensor | CPDocuments, method: str = "ring",
                 group: dist.ProcessGroup | None = None, mesh: Any = None,
                 causal: bool = True) -> torch.Tensor:
    """Document-causal attention of this rank's shard (``shard``'s layout) of queries
    ``[B, H, n2, D]`` over keys and values ``[B, H_kv, n2, D]`` of the whole sequence, held
    in shards by the CP ranks: this rank's shard of the output ``[B, H, n2, D]``.

    ``docs``: this rank's shard of the document ids ``[B, n2]`` (``shard_documents``;
    gathered over the CP ranks, a wait for the device on an accelerator), or a
    ``CPDocuments`` of the whole sequences built once per microbatch. ``method``: "ring" or
    "ulysses" over ``group`` (None: every rank), or "hybrid" over ``mesh``, a DeviceMesh
    with dims ``("cp_ring", "cp_ulysses")``. ``group`` should be a group of its own: the
    ring's transfers number their messages from 0 on every call. ``causal=False``: each
    query sees every key of its document (an encoder's attention). Never compiled: its
    transfers and host-side block lists run eager between a compiled model's graphs."""
    if method not in METHODS:
        raise ValueError(f"context parallelism {method!r} is not one of {', '.join(METHODS)}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[::2] != q.shape[::2]:
        raise ValueError(f"queries {tuple(q.shape)}, keys {tuple(k.shape)} and values "
                         f"{tuple(v.shape)} are not [B, H, S, D] shards of one sequence")
    if q.shape[2] % 2:
        raise ValueError(f"a CP shard holds two chunks of equal length, not {q.shape[2]} "
                         "positions: shard the sequence with dtdsl.parallel.cp.shard")
    if method == "hybrid":
        if mesh is None or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"hybrid context parallelism needs a DeviceMesh with dims "
                             f"{MESH_DIMS}, not {mesh!r}")
        ring_group, uly_group = mesh.get_group(MESH_DIMS[0]), mesh.get_group(MESH_DIMS[1])
        uly = mesh.size(1)
        groups: list[dist.ProcessGroup | None] = [uly_group, ring_group]
        ring = _RingGroup.of(ring_group) if mesh.size(0) > 1 else None
    elif method == "ring":
        ring, uly_group, uly, groups = _RingGroup.of(group), None, 1, [group]
    else:
        ring, uly_group, uly, groups = None, group, dist.get_world_size(group), [group]
    if not isinstance(docs, CPDocuments):
        docs = CPDocuments.gather(docs, groups, q.device)
    return _attend(q, k, v, docs, ring, uly_group, uly, causal)


# ---------------------------------------------------------------------------- runtime

@dataclass(frozen=True, eq=False)
class CPGroup:
    """A stage's context parallelism (``parallel.mesh.ProcessGroups.cp``): ``size`` CP
    ranks, this rank's ``rank`` among them (which shard of the layout it holds), its
    module's ``method`` and the process group (ring, Ulysses) or ``(cp_ring,
    cp_ulysses)`` DeviceMesh (hybrid) its attention runs over."""

    method: str
    size: int
    rank: int
    group: Any

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"context parallelism {self.method!r} is not one of "
                             f"{', '.join(METHODS)}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"CP rank {self.rank} is outside 0..{self.size - 1}")

    def context(self, docs: torch.Tensor) -> CPContext:
        """The attention context of one microbatch from the document ids of its whole
        sequences ``[B, L']`` (L' a multiple of ``2 * size``; every CP rank has them)."""
        return CPContext(self, CPDocuments.from_full(docs, self.size))

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of ``x`` along its sequence dimension (``shard``)."""
        return shard(x, self.size, self.rank, dim)

    def groups(self) -> list[Any]:
        """The process groups over which to gather along the CP ranks, innermost first
        (``CPDocuments.gather``'s order: CP rank ``i * U + j``)."""
        if self.method == "hybrid" and not isinstance(self.group, dist.ProcessGroup):
            return [self.group.get_group(MESH_DIMS[1]), self.group.get_group(MESH_DIMS[0])]
        return [self.group]


class CPContext:
    """What every attention layer of one microbatch's forward needs under context
    parallelism (``models.transformer.SelfAttention`` takes it in place of a document
    mask): the group and the documents' blocks, built once per microbatch. Not a
    dataclass: FSDP2 rebuilds every dataclass among a module's inputs (to cast its
    tensors), which would copy the documents' block cache for every layer."""

    __slots__ = ("cp", "docs")

    def __init__(self, cp: CPGroup, docs: CPDocuments):
        self.cp, self.docs = cp, docs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               causal: bool = True) -> torch.Tensor:
        """``cp_attention`` of this rank's shards ``[B, H, n2, D]`` with the module's
        method."""
        hybrid = self.cp.method == "hybrid"
        return cp_attention(q, k, v, docs=self.docs, method=self.cp.method,
                            group=None if hybrid else self.cp.group,
                            mesh=self.cp.group if hybrid else None, causal=causal)


class _Gather(torch.autograd.Function):
    """This CP rank's shard ``[B, n2, ...]`` to the whole sequence ``[B, length, ...]``
    on every CP rank; backward: the whole's gradients summed over the CP ranks (each
    rank's loss reads the whole), this rank's shard of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPGroup, length: int) -> torch.Tensor:
        parts = x.contiguous()[None]
        for group in cp.groups():
            size = dist.get_world_size(group)
            out = torch.empty((size * parts.shape[0], *parts.shape[1:]), dtype=parts.dtype,
                              device=parts.device)
            dist.all_gather_into_tensor(out, parts.contiguous(), group=group)
            parts = out
        ctx.cp, ctx.length = cp, length
        return unshard(list(parts.unbind(0)), length, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        for group in ctx.cp.groups():
            dist.all_reduce(grad, group=group)
        return ctx.cp.shard(grad), None, None


def gather_sequence(x: torch.Tensor, cp: CPGroup, length: int) -> torch.Tensor:
    """The whole sequences ``[B, length, ...]`` from every CP rank's shard ``x`` (on every
    CP rank, differentiable: ``_Gather``). ``length``: the whole width, padding dropped."""
    return _Gather.apply(x, cp, length)
