"""From a global batch of real (or drawn) samples to the durations of one iteration.

1. ``sample_work``: each sample's forward work per unit, relative to the mean over the
   cost model's own samples (so the expected durations are exactly the planner's): an
   encoder's work grows with its items' patches (linear layers) and their squares
   (attention), a generator's with how many items it generates, the backbone's with
   its sequence's length (a microbatch padded to its longest: ``Routing.padded_loads``).
2. ``route``: which microbatch step and which DP replica of every unit each sample goes
   to, under a reorder policy. Without reordering, samples go in data order (backbone
   replica r takes the r-th contiguous slice of the batch, in microbatches of
   ``micro_batch``; another unit's replicas split each step's samples contiguously).
   ``intra`` balances every unit's replicas per step (``dtdsl.reorder.intra.balance``: a
   deterministic function of the costs, so units agree without talking); ``inter``
   orders the steps for 1F1B by their encoder cost (``dtdsl.reorder.inter.best_order``).
3. ``phase_times``, ``pipeline_times``, ``imbalance``: what the routed work costs each
   unit's stages (``sim.workload.iteration_durations`` turns it into the simulator's
   durations).

Shared by the simulator, the planner, the runtime's routing (``data.batch.route_batch``)
and the preprocessing workers, so predicted and measured runs route alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.model import CostModel
from dtdsl.cost.samples import (
    SampleSet,
    attention_squares,
    draw_samples,
    item_key,
    microbatch_lengths,
    microbatch_squares,
    positions,
)
from dtdsl.ir.plan import Plan
from dtdsl.reorder.split import BubbleFit, bubble_exposure, bubble_owners, contiguous_split

__all__ = ["POLICIES", "Routing", "WorkModel", "batch_samples", "imbalance", "model_flops",
           "parse_policy", "phase_fit", "phase_times", "pipeline_times", "reordered",
           "route", "sample_work"]

POLICIES = ("none", "intra", "inter", "both")


def parse_policy(policy: str | Iterable[str]) -> frozenset[str]:
    """``none``/``intra``/``inter``/``both`` (or the spec's list) as a set of policies."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"reorder policy {policy!r}; one of {', '.join(POLICIES)}")
        return frozenset() if policy == "none" else \
            frozenset({"intra", "inter"}) if policy == "both" else frozenset({policy})
    return frozenset(policy)


def batch_samples(program, step: int, num_samples: int | None = None) -> SampleSet:
    """The samples of global batch ``step``, drawn from the spec's data distribution
    (seeded by the spec's seed and the step, so every run sees the same batches)."""
    n = num_samples or program.train.global_batch
    return draw_samples(program, n, seed=program.train.seed * 1_000_003 + step + 1)


def _raw_work(cost: CostModel, samples: SampleSet, *, timed: bool) -> dict[str, np.ndarray]:
    program = cost.program
    eff = cost.params.efficiency
    out: dict[str, np.ndarray] = {}
    for module in program.modules:
        if module.role == "backbone":
            out[module.name] = _backbone_work(cost, module, positions(samples),
                                              attention_squares(samples), timed=timed)
        elif module.role == "encoder":
            items = samples.items[item_key(program, module)]
            p = flops.encoder_tokens(module.arch, items.sizes.astype(float))
            per_token = flops.encoder_item_forward(module.arch, 1.0)
            linear, quadratic = per_token.matmul, per_token.attention
            if timed:   # time, not FLOPs: attention runs at a lower efficiency than matmuls
                linear, quadratic = linear / eff.matmul, quadratic / eff.attention
            out[module.name] = items.per_sample(linear * p + quadratic * p * p)
        else:
            out[module.name] = samples.items[f"{module.modality}.gen"].counts.astype(float)
    return out


def _backbone_work(cost: CostModel, module, lengths: np.ndarray, squares: np.ndarray, *,
                   timed: bool) -> np.ndarray:
    """The backbone's forward work on sequences of ``lengths`` whose documents' lengths
    squared add up to ``squares`` (attention per document, ``flops.backbone_attention``;
    in time units when ``timed``: each kind of work at its efficiency)."""
    w = flops.backbone_forward(module.arch, np.asarray(lengths, dtype=float),
                               np.asarray(squares, dtype=float))
    if not timed:
        return np.asarray(w.total, dtype=float)
    eff = cost.params.efficiency
    return np.asarray(w.matmul / eff.matmul + w.attention / eff.attention, dtype=float)


class WorkModel:
    """Relative per-sample work of a cost model's units: the reference means are taken
    once, over the cost model's own samples. The backbone's time is relative to its mean
    per sample in a microbatch padded to its longest sequence, as the cost model prices it
    (``Routing.padded_loads``); its FLOPs to their mean per sample."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        reference = cost.drawn()
        self._means = {timed: {name: float(v.mean()) for name, v in
                               _raw_work(cost, reference, timed=timed).items()}
                       for timed in (True, False)}
        program = cost.program
        mb = program.train.micro_batch
        padded = microbatch_lengths(positions(reference), mb)
        squares = microbatch_squares(reference, mb, packed=program.train.packing)
        self._means[True][program.backbone.name] = float(
            _backbone_work(cost, program.backbone, padded, squares, timed=True).mean())

    def relative(self, samples: SampleSet, *, timed: bool = True) -> dict[str, np.ndarray]:
        """Per unit, each sample's forward work relative to the mean over the cost
        model's samples (1.0 on average under the spec's distribution): in time when
        ``timed`` (each kind of work at its efficiency), else in FLOPs (for MFU)."""
        means = self._means[timed]
        out = {}
        for name, values in _raw_work(self.cost, samples, timed=timed).items():
            mean = means[name]
            out[name] = values / mean if mean > 0 else np.zeros_like(values)
        return out


def sample_work(cost: CostModel, samples: SampleSet, *, timed: bool = True
                ) -> dict[str, np.ndarray]:
    """``WorkModel(cost).relative(samples)`` (use a WorkModel for many batches)."""
    return WorkModel(cost).relative(samples, timed=timed)


@dataclass(frozen=True)
class Routing:
    """Where each sample of a global batch goes: its microbatch step (execution order)
    and, per unit, its DP replica."""

    num_microbatches: int
    step: np.ndarray                  # (B,)
    replica: dict[str, np.ndarray]    # unit -> (B,)
    # Phased encoders, whose replica follows the step (``_phase_shares``): (encoder,
    # backbone, backbone dp, the stage that encodes each step), kept by ``reordered``.
    phased: tuple[tuple[str, str, int, tuple[int, ...]], ...] = ()

    def loads(self, unit: str, costs: np.ndarray, dp: int) -> np.ndarray:
        """(steps, dp): the summed ``costs`` of each replica's samples per step."""
        flat = self.step * dp + self.replica[unit]
        return np.bincount(flat, weights=costs,
                           minlength=self.num_microbatches * dp).reshape(-1, dp)

    def padded_loads(self, unit: str, costs: np.ndarray, dp: int) -> np.ndarray:
        """(steps, dp): each replica's samples per step times the largest of their
        ``costs``: a microbatch padded to its longest sequence (the backbone)."""
        flat = self.step * dp + self.replica[unit]
        size = self.num_microbatches * dp
        count = np.bincount(flat, minlength=size)
        largest = np.zeros(size)
        np.maximum.at(largest, flat, np.asarray(costs, dtype=float))
        return (count * largest).reshape(-1, dp)

    def pairs(self, producer: str, producer_dp: int, consumer: str,
              consumer_dp: int) -> np.ndarray:
        """(steps, producer dp, consumer dp): whether a sample of the step goes from that
        producer replica to that consumer replica (the broker's routes)."""
        out = np.zeros((self.num_microbatches, producer_dp, consumer_dp), dtype=bool)
        out[self.step, self.replica[producer], self.replica[consumer]] = True
        return out


