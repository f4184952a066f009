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
3. ``iteration_durations``: per pass, stage, chunk, step and replica, seconds: the plan's
   per-microbatch times scaled by the work routed there; transfers and gradient sync
   from the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.model import CostModel
from dtdsl.cost.samples import (
    SampleSet,
    attention_squares,
    draw_samples,
    microbatch_lengths,
    microbatch_squares,
    positions,
)
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import Schedule
from dtdsl.reorder.split import contiguous_split
from dtdsl.sim.simulate import Durations

__all__ = ["POLICIES", "Routing", "StepTimes", "batch_samples", "encoder_step_times",
           "imbalance", "iteration_durations", "model_flops", "parse_policy", "reordered", "route",
           "sample_work", "step_orders", "WorkModel"]

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
            items = samples.items[module.modality]
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
        reference = draw_samples(cost.program, cost.params.samples, cost.params.seed)
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


# The first pipeline stage's forward and backward seconds per step, the later stages'
# forward and backward seconds, and the number of stages: what inter orders by.
StepTimes = tuple[np.ndarray, np.ndarray, float, float, int]


def route(plan: Plan, work: dict[str, np.ndarray], policy: frozenset[str], *,
          step_times: Callable[[Routing], StepTimes] | None = None) -> Routing:
    """Route a global batch (``work``: per unit, relative work per sample) per ``plan``.

    ``step_times`` gives what ``inter`` orders by (see ``encoder_step_times``); without
    it ``inter`` is skipped. ``inter`` here takes the 1F1B model's best order;
    ``simulate_steps`` instead simulates every order of ``step_orders`` through the whole
    pipeline."""
    m = plan.num_microbatches
    mb = plan.micro_batch
    backbone = next(u for u in plan.units if u.role == "backbone")
    n = next(iter(work.values())).shape[0]
    if n != plan.global_batch:
        raise ValueError(f"{n} samples for a global batch of {plan.global_batch}")
    index = np.arange(n)
    step = (index % (m * mb)) // mb
    replica: dict[str, np.ndarray] = {}
    for u in plan.units:
        if plan.rigid and u.name != backbone.name:
            continue
        r = np.empty(n, dtype=np.intp)
        total = np.zeros(u.dp)       # each replica's work so far (intra)
        for j in range(m):
            members = np.flatnonzero(step == j)
            if u.name == backbone.name and "intra" not in policy:
                r[members] = members // (m * mb)
            elif "intra" in policy and u.dp > 1:
                from dtdsl.reorder.intra import balance
                costs = work[u.name][members]
                groups = np.asarray(balance(costs.tolist(), u.dp))
                # The step's heaviest group goes to the replica with the least work so
                # far: one sample can outweigh a step's others, and a replica given the
                # heaviest group every step would fall behind the others for good.
                load = np.bincount(groups, weights=costs, minlength=u.dp)
                relabel = np.empty(u.dp, dtype=np.intp)
                relabel[np.argsort(-load, kind="stable")] = np.argsort(total, kind="stable")
                r[members] = relabel[groups]
                total += np.bincount(r[members], weights=costs, minlength=u.dp)
            else:
                r[members] = contiguous_split(len(members), u.dp)
        replica[u.name] = r
    if plan.rigid:
        # One pipeline per replica: a sample stays on its backbone replica's pipeline.
        replica = {u.name: replica[backbone.name] for u in plan.units}
    routing = Routing(num_microbatches=m, step=step, replica=replica)
    if "inter" in policy and step_times is not None:
        from dtdsl.reorder.inter import best_order

        fwd, bwd, stage_f, stage_b, stages = step_times(routing)
        routing = reordered(routing, best_order(list(fwd), list(bwd), stage_f, stage_b,
                                                stages))
    return routing


def reordered(routing: Routing, order) -> Routing:
    """``routing`` with its steps run in ``order`` (``order[k]``: the step that runs k-th)."""
    position = np.empty(len(order), dtype=np.intp)
    position[np.asarray(order)] = np.arange(len(order))
    return Routing(num_microbatches=routing.num_microbatches,
                   step=position[routing.step], replica=routing.replica)


def step_orders(times: StepTimes) -> list[list[int]]:
    """Candidate step orders for ``inter``, best first by the 1F1B model of
    ``dtdsl.reorder.inter``: ours (``best_order``), DistTrain's, data order, and the
    steps by size, ascending and descending (duplicates dropped). The model looks at the
    first pipeline stage only; a caller with the whole pipeline (``simulate_steps``)
    simulates each and keeps the fastest."""
    from dtdsl.reorder.inter import best_order, disttrain_order

    fwd, bwd, stage_f, stage_b, stages = times
    f, b = list(fwd), list(bwd)
    size = sorted(range(len(f)), key=lambda i: (f[i] + b[i], i))
    orders = [best_order(f, b, stage_f, stage_b, stages),
              disttrain_order(f, b, stages, stage_f, stage_b), list(range(len(f))), size,
              size[::-1]]
    out: list[list[int]] = []
    for order in orders:
        if order not in out:
            out.append(order)
    return out


