"""How fast the routed experts' GEMMs run for the rows each expert gets.

The cost model prices matmul work at ``Efficiency.matmul`` of the GPU's peak: what large
GEMMs reach. A fine-grained mixture of experts splits a microbatch's ``tokens x top_k``
slots over many experts, so each expert's GEMMs are short: at 128 experts, 8 per token, a
3K-token microbatch gives each expert about 200 rows. Such a GEMM falls short of the large
rate for two reasons that NVIDIA's "Matrix Multiplication Background User's Guide" (Deep
Learning Performance documentation, "Math and memory bounds", "Tile quantization") sets
out, and that MegaBlocks (Gale et al., MLSys 2023, section 3: experts' rows padded to
128-row blocks) and every grouped-GEMM kernel pay:

- **Memory bound.** A GEMM of ``m x k`` by ``k x n`` (bf16) reads ``2 (m k + k n)`` bytes
  and writes ``2 m n`` for ``2 m k n`` FLOPs: with few rows its weights dominate the bytes
  and its arithmetic intensity (about ``m`` FLOPs a byte) falls below the GPU's
  FLOPs-to-bandwidth ratio (about 200 for an H100 at the matmul efficiency), so it runs at
  the speed of its memory traffic, ``bytes / HBM bandwidth``.
- **Tile quantisation.** The kernel computes whole tiles: rows in blocks of
  ``ROW_TILE`` (the M side of the 128 x 128 and 128 x 256 tiles cuBLAS and CUTLASS use
  on Hopper) for the forward and the input gradient, whose output has the expert's rows;
  the weight gradient's rows are its reduction, run in ``DEPTH_TILE``-deep blocks. The
  rows per expert differ between experts and microbatches (routing is not uniform), so
  the last block's fill is spread over the block: on average half a block is wasted, and
  never less than one block is computed.

Expert parallelism over ``ep`` ranks gives each rank ``experts / ep`` experts with ``ep``
times the rows each (the same FLOPs per rank): the reason practice runs fine-grained MoE
with EP. ``expert_gemm_slowdown`` is the one rule; ``CostModel.compute_time_s`` and the
backward (``CostModel.expert_backward_extra_s``) apply it to the experts' share of the
work, and the simulator reads those times.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DEPTH_TILE", "ROW_TILE", "expert_gemm_slowdown"]

ROW_TILE = 128
DEPTH_TILE = 64
_BYTES = 2      # bf16 operands and outputs


def _computed_rows(rows, tile: int):
    """The rows a kernel computes on average for ``rows`` mean rows per expert: half a
    tile more (the last tile's mean waste), at least one whole tile."""
    return np.maximum(np.asarray(rows, dtype=float) + tile / 2, tile)


def _seconds(rows, k: float, n: float, tile: int, flops_per_s: float,
             hbm_bytes_per_s: float | None):
    """One GEMM of ``rows x k`` by ``k x n`` (or its gradients, which move the same three
    matrices): the slower of its tile-padded FLOPs at the large-GEMM rate and its bytes
    at the memory bandwidth (no memory bound when the bandwidth is unknown)."""
    rows = np.asarray(rows, dtype=float)
    compute = 2 * _computed_rows(rows, tile) * k * n / flops_per_s
    if hbm_bytes_per_s is None:
        return compute
    memory = _BYTES * (rows * k + k * n + rows * n) / hbm_bytes_per_s
    return np.maximum(compute, memory)


def _per_row_seconds(k: float, n: float, flops_per_s: float,
                     hbm_bytes_per_s: float | None) -> float:
    """What ``_seconds`` tends to per row as the rows grow: the GEMM's FLOPs per row at the
    large-GEMM rate, or its activations' bytes per row where those take longer."""
    compute = 2 * k * n / flops_per_s
    if hbm_bytes_per_s is None:
        return compute
    return max(compute, _BYTES * (k + n) / hbm_bytes_per_s)


def expert_gemm_slowdown(rows, hidden: float, ffn: float, *, flops_per_s: float,
                         hbm_bytes_per_s: float | None) -> tuple:
    """(forward, input gradient, weight gradient): how many times longer one SwiGLU
    expert's GEMMs take on ``rows`` rows (a mean, > 0; may be an array) than the same
    GEMMs on many rows take per row: its gate and up projections (``hidden x 2 ffn``
    together) and its down projection (``ffn x hidden``); ``ffn`` is a TP rank's columns;
    ``flops_per_s`` the large-GEMM rate (peak x ``Efficiency.matmul``). Many rows is the
    reference because that is what the cost model's rate prices: a real expert's GEMMs
    are compute-bound there (the factor tends to 1); a toy model's narrow ones are
    memory-bound at any rows, like its dense layers, which the dense rate prices alike.
    Each factor is >= 1 and the time per row never grows with the rows."""
    rows = np.asarray(rows, dtype=float)
    shapes = ((hidden, 2 * ffn), (ffn, hidden))
    many = rows * sum(_per_row_seconds(k, n, flops_per_s, hbm_bytes_per_s)
                      for k, n in shapes)
    rows_tiled = sum(_seconds(rows, k, n, ROW_TILE, flops_per_s, hbm_bytes_per_s)
                     for k, n in shapes) / many
    depth_tiled = sum(_seconds(rows, k, n, DEPTH_TILE, flops_per_s, hbm_bytes_per_s)
                      for k, n in shapes) / many
    return rows_tiled, rows_tiled, depth_tiled
