"""The cross-unit broker: per-sample activations forward, their gradients backward.

The schedule IR's communication is unit level (``vit.s0:SEND_F3>llm.s0``); which replica
of the receiver gets which sample is decided here, at sample granularity, so DP sizes need
not divide (an encoder with dp 2 can feed a backbone with dp 3).

**Routing.** At step j every unit's replicas together process the samples of the step;
each unit has an *assignment* (the replica index per sample, in step order) that every
rank computes alike from the per-sample costs (``dtdsl.reorder.intra.balance``), so no
message is needed to agree on it. ``route`` turns the producer's and the consumer's
assignment into the ordered sample list each (producer replica, consumer replica) pair
carries; ``reverse`` gives the gradient direction.

**Leaders** (Megatron MIMO bridge style). Only the first TP rank of the producer's last
stage of each replica sends, and only the first TP rank of the consumer's first stage of
each replica receives; the receiving leader then broadcasts the samples to its TP group,
in its replica's step order. Gradients travel the same way backwards: consumer first-stage
leaders send, producer last-stage leaders receive and broadcast to their TP group. A pair
that carries no sample exchanges no message; both sides know this from the routes.

**Transfers** go through ``parallel.p2p.P2P``: matched in order per peer (NCCL's rule, kept
on gloo too), one message per (producer replica, consumer replica) pair and direction,
the samples' tensors back to back. The receiver knows every tensor's shape before it
posts: the caller gives the expected shape of each sample's tensor (from the step's sample
sizes, which every rank has) and the dtype. Every sender queues its messages in (consumer
replica) order and every receiver its sources in increasing replica order, both in the
schedule's action order, so both sides of a pair agree on the order of their messages.
The label of a message (``vit->llm F 17 0->1``: edge, direction, microbatch index, replicas)
is what the ordering check compares.

**Co-located units** (``UnitPlan.colocated``) run inside the backbone's first or last
stage, in its forward and backward: the broker has no grid, route or message for them.
Their samples' replica is the backbone's (``reorder.workload.route``), so the routing every
rank computes still names them, and nothing else does. Nor does it carry a **phased**
encoder's (``UnitPlan.phased``) embeddings: they go from each backbone rank to its
replica's first stage over the pair of their PP group, before and after the pipeline
(``train.executor``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtdsl.parallel.mesh import ProcessGroups, RankRole, UnitGrid, grids, role_of
from dtdsl.parallel.p2p import P2P, Received, TensorSpec, pack, unpack

if TYPE_CHECKING:   # planning tools import the routing without the plan's models
    from dtdsl.ir.plan import Plan

__all__ = ["Broker", "PendingSamples", "StepSamples", "reverse", "route"]

SampleId = Hashable
Routes = dict[tuple[int, int], tuple[SampleId, ...]]

# ---------------------------------------------------------------------------- routing


def route(sample_ids: Sequence[SampleId], producer: Sequence[int], consumer: Sequence[int], *,
          producer_dp: int | None = None, consumer_dp: int | None = None) -> Routes:
    """For each (producer replica, consumer replica) pair that carries at least one sample,
    the sample ids it carries, in step order. ``producer[i]`` / ``consumer[i]`` is the
    replica of ``sample_ids[i]`` in each unit. Keys are sorted; pairs with no sample are
    absent."""
    ids = tuple(sample_ids)
    if len(producer) != len(ids) or len(consumer) != len(ids):
        raise ValueError(f"{len(ids)} samples but assignments of length {len(producer)} "
                         f"(producer) and {len(consumer)} (consumer)")
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids of a step must be distinct")
    for name, assignment, dp in (("producer", producer, producer_dp),
                                 ("consumer", consumer, consumer_dp)):
        for r in assignment:
            if operator.index(r) < 0 or (dp is not None and r >= dp):
                top = "" if dp is None else dp - 1
                raise ValueError(f"{name} replica {r!r} is outside 0..{top}")
    out: dict[tuple[int, int], list[SampleId]] = {}
    for sid, p, c in zip(ids, producer, consumer, strict=True):
        out.setdefault((p, c), []).append(sid)
    return {k: tuple(out[k]) for k in sorted(out)}


def reverse(routes: Routes) -> Routes:
    """The same routes seen from the other side: (consumer replica, producer replica)."""
    return {k: routes[(k[1], k[0])] for k in sorted((c, p) for p, c in routes)}


@dataclass(frozen=True, eq=False)
class StepSamples:
    """The samples of one step and each unit's assignment (replica per sample)."""

    sample_ids: tuple[SampleId, ...]
    assignment: Mapping[str, Sequence[int]]

    def replicas(self, unit: str) -> Sequence[int]:
        try:
            a = self.assignment[unit]
        except KeyError:
            raise KeyError(f"no assignment for unit {unit!r} in this step") from None
        if len(a) != len(self.sample_ids):
            raise ValueError(f"unit {unit!r}: assignment of length {len(a)} for "
                             f"{len(self.sample_ids)} samples")
        return a

    def samples_of(self, unit: str, replica: int) -> tuple[SampleId, ...]:
        """The samples ``replica`` of ``unit`` processes, in step order."""
        return tuple(s for s, r in zip(self.sample_ids, self.replicas(unit), strict=True)
                     if r == replica)



