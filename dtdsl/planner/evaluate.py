"""Exact evaluation of an integer layout: the one objective every planner optimises.

For units u with (tp_u, dp_u, pp_u), backbone data parallelism dp_lm and M
microbatches per backbone replica (DistTrain, section 5, with integer stages):

    T_u      = (dp_lm / dp_u) * C_u(tp_u) * ceil(L_u / pp_u) / L_u     one microbatch, one stage
               (C_u on one rank of a CP group of cp_u: ``CostModel.with_cp``)
               + 2 p2p_u if pp_u > 1                                 (activations out, gradients in)
    warm-up  = longest path of T_u (1 + (pp_u - 1) / vpp_u)  (encoders in parallel, then
               the backbone, then generators in parallel), plus the point-to-point transfers
    steady   = max_u T_u * (M - 1)
    sync     = max_u (ZeRO-1 gradient reduce-scatter + parameter all-gather of u)
    T_iter   = warm-up + steady + sync

subject to the ranks the units occupy, placed as the plan places them
(``ir.plan.place_units``: sum_u tp_u cp_u dp_u pp_u, no idle rank between units), being at
most N, and each unit's first-stage memory within its limit. C_u(tp_u) prices a unit's
TP collectives at NVLink bandwidth, or at the network's where that placement puts one of
its TP groups across two nodes. Every argument may be a numpy array (the exhaustive
search evaluates grids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtdsl.cost.model import CostModel, UnitCost
from dtdsl.ir.plan import place_units

__all__ = ["Estimate", "Evaluator"]


@dataclass(frozen=True)
class Estimate:
    """The predicted cost of a layout (arrays when the layout was given as arrays)."""

    feasible: object
    iteration_time_s: object
    warmup_s: object
    steady_s: object
    sync_s: object
    gpus: object                 # ranks the layout occupies (``place_units``' span)
    first_rank: tuple            # per unit: where its ranks start
    tp_across_nodes: tuple       # per unit: a TP group spans nodes (priced so)
    stage_time_s: tuple          # per unit: T_u
    memory_bytes: tuple          # per unit: first-stage peak
    vpp: tuple                   # per unit: virtual stages used


class Evaluator:
    """Exact cost of layouts for one cost model and GPU budget."""

    def __init__(self, cost: CostModel, num_gpus: int) -> None:
        self.cost = cost
        self.num_gpus = num_gpus
        program = cost.program
        self.gpus_per_node = program.cluster.gpus_per_node
        self.units: tuple[UnitCost, ...] = cost.units
        self.roles = tuple(u.role for u in self.units)
        # Context parallelism is the cost model's (``CostModel.with_cp``): fixed per search.
        self.cps = tuple(u.cp for u in self.units)
        self.backbone = self.roles.index("backbone")
        self.total_microbatches = program.train.num_microbatches
        self.schedule = program.train.schedule
        self.virtual_stages = program.train.virtual_stages
        gpu_memory = program.cluster.gpu.memory_bytes
        self.memory_limit = tuple(program.constraints_for(u.name).memory_limit_bytes(gpu_memory)
                                  for u in self.units)
        self._c: dict[tuple[int, int], tuple[float, float]] = {}
        # Activations cross from the encoders into the backbone and from it into the
        # generators, forward and back, once per warm-up.
        enc = [u for u in self.units if u.role == "encoder"]
        self.edge_s = (2 * cost.p2p_time_s(max(u.boundary_bytes for u in enc)) if enc else 0.0) \
            + (2 * cost.p2p_time_s(self.units[self.backbone].boundary_bytes)
               if "generator" in self.roles else 0.0)
        self.model_flops_per_iteration = sum(u.model_flops for u in self.units) * \
            self.total_microbatches
        # The other convention: causal attention counted whole, as the paper-era formula
        # (Narayanan et al. 2021, DistTrain) counts it; the model FLOPs above count the
        # half a causal mask computes.
        causal = [u for u in self.units
                  if u.role == "backbone" and program.backbone.arch.causal]
        self.model_flops_full_attention_per_iteration = self.model_flops_per_iteration + sum(
            u.model_attention_flops * (1 + u.backward_factor) for u in causal) * \
            self.total_microbatches

    def fwd_bwd(self, index: int, tp: int, across_nodes: bool = False
                ) -> tuple[float, float]:
        """C_u(tp), split into forward and backward, per backbone microbatch
        (``across_nodes``: TP collectives over the network)."""
        key = (index, tp, across_nodes)
        if key not in self._c:
            self._c[key] = self.cost.fwd_bwd_time_s(self.units[index], tp, across_nodes)
        return self._c[key]

    def placed_fwd_bwd(self, index: int, tp: int, across) -> tuple:
        """C_u(tp) split as ``fwd_bwd``, where ``across`` (a bool or an array of them)
        says which layouts put a TP group of the unit across nodes."""
        fwd, bwd = self.fwd_bwd(index, tp)
        if not np.any(across):
            return fwd, bwd
        fwd_x, bwd_x = self.fwd_bwd(index, tp, True)
        return np.where(across, fwd_x, fwd), np.where(across, bwd_x, bwd)

    def weight_s(self, index: int, bwd):
        """Of a stage's backward seconds ``bwd``, what ZB-H1's bubble can hide: its weight
        gradients (``CostModel.weight_grad_share``) up to half of it; 0 unless the
        schedule is zero_bubble."""
        if self.schedule != "zero_bubble":
            return 0.0
        return np.minimum(self.cost.weight_grad_share(self.units[index]) * bwd, bwd / 2)

    def microbatches(self, dp_lm: int) -> int:
        return self.total_microbatches // dp_lm

    def vpp(self, index: int, pp, microbatches: int | None = None):
        """Interleaving needs at least two stages, layers that split into pp * v chunks
        and, when ``microbatches`` is given, at least pp microbatches (with fewer the
        warm-up is not shortened: one microbatch still crosses every chunk in turn)."""
        pp = np.asarray(pp)
        v = self.virtual_stages
        if self.schedule != "interleaved" or v <= 1:
            return np.ones_like(pp)
        layers = self.units[index].layers
        ok = (pp >= 2) & (layers % (pp * v) == 0)
        if microbatches is not None:
            ok = ok & (pp <= microbatches)
        return np.where(ok, v, 1)

    def evaluate(self, tps: Sequence[int], dps: Sequence[int], pps: Sequence, *,
                 replicated: Sequence[bool] | None = None, chained: bool = False) -> Estimate:
        """The cost of one layout, or of a grid of them (``pps`` entries may be arrays that
        broadcast together).

        ``replicated[u]``: unit u runs whole on every rank of its TP group (Megatron-LM's
        encoders and generators as extra pipeline stages): its compute and memory are those
        of tp 1 while it occupies tp GPUs per stage. ``chained``: encoders run one after
        another (and generators likewise) in a single pipeline instead of side by side."""
        cost = self.cost
        n = len(self.units)
        replicated = tuple(replicated) if replicated is not None else (False,) * n
        work_tp = [1 if replicated[i] else tps[i] for i in range(n)]
        dp_lm = dps[self.backbone]
        m = self.microbatches(dp_lm)
        pps = [np.asarray(p) for p in pps]
        placed = place_units(tps, [tps[i] * self.cps[i] * dps[i] * pps[i] for i in range(n)],
                             self.gpus_per_node)
        # A replicated unit computes at tp 1 on every rank of its group: no collectives.
        straddle = tuple(placed.across_nodes[i] & (work_tp[i] > 1) for i in range(n))
        stage, warm, sync, vpps = [], [], [], []
        for i, unit in enumerate(self.units):
            fwd, bwd = self.placed_fwd_bwd(i, work_tp[i], straddle[i])
            share = dp_lm / dps[i]
            hop = cost.hop_time_s(unit, work_tp[i], share)
            # A stage's compute, plus sending its activations on and its input gradients
            # back when the unit has more than one stage.
            t = share * (fwd + bwd) * np.ceil(unit.layers / pps[i]) / unit.layers + \
                np.where(pps[i] > 1, 2 * hop, 0.0)
            v = self.vpp(i, pps[i], m)
            hops = 2 * (pps[i] - 1) * hop
            stage.append(t)
            vpps.append(v)
            # Megatron-LM's interleaved 1F1B: m T + (pp - 1) T / v in all, so the warm-up
            # is T (1 + (pp - 1) / v); DistTrain's T pp / v drops T (1 - 1/v). Equal at v 1.
            # ZB-H1 (zero_bubble): each of the pp - 1 bubbles shrinks from F + B + W to
            # F + B - W, never below F (schedule.lower's W fills it): T less twice W, at
            # most less the whole backward.
            wgt = self.weight_s(i, share * bwd * np.ceil(unit.layers / pps[i]) / unit.layers)
            warm.append(t + (t - 2 * wgt) * (pps[i] - 1) / v + hops)
            sync.append(cost.dp_sync_time_s(unit, work_tp[i], pps[i], dps[i],
                                            replicated_over=tps[i] if replicated[i] else 1))
        enc = [i for i in range(n) if self.roles[i] == "encoder"]
        gen = [i for i in range(n) if self.roles[i] == "generator"]
        zero = np.zeros(())
        across = _sum if chained else _max
        warmup = across([warm[i] for i in enc], zero) + warm[self.backbone] + \
            across([warm[i] for i in gen], zero) + self.edge_s
        steady = _max(stage, zero) * (m - 1)
        sync_s = _max(sync, zero)
        total = warmup + steady + sync_s

        # Memory: a unit's first stage holds a microbatch per stage downstream of it.
        down_gen = across([pps[i] for i in gen], zero)
        gpus = placed.span
        feasible = np.asarray(gpus <= self.num_gpus)
        memory = []
        for i, unit in enumerate(self.units):
            # In a chained pipeline the later encoders (generators) are downstream too.
            later = [pps[j] for j in (enc if self.roles[i] == "encoder" else gen) if j > i]
            below = _sum(later, zero) if chained else zero
            if self.roles[i] == "encoder":
                depth = pps[i] + below + pps[self.backbone] + down_gen
            elif self.roles[i] == "backbone":
                depth = pps[i] + down_gen
            else:
                depth = pps[i] + below
            mem = cost.memory_bytes(unit, work_tp[i], pps[i], dps[i], vpps[i], depth, m,
                                    dp_lm / dps[i])
            memory.append(mem)
            feasible = feasible & (mem <= self.memory_limit[i])
        return Estimate(feasible=feasible, iteration_time_s=total, warmup_s=warmup,
                        steady_s=steady, sync_s=sync_s, gpus=gpus,
                        first_rank=placed.first_rank, tp_across_nodes=straddle,
                        stage_time_s=tuple(stage),
                        memory_bytes=tuple(memory), vpp=tuple(vpps))

    def mfu(self, iteration_time_s: float, *, full_attention: bool = False) -> float:
        """Model FLOPs per iteration over what the whole cluster could do in that time
        (``full_attention``: causal attention counted whole, the paper-era convention)."""
        flops = self.model_flops_full_attention_per_iteration if full_attention else \
            self.model_flops_per_iteration
        return flops / (iteration_time_s * self.num_gpus * self.cost.peak_flops)


def _sum(values: list, empty):
    return sum(values[1:], values[0]) if values else empty


def _max(values: list, empty):
    if not values:
        return empty
    out = values[0]
    for v in values[1:]:
        out = np.maximum(out, v)
    return out