def route(plan: Plan, work: dict[str, np.ndarray], policy: frozenset[str], *,
          search: bool = True) -> Routing:
    """Route a global batch (``work``: per unit, relative work per sample) per ``plan``
    under ``policy`` (a subset of {"intra", "inter"}): the one rule the simulator and the
    workers that feed a run apply (``dtdsl.data.batch.route_batch``), a deterministic
    function of the plan and the costs.

    - none: data order. Backbone replica r takes the r-th contiguous slice of the batch,
      in microbatches of ``micro_batch``; another unit's replicas split each step's
      samples contiguously.
    - ``inter``: samples of similar work share a microbatch step (the batch sorted by a
      sample's work, each step the next ``dp * micro_batch``: by the backbone's work, by
      its slowest stage's, or kept in data order, whichever the pipeline model finds
      fastest), and the steps are ordered for 1F1B by the whole pipeline's stage times
      (``dtdsl.reorder.pipeline`` on ``pipeline_times``).
    - ``intra``: within each step, a backbone microbatch takes samples of similar length
      (less padding), the microbatches go to the backbone's replicas by their whole
      pipeline's work (the heaviest to the replica with the least so far), and every
      other unit's replicas are balanced on that unit's work
      (``dtdsl.reorder.intra.balance``).

    Samples move only within the batch, each exactly once.

    ``search`` off: the planner's quick estimate of the same rule (``sim.estimate``): the
    best grouping with its best candidate order, balanced by greedy alone, without the
    local searches that cost the workers' routing most of its time."""
    n = next(iter(work.values())).shape[0]
    if n != plan.global_batch:
        raise ValueError(f"{n} samples for a global batch of {plan.global_batch}")
    unknown = set(policy) - {"intra", "inter"}
    if unknown:
        raise ValueError(f"reorder policy {sorted(unknown)}: give a subset of intra, inter")
    costs = _SampleCosts(plan, work)
    intra = "intra" in policy
    budget = None if search else 0.0
    if "inter" not in policy:
        return _routed(plan, costs, _data_order_steps(plan), intra, grouped=False,
                       balance_budget=budget)
    from dtdsl.reorder.pipeline import OrderSearch

    # Each grouping (its other units balanced by greedy alone) with its best candidate
    # order; the winner is balanced in full and its order searched locally (each costs
    # far more than a candidate).
    best = None
    for grouped, steps in _groupings(plan, costs):
        routing = _routed(plan, costs, steps, intra, grouped=grouped, balance_budget=0.0)
        order, t = OrderSearch(*pipeline_times(plan, routing, work)).best_candidate()
        if best is None or t < best[0]:
            best = (t, grouped, steps, routing, order)
    _, grouped, steps, routing, order = best
    if search:
        routing = _routed(plan, costs, steps, intra, grouped=grouped)
        order, _ = OrderSearch(*pipeline_times(plan, routing, work)).best()
    return reordered(routing, order)