_EDGES = {("encoder", "backbone"), ("backbone", "generator")}
_ROUTES_KEPT = 4096     # cached routes before the cache starts over
SpecOf = Callable[[SampleId], TensorSpec]


@dataclass(eq=False)
class PendingSamples:
    """Samples a stage is receiving: ``wait()`` gives ``{sample: tensor}`` in the receiving
    replica's step order, once the receives' batch has been flushed (``P2P.flush``). On a
    TP group every rank calls ``wait`` at the same action: the leader's receives are
    broadcast to the others there."""

    order: tuple[SampleId, ...]
    specs: tuple[TensorSpec, ...]           # per sample in ``order``
    incoming: tuple[tuple[tuple[SampleId, ...], Received], ...]   # leader only
    leader: int
    tp_group: dist.ProcessGroup | None       # None: no TP broadcast
    device: torch.device
    is_leader: bool
    _got: dict[SampleId, torch.Tensor] | None = None
    # Context parallelism on the receiving stage: after the TP broadcast among CP rank 0's
    # TP ranks, each CP group broadcasts from its CP rank 0, so every CP rank holds every
    # sample's rows (each picks the positions it holds): the broadcasts (group, root) this
    # rank takes part in, in order (two on a hybrid mesh: ``_cp_broadcasts``).
    cp_steps: tuple[tuple[dist.ProcessGroup, int], ...] = ()
    in_tp_broadcast: bool = True            # False on CP ranks other than 0

    def wait(self) -> dict[SampleId, torch.Tensor]:
        if self._got is not None:
            return self._got
        buf = None
        if self.is_leader:
            got: dict[SampleId, torch.Tensor] = {}
            for ids, received in self.incoming:
                got.update(zip(ids, received.wait(), strict=True))
            ordered = [got[s] for s in self.order]
            if self.tp_group is not None or self.cp_steps:
                buf = pack(ordered, self.device)
                if self.tp_group is not None and buf.numel():
                    dist.broadcast(buf, self.leader, group=self.tp_group)
        else:
            buf = torch.empty(sum(s.nbytes for s in self.specs), dtype=torch.uint8,
                              device=self.device)
            if buf.numel() and self.in_tp_broadcast and self.tp_group is not None:
                dist.broadcast(buf, self.leader, group=self.tp_group)
        if buf is not None and buf.numel():
            for group, root in self.cp_steps:
                dist.broadcast(buf, root, group=group)
        if not self.is_leader:
            assert buf is not None
            ordered = unpack(buf, self.specs)
        self._got = dict(zip(self.order, ordered, strict=True))
        return self._got


