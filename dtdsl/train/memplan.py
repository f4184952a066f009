"""``dtc memcheck``: the planner's memory model held against the runtime's real stages, at
paper scale, on a machine without GPUs.

For every unit stage of a plan, one of its ranks (replica 0, TP index 0) is replayed in a
fake world of the plan's size (``train.memcheck.fake_world``: fake tensors, the fake
process group): the stage is built exactly as a bundle's rank builds it
(``train.stage.build_stage``: meta device, tensor parallelism, activation checkpointing,
FSDP2 with the spec's mixed precision), its optimizer's state created, and its part of
one iteration run under ``MemTracker`` (``train.memcheck.measure_peak``): as many
forwards as its schedule keeps in flight at once (the most microbatches it has run
forward and not yet backward in its action list), their backwards, the gradient
reduction and the optimizer step, in 1F1B's order at its fullest: after the first
backward the gradients exist, and one more forward brings the in-flight microbatches
back to their most (of these, three run; each of the others holds what an average one
that ran held, its tensors being the same: ``_ran``). The microbatches are those the
cost model budgets for:
one large microbatch in flight and the others average (a backbone microbatch is always
``micro_batch`` sequences of ``seq_len`` tokens, the dense LM head over all of them; an
encoder's the 99th percentile of a microbatch's image tokens, then the mean; a
generator's likewise of generation targets), each times the unit's share of backbone
microbatches.

A backbone stage that hosts co-located units (``parallel.mesh.hosted_units``) is
measured with them, as it runs: its first stage's microbatches carry the co-located
encoder's images (its large and average microbatch, spread over the sequences, which
keep ``seq_len`` positions: their text makes up the rest), its last stage's the
co-located generators' targets; the prediction adds each co-located unit's own memory
(``CostModel.memory_bytes`` at the host's TP and DP, one stage, the host stage's
microbatches in flight), as the planner prices it. Co-located units have no stage of
their own to measure.

A backbone stage of a plan with a phased encoder (``parallel.mesh.phased_units``) is
measured with it, as every backbone rank runs it: its shards of the encoder and
projector (parameters, gradients, optimizer state: ``train.stage.build_phased`` over the
encoder's DP group of every backbone rank with the same TP index), the forward phase
before the pipeline (no graph kept), the backward phase after it (one large microbatch
step of the encoder's share, recomputed with its activations, and its backward), and on
the first stage the step's embeddings of the whole replica and their gradients, held
from the forward phase to the backward phase. The prediction adds the phased unit's own
memory (``CostModel.memory_bytes`` at its TP and DP, one microbatch step in flight).

The measured peak is reported next to ``CostModel.stage_memory_bytes`` for the same stage
and the GPU's capacity, with whether the rank compiles its blocks (``ir.Train.compiles``
for a GPU rank, the rule the runtime applies): the modules are measured eager either way
(dynamo does not trace under the fake world's dispatch modes): for compiled blocks an
estimate, as inductor's partitioner chooses which activations to keep for backward
(usually fewer than eager autograd keeps, as it recomputes cheap pointwise ops).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ActionKind, Schedule

__all__ = ["NCCL_BUFFSIZE_BYTES", "NCCL_P2P_CHANNELS", "NCCL_RING_CHANNELS", "StageMemory",
           "broker_peers", "check_memory", "format_stages", "in_flight_of",
           "nccl_buffer_bytes"]

# The device type of the ranks a plan places: its cluster's GPUs (memcheck itself runs
# them in a fake world on the CPU), and so their backend (``parallel.device``).
_RANK_DEVICE = "cuda"
_RANK_BACKEND = {"cuda": "nccl"}.get(_RANK_DEVICE, "gloo")

# NCCL's communicator buffers: device memory NCCL allocates itself (cudaMalloc, outside
# PyTorch's caching allocator, so the fake world's tracker cannot see it). The model:
# NCCL_BUFFSIZE bytes per channel and peer connection of the Simple protocol. Sources:
# NCCL's environment-variable documentation (docs.nvidia.com/deeplearning/nccl/user-guide/
# docs/env.html, NCCL_BUFFSIZE: "the size of the buffer used by NCCL when communicating
# data between pairs of GPUs", default 4 MiB) and its source (``DEFAULT_BUFFER_SIZE_BYTES
# (1LL << 22)`` in channel setup: one such buffer per channel and connection). A ring
# collective (TP, DP, the job's default group: the optimizer's all-reduce) connects a rank
# to its previous and next rank (one peer in a group of two) on every channel;
# point-to-point (pipeline neighbours, broker links) to each peer on a few channels.
# Assumed, as NCCL chooses them by topology: 16 ring channels (NCCL_MIN/MAX_NCHANNELS
# allow 1..32; an NVLink node's rings typically use 16 or more) and 2 channels per
# point-to-point peer (NCCL_NCHANNELS_PER_NET_PEER's default). Not modelled: the LL and
# LL128 protocols' smaller buffers, tree and NVLS connections, NCCL's own work queues.
NCCL_BUFFSIZE_BYTES = 4 * 2**20
NCCL_RING_CHANNELS = 16
NCCL_P2P_CHANNELS = 2


@dataclass(frozen=True)
class StageMemory:
    """One unit stage: the measured peak of one of its ranks and the prediction."""

    unit: str
    stage: int
    rank: int
    in_flight: int
    predicted_bytes: float
    measured_bytes: int
    capacity_bytes: float
    by_category: dict[str, int]
    peak_phase: str
    # The seconds of the replay that measured it: for stages measured by one replay
    # (``train.memgroups``), that shared replay's, the same for each.
    time_s: float
    # Whether the plan's rank runs its blocks compiled (``ir.Train.compiles`` for a GPU
    # rank). The fake world measures the eager modules either way: dynamo does not trace
    # under MemTracker's dispatch mode.
    compiled: bool = False
    # NCCL's buffers on the rank, by communicator (``nccl_buffer_bytes``): besides the
    # measured peak, which holds PyTorch's tensors only.
    nccl: dict[str, int] = field(default_factory=dict)
    # The optimizer state the rank keeps in host memory (``adamw(..., offload=F)``,
    # ``train.offload``): not in ``measured_bytes``, which is the device's.
    host_bytes: int = 0
    # Of the microbatches in flight, how many the measurement ran (``_ran``): the others
    # held what an average one it ran holds.
    ran: int = 0

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_bytes - self.predicted_bytes) / max(self.predicted_bytes, 1.0)

    @property
    def nccl_bytes(self) -> int:
        return sum(self.nccl.values())

    @property
    def total_bytes(self) -> int:
        """What the rank's GPU holds at the peak: the measured tensors and NCCL's buffers."""
        return self.measured_bytes + self.nccl_bytes

    def as_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "stage": self.stage, "rank": self.rank,
                "predicted_bytes": int(self.predicted_bytes),
                "measured_bytes": int(self.measured_bytes),
                "nccl_bytes": self.nccl_bytes, "nccl_by_group": dict(self.nccl),
                "capacity_bytes": int(self.capacity_bytes), "in_flight": self.in_flight,
                "ran": self.ran,
                "peak_phase": self.peak_phase, "by_category": dict(self.by_category),
                "compiled": self.compiled, "host_bytes": self.host_bytes}


def broker_peers(plan: Plan, rank: int) -> tuple[int, ...]:
    """The ranks of other units ``rank`` exchanges activations or gradients with
    (``parallel.broker``): a producer's last-stage TP leader with every replica's
    first-stage leader of the unit it feeds (any may be routed a sample), and back;
    co-located units have no links. Pure."""
    from dtdsl.parallel.mesh import grids, role_of

    role = role_of(plan, rank)
    if not role.is_leader:
        return ()
    by_role: dict[str, list[Any]] = {}
    for g in grids(plan):
        by_role.setdefault(g.role, []).append(g)
    feeds = {"encoder": ["backbone"], "backbone": ["generator"]}
    fed_by = {"backbone": ["encoder"], "generator": ["backbone"]}
    peers: set[int] = set()
    if role.is_last_stage:
        for g in (g for r in feeds.get(role.role, ()) for g in by_role.get(r, ())):
            peers.update(g.leader(0, d) for d in range(g.dp))
    if role.is_first_stage:
        for g in (g for r in fed_by.get(role.role, ()) for g in by_role.get(r, ())):
            peers.update(g.leader(g.last_stage, d) for d in range(g.dp))
    return tuple(sorted(peers))


def nccl_buffer_bytes(plan: Plan, rank: int, *, zero: int = 1,
                      backend: str = "nccl") -> dict[str, int]:
    """NCCL's buffers on ``rank`` by communicator (the model above ``NCCL_BUFFSIZE_BYTES``):
    its unit's TP, DP and PP groups (``parallel.mesh.rank_groups``: those of more than one
    rank), the job's default group (its ring, for the optimizer's all-reduce) and its
    broker links (point-to-point to ``broker_peers`` over the default group); none on
    any other backend (gloo's buffers are host memory). Pure."""
    from dtdsl.parallel.mesh import rank_groups

    if backend != "nccl":
        return {}
    out: dict[str, int] = {}
    for dim, ranks in rank_groups(plan, rank, zero).items():
        name = "dp" if dim.startswith("dp_") else dim
        if dim == "pp":     # point-to-point to the neighbouring stages
            at = ranks.index(rank)
            peers = int(at > 0) + int(at < len(ranks) - 1)
            out[name] = peers * NCCL_P2P_CHANNELS * NCCL_BUFFSIZE_BYTES
        else:
            out[name] = _ring_bytes(len(ranks))
    if plan.gpus_used > 1:
        out["world"] = _ring_bytes(plan.gpus_used)
    links = broker_peers(plan, rank)
    if links:
        out["broker"] = len(links) * NCCL_P2P_CHANNELS * NCCL_BUFFSIZE_BYTES
    return out


def _ring_bytes(ranks: int) -> int:
    """A ring collective's buffers on one of its ``ranks``: its previous and next rank on
    every channel (one peer in a group of two)."""
    return min(ranks - 1, 2) * NCCL_RING_CHANNELS * NCCL_BUFFSIZE_BYTES


def format_stages(stages: list[StageMemory]) -> list[str]:
    """``dtc memcheck``'s table: a row per stage (predicted, measured, their error, the
    GPU's capacity, where the peak is; OVER when the measured tensors and NCCL's buffers
    exceed the capacity), and under it a line of NCCL's buffers by communicator."""
    from dtdsl.report import format_bytes

    lines = [f"{'stage':<16}{'rank':>6}{'in flight':>10}{'predicted':>12}{'measured':>12}"
             f"{'error':>8}{'capacity':>12}  peak in"]
    for s in stages:
        over = " OVER" if s.total_bytes > s.capacity_bytes else ""
        lines.append(f"{s.unit + '.s' + str(s.stage):<16}{s.rank:>6}{s.in_flight:>10}"
                     f"{format_bytes(s.predicted_bytes):>12}"
                     f"{format_bytes(s.measured_bytes):>12}{s.error:>+8.1%}"
                     f"{format_bytes(s.capacity_bytes):>12}  {s.peak_phase}{over}")
        if s.nccl:
            groups = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.nccl.items())
            lines.append(f"{'  + NCCL buffers':<32}{format_bytes(s.nccl_bytes):>12}"
                         f"{'':>8}{'':>12}  {groups}")
        if s.host_bytes:
            lines.append(f"{'  optimizer on the CPU':<32}{format_bytes(s.host_bytes):>12}"
                         f"{'':>8}{'':>12}  Adam moments offloaded (not in measured)")
    held = [s for s in stages if s.ran < s.in_flight]
    if held:
        lines.append(f"{len(held)} stage(s) ran {_RAN} of their microbatches in flight; each of "
                     "the others held what an average one held (--every-microbatch runs all)")
    return lines


