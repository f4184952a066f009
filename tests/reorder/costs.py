"""Skewed per-sample costs for the reordering tests and benchmarks/reorder_intra.py."""

from __future__ import annotations

import numpy as np

__all__ = ["KINDS", "draw"]

KINDS = ("lognormal-1", "lognormal-1.5", "pareto-1.5", "mm-zipf-attn", "mm-geometric")


def _images(rng: np.random.Generator, counts: np.ndarray) -> np.ndarray:
    return np.array([rng.integers(256, 4097, k).sum() if k else 0 for k in counts], float)


def draw(kind: str, n: int, seed: int) -> list[float]:
    """n per-sample costs of one of ``KINDS``, seeded."""
    rng = np.random.default_rng(seed)
    if kind == "lognormal-1":
        x = rng.lognormal(0.0, 1.0, n)
    elif kind == "lognormal-1.5":
        x = rng.lognormal(0.0, 1.5, n)
    elif kind == "pareto-1.5":
        x = rng.pareto(1.5, n) + 1.0
    elif kind == "mm-zipf-attn":
        # Text tokens (128..2048) plus a Zipf number (0..16) of images of 256..4096 patches,
        # with an attention term quadratic in the sequence length.
        seq = rng.integers(128, 2049, n) + _images(rng, np.minimum(rng.zipf(2.0, n) - 1, 16))
        x = seq + seq * seq / 8192.0
    elif kind == "mm-geometric":
        x = rng.integers(128, 2049, n) + _images(rng, np.minimum(rng.geometric(0.35, n) - 1, 16))
    else:
        raise ValueError(f"unknown cost kind {kind!r}; one of {', '.join(KINDS)}")
    return [float(v) for v in x]