class Broker:
    """Moves per-sample tensors between units for one rank (see the module docstring).

    Every method is called by every rank of the relevant stage: ``send_forward`` and
    ``recv_backward`` by the producer's last stage, ``recv_forward`` and ``send_backward``
    by the consumer's first stage. Non-leaders' sends are no-ops; receives broadcast within
    the receiving stage's TP group, so ``groups`` is needed wherever the receiving side has
    tp > 1. Received tensors do not require grad: the consumer marks its inputs
    ``requires_grad_()`` itself (they are leaves). ``p2p``: this rank's channel; the
    caller flushes it."""

    def __init__(self, plan: Plan, rank: int, p2p: P2P, groups: ProcessGroups | None = None):
        self.plan = plan
        self.p2p = p2p
        self.grids: dict[str, UnitGrid] = {g.name: g for g in grids(plan)}
        self.role: RankRole = role_of(plan, rank)
        if groups is not None and groups.rank != rank:
            raise ValueError(f"groups belong to rank {groups.rank}, not {rank}")
        self.groups = groups
        # Routes by (producer, consumer, StepSamples): a rank asks for the same microbatch
        # step's routes more than once, and a feed without a reorder policy hands out the
        # same StepSamples every step. The StepSamples is kept with its routes, so its id
        # cannot be reused while the entry lives.
        self._routes: dict[tuple[str, str, int], tuple[StepSamples, Routes, Routes]] = {}

    @property
    def rank(self) -> int:
        return self.role.rank

    def routes(self, producer: str, consumer: str, samples: StepSamples) -> Routes:
        """(producer replica, consumer replica) -> samples, for this step."""
        return self._cached_routes(producer, consumer, samples)[1]

    def _cached_routes(self, producer: str, consumer: str, samples: StepSamples
                       ) -> tuple[StepSamples, Routes, Routes]:
        key = (producer, consumer, id(samples))
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        pg, cg = self._edge(producer, consumer)
        out = route(samples.sample_ids, samples.replicas(producer), samples.replicas(consumer),
                    producer_dp=pg.dp, consumer_dp=cg.dp)
        if len(self._routes) >= _ROUTES_KEPT:
            self._routes.clear()
        self._routes[key] = hit = (samples, out, reverse(out))
        return hit

    # -- forward: producer last stage -> consumer first stage

    def send_forward(self, index: int, producer: str, consumer: str,
                     tensors_by_sample: Mapping[SampleId, torch.Tensor],
                     samples: StepSamples) -> None:
        """Queue microbatch ``index``'s (``step * M + j``) forward messages."""
        pg, cg = self._edge(producer, consumer)
        self._send(_label(producer, consumer, "F", index), pg, pg.last_stage,
                   samples.replicas(producer), cg, 0, self.routes(producer, consumer, samples),
                   tensors_by_sample, samples)

    def recv_forward(self, index: int, producer: str, consumer: str, samples: StepSamples,
                     spec_of: SpecOf) -> PendingSamples:
        """Queue the receives of microbatch ``index``'s forward messages; ``spec_of``:
        the shape and dtype of a sample's tensor."""
        pg, cg = self._edge(producer, consumer)
        return self._recv(_label(producer, consumer, "F", index), pg, pg.last_stage, cg, 0,
                          self._cached_routes(producer, consumer, samples)[2],
                          samples.replicas(consumer), samples, spec_of)

    # -- backward: consumer first stage -> producer last stage

    def send_backward(self, index: int, producer: str, consumer: str,
                      grads_by_sample: Mapping[SampleId, torch.Tensor],
                      samples: StepSamples) -> None:
        pg, cg = self._edge(producer, consumer)
        self._send(_label(producer, consumer, "B", index), cg, 0, samples.replicas(consumer),
                   pg, pg.last_stage, self._cached_routes(producer, consumer, samples)[2],
                   grads_by_sample, samples)

    def recv_backward(self, index: int, producer: str, consumer: str, samples: StepSamples,
                      spec_of: SpecOf) -> PendingSamples:
        pg, cg = self._edge(producer, consumer)
        return self._recv(_label(producer, consumer, "B", index), cg, 0, pg, pg.last_stage,
                          self.routes(producer, consumer, samples),
                          samples.replicas(producer), samples, spec_of)

    # -- internals

    def _edge(self, producer: str, consumer: str) -> tuple[UnitGrid, UnitGrid]:
        try:
            pg, cg = self.grids[producer], self.grids[consumer]
        except KeyError as exc:
            name = exc.args[0]
            if any(u.name == name and u.colocated for u in self.plan.units):
                # Its tensors never leave the host stage's autograd graph.
                raise KeyError(f"unit {name!r} is co-located on the backbone's stages: "
                               "the broker carries nothing to or from it") from None
            if any(u.name == name and u.phased for u in self.plan.units):
                raise KeyError(f"unit {name!r} runs phased on the backbone's ranks: the "
                               "broker carries nothing to or from it") from None
            raise KeyError(f"no unit {name!r} in the plan") from None
        if (pg.role, cg.role) not in _EDGES:
            raise ValueError(f"{producer} ({pg.role}) does not feed {consumer} ({cg.role}); "
                             "the broker links encoder -> backbone and backbone -> generator")
        return pg, cg

    def _where(self, grid: UnitGrid, stage: int, what: str) -> RankRole:
        r = self.role
        if r.unit != grid.name or r.stage != stage:
            raise RuntimeError(f"rank {r.rank} ({r.unit}.s{r.stage}) cannot {what}: only "
                               f"{grid.name}.s{stage} does")
        return r

    def _send(self, label: str, src: UnitGrid, src_stage: int, src_assignment: Sequence[int],
              dst: UnitGrid, dst_stage: int, routes: Routes,
              tensors: Mapping[SampleId, torch.Tensor], samples: StepSamples) -> None:
        me = self._where(src, src_stage, "send these tensors")
        mine = [s for s, r in zip(samples.sample_ids, src_assignment, strict=True)
                if r == me.replica]
        own = set(mine)
        if set(tensors) != own:
            missing = [s for s in mine if s not in tensors]
            extra = [s for s in tensors if s not in own]
            raise ValueError(f"{src.name} replica {me.replica} must send samples {mine}; "
                             f"missing {missing}, not its own {extra}")
        if not me.is_leader:
            return
        for (s, d), ids in routes.items():
            if s == me.replica:
                self.p2p.send(dst.leader(dst_stage, d), [tensors[i] for i in ids],
                              f"{label} {s}->{d}")

    def _recv(self, label: str, src: UnitGrid, src_stage: int, dst: UnitGrid, dst_stage: int,
              routes: Routes, dst_assignment: Sequence[int], samples: StepSamples,
              spec_of: SpecOf) -> PendingSamples:
        """``routes`` keyed (receiving replica, sending replica)."""
        me = self._where(dst, dst_stage, "receive these tensors")
        order = tuple(s for s, r in zip(samples.sample_ids, dst_assignment, strict=True)
                      if r == me.replica)
        specs = tuple(spec_of(s) for s in order)
        incoming: list[tuple[tuple[SampleId, ...], Received]] = []
        if me.is_leader:
            for (d, s), ids in routes.items():
                if d == me.replica:
                    incoming.append((ids, self.p2p.recv(
                        src.leader(src_stage, s), [spec_of(i) for i in ids],
                        f"{label} {s}->{d}")))
        tp_group, cp_steps = None, ()
        if (dst.tp > 1 or dst.cp > 1) and self.groups is None:
            raise RuntimeError(f"unit {dst.name} has tp={dst.tp}, cp={dst.cp}: the broker "
                               "needs this rank's ProcessGroups to broadcast within them")
        if dst.tp > 1:
            tp_group = self.groups.tp
        if dst.cp > 1:
            cp_steps = _cp_broadcasts(self.groups, me)
        return PendingSamples(order=order, specs=specs, incoming=tuple(incoming),
                              leader=dst.leader(dst_stage, me.replica), tp_group=tp_group,
                              device=self.p2p.device, is_leader=me.is_leader,
                              cp_steps=cp_steps, in_tp_broadcast=me.cp_index == 0)


def _cp_broadcasts(groups: ProcessGroups, me: RankRole
                   ) -> tuple[tuple[dist.ProcessGroup, int], ...]:
    """The broadcasts that take CP rank 0's samples to ``me`` (``PendingSamples.cp_steps``):
    over the CP group; on a hybrid ``(cp_ring, cp_ulysses)`` mesh (CP rank ``i * U + j``)
    first along the ring of ``j = 0``, then along each ring index's Ulysses group."""
    cp = groups.cp
    if isinstance(cp, dist.ProcessGroup):
        return ((cp, me.cp_ranks[0]),)
    u = cp.size(1)
    i, j = divmod(me.cp_index, u)
    steps = []
    if j == 0 and cp.size(0) > 1:
        steps.append((cp.get_group("cp_ring"), me.cp_ranks[0]))
    if u > 1:
        steps.append((cp.get_group("cp_ulysses"), me.cp_ranks[i * u]))
    return tuple(steps)


def _label(producer: str, consumer: str, direction: str, index: int) -> str:
    return f"{producer}->{consumer} {direction} {index}"
