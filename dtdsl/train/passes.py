"""The forward of each kind of pipeline stage: what a ``train.stage.StageModule`` runs
(``stage_run``), for ``train.executor`` (and ``dtc memcheck``, which builds stages alone).

Each reads the stage's ``StageState`` (``module.stage_state``): its unit's layers, and per
model ``chunk`` (an interleaved unit's, ``StageState.chunks``) the layers it runs and
whether it is the unit's first virtual stage (its embedding, co-located encoders) or its
last (head and loss, co-located generators, the projector out of an encoder)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.layout import SequenceLayout
from dtdsl.ir.modal import EncoderInputs, encoder_inputs
from dtdsl.models.inputs import PackedImages, image_encoder, unpack_images
from dtdsl.models.multimodal import (
    backbone_input,
    backbone_layers,
    backbone_output,
    conditioning,
    conditioning_rows,
    document_masks,
    document_targets,
    encoder_input,
    encoder_layers,
    encoder_output,
    generator_step,
    scatter_sequence,
    splice_items,
)
from dtdsl.parallel.cp import gather_sequence as cp_gather
from dtdsl.train.cp_run import cp_inputs, encoder_context
from dtdsl.train.generator import run_dit_stage
from dtdsl.train.stage import projector_between

__all__ = ["Units", "stage_run"]


class Units:
    """The few ``model.Model`` attributes the model's step functions read, for the units
    a stage holds (a rank never builds the whole model)."""

    def __init__(self, program: ir.Program, units: Any, vaes: dict[str, Any] | None = None):
        enc = image_encoder(program)
        self.units = units
        self.vaes = vaes or {}
        self.patch = (enc.arch.patch or 1) if enc is not None else 1
        self.inputs: EncoderInputs = encoder_inputs(program)
        self.image_tokens = self.inputs       # every encoder's items' rows (ir.modal)
        self.seq_len = program.train.seq_len
        self.backbone = program.backbone.name
        self.gen_proj = {g.name: projector_between(program, program.backbone.name, g.name)
                         for g in program.generators}
        self.archs = {m.name: m.arch for m in program.modules}

    def unit(self, name: str) -> torch.nn.Module:
        return self.units[name]


def _encoder_pass(module: Any, name: str, xs: Sequence[torch.Tensor], *, first: bool,
                  last: bool, start: int, stop: int | None,
                  grids: Sequence[tuple[int, int]] | None,
                  lengths: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Layers ``start:stop`` of encoder ``name`` on packed image groups ``xs``: from the
    pixels (``first``), and through its projector into the backbone (``last``).
    ``lengths``: each group's rows after the embedding, which a later stage under context
    parallelism receives in shards."""
    st = module.stage_state
    enc = module.units[name]
    if first:       # pixels to the compute dtype (the stage's root casts no input)
        xs = encoder_input(enc, [x.to(st.dtype) for x in xs], grids)
    # Context parallelism on the encoder's own ranks (a co-located encoder runs whole
    # on the backbone's, whatever the backbone's cp): each group's rows are sharded
    # after the embedding and gathered whole before the projector (``cp_run``).
    cp = st.cp if st.role.unit == name else None
    if cp is None:
        ys = encoder_layers(enc, xs, start, stop)
    else:
        if first:
            lengths = [x.shape[1] for x in xs]
            xs = [cp.shard(x) for x in xs]
        elif lengths is None:
            raise ValueError(f"{name}: a later stage under context parallelism needs each "
                             "group's whole length")
        ys = encoder_layers(enc, xs, start, stop,
                            cp=[encoder_context(cp, x.shape[0], n, x.device)
                                for x, n in zip(xs, lengths, strict=True)])
        if last:
            ys = [cp_gather(y, cp, n) for y, n in zip(ys, lengths, strict=True)]
    if last:
        proj = module.units[projector_between(st.program, name, st.program.backbone.name)]
        # Per group, on its images' patch grid (what a compressing projector reads).
        grids = [None] * len(ys) if grids is None else grids
        return [proj(h, grid) for h, grid in zip(encoder_output(enc, ys), grids, strict=True)]
    return ys


def _run_encoder(module: Any, xs: Sequence[torch.Tensor], *, first: bool,
                 grids: Sequence[tuple[int, int]] | None = None,
                 lengths: Sequence[int] | None = None, chunk: int = 0) -> list[torch.Tensor]:
    st = module.stage_state
    start, stop = st.layers_of(chunk)
    return _encoder_pass(module, st.role.unit, xs, first=first, last=st.last_of(chunk),
                         start=start, stop=stop, grids=grids, lengths=lengths)


def _hosted(module: Any, role: str) -> list[str]:
    """The co-located modules of ``role`` the stage runs (``StageState.hosted``)."""
    st = module.stage_state
    return [n for n in st.hosted if st.program.module(n).role == role]


def _hosted_embeds(module: Any, packed: PackedImages, name: str | None = None
                   ) -> list[torch.Tensor]:
    """Each sample's tokens in backbone width from the stage's co-located encoder
    ``name`` (default: its one) and its projector: the whole encoder, as an encoder unit
    of one stage runs it."""
    if name is None:
        (name,) = _hosted(module, "encoder")
    outs = _encoder_pass(module, name, packed.groups, first=True, last=True, start=0,
                         stop=None, grids=packed.grids)
    return unpack_images(packed, outs)


