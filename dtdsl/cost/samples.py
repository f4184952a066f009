"""Synthetic samples drawn from a spec's data distributions.

A ``SampleSet`` holds, for n samples, the text tokens of each and, per modality,
how many items (images, clips) each sample carries and how large each item is
(patches per image, frames per clip), flattened with offsets so that per-sample
sums of any function of the item sizes are one vectorised call. The cost model
uses it to take expectations; reordering and the simulator use it as a stream of
concrete samples. Draws are reproducible from the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtdsl.ir import program as ir
from dtdsl.ir.bounds import quantity_limit
from dtdsl.ir.layout import layout_of
from dtdsl.ir.modal import InputRule, drawn_tokens, encoder_inputs
from dtdsl.ir.sizes import SampleSizes

__all__ = ["ItemSet", "SampleSet", "attention_squares", "backbone_sizes", "draw",
           "draw_samples", "item_key", "microbatch_lengths", "microbatch_squares", "positions",
           "sized_samples"]


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
    limit = quantity_limit(quantity)
    high = limit if quantity.high is None else min(quantity.high, limit)
    values = np.clip(values, quantity.low, high)
    return np.rint(values).astype(np.int64)


@dataclass(frozen=True)
class ItemSet:
    """Items of one kind (e.g. images to encode) across samples: sizes flat, by sample."""

    counts: np.ndarray   # items per sample, shape (n,)
    sizes: np.ndarray    # size of each item (tokens), shape (counts.sum(),)
    # The positions each item takes in the backbone's sequence, where a projector
    # compresses it (``ir.program.ImageTokens``); None: its size.
    backbone: np.ndarray | None = None

    def per_sample(self, values: np.ndarray) -> np.ndarray:
        """Sum ``values`` (one per item) over each sample's items."""
        if not len(values):
            return np.zeros(len(self.counts))
        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        return np.bincount(owner, weights=values, minlength=len(self.counts))

    def tokens(self) -> np.ndarray:
        """Total item tokens per sample (what the encoder runs on)."""
        return self.per_sample(self.sizes.astype(float))

    @property
    def backbone_sizes(self) -> np.ndarray:
        """Each item's positions in the backbone's sequence."""
        return self.sizes if self.backbone is None else self.backbone

    def backbone_tokens(self) -> np.ndarray:
        """Total positions per sample that the items take in the backbone's sequence."""
        return self.per_sample(self.backbone_sizes.astype(float))

    def take(self, counts: np.ndarray, keep: np.ndarray) -> ItemSet:
        """The items ``keep`` selects (a boolean mask or indices), ``counts`` per sample."""
        return ItemSet(counts=counts, sizes=self.sizes[keep],
                       backbone=None if self.backbone is None else self.backbone[keep])


def backbone_sizes(tokens: ir.ImageTokens, patches: np.ndarray) -> np.ndarray | None:
    """The backbone positions of drawn images of ``patches`` patches each
    (``ImageTokens.of_patches``, once per distinct size); None without compression."""
    if tokens.compress is None:
        return None
    values, inverse = np.unique(np.asarray(patches, dtype=np.int64), return_inverse=True)
    return np.array([tokens.of_patches(int(v)) for v in values],
                    dtype=np.int64)[inverse].reshape(-1)


@dataclass(frozen=True)
class SampleSet:
    """n samples: their text tokens and, per item kind, their items."""

    text_tokens: np.ndarray
    items: dict[str, ItemSet]   # keys such as "image", "image.gen", "audio"
    # Packed sequences (``train.packing``): per sequence, the sum over its documents of
    # their positions squared (what its attention costs, ``flops.backbone_attention``).
    # None: every sample is one document.
    doc_squares: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.text_tokens)


