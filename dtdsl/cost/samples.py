"""Synthetic samples drawn from a spec's data distributions.

A ``SampleSet`` holds, for n samples, the text tokens of each and, per modality,
how many items (images, clips) each sample carries and how large each item is
(patches per image, frames per clip), flattened with offsets so that per-sample
sums of any function of the item sizes are one vectorised call. The cost model
uses it to take expectations; reordering and the simulator use it as a stream of
concrete samples. Draws are reproducible from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtdsl.ir import program as ir

__all__ = ["ItemSet", "SampleSet", "draw", "draw_samples"]


def draw(quantity: ir.Quantity, n: int, rng: np.random.Generator) -> np.ndarray:
    """n whole-number values of one quantity, clamped as the spec says."""
    dist = quantity.dist
    if isinstance(dist, ir.Constant):
        values = np.full(n, dist.value, dtype=float)
    elif isinstance(dist, ir.Uniform):
        values = rng.integers(int(np.ceil(dist.low)), int(np.floor(dist.high)) + 1, size=n)
    elif isinstance(dist, ir.LogNormal):
        values = rng.lognormal(np.log(dist.median), dist.sigma, size=n)
    elif isinstance(dist, ir.Zipf):
        values = rng.zipf(dist.a, size=n) - 1  # numpy draws k >= 1; ours start at 0
    elif isinstance(dist, ir.Choice):
        values = rng.choice(np.asarray(dist.values), size=n, p=np.asarray(dist.probs))
    elif isinstance(dist, ir.Empirical):
        values = rng.choice(np.asarray(dist.values), size=n)
    else:  # pragma: no cover - the union is closed
        raise AssertionError(type(dist).__name__)
    values = np.asarray(values, dtype=float)
    if quantity.low is not None or quantity.high is not None:
        values = np.clip(values, quantity.low, quantity.high)
    return np.rint(values).astype(np.int64)


@dataclass(frozen=True)
class ItemSet:
    """Items of one kind (e.g. images to encode) across samples: sizes flat, by sample."""

    counts: np.ndarray   # items per sample, shape (n,)
    sizes: np.ndarray    # size of each item (tokens), shape (counts.sum(),)

    def per_sample(self, values: np.ndarray) -> np.ndarray:
        """Sum ``values`` (one per item) over each sample's items."""
        out = np.zeros(len(self.counts))
        if len(values):
            owner = np.repeat(np.arange(len(self.counts)), self.counts)
            np.add.at(out, owner, values)
        return out

    def tokens(self) -> np.ndarray:
        """Total item tokens per sample."""
        return self.per_sample(self.sizes.astype(float))


@dataclass(frozen=True)
class SampleSet:
    """n samples: their text tokens and, per item kind, their items."""

    text_tokens: np.ndarray
    items: dict[str, ItemSet]   # keys such as "image", "image.gen", "audio"

    def __len__(self) -> int:
        return len(self.text_tokens)


def _item_sizes(data: ir.Data, modality: str, total: int, rng: np.random.Generator,
                generated: bool) -> np.ndarray:
    """Tokens per item: image patches, audio frames, video frames x patches."""
    if generated:
        return np.ones(total, dtype=np.int64)  # a generator's work is per item (fixed latent)
    if modality == "image":
        return draw(data.get("image", "patches"), total, rng)
    if modality == "audio":
        return draw(data.get("audio", "frames"), total, rng)
    frames = draw(data.get("video", "frames"), total, rng)
    return frames * draw(data.get("video", "patches"), total, rng)


def draw_samples(program: ir.Program, n: int, seed: int = 0) -> SampleSet:
    """n samples following the spec's data block (only what its modules read)."""
    rng = np.random.default_rng(seed)
    data = program.data
    text = draw(data.get("text", "tokens"), n, rng)
    items: dict[str, ItemSet] = {}
    for module in program.modules:
        if module.role == "encoder" and module.modality not in items:
            counts = draw(data.get(module.modality, "count"), n, rng)
            sizes = _item_sizes(data, module.modality, int(counts.sum()), rng, generated=False)
            items[module.modality] = ItemSet(counts=counts, sizes=sizes)
        elif module.role == "generator" and f"{module.modality}.gen" not in items:
            counts = draw(data.get(module.modality, "gen_count"), n, rng)
            sizes = _item_sizes(data, module.modality, int(counts.sum()), rng, generated=True)
            items[f"{module.modality}.gen"] = ItemSet(counts=counts, sizes=sizes)
    return SampleSet(text_tokens=text, items=items)