def _per_sample_seconds(plan: Plan) -> dict[str, tuple[float, float]]:
    """Forward and backward seconds of one average sample on each unit's heaviest stage."""
    out = {}
    for u in plan.units:
        samples = u.microbatch_share * plan.micro_batch
        out[u.name] = (u.fwd_time_s / samples, u.bwd_time_s / samples)
    return out


def encoder_step_times(plan: Plan, work: dict[str, np.ndarray]
                       ) -> Callable[[Routing], StepTimes]:
    """A function of a Routing giving what inter-microbatch ordering needs: the encoders'
    forward and backward seconds per step (their slowest replica, the slowest encoder),
    the backbone's per-stage seconds, and the pipeline depth (encoder, backbone and
    generator stages)."""
    seconds = _per_sample_seconds(plan)
    backbone = next(u for u in plan.units if u.role == "backbone")
    encoders = [u for u in plan.units if u.role == "encoder"]
    generators = [u for u in plan.units if u.role == "generator"]
    depth = max((u.pp for u in encoders), default=0) + backbone.pp + \
        max((u.pp for u in generators), default=0)

    def times(routing: Routing) -> StepTimes:
        m = routing.num_microbatches
        fwd = np.zeros(m)
        bwd = np.zeros(m)
        for u in encoders:
            load = routing.loads(u.name, work[u.name], u.dp).max(axis=1)
            f, b = seconds[u.name]
            fwd = np.maximum(fwd, load * f)
            bwd = np.maximum(bwd, load * b)
        f_lm, b_lm = (x * plan.micro_batch for x in seconds[backbone.name])
        return fwd, bwd, f_lm, b_lm, max(depth, 1)

    return times


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


def iteration_durations(plan: Plan, cost: CostModel, schedule: Schedule, routing: Routing,
                        work: dict[str, np.ndarray]) -> Durations:
    """Seconds of every pass, transfer and end of step (gradient sync and optimizer
    step, as SYNC: ``UnitPlan.dp_sync_time_s``) of one iteration."""
    seconds = _per_sample_seconds(plan)
    compute = {}
    links: dict[tuple[str, str], float] = {}
    sync = {}
    by_name = {u.name: u for u in plan.units}
    for su in schedule.units:
        u = by_name[su.name]
        loads = _loads(routing, u, work)                            # (M, dp)
        layers = np.asarray(u.layers_per_stage, dtype=float)
        stage_scale = layers / layers.max() / su.vpp                # (pp,)
        f, b = seconds[u.name]
        arr = np.empty((2, su.pp, su.vpp, routing.num_microbatches, su.dp))
        arr[0] = (f * stage_scale)[:, None, None, None] * loads[None, None]
        arr[1] = (b * stage_scale)[:, None, None, None] * loads[None, None]
        compute[u.name] = arr
        unit_cost = cost.unit(u.name)
        hop = float(cost.hop_time_s(unit_cost, 1 if u.tp_replicated else u.tp,
                                    u.microbatch_share))
        links[(u.name, u.name)] = hop
        sync[u.name] = np.full(su.pp, u.dp_sync_time_s)
    # Between units: the encoder's (backbone's) output crosses to the backbone
    # (generators), and the gradients of the same size come back, between the replicas
    # whose samples cross (the broker's routes).
    backbone = next(u for u in plan.units if u.role == "backbone")
    routes = {}
    for u in plan.units:
        if u.colocated:
            # The baseline's co-located encoder (generator): its passes run on the
            # backbone's first (last) stage, on the same replica as the sample's backbone.
            loads = _loads(routing, u, work)
            f, b = seconds[u.name]
            at = 0 if u.role == "encoder" else backbone.pp - 1
            vpp_b = compute[backbone.name].shape[2]
            chunk = 0 if u.role == "encoder" else vpp_b - 1
            compute[backbone.name][0, at, chunk] += f * loads
            compute[backbone.name][1, at, chunk] += b * loads
            sync[backbone.name][at] += u.dp_sync_time_s
        elif u.role == "encoder":
            links[(u.name, backbone.name)] = links[(backbone.name, u.name)] = links[
                (u.name, u.name)]
            routes[(u.name, backbone.name)] = routing.pairs(u.name, u.dp, backbone.name,
                                                            backbone.dp)
        elif u.role == "generator":
            links[(backbone.name, u.name)] = links[(u.name, backbone.name)] = links[
                (backbone.name, backbone.name)]
            routes[(backbone.name, u.name)] = routing.pairs(backbone.name, backbone.dp,
                                                            u.name, u.dp)
    return Durations(compute_s=compute, link_s=links, sync_s=sync, routes=routes)
