"""The Plan: how many GPUs each unit gets, its TP/DP/PP, and what that is predicted to cost.

A versioned pydantic model; ``Plan.model_dump_json()`` is its text form and the
``plan.json`` of a launch bundle. Each unit owns the contiguous ranks ``first_rank ..
first_rank + gpus - 1``, laid out as a (pp, dp, cp, tp) grid with TP innermost (cp 1
unless the plan uses context parallelism), and the units
tile ranks 0..gpus_used-1. ``place_units`` decides where each unit starts (the one rule the
planner's GPU accounting, its cost model's TP pricing and the plan's rank map share):
rank r is on node r // gpus_per_node, as torchrun numbers a job's processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dtdsl.ir.recompute import Recompute, RecomputeMode

__all__ = ["BASELINES", "PLACEMENTS", "PLAN_VERSION", "Baseline", "Packing", "Placement", "Plan",
           "Simulated", "UnitPlan", "chunk_ranges", "cp_conflict", "cp_split", "place_units",
           "placement_order", "split_layers", "straddling_tp_groups", "tp_spans_nodes"]

PLAN_VERSION = 1


class UnitPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    name: str
    role: Literal["encoder", "backbone", "generator"]
    projectors: tuple[str, ...]          # projectors that run on this unit's ranks
    gpus: int
    tp: int
    dp: int
    pp: int
    vpp: int = 1
    tp_replicated: bool = False           # the baseline's encoders: every TP rank computes it all
    # The baseline's other placement (Megatron-LM's encoder_pipeline_model_parallel_size
    # = 0): an encoder (generator) runs on the GPUs of the backbone's first (last) stage,
    # with the backbone's TP, and holds no GPU of its own (gpus 0).
    colocated: bool = False
    # Phased (an encoder only): its forward for the step's every microbatch, data-parallel
    # over all the backbone's GPUs (dp = the backbone's dp x pp, tp = the backbone's, gpus 0,
    # first_rank the backbone's: its replica q is the backbone's ranks at (stage, replica) =
    # divmod(q, backbone dp)), before the pipeline's first action; its outputs handed to the
    # backbone's first stage; its backward (forward recomputed, one microbatch step at a
    # time) after the pipeline drains (Optimus; Megatron-LM's non-pipelined encoders).
    phased: bool = False
    # Activation recomputation of its layers (``ir.program.Recompute``: none, selective,
    # full): the spec's setting, or the planner's to make a layout fit (Megatron-LM's
    # --recompute-granularity). An older plan's bool reads as full or none.
    recompute: RecomputeMode = Recompute.NONE
    first_rank: int
    # How the backbone pads a microbatch: to its longest sequence (the runtime), or to
    # seq_len (Megatron-LM's LLaVA when the language model is pipelined, ``_preprocess_data``:
    # "pipeline parallel expects fixed input size"; the baselines only).
    padding: Literal["longest", "seq_len"] = "longest"
    # Its TP collectives were priced at the inter-node bandwidth: a TP group of it spans
    # two nodes (``place_units``). Plans written before the field existed read as False.
    tp_across_nodes: bool = False
    layers_per_stage: tuple[int, ...]
    microbatch_share: float               # backbone microbatches per unit microbatch (dp_lm / dp)
    fwd_time_s: float                     # one unit microbatch on the slowest stage
    bwd_time_s: float
    dp_sync_time_s: float                 # end of step: exposed DP sync and optimizer step
    memory_bytes: float                   # peak per GPU, first stage
    memory_limit_bytes: float
    # Context parallelism: each microbatch's sequence split over cp ranks (its module's
    # ``context_parallel`` says how); gpus = tp x cp x pp x dp.
    cp: int = 1
    # Expert parallelism (an MoE backbone): each MoE layer's experts spread over ep of its
    # dp replicas (ep divides dp), each expert FSDP-sharded over the other dp / ep. Plans
    # written before the field existed read as 1.
    ep: int = 1

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.gpus)

    def tp_groups(self) -> list[range]:
        """The ranks of each of its TP groups, one per (stage, replica), in rank order
        (empty for a co-located unit: it runs on another unit's ranks)."""
        if self.gpus == 0:
            return []
        return [range(start, start + self.tp)
                for start in range(self.first_rank, self.first_rank + self.gpus, self.tp)]


class Packing(BaseModel):
    """The plan's layout on the same drawn steps with ``train.packing`` on and off, each
    priced and simulated for its setting, routed under ``policy`` (the spec's reorder
    policy; plans written before it compared both without reordering). A packed step's
    global batch counts sequences of several samples, an unpacked one's single samples:
    ``*_positions`` are the positions a step trains on average (text and encoder tokens,
    padding left out), so the time per position says which trains faster."""

    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    spec_packs: bool                # the spec's own train.packing
    packed_s: float                 # mean iteration time, packed (no reordering)
    unpacked_s: float               # the same, one sample per sequence
    packed_positions: float         # mean positions per step, packed
    unpacked_positions: float       # mean positions per step, unpacked
    policy: tuple[str, ...] = ()    # the reordering both were simulated under
    replanned: bool = False         # the layout does not fit the other way: that
                                    # setting's own (convex) layout was simulated

    @property
    def packing_faster(self) -> bool:
        """Whether packing trains more positions per second."""
        return self.packed_s * self.unpacked_positions < \
            self.unpacked_s * self.packed_positions


class Simulated(BaseModel):
    """A plan's iteration time on drawn batches (``dtdsl.sim``): the mean over ``steps``
    global batches drawn from the spec's data, each routed under the spec's reorder
    policy and without."""

    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    steps: int
    policy: tuple[str, ...]               # the spec's train.reorder
    iteration_time_s: float
    no_reorder_iteration_time_s: float
    candidates: int = 1                   # layouts the planner scored on these batches
    estimated: int = 0                    # layouts ranked by the drawn-batch estimate first
    packing: Packing | None = None        # the same layout with train.packing on and off

    @model_validator(mode="before")
    @classmethod
    def _drop_old(cls, data: Any) -> Any:
        # Plans written before ``Plan.baselines`` carried one baseline's time here.
        if isinstance(data, dict) and "baseline_iteration_time_s" in data:
            data = {k: v for k, v in data.items() if k != "baseline_iteration_time_s"}
        return data


BASELINES = ("megatron", "megatron_packed")
# Where a plan puts the encoders and generators (``planner.placement``): each on GPUs of its
# own, some on the backbone's first and last stages, encoders phased on the backbone's GPUs
# before and after its pipeline, or the fastest of them.
PLACEMENTS = ("auto", "disaggregated", "colocated", "phased")


class Baseline(BaseModel):
    """One Megatron-LM baseline on the same cluster (``planner.baseline``): its layout,
    chosen as the fastest of its candidates on the drawn batches (by mean work when
    nothing was simulated), its times, and the plan's speedup over it.

    Speedups are per position (text and encoder tokens trained a second): where the
    baseline trains the spec's data as the plan does (the same ``train.packing``) that is
    the ratio of iteration times; a packed baseline's global batch of packed sequences
    holds more positions than an unpacked one's, and ``*_positions_ratio`` (its positions
    per step over the plan's) says how many more."""

    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    packing: bool                         # sequences packed from documents
    layout: Plan                          # the chosen layout (search "baseline")
    planned_s: float                      # its iteration time at mean work
    simulated_s: float | None = None      # mean over the drawn batches (no reordering)
    steps: int = 0                        # drawn batches simulated (0: none)
    candidates: int = 1                   # layouts simulated on them, the fastest kept
    estimated: int = 0                    # layouts ranked by the drawn-batch estimate first
    positions_ratio: float = 1.0          # positions per step over the plan's, expected
    simulated_positions_ratio: float = 1.0    # the same on the drawn batches
    speedup: float | None = None          # the plan's over it, at mean work
    simulated_speedup: float | None = None    # the plan's over it on the drawn batches


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    version: Literal[1] = PLAN_VERSION
    spec: str
    spec_sha256: str
    search: Literal["convex", "exhaustive", "baseline"]
    num_gpus: int                         # in the cluster
    gpus_used: int
    global_batch: int
    micro_batch: int
    num_microbatches: int                 # per backbone replica and iteration
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
    iteration_time_s: float
    warmup_time_s: float
    steady_time_s: float
    dp_sync_time_s: float
    model_flops_per_iteration: float
    mfu: float                            # causal attention counted as the half it computes
    # MFU with causal attention counted whole (the paper-era convention of Megatron-LM's
    # 2021 formula and DistTrain); None in plans written before it existed.
    mfu_full_attention: float | None = None
    solve_time_s: float
    candidates: int                       # TP/DP combinations considered
    convex_solves: int                    # cvxpy problems solved (convex search)
    evaluated: int                        # integer layouts evaluated exactly
    simulated: Simulated | None = None    # on drawn batches (dtc plan --simulate-steps)
    # Megatron-LM's layouts on the same cluster, by name (``BASELINES``), each with the
    # plan's speedup over it; None when not compared, a name missing when none fits.
    baselines: dict[str, Baseline] | None = None
    # The best iteration time of each placement the planner weighed ("disaggregated",
    # "colocated": ``planner.placement``), on the drawn batches where it simulated them,
    # else at mean work: why this placement. None where it weighed one.
    placements: dict[str, float] | None = None
    units: tuple[UnitPlan, ...]
    # The fraction of each rank's optimizer state and update on the CPU (train.offload):
    # the spec's ``offload=F``, or the planner's choice for ``offload=auto``. Defaulted so
    # that plans written before it read.
    offload: float = Field(default=0.0, ge=0.0, le=1.0)
    offload_chosen: bool = False     # by the planner, for ``offload=auto``

    def offload_fraction(self, program: Any) -> float:
        """The optimizer offload the runtime and the cost model use: the spec's explicit
        fraction, else (``offload=auto``) this plan's."""
        offload = program.train.optimizer.offload
        return self.offload if offload == "auto" else float(offload)

    @property
    def rigid(self) -> bool:
        """Megatron-LM's layout (the baseline): one chain of stages per DP replica, every
        unit with the backbone's DP, so a sample stays on its replica's pipeline."""
        return self.search == "baseline"

    @model_validator(mode="before")
    @classmethod
    def _drop_old(cls, data: Any) -> Any:
        # Plans written before ``baselines`` carried one baseline's time and the speedup
        # over it: comparisons, not layout, dropped on reading.
        if isinstance(data, dict) and {"speedup", "baseline_iteration_time_s"} & set(data):
            data = {k: v for k, v in data.items()
                    if k not in ("speedup", "baseline_iteration_time_s")}
        return data

    @property
    def placement(self) -> str:
        """"phased" where an encoder runs phased on the backbone's GPUs, "colocated" where
        encoders or generators run on the backbone's stages, else "disaggregated" (each on
        GPUs of its own)."""
        if any(u.phased for u in self.units):
            return "phased"
        return "colocated" if any(u.colocated for u in self.units) else "disaggregated"

    def speedup(self, baseline: str = "megatron", *, simulated: bool = False
                ) -> float | None:
        """The plan's speedup over the named baseline (``Baseline.speedup``), on the drawn
        batches when ``simulated``; None when it was not compared."""
        found = (self.baselines or {}).get(baseline)
        if found is None:
            return None
        return found.simulated_speedup if simulated else found.speedup

    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)


