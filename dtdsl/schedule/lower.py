"""Lowering: Plan -> Schedule, in steps (compute, then communication, then gradient
sync and optimizer), then validation.

1. ``lower_compute``: every unit stage's order of forwards and backwards.
2. ``add_communication``: a receive before every pass that reads another stage's data,
   a send after every pass whose output another stage reads. Where a unit interleaves
   (vpp > 1), ``schedule.place.place_by_trace`` then moves each send and receive to
   where an execution trace of the compute orders has it due, so that NCCL's groups
   cannot deadlock (placed next to their passes, the interleaved order's do:
   ``schedule.validate``, phase 4); 1F1B and GPipe keep step 2's placement, which pairs
   their sends and receives step by step already.
3. ``add_optimizer``: ``SYNC`` and ``OPT`` at the end of every stage that trains.
4. ``validate`` (``dtdsl.schedule.validate``; ``dtc compile`` runs ``validate_nccl``).

The composite pipeline
----------------------
Units form a DAG: encoders (side by side) -> backbone -> generators (side by side).
Each unit stage runs 1F1B with its own warm-up: the number of forwards it runs before
its first backward. For stages without interleaving that is, over the gradients j its
consumers send back, the most microbatches a consumer forwards before it sends gradient
j, less j (enough that the stage never waits for a gradient whose consumer still waits
for one of its forwards), which is the textbook p - 1 - i for stage i of a plain p-stage
pipeline (one forward more than strictly needed, to cover the latency); capped at M. It
is read off the consumers' already lowered orders, sinks first, so that a consumer with
an unusual order (an interleaved backbone, whose chunk-0 forwards come in groups) gets
exactly as many microbatches as it waits for. GPipe runs all forwards, then all
backwards (microbatch 0 first, as torch's GPipe).

Gradients
---------
A virtual stage *trains* when it holds trainable parameters (an unfrozen module; an
encoder's projector sits on its last virtual stage, a generator's on its first). Its
input *needs a gradient* when anything upstream of it trains (within the unit the
earlier virtual stages; into the backbone ``dtdsl.cost.flops.input_needs_grad``; into
a generator the backbone's). It runs ``B`` when it trains or its input needs a gradient,
and a gradient reaches it: its own loss (the backbone's and every generator's last
stage) or a consumer that runs ``B``. A consumer sends gradients back to exactly the
producers that run ``B``. So a frozen encoder does no ``B`` and gets no ``RECV_B``; a
frozen backbone or generator whose input needs gradients runs ``B`` to pass them on,
without ``SYNC``/``OPT``.

Co-located modules (an encoder or generator of the program with no unit of its own in the
schedule: ``Schedule.empty`` leaves them out) run inside the backbone's first (last)
virtual stage, which therefore trains when they or their projectors do: a frozen
backbone with a trainable co-located encoder still runs ``B`` on its first stage and
steps its optimizer there. A phased encoder (``UnitPlan.phased``) runs before and after
the pipeline on every backbone rank, each holding a shard of it: every backbone stage
trains when it or its projector does, so a frozen backbone still runs ``B`` down to its
first stage (whose inputs' gradients the backward phase reads) and steps the encoder's
shards everywhere.

Interleaved 1F1B
----------------
Within a unit with vpp v > 1: the interleaved schedule of Megatron-LM and of
torch.distributed.pipelining's ScheduleInterleaved1F1B. Chunk c of stage s is virtual
stage c * pp + s; forwards run in groups of microbatches per chunk (chunk 0 for the
group's microbatches, chunk 1 for the same, ..., then the next group), backwards in the
same groups with the chunks reversed; stage s warms up with (v - 1) G + 2 (pp - 1 - s) + D
forwards, G the first group's size and D the warm-up the downstream units ask of the
last virtual stage as above (0 when nothing downstream sends gradients; one more per
downstream stage, as ``dtdsl.cost.model.in_flight`` assumes), and then alternates one
forward and one backward. The groups (``group_sizes``): max(1, M // g) of them, g = pp or
D where a downstream pipeline is deeper (so that the last chunk keeps feeding it), as
equal as possible, the larger first. That is torch's order wherever torch accepts M
(its M // pp rounds of M / rounds microbatches, M a multiple of the rounds) and
Megatron-LM's (groups of pp) wherever Megatron accepts M (a multiple of pp). With
uniform passes a lone interleaved unit then takes (max(M, pp) + (min(M, pp) - 1) / v)
stage times of forward and backward, never more than plain 1F1B's (M + pp - 1); with a
short last group instead (Megatron's groups for any M) it could be slower than 1F1B.
Between other units, Megatron's fixed groups of g are tried as well and the faster
order kept (``lower_compute``). Units with vpp 1 in an interleaved plan run plain 1F1B.
Restrictions (a ``LoweringError``): interleaving needs pp >= 2, GPipe and 1F1B do not
interleave.

The fixed alternation can still deadlock: a downstream pipeline of depth D >= 2 waits
for forward j + D - 1 of the last chunk, a group later than the alternation runs it;
Megatron's fixed groups with a short last group (where ``lower_compute`` keeps them)
make stage 0 wait for stage pp-1's forward of the previous chunk while stage pp-1 waits
for a gradient from stage 0. So a backward runs after the
alternation's count of forwards *or later*: after every forward its gradient depends
on, namely its own forward, the forwards the gradient-sending consumer (the next
virtual stage, or the downstream units) runs before that backward, transitively.
Backwards are placed in the backward order, a consumer's before its producer's; where
the alternation is valid nothing moves and the order is exactly Megatron's or torch's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from dtdsl.cost.flops import input_needs_grad
from dtdsl.errors import DtdslError
from dtdsl.ir.plan import Plan
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleUnit,
    StageSchedule,
    VirtualStage,
)
from dtdsl.schedule.place import place_by_trace
from dtdsl.schedule.validate import validate

__all__ = ["GradientFlow", "LoweringError", "add_communication", "add_optimizer",
           "gradient_flow", "group_sizes", "interleaved_order", "lower", "lower_compute",
           "lower_units", "split_weights"]

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B


class LoweringError(DtdslError, ValueError):
    """The plan asks for a schedule this lowering does not build (named in the message)."""


class GradientFlow:
    """Which virtual stages train, and which run backward (see the module docstring)."""

    def __init__(self, trains: frozenset[VirtualStage], backward: frozenset[VirtualStage]):
        self.trains = trains
        self.backward = backward

    @staticmethod
    def everywhere(schedule: Schedule) -> GradientFlow:
        """Every virtual stage trains and runs backward (a fully trainable model)."""
        every = frozenset((u.name, s, c) for u in schedule.units for s in range(u.pp)
                          for c in range(u.vpp))
        return GradientFlow(every, every)

    def stage_trains(self, unit: str, stage: int, vpp: int) -> bool:
        return any((unit, stage, c) in self.trains for c in range(vpp))


def gradient_flow(schedule: Schedule, program: Program,
                  phased: frozenset[str] = frozenset()) -> GradientFlow:
    """Trainable and backward-running virtual stages of ``schedule``'s units; ``phased``:
    the plan's phased encoders (``UnitPlan.phased``), held by every backbone stage."""
    units = schedule.units
    trains: set[VirtualStage] = set()
    useful: set[VirtualStage] = set()
    for u in units:
        module = program.module(u.name)
        last = u.num_virtual_stages - 1
        for k in range(u.num_virtual_stages):
            vs = (u.name, k % u.pp, k // u.pp)
            holds_projector = (u.role == "encoder" and k == last) or \
                (u.role == "generator" and k == 0)
            projector_trains = holds_projector and any(
                not p.frozen for p in program.projectors
                if (p.source if u.role == "encoder" else p.target) == u.name)
            if not module.frozen or projector_trains:
                trains.add(vs)
    trains |= _hosts_that_train(schedule, program, phased)

    def unit_input_needs_grad(u: ScheduleUnit) -> bool:
        if u.role == "encoder":
            return False
        backbone = program.backbone
        if u.role == "backbone":
            return input_needs_grad(program, backbone)
        # Into a generator: the backbone trains or its own input needs gradients (the
        # generator's projector is on the generator's first stage, after its input).
        return not backbone.frozen or input_needs_grad(program, backbone)

    for u in units:
        upstream = unit_input_needs_grad(u)
        for k in range(u.num_virtual_stages):
            vs = (u.name, k % u.pp, k // u.pp)
            if upstream or vs in trains:
                useful.add(vs)
            upstream = upstream or vs in trains

    # Gradients flow from the losses back to the sources: visit sinks first.
    backward: set[VirtualStage] = set()
    for u in _reverse_topological(units):
        for k in reversed(range(u.num_virtual_stages)):
            vs = (u.name, k % u.pp, k // u.pp)
            has_loss = u.role != "encoder" and k == u.num_virtual_stages - 1
            fed_back = any(c in backward for c in schedule.consumers(*vs))
            if vs in useful and (has_loss or fed_back):
                backward.add(vs)
    return GradientFlow(frozenset(trains), frozenset(backward))


def _trains_with_projector(program: Program, module: str, role: str) -> bool:
    """Does ``module`` or the projector that runs with it (an encoder's into the backbone,
    the backbone's into a generator) hold trainable parameters?"""
    if not program.module(module).frozen:
        return True
    return any(not p.frozen for p in program.projectors
               if (p.source if role == "encoder" else p.target) == module)


def _hosts_that_train(schedule: Schedule, program: Program,
                      phased: frozenset[str] = frozenset()) -> set[VirtualStage]:
    """The backbone's virtual stages that host a trainable co-located module: its first
    for an encoder, its last for a generator (module docstring); every one of them for a
    trainable phased encoder (``phased``: each backbone rank holds a shard of it and
    steps it)."""
    scheduled = {u.name for u in schedule.units}
    backbone = next(u for u in schedule.units if u.role == "backbone")
    last = backbone.num_virtual_stages - 1
    out: set[VirtualStage] = set()
    for m in program.modules:
        if m.role == "backbone" or m.name in scheduled:
            continue
        if not _trains_with_projector(program, m.name, m.role):
            continue
        if m.name in phased:
            out |= {(backbone.name, k % backbone.pp, k // backbone.pp)
                    for k in range(last + 1)}
        else:
            k = 0 if m.role == "encoder" else last
            out.add((backbone.name, k % backbone.pp, k // backbone.pp))
    return out


def _reverse_topological(units: Iterable[ScheduleUnit]) -> list[ScheduleUnit]:
    order = {"generator": 0, "backbone": 1, "encoder": 2}
    return sorted(units, key=lambda u: order[u.role])


# ---- step 1: compute order --------------------------------------------------------------------

# One pass of a stage's order: (F or B, microbatch, chunk).
Pass = tuple[ActionKind, int, int]


def interleaved_order(num_microbatches: int, vpp: int, group: int | Sequence[int]
                      ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Megatron-LM's interleaved order: (microbatch, chunk) of the forwards and of the
    backwards. Groups of ``group`` microbatches per chunk (a shorter last group), or of
    the sizes ``group`` lists, in turn."""
    sizes = _fixed_groups(num_microbatches, group) if isinstance(group, int) else list(group)
    if sum(sizes) != num_microbatches or min(sizes, default=1) < 1:
        raise ValueError(f"group sizes {sizes} do not cover {num_microbatches} microbatches")
    fwd: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        members = range(start, start + size)
        start += size
        for c in range(vpp):
            fwd += [(j, c) for j in members]
    bwd = [(j, vpp - 1 - c) for j, c in fwd]
    return fwd, bwd


def _fixed_groups(num_microbatches: int, group: int) -> list[int]:
    """Megatron-LM's groups: ``group`` microbatches each, the last one shorter."""
    return [min(group, num_microbatches - start) for start in range(0, num_microbatches, group)]


def group_sizes(num_microbatches: int, least: int) -> list[int]:
    """The microbatch groups of an interleaved order: as many groups of at least
    ``least`` microbatches as fit (one when fewer), as equal as possible, the larger
    first. With ``least`` pp that is torch.distributed.pipelining's grouping wherever
    its ScheduleInterleaved1F1B accepts M (max(1, M // pp) rounds of M / rounds each; it
    refuses M the rounds do not divide), and Megatron-LM's groups of pp wherever M is a
    multiple of pp."""
    rounds = max(1, num_microbatches // max(least, 1))
    size, extra = divmod(num_microbatches, rounds)
    return [size + 1] * extra + [size] * (rounds - extra)


def _merge(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], before: list[int]
           ) -> list[Pass]:
    """The forwards in ``fwd`` order and the backwards in ``bwd`` order, backward i after
    the first ``before[i]`` forwards (non-decreasing)."""
    order: list[Pass] = []
    done = 0
    for (j, c), n in zip(bwd, before, strict=True):
        order += [(F, *fc) for fc in fwd[done:n]]
        done = max(done, n)
        order.append((B, j, c))
    order += [(F, *fc) for fc in fwd[done:]]
    return order


def _one_f_one_b(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], warmup: int
                 ) -> list[Pass]:
    """``warmup`` forwards, then alternate one forward and one backward, then the rest."""
    return _merge(fwd, bwd, [min(warmup + i + 1, len(fwd)) for i in range(len(bwd))])


def _forwards_before(order: list[Pass], chunk: int) -> dict[int, int]:
    """Per microbatch j whose backward of ``chunk`` the stage runs: the highest
    microbatch of the forwards of ``chunk`` it has run before that backward (-1 for
    none; forwards of a chunk run in microbatch order)."""
    highest = -1
    out: dict[int, int] = {}
    for kind, j, c in order:
        if c == chunk:
            if kind is B:
                out[j] = highest
            else:
                highest = j
    return out


def lower_compute(base: Schedule, flow: GradientFlow) -> Schedule:
    """Step 1: the forwards and backwards of every unit stage of ``base`` (its units,
    schedule name and microbatch count; its actions are ignored), in order.

    Interleaved units take ``group_sizes`` (torch's order where torch applies). In a
    pipeline of several units, Megatron-LM's fixed groups of max(pp, D) are tried too and
    the faster of the two orders (``_makespan``, uniform passes) is kept, the
    ``group_sizes`` one on a tie: next to units without chunks neither is always the
    faster (larger groups make the chunk-0 forwards, which read an encoder, and the
    last chunk's, which feed a generator, come in longer bursts)."""
    orders = _orders(base, flow, group_sizes)
    if len(base.units) > 1 and any(u.vpp > 1 for u in base.units):
        fixed = _orders(base, flow, _fixed_groups)
        if fixed != orders and _makespan(base, flow, fixed) < _makespan(base, flow, orders):
            orders = fixed
    stages = tuple(
        StageSchedule(unit=st.unit, stage=st.stage, actions=tuple(
            Action(unit=st.unit, stage=st.stage, kind=kind, microbatch=j, chunk=c)
            for kind, j, c in orders[(st.unit, st.stage)]))
        for st in base.stages)
    return base.with_stages(stages)


Groups = Callable[[int, int], list[int]]


def _orders(base: Schedule, flow: GradientFlow, groups: Groups
            ) -> dict[tuple[str, int], list[Pass]]:
    """Every unit stage's passes, interleaved units with microbatch groups ``groups(M,
    least)``."""
    m = base.num_microbatches
    orders: dict[tuple[str, int], list[Pass]] = {}

    def consumer_reads(vs: VirtualStage) -> list[tuple[VirtualStage, dict[int, int]]]:
        """The gradient-sending consumers of ``vs`` (already lowered) and, per microbatch
        j, the highest microbatch they forward before the backward of j that sends to
        ``vs``."""
        return [(c, _forwards_before(orders[(c[0], c[1])], c[2]))
                for c in base.consumers(*vs) if c in flow.backward]

    def demand(vs: VirtualStage) -> int:
        """The warm-up of a stage without interleaving: how many microbatches its
        gradient-sending consumers take before they send gradient j back, less j, at
        most (0 when none does). A stage that runs forward j + demand before backward j
        has forwarded everything its consumers wait for, plus one to cover the latency
        (the textbook p - 1 - i of a plain pipeline)."""
        if vs not in flow.backward:
            return 0
        return max((highest + 1 - j for _, before in consumer_reads(vs)
                    for j, highest in before.items()), default=0)

    for u in _reverse_topological(base.units):
        v = u.vpp
        if v > 1 and u.pp < 2:
            raise LoweringError(f"{u.name}: interleaving (vpp {v}) needs at least two "
                                f"pipeline stages, the plan gives pp {u.pp}")
        if v > 1 and base.name != "interleaved":
            raise LoweringError(f"{u.name}: vpp {v} under the {base.name} schedule; only "
                                "the interleaved schedule has model chunks")
        if v > 1 and base.name == "zero_bubble":
            raise LoweringError(f"{u.name}: vpp {v} under the zero_bubble schedule; only "
                                "the interleaved schedule has model chunks")
        if v == 1:
            warmups = {}
            for s in reversed(range(u.pp)):
                fwd = [(j, 0) for j in range(m)]
                bwd = fwd if (u.name, s, 0) in flow.backward else []
                warmup = m if base.name == "gpipe" else min(m, demand((u.name, s, 0)))
                warmups[s] = warmup if bwd else m
                orders[(u.name, s)] = _one_f_one_b(fwd, bwd, warmup)
            if base.name == "zero_bubble":
                held = max(warmups.values()) + 1
                for s, warmup in warmups.items():
                    if (u.name, s, 0) in flow.trains:
                        orders[(u.name, s)] = split_weights(orders[(u.name, s)],
                                                            max(0, held - warmup - 1))
            continue
        orders.update(_interleaved(u, m, flow, consumer_reads, demand, groups))
    return orders


def split_weights(order: Sequence[Pass], deferred: int) -> list[Pass]:
    """ZB-H1 (module docstring, Zero bubble): ``order`` with each backward split into
    its ``B`` and a ``W`` that runs once ``deferred`` more backwards have run (the oldest
    first, as torch.distributed.pipelining's zero-bubble orders), the last ``deferred``
    after the stage's last pass."""
    out: list[Pass] = []
    pending: deque[tuple[int, int]] = deque()
    for kind, j, c in order:
        out.append((kind, j, c))
        if kind is B:
            pending.append((j, c))
            if len(pending) > deferred:
                out.append((W, *pending.popleft()))
    out += [(W, j, c) for j, c in pending]
    return out


def _makespan(base: Schedule, flow: GradientFlow,
              orders: dict[tuple[str, int], list[Pass]]) -> float:
    """When the last pass of ``orders`` ends if every stage's forward takes 1 / vpp and
    its backward 2 / vpp and transfers take no time (a pass starts when its stage is
    free and its inputs are there: the producers' forwards, the consumers' backwards)."""
    end: dict[tuple[str, int, int, ActionKind, int], float] = {}
    vpp = {u.name: u.vpp for u in base.units}
    todo = {key: 0 for key in orders}
    free = dict.fromkeys(orders, 0.0)
    progress = True
    while progress:
        progress = False
        for (unit, s), order in orders.items():
            k = todo[(unit, s)]
            while k < len(order):
                kind, j, c = order[k]
                if kind is F:
                    deps = [(*p, F, j) for p in base.producers(unit, s, c)]
                else:
                    deps = [(unit, s, c, F, j)] + [(*q, B, j) for q in base.consumers(unit, s, c)
                                                   if q in flow.backward]
                if any(d not in end for d in deps):
                    break
                start = max([free[(unit, s)]] + [end[d] for d in deps])
                free[(unit, s)] = end[(unit, s, c, kind, j)] = \
                    start + (1.0 if kind is F else 2.0) / vpp[unit]
                k += 1
                progress = True
            todo[(unit, s)] = k
    if any(todo[key] < len(order) for key, order in orders.items()):
        raise LoweringError("internal: the lowered orders deadlock")
    return max(free.values(), default=0.0)


def _interleaved(u: ScheduleUnit, m: int, flow: GradientFlow,
                 consumer_reads: Callable[[VirtualStage], list[tuple[VirtualStage, dict]]],
                 demand: Callable[[VirtualStage], int], groups: Groups
                 ) -> dict[tuple[str, int], list[Pass]]:
    """The orders of an interleaved unit's stages (see the module docstring), given
    ``lower_compute``'s view of the units downstream."""
    v, pp = u.vpp, u.pp
    last = (u.name, pp - 1, v - 1)
    downstream = demand(last)
    sizes = groups(m, max(pp, downstream))
    fwd, bwd = interleaved_order(m, v, sizes)
    total = len(fwd)
    position = {fc: k for k, fc in enumerate(fwd)}
    # Stage 0's forwards of chunk c >= 1 read stage pp-1's chunk c - 1: how many forwards
    # stage pp-1 must have run for stage 0's first n forwards, as a prefix maximum.
    wrap = [0] * (total + 1)
    for k, (j, c) in enumerate(fwd):
        wrap[k + 1] = max(wrap[k], position[(j, c - 1)] + 1 if c else 0)
    # The forwards the units downstream of the last virtual stage run before each gradient
    # they send back, in this unit's forward count.
    downstream_need: dict[int, int] = {}
    for _, seen in consumer_reads(last):
        for j, highest in seen.items():
            need = position[(highest, v - 1)] + 1 if highest >= 0 else 0
            downstream_need[j] = max(downstream_need.get(j, 0), need)

    # before[(s, j, c)]: forwards stage s runs before its backward of (j, c).
    before: dict[tuple[int, int, int], int] = {}
    runs: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    warmup = [min(total, (v - 1) * sizes[0] + 2 * (pp - 1 - s) + downstream) for s in range(pp)]
    for j, c in bwd:             # backwards in order: a consumer's is placed before its producer's
        for s in reversed(range(pp)):
            if (u.name, s, c) not in flow.backward:
                continue
            n = max(min(warmup[s] + len(runs[s]) + 1, total), position[(j, c)] + 1)
            if runs[s]:
                n = max(n, before[(s, *runs[s][-1])])
            if s + 1 < pp:
                n = max(n, before.get((s + 1, j, c), 0))
            elif c + 1 < v:
                n = max(n, wrap[before.get((0, j, c + 1), 0)])
            else:
                n = max(n, downstream_need.get(j, 0))
            before[(s, j, c)] = n
            runs[s].append((j, c))
    return {(u.name, s): _merge(fwd, runs[s], [before[(s, *jc)] for jc in runs[s]])
            for s in range(pp)}


# ---- step 2: communication ---------------------------------------------------------------------

def add_communication(schedule: Schedule) -> Schedule:
    """Step 2: receive what a pass reads from another stage just before it, send what it
    produces for another stage just after it. A consumer sends gradients back to the
    producers that run a backward of that microbatch and chunk. A ``W`` (zero_bubble)
    moves past the receives of the pass after it: it reads and sends nothing, and where
    it stood it would split the run of a backward's sends and the next pass's receives,
    one NCCL group in 1F1B (``validate_nccl``), in two."""
    backward = {(st.unit, st.stage, a.chunk, a.microbatch)
                for st in schedule.stages for a in st.actions if a.kind is B}
    stages = []
    for st in schedule.stages:
        unit, stage = st.unit, st.stage
        links: dict[int, tuple[tuple[VirtualStage, ...], tuple[VirtualStage, ...]]] = {}
        out: list[Action] = []
        weights: list[Action] = []
        for a in st.actions:
            kind = a.kind
            if kind is W:
                weights.append(a)
                continue
            if kind is not F and kind is not B:
                out += weights + [a]
                weights = []
                continue
            j, c = a.microbatch, a.chunk
            if c not in links:
                links[c] = (schedule.producers(unit, stage, c), schedule.consumers(unit, stage, c))
            producers, consumers = links[c]
            if kind is F:
                out += [Action(unit=unit, stage=stage, kind=RECV_F, microbatch=j, chunk=c,
                               peer_unit=p[0], peer_stage=p[1], peer_chunk=p[2])
                        for p in producers]
                out += weights + [a]
                out += [Action(unit=unit, stage=stage, kind=SEND_F, microbatch=j, chunk=c,
                               peer_unit=q[0], peer_stage=q[1], peer_chunk=q[2])
                        for q in consumers]
            else:
                out += [Action(unit=unit, stage=stage, kind=RECV_B, microbatch=j, chunk=c,
                               peer_unit=q[0], peer_stage=q[1], peer_chunk=q[2])
                        for q in consumers if (*q, j) in backward]
                out += weights + [a]
                out += [Action(unit=unit, stage=stage, kind=SEND_B, microbatch=j, chunk=c,
                               peer_unit=p[0], peer_stage=p[1], peer_chunk=p[2])
                        for p in producers if (*p, j) in backward]
            weights = []
        out += weights
        stages.append(StageSchedule(unit=unit, stage=stage, actions=tuple(out)))
    return schedule.with_stages(tuple(stages))


# ---- step 3: gradient sync and optimizer -----------------------------------------------------

def add_optimizer(schedule: Schedule, flow: GradientFlow) -> Schedule:
    """Step 3: ``SYNC`` then ``OPT`` at the end of every stage that holds trainable
    parameters (after its last backward: its gradients are complete)."""
    stages = []
    for st in schedule.stages:
        actions = st.actions
        if flow.stage_trains(st.unit, st.stage, schedule.unit(st.unit).vpp):
            actions += (Action(unit=st.unit, stage=st.stage, kind=ActionKind.SYNC),
                        Action(unit=st.unit, stage=st.stage, kind=ActionKind.OPT))
        stages.append(StageSchedule(unit=st.unit, stage=st.stage, actions=actions))
    return schedule.with_stages(tuple(stages))


def lower_units(base: Schedule, flow: GradientFlow) -> Schedule:
    """Steps 1-3 and validation for the units of ``base`` (see ``lower``); for callers
    without a Program, e.g. synthetic pipelines (``GradientFlow.everywhere``)."""
    schedule = add_communication(lower_compute(base, flow))
    if any(u.vpp > 1 for u in base.units):
        schedule = place_by_trace(schedule)
    schedule = add_optimizer(schedule, flow)
    validate(schedule)
    return schedule


def lower(plan: Plan, program: Program) -> Schedule:
    """The validated schedule of ``plan`` (its ``schedule``, ``num_microbatches`` and
    per-unit pp and vpp) for ``program`` (which modules and projectors are frozen)."""
    base = Schedule.empty(plan)
    phased = frozenset(u.name for u in plan.units if u.phased)
    return lower_units(base, gradient_flow(base, program, phased))
