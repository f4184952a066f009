"""The schedule executor: one rank runs its stage's actions of the Schedule IR.

Each global rank is one (stage, replica, tp_index) of one unit (``mesh.role_of``). Per
training step it

1. takes the step's ``batch.StepBatch`` from its feed (``batch.BatchSource``; by default
   ``batch.LocalBatches``, which builds it in this process from the spec's synthetic
   data; in a launched job the preprocessing workers of ``dtdsl.feed`` build it on CPU
   nodes ahead of time): the routing of every unit replica at every microbatch step under
   the spec's reorder policy, the samples this rank reads with only the parts it reads
   (images on an encoder, tokens on the backbone's first stage, generation targets on a
   generator), and the loss denominators of the whole batch;
2. this happens before the step's barrier, off the timed actions;
3. runs its stage's action list in program order:

   - ``F``: the stage's slice of the unit on this replica's samples of the step. Input:
     the encoder's first stage reads the images; an inner stage the activations its
     ``RECV_F`` got from the previous stage of the same replica and TP index (PP
     point-to-point, the broker's wire format); the backbone's and a generator's first
     stage the per-sample tensors its ``RECV_F`` got from the ``Broker``. The encoder's
     projector runs on the encoder's last stage, a generator's projector on the
     generator's (only) stage. Losses (the backbone's last stage, the generators) are
     already divided by the global denominators, so they are summed, never averaged.
   - ``B``: autograd backward from the outputs of ``F`` with the gradients ``RECV_B``
     received (plus the loss itself where the stage has one); the gradients of the
     stage's inputs are kept for ``SEND_B``.
   - ``SEND_F`` / ``SEND_B``: within a unit ``send_tensors`` to the neighbour stage of
     the same replica and TP index, across units ``Broker.send_forward`` /
     ``send_backward``. Non-blocking: the handles are waited on at the end of the step
     (``send_tensors`` copies into its own buffers, so nothing is reused too early).
   - ``RECV_F`` / ``RECV_B``: the matching blocking receives. Both directions use the
     broker's eager wire messages (one transfer for a message of at most
     ``broker.EAGER_BYTES``: no dependent header round trip), and the receives of the
     rank's next ``_PREPOST`` RECV actions are posted ahead (the first at the start of
     the step), so a message travels as soon as it is sent (``broker.post_recv``).
   - ``SYNC`` / ``OPT``: markers. Gradient reduction and the update happen in one
     ``optim.optimizer_step`` that EVERY rank calls after its action list (with no
     optimizer where its stage trains nothing), because the global gradient norm and the
     inf/NaN agreement are collectives over the whole job; the step's losses are summed
     over the job in the same all-reduce. On a stage that trains, the time of that call
     is recorded as its ``SYNC`` (the DP reduce is inside it) and ``OPT`` events.

Message tags: ``broker.message_tag(step * M + j, direction)`` for microbatch step ``j``
of training step ``step``; PP pairs and broker pairs are different rank pairs, and gloo
matches by (source, tag), so no two messages in flight can be confused.

Gradients are summed over DP replicas and microbatches (``Zero1AdamW(average=False)``),
AdamW with the spec's settings on every trainable parameter, global-norm clipping at
``train.grad_clip``: exactly ``reference.train_reference``'s update.

Tensor parallelism (every unit): each TP rank builds the full unit and keeps its shard
(``tp.shard_unit``: DTensor ``ColwiseParallel``/``RowwiseParallel`` on the attention and
MLP blocks, all-reduces inside them); activations between blocks, the projector and the
inputs are replicated, so every TP rank runs the same actions on the same samples, the
broker's TP leader talks to other units and broadcasts what it receives, and PP
neighbours pair by TP index. The optimizer updates the DTensor parameters through their
local shards and counts replicated parameters once in the norm.

Only the last backbone stage's TP leader adds the LM loss to the reported total (every TP
rank computes it); a generator's TP leader likewise adds its loss. Limits: interleaved
schedules (vpp > 1) raise NotImplementedError; a U-Net or DiT generator runs on one
pipeline stage; the backbone's embedding and output head are replicated, not
vocabulary-parallel.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtdsl.data.batch import BatchSource, LocalBatches, StepBatch
from dtdsl.data.sample import Sample, image_encoder, pack_images, unpack_images
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Action, ActionKind, Schedule
from dtdsl.models.multimodal import (
    Normalizer,
    backbone_input,
    backbone_layers,
    backbone_output,
    build_unit,
    conditioning,
    encoder_input,
    encoder_layers,
    generator_step,
)
from dtdsl.parallel.broker import (
    Broker,
    PostedRecv,
    StepSamples,
    message_tag,
    post_recv,
    recv_posted,
    send_tensors,
    use_local_links,
)
from dtdsl.parallel.links import shared_local_links
from dtdsl.parallel.mesh import ProcessGroups, RankRole
from dtdsl.parallel.tp import TPLayout, shard_unit
from dtdsl.sim.timeline import Event, Timeline, TimelineUnit
from dtdsl.train.optim import Zero1AdamW, optimizer_step

__all__ = ["StageExecutor", "gather_timeline", "measured_timeline", "run_rank"]

_FWD, _BWD = 0, 1
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)
# How many of its next RECV actions a rank keeps posted (``broker.post_recv``): gloo moves a
# message's data only once its receive is posted, so a receive posted ahead saves the
# round trip at the RECV. Each holds a ``HEADER_BYTES + EAGER_BYTES`` buffer until then.
_PREPOST = 8


class _Units:
    """The few ``model.Model`` attributes the model's step functions read, for the units
    this rank holds (a duck-typed stand-in: a rank never builds the whole model)."""

    def __init__(self, program: ir.Program, units: dict[str, nn.Module]):
        enc = image_encoder(program)
        self.units = units
        self.patch = (enc.arch.patch or 1) if enc is not None else 1
        self.seq_len = program.train.seq_len
        self.backbone = program.backbone.name
        self.gen_proj = {g.name: _projector(program, program.backbone.name, g.name)
                         for g in program.generators}

    def unit(self, name: str) -> nn.Module:
        return self.units[name]


def _projector(program: ir.Program, source: str, target: str) -> str:
    for p in program.projectors:
        if p.source == source and p.target == target:
            return p.name
    raise ValueError(f"the spec has no projector {source} -> {target}, which the runtime "
                     "needs")


@dataclass
class _Micro:
    """What one microbatch leaves between its actions on this rank."""

    inputs: Any = None          # received / built inputs (leaves where gradients go back)
    outputs: Any = None         # F's outputs that B differentiates
    outbox: Any = None          # what SEND_F sends
    loss: torch.Tensor | None = None
    grads_in: dict[str, Any] = field(default_factory=dict)    # RECV_B by peer unit
    input_grads: Any = None     # what SEND_B sends


class StageExecutor:
    """Runs one rank's stage of ``schedule`` (see the module docstring).

    ``groups``: this rank's ``mesh.build_groups(plan)``; ``seed``: the initialisation seed
    (``train.seed`` to match the reference)."""

    def __init__(self, program: ir.Program, plan: Plan, schedule: Schedule, *,
                 rank: int, groups: ProcessGroups, seed: int | None = None,
                 feed: BatchSource | None = None):
        self.program, self.plan, self.schedule = program, plan, schedule
        self.role: RankRole = groups.role
        if self.role.rank != rank:
            raise ValueError(f"groups belong to rank {self.role.rank}, not {rank}")
        for u in plan.units:
            if u.vpp > 1:
                raise NotImplementedError(
                    f"unit {u.name} has vpp={u.vpp}: the executor does not run interleaved "
                    "schedules yet; plan it with vpp=1")
        if schedule.num_microbatches != plan.num_microbatches:
            raise ValueError(f"schedule of {schedule.num_microbatches} microbatches for a "
                             f"plan of {plan.num_microbatches}")
        self.groups = groups
        self.seed = program.train.seed if seed is None else seed
        self.unit_plan = plan.unit(self.role.unit)
        self.module_spec = program.module(self.role.unit)
        self.actions: tuple[Action, ...] = schedule.stage(self.role.unit, self.role.stage).actions
        self.sends_grad = any(a.kind is ActionKind.SEND_B for a in self.actions)
        self.sends_forward = any(a.kind is ActionKind.SEND_F for a in self.actions)
        self.trains_in_schedule = any(a.kind is ActionKind.OPT for a in self.actions)
        # Eager wire messages (one transfer for a small message) on every PP and broker
        # pair: every rank's executor sends and receives alike.
        self.broker = Broker(plan, rank, groups, eager=True)
        # On CPU, transfers between ranks of one host go over Unix sockets (links.py).
        if dist.is_initialized() and dist.get_backend() == "gloo":
            use_local_links(shared_local_links())
        self._leader = self.role.grid.leader(self.role.stage, self.role.replica)
        self._build()
        self._forward = {"encoder": self._encoder_forward, "backbone": self._backbone_forward,
                         "generator": self._generator_forward}[self.role.role]
        self._t0 = 0.0
        self.feed: BatchSource = feed if feed is not None else LocalBatches(
            program, plan, self.role)
        self.batch: StepBatch | None = None
        self.steps: tuple[StepSamples, ...] = ()
        self._ids: tuple[tuple[int, ...], ...] = ()
        self.norm: Normalizer | None = None
        self.step = -1

    # ---- building -------------------------------------------------------------------------

    def _build(self) -> None:
        program, role = self.program, self.role
        name = role.unit
        module = build_unit(program, name, self.seed)
        # Every TP rank builds the full unit from the same seed and keeps its shard, so
        # the shards are slices of the single-process parameters.
        self.tp_layout: TPLayout | None = None
        if role.grid.tp > 1:
            self.tp_layout = shard_unit(module, role.grid.tp, role.tp_index, self.groups.tp)
        units: dict[str, nn.Module] = {name: module}
        params: list[nn.Parameter] = []
        if role.role == "generator":
            if role.grid.pp != 1:
                raise NotImplementedError(f"generator {name} has pp={role.grid.pp}: U-Net and "
                                          "DiT generators run on one pipeline stage")
            proj = _projector(program, program.backbone.name, name)
            units[proj] = build_unit(program, proj, self.seed)
            params += list(module.parameters()) + list(units[proj].parameters())
        else:
            split = tuple(self.unit_plan.layers_per_stage)
            total = len(module.layers)
            if len(split) != role.grid.pp or sum(split) != total:
                raise ValueError(f"unit {name}: layers_per_stage {split} does not split its "
                                 f"{total} layers over pp={role.grid.pp} stages")
            self.start = sum(split[:role.stage])
            self.stop = self.start + split[role.stage]
            if role.is_first_stage:
                first = module.patch_embed if role.role == "encoder" else module.tok_embeddings
                params += list(first.parameters())
            for layer in module.layers[self.start:self.stop]:
                params += list(layer.parameters())
            if role.is_last_stage:
                if role.role == "encoder":
                    proj = _projector(program, name, program.backbone.name)
                    units[proj] = build_unit(program, proj, self.seed)
                    params += list(units[proj].parameters())
                else:
                    params += list(module.norm.parameters()) + list(module.output.parameters())
        for m in units.values():
            m.train()
        self.model = _Units(program, units)
        self.stage_params = params
        trainable = [p for p in params if p.requires_grad]
        if bool(trainable) != self.trains_in_schedule:
            raise RuntimeError(f"{name}.s{role.stage}: the schedule says it "
                               f"{'trains' if self.trains_in_schedule else 'trains nothing'}"
                               f" but it holds {len(trainable)} trainable parameters; lower "
                               "the schedule from the same program")
        opt = program.train.optimizer
        if opt.name != "adamw" and opt.weight_decay > 0:
            raise NotImplementedError(f"optimizer {opt.name} with weight decay: the runtime "
                                      "has AdamW (decoupled weight decay) only")
        sharded = set() if self.tp_layout is None else {
            id(p) for n, p in module.named_parameters() if self.tp_layout.is_sharded(n)}
        self.optimizers = [] if not trainable else [Zero1AdamW(
            trainable, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
            weight_decay=opt.weight_decay, zero=opt.zero, dp_group=self.groups.dp,
            average=False, tp_rank=role.tp_index,
            tp_replicated=[p for p in trainable if id(p) not in sharded])]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters as ``{"unit.param": tensor}`` (``unit`` a module or
        projector name, ``param`` its name in that module): the keys of
        ``model.Model.units``' parameters without the ``units.`` prefix."""
        mine = {id(p) for p in self.stage_params}
        return {f"{u}.{n}": p for u, m in self.model.units.items()
                for n, p in m.named_parameters() if id(p) in mine}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``named_parameters`` with TP shards gathered into the full (single-process)
        tensors. Collective over this rank's TP group when the unit has tp > 1."""
        out = {}
        for key, p in self.named_parameters().items():
            unit, _, param = key.partition(".")
            if self.tp_layout is not None and unit == self.role.unit:
                out[key] = self.tp_layout.full(param, p.detach())
            else:
                out[key] = p.detach()
        return out

    # ---- peers ----------------------------------------------------------------------------

    def _pp_peer(self, stage: int) -> int:
        return self.role.grid.rank(stage, self.role.replica, self.role.tp_index)

    # ---- one training step ----------------------------------------------------------------

    def run_step(self, step: int) -> dict[str, Any]:
        """Run training step ``step``; returns ``{"step", "loss", "lm_loss", "gen_loss",
        "grad_norm", "skipped", "time_s", "events"}`` (losses summed over the job,
        identical on every rank; events: this rank's measured actions)."""
        self.step = step
        # Off the timed actions: in a real job the preprocessing workers built it ahead.
        batch = self.batch = self.feed.batch(step)
        if batch.step != step:
            raise RuntimeError(f"the data feed gave step {batch.step} for step {step}")
        if len(batch.routing) != self.plan.num_microbatches:
            raise RuntimeError(f"step {step}'s routing has {len(batch.routing)} microbatch "
                               f"steps for a plan of {self.plan.num_microbatches}")
        self.steps = batch.routing
        r = self.role
        self._ids = tuple(tuple(s.samples_of(r.unit, r.replica)) for s in self.steps)
        self.norm = batch.normalizer
        self.micro: dict[int, _Micro] = {}
        self.pending: list[dist.Work] = []
        self.lm = self.gen = 0.0
        for p in self.stage_params:
            p.grad = None
        events: list[Event] = []
        self._to_post = deque(i for i, a in enumerate(self.actions) if a.kind in _RECVS)
        self._posted: dict[int, list[PostedRecv]] = {}
        dist.barrier()     # a common origin for every rank's event times
        self._t0 = time.perf_counter()
        self._post_ahead()     # the first _PREPOST receives
        for i, a in enumerate(self.actions):
            if a.kind in (ActionKind.SYNC, ActionKind.OPT):
                continue
            start = time.perf_counter() - self._t0
            self._run(i, a)
            events.append(self._event(a.kind.value, a.microbatch, start))
        for w in self.pending:
            w.wait()
        start = time.perf_counter() - self._t0
        train = self.program.train
        # The step's losses are summed over the job in the optimizer's one all-reduce.
        result = optimizer_step(self.optimizers,
                                max_norm=train.grad_clip if train.grad_clip > 0 else None,
                                totals=(self.lm, self.gen))
        if self.trains_in_schedule:
            events.append(self._event("SYNC", None, start))
            events.append(self._event("OPT", None, start))
        lm, gen = result.totals
        return {"step": step, "loss": lm + gen, "lm_loss": lm, "gen_loss": gen,
                "grad_norm": result.grad_norm, "skipped": result.skipped,
                "time_s": time.perf_counter() - self._t0, "data_wait_s": batch.wait_s,
                "events": events}

    def train(self, steps: int, *, first_step: int = 0,
              metrics_path: str | Path | None = None,
              logdir: str | Path | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` training steps from ``first_step``; ``run_step``'s result per step.
        Rank 0 appends ``{"step", "loss", "lm_loss", "gen_loss"}`` JSON lines to
        ``metrics_path``. With ``logdir`` every rank joins gathering each step's measured
        Timeline and rank 0 writes it to TensorBoard with the simulator's writer (scalars,
        Gantt image) plus the losses, so predicted and measured runs read alike."""
        out = []
        writer = None
        if logdir is not None and self.role.rank == 0:
            from dtdsl.sim.tensorboard import TimelineWriter

            writer = TimelineWriter(logdir)
        try:
            for step in range(first_step, first_step + steps):
                result = self.run_step(step)
                out.append(result)
                if metrics_path is not None and self.role.rank == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({k: result[k] for k in (
                            "step", "loss", "lm_loss", "gen_loss")}) + "\n")
                if logdir is not None:
                    timeline = gather_timeline(self.plan, step, result["events"])
                    if writer is not None:
                        scalars = {"loss/total": result["loss"], "loss/lm": result["lm_loss"],
                                   "loss/gen": result["gen_loss"],
                                   "grad_norm": result["grad_norm"]}
                        writer.add_step(step, timeline, {k: float(v) for k, v in
                                                         scalars.items() if v is not None})
        finally:
            if writer is not None:
                writer.close()
        return out

    def _event(self, kind: str, microbatch: int | None, start: float) -> Event:
        r = self.role
        return Event(unit=r.unit, stage=r.stage, replica=r.replica, rank=self._leader,
                     kind=kind, microbatch=microbatch, start_s=start,
                     end_s=time.perf_counter() - self._t0)

    def _sample(self, i: int) -> Sample:
        assert self.batch is not None
        try:
            return self.batch.samples[i]
        except KeyError:
            raise RuntimeError(f"{self.role.unit}.s{self.role.stage} replica "
                               f"{self.role.replica}: step {self.step}'s data lacks sample "
                               f"{i}, which its routing sends here") from None

    def _samples(self, j: int) -> tuple[list[int], list[Sample]]:
        ids = list(self._ids[j])
        return ids, [self._sample(i) for i in ids]

    def _tag(self, j: int, direction: int) -> int:
        return message_tag(self.step * self.plan.num_microbatches + j, direction)

    def _run(self, index: int, a: Action) -> None:
        """Run action ``a``, the ``index``-th of this stage's list."""
        j = a.microbatch
        assert j is not None
        mb = self.micro.setdefault(j, _Micro())
        kind = a.kind
        if kind is ActionKind.F:
            self._forward(j, mb)
        elif kind is ActionKind.B:
            self._backward(j, mb)
            self.micro.pop(j)
            if self.sends_grad:
                self.micro[j] = _Micro(input_grads=mb.input_grads)
        elif kind is ActionKind.SEND_F:
            self._send(a, j, mb.outbox, _FWD)
        elif kind is ActionKind.SEND_B:
            self._send(a, j, mb.input_grads, _BWD)
            self.micro.pop(j, None)
        elif kind is ActionKind.RECV_F:
            got = self._recv(index, a, j, _FWD)
            if a.peer_unit == self.role.unit:
                mb.inputs = got
            else:
                if mb.inputs is None:
                    mb.inputs = {}
                mb.inputs[a.peer_unit] = got
        elif kind is ActionKind.RECV_B:
            mb.grads_in[a.peer_unit] = self._recv(index, a, j, _BWD)
        else:   # pragma: no cover - SYNC/OPT are handled by run_step
            raise AssertionError(kind)

    # ---- communication --------------------------------------------------------------------

    def _send(self, a: Action, j: int, payload: Any, direction: int) -> None:
        assert a.peer_unit is not None and a.peer_stage is not None
        if a.peer_unit == self.role.unit:
            self.pending += send_tensors(list(payload), self._pp_peer(a.peer_stage),
                                         tag=self._tag(j, direction), eager=True)
        elif direction == _FWD:
            self.pending += self.broker.send_forward(
                self.step * self.plan.num_microbatches + j, self.role.unit, a.peer_unit,
                payload, self.steps[j])
        else:
            self.pending += self.broker.send_backward(
                self.step * self.plan.num_microbatches + j, a.peer_unit, self.role.unit,
                payload, self.steps[j])

    def _post(self, a: Action) -> list[PostedRecv]:
        """Post the receives of RECV action ``a`` (see ``_PREPOST``)."""
        assert a.peer_unit is not None and a.peer_stage is not None and a.microbatch is not None
        j = a.microbatch
        if a.peer_unit == self.role.unit:
            direction = _FWD if a.kind is ActionKind.RECV_F else _BWD
            return [post_recv(self._pp_peer(a.peer_stage), tag=self._tag(j, direction),
                              eager=True)]
        index = self.step * self.plan.num_microbatches + j
        if a.kind is ActionKind.RECV_F:
            return self.broker.post_forward(index, a.peer_unit, self.role.unit, self.steps[j])
        return self.broker.post_backward(index, self.role.unit, a.peer_unit, self.steps[j])

    def _post_ahead(self) -> None:
        while self._to_post and len(self._posted) < _PREPOST:
            i = self._to_post.popleft()
            self._posted[i] = self._post(self.actions[i])

    def _recv(self, index: int, a: Action, j: int, direction: int) -> Any:
        assert a.peer_unit is not None and a.peer_stage is not None
        posted = self._posted.pop(index)
        self._post_ahead()      # the next one goes out while this one is waited for
        if a.peer_unit == self.role.unit:
            return recv_posted(posted)[0]
        step = self.step * self.plan.num_microbatches + j
        if direction == _FWD:
            return self.broker.recv_forward(step, a.peer_unit, self.role.unit, self.steps[j],
                                            posted)
        return self.broker.recv_backward(step, self.role.unit, a.peer_unit, self.steps[j],
                                         posted)

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        """A received tensor as an autograd leaf (own storage, gradient wanted when this
        stage sends gradients back)."""
        t = t.clone()
        return t.requires_grad_(True) if self.sends_grad and t.is_floating_point() else t

    # ---- forwards ---------------------------------------------------------------------------

    def _encoder_forward(self, j: int, mb: _Micro) -> None:
        role = self.role
        enc = self.model.unit(role.unit)
        ids, samples = self._samples(j)
        packed = pack_images([s.images for s in samples], self.model.patch)
        if role.is_first_stage:
            xs = encoder_input(enc, packed.groups)
            mb.inputs = None
        else:
            xs = [self._leaf(t) for t in mb.inputs]
            mb.inputs = xs
        ys = encoder_layers(enc, xs, self.start, self.stop)
        if role.is_last_stage:
            proj = self.model.unit(_projector(self.program, role.unit, self.model.backbone))
            width = self.program.backbone.arch.hidden
            outs = unpack_images(packed, [proj(h) for h in ys], width=width)
            mb.outputs = dict(zip(ids, outs, strict=True))
            mb.outbox = {i: o.detach() for i, o in mb.outputs.items()}
        else:
            mb.outputs = ys
            mb.outbox = [y.detach() for y in ys]

    def _backbone_forward(self, j: int, mb: _Micro) -> None:
        role = self.role
        bb = self.model.unit(role.unit)
        ids = list(self._ids[j])
        if role.is_first_stage:
            samples = [self._sample(i) for i in ids]
            received: dict[str, dict[int, torch.Tensor]] = mb.inputs or {}
            width = bb.tok_embeddings.embedding_dim
            if received:
                if len(received) != 1:
                    raise NotImplementedError("the runtime models one image encoder")
                (per_sample,) = received.values()
                embeds = {i: self._leaf(per_sample[i]) for i in ids}
            else:
                embeds = {i: torch.zeros(0, width) for i in ids}
            mb.inputs = embeds
            batch = backbone_input(bb, [embeds[i] for i in ids], [s.tokens for s in samples],
                                   self.model.seq_len)
            x, targets, lengths = batch.embeds, batch.targets, torch.tensor(batch.lengths)
        else:
            x_in, targets, lengths = mb.inputs
            x = self._leaf(x_in)
            mb.inputs = [x]
        y = backbone_layers(bb, x, self.start, self.stop)
        if role.is_last_stage:
            loss_sum, hidden = backbone_output(bb, y, targets)
            assert self.norm is not None
            mb.loss = loss_sum / max(1, self.norm.text_tokens)
            if role.is_leader:      # TP ranks hold the same loss: count it once
                self.lm += float(mb.loss.detach())
            if self.sends_forward:  # the generators' conditioning
                conds = conditioning(hidden, lengths.tolist())
                mb.outputs = dict(zip(ids, conds, strict=True))
                mb.outbox = {i: c.detach() for i, c in mb.outputs.items()}
        else:
            mb.outputs = [y]
            mb.outbox = [y.detach(), targets, lengths]

    def _generator_forward(self, j: int, mb: _Micro) -> None:
        name = self.role.unit
        ids, samples = self._samples(j)
        received = mb.inputs or {}
        if len(received) != 1:
            raise RuntimeError(f"{name}: F{j} without the backbone's conditioning")
        (per_sample,) = received.values()
        conds = {i: self._leaf(per_sample[i]) for i in ids}
        mb.inputs = conds
        gen_sum = generator_step(self.model, name, [conds[i] for i in ids],
                                 [s.targets[name] for s in samples])
        assert self.norm is not None
        mb.loss = gen_sum / max(1, self.norm.gen_targets)
        if self.role.is_leader:     # TP ranks hold the same loss: count it once
            self.gen += float(mb.loss.detach())

    # ---- backward ---------------------------------------------------------------------------

    def _backward(self, j: int, mb: _Micro) -> None:
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if mb.loss is not None and mb.loss.requires_grad:
            tensors.append(mb.loss)
            grads.append(torch.ones_like(mb.loss))
        if isinstance(mb.outputs, dict):
            # Per-sample outputs read by other units: sum what every consumer sent.
            for per_sample in mb.grads_in.values():
                for i, g in per_sample.items():
                    out = mb.outputs[i]
                    if out.requires_grad:
                        tensors.append(out)
                        grads.append(g)
        elif mb.outputs is not None:
            (received,) = mb.grads_in.values()
            for out, g in zip(mb.outputs, received, strict=True):
                if out.requires_grad:
                    tensors.append(out)
                    grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        if not self.sends_grad:
            return

        def grad(x: torch.Tensor) -> torch.Tensor:
            return x.grad if x.grad is not None else torch.zeros_like(x)

        if isinstance(mb.inputs, dict):
            mb.input_grads = {i: grad(x) for i, x in mb.inputs.items()}
        else:
            mb.input_grads = [grad(x) for x in mb.inputs]


def measured_timeline(plan: Plan, step: int, events: Sequence[Event]) -> Timeline:
    """A measured ``Timeline`` of one step from the events of any set of ranks (e.g. all
    of them, gathered)."""
    units = tuple(TimelineUnit(name=u.name, role=u.role, pp=u.pp, dp=u.dp, tp=u.tp,
                               first_rank=u.first_rank) for u in plan.units)
    return Timeline(source="measured", num_microbatches=plan.num_microbatches, units=units,
                    events=tuple(events), step=step)


_KINDS = tuple(k.value for k in ActionKind)


def gather_timeline(plan: Plan, step: int, events: Sequence[Event]) -> Timeline:
    """The measured ``Timeline`` of one step from every rank's ``events`` (collective over
    the default group; every rank gets the whole timeline). Events are gathered from TP
    leaders only (a replica's TP ranks run in lockstep, one event stands for them all).
    Each rank's times are relative to its own start of the step, taken right after a
    barrier, so they compare across ranks up to the barrier's skew."""
    names = [u.name for u in plan.units]
    rank = dist.get_rank()
    mine = [e for e in events if e.rank == rank]
    rows = torch.tensor([[names.index(e.unit), e.stage, e.replica, e.rank, _KINDS.index(e.kind),
                          -1 if e.microbatch is None else e.microbatch, e.chunk, e.start_s,
                          e.end_s] for e in mine], dtype=torch.float64).reshape(-1, 9)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(mine)], dtype=torch.int64))
    width = max(int(c) for c in counts)
    padded = torch.zeros(width, 9, dtype=torch.float64)
    padded[:len(mine)] = rows
    parts = [torch.empty(width, 9, dtype=torch.float64) for _ in counts]
    dist.all_gather(parts, padded)
    out = []
    for part, count in zip(parts, counts, strict=True):
        for row in part[:int(count)].tolist():
            unit, stage, replica, r, kind, mb, chunk, start, end = row
            out.append(Event(unit=names[int(unit)], stage=int(stage), replica=int(replica),
                             rank=int(r), kind=_KINDS[int(kind)],
                             microbatch=None if mb < 0 else int(mb), chunk=int(chunk),
                             start_s=start, end_s=end))
    return measured_timeline(plan, step, out)


def run_rank(program: ir.Program, plan: Plan, schedule: Schedule, *, steps: int, rank: int,
             groups: ProcessGroups, seed: int | None = None, first_step: int = 0,
             metrics_path: str | Path | None = None,
             logdir: str | Path | None = None) -> list[dict[str, Any]]:
    """Train ``steps`` steps (``first_step`` on) on this rank: ``StageExecutor(...).train``.
    Collective over every rank of ``plan``."""
    ex = StageExecutor(program, plan, schedule, rank=rank, groups=groups, seed=seed)
    return ex.train(steps, first_step=first_step, metrics_path=metrics_path, logdir=logdir)
