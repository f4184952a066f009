"""Packed attention: the dense boolean mask dtdsl gave SDPA before against FlexAttention's
document-causal block mask (``models.attention``), on 8K sequences packed from the
``mllm_9b`` spec's data (``train.packing = true``, the synthetic source's packing).

Prints, over ``--rows`` packed sequences, the share of the 128 x 128 blocks of the
scores the BlockMask touches (a dense mask: all of them) next to the cost model's share
of the causal work (``sum of squared document lengths / S^2``); then, on the sequence
with the median share, the forward time and peak memory on this CPU of

- dense: SDPA with a ``[1, 1, S, S]`` bool mask, K and V repeated for grouped-query
  attention (the code before FlexAttention);
- flex: ``torch.compile(flex_attention)`` over the BlockMask, GQA without copies
  (inductor's CPU kernel; a GPU runs the same call through Triton),

as ratios (absolute times only from an accelerator). Forward only: torch 2.13 has no
compiled FlexAttention backward on the CPU. Peak memory is the resident set's high-water
mark over the call (reset through ``/proc/self/clear_refs``; "n/a" where the kernel does
not allow it), beyond the inputs. The backward of every layer also keeps what the
forward made: the dense path its ``S^2``-byte mask, flex only the block lists.

    python benchmarks/packed_attention.py [--rows 64] [--heads 8] [--kv-heads 2]
                                          [--head-dim 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import shipped

from dtdsl.data.batch import SyntheticSource
from dtdsl.ir.layout import layout_of
from dtdsl.models.attention import document_mask, flex_kernel

_STATUS = Path("/proc/self/status")


def _kib(field: str) -> int | None:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def peak_bytes(fn) -> float | None:
    """The resident set's high-water mark during ``fn()`` above the resident set before
    it, or None where the peak cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    before = _kib("VmRSS")
    fn()
    peak = _kib("VmHWM")
    return None if before is None or peak is None else max(0, peak - before) * 1024.0


def packed_spans(rows: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """``seq_len`` and the document spans of the first ``rows`` packed sequences of
    mllm_9b's synthetic data."""
    program = shipped("mllm_9b")
    program = program.model_copy(update={"train": program.train.model_copy(
        update={"packing": True})})
    source = SyntheticSource(program)
    tokens = program.image_tokens()
    seq_len = program.train.seq_len
    out: list[list[tuple[int, int]]] = []
    step = 0
    while len(out) < rows:
        out.extend(list(layout_of(sz, tokens, seq_len).spans) for sz in source.sizes(step))
        step += 1
    return seq_len, out[:rows]


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="packed sequences to measure")
    parser.add_argument("--heads", type=int, default=8, help="query heads (9b: 32)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (9b: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    width, spans = packed_spans(args.rows)
    fractions, works = [], []
    for row in spans:
        _, mask = document_mask([row], width, "cpu")
        fractions.append(mask.block_fraction())
        works.append(sum(n * n for _, n in row) / width ** 2)
    docs = [len(row) for row in spans]
    print(f"mllm_9b packed, seq_len {width}: {args.rows} sequences, {min(docs)}-{max(docs)} "
          f"documents each (padding after them counts as one)")
    print(f"blocks touched (128 x 128): mean {statistics.fmean(fractions):.1%}, "
          f"min {min(fractions):.1%}, max {max(fractions):.1%}  (dense mask: 100%, "
          f"one causal document: {(width // 128 + 1) / (2 * (width // 128)):.1%})")
    print(f"causal work priced (sum of squared document lengths / S^2): mean "
          f"{statistics.fmean(works):.1%}, min {min(works):.1%}, max {max(works):.1%}")

    median = sorted(range(len(spans)), key=lambda i: fractions[i])[len(spans) // 2]
    row = spans[median]
    positions, mask = document_mask([row], width, "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, width, args.head_dim, generator=g)
    k = torch.randn(1, args.kv_heads, width, args.head_dim, generator=g)
    v = torch.randn(1, args.kv_heads, width, args.head_dim, generator=g)
    group = args.heads // args.kv_heads
    docs_ids = mask.docs[0, :width]
    dense_mask = ((docs_ids[:, None] == docs_ids[None, :]) &
                  torch.ones(width, width, dtype=torch.bool).tril())[None, None]

    def dense():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                              v.repeat_interleave(group, dim=1),
                                              attn_mask=dense_mask)

    def flex():
        return flex_kernel()(q, k, v, block_mask=mask.block_mask, enable_gqa=True)

    with torch.no_grad():
        start = time.perf_counter()
        got = flex()
        compile_s = time.perf_counter() - start
        diff = float((got - dense()).abs().max())
        t_dense, t_flex = seconds(dense, args.repeats), seconds(flex, args.repeats)
        m_dense, m_flex = peak_bytes(dense), peak_bytes(flex)
    print(f"one sequence ({len(row)} documents, {fractions[median]:.1%} of blocks), "
          f"{args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, fp32, "
          f"{torch.get_num_threads()} threads, forward:")
    print(f"  flex / dense time: {t_flex / t_dense:.3f}  (median of {args.repeats}; flex's "
          f"first call compiled in {compile_s:.0f} s on this CPU)")
    if m_dense and m_flex is not None:
        print(f"  flex / dense peak memory: {m_flex / m_dense:.3f}  ({m_flex / 2**20:.0f} MiB "
              f"vs {m_dense / 2**20:.0f} MiB above the inputs)")
    else:
        print("  peak memory: n/a (this kernel does not let /proc/self/clear_refs reset it)")
    bm = mask.block_mask
    lists = sum(t.numel() * t.element_size() for t in (
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
        bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices, mask.docs))
    print(f"  kept for backward per sequence, beyond q, k, v and the output: dense "
          f"{dense_mask.numel() / 2**20:.0f} MiB of mask in every layer (and K, V repeated "
          f"{group}x), flex {lists / 2**10:.0f} KiB of block lists and document ids per "
          f"microbatch")
    print(f"  max |flex - dense| = {diff:.2e}")


if __name__ == "__main__":
    main()