def _hosted_losses(module: Any, hidden: torch.Tensor, layouts: Sequence[SequenceLayout],
                   generation: dict[str, tuple[Sequence[Any], Sequence[Sequence[int]]]]
                   ) -> dict[str, torch.Tensor]:
    """Each co-located generator's summed loss (``generator_step``) on the conditioning
    of the backbone's final hidden states: ``generation`` holds, per generator, every
    sequence's targets and its documents' target counts."""
    st = module.stage_state
    conds = conditioning(hidden, layouts)
    rows = [conditioning_rows(lay) for lay in layouts]
    model = Units(st.program, module.units, st.vaes)
    out = {}
    for name in _hosted(module, "generator"):
        targets, counts = generation[name]
        docs_c, docs_t = document_targets(conds, targets, rows, counts)
        out[name] = generator_step(model, name, docs_c, docs_t)
    return out


def _run_backbone(module: Any, *, x: torch.Tensor | None = None,
                  image_embeds: Sequence[torch.Tensor] | None = None,
                  images: PackedImages | dict[str, PackedImages] | None = None,
                  tokens: Sequence[torch.Tensor] | None = None,
                  layouts: Sequence[SequenceLayout] | None = None,
                  targets: torch.Tensor | None = None,
                  loss_tokens: int | None = None,
                  loss_rows: torch.Tensor | None = None,
                  generation: dict[str, Any] | None = None,
                  received: dict[str, Sequence[torch.Tensor]] | None = None,
                  chunk: int = 0) -> tuple[Any, ...]:
    """A backbone stage's forward: ``(activations, targets)`` on an inner stage,
    ``(LM loss sum, final hidden states, {co-located generator: its loss sum})`` on the
    last. The first stage embeds ``tokens`` with ``image_embeds`` (received) or with
    what its co-located encoders make of ``images`` (per encoder where there are
    several), spliced with the other encoders' ``received`` rows (per encoder, per
    sample) in the layouts' order; the last runs its co-located
    generators on ``generation`` (``_hosted_losses``). ``chunk``: the model chunk that
    runs (an interleaved unit's: its layers; the first and last are the unit's first and
    last virtual stage's)."""
    st = module.stage_state
    bb = module.units[st.role.unit]
    assert layouts is not None
    if x is None:
        if isinstance(images, dict):    # several encoders: spliced in the layout's order
            made = {n: _hosted_embeds(module, packed, n) for n, packed in images.items()}
            rows = {**made, **(received or {})}
            image_embeds = [splice_items({n: r[b] for n, r in rows.items()}, layouts[b])
                            for b in range(len(layouts))]
        elif images is not None:    # the co-located encoder, in the same autograd graph
            image_embeds = _hosted_embeds(module, images)
        assert image_embeds is not None and tokens is not None
        batch = backbone_input(bb, image_embeds, tokens, layouts,
                               cp=1 if st.cp is None else st.cp.size)
        if st.cp is None:
            x, targets = scatter_sequence(bb, batch.embeds), batch.targets
        else:   # every CP rank built the whole microbatch: it keeps its shard
            x = scatter_sequence(bb, st.cp.shard(batch.embeds))
            targets = st.cp.shard(batch.targets)
        positions, mask = batch.positions, batch.mask
    else:
        assert targets is not None
        if st.cp is None:
            positions, mask = document_masks(layouts, targets.shape[1], x.device)
    assert targets is not None
    cp = 1
    if st.cp is not None:
        cp = st.cp.size
        positions, mask = cp_inputs(st.cp, layouts, targets.shape[1] * cp, x.device)
    start, stop = st.layers_of(chunk)
    y = backbone_layers(bb, x, start, stop, positions=positions, mask=mask, cp=cp,
                        lengths=[lay.length for lay in layouts])
    if st.last_of(chunk):
        loss, hidden = backbone_output(bb, y, targets, loss_tokens=loss_tokens,
                                       loss_rows=loss_rows)
        if st.cp is not None and st.program.generators:
            # The generators read the whole sequences' hidden states: gathered over CP.
            hidden = cp_gather(hidden, st.cp, targets.shape[1] * cp)
        gens = _hosted_losses(module, hidden, layouts, generation or {}) \
            if _hosted(module, "generator") else {}
        if st.cp is not None:
            # Every CP rank runs the co-located generators on the same whole sequences:
            # each takes 1 / cp of their loss (its gradients sum over dp x cp, and its
            # total over the job), so the step's are the generators' own.
            gens = {n: g / cp for n, g in gens.items()}
        return loss, hidden, gens
    return y, targets


def _run_generator(module: Any, *args: Any, **kwargs: Any) -> Any:
    """A generator's stage: the whole generator on one stage (``generator_step``'s loss
    of ``(conds, targets)``), or a DiT's share of several (``train.generator``)."""
    st = module.stage_state
    if st.role.grid.pp > 1:
        return run_dit_stage(module, *args, **kwargs)
    conds, targets = args
    return generator_step(Units(st.program, module.units, st.vaes), st.role.unit, conds,
                          targets)


def stage_run(role: str) -> Any:
    """The forward of a stage of a unit of ``role`` (``StageModule``'s ``run``)."""
    return {"encoder": _run_encoder, "backbone": _run_backbone,
            "generator": _run_generator}[role]
