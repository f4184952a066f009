"""A generator unit's passes (a mixin of ``train.executor.StageExecutor``), and a DiT
generator split over several pipeline stages.

A U-Net, and a DiT at pp 1, run whole on one stage: the backbone's conditioning in
through the projector, the loss out (``models.multimodal.generator_step``). A DiT over
``pp`` stages runs as the backbone's stages do, its blocks split by the plan's
``layers_per_stage`` (``train.stage``):

- the first stage receives the conditioning from the backbone (``parallel.broker``), runs
  the projector into the generator, noises the targets' latents (its VAE's, where it has
  one) and embeds them, then runs its blocks;
- every stage runs its blocks on what the one before sent: the tokens ``[T, patches,
  hidden]`` of the microbatch's T targets and their cross-attention context ``[T,
  COND_TOKENS, context_dim]``, both in the compute dtype (every block reads the context,
  so it travels with the tokens and its gradient comes back with theirs; one projection,
  on the first stage);
- the last stage unembeds and takes the loss: a DiT predicts the noise
  (``models.diffusion``), which it reads from its own samples, as every stage reads the
  timesteps and each target's context rows (its adaLN code and padding mask): nothing but
  the two tensors travels, forward or back (``cost.flops.dit_stage_message``, what the
  cost model's hop between a unit's stages prices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtdsl.cost.flops import dit_stage_message
from dtdsl.ir import program as ir
from dtdsl.models.attention import key_bias
from dtdsl.models.inputs import GenTargets
from dtdsl.models.multimodal import (
    conditioning_rows,
    document_targets,
    noised_latents,
    padded_context,
)
from dtdsl.parallel.device import to_device
from dtdsl.parallel.p2p import TensorSpec
from dtdsl.train.stage import projector_between

__all__ = ["GeneratorPasses", "run_dit_stage"]


def _split(targets: Sequence[GenTargets], counts: Sequence[Sequence[int]]
           ) -> list[GenTargets]:
    """Per-sequence targets split into their documents' (as ``document_targets``)."""
    out = []
    for t, n in zip(targets, counts, strict=True):
        if len(n) == 1:
            out.append(t)
            continue
        at = 0
        for k in n:
            out.append(t.slice(at, at + k))
            at += k
    return out


def run_dit_stage(module: Any, *, targets: Sequence[GenTargets], rows: Sequence[int],
                  conds: Sequence[torch.Tensor] | None = None, x: torch.Tensor | None = None,
                  context: torch.Tensor | None = None, chunk: int = 0) -> Any:
    """A DiT generator's stage (module docstring) on its microbatch's documents:
    ``targets`` and ``rows`` (each document's conditioning rows) on every stage, ``conds``
    (each document's conditioning) on the first, the previous stage's tokens ``x`` and
    ``context`` on the others. Returns ``(tokens, context)`` to send on, or on the last
    stage the summed loss (``generator_step``'s)."""
    st = module.stage_state
    name = st.role.unit
    dit = module.units[name]
    arch = st.program.module(name).arch
    first, last = st.first_of(chunk), st.last_of(chunk)
    device = next(dit.parameters()).device
    docs = [k for k, t in enumerate(targets) if len(t)]
    if not docs:
        if last:
            return torch.zeros((), device=device)
        if first:
            return tuple(torch.zeros(shape, dtype=st.dtype, device=device)
                         for shape in dit_stage_message(arch, 0))
        return x, context
    batch = GenTargets.cat([targets[k] for k in docs])
    if first:
        assert conds is not None
        proj = module.units[projector_between(st.program, st.program.backbone.name, name)]
        context, keep = padded_context(proj, [(conds[k], targets[k]) for k in docs])
        noisy, _ = noised_latents(arch, name, batch, st.vaes.get(name), device)
        x = dit.embed(noisy.to(context.dtype))
    else:
        assert x is not None and context is not None
        keep = torch.cat([(torch.arange(ir.COND_TOKENS, device=device) < rows[k])[None]
                          .expand(len(targets[k]), -1) for k in docs])
    start, stop = st.layers_of(chunk)
    x = dit.run_blocks(x, dit.timestep_code(batch.timesteps.to(device), x.dtype), context,
                       key_bias(keep, context.dtype), start, stop)
    if not last:
        return x, context
    pred = dit.unembed(x, batch.noise.shape)
    # A DiT's target is the noise (``noisy_and_target`` without x0 at epsilon prediction).
    noise = batch.noise.to(device)
    return ((pred.float() - noise) ** 2).flatten(1).mean(dim=1).sum()


class GeneratorPasses:
    """``StageExecutor``'s generator passes (module docstring); it reads the executor's
    state (``self._ids``, ``self._sample``, ``self.stage``, ...)."""

    def _generator_forward(self, j: int, mb: Any) -> None:
        name = self.role.unit
        ids, samples = list(self._ids[j]), [self._sample(i) for i in self._ids[j]]
        if len(mb.pending) != 1:
            what = "the backbone's conditioning" if self._first else "the previous stage's"
            raise RuntimeError(f"{name}: F{j} without {what}")
        (pending,) = mb.pending.values()
        got = pending.wait()
        mb.pending = {}
        targets = [to_device(s.targets[name], self.device) for s in samples]
        rows = [conditioning_rows(self._layout(i)) for i in ids]
        counts = [self._doc_targets(i, name) for i in ids]
        if self._first:
            conds = {i: self._leaf(got[i]) for i in ids}
            mb.inputs = conds
            # A packed sequence's documents each have their own conditioning and targets.
            docs_c, docs_t = document_targets([conds[i] for i in ids], targets, rows, counts)
            self.processed["targets"] += sum(len(t) for t in docs_t)
        else:
            docs_c, docs_t = None, _split(targets, counts)
            mb.inputs = [self._leaf(t) for t in got]
        if self.role.grid.pp == 1:
            out = self.stage.module(docs_c, docs_t)
        else:
            x, context = (None, None) if self._first else mb.inputs
            out = self.stage.module(targets=docs_t, rows=[r for rs in rows for r in rs],
                                    conds=docs_c, x=x, context=context, chunk=self._chunk)
        if not self._last:
            mb.outputs = list(out)
            mb.outbox = [o.detach() for o in out]
            return
        assert self.norm is not None
        mb.loss = out / max(1, self.norm.gen_targets)
        if self.role.is_leader:     # TP ranks hold the same loss: count it once
            self.gen += mb.loss.detach().double()

    def _generator_specs(self, j: int) -> list[TensorSpec]:
        """What a DiT stage's PP message of microbatch ``j`` holds, either way."""
        name = self.role.unit
        targets = sum(self._sizes(i).gen_counts.get(name, 0) for i in self._ids[j])
        return [TensorSpec(tuple(int(n) for n in shape), self.dtype) for shape in
                dit_stage_message(self.program.module(name).arch, targets)]