def _item_draws(data: ir.Data, modality: str, total: int, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """What is drawn of ``total`` items of an encoder modality, before any encoder's rule
    reads it: image patches; audio ``audio.frames``; video ``video.frames`` and
    ``video.patches`` (the second array; None for the others)."""
    if modality == "image":
        return draw(data.get("image", "patches"), total, rng), None
    if modality == "audio":
        return draw(data.get("audio", "frames"), total, rng), None
    frames = draw(data.get("video", "frames"), total, rng)
    return frames, draw(data.get("video", "patches"), total, rng)


def _item_sizes(modality: str, drawn: tuple[np.ndarray, np.ndarray | None],
                rule: InputRule | None = None) -> np.ndarray:
    """Tokens per item of the draws ``drawn`` (``_item_draws``) as an encoder's items have
    them at runtime (``ir.modal.drawn_tokens`` of its ``rule``: an audio clip's tokens
    rounded to whole rows of patches, a video's frames rounded up to whole temporal
    patches times its square frames' patches; image patches as drawn)."""
    if modality == "image":
        return drawn[0]
    if rule is None:
        rule = InputRule(name="", modality=modality, patch=1, mel_bins=1)
    return drawn_tokens(rule, drawn[0], drawn[1])


def item_key(program: ir.Program, module: ir.Module) -> str:
    """The ``SampleSet.items`` key of encoder ``module``'s items: its modality for the
    first encoder of that modality, else ``"<modality>@<name>"``. Every encoder of a
    modality encodes the same items (the sample's images or clips, ``ir.modal``), each
    with its own tokens, which take positions in the backbone's sequence too: a second
    key, not a second draw. The stage graph, the cost model and the simulator read each
    encoder's own."""
    first = next(m for m in program.encoders if m.modality == module.modality)
    return module.modality if first.name == module.name else \
        f"{module.modality}@{module.name}"


def draw_samples(program: ir.Program, n: int, seed: int = 0) -> SampleSet:
    """n sequences as the runtime trains on them, drawn from the spec's data block (only
    what its modules read): each drawn sample cut to ``seq_len`` as the sources cut it
    (``ir.layout``: its encoders' items first, an item that does not fit dropped with
    those after it, then the text that fits), and with ``train.packing`` the samples packed
    into sequences as ``ir.layout.pack`` packs them (a sequence's text and items are its
    samples')."""
    if not program.train.packing:
        return _cut(program, _draw_documents(program, n, np.random.default_rng(seed)))
    from dtdsl.ir.layout import Packer

    rng = np.random.default_rng(seed)
    packer = Packer(program.train.seq_len)
    docs: list[SampleSet] = []
    closed = False
    while not closed:
        # Draw more documents and pack them on from where the stream stopped (closed
        # sequences only: the open ones wait for the documents after them).
        docs.append(_cut(program, _draw_documents(program, max(2 * n, 64), rng)))
        # Python ints: pack compares each length with every open sequence's room.
        closed = packer.feed(positions(docs[-1]).tolist(), rows=n)
    return _join(_concat(docs), packer.done)


def positions(samples: SampleSet) -> np.ndarray:
    """Each sample's positions in the backbone's sequence: its text and encoder items (as
    their projectors compress them)."""
    total = samples.text_tokens.astype(np.int64).copy()
    for key, items in samples.items.items():
        if not key.endswith(".gen"):
            total += items.backbone_tokens().astype(np.int64)
    return total


def attention_squares(samples: SampleSet) -> np.ndarray:
    """Each sequence's documents' positions squared, summed (``SampleSet.doc_squares``;
    its positions squared when it is one document): ``flops.backbone_attention``'s
    argument."""
    if samples.doc_squares is not None:
        return samples.doc_squares.astype(float)
    return positions(samples).astype(float) ** 2


def microbatch_squares(samples: SampleSet, micro_batch: int, *, packed: bool) -> np.ndarray:
    """Per microbatch (``microbatch_lengths``' runs), the mean over its sequences of their
    ``attention_squares`` once padded to its longest sequence: with ``packed`` documents
    (document masks) the padding after a sequence's documents is one more document, so
    its square adds; without, causal attention runs over the whole padded row."""
    lengths = positions(samples).astype(float)
    padded = microbatch_lengths(lengths, micro_batch)
    if not packed:
        return padded ** 2
    longest = np.repeat(padded, micro_batch)[:len(lengths)]
    rows = attention_squares(samples) + (longest - lengths) ** 2
    group = np.arange(len(lengths)) // micro_batch
    return np.bincount(group, weights=rows) / np.bincount(group)


def microbatch_lengths(lengths: np.ndarray, micro_batch: int) -> np.ndarray:
    """The length the backbone pads each microbatch to: the longest of each run of
    ``micro_batch`` consecutive sequences (the runtime pads a microbatch to its longest
    sequence, ``models.multimodal.backbone_input``); a short last run counts too."""
    lengths = np.asarray(lengths, dtype=float)
    n = len(lengths)
    if n == 0:
        return lengths
    groups = -(-n // micro_batch)
    padded = np.full(groups * micro_batch, -np.inf)
    padded[:n] = lengths
    return padded.reshape(groups, micro_batch).max(axis=1)


def _cut(program: ir.Program, samples: SampleSet) -> SampleSet:
    """Each sample cut to ``seq_len`` as ``ir.layout.fit`` cuts a synthetic sample (its
    items first, then its text): an item that does not fit is dropped with all that
    follows it, text included; a sample whose first item alone does not fit keeps its
    text, without items."""
    seq_len = program.train.seq_len
    room = np.full(len(samples), seq_len, dtype=np.int64)
    stopped = np.zeros(len(samples), dtype=bool)     # an item was dropped: nothing follows
    any_kept = np.zeros(len(samples), dtype=bool)
    items = dict(samples.items)
    encoders = [k for k in samples.items if not k.endswith(".gen")]
    for key in encoders:
        item = samples.items[key]
        if not len(item.sizes):
            continue
        owner = np.repeat(np.arange(len(item.counts)), item.counts)
        length = item.backbone_sizes          # what an item takes of the sequence
        cum = np.cumsum(length)
        has = item.counts > 0
        first = (np.cumsum(item.counts) - item.counts)[has]
        before = np.repeat(cum[first] - length[first], item.counts[has])
        # The items' running total within their sample only grows: what fits is a prefix.
        keep = (cum - before <= room[owner]) & ~stopped[owner]
        counts = np.bincount(owner[keep], minlength=len(item.counts)).astype(np.int64)
        used = np.bincount(owner[keep], weights=length[keep],
                           minlength=len(item.counts)).astype(np.int64)
        room, any_kept = room - used, any_kept | (counts > 0)
        stopped |= counts < item.counts
        items[key] = item.take(counts, keep)
    text = np.where(stopped, 0, np.minimum(samples.text_tokens, room))
    # Nothing would be left: the text alone, without items.
    alone = stopped & ~any_kept
    if alone.any():
        text = np.where(alone, np.minimum(samples.text_tokens, seq_len), text)
    return SampleSet(text_tokens=text, items=items)


def _concat(parts: list[SampleSet]) -> SampleSet:
    keys = parts[0].items.keys()
    packed = any(p.doc_squares is not None for p in parts)
    return SampleSet(
        text_tokens=np.concatenate([p.text_tokens for p in parts]),
        items={k: ItemSet(counts=np.concatenate([p.items[k].counts for p in parts]),
                          sizes=np.concatenate([p.items[k].sizes for p in parts]),
                          backbone=None if parts[0].items[k].backbone is None else
                          np.concatenate([p.items[k].backbone for p in parts]))
               for k in keys},
        doc_squares=np.concatenate([attention_squares(p) for p in parts]) if packed else None)


def _join(samples: SampleSet, rows: list[list[int]]) -> SampleSet:
    """The sequences ``rows`` (lists of sample indices) of ``samples``, each keeping its
    documents' squared lengths (``doc_squares``)."""
    order = np.asarray([i for r in rows for i in r], dtype=np.int64)
    owner = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    squares = np.bincount(owner, weights=attention_squares(samples)[order],
                          minlength=len(rows))
    text = np.bincount(owner, weights=samples.text_tokens[order],
                       minlength=len(rows)).astype(np.int64)
    items = {}
    for key, item in samples.items.items():
        starts = (np.cumsum(item.counts) - item.counts).astype(np.int64)
        # Each document's items, the documents in ``order``: one gather.
        taken = item.counts[order]
        first = np.repeat(starts[order] - (np.cumsum(taken) - taken), taken)
        counts = np.bincount(owner, weights=taken, minlength=len(rows)).astype(np.int64)
        items[key] = item.take(counts, first + np.arange(int(taken.sum())))
    return SampleSet(text_tokens=text, items=items, doc_squares=squares)


def _draw_documents(program: ir.Program, n: int, rng: np.random.Generator) -> SampleSet:
    """n samples as the data block draws them, before any cut."""
    data = program.data
    text = draw(data.get("text", "tokens"), n, rng)
    items: dict[str, ItemSet] = {}
    # Per encoder modality its items' counts and draws, made once for the first encoder
    # of that modality and read by every other (``ir.modal``: hybrid towers).
    shared: dict[str, tuple[np.ndarray, tuple[np.ndarray, np.ndarray | None]]] = {}
    for module in program.modules:
        if module.role == "encoder":
            rule = InputRule.of(program, module)
            if module.modality not in shared:
                counts = draw(data.get(module.modality, "count"), n, rng)
                shared[module.modality] = (counts, _item_draws(
                    data, module.modality, int(counts.sum()), rng))
            counts, drawn = shared[module.modality]
            sizes = _item_sizes(module.modality, drawn, rule)
            backbone = backbone_sizes(rule.image, sizes) if rule.image is not None else None
            items[item_key(program, module)] = ItemSet(counts=counts, sizes=sizes,
                                                       backbone=backbone)
        elif module.role == "generator" and f"{module.modality}.gen" not in items:
            counts = draw(data.get(module.modality, "gen_count"), n, rng)
            # A generator's work is per item (a fixed latent): one unit each.
            items[f"{module.modality}.gen"] = ItemSet(
                counts=counts, sizes=np.ones(int(counts.sum()), dtype=np.int64))
    return SampleSet(text_tokens=text, items=items)


def sized_samples(program: ir.Program, sizes: Sequence[SampleSizes]) -> SampleSet:
    """The cost model's view of real samples: text tokens, and per encoder modality and
    generated modality the items' sizes (patches per image, and its tokens in the backbone
    where the projector compresses them; an audio or video clip's patches,
    ``ir.modal``; one unit per generated item); of packed sequences also their
    documents' squared lengths. Keys as the cost model's (``item_key``).

    Torch-free: the telemetry process of a run (``train.launch``) simulates each step's
    batch from its sizes without importing torch."""
    rules = encoder_inputs(program)
    tokens = program.image_tokens()
    items: dict[str, ItemSet] = {}
    for module in program.modules:
        if module.role == "encoder":
            key = item_key(program, module)
            if module.name == rules.image:
                shapes = [hw for sz in sizes for hw in sz.image_shapes]
                items[key] = ItemSet(
                    counts=np.array([len(sz.image_shapes) for sz in sizes], dtype=np.int64),
                    sizes=np.array([math.prod(tokens.grid(h, w)) for h, w in shapes],
                                   dtype=np.int64),
                    backbone=None if tokens.compress is None else
                    np.array([tokens(h, w) for h, w in shapes], dtype=np.int64))
            else:
                rule = rules.rule(module.name)
                per = [sz.inputs.get(module.name, ()) for sz in sizes]
                compress = rule.image is not None and rule.image.compress is not None
                items[key] = ItemSet(
                    counts=np.array([len(p) for p in per], dtype=np.int64),
                    sizes=np.array([rule.patches(x) for p in per for x in p], dtype=np.int64),
                    backbone=np.array([rule.tokens(x) for p in per for x in p],
                                      dtype=np.int64) if compress else None)
        elif module.role == "generator" and f"{module.modality}.gen" not in items:
            counts = np.array([sz.gen_counts.get(module.name, 0) for sz in sizes],
                              dtype=np.int64)
            items[f"{module.modality}.gen"] = ItemSet(
                counts=counts, sizes=np.ones(int(counts.sum()), dtype=np.int64))
    squares = None
    if any(sz.doc_text is not None for sz in sizes):
        # Packed sequences: attention is priced per document (``flops.backbone_attention``).
        squares = np.array([sum(n * n for _, n in layout_of(sz, rules, program.train.seq_len)
                                .spans) for sz in sizes], dtype=float)
    return SampleSet(text_tokens=np.array([sz.text_tokens for sz in sizes], dtype=np.int64),
                     items=items, doc_squares=squares)
