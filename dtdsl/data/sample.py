"""Deterministic synthetic training data: real tensors for every sample of a global batch.

``make_batch(program, step)`` gives the ``train.global_batch`` samples of one training
step; ``make_sample(program, step, index)`` gives one of them alone, equal to the one
in the batch. Every sample is seeded from ``(train.seed, step, index)`` only, so any
rank of a distributed run can build exactly the samples it was routed, in any order,
and a single-process reference run builds the very same tensors.

What a sample carries (sizes drawn with ``dtdsl.cost.samples.draw``, so they follow the
spec's distributions and clamps exactly as the cost model and simulator see them):

- ``tokens``: ``text.tokens`` int64 token ids. They are not uniform noise but a walk on
  a fixed sparse Markov chain (``_SUCCESSORS`` successors per token, seeded by the spec
  seed alone, successors drawn Zipf-skewed over the vocabulary), so a language model can
  learn something in a few steps and a training loss visibly falls;
- ``images``: ``image.count`` float32 images ``[3, H, W]`` for the image encoder: square,
  ``H = W = g * patch`` where ``g = round(sqrt(image.patches))`` (at least 1), so the
  encoder sees ``g^2`` patches (exactly ``image.patches`` when it is a square number, as
  in every shipped spec); under a pixel-shuffling projector ``g`` is rounded to a
  multiple of its factor (``ImageTokens.square_side``);
- ``targets``: per generator (by module name) ``GenTargets``: ``gen_count`` latents
  ``[G, C, L, L]`` (``C`` the generator's ``latent_channels``, ``L`` its ``latent``),
  with the noise ``[G, C, L, L]`` and the integer timesteps ``[G]`` in
  ``[0, T)`` of the denoising loss (``T``: the generator's ``timesteps``).

The tensors' types (``Sample``, ``GenTargets``) and the encoders' packing live in
``models.inputs``, what the models read.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import replace
from functools import cache

import numpy as np
import torch

from dtdsl.cost.samples import draw
from dtdsl.ir import program as ir
from dtdsl.ir.layout import fit
from dtdsl.ir.modal import encoder_inputs
from dtdsl.ir.sizes import SampleSizes
from dtdsl.models.diffusion import DEFAULT_TIMESTEPS
from dtdsl.models.inputs import GenTargets, Sample, image_encoder

__all__ = [
    "DIFFUSION_STEPS",
    "SampleSizes",
    "image_side",
    "join_samples",
    "join_sizes",
    "make_batch",
    "make_sample",
    "sample_seed",
    "sample_sizes",
]

DIFFUSION_STEPS = DEFAULT_TIMESTEPS   # DDPM's discrete timesteps (a generator may have others)
_SUCCESSORS = 4            # successors per token in the text Markov chain
_ZIPF_A = 1.1              # skew of the successor draw over the vocabulary


def sample_seed(seed: int, step: int, index: int, what: str = "") -> int:
    """A 63-bit seed for one sample (and one stream ``what`` of it), stable across
    processes and Python versions (no ``hash()``)."""
    digest = hashlib.sha256(f"dtdsl:{seed}:{step}:{index}:{what}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def image_side(patches: int, patch: int, tokens: ir.ImageTokens | None = None) -> int:
    """The side in pixels of the square image with about ``patches`` patches of ``patch``
    pixels; with ``tokens``, its side in patches a multiple of their ``block`` (so that a
    compressing projector takes its grid, ``ImageTokens.square_side``)."""
    if tokens is None:
        return max(1, round(math.sqrt(patches))) * patch
    return tokens.square_side(patches) * patch


@cache
def _successor_table(seed: int, vocab: int) -> tuple[tuple[int, ...], ...]:
    """``vocab`` rows of ``_SUCCESSORS`` next-token candidates: fixed by the spec seed."""
    gen = torch.Generator().manual_seed(sample_seed(seed, -1, -1, "markov"))
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks ** -_ZIPF_A
    perm = torch.randperm(vocab, generator=gen)                # which ids are frequent
    picks = torch.multinomial(probs, vocab * _SUCCESSORS, replacement=True, generator=gen)
    return tuple(map(tuple, perm[picks].view(vocab, _SUCCESSORS).tolist()))


def _draw_one(quantity: ir.Quantity | None, rng: np.random.Generator, what: str) -> int:
    if quantity is None:
        raise ValueError(f"the spec's data block has no {what}, which the model needs")
    return int(draw(quantity, 1, rng)[0])


def join_samples(docs: Sequence[Sample], sizes: SampleSizes, index: int) -> Sample:
    """One packed sequence at position ``index`` of ``docs`` (each one document, with any
    parts), whose sizes are ``sizes`` (``join_sizes`` of theirs): their tokens, images and
    targets one after the other."""
    if len(docs) == 1:
        return replace(docs[0], index=index)
    targets = {}
    for g in sizes.gen_counts:
        parts = [d.targets[g] for d in docs if g in d.targets]
        if parts:
            targets[g] = GenTargets.cat(parts)
    return Sample(step=docs[0].step, index=index, tokens=torch.cat([d.tokens for d in docs]),
                  images=tuple(im for d in docs for im in d.images), targets=targets,
                  image_at=sizes.image_at, trained=sizes.trained, doc_text=sizes.doc_text,
                  doc_images=sizes.doc_images, doc_gen=sizes.doc_gen,
                  inputs={k: tuple(x for d in docs for x in d.inputs.get(k, ()))
                          for k in sizes.inputs},
                  inputs_at=sizes.inputs_at, doc_inputs=sizes.doc_inputs)


def join_sizes(docs: Sequence[SampleSizes]) -> SampleSizes:
    """One packed sequence of ``docs`` (each one document), in order; a single document
    is itself."""
    if len(docs) == 1:
        return docs[0]
    text = images = 0
    image_at: list[int] = []
    trained: list[tuple[int, int]] = []
    names = sorted({g for d in docs for g in d.gen_counts})
    keys = sorted({k for d in docs for k in d.inputs})
    inputs_at: dict[str, list[int]] = {k: [] for k in keys}
    for d in docs:
        if d.doc_text is not None:
            raise ValueError("a packed sequence is packed again")
        image_at.extend(p + text for p in d.places)
        for k in keys:
            inputs_at[k].extend(p + text for p in d.input_places(k))
        trained.extend((a + text, b + text) for a, b in d.trained_ranges)
        text, images = text + d.text_tokens, images + len(d.image_shapes)
    return SampleSizes(
        text_tokens=text, image_shapes=tuple(s for d in docs for s in d.image_shapes),
        gen_counts={g: sum(d.gen_counts.get(g, 0) for d in docs) for g in names},
        image_at=tuple(image_at), trained=tuple(trained),
        doc_text=tuple(d.text_tokens for d in docs),
        doc_images=tuple(len(d.image_shapes) for d in docs),
        doc_gen={g: tuple(d.gen_counts.get(g, 0) for d in docs) for g in names},
        cut=sum(d.cut for d in docs),
        inputs={k: tuple(s for d in docs for s in d.inputs.get(k, ())) for k in keys},
        inputs_at={k: tuple(v) for k, v in inputs_at.items()},
        doc_inputs={k: tuple(len(d.inputs.get(k, ())) for d in docs) for k in keys})


def sample_sizes(program: ir.Program, step: int, index: int) -> SampleSizes:
    """The sizes of sample ``index`` of step ``step`` (those of ``make_sample``'s sample)
    from its ``sizes`` stream alone, cut to ``seq_len`` (``ir.layout.fit``): no tensor
    is built."""
    sizes = np.random.default_rng(sample_seed(program.train.seed, step, index, "sizes"))
    data = program.data
    n_text = max(1, _draw_one(data.get("text", "tokens"), sizes, "text.tokens"))
    sides: list[int] = []
    encoder = image_encoder(program)
    tokens = program.image_tokens()
    # Per modality the items' draws, made once: every encoder of a modality encodes the
    # same items, each at its own shape (``ir.modal``).
    drawn: dict[str, list[tuple[int, ...]]] = {}
    if encoder is not None:
        count = max(0, _draw_one(data.get("image", "count"), sizes, "image.count"))
        patches = draw(data.get("image", "patches"), count, sizes) if count else []
        drawn["image"] = [(int(p),) for p in patches]
        sides = [image_side(int(p), tokens.patch, tokens) for p in patches]
    rules = encoder_inputs(program)
    inputs = {}
    for rule in rules.others:
        if rule.modality not in drawn:
            drawn[rule.modality] = _draw_items(rule.modality, data, sizes)
        inputs[rule.name] = tuple(rule.synthetic_shape(*d) for d in drawn[rule.modality])
    gen_counts = {
        module.name: max(0, _draw_one(data.get(module.modality, "gen_count"), sizes,
                                      f"{module.modality}.gen_count"))
        for module in program.generators}
    drawn = SampleSizes(text_tokens=n_text, image_shapes=tuple((s, s) for s in sides),
                        gen_counts=gen_counts, inputs=inputs)
    # Cut to seq_len as every source cuts its samples (ir.layout): items that do not
    # fit are dropped, the text cut.
    return fit(drawn, rules, program.train.seq_len)


def _draw_items(modality: str, data: ir.Data, rng: np.random.Generator
                ) -> list[tuple[int, ...]]:
    """One sample's items of ``modality`` as the cost model draws them
    (``cost.samples``): its count, then each item's size (image patches, audio frames,
    video frames then patches), the arguments of ``InputRule.synthetic_shape``."""
    m = modality
    count = max(0, _draw_one(data.get(m, "count"), rng, f"{m}.count"))
    if not count:
        return []
    if m == "image":
        return [(int(p),) for p in draw(data.get("image", "patches"), count, rng)]
    frames = _draw_many(data.get(m, "frames"), count, rng, f"{m}.frames")
    if m == "audio":
        return [(int(f),) for f in frames]
    patches = _draw_many(data.get(m, "patches"), count, rng, f"{m}.patches")
    return [(int(f), int(p)) for f, p in zip(frames, patches, strict=True)]


def _draw_many(quantity: ir.Quantity | None, n: int, rng: np.random.Generator,
               what: str) -> np.ndarray:
    if quantity is None:
        raise ValueError(f"the spec's data block has no {what}, which the model needs")
    return draw(quantity, n, rng)


_PARTS = frozenset({"tokens", "images", "targets"})


def make_sample(program: ir.Program, step: int, index: int, *,
                parts: frozenset[str] | set[str] = _PARTS,
                sizes: SampleSizes | None = None) -> Sample:
    """Sample ``index`` of step ``step``'s global batch, built alone.

    ``parts`` (default all of ``tokens``, ``images``, ``targets``) names what to build;
    a part left out is empty (no tokens, no images, no targets) and only what the parts
    asked for costs time. The parts built are identical to the full sample's: tensors
    come from one random stream in the order tokens, images, targets, so asking for
    ``targets`` still draws (and drops) the images' numbers. ``sizes``: this sample's
    ``sample_sizes`` when the caller already has them."""
    unknown = set(parts) - _PARTS
    if unknown:
        raise ValueError(f"unknown sample parts {sorted(unknown)}; known: {sorted(_PARTS)}")
    seed = program.train.seed
    if sizes is None:
        sizes = sample_sizes(program, step, index)
    gen = torch.Generator().manual_seed(sample_seed(seed, step, index, "tensors"))

    vocab = program.backbone.arch.vocab
    n_text = sizes.text_tokens
    first = int(torch.randint(vocab, (1,), generator=gen))
    choice = torch.randint(_SUCCESSORS, (n_text,), generator=gen)
    if "tokens" in parts:
        rows = _successor_table(seed, vocab)
        ids = [first]
        for k in choice[1:].tolist():
            ids.append(rows[ids[-1]][k])
        tokens = torch.tensor(ids[:n_text], dtype=torch.int64)   # none when cut to 0
    else:
        tokens = torch.empty(0, dtype=torch.int64)

    images: list[torch.Tensor] = []
    inputs: dict[str, tuple[torch.Tensor, ...]] = {}
    if "images" in parts or "targets" in parts:
        for h, w in sizes.image_shapes:
            images.append(torch.randn(3, h, w, generator=gen))
        # Every other encoder's items (the encoders' spec order), after the images: an
        # image-only sample draws exactly what it drew before encoders had inputs.
        for name, shapes in sizes.inputs.items():
            inputs[name] = tuple(torch.randn(shape, generator=gen) for shape in shapes)

    targets: dict[str, GenTargets] = {}
    if "targets" in parts:
        for module in program.generators:
            arch = module.arch
            count = sizes.gen_counts[module.name]
            shape = (count, arch.latent_channels, arch.latent, arch.latent)
            targets[module.name] = GenTargets(
                latents=torch.randn(shape, generator=gen),
                noise=torch.randn(shape, generator=gen),
                timesteps=torch.randint(arch.timesteps, (count,), generator=gen))
    keep = "images" in parts
    return Sample(step=step, index=index, tokens=tokens,
                  images=tuple(images) if keep else (), targets=targets,
                  inputs={k: v if keep else () for k, v in inputs.items()},
                  inputs_at=sizes.inputs_at if keep else None)


def make_batch(program: ir.Program, step: int) -> list[Sample]:
    """The ``train.global_batch`` samples of training step ``step``, in index order."""
    return [make_sample(program, step, i) for i in range(program.train.global_batch)]
