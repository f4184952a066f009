"""The schedule executor: one rank runs its stage's actions of the Schedule IR.

Each global rank is one (stage, replica, cp_index, tp_index) of one unit
(``parallel.mesh``). Per training step (``StageExecutor.run_step``) it

1. takes the step's ``data.batch.StepBatch`` from its feed (``data.batch.BatchSource``:
   ``data.batch.LocalBatches`` in this process, or the preprocessing workers of
   ``dtdsl.feed`` in a launched job), off the timed actions: the routing of every unit
   replica per microbatch step, the sizes of every sample, the samples this rank reads
   (``data.batch.reads_of``) and the loss denominators of the whole batch;
2. runs its stage's action list in program order:

   - ``F`` / ``B``: the stage's slice of the unit (with the units co-located on it) on
     this replica's samples; losses are already divided by the global denominators, so
     they are summed. ``B`` keeps the gradients of the stage's inputs for ``SEND_B``.
     Under zero_bubble ``B`` and ``W`` split a backward (``train.zerobubble``).
   - ``SEND_*`` / ``RECV_*``: within a unit, ``parallel.p2p.P2P`` to the neighbour stage
     of the same replica and TP index (receives name their shapes from the plan and the
     sample sizes, so a message is one transfer; consecutive communication actions go out
     as one batch); across units, ``parallel.broker.Broker``, routed per sample.
   - ``SYNC`` / ``OPT``: markers. FSDP2 reduces the gradients (``Stage.reduce_early``,
     ``Stage.reduce_gradients``), then EVERY rank calls ``train.optim.optimizer_step``
     once, since the global gradient norm, the inf/NaN skip and the step's loss totals
     are one all-reduce over the whole job; on a stage that trains, that call is its
     ``SYNC`` and ``OPT`` events.

Tensor parallelism is ``parallel.tp.parallelize_unit`` (attention and MLP blocks sharded,
a backbone with sequence parallelism and a vocabulary-parallel embedding and LM head);
context parallelism is ``parallel.cp``. Co-located units (``parallel.mesh.hosted_units``)
run inside their host stage's ``F`` and ``B``. A phased encoder
(``parallel.mesh.phased_units``) runs on every backbone rank outside the schedule: a
forward phase before the first action (embeddings sent to the backbone's first stage) and
a backward phase after the last (``train.phases``); each phase is one event with no
microbatch on the rank's own row. What a pass reads of its samples is ``train.inputs``.

Timing (``train.clock``): each action's start and end are marks read once after the
optimizer step (CUDA events on a GPU, host time on the CPU).
``train.timelines.gather_timeline`` collects the measured ``ir.timeline.Timeline`` of
timed steps.

Interleaved 1F1B (a unit with vpp > 1): the rank's stage holds its model chunks (``Stage.
chunks``, under one FSDP2 root); each action names its chunk, which picks the layers a
pass runs (``train.passes``), the microbatch's stash (by chunk and microbatch) and, on a
PP message, the peer's chunk. Only the unit's first virtual stage (stage 0, chunk 0)
embeds and talks to the encoders, only its last (stage pp-1, chunk vpp-1) has the head
and talks to the generators.

A generator's passes, and a DiT's over several pipeline stages, are ``train.generator``.

Limits: more than one phased encoder raises NotImplementedError.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtdsl.data.batch import BatchSource, LocalBatches, StepBatch
from dtdsl.ir import program as ir
from dtdsl.ir.layout import SequenceLayout, layout_of
from dtdsl.ir.modal import pixel_norm
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Action, ActionKind, Schedule
from dtdsl.ir.sizes import SampleSizes
from dtdsl.ir.timeline import Event
from dtdsl.models.inputs import PackedImages, Pixels, Sample, unpack_images
from dtdsl.models.moe import moe_blocks, set_loss_scale, take_aux_losses
from dtdsl.models.multimodal import (
    Normalizer,
    conditioning,
    conditioning_rows,
    encoder_rows,
    packed_item_shapes,
    padded_width,
    splice_items,
)
from dtdsl.parallel.broker import Broker, PendingSamples, StepSamples
from dtdsl.parallel.cp import padded_length
from dtdsl.parallel.device import to_device
from dtdsl.parallel.ep import full_parameters
from dtdsl.parallel.mesh import ProcessGroups, RankRole
from dtdsl.parallel.p2p import P2P, Received, TensorSpec
from dtdsl.train import timelines
from dtdsl.train.clock import StepClock, step_clock
from dtdsl.train.cp_run import attach_cp, sum_over_cp
from dtdsl.train.generator import GeneratorPasses
from dtdsl.train.handoff import Handed, PerPeer, Sink, grad_of, last_sends, sinks
from dtdsl.train.inputs import PassInputs
from dtdsl.train.optim import LossScale, StageOptimizer, optimizer_step
from dtdsl.train.passes import Units, stage_run
from dtdsl.train.phases import _BWD, _FWD, PhasedEncoder
from dtdsl.train.record import StepRecord
from dtdsl.train.stage import Stage, build_stage
from dtdsl.train.zerobubble import SplitBackward

__all__ = ["StageExecutor", "StepRecord", "run_rank", "stage_run"]

_COMM = (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)


@dataclass
class _Micro:
    """What one microbatch leaves between its actions on this rank."""

    inputs: Any = None          # received / built inputs (leaves where gradients go back)
    pending: dict[str, Any] = field(default_factory=dict)   # RECV_F in flight, by peer unit
    outputs: Any = None         # F's outputs that B differentiates
    outbox: Any = None          # what SEND_F sends
    loss: torch.Tensor | None = None
    grads_in: dict[str, Any] = field(default_factory=dict)  # RECV_B in flight, by peer unit
    input_grads: Any = None     # what SEND_B sends


class StageExecutor(PhasedEncoder, PassInputs, GeneratorPasses):
    """Runs one rank's stage of ``schedule`` (see the module docstring).

    ``groups``: this rank's ``mesh.build_groups(plan)``; ``device``: the rank's device
    (``parallel.device.rank_device``); ``seed``: the initialisation seed (``train.seed``
    to match the reference); ``initialize=False``: leave the parameters for a checkpoint
    to fill (``Stage.initialize`` when there is none); ``clock``: what times the actions
    (default ``clock.step_clock(device)``: CUDA events on a GPU, host time on the CPU)."""

    def __init__(self, program: ir.Program, plan: Plan, schedule: Schedule, *,
                 rank: int, groups: ProcessGroups, device: torch.device | str = "cpu",
                 seed: int | None = None, feed: BatchSource | None = None,
                 initialize: bool = True, clock: StepClock | None = None):
        self.program, self.plan, self.schedule = program, plan, schedule
        self.role: RankRole = groups.role
        if self.role.rank != rank:
            raise ValueError(f"groups belong to rank {self.role.rank}, not {rank}")
        if self.role.role == "generator" and self.role.grid.pp != 1 and \
                not isinstance(program.module(self.role.unit).arch, ir.DiTArch):
            raise NotImplementedError(f"generator {self.role.unit} has pp={self.role.grid.pp}: "
                                      "a U-Net runs on one pipeline stage")
        if schedule.num_microbatches != plan.num_microbatches:
            raise ValueError(f"schedule of {schedule.num_microbatches} microbatches for a "
                             f"plan of {plan.num_microbatches}")
        self.groups = groups
        self.device = torch.device(device)
        self.seed = program.train.seed if seed is None else seed
        self.actions: tuple[Action, ...] = schedule.stage(self.role.unit, self.role.stage).actions
        # Model chunks (an interleaved unit's, vpp > 1): the one a pass runs, and those
        # whose inputs' gradients are sent back and whose outputs go forward.
        self.vpp, self._chunk = plan.unit(self.role.unit).vpp, 0
        self._grad_chunks = {a.chunk for a in self.actions if a.kind is ActionKind.SEND_B}
        self._fwd_chunks = {a.chunk for a in self.actions if a.kind is ActionKind.SEND_F}
        self._last_sends = last_sends(self.actions)     # the outbox is dropped after them
        self.trains_in_schedule = any(a.kind is ActionKind.OPT for a in self.actions)
        backwards = [i for i, a in enumerate(self.actions) if a.kind is ActionKind.B]
        self._last_backward = backwards[-1] if backwards else -1
        self.p2p = P2P(self.device)
        # A phased encoder's hand-offs between this replica's stages: the PP group's channel.
        self.phase_p2p = P2P(self.device, group=groups.mesh.get_group("pp")) \
            if groups.phased and self.role.grid.pp > 1 else None
        self.broker = Broker(plan, rank, self.p2p, groups)
        self._leader = self.role.grid.leader(self.role.stage, self.role.replica)
        self.stage: Stage = build_stage(program, plan, self.role, groups.mesh, self.device,
                                        seed=self.seed, run=stage_run(self.role.role),
                                        initialize=initialize, phased=groups.phased,
                                        phased_run=stage_run("encoder"), ep=groups.ep)
        if len(self.stage.phased) > 1:
            raise NotImplementedError("one phased encoder: plan the other encoders as their "
                                      "own units")
        self._cp = attach_cp(program, plan, self.stage, groups)
        self.split = SplitBackward(self.stage, self.actions)    # B and W (zero_bubble)
        # The phased encoder's embeddings of this replica's samples (first stage), as leaves.
        self._phased_in: dict[int, torch.Tensor] = {}
        # Per phased encoder, this rank's share of the step: (samples, their packed
        # images) per microbatch step, from the forward phase to the backward phase.
        self._phase_packs: dict[str, list[tuple[list[int], PackedImages | None]]] = {}
        # On the first stage, between the phases: per sample whose embeddings are on
        # their way, its step's message (``_phase_forward``); per stage whose embedding
        # gradients it has not sent yet, the steps it still waits for (``_phase_grads_due``).
        self._phase_waiting: dict[int, tuple[list[int], Any]] = {}
        self._phase_due: dict[int, set[int]] = {}
        self.model = Units(program, self.stage.module.units)
        self._moe = moe_blocks(self.stage.module)   # an MoE backbone's blocks, found once
        # Co-located modules this stage runs (a backbone's first stage: the encoder, its
        # last: the generators), on its own ranks and samples.
        hosted = {n: program.module(n).role for n in self.stage.hosted}
        # Co-located encoders, in forward order (their embeddings are spliced with the
        # other encoders' received ones).
        self._hosted_encoders = [n for n, r in hosted.items() if r == "encoder"]
        self._hosted_encoder = self._hosted_encoders[0] if self._hosted_encoders else None
        if self._hosted_encoder and self.stage.phased:
            raise NotImplementedError("a phased encoder beside a co-located one: plan the "
                                      "other encoders as their own units")
        self._hosted_generators = [n for n, r in hosted.items() if r == "generator"]
        self.dtype = self.stage.compute_dtype
        self._patch = self.model.patch
        # Images arrive as uint8 pixels (a dataset's) and are normalised on this device,
        # per packed group (``models.inputs.Pixels``); its constants are copied here once.
        self._pixels = Pixels(*pixel_norm(program), device=self.device) \
            if self._hosted_encoder or self.stage.phased or self.role.role == "encoder" \
            else None
        self._image_tokens = self.model.image_tokens
        self._inputs = self.model.inputs
        # The encoder whose items this rank encodes: its own unit, or the one it hosts or
        # runs phased (one at most, checked above).
        self._encoder = self.role.unit if self.role.role == "encoder" else \
            self._hosted_encoder or next(iter(self.stage.phased), None)
        self._width = program.backbone.arch.hidden
        self._build_optimizer()
        self.local_sgd = self._build_local_sgd()
        self._allreduce_bytes: int | None = None     # _dp_payload_bytes, once
        # fp16's dynamic loss scale (``optim.LossScale``): every loss's backward starts from
        # it (an MoE backbone's aux losses' too); the optimizer unscales, skips, updates it.
        self.loss_scale = LossScale() if program.train.precision == "fp16" else None
        set_loss_scale(self._moe, self.loss_scale)
        self._forward = {"encoder": self._encoder_forward, "backbone": self._backbone_forward,
                         "generator": self._generator_forward}[self.role.role]
        self._t0 = 0.0
        self.clock: StepClock = clock if clock is not None else step_clock(self.device)
        self.feed: BatchSource = feed if feed is not None else LocalBatches(
            program, plan, self.role, pin=self.device.type != "cpu")
        self.batch: StepBatch | None = None
        self._layouts: dict[int, SequenceLayout] = {}    # this step's, by position
        self.steps: tuple[StepSamples, ...] = ()
        self._ids: tuple[tuple[int, ...], ...] = ()
        self.norm: Normalizer | None = None
        self.step = -1

    # ---- building -------------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        program, role = self.program, self.role
        named = self.stage.named_parameters()
        trainable = [(k, p) for k, p in named.items() if p.requires_grad]
        if bool(trainable) != self.trains_in_schedule:
            raise RuntimeError(f"{role.unit}.s{role.stage}: the schedule says it "
                               f"{'trains' if self.trains_in_schedule else 'trains nothing'}"
                               f" but it holds {len(trainable)} trainable parameters; lower "
                               "the schedule from the same program")
        opt = program.train.optimizer
        self.optimizers: list[StageOptimizer] = []
        # One optimizer per FSDP2 root (the stage, each phased encoder): a checkpoint
        # saves each with its module (``checkpoint_parts``).
        self._parts: list[tuple[torch.nn.Module, StageOptimizer | None]] = []
        from dtdsl.train.lr import lr_at

        train = program.train
        phased = {n for part in self.stage.phased.values() for n in part.named_parameters()}
        roots = [(self.stage.module, [(k, p) for k, p in trainable if k not in phased])]
        roots += [(part.module, [(k, p) for k, p in part.named_parameters().items()
                                 if p.requires_grad]) for part in self.stage.phased.values()]
        for module, params in roots:
            if not params:
                self._parts.append((module, None))
                continue
            self.optimizers.append(StageOptimizer(
                [p for _, p in params], name=opt.name, lr=opt.lr, betas=tuple(opt.betas),
                eps=opt.eps, weight_decay=opt.weight_decay, tp_index=role.tp_index,
                counted_on_tp=[k in self.stage.tp_sharded for k, _ in params],
                # A tied LM head on the last stage is the first stage's embedding again.
                uncounted=[k == self.stage.tied_name and role.is_last_stage
                           for k, _ in params],
                lr_at=lambda step: lr_at(train.lr_schedule, opt.lr, train.steps, step),
                offload=self.plan.offload_fraction(program)))
            self._parts.append((module, self.optimizers[-1]))

    def _build_local_sgd(self) -> Any:
        """``train.local_sgd.StageSync`` over this rank's FSDP2 roots when the spec says
        ``sync = local_sgd(...)`` (the roots' DP meshes are then laid out in replicas,
        ``ir.Train.mesh_zero`` and ``replica_dp``); None for synchronous DP."""
        sync = self.program.train.sync
        if not sync.local:
            return None
        from dtdsl.train.local_sgd import StageSync, config_of

        ep = self.plan.unit(self.role.unit).ep
        if ep > 1 and sync.replica_ranks(self.role.grid.dp) % ep:
            # Replicas would average experts that differ (DT636 at compile time).
            raise ValueError(f"{self.role.unit}: ep {ep} does not fit in a local_sgd "
                             f"replica of {sync.replica_ranks(self.role.grid.dp)} rank(s)")
        meshes = [self.groups.mesh] + [self.groups.phased[n] for n in self.stage.phased]
        names = {id(p): k for k, p in self.stage.named_parameters().items()}
        parts = []
        for (module, opt), mesh in zip(self._parts, meshes, strict=True):
            params = [] if opt is None else list(opt.params)
            # Counted once per TP group (a TP-replicated block on TP index 0) and a tied
            # LM head not at all, as the gradient norm counts them (``_build_optimizer``).
            counted = [(names[id(p)] in self.stage.tp_sharded or self.role.tp_index == 0)
                       and not (names[id(p)] == self.stage.tied_name
                                and self.role.is_last_stage) for p in params]
            tag = f"{self.role.unit}.s{self.role.stage}" if module is self.stage.module \
                else f"{self.role.unit}.s{self.role.stage}.phased"
            parts.append((mesh, params, counted, [names[id(p)] for p in params], tag,
                          None if opt is None else opt.optimizer, module))
        return StageSync(parts, config_of(sync), unit=self.role.unit,
                         tp_group=self.stage.tp_group if self.role.grid.tp > 1 else None)

    def _stepping(self) -> list[Any]:
        """The optimizers as the job's step sees them: under Local SGD each scaled to its
        unit's replicas (``local_sgd.ReplicaScaled``)."""
        if self.local_sgd is None:
            return list(self.optimizers)
        from dtdsl.train.local_sgd import ReplicaScaled

        return [ReplicaScaled(o, self.local_sgd.replicas_of(o.params))
                for o in self.optimizers]

    def _dp_payload_bytes(self) -> int:
        """What this rank puts into data-parallel collectives this step (the metric
        ``dp_sync_bytes``, summed over the job): the Local SGD synchronisation when one
        is due, else FSDP2's gradient reduce-scatter (fp32, unsharded) and, with ZeRO-1,
        its parameter all-gather (compute dtype) of every root with several replicas."""
        if self.local_sgd is not None:
            return self.local_sgd.payload_bytes()
        if self._allreduce_bytes is None:
            self._allreduce_bytes = self._reduce_bytes()
        return self._allreduce_bytes

    def _reduce_bytes(self) -> int:
        meshes = [self.groups.mesh] + [self.groups.phased[n] for n in self.stage.phased]
        out = 0
        gather = self.program.train.optimizer.zero >= 1
        names = {id(p): k for k, p in self.stage.named_parameters().items()}
        for (_, opt), mesh in zip(self._parts, meshes, strict=True):
            replicas = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
            if opt is None or replicas < 2:
                continue
            for p in opt.params:
                numel = p.numel() // (self.role.grid.tp if names[id(p)] in
                                      self.stage.tp_sharded else 1)
                out += numel * (4 + (self.dtype.itemsize if gather else 0))
        return out

    def checkpoint_parts(self) -> list[tuple[torch.nn.Module, StageOptimizer | None]]:
        """Each FSDP2 root this rank holds (its stage's module, then each phased
        encoder's) with its optimizer (None where it trains nothing): what a checkpoint
        saves, one ``get_state_dict`` each."""
        return list(self._parts)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters as ``{"unit.param": tensor}`` (DTensors: FSDP2's
        shards, with TP placements where sharded)."""
        return self.stage.named_parameters()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``named_parameters`` as full (single-process) tensors. Collective over the
        stage's ranks (DTensor ``full_tensor``, an EP group's experts gathered too)."""
        return full_parameters(self.stage.module, self.named_parameters())

    # ---- peers ----------------------------------------------------------------------------

    def _pp_peer(self, stage: int) -> int:
        # Under context parallelism stage s's CP rank r talks to stage s+1's CP rank r.
        return self.role.grid.rank(stage, self.role.replica, self.role.tp_index,
                                   self.role.cp_index)

    # ---- one training step ----------------------------------------------------------------

    def _begin(self, step: int) -> StepBatch:
        """Step ``step``'s batch from the feed, checked against the plan, and the step's
        state: its routing, this rank's samples per microbatch, the loss normaliser, the
        loss sums and the counts of what it processes."""
        self.step = step
        # Off the timed actions: in a real job the preprocessing workers built it ahead.
        batch = self.batch = self.feed.batch(step)
        self._layouts = {}
        if batch.step != step:
            raise RuntimeError(f"the data feed gave step {step} for step {step}")
        if len(batch.routing) != self.plan.num_microbatches:
            raise RuntimeError(f"step {step}'s routing has {len(batch.routing)} microbatch "
                               f"steps for a plan of {self.plan.num_microbatches}")
        if len(batch.sizes) != sum(len(s.sample_ids) for s in batch.routing):
            raise RuntimeError(f"step {step}'s data has sizes of {len(batch.sizes)} samples "
                               "for the batch it routes; the feed must send every sample's "
                               "sizes")
        self.steps = batch.routing
        r = self.role
        self._ids = tuple(tuple(s.samples_of(r.unit, r.replica)) for s in self.steps)
        self.norm = batch.normalizer
        self.micro: dict[tuple[int, int], _Micro] = {}     # by (chunk, microbatch)
        self.lm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.gen = torch.zeros((), dtype=torch.float64, device=self.device)
        # What this rank's stage took in this step, counted from the tensors themselves
        # (on a unit's first stage): image patches, backbone positions and the text tokens
        # among them, generation targets.
        self.processed = {"patches": 0, "positions": 0, "text_tokens": 0, "targets": 0}
        return batch

    def run_step(self, step: int, *, timed: bool = False) -> StepRecord:
        """Run training step ``step`` (``StepRecord``). ``timed``: the step's events go
        into a gathered timeline, so every rank starts the step at a barrier (a common
        origin for their times); other steps start without one."""
        batch = self._begin(step)
        # (kind, microbatch, clock mark) per event: the clock is read once the step's
        # actions are done (``train.clock``: on CUDA, events read with one sync).
        marks: list[tuple[str, int | None, int, int]] = []
        self.stage.begin_step(skip=self.local_sgd.pending_modules() if self.local_sgd else ())
        if timed:
            dist.barrier()     # a common origin for every rank's event times
        self._t0 = time.perf_counter()
        self.clock.start()
        # A phased encoder's phases are events of the rank's own row with no microbatch
        # (the schedule's passes all have one): one row per GPU, as the simulator's.
        for name in self.stage.phased:
            mark = self.clock.begin()
            self._phase_forward(name)
            self.clock.end(mark)
            marks.append((_FWD, None, mark, 0))
        for i, a in enumerate(self.actions):
            if a.kind in (ActionKind.SYNC, ActionKind.OPT):
                continue
            if a.kind not in _COMM:
                # Consecutive communication actions go out as one batch, before compute;
                # a pass's time starts once what it receives is here (its wait for a
                # peer is the pipeline's bubble, not its compute).
                self.p2p.flush()
                self._await_inputs(a)
                if self._phase_waiting:
                    self._phase_arrivals(a)
            if i == self._last_backward:
                # A backbone's layers reduce-scatter their gradients as each one's last
                # backward ends, behind the backward of the layers before it.
                self.stage.reduce_early()
            mark = self.clock.begin()
            self._run(i, a)
            self.clock.end(mark)
            marks.append((a.kind.value, a.microbatch, mark, a.chunk))
            if self._phase_due:
                self._phase_grads_due(a)
        self.p2p.flush()    # the last sends (a last SEND_B) go out before the reduction
        if self._last_backward >= 0:
            # FSDP2's gradient reduction of the rest, once, after the stage's last
            # backward (waiting for it before the last gradient is sent would hold the
            # previous stage up).
            self.stage.reduce_gradients()
        for name, part in self.stage.phased.items():
            if part.trainable():
                mark = self.clock.begin()
                self._phase_backward(name)
                self.clock.end(mark)
                marks.append((_BWD, None, mark, 0))
            # Every rank of the encoder's DP group reduces (or, frozen, reshards), its
            # share empty or not: ``Stage.reduce_gradients``.
            part.reduce_gradients()
        self._phased_in, self._phase_packs = {}, {}
        self._phase_waiting, self._phase_due = {}, {}
        self.p2p.wait_sends()
        if self.phase_p2p is not None:
            self.phase_p2p.wait_sends()
        if self.micro and any(m.pending or m.grads_in for m in self.micro.values()):
            raise RuntimeError(f"{self.role.unit}.s{self.role.stage}: step {step} ended "
                               "with receives nobody used; the schedule and the executor "
                               "disagree")
        mark = self.clock.begin()
        train = self.program.train
        scale = self.loss_scale.scale if self.loss_scale is not None else None
        if self.local_sgd is not None:
            self.local_sgd.decide(step, time.perf_counter())
        payload = float(self._dp_payload_bytes())
        # The step's losses are summed over the job in the optimizer's one all-reduce.
        result = optimizer_step(self._stepping(), step=step,
                                max_norm=train.grad_clip if train.grad_clip > 0 else None,
                                totals=(self.lm, self.gen, payload), device=self.device,
                                loss_scale=self.loss_scale)
        if self.local_sgd is not None:
            self.local_sgd.after_step(step, time.perf_counter())
        self.clock.end(mark)
        if self.trains_in_schedule:
            marks += [("SYNC", None, mark, 0), ("OPT", None, mark, 0)]
        spans = self.clock.read()
        events = [self._event(kind, mb, spans[m], c) for kind, mb, m, c in marks]
        lm, gen, dp_bytes = result.totals
        compiled = self.stage.compiled
        return StepRecord(
            step=step, loss=lm + gen, lm_loss=lm, gen_loss=gen, grad_norm=result.grad_norm,
            skipped=result.skipped, loss_scale=scale,
            skipped_steps=self.loss_scale.skipped_steps if self.loss_scale else None,
            time_s=time.perf_counter() - self._t0, data_wait_s=batch.wait_s, events=events,
            processed=dict(self.processed), dp_sync_bytes=int(dp_bytes),
            # A step where it grows recompiled (``train.compiled``).
            compiled_graphs=compiled.graphs if compiled is not None else 0)

    def train(self, steps: int, *, first_step: int = 0,
              metrics_path: str | Path | None = None,
              logdir: str | Path | None = None) -> list[StepRecord]:
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
                result = self.run_step(step, timed=logdir is not None)
                out.append(result)
                if metrics_path is not None and self.role.rank == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({k: result[k] for k in (
                            "step", "loss", "lm_loss", "gen_loss")}) + "\n")
                if logdir is not None:
                    timeline = timelines.gather_timeline(self.plan, step, result["events"],
                                               device=self.device)
                    if writer is not None and timeline is not None:
                        scalars = {"loss/total": result["loss"], "loss/lm": result["lm_loss"],
                                   "loss/gen": result["gen_loss"],
                                   "grad_norm": result["grad_norm"],
                                   "compiled_graphs": result["compiled_graphs"],
                                   "comm/dp_sync_bytes": result["dp_sync_bytes"]}
                        writer.add_step(step, timeline, {k: float(v) for k, v in
                                                         scalars.items() if v is not None})
        finally:
            if writer is not None:
                writer.close()
        if self.local_sgd is not None:     # no half-synchronised model after training
            self.local_sgd.settle()
        return out

    def _event(self, kind: str, microbatch: int | None, span: tuple[float, float],
               chunk: int) -> Event:
        """An event of this rank's row; ``span``: its (start_s, end_s) from the step's
        start, as the step's clock read them."""
        r = self.role
        return Event(unit=r.unit, stage=r.stage, replica=r.replica, rank=self._leader,
                     kind=kind, microbatch=microbatch, chunk=chunk, start_s=span[0],
                     end_s=span[1])

    def _sample(self, i: int) -> Sample:
        assert self.batch is not None
        try:
            return self.batch.samples[i]
        except KeyError:
            raise RuntimeError(f"{self.role.unit}.s{self.role.stage} replica "
                               f"{self.role.replica}: step {self.step}'s data lacks sample "
                               f"{i}, which its routing sends here") from None

    def _sizes(self, i: int) -> SampleSizes:
        assert self.batch is not None
        return self.batch.sizes[i]

    def _layout(self, i: int) -> SequenceLayout:
        """Sample ``i``'s place in the backbone's sequence (``ir.layout``), from its sizes."""
        found = self._layouts.get(i)
        if found is None:
            found = self._layouts[i] = layout_of(self._sizes(i), self._image_tokens,
                                                 self.program.train.seq_len)
        return found

    def _index(self, j: int) -> int:
        """Microbatch ``j``'s index in the run (labels of its messages)."""
        return self.step * self.plan.num_microbatches + j

    def _await_inputs(self, a: Action) -> None:
        """Wait for the receives pass ``a`` reads (they keep what they received)."""
        mb = self.micro.get((a.chunk, a.microbatch))
        if mb is None:
            return
        waiting = mb.pending if a.kind is ActionKind.F else mb.grads_in
        for received in waiting.values():
            received.wait()

    def _run(self, index: int, a: Action) -> None:
        """Run action ``a``, the ``index``-th of this stage's list."""
        j = a.microbatch
        assert j is not None
        key = (a.chunk, j)      # an interleaved unit's chunks each keep their own stash
        self._chunk = a.chunk   # the chunk the pass runs
        if a.kind is ActionKind.W:
            return self.split.weights(key)
        mb = self.micro.setdefault(key, _Micro())
        kind = a.kind
        if kind is ActionKind.F:
            self._forward(j, mb)
        elif kind is ActionKind.B:
            self._backward(index, j, mb)
            self.micro.pop(key)
            if self.sends_grad:
                self.micro[key] = _Micro(input_grads=mb.input_grads)
        elif kind is ActionKind.SEND_F:
            self._send(a, j, mb.outbox, _FWD)
            if index in self._last_sends:
                mb.outbox = None
        elif kind is ActionKind.SEND_B:
            self._send(a, j, mb.input_grads, _BWD)
            if isinstance(mb.input_grads, PerPeer):     # one SEND_B per encoder
                mb.input_grads.pop(a.peer_unit)
                if mb.input_grads:
                    return
            self.micro.pop(key, None)
        elif kind is ActionKind.RECV_F:
            assert a.peer_unit is not None
            mb.pending[a.peer_unit] = self._recv(a, j, _FWD)
        elif kind is ActionKind.RECV_B:
            assert a.peer_unit is not None
            mb.grads_in[a.peer_unit] = self._recv(a, j, _BWD)
        else:   # pragma: no cover - SYNC/OPT are handled by run_step
            raise AssertionError(kind)

    # ---- communication --------------------------------------------------------------------

    def _send(self, a: Action, j: int, payload: Any, direction: str) -> None:
        assert a.peer_unit is not None and a.peer_stage is not None
        index = self._index(j)
        if a.peer_unit == self.role.unit:
            peer = self._pp_peer(a.peer_stage)
            self.p2p.send(peer, list(payload), self._pp_label(direction, index, (
                (self.role.stage, a.chunk), (a.peer_stage, a.peer_chunk))))
        elif direction == _FWD:
            self.broker.send_forward(index, self.role.unit, a.peer_unit, payload, self.steps[j])
        else:
            if isinstance(payload, PerPeer):   # several encoders: this one's gradients
                payload = payload[a.peer_unit]
            self.broker.send_backward(index, a.peer_unit, self.role.unit, payload,
                                      self.steps[j])

    def _pp_label(self, direction: str, index: int,
                  ends: tuple[tuple[int, int], tuple[int, int]]) -> str:
        """A PP message's label, between two (stage, chunk), named by virtual stage."""
        r = self.role
        src, dst = (c * r.grid.pp + s for s, c in ends)
        return (f"{r.unit}.s{src}->{r.unit}.s{dst} {direction} {index} "
                f"r{r.replica}t{r.tp_index}")

    def _recv(self, a: Action, j: int, direction: str) -> Received | PendingSamples:
        assert a.peer_unit is not None and a.peer_stage is not None
        index = self._index(j)
        if a.peer_unit == self.role.unit:
            peer = self._pp_peer(a.peer_stage)
            specs = self._pp_specs(j, direction)
            return self.p2p.recv(peer, specs, self._pp_label(direction, index, (
                (a.peer_stage, a.peer_chunk), (self.role.stage, a.chunk))))
        if direction == _FWD:
            return self.broker.recv_forward(index, a.peer_unit, self.role.unit, self.steps[j],
                                            self._edge_spec(a.peer_unit))
        return self.broker.recv_backward(index, self.role.unit, a.peer_unit, self.steps[j],
                                         self._edge_spec(a.peer_unit))

    def _edge_spec(self, peer: str) -> Any:
        """The shape of one sample's tensor on the edge between this unit and ``peer``."""
        role = self.role.role
        peer_role = self.plan.unit(peer).role
        width, rules = self._width, self._inputs
        if {role, peer_role} == {"encoder", "backbone"}:
            name = self.role.unit if role == "encoder" else peer
            return lambda i: TensorSpec((encoder_rows(self._sizes(i), rules, name), width),
                                        self.dtype)
        return lambda i: TensorSpec((sum(conditioning_rows(self._layout(i))), width),
                                    self.dtype)

    def _pp_specs(self, j: int, direction: str) -> list[TensorSpec]:
        """What a PP message of microbatch ``j`` holds (forward: activations and, on a
        backbone, the targets; backward: the activations' gradients)."""
        sizes = [self._sizes(i) for i in self._ids[j]]
        if self.role.role == "encoder":
            arch = self.program.module(self.role.unit).arch
            # Context parallelism: each CP rank sends its PP peer its shard of each group.
            cp = self.role.grid.cp
            return [TensorSpec((n, rows if cp == 1 else padded_length(rows, cp) // cp,
                                arch.hidden), self.dtype)
                    for n, rows in self._encoder_groups(sizes)]
        if self.role.role == "generator":
            return self._generator_specs(j)
        seq = max((self._layout(i).length for i in self._ids[j]), default=0)
        # Sequence parallelism: each TP rank sends its PP peer its piece of the sequence;
        # context parallelism: each CP rank its shard (``parallel.cp``).
        tp, cp = self.role.grid.tp, self.role.grid.cp
        seq = padded_width(seq, tp, cp) // cp
        specs = [TensorSpec((len(sizes), seq // tp, self._width), self.dtype)]
        if direction == _FWD:
            specs.append(TensorSpec((len(sizes), seq), torch.int64))
        return specs

    def _leaf(self, t: torch.Tensor, hold: bool = True) -> Any:
        """A received tensor as an autograd leaf (own storage, gradient wanted when this
        stage sends gradients back); not ``hold``: a ``handoff.Sink`` of it."""
        t = t.clone()
        if not (self.sends_grad and t.is_floating_point()):
            return t
        return t.requires_grad_(True) if hold else Sink(t)

    @property
    def sends_grad(self) -> bool:
        """Whether the running chunk sends its inputs' gradients back."""
        return self._chunk in self._grad_chunks

    @property
    def _first(self) -> bool:
        """Whether the running chunk is the unit's first virtual stage."""
        return self.role.is_first_stage and self._chunk == 0

    @property
    def _last(self) -> bool:
        """Whether the running chunk is the unit's last virtual stage."""
        return self.role.is_last_stage and self._chunk == self.vpp - 1

    # ---- phased encoders ----------------------------------------------------------------

    # ---- forwards ---------------------------------------------------------------------------

    def _encoder_groups(self, sizes: list[Any]) -> list[tuple[int, int]]:
        """This encoder unit's packed groups of samples ``sizes``: (items, rows after
        the embedding) each, in ``_pack``'s order."""
        arch = self.program.module(self.role.unit).arch
        return packed_item_shapes(sizes, self._inputs, self.role.unit, int(arch.cls_token))

    def _encoder_forward(self, j: int, mb: _Micro) -> None:
        ids, samples = list(self._ids[j]), [self._sample(i) for i in self._ids[j]]
        packed = self._pack(samples)
        # Under context parallelism a later stage receives shards: each group's whole
        # length is known from the samples' sizes.
        extra = {} if self._cp is None or self._first else {"lengths": [
            rows for _, rows in self._encoder_groups([self._sizes(i) for i in ids])]}
        if self._first:
            xs = None
            mb.inputs = None
            self.processed["patches"] += sum(g.shape[0] * g.shape[1] for g in packed.groups)
        else:
            (pending,) = mb.pending.values()
            xs = [self._leaf(t) for t in pending.wait()]
            mb.inputs = xs
        mb.pending = {}
        ys = self.stage.module(packed.groups if xs is None else xs, first=xs is None,
                               grids=packed.grids, chunk=self._chunk, **extra)
        if self._last:
            outs = dict(zip(ids, unpack_images(packed, ys, width=self._width), strict=True))
            mb.outbox = {i: o.detach() for i, o in outs.items()}
            mb.outputs = {i: Handed(o) for i, o in outs.items()}
        else:
            mb.outputs = ys
            mb.outbox = [y.detach() for y in ys]

    def _backbone_forward(self, j: int, mb: _Micro) -> None:
        role = self.role
        ids = list(self._ids[j])
        extra: dict[str, Any] = {}
        extra["chunk"] = self._chunk
        if self._last and self._hosted_generators:
            extra["generation"] = self._generation(ids)
        if self._first:
            samples = [self._sample(i) for i in ids]
            packs = {n: p for n in self._hosted_encoders
                     if (p := self._hosted_images(samples, n)) is not None}
            # The encoders of their own units: each sample's rows of every one, as
            # autograd leaves per encoder (each gets its own gradients back).
            leaves, slots = sinks({peer: {i: self._leaf(t[i], hold=False) for i in ids}
                                   for peer, t in ((p, q.wait()) for p, q in mb.pending.items())})
            zero = torch.zeros(0, self._width, dtype=self.dtype, device=self.device)
            # One co-located encoder alone: its packed items; several, or beside received
            # embeddings: per encoder (spliced in ``_run_backbone``).
            images = None if not packs else next(iter(packs.values())) \
                if len(packs) == 1 and not leaves and len(self._hosted_encoders) == 1 \
                else packs
            if images is not None:
                # The co-located encoders embed them inside the stage's forward, spliced
                # there with the received ones (``_run_backbone``); the zero-row
                # placeholders below are replaced there.
                extra["images"] = images
                if leaves:
                    extra["received"] = {p: [got[i] for i in ids] for p, got in leaves.items()}
                embeds = {i: zero for i in ids}
            else:
                own: dict[str, Any] = {}
                if self.stage.phased:   # the phased encoder's, received before the pipeline
                    own = {next(iter(self.stage.phased)): {i: self._phased_embeds(i)
                                                           for i in ids}}
                parts = {**own, **leaves}
                if len(parts) > 1:      # spliced in the order the layout places the items
                    embeds = {i: splice_items({p: got[i] for p, got in parts.items()},
                                              self._layout(i)) for i in ids}
                elif parts:
                    (got,) = parts.values()
                    embeds = dict(got)
                else:
                    embeds = {i: zero for i in ids}
            rows = [sum(self._layout(i).image_tokens) for i in ids]
            # What SEND_B sends each encoder: its leaves' gradients (none for the phased
            # or co-located encoder, whose backward runs here).
            if len(leaves) > 1 or (leaves and (images is not None or self.stage.phased)):
                mb.inputs = PerPeer(slots)
            elif leaves:
                (mb.inputs,) = slots.values()
            else:
                mb.inputs = None if images is not None else embeds
            tokens = [to_device(s.tokens, self.device) for s in samples]
            self.processed["text_tokens"] += sum(len(t) for t in tokens)
            self.processed["positions"] += sum(len(t) for t in tokens) + sum(rows)
            out = self.stage.module(image_embeds=[embeds[i] for i in ids], tokens=tokens,
                                    layouts=[self._layout(i) for i in ids],
                                    loss_tokens=self._loss_tokens(ids),
                                    loss_rows=self._loss_rows(ids), **extra)
        else:
            (pending,) = mb.pending.values()
            x_in, targets = pending.wait()
            x = self._leaf(x_in)
            mb.inputs = [x]
            out = self.stage.module(x=x, targets=targets, loss_tokens=self._loss_tokens(ids),
                                    layouts=[self._layout(i) for i in ids],
                                    loss_rows=self._loss_rows(ids), **extra)
        mb.pending = {}
        # An MoE backbone's aux losses on this stage's layers (their gradients join the
        # backward through the layers' outputs): reported with the LM loss, once per TP group.
        aux = take_aux_losses(self._moe)
        if aux is not None and role.is_leader:
            self.lm += aux.to(self.lm.device).double()
        if self._last:
            loss_sum, hidden, gens = out
            assert self.norm is not None
            lm = loss_sum / max(1, self.norm.text_tokens)
            mb.loss = lm
            if gens:    # the co-located generators' losses join the backward
                gen = sum(gens.values()) / max(1, self.norm.gen_targets)
                mb.loss = lm + gen
            if role.counts_loss:    # TP ranks hold the same loss: count it once
                self.lm += lm.detach().double()
                if gens:
                    self.gen += gen.detach().double()
            if self._chunk in self._fwd_chunks:  # the generators' conditioning
                conds = conditioning(hidden, [self._layout(i) for i in ids])
                mb.outbox = {i: c.detach() for i, c in zip(ids, conds, strict=True)}
                mb.outputs = {i: Handed(c) for i, c in zip(ids, conds, strict=True)}
        else:
            y, targets = out
            mb.outputs = [y]
            mb.outbox = [y.detach(), targets]

    # ---- backward ---------------------------------------------------------------------------

    def _backward(self, index: int, j: int, mb: _Micro) -> None:
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if mb.loss is not None and mb.loss.requires_grad:
            tensors.append(mb.loss)     # times fp16's loss scale, as its seed
            grads.append(torch.full_like(mb.loss, 1.0 if self.loss_scale is None
                                         else self.loss_scale.scale))
        received = {peer: p.wait() for peer, p in mb.grads_in.items()}
        mb.grads_in = {}
        if self._cp is not None and isinstance(mb.outputs, dict):
            # The conditioning's gradient reached every CP rank whole (the broker's CP
            # broadcast), and the gather's backward sums the CP ranks': 1 / cp each.
            received = {peer: {i: g / self._cp.size for i, g in got.items()}
                        for peer, got in received.items()}
        if isinstance(mb.outputs, dict):
            # Per-sample outputs read by other units: sum what every consumer sent.
            for per_sample in received.values():
                for i, g in per_sample.items():
                    if mb.outputs[i].requires_grad:     # a ``handoff.Handed``
                        proxy, seed = mb.outputs[i].seed(g)
                        tensors.append(proxy)
                        grads.append(seed)
        elif mb.outputs is not None:
            (got,) = received.values()
            for out, g in zip(mb.outputs, got, strict=True):
                if out.requires_grad:
                    tensors.append(out)
                    grads.append(g)
        if tensors:     # whole, or zero_bubble's B (``train.zerobubble``)
            self.split.backward((self._chunk, j), tensors, grads)
        if not self.sends_grad:
            return

        if isinstance(mb.inputs, PerPeer):
            mb.input_grads = PerPeer({peer: {i: grad_of(x) for i, x in xs.items()}
                                       for peer, xs in mb.inputs.items()})
        elif isinstance(mb.inputs, dict):
            mb.input_grads = {i: grad_of(x) for i, x in mb.inputs.items()}
        else:
            mb.input_grads = [grad_of(x) for x in mb.inputs]
        if self._cp is not None and self._first:
            sum_over_cp(mb.input_grads, self._cp)


def run_rank(program: ir.Program, plan: Plan, schedule: Schedule, *, steps: int, rank: int,
             groups: ProcessGroups, seed: int | None = None, first_step: int = 0,
             metrics_path: str | Path | None = None, logdir: str | Path | None = None,
             device: torch.device | str = "cpu") -> list[StepRecord]:
    """Train ``steps`` steps (``first_step`` on) on this rank: ``StageExecutor(...).train``.
    Collective over every rank of ``plan``."""
    ex = StageExecutor(program, plan, schedule, rank=rank, groups=groups, seed=seed,
                       device=device)
    return ex.train(steps, first_step=first_step, metrics_path=metrics_path, logdir=logdir)