Baseline.model_rebuild()     # its layout is a Plan, defined after it


def cp_split(method: str, cp: int, tp: int, gpus_per_node: int) -> tuple[int, int]:
    """(ring, ulysses) degrees of a CP group of ``cp`` ranks whose TP groups hold ``tp``
    (ranks (cp, tp) with TP innermost, so a CP group spans tp x cp consecutive ranks):
    ``ring`` is all ring, ``ulysses`` all all-to-all, ``hybrid`` (USP) Ulysses over the
    largest divisor of cp whose ranks one node holds (tp x ulysses <= gpus_per_node), the
    ring across the rest."""
    if method == "ring":
        return cp, 1
    if method == "ulysses":
        return 1, cp
    inside = max((u for u in range(1, cp + 1) if cp % u == 0 and tp * u <= gpus_per_node),
                 default=1)
    return cp // inside, inside


def cp_conflict(arch: Any, method: str, cp: int, tp: int, gpus_per_node: int) -> str | None:
    """Why ``cp`` ranks of ``method`` cannot split a module of architecture ``arch`` at TP
    ``tp``, or None. Ulysses shards a TP rank's heads over its degree
    (``parallel.cp._check_heads``): the heads a multiple of it, the KV heads a multiple or
    a divisor of it. A module without a token sequence (a U-Net) has nothing to split."""
    if cp <= 1:
        return None
    if getattr(arch, "kind", None) == "unet":
        return "a U-Net works on latent images, not a token sequence"
    _, ulysses = cp_split(method, cp, tp, gpus_per_node)
    if ulysses <= 1:
        return None
    heads = arch.heads // tp if arch.heads % tp == 0 else arch.heads
    kv = getattr(arch, "kv_heads", None) or arch.heads
    kv = kv // tp if kv % tp == 0 else kv
    if heads % ulysses or (kv % ulysses and ulysses % kv):
        per = f" per TP rank (tp {tp})" if tp > 1 else ""
        return (f"Ulysses over {ulysses} ranks needs {heads} attention heads{per} to be a "
                f"multiple of {ulysses}" + (f" and {kv} KV heads a multiple or a divisor of it"
                                            if kv != heads else ""))
    return None


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as even as possible, the larger stages first."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))