def in_flight_of(schedule: Schedule, unit: str, stage: int) -> int:
    """The most microbatches the stage has run forward and not yet backward at once (every
    microbatch it runs, for a stage that runs no backward). Under zero_bubble a
    microbatch is held until its ``W``: its ``B`` keeps the graph for the weight
    gradients (``train.zerobubble``), nearly all of what the forward saved."""
    actions = schedule.stage(unit, stage).actions
    done = ActionKind.W if any(a.kind is ActionKind.W for a in actions) else ActionKind.B
    outstanding = peak = 0
    has_backward = False
    for a in actions:
        if a.kind is ActionKind.F:
            outstanding += 1
            peak = max(peak, outstanding)
        elif a.kind is done:
            outstanding -= 1
            has_backward = True
    return peak if has_backward else 1


def _depth(plan: Plan, unit: str, stage: int) -> int:
    """Pipeline stages from ``stage`` of ``unit`` to the end of the chain (the planner's
    rule in ``planner.evaluate``, unchained)."""
    u = plan.unit(unit)
    # Co-located generators run inside the backbone's last stage: no stage of their own.
    gen = max((g.pp for g in plan.units if g.role == "generator" and not g.colocated),
              default=0)
    backbone = next(g.pp for g in plan.units if g.role == "backbone")
    # Under zero_bubble a backbone stage's deferred Ws keep their microbatches: each
    # stage holds the first stage's count (the planner's rule, ``planner.baseline``).
    own = u.pp if plan.schedule == "zero_bubble" and u.role == "backbone" else u.pp - stage
    if u.role == "encoder":
        return own + backbone + gen
    if u.role == "backbone":
        return own + gen
    return own


