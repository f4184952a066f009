"""The routed experts' GEMM rule (``cost.gemm``) against rooflines worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from dtdsl.cost.gemm import expert_gemm_slowdown
from dtdsl.ir.hardware import GPU_PRESETS, hbm_bandwidth

H100 = GPU_PRESETS["H100"]
RATE = H100.peak_flops * 0.70          # the large-GEMM rate at the default efficiency
HBM = H100.hbm_bw_bytes_per_s


def _slowdown(rows, hidden, ffn, hbm=HBM):
    return expert_gemm_slowdown(rows, hidden, ffn, flops_per_s=RATE, hbm_bytes_per_s=hbm)


def test_a_compute_bound_expert_pays_half_a_tile():
    # 4096 rows of a Mixtral-wide expert (4096 x 14336): compute-bound; the forward and the
    # input gradient compute 4096 + 64 rows (half a 128-row tile wasted on average), the
    # weight gradient 4096 + 32 (half a 64-deep block).
    fwd, dgrad, wgrad = _slowdown(4096, 4096, 14336)
    assert fwd == dgrad == pytest.approx((4096 + 64) / 4096)
    assert wgrad == pytest.approx((4096 + 32) / 4096)


def test_a_short_expert_is_memory_bound():
    # Qwen3-30B-A3B's expert at tp 2 (2048 x 384 columns) on 203 rows, by hand. Gate and
    # up (2048 x 768): 267 rows of FLOPs (203 + 64) take 2 * 267 * 2048 * 768 / RATE =
    # 1.213 us; their bytes 2 (203 * 2048 + 2048 * 768 + 203 * 768) = 4.290 MB take
    # 1.280 us at 3.35 TB/s. Down (384 x 2048): half the FLOPs, 0.607 us; its bytes
    # 2 (203 * 384 + 384 * 2048 + 203 * 2048) = 2.560 MB, 0.764 us. Both memory-bound.
    # On many rows each row costs its FLOPs: 2 * 2048 * (768 + 384) / RATE.
    up = max(2 * 267 * 2048 * 768 / RATE, 2 * (203 * 2048 + 2048 * 768 + 203 * 768) / HBM)
    down = max(2 * 267 * 384 * 2048 / RATE, 2 * (203 * 384 + 384 * 2048 + 203 * 2048) / HBM)
    assert up == pytest.approx(1.280e-6, rel=1e-3) and down == pytest.approx(0.764e-6, rel=1e-3)
    many = 203 * 2 * 2048 * (768 + 384) / RATE
    fwd, dgrad, wgrad = _slowdown(203, 2048, 384)
    assert fwd == dgrad == pytest.approx((up + down) / many)
    assert fwd == pytest.approx((1.280 + 0.764) / 1.3837, abs=1e-3)   # 1.478
    # The weight gradient: 235 rows of FLOPs (203 + 32); gate and up still memory-bound.
    wup = max(2 * 235 * 2048 * 768 / RATE, 2 * (203 * 2048 + 2048 * 768 + 203 * 768) / HBM)
    wdown = max(2 * 235 * 384 * 2048 / RATE, 2 * (203 * 384 + 384 * 2048 + 203 * 2048) / HBM)
    assert wgrad == pytest.approx((wup + wdown) / many)


def test_a_handful_of_rows_computes_one_tile():
    # Under half a tile the kernel still computes one whole tile (no memory bound given).
    fwd, _, wgrad = _slowdown(10, 2048, 768, hbm=None)
    assert fwd == pytest.approx(128 / 10) and wgrad == pytest.approx(64 / 10)


@pytest.mark.parametrize(("hidden", "ffn"), [(2048, 768), (2048, 384), (4096, 14336),
                                              (64, 64), (1024, 96)])
@pytest.mark.parametrize("hbm", [HBM, None])
def test_more_rows_per_expert_are_never_slower_per_row(hidden, ffn, hbm):
    # The factors are time per row over the many-rows time per row: never rising with
    # the rows, never below 1, and 1 in the limit.
    rows = np.arange(1, 20001, dtype=float)
    for factor in _slowdown(rows, hidden, ffn, hbm=hbm):
        assert np.all(np.diff(factor) <= 1e-12)
        assert np.all(factor >= 1 - 1e-12)
    assert _slowdown(1e7, hidden, ffn, hbm=hbm)[0] == pytest.approx(1.0, abs=1e-4)


def test_every_preset_has_its_hbm_bandwidth():
    # Data-sheet figures; a custom GPU has none (the rule keeps to FLOPs and tiles).
    assert {name: p.hbm_bw_bytes_per_s for name, p in GPU_PRESETS.items()} == {
        "A100": 2.039e12, "H100": 3.35e12, "H800": 3.35e12, "H200": 4.8e12}
    assert hbm_bandwidth("H200") == 4.8e12 and hbm_bandwidth("cpu") is None
