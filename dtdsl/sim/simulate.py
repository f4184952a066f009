"""Discrete-event simulation of a Schedule: when every action of one iteration runs.

Semantics (those of ``dtdsl.ir.schedule`` and the validator): each unit stage runs its
actions in program order; a forward or backward takes its duration; a send is posted
when the stage reaches it and does not block; a receive is posted when the stage reaches
it, and the pass that reads it (the next forward, or backward, of its chunk and
microbatch) waits until the matching send was posted plus the transfer time on the link,
as the runtime waits (``train.executor``: a run of sends and receives goes out at once, a
pass waits for what it reads), so a receive posted early (``schedule.place``) costs no
time; SYNC and OPT take their durations. So every pass starts at the later of the end of
the previous action on its stage and the arrival of what it reads, and the iteration
ends with the last action.

Who waits for whom. Every data-parallel replica of a stage runs its own program with its
own durations. Within a unit, replica r of one stage exchanges activations and gradients
with replica r of the next (its own pipeline). Between units the broker couples replicas
exactly where samples cross (``dtdsl.parallel.broker``: a pair of replicas that carries
no sample of a step exchanges no message): replica r of the consumer waits, at step j,
for the producer replicas holding its samples of step j (``Durations.routes``; without
routes, every producer replica, the broker's worst case), and gradients go back the same
pairs. A stage's gradient synchronisation is a collective over its replicas: SYNC starts
when the last replica reaches it. So the replicas of a rigid pipeline (the same replica
index in every unit, Megatron-LM's layout) are independent pipelines that meet only at
the gradient sync, and data imbalance shows as each replica's own idle time.

Speed: ``Simulator(schedule)`` compiles the schedule once into a topologically ordered
list of nodes (forwards, backwards, SYNC, OPT; sends fold into the node before them and
receives into the pass that reads them, both take no time of their own; receives no pass
reads, in a schedule the validator refuses, become a wait node of no duration at the end)
with two inputs each, ``start = max(end[a] + wa, end[b] + wb)``; ``run(durations)`` is
then one plain loop over the nodes, so many iterations with different sample costs share
the compilation. 32 stages x 256 microbatches (16k passes) run in a few milliseconds.
Schedules with data parallelism run the same nodes per replica (a list of replica times
per node, the routes read per step), a few times slower per node.

Phased encoders in the pipeline's bubbles (``Durations.bubbles``: per encoder, the
backbone stage that encodes each microbatch step, ``reorder.workload.phase_fit``): stage s's
ranks run their encoder forwards as nodes of their own row before the stage's first
action, and their encoder backwards after its last pass (before its SYNC); the first
stage's forward of step j waits for the forward of j's images (the hand-off is priced in
its duration), a stage's first encoder backward for the first stage's backward of the
last of its steps (and, on stage 1, for the first stage's last forward: the gradients'
one message follows the activations to that rank), and the first stage's SYNC (the
encoder's gradient sync over every backbone rank) for every stage's encoder backwards.
So what does not fit in a bubble shows as the time it adds. Their durations are
``compute_s[encoder]`` of shape (2, 1, 1, M, backbone dp); the nodes are compiled once per
assignment (``Simulator.run`` keeps a variant per assignment it meets).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from dtdsl.ir.schedule import ActionKind, Schedule
from dtdsl.ir.timeline import Event, Timeline, TimelineUnit
from dtdsl.schedule.validate import ScheduleError

__all__ = ["Durations", "SimResult", "Simulator", "simulate"]

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
_FWD, _BWD, _WGT = 0, 1, 2
# Rows of a unit's pass durations in the simulator: forward, backward (input gradients
# only where the schedule runs a W for it), weight gradients.
_ROWS = 3
_ROW = {F: _FWD, B: _BWD, W: _WGT}
# The duration slot of a node that only waits for receives (no action of its own).
_WAIT = -2


@dataclass(frozen=True, kw_only=True)
class Durations:
    """How long each action of one iteration takes.

    ``compute_s[unit]``: shape (2, pp, vpp, M, dp): forward (index 0) and backward (1)
    seconds of microbatch step j through model chunk c of stage s on replica r.
    ``weight_s[unit]``: shape (pp, vpp, M, dp): of each backward, the seconds of its weight
    gradients (``dtdsl.cost.model.CostModel.weight_grad_share``). Where the schedule runs a
    ``W`` for a backward, the ``W`` takes these and the ``B`` the rest; a ``B`` without
    its ``W`` takes the whole backward. Missing: W passes take no time.
    ``link_s[(src, dst)]``: seconds a transfer from unit ``src`` to unit ``dst`` takes
    (activations from src to dst, or gradients from src back to dst; src == dst for the
    hops between a unit's own stages); missing links take no time.
    ``sync_s[unit]``, ``opt_s[unit]``: shape (pp,): the gradient synchronisation and the
    optimizer step of each stage (zero when missing).
    ``routes[(producer, consumer)]``: bool, shape (M, producer dp, consumer dp): whether
    replica q of the producer sends samples of microbatch step j to replica r of the
    consumer (and gets their gradients back); a missing edge couples every pair.
    ``bubbles``: per phased encoder (not a unit of the schedule), the backbone stage that
    encodes each microbatch step (module docstring); its ``compute_s`` entry has shape
    (2, 1, 1, M, backbone dp)."""

    compute_s: Mapping[str, np.ndarray]
    link_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    sync_s: Mapping[str, np.ndarray] = field(default_factory=dict)
    opt_s: Mapping[str, np.ndarray] = field(default_factory=dict)
    routes: Mapping[tuple[str, str], np.ndarray] = field(default_factory=dict)
    bubbles: tuple[tuple[str, tuple[int, ...]], ...] = ()
    weight_s: Mapping[str, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def uniform(schedule: Schedule, forward_s: float, backward_s: float, *,
                link_s: float = 0.0, weight_s: float = 0.0) -> Durations:
        """Every pass of every stage takes the same time (chunks split it evenly);
        ``weight_s`` of each ``backward_s`` is its weight gradients'."""
        m = schedule.num_microbatches
        compute, weights = {}, {}
        for u in schedule.units:
            shape = (2, u.pp, u.vpp, m, u.dp)
            arr = np.empty(shape)
            arr[_FWD] = forward_s / u.vpp
            arr[_BWD] = backward_s / u.vpp
            compute[u.name] = arr
            if weight_s:
                weights[u.name] = np.full(shape[1:], weight_s / u.vpp)
        names = [u.name for u in schedule.units]
        links = {(a, b): link_s for a in names for b in names} if link_s else {}
        return Durations(compute_s=compute, link_s=links, weight_s=weights)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """One simulated iteration: per-node start and end times plus what they mean."""

    simulator: Simulator
    durations: Durations
    start_s: np.ndarray           # per node: when its first replica starts
    end_s: np.ndarray             # per node: when its last replica ends
    node_s: np.ndarray            # per node: its slowest replica's seconds
    iteration_time_s: float
    # (nodes, largest dp): when each replica of a node starts (NaN past its unit's dp);
    # None when every replica starts together (no data parallelism).
    replica_start_s: np.ndarray | None = None

    def busy_s(self) -> dict[str, float]:
        """Per unit stage (``llm.s1``): seconds of compute on its slowest replica."""
        sim = self.simulator
        out: dict[str, float] = {}
        for name, (lo, hi) in sim.stage_compute.items():
            out[name] = float(self.node_s[sim.compute_nodes[lo:hi]].sum())
        return out

    def bubble_fraction(self) -> dict[str, float]:
        """Per unit stage: the share of the iteration its slowest replica is not computing."""
        t = self.iteration_time_s
        return {k: (1.0 - v / t) if t > 0 else 0.0 for k, v in self.busy_s().items()}

    def mean_bubble_fraction(self) -> float:
        """The share of the iteration that the replicas of all stages together are not
        computing, each replica with its own durations (``timeline()``'s
        ``mean_bubble_fraction``, TensorBoard's ``pipeline/bubble_fraction``)."""
        t = self.iteration_time_s
        sim = self.simulator
        busy = 0.0
        for name, _, _, _ in sim._dims:
            arr = sim.passes(self.durations, name)
            busy += float(arr[sim.compute_used[name]].sum())
        rows = sum(u.pp * u.dp for u in sim.schedule.units)
        return 1.0 - busy / (rows * t) if t > 0 and rows else 0.0

    def timeline(self, *, step: int = 0) -> Timeline:
        """The iteration as a Timeline: every replica's passes with its own duration (the
        replicas of a stage start together), SYNC and OPT."""
        return self.simulator.timeline(self, step=step)


class _Node(NamedTuple):
    """One node of the simulator's graph before renumbering (``Simulator._program_nodes``):
    a pass, a SYNC or OPT, or a wait of no duration for receives."""

    stage: int              # index into the schedule's stages
    kind: ActionKind
    slot: int               # its duration's flat index; -1: SYNC/OPT; _WAIT: a wait
    unit: str
    microbatch: int | None
    chunk: int
    deps: list              # [(node or send key, link, broker edge)]: its receives


class Simulator:
    """A schedule compiled for repeated simulation (see the module docstring)."""

    def __init__(self, schedule: Schedule,
                 bubbles: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> None:
        self.schedule = schedule
        self.bubbles = tuple(bubbles)
        self._variants: dict[tuple, Simulator] = {}
        m = schedule.num_microbatches
        units = {u.name: u for u in schedule.units}
        backbone = next((u for u in schedule.units if u.role == "backbone"), None)
        if self.bubbles and backbone is None:
            raise ValueError("phased encoders need a backbone in the schedule")
        for name, owners in self.bubbles:
            if name in units or len(owners) != m or \
                    any(not 0 <= s < backbone.pp for s in owners):
                raise ValueError(f"phased encoder {name!r}: {len(owners)} owners for {m} "
                                 f"steps, or an owner outside stages 0..{backbone.pp - 1}")
        # Every unit with durations: the schedule's, then each phased encoder (one stage,
        # one chunk, the backbone's replicas).
        self._dims = [(u.name, u.pp, u.vpp, u.dp) for u in schedule.units] + [
            (name, 1, 1, backbone.dp) for name, _ in self.bubbles]
        # Flat index of a pass's duration: per unit a block of 3 * pp * vpp * m entries
        # (forward, backward, weight gradients).
        base: dict[str, int] = {}
        offset = 0
        for name, pp, vpp, _ in self._dims:
            base[name] = offset
            offset += _ROWS * pp * vpp * m
        self._compute_base = base
        self._num_compute = offset
        self._links = sorted({(a.unit, a.peer_unit) for st in schedule.stages
                              for a in st.actions if a.kind.is_send})
        raw, producer, stage_nodes = self._program_nodes(units, backbone, base, m)
        inputs, routed = self._node_inputs(raw, producer, stage_nodes)
        order = self._topological(inputs)
        new_id = self._renumber(order, inputs, raw)
        self._index(raw, new_id, stage_nodes, base, m)
        self._lanes(order, raw, routed, new_id, base)

    def _program_nodes(self, units: dict, backbone: Any, base: dict[str, int], m: int
                       ) -> tuple[list[_Node], dict[tuple, int], list[list[int]]]:
        """Pass 1: nodes per stage in program order, and where sends' data is ready (the
        node whose end posts each send key). A node: [stage index, kind, duration slot,
        unit, microbatch, chunk, inputs [(node or send key, link, broker edge)]]."""
        schedule = self.schedule
        link_index = {k: i for i, k in enumerate(self._links)}
        producer: dict[tuple, int] = {}      # send key -> node whose end posts it
        raw: list[_Node] = []
        stage_nodes: list[list[int]] = []
        for si, st in enumerate(schedule.stages):
            u = units[st.unit]
            nodes: list[int] = []
            pending: list[tuple] = []        # inputs of the next node (phased encoders)
            # Receives by what reads them ((F or B, chunk, microbatch)): the runtime posts
            # a receive where the schedule has it and waits for it at that pass only.
            reads: dict[tuple, list[tuple]] = {}
            last = -1
            hosts = bool(self.bubbles) and st.unit == backbone.name
            if hosts:   # the encoder forwards of this stage's steps, before its first action
                for name, owners in self.bubbles:
                    for j in (j for j, s in enumerate(owners) if s == st.stage):
                        last = len(raw)
                        raw.append(_Node(si, F, base[name] + j, name, j, 0, []))
                        nodes.append(last)
                        producer[("enc_f", name, j)] = last
            tail_done = not hosts
            for a in st.actions:
                kind = a.kind
                if not tail_done and kind in (ActionKind.SYNC, ActionKind.OPT):
                    last = self._encoder_backwards(raw, nodes, producer, si, st.stage, base, m)
                    tail_done = True
                    if st.stage == 0:
                        pending += [(("enc_b_last", name, s), -1, None)
                                    for name, owners in self.bubbles
                                    for s in set(owners) - {0}]
                if kind.is_send:
                    # Posted at the end of the node before it, whatever the stage receives
                    # in between (the runtime issues a run of sends and receives at once).
                    key = (kind.direction, a.unit, a.stage, a.chunk, a.peer_unit,
                           a.peer_stage, a.peer_chunk, a.microbatch)
                    producer[key] = last
                    continue
                if kind.is_recv:
                    key = (kind.direction, a.peer_unit, a.peer_stage, a.peer_chunk, a.unit,
                           a.stage, a.chunk, a.microbatch)
                    # Between units the broker decides which replicas exchange: the
                    # forward edge (producer, consumer), the step, and the direction.
                    backward = kind.direction is B
                    edge = None if a.peer_unit == a.unit else (
                        ((a.unit, a.peer_unit) if backward else (a.peer_unit, a.unit)),
                        a.microbatch, backward)
                    reads.setdefault((kind.direction, a.chunk, a.microbatch), []).append(
                        (key, link_index.get((a.peer_unit, a.unit), -1), edge))
                    continue
                if kind.is_compute:
                    slot = base[u.name] + (((_ROW[kind] * u.pp + st.stage) * u.vpp + a.chunk)
                                           * m + a.microbatch)
                else:
                    slot = -1
                if hosts and st.stage == 0 and a.chunk == 0 and kind in (F, B):
                    if kind is F:   # the embeddings of the step's images are here
                        pending = pending + [(("enc_f", name, a.microbatch), -1, None)
                                             for name, owners in self.bubbles
                                             if owners[a.microbatch] != 0]
                    producer[("bb_" + kind.value, a.microbatch)] = len(raw)
                if kind is F or kind is B:
                    pending = pending + reads.pop((kind, a.chunk, a.microbatch), [])
                last = len(raw)
                raw.append(_Node(si, kind, slot, st.unit, a.microbatch, a.chunk, pending))
                nodes.append(last)
                pending = []
            if not tail_done:
                last = self._encoder_backwards(raw, nodes, producer, si, st.stage, base, m)
            pending += [d for waits in reads.values() for d in waits]
            if pending:   # receives no pass reads: a node of no duration at the end
                last = len(raw)
                raw.append(_Node(si, ActionKind.SYNC, _WAIT, st.unit, None, 0, pending))
                nodes.append(last)
            stage_nodes.append(nodes)
        return raw, producer, stage_nodes

    def _node_inputs(self, raw: list[_Node], producer: dict[tuple, int],
                     stage_nodes: list[list[int]]) -> tuple[list, list]:
        """Pass 2: each node's inputs as (node id, link); the previous node on its stage is
        an input too. The same inputs with the broker's edge of each (None: replica to
        replica)."""
        n = len(raw)
        inputs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        routed: list[list[tuple[int, int, tuple | None]]] = [[] for _ in range(n)]
        for nodes in stage_nodes:
            prev = -1
            for v in nodes:
                if prev >= 0:
                    inputs[v].append((prev, -1))
                    routed[v].append((prev, -1, None))
                for key, link, edge in raw[v].deps:
                    if key not in producer:
                        raise ScheduleError([f"a receive at node {v} has no send "
                                             "(validate the schedule first)"], self.schedule, ())
                    src = producer[key]
                    if src >= 0:
                        inputs[v].append((src, link))
                        routed[v].append((src, link, edge))
                prev = v
        return inputs, routed

    def _topological(self, inputs: list[list[tuple[int, int]]]) -> list[int]:
        """The nodes in a topological order (Kahn's); a cycle is a deadlock."""
        n = len(inputs)
        indegree = [len(x) for x in inputs]
        users: list[list[int]] = [[] for _ in range(n)]
        for v, ins in enumerate(inputs):
            for src, _ in ins:
                users[src].append(v)
        queue = deque(v for v in range(n) if indegree[v] == 0)
        order: list[int] = []
        while queue:
            v = queue.popleft()
            order.append(v)
            for w in users[v]:
                indegree[w] -= 1
                if indegree[w] == 0:
                    queue.append(w)
        if len(order) != n:
            raise ScheduleError(["deadlock: the schedule's dependencies form a cycle "
                                 "(validate it for where)"], self.schedule, ())
        return order

    def _renumber(self, order: list[int], inputs: list, raw: list[_Node]) -> dict[int, int]:
        """Renumber in topological order, splitting nodes with more than two inputs into a
        chain of joins (zero duration) so every node has exactly two; the new id of each
        node."""
        sentinel_slot = -1
        a_in: list[int] = []
        a_link: list[int] = []
        b_in: list[int] = []
        b_link: list[int] = []
        slots: list[int] = []
        new_id: dict[int, int] = {}
        for v in order:
            ins = [(new_id[src], link) for src, link in inputs[v]]
            while len(ins) > 2:
                (x, lx), (y, ly) = ins[0], ins[1]
                a_in.append(x)
                a_link.append(lx)
                b_in.append(y)
                b_link.append(ly)
                slots.append(sentinel_slot)
                ins = [(len(slots) - 1, -1)] + ins[2:]
            ins += [(-1, -1)] * (2 - len(ins))
            a_in.append(ins[0][0])
            a_link.append(ins[0][1])
            b_in.append(ins[1][0])
            b_link.append(ins[1][1])
            # Waits (_WAIT) read the zero entry, like joins.
            slots.append(max(raw[v].slot, sentinel_slot))
            new_id[v] = len(slots) - 1
        total = len(slots)
        # Index total is the sentinel: end time 0, and link -1 (no link) reads weight 0.
        self._a = [total if x < 0 else x for x in a_in]
        self._b = [total if x < 0 else x for x in b_in]
        self._a_link = np.asarray(a_link, dtype=np.intp)
        self._b_link = np.asarray(b_link, dtype=np.intp)
        self._slots = np.asarray(slots, dtype=np.intp)
        self.num_nodes = total
        self._raw = raw
        self._new_id = new_id
        return new_id

    def _index(self, raw: list[_Node], new_id: dict[int, int], stage_nodes: list[list[int]],
               base: dict[str, int], m: int) -> None:
        """Where the SYNC and OPT durations go, the compute nodes per stage (for busy
        time) and which passes each unit runs at all."""
        schedule = self.schedule
        # SYNC/OPT durations: per (unit, stage); real ones only (slot -1, not _WAIT).
        sync_nodes, opt_nodes = [], []
        for v, (si, kind, slot, unit, _, _, _) in enumerate(raw):
            if slot == -1 and kind is ActionKind.SYNC:
                sync_nodes.append((new_id[v], unit, schedule.stages[si].stage))
            elif slot == -1 and kind is ActionKind.OPT:
                opt_nodes.append((new_id[v], unit, schedule.stages[si].stage))
        self._sync_nodes = sync_nodes
        self._opt_nodes = opt_nodes
        # Compute nodes grouped per stage, for busy time.
        compute_nodes: list[int] = []
        stage_compute: dict[str, tuple[int, int]] = {}
        for si, nodes in enumerate(stage_nodes):
            lo = len(compute_nodes)
            compute_nodes += [new_id[v] for v in nodes if raw[v].slot >= 0]
            stage_compute[str(schedule.stages[si].where)] = (lo, len(compute_nodes))
        self.compute_nodes = np.asarray(compute_nodes, dtype=np.intp)
        # Per unit, which (pass, stage, chunk, microbatch) the schedule runs at all.
        used = np.zeros(self._num_compute, dtype=bool)
        used[[node.slot for node in raw if node.slot >= 0]] = True
        self.compute_used = {
            name: used[base[name]:base[name] + _ROWS * pp * vpp * m].reshape(_ROWS, pp, vpp, m)
            for name, pp, vpp, _ in self._dims}
        self.stage_compute = stage_compute
        self._stage_nodes = stage_nodes

    def _lanes(self, order: list[int], raw: list[_Node], routed: list,
               new_id: dict[int, int], base: dict[str, int]) -> None:
        """Per replica: the nodes in topological order with their inputs (by position in
        that order), their unit's replica count, where their durations are and whether
        they are a collective over the replicas (SYNC)."""
        schedule = self.schedule
        self.replicated = any(u.dp > 1 for u in schedule.units)
        position = {v: k for k, v in enumerate(order)}
        unit_index = {name: k for k, (name, _, _, _) in enumerate(self._dims)}
        lanes: list[tuple] = []
        for v in order:
            si, kind, slot, unit, _, _, _ = raw[v]
            dp = self._dims[unit_index[unit]][3]
            ins = tuple((position[src], link, edge) for src, link, edge in routed[v])
            local = slot - base[unit] if slot >= 0 else slot
            lanes.append((ins, dp, unit_index[unit], local, new_id[v],
                          slot == -1 and kind is ActionKind.SYNC))
        self._lane_nodes = lanes

    def _encoder_backwards(self, raw: list, nodes: list[int], producer: dict, si: int,
                           stage: int, base: dict[str, int], m: int) -> int:
        """Append stage ``stage``'s encoder backwards (module docstring) to its nodes;
        returns the last node (-1 without one)."""
        last = nodes[-1] if nodes else -1
        for name, owners in self.bubbles:
            mine = [j for j, s in enumerate(owners) if s == stage]
            for k, j in enumerate(mine):
                deps = []
                if k == 0 and stage > 0:
                    # The gradients of all its steps come in one message after the first
                    # stage's backward of the last of them (on stage 1 also after the
                    # first stage's last forward, which goes to the same rank first).
                    deps.append((("bb_B", mine[-1]), -1, None))
                    if stage == 1:
                        deps.append((("bb_F", m - 1), -1, None))
                last = len(raw)
                raw.append(_Node(si, B, base[name] + m + j, name, j, 0, deps))
                nodes.append(last)
            if mine:
                producer[("enc_b_last", name, stage)] = last
        return last

    # ---- running ----------------------------------------------------------------------------

    def passes(self, durations: Durations, name: str) -> np.ndarray:
        """Unit ``name``'s seconds per pass, shape (3, pp, vpp, M, dp): forward, backward
        and weight gradients, the backward less its ``weight_s`` where the schedule runs
        that backward's ``W`` (``Durations``)."""
        m = self.schedule.num_microbatches
        pp, vpp, dp = next((p, v, d) for n, p, v, d in self._dims if n == name)
        arr = np.asarray(durations.compute_s[name], dtype=float)
        want = (2, pp, vpp, m, dp)
        if arr.shape != want:
            raise ValueError(f"compute_s[{name!r}] has shape {arr.shape}, expected "
                             f"{want} (pass, stage, chunk, microbatch, replica)")
        out = np.zeros((_ROWS, *want[1:]))
        out[:2] = arr
        split = self.compute_used[name][_WGT]
        if name in durations.weight_s and split.any():
            w = np.asarray(durations.weight_s[name], dtype=float)
            if w.shape != want[1:]:
                raise ValueError(f"weight_s[{name!r}] has shape {w.shape}, expected "
                                 f"{want[1:]} (stage, chunk, microbatch, replica)")
            if np.any(w > arr[_BWD] * (1 + 1e-9)):
                raise ValueError(f"weight_s[{name!r}] exceeds the backward it is part of")
            out[_WGT] = np.where(split[..., None], w, 0.0)
            out[_BWD] = arr[_BWD] - out[_WGT]
        return out

    def _flat_durations(self, durations: Durations) -> tuple[np.ndarray, np.ndarray]:
        """Per flat compute slot: the slowest replica's seconds; per link: seconds."""
        flat = np.zeros(self._num_compute + 1)   # last entry: slot -1 reads 0
        for name, _, _, _ in self._dims:
            arr = self.passes(durations, name)
            lo = self._compute_base[name]
            flat[lo:lo + arr[..., 0].size] = arr.max(axis=-1).ravel()
        if not np.all(np.isfinite(flat)) or flat.min() < 0:
            raise ValueError("durations must be finite and non-negative")
        links = np.zeros(len(self._links) + 1)   # last entry: "no link"
        for i, key in enumerate(self._links):
            links[i] = float(durations.link_s.get(key, 0.0))
        return flat, links

    def variant(self, bubbles: tuple[tuple[str, tuple[int, ...]], ...]) -> Simulator:
        """This schedule compiled with phased encoders at ``bubbles`` (cached)."""
        bubbles = tuple((name, tuple(owners)) for name, owners in bubbles)
        if bubbles == self.bubbles:
            return self
        if bubbles not in self._variants:
            self._variants[bubbles] = Simulator(self.schedule, bubbles)
        return self._variants[bubbles]

    def run(self, durations: Durations) -> SimResult:
        """Simulate one iteration with ``durations``."""
        if tuple(durations.bubbles) != self.bubbles:
            return self.variant(durations.bubbles).run(durations)
        flat, links = self._flat_durations(durations)
        dur = flat[self._slots]
        for node, unit, stage in self._sync_nodes:
            if unit in durations.sync_s:
                dur[node] = float(np.asarray(durations.sync_s[unit])[stage])
        for node, unit, stage in self._opt_nodes:
            if unit in durations.opt_s:
                dur[node] = float(np.asarray(durations.opt_s[unit])[stage])
        if self.replicated or durations.routes:
            return self._run_replicas(durations, dur, links)
        wa = links[self._a_link].tolist()
        wb = links[self._b_link].tolist()
        d = dur.tolist()
        n = self.num_nodes
        end = [0.0] * (n + 1)
        # The hot loop: plain floats and lists, zipped (numpy scalars or indexing every list
        # would be several times slower).
        i = 0
        for ai, wai, bi, wbi, di in zip(self._a, wa, self._b, wb, d, strict=True):
            s = end[ai] + wai
            t = end[bi] + wbi
            end[i] = (s if s > t else t) + di
            i += 1
        end_arr = np.asarray(end[:n])
        return SimResult(simulator=self, durations=durations, start_s=end_arr - dur,
                         end_s=end_arr, node_s=dur,
                         iteration_time_s=float(end_arr.max(initial=0.0)))

    def _feeders(self, durations: Durations) -> Callable[[tuple], list | None]:
        """Per broker edge, step and direction: for each receiving replica, the sending
        replicas it waits for (None: all of them)."""
        m = self.schedule.num_microbatches
        dps = {u.name: u.dp for u in self.schedule.units}
        routes = {}
        for (a, b), mask in durations.routes.items():
            mask = np.asarray(mask, dtype=bool)
            want = (m, dps.get(a, -1), dps.get(b, -1))
            if mask.shape != want:
                raise ValueError(f"routes[{(a, b)!r}] has shape {mask.shape}, expected {want} "
                                 "(microbatch, producer replica, consumer replica)")
            routes[(a, b)] = mask
        cache: dict[tuple, list | None] = {}

        def feeders(key: tuple) -> list | None:
            if key not in cache:
                edge, j, backward = key
                mask = routes.get(edge)
                if mask is None:
                    cache[key] = None
                else:
                    pairs = mask[j] if backward else mask[j].T    # (receiver, sender)
                    cache[key] = [np.flatnonzero(row).tolist() for row in pairs]
            return cache[key]

        return feeders

    def _run_replicas(self, durations: Durations, dur: np.ndarray,
                      links: np.ndarray) -> SimResult:
        """The iteration replica by replica (see the module docstring)."""
        per_unit = [self.passes(durations, name).reshape(-1, dp).tolist()
                    for name, _, _, dp in self._dims]
        link = links.tolist()
        feeders = self._feeders(durations)
        tail = dur.tolist()
        starts: list[list[float]] = []
        ends: list[list[float]] = []
        for ins, dp, ui, local, node, barrier in self._lane_nodes:
            cur = [0.0] * dp
            for src, li, edge in ins:
                e, w = ends[src], link[li]
                if edge is None:
                    cur = [c if c > x + w else x + w for c, x in zip(cur, e, strict=True)]
                    continue
                fed = feeders(edge)
                if fed is None:
                    t = max(e) + w
                    cur = [c if c > t else t for c in cur]
                else:
                    cur = [max(c, max(e[q] for q in qs) + w) if qs else c
                           for c, qs in zip(cur, fed, strict=True)]
            if barrier:
                cur = [max(cur)] * dp
            if local >= 0:
                end = [c + x for c, x in zip(cur, per_unit[ui][local], strict=True)]
            else:
                d = tail[node]
                end = [c + d for c in cur]
            starts.append(cur)
            ends.append(end)
        n = self.num_nodes
        width = max(dp for _, _, _, dp in self._dims)
        replica_start = np.full((n, width), np.nan)
        start_arr = np.zeros(n)
        end_arr = np.zeros(n)
        for (_, dp, _, _, node, _), s, e in zip(self._lane_nodes, starts, ends, strict=True):
            replica_start[node, :dp] = s
            start_arr[node] = min(s)
            end_arr[node] = max(e)
        return SimResult(simulator=self, durations=durations, start_s=start_arr,
                         end_s=end_arr, node_s=dur, replica_start_s=replica_start,
                         iteration_time_s=float(end_arr.max(initial=0.0)))

    # ---- timelines --------------------------------------------------------------------------

    def timeline(self, result: SimResult, *, step: int = 0) -> Timeline:
        schedule = self.schedule
        m = schedule.num_microbatches
        tunits = tuple(TimelineUnit(name=u.name, role=u.role, pp=u.pp, dp=u.dp, tp=u.tp,
                                    first_rank=u.first_rank) for u in schedule.units)
        by_name = {u.name: u for u in tunits}
        compute = {name: self.passes(result.durations, name) for name, _, _, _ in self._dims}
        start = result.start_s.tolist()
        events: list[Event] = []
        encoders = {name for name, _ in self.bubbles}
        for v, (si, kind, slot, unit, j, c, _) in enumerate(self._raw):
            if slot == _WAIT:
                continue
            node = self._new_id[v]
            stage = schedule.stages[si].stage
            if unit in encoders:
                # A phased encoder's pass: an event of its backbone stage's own row with
                # no microbatch (as the executor measures it).
                tu = by_name[schedule.stages[si].unit]
                ranks = [tu.rank(stage, r) for r in range(tu.dp)]
                t0 = [start[node]] * tu.dp if result.replica_start_s is None else \
                    result.replica_start_s[node, :tu.dp].tolist()
                d = compute[unit][0 if kind is F else 1, 0, 0, j].tolist()
                events += [Event(unit=tu.name, stage=stage, replica=r, rank=ranks[r],
                                 kind=str(kind), microbatch=None, start_s=t0[r],
                                 end_s=t0[r] + d[r]) for r in range(tu.dp)]
                continue
            tu = by_name[unit]
            ranks = [tu.rank(stage, r) for r in range(tu.dp)]
            t0 = [start[node]] * tu.dp if result.replica_start_s is None else \
                result.replica_start_s[node, :tu.dp].tolist()
            name = str(kind)
            if slot >= 0:
                d = compute[unit][_ROW[kind], stage, c, j].tolist()
                events += [Event(unit=unit, stage=stage, replica=r, rank=ranks[r], kind=name,
                                 microbatch=j, chunk=c, start_s=t0[r], end_s=t0[r] + d[r])
                           for r in range(tu.dp)]
            else:
                d = float(result.node_s[node])
                events += [Event(unit=unit, stage=stage, replica=r, rank=ranks[r], kind=name,
                                 microbatch=None, start_s=t0[r], end_s=t0[r] + d)
                           for r in range(tu.dp)]
        return Timeline(source="predicted", num_microbatches=m, units=tunits,
                        events=tuple(events), step=step)


def simulate(schedule: Schedule, durations: Durations) -> SimResult:
    """Compile ``schedule`` and simulate one iteration (use ``Simulator`` to run many)."""
    return Simulator(schedule).run(durations)
