"""A phased encoder's two phases on a backbone rank (a mixin of train.executor.StageExecutor):
its forward for the whole step before the schedule's first action, embeddings sent to the
backbone's first stage in the pipeline's bubbles, and its backward after the last.

Its hand-offs between the replica's backbone stages (embeddings to the first stage, their
gradients back) go over the PP group's own channel (``phase_p2p``), never the schedule's:
in-order matching then pairs them whatever the schedule sends the same ranks (one model
chunk or several), and on GPUs a hand-off waiting for its receiver (a gradient the later
stage takes after its last action) holds up that channel's stream only, not the
schedule's transfers behind it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtdsl.data.sample import PackedImages, unpack_images
from dtdsl.ir.schedule import Action, ActionKind
from dtdsl.models.multimodal import (
    encoder_rows,
)
from dtdsl.parallel.p2p import TensorSpec

# Message directions, in the executor's pipeline labels too.
_FWD, _BWD = "F", "B"


class PhasedEncoder:
    """``StageExecutor``'s phased-encoder part (module docstring); it reads the executor's
    state (``self._sizes``, ``self.phase_p2p``, ``self.stage``, ...)."""

    def _phased_embeds(self, i: int) -> torch.Tensor:
        """Sample ``i``'s embeddings from the forward phase (none for a sample without
        images), on the backbone's first stage."""
        if self._rows(i) == 0:
            return torch.zeros(0, self._width, dtype=self.dtype, device=self.device)
        try:
            return self._phased_in[i]
        except KeyError:
            raise RuntimeError(f"{self.role.unit}.s0: step {self.step}'s forward phase "
                               f"left sample {i} without embeddings; the routing and the "
                               "executor disagree") from None

    def _rows(self, i: int) -> int:
        """Sample ``i``'s rows from the encoder this rank encodes (hosts, runs phased)."""
        assert self._encoder is not None
        return encoder_rows(self._sizes(i), self._inputs, self._encoder)

    def _phase_share(self, name: str, stage: int) -> list[list[int]]:
        """Per microbatch step, the samples that the ranks of backbone stage ``stage`` of
        this replica encode with phased encoder ``name`` (its replica stage * dp +
        replica: ``parallel.mesh.phased_grid``), as the routing says."""
        replica = stage * self.role.grid.dp + self.role.replica
        return [list(s.samples_of(name, replica)) for s in self.steps]

    def _phase_specs(self, order: Sequence[int]) -> list[TensorSpec]:
        """The embeddings (or their gradients) of ``order``, from the samples' sizes."""
        return [TensorSpec((self._rows(i), self._width),
                           self.dtype) for i in order]

    def _phase_label(self, name: str, direction: str, src: int, dst: int,
                     j: int | None = None) -> str:
        r = self.role
        part = "" if j is None else f" m{j}"
        return f"{name} phase {r.unit}.s{src}->s{dst} {direction}{part} {self.step} " \
            f"r{r.replica}t{r.tp_index}"

    def _phase_encode(self, name: str, ids: Sequence[int], packed: PackedImages | None
                      ) -> dict[int, torch.Tensor]:
        """Phased encoder ``name`` and its projector on ``packed``, the images of samples
        ``ids``: each one's embeddings in backbone width (samples without images left
        out)."""
        if packed is None:
            return {}
        part = self.stage.phased[name]
        ys = part.module(packed.groups, first=True, grids=packed.grids)
        outs = unpack_images(packed, ys, width=self._width)
        return {i: o for i, o in zip(ids, outs, strict=True) if o.shape[0] > 0}

    def _phase_steps(self, name: str, stage: int) -> list[tuple[int, list[int]]]:
        """Per microbatch step that stage ``stage`` encodes (``reorder.workload.phase_fit``:
        all of a step's images on one stage), the samples with image embeddings in it:
        the tensors of one message between that stage and the first, in order."""
        out = []
        for j, ids in enumerate(self._phase_share(name, stage)):
            order = [i for i in ids if self._rows(i) > 0]
            if order:
                out.append((j, order))
        return out

    def _phase_forward(self, name: str) -> None:
        """Phased encoder ``name``'s forward phase, before the stage's first action: this
        rank encodes its share, the microbatch steps the plan gives its stage (in the
        pipeline's bubble before its first forward, ``reorder.workload.phase_fit``), under
        ``no_grad`` (the backward phase recomputes it). A later stage sends each step's
        embeddings to the first stage as soon as they are encoded, one message per step
        (it does not wait for them to arrive); the first stage keeps its own and posts the
        receives of every other stage's, each waited for only before its forward of that
        step (``_phase_arrivals``), as autograd leaves for ``backbone_input``
        (``_phased_in``)."""
        part = self.stage.phased[name]
        role = self.role
        trains = bool(part.trainable())
        # The share's images, packed once (their patches counted) and kept on the device
        # for the backward phase's recomputation.
        packs = self._phase_packs[name] = [
            (ids, self._hosted_images([self._sample(i) for i in ids]))
            for ids in self._phase_share(name, role.stage)]
        if role.stage > 0:
            for j, order in self._phase_steps(name, role.stage):
                with torch.no_grad():
                    mine = self._phase_encode(name, *packs[j])
                self.phase_p2p.send(self._pp_peer(0), [mine[i] for i in order],
                                    self._phase_label(name, _FWD, role.stage, 0, j))
                self.phase_p2p.flush()
            return
        mine: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for ids, packed in packs:
                mine.update(self._phase_encode(name, ids, packed))
        self._phased_in = {i: t.detach().requires_grad_(trains) for i, t in mine.items()}
        for s in range(1, role.grid.pp):
            steps = self._phase_steps(name, s)
            for j, order in steps:
                received = self.phase_p2p.recv(self._pp_peer(s), self._phase_specs(order),
                                               self._phase_label(name, _FWD, s, 0, j))
                self._phase_waiting.update((i, (order, received)) for i in order)
            if trains and steps:
                self._phase_due[s] = {j for j, _ in steps}
        if self.phase_p2p is not None:
            self.phase_p2p.flush()

    def _phase_arrivals(self, a: Action) -> None:
        """Before the first stage's forward of a step: wait for the phased encoder's
        embeddings of the step's samples that other stages encode."""
        if a.kind is not ActionKind.F or a.microbatch is None:
            return
        trains = bool(next(iter(self.stage.phased.values())).trainable())
        for i in self.steps[a.microbatch].sample_ids:
            if i not in self._phase_waiting:
                continue
            order, received = self._phase_waiting[i]
            for k, t in zip(order, received.wait(), strict=True):
                self._phased_in[k] = t.clone().detach().requires_grad_(trains)
                self._phase_waiting.pop(k)

    def _phase_grads_due(self, a: Action) -> None:
        """After a first-stage action: send a later stage its share's embedding gradients
        (one message) once the backward of the first model chunk of every step it encoded
        has run here (they are then complete). It runs its backward phase after its last
        action, in the bubble the first stage's last backwards leave it."""
        if a.kind is ActionKind.B and a.chunk == 0:
            for waiting in self._phase_due.values():
                waiting.discard(a.microbatch)
        for s in [s for s, waiting in self._phase_due.items() if not waiting]:
            self._phase_send_grads(s)

    def _phase_send_grads(self, stage: int) -> None:
        """Queue stage ``stage``'s share's embedding gradients to it (first stage)."""
        (name,) = self.stage.phased
        order = [i for _, ids in self._phase_steps(name, stage) for i in ids]
        self.phase_p2p.send(self._pp_peer(stage), [self._phase_grad(i) for i in order],
                            self._phase_label(name, _BWD, 0, stage))
        self.phase_p2p.flush()
        self._phase_due.pop(stage)

    def _phase_grad(self, i: int) -> torch.Tensor:
        x = self._phased_in[i]
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def _phase_backward(self, name: str) -> None:
        """Phased encoder ``name``'s backward phase, after the stage's last action: the
        first stage has sent each later stage its share's embedding gradients
        (``_phase_grads_due``; any left are sent now) and keeps its own; every rank
        recomputes its share's forward, one microbatch step at a time (one step's
        activations held at once), and runs backward with those gradients."""
        role = self.role
        if role.stage == 0:
            for s in list(self._phase_due):
                self._phase_send_grads(s)
            grads = {i: self._phase_grad(i) for _, ids in self._phase_steps(name, 0)
                     for i in ids}
        else:
            # No message where the share has no embeddings (nor any sent: both sides
            # derive the same empty share).
            order = [i for _, ids in self._phase_steps(name, role.stage) for i in ids]
            grads = {}
            if order:
                received = self.phase_p2p.recv(self._pp_peer(0), self._phase_specs(order),
                                               self._phase_label(name, _BWD, 0, role.stage))
                self.phase_p2p.flush()
                grads = dict(zip(order, received.wait(), strict=True))
        for ids, packed in self._phase_packs.pop(name):
            outs = self._phase_encode(name, ids, packed)
            tensors = [o for o in outs.values() if o.requires_grad]
            if tensors:
                torch.autograd.backward(tensors, [grads[i] for i, o in outs.items()
                                                  if o.requires_grad])