def reordered(routing: Routing, order) -> Routing:
    """``routing`` with its steps run in ``order`` (``order[k]``: the step that runs k-th)."""
    position = np.empty(len(order), dtype=np.intp)
    position[np.asarray(order)] = np.arange(len(order))
    step = position[routing.step]
    replica = dict(routing.replica)
    for name, backbone, dp, owners in routing.phased:
        # The stage that encodes a step is the step's place's (``phase_fit``).
        replica[name] = _phase_shares(replica[backbone], step, owners, dp)
    return Routing(num_microbatches=routing.num_microbatches, step=step, replica=replica,
                   phased=routing.phased)


class _SampleCosts:
    """Per unit and sample, the seconds a step of copies of the sample takes on the unit's
    slowest stage (forward and backward): ``work`` times the plan's time of an average
    microbatch there."""

    def __init__(self, plan: Plan, work: dict[str, np.ndarray]) -> None:
        self.plan = plan
        self.backbone = next(u for u in plan.units if u.role == "backbone")
        self.stage = {u.name: np.asarray(work[u.name], dtype=float) *
                      (u.fwd_time_s + u.bwd_time_s) for u in plan.units}
        self._others: np.ndarray | None = None

    def pipeline(self, batches: np.ndarray) -> np.ndarray:
        """The whole pipeline's seconds of each backbone microbatch (rows of ``batches``:
        sample indices) over every unit's stages, the backbone's padded to its longest."""
        bb = self.backbone
        if self._others is None:
            self._others = sum((self.stage[u.name] * u.pp for u in self.plan.units
                                if u.name != bb.name and not u.phased),
                               np.zeros(len(self.stage[bb.name])))
        longest = self.stage[bb.name][batches].max(axis=1)
        return batches.shape[1] * longest * bb.pp + self._others[batches].sum(axis=1)

    def keys(self) -> list[np.ndarray]:
        """What ``inter`` sorts samples by: the backbone's work, the slowest stage's."""
        return [self.stage[self.backbone.name],
                np.max(list(self.stage.values()), axis=0)]


def _data_order_steps(plan: Plan) -> np.ndarray:
    m, mb = plan.num_microbatches, plan.micro_batch
    return (np.arange(plan.global_batch) % (m * mb)) // mb


def _groupings(plan: Plan, costs: _SampleCosts) -> list[tuple[bool, np.ndarray]]:
    """(grouped, each sample's step) of every grouping ``inter`` tries: data order, and the
    batch sorted by each key (ties by position) cut into steps of dp * micro_batch."""
    n = plan.global_batch
    per_step = n // plan.num_microbatches
    out = [(False, _data_order_steps(plan))]
    for key in costs.keys():
        step = np.empty(n, dtype=np.intp)
        step[np.argsort(key, kind="stable")] = np.arange(n) // per_step
        if not any(np.array_equal(step, s) for _, s in out[1:]):
            out.append((True, step))
    return out


