"""The multimodal model as per-unit steps that a disaggregated runtime can split.

``build_model(program, seed)`` builds every module and projector on one device, each
initialised from its own seed ``init_seed(seed, name)`` (the spec seed and the unit's
name only), so the parameters do not depend on the parallel layout: a distributed
runtime builds the full unit with the same seed and keeps its shard. Frozen modules
and projectors (``frozen = true``) get ``requires_grad = False``.

The forward pass is three steps, one per kind of unit, each a plain function of the
unit's torch modules and its inputs:

- ``encode(model, samples)``: each sample's images (grouped by size, no padding, see
  ``models.inputs.pack_images``) through the ViT and the encoder->backbone projector (which
  compresses each image's patch grid when the spec says so, ``models.mlp``): one
  ``[image tokens_i, hidden_llm]`` tensor per sample. Split into ``encoder_input`` and
  ``encoder_layers(encoder, xs, start, stop)`` for pipeline stages.
- ``backbone_step(model, image_embeds, samples)``: per sample its sequence as
  ``ir.layout`` places it: the text tokens with each image's embeddings spliced in
  where the sample puts it (``<image>`` in the text; before the text for synthetic and
  caption data), cut at ``seq_len``, right-padded to the longest sequence of the call
  (or to ``pad_to``, e.g. ``seq_len`` for fixed shapes: the model is causal, so padding
  after a sequence changes none of its outputs), causal LM. The LM loss is the *sum* of
  next-token cross-entropies of the sample's trained tokens (a caption's text and EOS;
  a conversation's assistant turns; every synthetic token but the first), each predicted
  at the position before it; none at image positions or padding. It also returns each
  sample's conditioning for the generators: the final normed hidden states of its last
  ``COND_TOKENS`` real tokens (all of them when it has fewer). Split into
  ``backbone_input``, ``backbone_layers(backbone, x, start, stop)`` and
  ``backbone_output`` for pipeline stages.
- ``generator_step(model, name, conditioning, targets)``: conditioning through the
  backbone->generator projector gives the cross-attention context; each target's
  clean latent is noised to its timestep under the generator's noise schedule, the
  generator predicts the noise or the velocity (``models.diffusion``: its scheduler
  config's); the result is the *sum* over targets of each target's mean squared error.

The loss of any subset of a step's samples is::

    loss = LM_sum(subset) / N_text + GEN_sum(subset) / N_gen

where ``N_text`` (text loss tokens) and ``N_gen`` (generation targets, all generators
together) are counted over the whole GLOBAL batch (``loss_normalizer``; at least 1
each). Both terms are sums over samples divided by batch-wide constants, so the losses
of any split of the global batch (DP replicas, microbatches) add up to the loss of the
whole batch, and so do their gradients: a distributed run sums them (no averaging over
replicas or microbatches).

U-Net generators are not split by layers (skip connections cross every level); the
encoder and backbone expose their ``layers`` lists, and the step functions take layer
ranges, so pipeline stages can run contiguous slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.cost.flops import lm_loss_chunk_rows
from dtdsl.ir import program as ir
from dtdsl.ir.layout import SequenceLayout, Tokens, layout_of
from dtdsl.ir.modal import EncoderInputs, encoder_inputs, pixel_norm
from dtdsl.ir.program import COND_TOKENS
from dtdsl.ir.sizes import SampleSizes
from dtdsl.models import build_module, build_projector, tie_weights
from dtdsl.models.attention import DocumentMask, document_mask, key_bias
from dtdsl.models.diffusion import noisy_and_target
from dtdsl.models.init import init_module
from dtdsl.models.inputs import (
    GenTargets,
    Pixels,
    Sample,
    image_encoder,
    pack_images,
    pack_items,
    unpack_images,
)
from dtdsl.models.transformer import (
    Backbone,
    Encoder,
    gather_sequence,
    scatter_sequence,
    sequence_parallel_degree,
)

__all__ = [
    "IGNORE",
    "BackboneBatch",
    "LossParts",
    "Model",
    "Normalizer",
    "backbone_input",
    "backbone_layers",
    "cp_document_ids",
    "padded_width",
    "backbone_output",
    "backbone_step",
    "build_model",
    "build_unit",
    "conditioning",
    "conditioning_rows",
    "document_masks",
    "document_targets",
    "encode",
    "encoder_items",
    "encoder_rows",
    "encoder_input",
    "encoder_layers",
    "encoder_output",
    "gather_sequence",
    "generator_step",
    "image_tokens",
    "init_unit",
    "layer_range",
    "lm_loss",
    "loss_normalizer",
    "loss_tokens",
    "microbatch_loss",
    "noised_latents",
    "packed_item_shapes",
    "packed_shapes",
    "padded_context",
    "scatter_sequence",
    "sequence_length",
    "sequence_parallel_degree",
    "sample_layout",
    "sample_sizes_of",
    "splice_items",
    "unit_spec",
]

IGNORE = -100      # target id of positions without a loss
_DENSE_LOSS = 0.9  # targets at this share of positions or more: the LM head on all of them


# ---- building --------------------------------------------------------------------------

def unit_spec(program: ir.Program, name: str) -> ir.Module | ir.Projector:
    """The module or projector called ``name``."""
    for p in program.projectors:
        if p.name == name:
            return p
    return program.module(name)


def init_unit(program: ir.Program, name: str, module: nn.Module, seed: int, *,
              prefix: str = "", skip: set[int] | None = None) -> None:
    """Initialise ``module`` (unit ``name``, or its part at ``prefix`` inside the unit; a
    materialised module, plain or sharded: TP and FSDP2 shards) from the unit's
    ``pretrained`` weights, each parameter's block read from its checkpoint
    (``models.hf.load_weights``), or else by ``models.init``'s layout-independent rules
    from the spec ``seed``; parameters whose ``id`` is in ``skip`` are left."""
    spec = unit_spec(program, name)
    if isinstance(spec, ir.Module) and spec.pretrained is not None:
        from dtdsl.models.hf import Checkpoint, load_weights

        assert spec.hf is not None, "the checker gives every pretrained module its source"
        with Checkpoint(spec.pretrained) as checkpoint:
            load_weights(module, spec.hf.family, spec.arch, checkpoint, skip=skip,
                         prefix=prefix)
        return
    layers = getattr(spec.arch, "layers", None) or getattr(spec.arch, "depth", 1)
    head = "output" if isinstance(spec, ir.Module) and spec.role == "backbone" else None
    init_module(module, seed=seed, unit=name, prefix=prefix, num_layers=int(layers),
                head=head, skip=skip)


def build_unit(program: ir.Program, name: str, seed: int, tp: int = 1, *,
               device: torch.device | str | None = None) -> nn.Module:
    """Module or projector ``name`` on ``device`` (default: the current default device),
    initialised by ``init_unit`` from ``seed`` (nothing is drawn from the global RNG),
    frozen if the spec says so. On the meta device nothing is initialised: a rank
    materialises and initialises what it owns (``train.stage``)."""
    spec = unit_spec(program, name)
    # Built on meta (no memory, no draws from the global RNG by torch's default
    # initialisers), then materialised and initialised once, by our rules.
    with torch.device("meta"):
        if isinstance(spec, ir.Projector):
            unit = build_projector(spec, tp=tp)
        else:
            unit = build_module(spec, tp=tp)
            if getattr(spec.arch, "moe", None) is not None:     # the step's aux loss
                from dtdsl.models.moe import set_aux_weight

                set_aux_weight(unit, spec.arch.moe.aux_loss_coef, program.train.global_batch)
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type != "meta":
        unit.to_empty(device=target)
        tie_weights(unit)
        init_unit(program, name, unit, seed)
    if spec.frozen:
        unit.requires_grad_(False)
    return unit


def layer_range(module: nn.Module, start: int = 0, stop: int | None = None) -> list[nn.Module]:
    """Layers ``start:stop`` (global indices) of an encoder or backbone, in order; a
    pipeline stage's module holds only its own (``layers`` is keyed by index)."""
    layers = module.layers
    total = int(max(map(int, layers.keys()), default=-1)) + 1 if stop is None else stop
    try:
        return [layers[str(i)] for i in range(start, total)]
    except KeyError as err:
        raise ValueError(f"layer {err.args[0]} is not held by this module (it holds "
                         f"{sorted(map(int, layers.keys()))})") from None


