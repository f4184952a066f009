"""Attention over packed documents: FlexAttention with a document-causal block mask.

A packed sequence (``train.packing``, ``ir.layout``) holds several documents; a position
attends to the positions of its own document up to itself, and the padding after the
documents is one more document (so no row of scores is empty). ``document_mask`` builds
what the kernel needs from the layouts alone, on the host:

- each position's document id ``[B, S']`` (``S'``: ``S`` rounded up to the block size, so
  a kernel that evaluates the mask on a whole last block reads inside the tensor), read by
  the ``mask_mod``;
- the ``BlockMask``'s block lists (``BlockMask.from_kv_blocks``): documents are contiguous,
  so the keys a block of 128 queries needs are the blocks from its first query's document
  start to itself; a block is *full* (no mask evaluated in it) when it lies below the
  diagonal and its queries and keys all sit in one document. This is exactly what
  ``create_block_mask`` derives by evaluating the mask on all ``S^2`` pairs (the tests
  compare the two), without the ``S^2`` work or a device round trip;
- the positions ``[B, S]``, restarting at 0 in every document (rotary embeddings).

Everything is made on the host and copied to the device pinned and without blocking:
nothing here waits for the device.

``document_attention(q, k, v, mask)`` runs ``flex_attention`` with ``enable_gqa`` (K and V
keep their own heads; nothing is repeated). On CUDA it is ``torch.compile``'d once per
process (``flex_kernel``): the fused Triton kernel that skips the blocks the mask leaves
out; new widths stop compiling once the sequence length is dynamic. On the CPU torch 2.13's
public ``flex_attention`` refuses inputs that need a gradient (it has no CPU backward,
compiled or not), so the CPU runs the same operator that function is built on
(``flex_attention_hop``), uncompiled: torch's reference implementation of it, which
evaluates the same ``mask_mod`` and supports autograd. Both take the same inputs; the CPU
tests hold it equal to a dense masked SDPA, and a compiled forward on the CPU runs the
block lists through a real kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["BLOCK", "DENSE_BACKENDS", "DocumentMask", "dense_attention", "document_attention",
           "document_ids", "document_mask", "flex_kernel", "key_bias"]

BLOCK = 128   # torch's default sparse block: the CUDA kernels' tiles divide it

# Attention without a document mask, in this order of preference. On Hopper torch tries
# cuDNN's fused attention first, and cuDNN builds an execution plan for every new input
# shape: milliseconds of host time each, and a run's microbatches change length every
# step. Measured on an H200 (torch 2.11, benchmarks/gpu_check.py's step): 1054 ms a step
# with cuDNN first, 223 ms with FlashAttention first, where a plain PyTorch loop of the
# same model takes 235 ms. cuDNN stays as a fallback for what flash cannot run.
DENSE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of ``[B, H, S, D]`` queries over ``[B, H_kv, M, D]``
    keys and values (grouped-query when ``H_kv < H``: K and V are not repeated), causal or
    not, on the first of ``DENSE_BACKENDS`` that takes the inputs; ``bias``: an additive
    mask broadcast to ``[B, H, S, M]`` (``key_bias``: padded keys), which FlashAttention
    does not take (the efficient kernel does)."""
    with sdpa_kernel(DENSE_BACKENDS, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


def key_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[B, 1, 1, M]`` bias of ``dense_attention`` from a ``[B, M]`` boolean
    of the keys to attend to (every row keeps at least one): 0 where kept, -inf where
    not."""
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep, float("-inf"))[:, None, None, :]

# The BlockMask's tensors, in its constructor's keywords.
_BLOCK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """Packed documents' attention pattern for ``flex_attention`` (module docstring)."""

    block_mask: BlockMask
    docs: torch.Tensor          # [B, S'] int32: each position's document (padding: one more)

    @property
    def length(self) -> int:
        return self.block_mask.seq_lengths[0]

    def block_fraction(self) -> float:
        """The share of the ``BLOCK x BLOCK`` blocks of the ``S x S`` scores the kernel
        computes (partial and full), over all sequences (a dense mask: 1.0)."""
        bm = self.block_mask
        touched = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum()
                                            if bm.full_kv_num_blocks is not None else 0)
        rows, cols = bm.kv_indices.shape[-2], -(-self.length // BLOCK)
        return float(touched) / (bm.kv_num_blocks.shape[0] * rows * cols)


def document_ids(spans: Sequence[Sequence[tuple[int, int]]], width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document ids [B, S'] int32, positions [B, S] int64)`` on the host for sequences
    whose documents are ``spans[b]`` (``(first position, length)`` each, in order, from 0
    without gaps): padding after the documents is one more document, and so is the
    rounding up to whole blocks (``S' = ceil(S / BLOCK) * BLOCK``)."""
    padded = -(-width // BLOCK) * BLOCK
    docs = torch.empty(len(spans), padded, dtype=torch.int32)
    positions = torch.empty(len(spans), width, dtype=torch.int64)
    for b, row in enumerate(spans):
        end = 0
        for d, (start, n) in enumerate(row):
            if start != end or n < 1:
                raise ValueError(f"sequence {b}: document {d} at {start} of {n} positions "
                                 f"does not follow the one ending at {end}")
            if start + n > width:
                raise ValueError(f"sequence {b}: documents of {start + n} positions exceed "
                                 f"{width}")
            docs[b, start:start + n] = d
            positions[b, start:start + n] = torch.arange(n)
            end = start + n
        docs[b, end:] = len(row)
        positions[b, end:] = torch.arange(width - end)
    return docs, positions


def _block_lists(docs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` ``[B, 1, Q, K]`` block masks (bool) of the document-causal
    pattern, from contiguous document ids (module docstring)."""
    blocks = docs.shape[1] // BLOCK
    first = torch.arange(blocks) * BLOCK                        # each block's first position
    last = torch.clamp(first + BLOCK, max=width) - 1            # its last real query
    # The first position of each position's document: ids only grow along a sequence.
    pos = torch.arange(docs.shape[1]).expand_as(docs)
    change = torch.ones_like(docs, dtype=torch.bool)
    change[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start = torch.cummax(torch.where(change, pos, 0), dim=1).values
    lo = start[:, first] // BLOCK                               # [B, Q]: lowest key block
    q = torch.arange(blocks)[:, None]
    k = torch.arange(blocks)[None, :]
    touched = (k >= lo[:, :, None]) & (k <= q)                  # [B, Q, K]
    whole = (first + BLOCK <= width)[:, None]                   # every query row is real
    # The key block's first position and the query block's last in one document.
    same = docs[:, first][:, None, :] == docs[:, last][:, :, None]
    full = touched & (k < q) & whole & same
    return (touched & ~full)[:, None], full[:, None]


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense block mask as BlockMask's (counts, indices): each row's blocks first, in
    increasing order (what torch's own conversion gives)."""
    counts = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
    return counts, indices.to(torch.int32)


def _document_causal(docs: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The mask_mod: same document, key not after the query."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def _to(x: Any, device: torch.device) -> Any:
    """A host tensor on ``device``: pinned and copied without blocking for an
    accelerator (the stream orders the copy before the kernels that read it)."""
    if not isinstance(x, torch.Tensor) or device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def document_mask(spans: Sequence[Sequence[tuple[int, int]]], width: int,
                  device: torch.device | str) -> tuple[torch.Tensor, DocumentMask]:
    """``(positions [B, S], DocumentMask)`` on ``device`` for sequences of ``width``
    positions whose documents are ``spans[b]`` (``document_ids``), built on the host."""
    device = torch.device(device)
    docs, positions = document_ids(spans, width)
    partial, full = _block_lists(docs, width)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    host = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    seq_lengths=(width, width))
    docs = _to(docs, device)
    block_mask = BlockMask(
        seq_lengths=(width, width),
        **{name: _to(getattr(host, name), device) for name in _BLOCK_TENSORS},
        BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=_document_causal(docs))
    return _to(positions, device), DocumentMask(block_mask=block_mask, docs=docs)


@functools.cache
def flex_kernel() -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled, once per process (torch.compile caches its kernels;
    a new batch's mask_mod closure and block lists reuse them, and new widths stop
    compiling once the sequence length is dynamic)."""
    return torch.compile(flex_attention)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: DocumentMask) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, S, D]`` over ``k``, ``v`` ``[B, H_kv, S, D]`` (grouped-query
    when ``H_kv < H``: no head is copied) within each query's document, causal:
    ``[B, H, S, D]``."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cpu":
        # Inside a compiled block (train.compiled) dynamo traces into the compiled
        # kernel: one graph with the block's other kernels.
        return flex_kernel()(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    return _reference_flex(q, k, v, mask)


# torch's lazy form of torch.compiler.disable: dynamo (over a second of CPU to import) is
# imported at the first call, not by every process that imports the models (ranks, workers).
@torch._disable_dynamo
def _reference_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: DocumentMask) -> torch.Tensor:
    """The CPU's document attention: torch 2.13 has no CPU backward behind the public
    function (module docstring), so the operator itself, with the options and scale the
    public function would give it. Never compiled (inductor's CPU lowering has no backward
    either): in a compiled block it runs eager between the block's graphs."""
    from torch.nn.attention.flex_attention import (
        _apply_kernel_options,
        _identity,
        flex_attention_hop,
    )

    options = _apply_kernel_options(q, k, v, False, None)
    out, _, _ = flex_attention_hop(q, k, v, _identity, mask.block_mask.as_tuple(),
                                   1.0 / math.sqrt(q.shape[-1]), options)
    return out