@dataclass(frozen=True)
class _Images:
    """An encoder microbatch's images for memcheck: ``n`` square images of ``side`` x
    ``side`` patches (``rows`` rows each in the encoder, a class token's included)."""

    n: int
    side: int
    rows: int
    width: int      # a patch's values


def _encoder_images(program: ir.Program, cost: Any, name: str, unit: Any, share: float,
                    large: bool) -> _Images:
    """The items of encoder ``name``'s large (the cost model's 99th percentile) or
    average microbatch, as the cost model budgets them: as many items as its rows hold
    of an average item (an image's, an audio clip's or a video clip's, ``ir.modal``;
    one at least), square grids that share its rows equally. Whole average items would
    overshoot the budget by up to one item: a large microbatch of one video clip 1.33
    times the average (the 99th percentile of 64 to 128 frames) would be two average
    clips, 1.5 times its rows."""
    from dtdsl.ir.modal import InputRule, drawn_tokens

    module = program.module(name)
    arch = module.arch
    rule = InputRule.of(cost.program, module)
    tokens = max(1, int(math.ceil(unit.peak_items * share
                                  / (1.0 if large else unit.act_peak_ratio))))
    data = cost.program.data
    cls = int(arch.cls_token)                       # a class token's row too
    if rule.image is not None:
        items = data.get("image", "patches")
        per_item = 256 if items is None else max(1, int(round(_mean(items))))
    else:
        m = rule.modality
        frames, patches = data.get(m, "frames"), data.get(m, "patches")
        size = 256 if frames is None else max(1, int(round(_mean(frames))))
        per = None if patches is None else np.array([max(1, int(round(_mean(patches))))])
        per_item = int(drawn_tokens(rule, np.array([size]), per)[0])
    n = max(1, round(tokens / (per_item + cls)))
    patches = max(1.0, tokens / n - cls)
    # An image's a square grid the projector's compression divides (pixel shuffle: whole
    # k x k blocks), as the data's own images are rounded.
    side = rule.image.square_side(patches) if rule.image is not None else \
        max(1, round(math.sqrt(patches)))
    return _Images(n=n, side=side, rows=side * side + cls, width=rule.patch_dim)


def _item_rows(program: ir.Program, name: str, side: int) -> int:
    """The backbone rows of one of ``_encoder_images``' square items of encoder ``name``:
    an image's as its projector compresses it, any other's one per patch."""
    from dtdsl.ir.modal import InputRule

    rule = InputRule.of(program, program.module(name))
    return rule.image.of_grid(side, side) if rule.image is not None else side * side


def _generation_targets(program: ir.Program, name: str, unit: Any, share: float,
                        large: bool) -> int:
    """How many targets generator ``name``'s large or average microbatch holds."""
    return max(1, int(math.ceil(unit.peak_items * share
                                / (1.0 if large else unit.act_peak_ratio))))