# ---- shapes ------------------------------------------------------------------------------

def image_tokens(sizes: SampleSizes, tokens: Tokens) -> int:
    """The tokens of a sample's images in the backbone's sequence (its rows there, as its
    image encoder's projector makes them: ``Program.image_tokens``)."""
    return sum(tokens(h, w) for h, w in sizes.image_shapes)


def encoder_rows(sizes: SampleSizes, rules: EncoderInputs, name: str) -> int:
    """The rows encoder ``name`` gives a sample in the backbone's sequence: its items'
    tokens (``ir.modal``), the images' for the image encoder."""
    if name == rules.image:
        return image_tokens(sizes, rules)
    rule = rules.rule(name)
    return sum(rule.tokens(shape) for shape in sizes.inputs.get(name, ()))


def encoder_items(sample: Sample, rules: EncoderInputs, name: str) -> tuple[torch.Tensor, ...]:
    """Encoder ``name``'s items of ``sample``: its images for the image encoder, else its
    ``inputs[name]``."""
    return sample.images if name == rules.image else sample.inputs.get(name, ())


def splice_items(parts: dict[str, torch.Tensor], layout: SequenceLayout) -> torch.Tensor:
    """One sample's rows from every encoder (``parts[key]``: its items' rows, in the
    encoder's item order; keys as ``ir.layout.placements`` names them) in the order
    ``layout`` places the items: what ``backbone_input`` splices. Without item keys (one
    encoder's items): the rows of the encoder that has any."""
    if not layout.items:
        rows = [p for p in parts.values() if p.shape[0]]
        if len(rows) > 1:
            raise ValueError("rows of several encoders, but the layout names no items")
        return rows[0] if rows else next(iter(parts.values()))
    # Each encoder's items by index: their first row among its rows.
    sizes: dict[str, dict[int, int]] = {}
    for (key, k), n in zip(layout.items, layout.image_tokens, strict=True):
        sizes.setdefault(key, {})[k] = n
    start: dict[tuple[str, int], int] = {}
    for key, by_index in sizes.items():
        at = 0
        for k in sorted(by_index):
            start[(key, k)] = at
            at += by_index[k]
    pieces = [parts[key][start[(key, k)]:start[(key, k)] + n]
              for (key, k), n in zip(layout.items, layout.image_tokens, strict=True)]
    return torch.cat(pieces) if pieces else next(iter(parts.values()))[:0]


