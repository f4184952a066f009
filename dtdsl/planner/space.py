"""The search space every planner shares: which TP, DP and PP each unit may take.

A *candidate* fixes TP and DP for every unit (DistTrain's outer enumeration); what
is left is the GPU count of each unit, ``g_u = tp_u * cp_u * dp_u * pp_u``, that is its
pipeline depth (cp_u is the cost model's, ``CostModel.with_cp``: fixed per search; so is
an MoE backbone's ep, ``CostModel.with_ep``, which its dp must be a multiple of).
Candidates are held as integer arrays (one row per candidate, one column per unit) so
that bounds over tens of thousands of them are vectorised.

DP of the backbone divides the number of microbatches (every replica runs the
same number per step); DP of another unit divides the samples the backbone
consumes per microbatch step, ``dp_lm * micro_batch``, so each of its replicas
gets whole samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtdsl.ir import program as ir
from dtdsl.ir.plan import cp_conflict
from dtdsl.planner.evaluate import Evaluator

__all__ = ["Candidates", "Space", "divisors", "efficient_pps"]

# TP beyond this spans more GPUs than any node has; the cost model would price it, but no
# shipped preset has larger nodes and the enumeration would only grow.
_MAX_TP = 64


def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of n, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def efficient_pps(layers: int, allowed: tuple[int, ...]) -> tuple[int, ...]:
    """The allowed pipeline depths that are not dominated: for each stage size
    ceil(layers / pp), the smallest pp that gives it. A larger pp with the same stage
    size has the same stage time and more GPUs, a longer warm-up and more microbatches
    in flight, so no planner needs it."""
    best: dict[int, int] = {}
    for pp in allowed:
        size = -(-layers // pp)
        if size not in best or pp < best[size]:
            best[size] = pp
    return tuple(sorted(best.values()))


@dataclass(frozen=True)
class Candidates:
    """TP and DP for every unit, one row per candidate."""

    tp: np.ndarray       # (c, n) int
    dp: np.ndarray       # (c, n) int

    def __len__(self) -> int:
        return len(self.tp)


class Space:
    """The allowed values of one program on a budget of ``num_gpus`` GPUs."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        program = evaluator.cost.program
        self.program = program
        self.num_gpus = evaluator.num_gpus
        self.units = evaluator.units
        self.n = len(self.units)
        self.backbone = evaluator.backbone
        self.constraints = tuple(program.constraints_for(u.name) for u in self.units)
        self.cps = np.asarray(evaluator.cps, dtype=int)
        self.micro_batch = program.train.micro_batch
        self.total_microbatches = program.train.num_microbatches

    # ---- per-axis choices ----------------------------------------------------------------
    def tps(self, i: int) -> tuple[int, ...]:
        """Allowed TP degrees (with a measured profile, those it measured)."""
        limit = min(self.num_gpus, _MAX_TP)
        allowed = self.constraints[i].tp.candidates(limit)
        measured = self.evaluator.cost.tps(self.units[i])
        if measured is not None:
            allowed = tuple(tp for tp in allowed if tp in measured)
        unit = self.units[i]
        if unit.cp > 1:     # the TP degrees at which its CP method splits the heads
            arch = self.program.module(unit.name).arch
            node = self.program.cluster.gpus_per_node
            allowed = tuple(t for t in allowed
                            if cp_conflict(arch, unit.cp_method, unit.cp, t, node) is None)
        return allowed

    def pps(self, i: int) -> tuple[int, ...]:
        """Allowed pipeline depths: at most one stage per layer. A U-Net generator gets one
        stage where its constraints allow it: the planner never plans what the runtime
        refuses, and the runtime runs a U-Net on one stage (``codegen.support``, DT601; its
        skip connections cross every cut, and ``frontend.constraints`` refuses a U-Net
        constraint without pp 1, DT407). A DiT's blocks split as a transformer's
        (``train.generator``)."""
        allowed = self.constraints[i].pp.candidates(min(self.units[i].layers, self.num_gpus))
        unit = self.units[i]
        if unit.role == "generator" and 1 in allowed and \
                isinstance(self.program.module(unit.name).arch, ir.UNetArch):
            return (1,)
        return allowed

    def depths(self, i: int, *, dominated: bool = False) -> tuple[int, ...]:
        """The pipeline depths a search tries for unit i: the efficient ones
        (``efficient_pps``), or every allowed one where a ``gpus`` constraint may need a
        dominated depth (or ``dominated``)."""
        gpus = self.constraints[i].gpus
        constrained = gpus.values is not None or gpus.high is not None or gpus.low > 1
        if dominated or constrained:
            return self.pps(i)
        return efficient_pps(self.units[i].layers, self.pps(i))

    def dp_lms(self) -> tuple[int, ...]:
        domain = self.constraints[self.backbone].dp
        ep = self.units[self.backbone].ep     # EP groups are carved from its DP ranks
        return tuple(d for d in divisors(self.total_microbatches)
                     if d <= self.num_gpus and d in domain and self.ep_fits(d, ep))

    def dps(self, i: int, dp_lm: int) -> tuple[int, ...]:
        if i == self.backbone:
            return (dp_lm,)
        domain = self.constraints[i].dp
        ep = self.units[i].ep
        return tuple(d for d in divisors(dp_lm * self.micro_batch)
                     if d <= self.num_gpus and d in domain and self.ep_fits(d, ep))

    def ep_fits(self, dp: int, ep: int) -> bool:
        """Whether ``dp`` DP ranks take EP groups of ``ep``: ep divides dp, and under
        Local SGD a replica's ranks (``ir.Sync.replica_ranks``; an EP group lies inside
        one replica, ``parallel.mesh.ep_lines``, DT636)."""
        return self.program.train.sync.replica_ranks(dp) % ep == 0

    def gpus_allowed(self, i: int, gpus) -> np.ndarray:
        """Does unit i's gpus constraint allow these counts (an array)?"""
        domain = self.constraints[i].gpus
        gpus = np.asarray(gpus)
        ok = gpus >= domain.low
        if domain.high is not None:
            ok &= gpus <= domain.high
        if domain.values is not None:
            ok &= np.isin(gpus, domain.values)
        return ok

    # ---- candidates ---------------------------------------------------------------------------
    def candidates(self) -> Candidates:
        """Every TP/DP combination whose smallest layout (pp 1 everywhere) fits the budget."""
        tp_rows = np.array(np.meshgrid(*[self.tps(i) for i in range(self.n)],
                                       indexing="ij")).reshape(self.n, -1).T
        tp_out, dp_out = [], []
        for dp_lm in self.dp_lms():
            choices = [self.dps(i, dp_lm) for i in range(self.n)]
            if any(not c for c in choices):
                continue
            dp_rows = np.array(np.meshgrid(*choices, indexing="ij")).reshape(self.n, -1).T
            tp_rep = np.repeat(tp_rows, len(dp_rows), axis=0)
            dp_rep = np.tile(dp_rows, (len(tp_rows), 1))
            keep = (tp_rep * dp_rep * self.cps).sum(axis=1) <= self.num_gpus
            tp_out.append(tp_rep[keep])
            dp_out.append(dp_rep[keep])
        if not tp_out:
            return Candidates(tp=np.zeros((0, self.n), int), dp=np.zeros((0, self.n), int))
        return Candidates(tp=np.concatenate(tp_out), dp=np.concatenate(dp_out))

    # ---- memory ---------------------------------------------------------------------------------
    def min_downstream_pp(self, i: int) -> int:
        """The fewest pipeline stages that can follow unit i's last stage."""
        role = self.units[i].role
        gens = [self.pps(j)[0] for j in range(self.n) if self.units[j].role == "generator"
                and self.pps(j)]
        down_gen = max(gens, default=0)
        if role == "encoder":
            return (self.pps(self.backbone) or (1,))[0] + down_gen
        if role == "backbone":
            return down_gen
        return 0

    def smallest_fitting_pp(self, i: int, tp: np.ndarray, dp: np.ndarray,
                            dp_lm: np.ndarray) -> np.ndarray:
        """For each (tp, dp, dp_lm) row: the smallest allowed pp at which unit i's first
        stage fits in its memory limit with the fewest stages downstream (more stages
        downstream only add microbatches in flight); 0 where none fits."""
        allowed = np.asarray(self.pps(i))
        if allowed.size == 0:
            return np.zeros(len(tp), dtype=int)
        tp, dp, dp_lm = (np.asarray(a)[:, None] for a in (tp, dp, dp_lm))
        pp = allowed[None, :]
        ev = self.evaluator
        depth = pp + self.min_downstream_pp(i)
        mem = ev.cost.memory_bytes(self.units[i], tp, pp, dp, ev.vpp(i, pp), depth,
                                   self.total_microbatches // dp_lm, dp_lm / dp)
        fits = mem <= ev.memory_limit[i]
        first = np.argmax(fits, axis=1)
        return np.where(fits.any(axis=1), allowed[first], 0)