def chunk_ranges(layers_per_stage: tuple[int, ...], vpp: int
                 ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per pipeline stage, the ``[start, stop)`` of the unit's layers each of its ``vpp``
    model chunks holds. Stage s's layers are split as evenly as possible over its chunks
    (``split_layers``, the larger first), and chunk c of stage s is virtual stage
    c * pp + s: the layers run through the virtual stages in that order, so stage s's
    chunks are not contiguous. At vpp 1 each stage holds one range, its own layers."""
    pp = len(layers_per_stage)
    per_chunk = [split_layers(n, vpp) for n in layers_per_stage]
    counts = [per_chunk[k % pp][k // pp] for k in range(pp * vpp)]   # by virtual stage
    starts = [sum(counts[:k]) for k in range(pp * vpp)]
    return tuple(tuple((starts[c * pp + s], starts[c * pp + s] + counts[c * pp + s])
                       for c in range(vpp)) for s in range(pp))


# ---- where units start -------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where ``place_units`` puts each unit; entries are arrays where its ``gpus`` were."""

    first_rank: tuple             # per unit
    across_nodes: tuple           # per unit: one of its TP groups spans two nodes
    span: Any                     # ranks the units occupy together: 0..span-1


def placement_order(tps: Sequence[int], gpus_per_node: int) -> tuple[int, ...]:
    """The order in which units take ranks: those whose TP groups fill whole nodes (tp a
    multiple of the node size) first, then those whose TP divides the node size, largest
    TP first, then the rest (a TP degree that neither divides nor is a multiple of the
    node size), each in plan order.

    A unit takes ``tp * dp * pp`` ranks, a multiple of its tp, so where every TP degree
    divides the next larger one (powers of two on nodes of a power of two, the usual
    case) every unit of the first two kinds starts at a multiple of its tp and none of
    its TP groups crosses a node boundary, without a single idle GPU between units."""
    def kind(i: int) -> tuple[int, int]:
        tp = int(tps[i])
        if tp % gpus_per_node == 0:
            return (0, 0)
        if gpus_per_node % tp == 0:
            return (1, -tp)
        return (2, 0)
    return tuple(sorted(range(len(tps)), key=lambda i: (*kind(i), i)))


def tp_spans_nodes(first_rank, tp: int, gpus, gpus_per_node: int):
    """Does a TP group of a unit of ``gpus`` ranks from ``first_rank`` (TP innermost:
    groups of ``tp`` consecutive ranks) contain ranks of two nodes? ``first_rank`` and
    ``gpus`` may be arrays.

    A group straddles when a node boundary falls strictly inside it. Boundaries inside the
    unit's ranks are the first one, b, and those G, 2G, ... after it (G ranks a node): the
    first falls between groups when (b - first_rank) is a multiple of tp; the later ones
    then do exactly when tp divides G."""
    first_rank = np.asarray(first_rank)
    end = first_rank + np.asarray(gpus)
    boundary = (first_rank // gpus_per_node + 1) * gpus_per_node
    inside = boundary < end
    off_grid = (boundary - first_rank) % tp != 0
    later = (boundary + gpus_per_node < end) & (gpus_per_node % tp != 0)
    return inside & (off_grid | later)


# Orders tried per layout are n!: 720 at six units; with more the first order stands.
_SEARCHED_UNITS = 6


def _back_to_back(order: Sequence[int], tps: Sequence[int], gpus: Sequence,
                  gpus_per_node: int) -> tuple[list[Any], list[Any], Any]:
    first: list[Any] = [0] * len(tps)
    end: Any = 0
    for i in order:
        first[i] = end
        end = end + gpus[i]
    across = [tp_spans_nodes(first[i], int(tps[i]), gpus[i], gpus_per_node)
              for i in range(len(tps))]
    return first, across, end


def _avoidable(tps: Sequence[int], across: list[Any], gpus_per_node: int) -> Any:
    """How many units have a TP group across nodes that a node could hold (TP
    collectives at all, no larger than a node)."""
    return sum((a for t, a in zip(tps, across, strict=True) if 1 < int(t) <= gpus_per_node),
               np.zeros((), dtype=int))


def place_units(tps: Sequence[int], gpus: Sequence, gpus_per_node: int) -> Placement:
    """Where each unit's ranks start: back to back, with no idle rank between units (the
    runtime numbers a job's ranks 0..world-1 and every one of them belongs to a unit), so
    the units occupy exactly sum(gpus) ranks. ``gpus`` entries may be arrays that
    broadcast together (the planner's grids).

    The order is ``placement_order``, in which no TP group that divides the node size
    crosses a node boundary when the TP degrees divide one another. Where it leaves a
    unit with a group across nodes that a node could hold (a TP degree that does not
    divide the node size, or degrees that do not divide one another), every other order
    is tried (up to ``_SEARCHED_UNITS`` units), and for each layout the first with the
    fewest such units is kept: a tp-2 unit of 4 GPUs on nodes of 3 fits from rank 1,
    not from rank 0 or 2."""
    order = placement_order(tps, gpus_per_node)
    first, across, end = _back_to_back(order, tps, gpus, gpus_per_node)
    worst = _avoidable(tps, across, gpus_per_node)
    if np.any(worst) and len(tps) <= _SEARCHED_UNITS:
        for other in itertools.permutations(range(len(tps))):
            if other == order:
                continue
            f, a, _ = _back_to_back(other, tps, gpus, gpus_per_node)
            count = _avoidable(tps, a, gpus_per_node)
            better = count < worst
            if not np.any(better):
                continue
            first = [np.where(better, x, y) for x, y in zip(f, first, strict=True)]
            across = [np.where(better, x, y) for x, y in zip(a, across, strict=True)]
            worst = np.where(better, count, worst)
    return Placement(first_rank=tuple(first), across_nodes=tuple(across), span=end)


def straddling_tp_groups(unit: UnitPlan, gpus_per_node: int) -> list[range]:
    """The TP groups of ``unit`` whose ranks lie on more than one node, from its rank map
    (rank r on node r // gpus_per_node)."""
    return [g for g in unit.tp_groups()
            if g[0] // gpus_per_node != g[-1] // gpus_per_node]