def sequence_length(sizes: SampleSizes, tokens: ir.ImageTokens, seq_len: int) -> int:
    """The length of a sample's backbone sequence (``ir.layout``'s rule)."""
    return layout_of(sizes, tokens, seq_len).length


def packed_shapes(sizes: Sequence[SampleSizes], patch: int, extra_tokens: int = 0
                  ) -> list[tuple[int, int]]:
    """``(images, rows)`` of every group ``pack_images`` makes of these samples' images, in
    its order: what an encoder stage's activations look like, from sizes alone (``rows``:
    an image's patches plus ``extra_tokens``, its class token)."""
    groups: dict[tuple[int, int], int] = {}
    for sz in sizes:
        for h, w in sz.image_shapes:
            groups[(h, w)] = groups.get((h, w), 0) + 1
    return [(n, (h // patch) * (w // patch) + extra_tokens) for (h, w), n in groups.items()]


def packed_item_shapes(sizes: Sequence[SampleSizes], rules: EncoderInputs, name: str,
                       extra_tokens: int = 0) -> list[tuple[int, int]]:
    """``packed_shapes`` for encoder ``name``'s items (``pack_items``' groups): the image
    encoder's images, any other encoder's ``inputs[name]``, rows from its rule."""
    if name == rules.image:
        return packed_shapes(sizes, rules.image_tokens.patch, extra_tokens)
    rule = rules.rule(name)
    groups: dict[tuple[int, ...], int] = {}
    for sz in sizes:
        for shape in sz.inputs.get(name, ()):
            groups[tuple(shape)] = groups.get(tuple(shape), 0) + 1
    return [(n, rule.patches(shape) + extra_tokens) for shape, n in groups.items()]


class Model(nn.Module):
    """Every unit of a program: ``units[name]`` for modules and projectors alike, plus
    the names that wire them (``encoder``, ``backbone``, ``generators``,
    ``enc_proj`` and ``gen_proj[generator]``)."""

    def __init__(self, program: ir.Program, seed: int):
        super().__init__()
        enc = image_encoder(program)
        self.encoder = enc.name if enc is not None else None
        self.encoders = tuple(m.name for m in program.encoders)
        self.backbone = program.backbone.name
        self.generators = tuple(m.name for m in program.generators)
        self.seq_len = program.train.seq_len
        self.patch = (enc.arch.patch or 1) if enc is not None else 1
        # Every encoder's items and their rows in the backbone (``ir.modal``), an
        # image's as ``Program.image_tokens``.
        self.inputs = encoder_inputs(program)
        self.image_tokens: Tokens = self.inputs if self.inputs.others else \
            program.image_tokens()
        self.pixel_norm = pixel_norm(program)        # its images' mean and std

        def projector(source: str, target: str) -> str:
            for p in program.projectors:
                if p.source == source and p.target == target:
                    return p.name
            raise ValueError(f"the spec has no projector {source} -> {target}, which the "
                             "runtime needs")

        self.enc_proj = projector(self.encoder, self.backbone) if self.encoder else None
        self.enc_projs = {e: projector(e, self.backbone) for e in self.encoders}
        self.archs = {m.name: m.arch for m in program.modules}
        self.gen_proj = {g: projector(self.backbone, g) for g in self.generators}
        names = [m.name for m in program.modules] + [p.name for p in program.projectors]
        self.units = nn.ModuleDict({n: build_unit(program, n, seed) for n in names})
        # Generators' frozen VAE encoders: not units (nothing to train or save), but
        # submodules, so the model moves them with it.
        self.vaes = nn.ModuleDict()
        for m in program.generators:
            if m.vae is not None:
                from dtdsl.models.vae import VAEConfig, load_vae

                self.vaes[m.name] = load_vae(VAEConfig.of(m.vae),
                                             device=torch.get_default_device())

    def unit(self, name: str) -> nn.Module:
        return self.units[name]


def build_model(program: ir.Program, seed: int | None = None) -> Model:
    """All modules and projectors of ``program`` on the current default device, fp32;
    ``seed`` defaults to ``train.seed``."""
    return Model(program, program.train.seed if seed is None else seed)


# ---- loss normalisation ----------------------------------------------------------------

def sample_sizes_of(sample: Sample) -> SampleSizes:
    """A whole sample's sizes, from its tensors (tokens, images and targets)."""
    return SampleSizes(
        text_tokens=len(sample.tokens),
        image_shapes=tuple((int(im.shape[-2]), int(im.shape[-1])) for im in sample.images),
        gen_counts={g: len(t) for g, t in sample.targets.items()},
        image_at=sample.image_at, trained=sample.trained, doc_text=sample.doc_text,
        doc_images=sample.doc_images, doc_gen=sample.doc_gen,
        inputs={k: tuple(tuple(int(d) for d in x.shape) for x in v)
                for k, v in sample.inputs.items()},
        inputs_at=sample.inputs_at, doc_inputs=sample.doc_inputs)


def sample_layout(sample: Sample, tokens: ir.ImageTokens, seq_len: int) -> SequenceLayout:
    """Where a sample's text and images sit in its sequence, and which tokens are targets
    (``ir.layout``; the rule its ``SampleSizes`` give; ``tokens``: an image's tokens,
    ``Program.image_tokens``)."""
    return layout_of(sample_sizes_of(sample), tokens, seq_len)


def loss_tokens(sample: Sample, tokens: ir.ImageTokens, seq_len: int) -> int:
    """The sample's LM loss tokens: its trained tokens that fit in ``seq_len``, but one at
    the sequence's first position."""
    return sample_layout(sample, tokens, seq_len).loss_tokens


@dataclass(frozen=True)
class Normalizer:
    """The global batch's loss denominators."""

    text_tokens: int   # next-token losses over the whole global batch
    gen_targets: int   # generation targets over the whole global batch, all generators


def loss_normalizer(model: Model, samples: Sequence[Sample]) -> Normalizer:
    """The denominators of the loss of ``samples``, the WHOLE global batch."""
    return Normalizer(
        text_tokens=sum(loss_tokens(s, model.image_tokens, model.seq_len) for s in samples),
        gen_targets=sum(s.num_gen_targets for s in samples))


# ---- encoder -----------------------------------------------------------------------------

def encoder_input(encoder: Encoder, groups: Sequence[torch.Tensor],
                  grids: Sequence[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """Each packed group ``[B, N, patch_dim]`` (of images with patch grid ``grids[k]``) to
    the first layer's input: ``Encoder.embed`` (patch embedding, class token, positions,
    pre-norm; exactly what ``Encoder.forward`` does before its layers)."""
    if grids is None:
        grids = [None] * len(groups)
    return [encoder.embed(patches, grid) for patches, grid in zip(groups, grids, strict=True)]


def encoder_output(encoder: Encoder, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The last layer's output of each group to what the projector reads
    (``Encoder.finish``: post-norm, class token dropped)."""
    return [encoder.finish(x) for x in xs]


def encoder_layers(encoder: Encoder, xs: Sequence[torch.Tensor], start: int = 0,
                   stop: int | None = None,
                   cp: Sequence[tuple[torch.Tensor, Any]] | None = None
                   ) -> list[torch.Tensor]:
    """Layers ``start:stop`` of the encoder on each group. Under context parallelism
    ``x`` is this CP rank's shard of each group and ``cp[k]`` group ``k``'s real
    positions (what a rotary tower rotates by) and ``parallel.cp.CPContext``."""
    layers = layer_range(encoder, start, stop)
    out = []
    for k, x in enumerate(xs):
        positions, mask = (None, None) if cp is None else cp[k]
        for layer in layers:
            x = layer(x) if mask is None else layer(x, positions, mask)
        out.append(x)
    return out


def encode(model: Model, samples: Sequence[Sample]) -> list[torch.Tensor]:
    """Each sample's encoder tokens in backbone width ``[tokens_i, hidden_llm]``, every
    encoder's items in the order ``ir.layout`` places them (``[0, hidden_llm]``
    without items, or without an encoder)."""
    backbone: Backbone = model.unit(model.backbone)
    width = backbone.tok_embeddings.embedding_dim
    device = backbone.tok_embeddings.weight.device
    encoders = getattr(model, "encoders", (model.encoder,) if model.encoder else ())
    if not encoders:
        return [torch.zeros(0, width, device=device) for _ in samples]
    if model.encoder is not None and tuple(encoders) == (model.encoder,):
        return _encode_images(model, samples, width, device)
    rules: EncoderInputs = model.inputs
    parts = {name: (_encode_images(model, samples, width, device) if name == model.encoder
                    else _encode_items(model, name, samples, width, device))
             for name in encoders}
    out = []
    for b, s in enumerate(samples):
        sizes = sample_sizes_of(s)
        out.append(splice_items({n: p[b] for n, p in parts.items()},
                                layout_of(sizes, rules, model.seq_len)))
    return out


def _encode_images(model: Model, samples: Sequence[Sample], width: int,
                   device: torch.device) -> list[torch.Tensor]:
    """The image encoder's tokens of each sample, through its projector."""
    encoder: Encoder = model.unit(model.encoder)
    # uint8 pixels (a dataset's) normalised on the device, as the executor does.
    packed = pack_images([[im.to(device) for im in s.images] for s in samples], model.patch,
                         Pixels(*model.pixel_norm, device=device))
    hidden = encoder_output(encoder, encoder_layers(
        encoder, encoder_input(encoder, packed.groups, packed.grids)))
    projector = model.unit(model.enc_proj)
    # Per group of same-sized images, on its patch grid (a compressing projector's input).
    return unpack_images(packed, [projector(h, grid) for h, grid
                                  in zip(hidden, packed.grids, strict=True)], width=width)


def _encode_items(model: Model, name: str, samples: Sequence[Sample], width: int,
                  device: torch.device) -> list[torch.Tensor]:
    """Encoder ``name``'s tokens of each sample's ``inputs[name]``, through its projector."""
    encoder: Encoder = model.unit(name)
    packed = pack_items([[x.to(device) for x in s.inputs.get(name, ())] for s in samples],
                        model.inputs.rule(name))
    hidden = encoder_output(encoder, encoder_layers(
        encoder, encoder_input(encoder, packed.groups, packed.grids)))
    projector = model.unit(model.enc_projs[name])
    return unpack_images(packed, [projector(h, grid) for h, grid
                                  in zip(hidden, packed.grids, strict=True)], width=width)


# ---- backbone ----------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class BackboneBatch:
    """The backbone's input for a list of samples."""

    embeds: torch.Tensor            # [B, S, hidden]: text with images spliced in, zeros after
    targets: torch.Tensor           # [B, S] next-token ids, IGNORE where there is no loss
    lengths: tuple[int, ...]        # real (unpadded) length of each sequence
    positions: torch.Tensor | None = None   # packed documents (``document_masks``)
    mask: DocumentMask | None = None


def padded_width(length: int, tp: int = 1, cp: int = 1) -> int:
    """The width a microbatch whose longest sequence has ``length`` positions is padded
    to: a multiple of the sequence-parallel degree ``tp`` (equal pieces), and under
    context parallelism of ``2 * cp * tp`` (``parallel.cp``: each of ``cp`` ranks holds
    two equal chunks, each cut into ``tp`` pieces)."""
    unit = tp if cp == 1 else 2 * cp * tp
    return -(-length // unit) * unit


def backbone_input(backbone: Backbone, image_embeds: Sequence[torch.Tensor],
                   tokens: Sequence[torch.Tensor], layouts: Sequence[SequenceLayout],
                   pad_to: int | None = None, cp: int = 1) -> BackboneBatch:
    """Each sample's sequence as its ``layouts`` entry places it (``ir.layout``: text
    tokens with the sample's images, ``image_embeds[i]`` the rows of its images in order,
    spliced in; cut to the kept text), right-padded with zero embeddings to the longest
    (or ``pad_to``), and the next-token targets of its trained tokens. ValueError for an
    image the layout drops (sources fit their samples before they are encoded). ``cp``:
    the context-parallel degree the width is padded for (``padded_width``)."""
    device = backbone.tok_embeddings.weight.device
    lengths = [lay.length for lay in layouts]
    width = max(lengths, default=0) if pad_to is None else pad_to
    if width < max(lengths, default=0):
        raise ValueError(f"pad_to {pad_to} is shorter than a sequence of {max(lengths)}")
    # Sequence parallelism cuts the sequence into equal pieces: pad to a multiple.
    width = padded_width(width, sequence_parallel_degree(backbone), cp)
    # Where every kept text token and image row goes in the flat [B * S] batch, and which
    # positions predict which token: made on the host from the layouts, then two copies
    # and one embedding lookup per microbatch, whatever the samples hold.
    text_dst: list[int] = []
    image_dst: list[int] = []
    loss_dst: list[int] = []
    loss_src: list[int] = []
    kept: list[torch.Tensor] = []
    offset = 0
    for b, (ids, img, lay) in enumerate(zip(tokens, image_embeds, layouts, strict=True)):
        if img.shape[0] != sum(lay.image_tokens):
            raise ValueError(f"sample {b}: {img.shape[0]} image rows, but its layout keeps "
                             f"{sum(lay.image_tokens)} (fit the sample to seq_len first)")
        base = b * width
        for first, stop, at in lay.text_runs:
            text_dst.extend(range(base + at, base + at + stop - first))
        for start, n in zip(lay.image_starts, lay.image_tokens, strict=True):
            image_dst.extend(range(base + start, base + start + n))
        for (a, _), (lo, hi) in zip(_loss_tokens_of(lay), lay.loss_positions(), strict=True):
            loss_dst.extend(range(base + lo, base + hi))
            loss_src.extend(range(offset + a, offset + a + hi - lo))
        kept.append(ids[:lay.text])
        offset += lay.text
    flat_tokens = torch.cat(kept).to(device) if kept else torch.empty(0, dtype=torch.int64,
                                                                       device=device)
    text = backbone.embed(flat_tokens[None])[0]
    rows, hidden = len(layouts) * width, text.shape[-1]
    if not image_dst and len(text_dst) == rows:
        embeds = text.view(len(layouts), width, hidden)   # text only, no padding: no copy
    else:
        embeds = text.new_zeros(rows, text.shape[-1])
        embeds = embeds.index_copy(0, _index(text_dst, device), text)
        if image_dst:
            embeds = embeds.index_copy(0, _index(image_dst, device),
                                       torch.cat(list(image_embeds)).to(text.dtype))
        embeds = embeds.view(len(layouts), width, hidden)
    target = torch.full((rows,), IGNORE, dtype=torch.int64, device=device)
    if loss_dst:
        target[_index(loss_dst, device)] = flat_tokens[_index(loss_src, device)]
    positions, mask = document_masks(layouts, width, device)
    return BackboneBatch(embeds=embeds, targets=target.view(len(layouts), width),
                         lengths=tuple(lengths), positions=positions, mask=mask)


def _loss_tokens_of(lay: SequenceLayout) -> list[tuple[int, int]]:
    """The text-token ranges behind ``lay.loss_positions()``, in the same order."""
    out = []
    for a, b in lay.loss:
        for first, stop, _ in lay.text_runs:
            lo, hi = max(a, first), min(b, stop)
            if lo < hi:
                out.append((lo, hi))
    return out


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def document_masks(layouts: Sequence[SequenceLayout], width: int,
                   device: torch.device | str) -> tuple[torch.Tensor | None,
                                                         DocumentMask | None]:
    """``(positions [B, S], DocumentMask)`` of sequences packed from several documents
    (``ir.layout``): positions restart at 0 in every document, and a position attends
    to the positions of its own document up to itself (padding after the documents is
    one more document); built on the host from the layouts, copied without blocking
    (``models.attention.document_mask``). ``(None, None)`` when no sequence holds more
    than one document: plain causal attention over positions ``0..S-1``."""
    if all(len(lay.spans) <= 1 for lay in layouts):
        return None, None
    return document_mask([lay.spans for lay in layouts], width, device)


def cp_document_ids(layouts: Sequence[SequenceLayout], width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document ids [B, width], positions [B, width])`` on the host of the whole
    sequences under context parallelism (``parallel.cp``): each document's positions
    count from 0 (rotary embeddings rotate by them), the padding after the documents is a
    document of its own (a sequence of one sample is one document, so its attention is
    the causal attention of ``document_masks``' ``(None, None)``)."""
    from dtdsl.models.attention import document_ids

    docs, positions = document_ids([lay.spans for lay in layouts], width)
    return docs[:, :width].long(), positions


def backbone_layers(backbone: Backbone, x: torch.Tensor, start: int = 0,
                    stop: int | None = None, *, positions: torch.Tensor | None = None,
                    mask: Any = None, cp: int = 1,
                    lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Layers ``start:stop`` of the backbone on ``[B, S, hidden]`` (positions 0..S-1,
    causal; or ``positions`` and ``mask`` of packed documents, ``document_masks``), or
    under sequence parallelism on this TP rank's piece ``[B, S / tp, hidden]`` (attention
    and MLP gather the whole sequence, ``parallel.tp``). Under context parallelism over
    ``cp`` ranks ``x`` is this rank's shard, ``positions`` its real positions and
    ``mask`` the microbatch's ``parallel.cp.CPContext``. ``lengths``: each row's tokens
    before its padding, which an MoE layer routes alone (all rows when None)."""
    seq = x.shape[1] * sequence_parallel_degree(backbone) * cp
    rotation = backbone.rotation(positions, seq, x.device)    # once for all the layers
    valid = None        # [B, S]: the tokens, made for the first MoE layer only
    for layer in layer_range(backbone, start, stop):
        if not getattr(layer, "moe", False):
            x = layer(x, rotation, mask)
            continue
        if valid is None and lengths is not None:
            # Over the whole sequence: under sequence parallelism an MoE block gathers it;
            # under context parallelism, this CP rank's shard of it.
            ends = torch.tensor(lengths, device=x.device)[:, None]
            valid = torch.arange(seq, device=x.device) < ends
            if cp > 1:
                valid = mask.cp.shard(valid)
        x = layer(x, rotation, mask, valid)
    return x


def backbone_output(backbone: Backbone, x: torch.Tensor, targets: torch.Tensor,
                    *, loss_tokens: int | None = None, loss_rows: torch.Tensor | None = None,
                    chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage: final norm, then the summed next-token cross-entropy at the
    positions with a target (``lm_loss``, over chunks of ``chunk_rows`` rows). Returns
    ``(loss sum, normed hidden states [B, S, hidden])``. ``loss_tokens`` / ``loss_rows``:
    how many positions have a target and which (flat indices into ``[B, S]``), when the
    caller knows them from the samples' sizes (otherwise found here, which waits for the
    device)."""
    hidden = gather_sequence(backbone, backbone.norm(x))
    if loss_tokens is None:
        loss_tokens = int((targets != IGNORE).sum())
    if loss_tokens >= _DENSE_LOSS * targets.numel():
        # Nearly every position has a target: the head on all of them is cheaper than
        # gathering the rows (and scattering their gradient back).
        rows, labels = hidden.flatten(0, 1), targets.flatten()
    else:   # image tokens, padding: the head (vocabulary-wide) only where it counts
        if loss_rows is None:
            loss_rows = (targets.flatten() != IGNORE).nonzero().squeeze(1)
        rows = hidden.flatten(0, 1).index_select(0, loss_rows)
        labels = targets.flatten().index_select(0, loss_rows)
    return lm_loss(backbone.output, rows, labels, chunk_rows=chunk_rows), hidden


def lm_loss(head: nn.Module, rows: torch.Tensor, labels: torch.Tensor, *,
            chunk_rows: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``head(rows)`` ([N, hidden] -> [N, vocab]) against
    ``labels`` ([N], ``IGNORE`` counts nothing), computed over chunks of ``chunk_rows``
    rows (default ``cost.flops.lm_loss_chunk_rows``: a byte budget of fp32 logits) so the
    full fp32 logits are never held: each chunk's logits, their fp32 upcast and the
    cross-entropy run under activation checkpointing, which keeps only the chunk's rows
    (a slice of the hidden states, kept anyway) and recomputes its logits in backward,
    one chunk at a time. Equal to the unchunked loss up to fp32 summation order.

    A vocabulary-parallel head (``parallel.tp``: ``Shard(-1)`` DTensor logits) chunks the
    rows of this rank's shard of the vocabulary, its cross-entropy under ``loss_parallel``
    (which reduces the log-sum-exp over the TP group without gathering the vocabulary;
    its backward too runs under ``loss_parallel``, ``train.stage.Stage.backward_context``)."""
    from torch.utils.checkpoint import checkpoint

    if chunk_rows is None:
        weight = head.weight
        chunk_rows = lm_loss_chunk_rows(getattr(weight, "to_local", lambda: weight)().shape[0])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows {chunk_rows}: a chunk needs at least one row")
    total = None
    for start in range(0, max(rows.shape[0], 1), chunk_rows):
        part = (rows[start:start + chunk_rows], labels[start:start + chunk_rows])
        if torch.is_grad_enabled():
            loss = checkpoint(_chunk_loss, head, *part, use_reentrant=False,
                              preserve_rng_state=False)
        else:
            loss = _chunk_loss(head, *part)
        total = loss if total is None else total + loss
    assert total is not None
    return total


def _chunk_loss(head: nn.Module, rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk of ``lm_loss``: its logits, in fp32, through the cross-entropy (summed)."""
    logits = head(rows)
    if hasattr(logits, "placements"):
        # A vocabulary-parallel head (parallel.tp): each TP rank holds its columns of the
        # logits and the cross-entropy reduces across them (loss_parallel).
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE,
                                   reduction="sum")
        return loss.full_tensor()
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")


def conditioning(hidden: torch.Tensor, layouts: Sequence[SequenceLayout],
                 k: int = COND_TOKENS) -> list[torch.Tensor]:
    """Per sequence, each document's last ``min(k, length)`` hidden states, the documents'
    one after the other ``[rows, hidden]`` (``conditioning_rows``)."""
    out = []
    for i, lay in enumerate(layouts):
        parts = [hidden[i, start + max(0, n - k):start + n] for start, n in lay.spans]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return out


def conditioning_rows(layout: SequenceLayout, k: int = COND_TOKENS) -> list[int]:
    """The rows of each document's conditioning in ``conditioning``'s output."""
    return [min(k, n) for _, n in layout.spans]


def document_targets(conds: Sequence[torch.Tensor], targets: Sequence[GenTargets],
                     rows: Sequence[Sequence[int]], counts: Sequence[Sequence[int]]
                     ) -> tuple[list[torch.Tensor], list[GenTargets]]:
    """Per-sequence conditioning and targets split into their documents' (``rows``: each
    sequence's documents' conditioning rows, ``conditioning_rows``; ``counts``: their
    targets, the sizes' ``doc_gen``)."""
    out_c, out_t = [], []
    for c, t, r, n in zip(conds, targets, rows, counts, strict=True):
        if len(r) == 1:
            out_c.append(c)
            out_t.append(t)
            continue
        at = tt = 0
        for n_rows, n_targets in zip(r, n, strict=True):
            out_c.append(c[at:at + n_rows])
            out_t.append(t.slice(tt, tt + n_targets))
            at, tt = at + n_rows, tt + n_targets
    return out_c, out_t


def backbone_step(model: Model, image_embeds: Sequence[torch.Tensor],
                  samples: Sequence[Sample], pad_to: int | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole backbone: ``(LM loss sum, per-sample conditioning)``."""
    backbone: Backbone = model.unit(model.backbone)
    batch = backbone_input(backbone, image_embeds, [s.tokens for s in samples],
                           [sample_layout(s, model.image_tokens, model.seq_len)
                            for s in samples], pad_to)
    x = backbone_layers(backbone, scatter_sequence(backbone, batch.embeds),
                        positions=batch.positions, mask=batch.mask, lengths=batch.lengths)
    loss, hidden = backbone_output(backbone, x, batch.targets)
    return loss, conditioning(hidden, [sample_layout(s, model.image_tokens, model.seq_len)
                                       for s in samples])


# ---- generators --------------------------------------------------------------------------

def generator_step(model: Model, name: str, cond: Sequence[torch.Tensor],
                   targets: Sequence[GenTargets]) -> torch.Tensor:
    """Generator ``name`` on the samples' conditioning and targets (one of each per
    sample, the conditioning at most ``COND_TOKENS`` rows): the sum over targets of the
    mean squared noise-prediction error. Every target is in one batch, its context padded
    to ``COND_TOKENS`` rows and the padding masked out of the cross-attention: the
    generator's shapes are the same at every call (one compiled graph, as the cost model
    prices ``COND_TOKENS`` rows), its results those of the unpadded context."""
    generator = model.unit(name)
    projector = model.unit(model.gen_proj[name])
    device = next(generator.parameters()).device
    arch = model.archs[name]
    members = [(c, t) for c, t in zip(cond, targets, strict=True) if len(t)]
    total = torch.zeros((), device=device)
    vaes = getattr(model, "vaes", {})
    vae = vaes[name] if name in vaes else None
    if members:
        context, keep = padded_context(projector, members)
        batch = GenTargets.cat([t for _, t in members])
        noisy, target = noised_latents(arch, name, batch, vae, device)
        steps = batch.timesteps.to(device)
        # In the compute dtype of the generator's parameters (bf16 under mixed precision:
        # the context comes out of its projector in it); the error in fp32.
        pred = generator(noisy.to(context.dtype), steps, context,
                         key_bias(keep, context.dtype))
        total = total + ((pred.float() - target) ** 2).flatten(1).mean(dim=1).sum()
    return total


def noised_latents(arch: ir.UNetArch | ir.DiTArch, name: str, batch: GenTargets, vae: Any,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(noisy latents, prediction target)`` of generator ``name``'s targets ``batch``
    (``models.diffusion.noisy_and_target``): its clean latents, or those its frozen
    ``vae`` makes of its target images (no gradient)."""
    if batch.latents is not None:
        x0 = batch.latents.to(device)
    else:
        if vae is None:
            raise ValueError(f"generator {name}'s targets are images, but it has no VAE")
        assert batch.pixels is not None and batch.eps is not None
        pixels = batch.pixels.to(device).float().div_(127.5).sub_(1.0)
        x0 = vae.latents(pixels, batch.eps.to(device))
    return noisy_and_target(arch, x0, batch.noise.to(device), batch.timesteps.to(device))


def padded_context(projector: nn.Module, members: Sequence[tuple[torch.Tensor, GenTargets]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The projected conditioning of every target ``[targets, COND_TOKENS, dim]``, each
    sample's rows repeated for its targets and zero-padded, with the ``[targets,
    COND_TOKENS]`` boolean of its real rows."""
    contexts, keeps = [], []
    for c, t in members:
        rows = c.shape[0]
        if not 0 < rows <= COND_TOKENS:
            raise ValueError(f"a generator's conditioning has {rows} rows; it takes 1 to "
                             f"{COND_TOKENS} (each document's last states, conditioning)")
        projected = projector(c)
        padded = F.pad(projected, (0, 0, 0, COND_TOKENS - rows))
        keep = torch.arange(COND_TOKENS, device=c.device) < rows
        contexts.append(padded[None].expand(len(t), -1, -1))
        keeps.append(keep[None].expand(len(t), -1))
    return torch.cat(contexts), torch.cat(keeps)


# ---- the loss of a microbatch --------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class LossParts:
    total: torch.Tensor     # lm / N_text + gen / N_gen: the tensor to backpropagate
    lm_sum: torch.Tensor    # summed next-token cross-entropy
    gen_sum: torch.Tensor   # summed per-target denoising MSE, all generators


def microbatch_loss(model: Model, samples: Sequence[Sample], norm: Normalizer,
                    pad_to: int | None = None) -> LossParts:
    """The loss of ``samples`` (any subset of a global batch) with the global batch's
    denominators ``norm``; see the module docstring for the formula."""
    embeds = encode(model, samples)
    lm_sum, cond = backbone_step(model, embeds, samples, pad_to)
    gen_sum = torch.zeros((), device=lm_sum.device)
    layouts = [sample_layout(s, model.image_tokens, model.seq_len) for s in samples]
    rows = [conditioning_rows(lay) for lay in layouts]
    for name in model.generators:
        counts = [s.doc_gen[name] if s.doc_gen is not None else (len(s.targets[name]),)
                  for s in samples]
        conds, targets = document_targets(cond, [s.targets[name] for s in samples], rows,
                                          counts)
        gen_sum = gen_sum + generator_step(model, name, conds, targets)
    total = lm_sum / max(1, norm.text_tokens) + gen_sum / max(1, norm.gen_targets)
    return LossParts(total=total, lm_sum=lm_sum, gen_sum=gen_sum)