def _targets(program: ir.Program, name: str, count: int, device: torch.device) -> Any:
    """``count`` generation targets of generator ``name`` (zero latents, the last
    timestep), one ``GenTargets``."""
    from dtdsl.models.inputs import GenTargets

    arch = program.module(name).arch
    shape = (count, arch.latent_channels, arch.latent, arch.latent)
    return GenTargets(latents=torch.zeros(shape, device=device),
                      noise=torch.zeros(shape, device=device),
                      timesteps=torch.full((count,), arch.timesteps - 1, dtype=torch.int64,
                                           device=device))


def _spread(n: int, b: int) -> list[int]:
    """``n`` items over ``b`` sequences, as evenly as they go."""
    return [n // b + (k < n % b) for k in range(b)]


def _hosted_inputs(program: ir.Program, cost: Any, plan: Plan, role: Any, seq: int,
                   dtype: torch.dtype, device: torch.device, large: bool
                   ) -> tuple[list[Any], dict[str, Any]]:
    """The layouts of a backbone microbatch of ``micro_batch`` sequences of ``seq``
    positions, and the extra forward arguments of the co-located units its stage hosts:
    the encoders' items (``images``, spread over the sequences, whose text fills the
    rest; per encoder where there are several) and each generator's targets
    (``generation``)."""
    from dtdsl.ir.layout import sequence_layout
    from dtdsl.models.inputs import PackedImages
    from dtdsl.parallel.mesh import hosted_units

    b = program.train.micro_batch
    extra: dict[str, Any] = {}
    room = [seq] * b
    items: list[list[tuple[str, int, int]]] = [[] for _ in range(b)]   # (encoder, k, rows)
    packs: dict[str, Any] = {}
    for u in hosted_units(plan, role):
        if u.role == "encoder":
            im = _encoder_images(program, cost, u.name, cost.unit(u.name), 1.0, large)
            rows = _item_rows(program, u.name, im.side)
            # No sequence holds more items than fit in what the others left of it.
            # (The first encoder puts one in each at least.)
            per_sample = [min(c, max(int(r == seq), r // max(1, rows)))
                          for c, r in zip(_spread(im.n, b), room, strict=True)]
            for k, c in enumerate(per_sample):
                items[k] += [(u.name, j, rows) for j in range(c)]
                room[k] -= c * rows
            owners = tuple((k, j) for k, c in enumerate(per_sample) for j in range(c))
            group = torch.zeros(len(owners), im.side * im.side, im.width, dtype=dtype,
                                device=device)
            packs[u.name] = PackedImages(groups=(group,), owners=(owners,),
                                         counts=tuple(per_sample),
                                         grids=((im.side, im.side),))
        else:
            count = _generation_targets(program, u.name, cost.unit(u.name), 1.0, large)
            counts = _spread(count, b)
            extra.setdefault("generation", {})[u.name] = (
                [_targets(program, u.name, c, device) for c in counts],
                [(c,) for c in counts])
    if packs:
        # One encoder: its packed items; several: per encoder, spliced by the layouts.
        extra["images"] = next(iter(packs.values())) if len(packs) == 1 else packs
    layouts = []
    for own, left in zip(items, room, strict=True):
        lay = sequence_layout(left, [n for *_, n in own], [0] * len(own), [(0, left)], seq)
        layouts.append(replace(lay, items=tuple((name, k) for name, k, _ in own))
                       if len(packs) > 1 else lay)
    return layouts, extra


def _inputs(program: ir.Program, cost: Any, plan: Plan, unit: Any, role: Any, share: float,
            dtype: torch.dtype, device: torch.device, large: bool,
            first: bool) -> Callable[[], tuple[tuple, dict]]:
    """A function making the inputs of one microbatch for the stage's forward: a large
    one (the cost model's 99th percentile) or an average one; ``first``: for the unit's
    first virtual stage (its embedding; stage 0's first chunk)."""
    module = program.module(role.unit)
    arch = module.arch
    train = program.train
    if role.role == "backbone":
        from dtdsl.models.multimodal import padded_width

        b, h = train.micro_batch, arch.hidden
        # Under context parallelism a stage holds its CP rank's shard of the sequences.
        cp = role.grid.cp
        s = padded_width(train.seq_len, role.grid.tp, cp)
        layouts, extra = _hosted_inputs(program, cost, plan, role, s, dtype, device, large)
        local = s // cp

        def backbone() -> tuple[tuple, dict]:
            if first:
                tokens = [torch.zeros(lay.text, dtype=torch.int64, device=device)
                          for lay in layouts]
                embeds = [torch.zeros(0, h, dtype=dtype, device=device) for _ in range(b)]
                return (), {"image_embeds": embeds, "tokens": tokens, "layouts": layouts,
                            "loss_tokens": b * local, **extra}
            # Under sequence parallelism, this TP rank's piece of the sequence.
            x = torch.zeros(b, local // role.grid.tp, h, dtype=dtype, device=device,
                            requires_grad=True)
            return (), {"x": x, "targets": torch.zeros(b, local, dtype=torch.int64,
                                                       device=device),
                        "layouts": layouts, "loss_tokens": b * local, **extra}
        return backbone
    if role.role == "encoder":
        from dtdsl.parallel.cp import padded_length

        im = _encoder_images(program, cost, role.unit, unit, share, large)

        def encoder() -> tuple[tuple, dict]:
            if first:
                return ([torch.zeros(im.n, im.side * im.side, im.width, dtype=dtype,
                                     device=device)],), {"first": True}
            # Under context parallelism, this CP rank's shard of each image's rows.
            cp = role.grid.cp
            rows = im.rows if cp == 1 else padded_length(im.rows, cp) // cp
            x = torch.zeros(im.n, rows, arch.hidden, dtype=dtype, device=device,
                            requires_grad=True)
            return ([x],), {"first": False, **({"lengths": [im.rows]} if cp > 1 else {})}
        return encoder
    count = _generation_targets(program, role.unit, unit, share, large)
    hidden = program.backbone.arch.hidden

    def generator() -> tuple[tuple, dict]:
        targets = [_targets(program, role.unit, 1, device) for _ in range(count)]
        conds = [torch.zeros(16, hidden, dtype=dtype, device=device, requires_grad=True)
                 for _ in range(count)] if first else None
        if role.grid.pp == 1:
            return (conds, targets), {}
        # A DiT's stage (``train.generator``): the first from the conditioning, the others
        # from the previous stage's tokens and context.
        kwargs: dict[str, Any] = {"targets": targets, "rows": [16] * count, "conds": conds}
        if not first:
            from dtdsl.cost.flops import dit_stage_message

            kwargs["x"], kwargs["context"] = (
                torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
                for shape in dit_stage_message(arch, count))
        return (), kwargs
    return generator


@dataclass
class _Phase:
    """One phased encoder's phases on a measured backbone stage (module docstring)."""

    part: Any                   # the encoder's Stage (``Stage.phased``)
    images: Callable[[], tuple[tuple, dict]]    # (args, kwargs): a large microbatch
                                                # step of the rank's share
    embeds: tuple[int, int]     # (rows, width) of the step's embeddings it holds, or (0, w)
    dtype: torch.dtype
    device: torch.device

    def forward(self) -> torch.Tensor:
        """The forward phase: a microbatch step encoded without a graph; the step's
        embeddings (on the first stage) kept as a leaf that wants a gradient."""
        args, kwargs = self.images()
        with torch.no_grad():
            self.part.module(*args, **kwargs)
        return torch.zeros(self.embeds, dtype=self.dtype, device=self.device,
                           requires_grad=True)

    def backward(self, embeds: torch.Tensor) -> None:
        """The backward phase: the embeddings' gradients, one microbatch step
        recomputed with its activations and its backward, then the reduction."""
        embeds.grad = torch.zeros_like(embeds)
        if self.part.trainable():
            args, kwargs = self.images()
            outs = self.part.module(*args, **kwargs)
            sum(o.float().sum() for o in outs).backward()
        self.part.reduce_gradients()


def _phase(program: ir.Program, cost: Any, plan: Plan, unit: Any, role: Any, built: Any,
           device: torch.device) -> _Phase:
    """The phases of phased encoder ``unit`` on the backbone stage ``role``: its share
    of a microbatch step (the cost model's large microbatch times the unit's share, as
    an encoder unit of that DP is measured), and on the first stage the embeddings of
    every microbatch of the step (one large, the others average)."""
    dp_lm = next(x.dp for x in plan.units if x.role == "backbone")
    part = built.phased[unit.name]
    im = _encoder_images(program, cost, unit.name, cost.unit(unit.name), dp_lm / unit.dp,
                         True)
    width = program.backbone.arch.hidden
    rows = 0
    if role.is_first_stage:
        for large in [True] + [False] * (plan.num_microbatches - 1):
            whole = _encoder_images(program, cost, unit.name, cost.unit(unit.name), 1.0,
                                    large)
            rows += whole.n * _item_rows(program, unit.name, whole.side)

    def images() -> tuple[tuple, dict]:
        group = torch.zeros(im.n, im.side * im.side, im.width, dtype=built.compute_dtype,
                            device=device)
        return ([group],), {"first": True, "grids": [(im.side, im.side)]}

    return _Phase(part=part, images=images, embeds=(rows, width),
                  dtype=built.compute_dtype, device=device)


def _mean(q: ir.Quantity) -> float:
    from dtdsl.cost.samples import draw

    values = draw(q, 4096, np.random.default_rng(0))
    return float(values.mean()) if len(values) else 1.0


def _loss_of(role: Any, out: Any, last: bool) -> torch.Tensor:
    """A scalar to differentiate standing in for the stage's loss and the gradients it
    would receive: the loss where the stage (``last``: its chunk, the unit's last virtual
    stage) has one, else every output."""
    if role.role == "generator":    # its loss, or a DiT's tokens and context on
        return out if last else sum(o.float().sum() for o in out)
    if role.role == "backbone":
        if last:                    # the LM loss and the co-located generators'
            return out[0] + sum(out[2].values())
        return out[0].float().sum()
    return sum(o.float().sum() for o in out)


def _attach_cp(program: ir.Program, plan: Plan, built: Any, role: Any, world: Any) -> None:
    """The measured stage's context parallelism over its CP ranks in the fake world (the
    ring's transfers and Ulysses' all-to-alls move nothing there; the buffers they fill
    are allocated as in the run)."""
    from dtdsl.parallel.cp import MESH_DIMS as CP_DIMS
    from dtdsl.parallel.mesh import cp_ulysses
    from dtdsl.train.cp_run import cp_group, use_cp

    u = cp_ulysses(program, plan).get(role.unit, 1)
    cp = role.grid.cp
    if u in (1, cp):
        group = world.device_mesh(role.cp_ranks, (cp,), ("cp",)).get_group()
    else:
        group = world.device_mesh(role.cp_ranks, (cp // u, u), CP_DIMS)
    use_cp(built.module, cp_group(program, plan, role, group))


def _expert_groups(plan: Plan, role: Any, zero: int, mesh: Any = None,
                   replica_dp: int = 1) -> Any:
    """The measured rank's EP groups on the fake world (``ExpertGroups``, None at ep 1), as
    ``parallel.mesh.build_groups`` makes them for a run: its all-to-alls exchange nothing
    there, the routing's sizes assumed (``models.moe.mean_counts``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from dtdsl.parallel.mesh import _ep_groups, rank_groups

    if plan.unit(role.unit).ep == 1:
        return None
    with unset_fake_temporarily():      # its mesh's rank table is real, as the world's
        return _ep_groups(plan, role, rank_groups(plan, role.rank, zero, None, replica_dp),
                          "cpu", zero, mesh, replica_dp)


def _optimizer(program: ir.Program, plan: Plan, trainable: list[Any]) -> Any:
    """The stage's optimizer (``StageOptimizer``) over ``trainable``, its state made as
    the first step makes it; None when nothing trains."""
    from dtdsl.train.memcheck import init_optimizer_state
    from dtdsl.train.optim import StageOptimizer

    if not trainable:
        return None
    o = program.train.optimizer
    opt = StageOptimizer(trainable, name=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                         weight_decay=o.weight_decay, offload=plan.offload_fraction(program))
    init_optimizer_state(opt.optimizer)
    return opt


# Microbatches in flight a stage's measurement runs (``_ran``): the large one, an
# average one (the bytes it holds: the difference of marks around its forward), and the
# one whose forward meets the rest, held.
_RAN = 3


def _ran(in_flight: int, vpp: int, every_microbatch: bool) -> int:
    """How many of a stage's ``in_flight`` microbatches its measurement runs; each of the
    others holds what an average one the stage ran holds, from its forward to the first
    backward of an average one (``InFlight.hold``): microbatches of the same size make the
    same tensors, so the peak is the same, and the measurement's time no longer grows
    with the pipeline's depth (``in_flight`` is up to pp). Every one where asked
    (``every_microbatch``; ``dtc memcheck --every-microbatch``), and for interleaved
    stages, whose forwards cycle over model chunks of their own."""
    return in_flight if every_microbatch or vpp > 1 else min(in_flight, _RAN)


def _in_flight_passes(forward: Callable[[int], Any], backward: Callable[[Any], None],
                      flight: Any, k: int, ran: int, trains: bool,
                      grouped: bool = False) -> None:
    """1F1B's steady state at its fullest: ``k`` microbatches forward (the first large),
    one backward (from now on the gradients exist), one more forward (``k`` in flight
    again, next to the gradients), then the rest backward. Past ``ran`` of them the
    others in flight are held, not run (``_ran``); ``grouped``: as many as each count of
    the measurement's ``holds`` (``train.memgroups``; ``k`` the most in flight)."""
    outs, marks = [], []
    for i in range(ran):
        if i == ran - 1 and ran < k:        # its forward with k - 1 others held
            flight.hold(*marks, *(() if grouped else (k - ran,)))
        outs.append(forward(i))
        if i in (0, 1):                     # around an average microbatch's forward
            marks.append(flight.mark())
    if trains:
        backward(outs.pop(0))
        outs.append(forward(k))
        backward(outs.pop(0))               # an average one's, k - 1 others held
        flight.release()                    # the rest with fewer: never the peak
        while outs:
            backward(outs.pop(0))
    flight.release()
    outs.clear()


def _measure_stage(program: ir.Program, plan: Plan, schedule: Schedule, cost: Any,
                   unit: str, stage: int, every_microbatch: bool = False,
                   others: tuple[int, ...] = ()) -> list[StageMemory]:
    """Replay ``stage`` of ``unit`` and measure it, and with it the unit's ``others``
    stages, whose replay is the same but for the microbatches held (``train.memgroups``):
    their StageMemory in the order ``stage``, ``others``."""
    from dtdsl.parallel.mesh import (
        MESH_DIMS,
        grids,
        hosted_units,
        phased_grid,
        phased_units,
        unit_mesh_shape,
    )
    from dtdsl.train.executor import stage_run
    from dtdsl.train.memcheck import fake_world, measure_held_peaks, measure_peak
    from dtdsl.train.stage import build_stage

    start_s = time.perf_counter()
    grid = next(g for g in grids(plan) if g.name == unit)
    rank = grid.rank(stage, 0, 0)
    u = plan.unit(unit)
    ks = [in_flight_of(schedule, unit, s) for s in (stage, *others)]
    k = max(ks)
    zero, replica_dp = program.train.mesh_zero, program.train.replica_dp
    dp_lm = next(x.dp for x in plan.units if x.role == "backbone")
    share = dp_lm / u.dp
    # Priced at the plan's cp, as the simulator prices it (``reorder.workload``), and at
    # its ep, as the planner prices it (``CostModel.with_ep``): at ep 1 every expert
    # would be priced on every rank.
    unit_cost = replace(cost.unit(unit), cp=u.cp, ep=u.ep)
    from dtdsl.parallel.mesh import RankRole

    role = RankRole(rank=rank, grid=grid, stage=stage, replica=0, tp_index=0)
    phased = phased_units(plan, role)
    with fake_world(plan.gpus_used, rank, "cpu") as world:
        mesh = world.device_mesh(grid.ranks, unit_mesh_shape(grid, zero, replica_dp), MESH_DIMS)
        meshes = {}
        for p in phased:
            g = phased_grid(plan, p)
            meshes[p.name] = world.device_mesh(g.ranks, unit_mesh_shape(g, zero), MESH_DIMS)
        built = build_stage(program, plan, role, mesh, world.device,
                            run=stage_run(role.role), initialize=False, compile=False,
                            phased=meshes, phased_run=stage_run("encoder"),
                            ep=_expert_groups(plan, role, zero, mesh, replica_dp))
        if grid.cp > 1:
            _attach_cp(program, plan, built, role, world)
        opt = _optimizer(program, plan, built.trainable())
        # Per model chunk (interleaved: the passes in flight cycle over them), a large and
        # an average microbatch.
        makers = [[_inputs(program, cost, plan, unit_cost, role, share, built.compute_dtype,
                           world.device, large, role.is_first_stage and c == 0)
                   for large in (True, False)] for c in range(u.vpp)]
        hosted = hosted_units(plan, role)
        trains = unit_cost.backward_factor > 0 or any(
            cost.unit(h.name).backward_factor > 0 for h in hosted + phased)
        phases = [_phase(program, cost, plan, p, role, built, world.device) for p in phased]

        def forward(i: int) -> Any:
            c = i % u.vpp
            args, kwargs = makers[c][0 if i == 0 else 1]()
            out = built.module(*args, **kwargs, **({"chunk": c} if u.vpp > 1 else {}))
            return _loss_of(role, out, role.is_last_stage and c == u.vpp - 1) \
                if trains else None

        def backward(loss: Any) -> None:
            with built.backward_context():
                loss.backward()

        def step(flight: Any) -> None:
            built.begin_step()
            held = [ph.forward() for ph in phases]      # the phased encoders' forward phase
            _in_flight_passes(forward, backward, flight, k, ran, trains, bool(others))
            if trains:
                built.reduce_gradients()
            for ph, embeds in zip(phases, held, strict=True):
                ph.backward(embeds)
            held.clear()
            if opt is not None:
                opt.optimizer.step()
                opt.zero_grad()

        modules = (built.module, *(part.module for part in built.phased.values()))
        ran = _ran(ks[0], u.vpp, every_microbatch)
        track = modules + ((opt.optimizer,) if opt else ())
        reports = measure_held_peaks(step, tuple(n - ran for n in ks), track=track) \
            if others else (measure_peak(step, track=track, in_flight=True),)
        host = _host_bytes(opt)
    layers = built.held_layers if u.role != "generator" or u.pp > 1 else unit_cost.layers
    time_s = time.perf_counter() - start_s
    return [_stage_memory(program, plan, cost, unit_cost, unit, s, n, ran, report, host,
                          layers, share, time_s)
            for s, n, report in zip((stage, *others), ks, reports, strict=True)]


def _stage_memory(program: ir.Program, plan: Plan, cost: Any, unit_cost: Any, unit: str,
                  stage: int, k: int, ran: int, report: Any, host: int, layers: int,
                  share: float, time_s: float) -> StageMemory:
    """Stage ``stage`` of ``unit``'s StageMemory from its measurement ``report`` (and the
    optimizer state kept on the host, ``host``): its own rank, prediction and NCCL
    buffers."""
    from dtdsl.parallel.mesh import RankRole, grids, hosted_units, phased_units

    grid = next(g for g in grids(plan) if g.name == unit)
    role = RankRole(rank=grid.rank(stage, 0, 0), grid=grid, stage=stage, replica=0, tp_index=0)
    predicted = _predicted_bytes(plan, cost, unit_cost, unit, stage, layers, share,
                                 hosted_units(plan, role), phased_units(plan, role))
    zero = program.train.mesh_zero
    return StageMemory(unit=unit, stage=stage, rank=role.rank, in_flight=k, ran=ran,
                       predicted_bytes=predicted, measured_bytes=report.peak_bytes - host,
                       capacity_bytes=program.cluster.gpu.memory_bytes,
                       by_category={**report.by_category, "optimizer_state":
                                    report.by_category["optimizer_state"] - host},
                       peak_phase=report.peak_phase, host_bytes=host, time_s=time_s,
                       compiled=program.train.compiles(_RANK_DEVICE),
                       nccl=nccl_buffer_bytes(plan, role.rank, zero=zero,
                                              backend=_RANK_BACKEND))


def _predicted_bytes(plan: Plan, cost: Any, unit_cost: Any, unit: str, stage: int,
                     layers: int, share: float, hosted: Any, phased: Any) -> float:
    """What the planner prices stage ``stage`` of ``unit`` at (``layers`` of its layers,
    ``share`` of the backbone's microbatch): the unit's own stage memory, each co-located
    unit's and each phased encoder's."""
    u = plan.unit(unit)
    depth = _depth(plan, unit, stage)
    dp_lm = next(x.dp for x in plan.units if x.role == "backbone")
    predicted = cost.stage_memory_bytes(
        unit_cost, tp=u.tp, pp=u.pp, dp=u.dp, vpp=u.vpp, stage=stage, layers=layers,
        depth=depth, microbatches=plan.num_microbatches, share=share)
    # Each co-located unit's own memory, as the planner prices it: one stage of all its
    # layers at the host's TP (whole where replicated over it) and DP, with the host
    # stage's microbatches in flight.
    predicted += sum(float(cost.memory_bytes(
        cost.unit(h.name), 1 if h.tp_replicated else h.tp, 1, h.dp, 1, depth,
        plan.num_microbatches, 1.0)) for h in hosted)
    # Each phased encoder's: its shards over all the backbone's ranks, one microbatch
    # step of its share in flight at a time.
    predicted += sum(float(cost.memory_bytes(
        cost.unit(p.name), 1 if p.tp_replicated else p.tp, 1, p.dp, 1, 1,
        plan.num_microbatches, dp_lm / p.dp)) for p in phased)
    return predicted


def _host_bytes(opt: Any) -> int:
    """The offloaded Adam moments that ``measure_peak`` counted through the optimizer's
    state (they are fake tensors on the fake world's CPU device, like the rest) but that
    a GPU rank keeps in pinned host memory (``train.offload``), rounded as the tracker
    rounds each storage. Nothing else of the host's part is tracked: the host copies and
    gradient buffers are made before the measurement and are no optimizer state."""
    from dtdsl.train.memcheck import CUDA_ALLOCATION_GRANULARITY_BYTES as grain

    tensors = opt.optimizer.host_state_tensors() if opt is not None and hasattr(
        opt.optimizer, "host_state_tensors") else []
    return sum(-(-t.numel() * t.element_size() // grain) * grain for t in tensors)


def _recomputing(program: ir.Program, plan: Plan) -> ir.Program:
    """``program`` with each module recomputing as the stage runs it: the more of its
    spec's ``recompute`` and its plan's (the planner raises it to make a layout fit;
    ``train.stage._recomputes``)."""
    planned = {u.name: ir.Recompute.of(u.recompute) for u in plan.units}
    modules = []
    for m in program.modules:
        mode = max(ir.Recompute.of(m.recompute), planned.get(m.name, ir.Recompute.NONE),
                   key=lambda r: r.rank)
        modules.append(m if mode == m.recompute else m.model_copy(update={"recompute": mode}))
    return program.model_copy(update={"modules": tuple(modules)})


def check_memory(program: ir.Program, plan: Plan, *, cost: Any = None, jobs: int = 1,
                 progress: Callable[[int, int, str], None] | None = None,
                 every_microbatch: bool = False, units: Collection[str] | None = None,
                 group: bool = True, stages: Collection[tuple[str, int]] | None = None
                 ) -> list[StageMemory]:
    """Measure every unit stage of ``plan`` (module docstring) in plan order, or those of
    ``units`` (a paper-scale backbone's take minutes), or the ``(unit, stage)`` pairs in
    ``stages``, each in a process forked from this one (a fake world leaves process group
    names, DeviceMesh and DTensor caches behind), up to ``jobs`` at a time; stages whose
    replays differ only in the microbatches held share one (``train.memgroups``; ``group=False``:
    each by its own, the same results). ``every_microbatch``: run every one in flight."""
    import multiprocessing

    from dtdsl.cost.model import build_cost_model
    from dtdsl.schedule.lower import lower
    from dtdsl.train.memgroups import replay_groups

    # Priced as the stages run: recomputing where the plan raised it (as the planner
    # priced them; a given cost model, ``dtc memcheck``'s, is the spec's).
    recomputing = _recomputing(program, plan)
    if cost is None or any(cost.unit(m.name).recompute is not ir.Recompute.of(m.recompute)
                           for m in recomputing.modules):
        cost = build_cost_model(recomputing, None if cost is None else cost.params,
                                profile=None if cost is None else cost.profile)
    # The plan's optimizer offload (the spec's, or the planner's for offload=auto).
    cost = cost.with_offload(plan.offload_fraction(program))
    schedule = lower(plan, program)
    # Co-located and phased units are measured with the backbone stages that run them.
    todo = [(u.name, s) for u in plan.units if not (u.colocated or u.phased)
            and (units is None or u.name in units) for s in range(u.pp)
            if stages is None or (u.name, s) in stages]
    ran = [_ran(in_flight_of(schedule, u, s), plan.unit(u).vpp, every_microbatch)
           for u, s in todo]
    groups = replay_groups(program, plan, todo, ran) if group else [(i,) for i in range(len(todo))]
    if progress is not None:
        progress(0, len(todo), "")
    context = multiprocessing.get_context("fork")
    results: dict[int, StageMemory] = {}
    _import_runtime()
    # The children's garbage collections (a measurement runs three) then pass over their
    # own objects only, not over the hundreds of thousands this process holds and shares
    # with them (a pass that also copies every page it touches).
    gc.freeze()
    try:
        with context.Pool(max(1, min(jobs, len(groups))), maxtasksperchild=1) as pool:
            pending = [pool.apply_async(_measure_in_child,
                                        (program, plan, schedule, cost, *todo[g[0]],
                                         every_microbatch, tuple(todo[i][1] for i in g[1:])))
                       for g in groups]
            for g, task in zip(groups, pending, strict=True):
                for i, measured in zip(g, task.get(), strict=True):
                    results[i] = measured
                    if progress is not None:
                        progress(len(results), len(todo), f"{todo[i][0]}.s{todo[i][1]}")
    finally:
        gc.unfreeze()
    return [results[i] for i in range(len(todo))]


def _import_runtime() -> None:
    """Import, once and before forking, what every stage's measurement imports: each runs
    in a process forked from this one, which would otherwise import it anew (torch's
    FSDP2, DTensor, fake process group and MemTracker, which bring in dynamo and sympy;
    some 800 modules, over a second of CPU per stage)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    import dtdsl.data.sample  # noqa: F401
    import dtdsl.ir.layout  # noqa: F401
    import dtdsl.parallel.mesh  # noqa: F401
    import dtdsl.parallel.tp  # noqa: F401
    import dtdsl.train.executor  # noqa: F401
    import dtdsl.train.memcheck  # noqa: F401
    import dtdsl.train.optim  # noqa: F401
    import dtdsl.train.stage  # noqa: F401


def _measure_in_child(program: ir.Program, plan: Plan, schedule: Schedule, cost: Any,
                      unit: str, stage: int, every_microbatch: bool,
                      others: tuple[int, ...]) -> list[StageMemory]:
    torch.set_num_threads(1)
    return _measure_stage(program, plan, schedule, cost, unit, stage, every_microbatch,
                          others)