def _routed(plan: Plan, costs: _SampleCosts, step: np.ndarray, intra: bool, *,
            grouped: bool, balance_budget: float | None = None) -> Routing:
    """Every unit's replica per sample for the steps ``step`` (see ``route``;
    ``balance_budget``: ``intra.balance``'s work per step and unit, default
    ``_BALANCE_BUDGET``)."""
    m, mb = plan.num_microbatches, plan.micro_batch
    bb = costs.backbone
    members_of = [np.flatnonzero(step == j) for j in range(m)]
    r = np.empty(len(step), dtype=np.intp)
    total = np.zeros(bb.dp)         # each backbone replica's pipeline seconds so far
    length = costs.stage[bb.name]
    for members in members_of:
        if not (intra or grouped):
            r[members] = members // (m * mb)
            continue
        # A microbatch of samples of similar length pads least.
        batches = members[np.argsort(length[members], kind="stable")].reshape(bb.dp, mb)
        if not intra:
            r[batches] = np.arange(bb.dp)[:, None]
            continue
        # The heaviest microbatch to the replica with the least work so far: a replica
        # given the heaviest every step would fall behind the others for good.
        load = costs.pipeline(batches)
        target = np.empty(bb.dp, dtype=np.intp)
        target[np.argsort(-load, kind="stable")] = np.argsort(total, kind="stable")
        r[batches] = target[:, None]
        total[target] += load
    replica = {bb.name: r}
    owners = phase_fit(plan).owners if any(u.phased for u in plan.units) else ()
    for u in plan.units:
        if u.phased:
            replica[u.name] = _phase_shares(r, step, owners, bb.dp)
        elif u.name != bb.name:
            # One pipeline per replica in a rigid plan, and a co-located unit runs on its
            # host stage's replicas: a sample stays on its backbone replica's.
            replica[u.name] = r if plan.rigid or u.colocated else _split(
                members_of, costs.stage[u.name], u.dp, intra,
                _BALANCE_BUDGET if balance_budget is None else balance_budget)
    phased = tuple((u.name, bb.name, bb.dp, owners) for u in plan.units if u.phased)
    return Routing(num_microbatches=m, step=step, replica=replica, phased=phased)


def _phase_shares(backbone: np.ndarray, step: np.ndarray, owners: tuple[int, ...],
                  dp: int) -> np.ndarray:
    """A phased encoder's replica per sample: a sample of backbone replica r in
    microbatch step j is encoded by the ranks of pipeline stage ``owners[j]`` of replica r
    (``phase_fit``), the encoder's replica owners[j] * dp + r (``UnitPlan.phased``)."""
    return np.asarray(owners, dtype=np.intp)[step] * dp + backbone


def _stage_seconds(plan: Plan) -> tuple[list[float], list[float]]:
    """The backbone's stages' forward and backward seconds of a mean microbatch, the
    co-located encoders' on its first stage and generators' on its last."""
    bb = next(u for u in plan.units if u.role == "backbone")
    layers = np.asarray(bb.layers_per_stage, dtype=float)
    scale = layers / layers.max()
    fwd, bwd = (bb.fwd_time_s * scale).tolist(), (bb.bwd_time_s * scale).tolist()
    for u in plan.units:
        if u.colocated:
            at = 0 if u.role == "encoder" else -1
            fwd[at] += u.fwd_time_s / u.microbatch_share
            bwd[at] += u.bwd_time_s / u.microbatch_share
    return fwd, bwd


def phase_fit(plan: Plan) -> BubbleFit:
    """Where the plan's phased encoders run (``reorder.split.bubble_owners``): per
    microbatch step, the backbone stage whose ranks encode its images, in 1F1B's bubbles
    where they fit, at mean work (the planner's ``Colocation`` prices the same). Every
    phased encoder of a step on the same stage, one after another. A function of the
    plan alone: the simulator, the routing and so every rank agree."""
    phased = [u for u in plan.units if u.phased]
    if not phased:
        raise ValueError("the plan runs no encoder phased")
    fwd, bwd = _stage_seconds(plan)
    ef = sum(u.fwd_time_s / u.microbatch_share for u in phased)
    eb = sum(u.bwd_time_s / u.microbatch_share for u in phased)
    return bubble_owners(fwd, bwd, plan.num_microbatches, ef, eb)


# Work of ``intra.balance`` per step and unit (its units: about a microsecond each): a
# step's few samples rarely need more, and a batch must route in a fraction of a second
# (the planner routes several per layout it scores).
_BALANCE_BUDGET = 500.0


def _split(members_of: list[np.ndarray], costs: np.ndarray, dp: int, intra: bool,
           budget: float) -> np.ndarray:
    """A non-backbone unit's replica per sample, step by step: balanced on ``costs``
    (``intra``: greedy for every step at once, ``intra.balance`` where greedy is above the
    simple bound), else the step's samples cut into contiguous runs."""
    from dtdsl.reorder.intra import balance

    out = np.empty(len(costs), dtype=np.intp)
    if not intra or dp == 1:
        for members in members_of:
            out[members] = contiguous_split(len(members), dp)
        return out
    members = np.array(members_of)                       # (steps, samples per step)
    mine = costs[members]
    groups, loads = _greedy_rows(mine, dp)
    k = members.shape[1]
    ascending = np.sort(mine, axis=1)
    others = max(k // dp - 1, 0)
    bound = np.maximum(mine.sum(axis=1) / dp,
                       ascending[:, -1] + ascending[:, :others].sum(axis=1))
    if budget > 0:
        for j in np.flatnonzero(loads.max(axis=1) > bound * (1 + 1e-5)):
            groups[j] = balance(mine[j], dp, work_budget=budget)
    total = np.zeros(dp)       # each replica's work so far
    for j in range(len(members)):
        # The step's heaviest group to the replica with the least work so far.
        load = np.bincount(groups[j], weights=mine[j], minlength=dp)
        relabel = np.empty(dp, dtype=np.intp)
        relabel[np.argsort(-load, kind="stable")] = np.argsort(total, kind="stable")
        out[members[j]] = relabel[groups[j]]
        total += load[np.argsort(relabel)]
    return out


def _greedy_rows(costs: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """``intra.greedy_lpt`` on every row of ``costs`` at once: (group per sample, load per
    group). Largest first (ties by index), each to the least-loaded group with room
    (ties: the lower index); the first k % dp groups take one sample more."""
    rows, k = costs.shape
    base, extra = divmod(k, dp)
    room = np.full((rows, dp), base) + (np.arange(dp) < extra)
    load = np.zeros((rows, dp))
    groups = np.empty((rows, k), dtype=np.intp)
    order = np.argsort(-costs, axis=1, kind="stable")
    at = np.arange(rows)
    for c in range(k):
        item = order[:, c]
        g = np.argmin(np.where(room > 0, load, np.inf), axis=1)
        groups[at, item] = g
        load[at, g] += costs[at, item]
        room[at, g] -= 1
    return groups, load


def _per_sample_seconds(plan: Plan) -> dict[str, tuple[float, float]]:
    """Forward and backward seconds of one average sample on each unit's heaviest stage."""
    out = {}
    for u in plan.units:
        samples = u.microbatch_share * plan.micro_batch
        out[u.name] = (u.fwd_time_s / samples, u.bwd_time_s / samples)
    return out


def _phase_steps(plan: Plan, routing: Routing, work: dict[str, np.ndarray]
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per phased encoder: (steps, backbone dp) forward and backward seconds of each
    microbatch step's images of each backbone replica, on the stage that encodes them
    (``phase_fit``; hand-off included, the backward with its recomputed forward)."""
    bb = next(u for u in plan.units if u.role == "backbone")
    seconds = _per_sample_seconds(plan)
    out = {}
    for u in plan.units:
        if not u.phased:
            continue
        f, b = seconds[u.name]
        loads = routing.loads(u.name, work[u.name], u.dp)                # (steps, dp x pp)
        per_step = loads.reshape(len(loads), bb.pp, bb.dp).sum(axis=1)    # (steps, dp)
        out[u.name] = (f * per_step, b * per_step)
    return out


def phase_times(plan: Plan, routing: Routing, work: dict[str, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(backbone dp,) seconds the phased encoders add to each backbone replica's step
    before the pipeline's work and after it, as ``reorder.split.bubble_exposure``
    estimates it for the batch's own encoder work at ``phase_fit``'s owners (what does
    not fit in the bubbles); zeros without a phased encoder. The simulator places the
    same work as events (``iteration_durations``); this is the drawn-batch estimate's."""
    bb = next(u for u in plan.units if u.role == "backbone")
    fwd, bwd = np.zeros(bb.dp), np.zeros(bb.dp)
    steps = _phase_steps(plan, routing, work)
    if not steps:
        return fwd, bwd
    owners = phase_fit(plan).owners
    stage_f, stage_b = _stage_seconds(plan)
    ef = sum(f for f, _ in steps.values())
    eb = sum(b for _, b in steps.values())
    for r in range(bb.dp):
        fwd[r], bwd[r] = bubble_exposure(stage_f, stage_b, owners, ef[:, r].tolist(),
                                         eb[:, r].tolist())
    return fwd, bwd


def pipeline_times(plan: Plan, routing: Routing, work: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(stages, steps) forward and backward seconds of the plan's pipeline as one chain,
    per microbatch step (its slowest replica): the encoders' stages (side-by-side
    encoders as one, a shallower one ending with the deepest), the backbone's (a
    co-located encoder on its first, a co-located generator on its last), the
    generators'. What ``inter`` orders the steps by."""
    seconds = _per_sample_seconds(plan)
    m = routing.num_microbatches

    def stages(u) -> tuple[np.ndarray, np.ndarray]:
        load = _loads(routing, u, work).max(axis=1)                  # (steps,)
        layers = np.asarray(u.layers_per_stage, dtype=float)
        scale = (layers / layers.max())[:, None]
        f, b = seconds[u.name]
        return f * scale * load, b * scale * load

    bb = next(u for u in plan.units if u.role == "backbone")
    fwd, bwd = stages(bb)
    chain_f, chain_b = [], []
    for role in ("encoder", "generator"):
        units = [u for u in plan.units if u.role == role and not u.phased]
        depth = max((u.pp for u in units if not u.colocated), default=0)
        f_sec, b_sec = np.zeros((depth, m)), np.zeros((depth, m))
        for u in units:
            f, b = stages(u)
            if u.colocated:
                at = 0 if role == "encoder" else -1
                fwd[at] += f[0]
                bwd[at] += b[0]
                continue
            at = depth - u.pp if role == "encoder" else 0
            np.maximum(f_sec[at:at + u.pp], f, out=f_sec[at:at + u.pp])
            np.maximum(b_sec[at:at + u.pp], b, out=b_sec[at:at + u.pp])
        chain_f.append(f_sec)
        chain_b.append(b_sec)
    return (np.concatenate([chain_f[0], fwd, chain_f[1]]),
            np.concatenate([chain_b[0], bwd, chain_b[1]]))


def _loads(routing: Routing, unit, work: dict[str, np.ndarray]) -> np.ndarray:
    """(steps, dp): a unit's work per replica and step; the backbone pads a microbatch to
    its longest sequence, or (``UnitPlan.padding``) every sequence to seq_len."""
    if unit.role == "backbone":
        if unit.padding == "seq_len":
            return _seq_len_loads(routing, unit)
        return routing.padded_loads(unit.name, work[unit.name], unit.dp)
    return routing.loads(unit.name, work[unit.name], unit.dp)


def _seq_len_loads(routing: Routing, unit) -> np.ndarray:
    """A backbone whose every sequence is padded to seq_len (a Megatron-LM baseline under
    pipeline parallelism): each sample costs what the plan priced, one sample of a
    microbatch of seq_len sequences, whatever its length; a replica's load is its count."""
    flat = routing.step * unit.dp + routing.replica[unit.name]
    count = np.bincount(flat, minlength=routing.num_microbatches * unit.dp)
    return count.astype(float).reshape(-1, unit.dp)


def imbalance(plan: Plan, routing: Routing, work: dict[str, np.ndarray]) -> float:
    """How much longer the slowest replica works than the average one, over the
    iteration: per unit the sum over steps of the largest replica load over the sum of
    the mean ones; the worst unit (1.0: perfectly balanced)."""
    worst = 1.0
    for u in plan.units:
        if u.dp < 2:
            continue
        loads = _loads(routing, u, work)
        mean = loads.mean(axis=1).sum()
        if mean > 0:
            worst = max(worst, float(loads.max(axis=1).sum() / mean))
    return worst


def model_flops(plan: Plan, cost: CostModel, work: dict[str, np.ndarray]) -> float:
    """The model FLOPs of this batch: the plan's expectation scaled, per unit, by the
    batch's mean work (``work`` in FLOPs: ``relative(..., timed=False)``)."""
    total = 0.0
    for u in cost.units:
        total += u.model_flops * float(work[u.name].mean())
    return total * cost.program.train.num_microbatches
