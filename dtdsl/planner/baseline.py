"""The baselines: Megatron-LM's rigid orchestration, as its LLaVA training runs it.

One TP degree and one DP degree for the backbone, one pipeline per DP replica, every unit
with the backbone's DP and microbatch (``Plan.rigid``). Megatron-LM's multimodal training
(``examples/multimodal/model.py``, ``megatron/training/arguments.py``) places an encoder
in one of two ways:

- **its own stage** (``--encoder-pipeline-model-parallel-size 1``; never more: "LLaVA does
  not support pp>1 for encoder on it's own pipeline rank"), before the backbone's stages,
  split by ``--encoder-tensor-model-parallel-size``, at most the decoder's TP ("We do not
  support encoders with more TP than the decoder"). Generators, which Megatron-LM's
  LLaVA has not, take the same rule after the backbone. Several encoders run one after
  another (``chained``);
- **co-located** (``--encoder-pipeline-model-parallel-size 0``): on the GPUs of the
  backbone's first pipeline stage with the decoder's TP ("If non-MOE encoder shares first
  decoder pipeline rank it must have the same TP as the decoder"), generators on its
  last. ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  give those stages fewer layers (the middle stages split the rest evenly,
  ``TransformerConfig``'s rule), which balances the stage times.

Under pipeline parallelism of the language model every microbatch is padded to
``seq_len`` (``megatron/core/models/multimodal/llava_model.py`` ``_preprocess_data``:
"Pipeline parallel expects fixed input size"); at pp 1 to its longest sequence
(``UnitPlan.padding``; the cost model priced so, ``CostParams.pad_to_seq_len``). Where a
layout fits only with every layer recomputed it is taken so
(``--recompute-granularity full``).

Two baselines: ``megatron`` trains the spec's data unpacked, ``megatron_packed`` packed
into sequences of ``seq_len`` attending within their documents (Megatron-Energon's
packing buffer, ``--packing-buffer-size``; ``train.packing`` on). Each is chosen on the
drawn batches the plan is scored on: ``baseline_candidates`` ranks every placement and
backbone depth by its best layout at mean work, ``choose_on_drawn_batches`` ranks those
near the fastest by their drawn-batch estimate (``sim.estimate``, as the plan's layouts
are ranked), simulates the best two on the drawn batches and keeps the fastest there.
``docs/planner.md`` describes them with their sources.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.cost.samples import SampleSet
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan, UnitPlan, place_units
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.result import Layout, make_plan, no_layout_fits
from dtdsl.planner.space import Space, efficient_pps

__all__ = ["ESTIMATE_WITHIN", "PLACEMENTS", "SIMULATED", "Candidate", "Colocation",
           "StageWork", "baseline_candidates", "baseline_cost", "choose_on_drawn_batches",
           "colocated_plan",
           "megatron_split", "one_f_one_b_time", "plan_baseline", "with_recompute"]

Progress = Callable[[int, int, str], None]

PLACEMENTS = ("stages", "colocated")
# Which candidates the drawn-batch estimate ranks: within this factor of the fastest at
# mean work. Drawn batches take up to about 1.5x the mean-work time of a pp 1 layout
# (its replicas wait for the longest samples at the gradient sync), little more than it
# for a pipelined one padded to seq_len.
ESTIMATE_WITHIN = 1.5
# How many of the best by the estimate are simulated on every drawn batch.
SIMULATED = 2


def with_recompute(cost: CostModel, samples: SampleSet | None = None,
                   mode: ir.Recompute = ir.Recompute.FULL, *,
                   modes: dict[str, ir.Recompute] | None = None) -> CostModel | None:
    """``cost`` with every module recomputing at least ``mode`` in backward (full: every
    layer's activations, selective: each layer's attention core), or with ``modes``
    each named module at least its own (the planner's choice per unit); None when the
    spec already recomputes so much everywhere. ``samples``: the draw ``cost`` was built
    on (``build_cost_model``; by default ``cost.samples``): recomputation draws alike."""
    program = cost.program
    wanted = {m.name: mode if modes is None else modes.get(m.name, ir.Recompute.NONE)
              for m in program.modules}
    if all(ir.Recompute.of(m.recompute).rank >= wanted[m.name].rank for m in program.modules):
        return None
    modules = tuple(m if ir.Recompute.of(m.recompute).rank >= wanted[m.name].rank else
                    m.model_copy(update={"recompute": wanted[m.name]}) for m in program.modules)
    return build_cost_model(program.model_copy(update={"modules": modules}), cost.params,
                            profile=cost.profile,
                            samples=cost.samples if samples is None else samples)


def baseline_cost(cost: CostModel, *, packing: bool | None = None,
                  pad_to_seq_len: bool | None = None,
                  samples: SampleSet | None = None) -> CostModel:
    """``cost`` with ``train.packing`` and the backbone's padding to ``seq_len`` set as
    given (None: as they are), and the zero_bubble schedule run as 1F1B (Megatron-LM
    mainline has no zero-bubble schedule); ``cost`` itself when nothing changes.
    ``samples``: the draw of the resulting program's data (``build_cost_model``), where
    the caller has it."""
    program, params = cost.program, cost.params
    if program.train.schedule == "zero_bubble":
        program = program.model_copy(update={"train": program.train.model_copy(
            update={"schedule": "1f1b"})})
    if packing is not None and packing != program.train.packing:
        program = program.model_copy(update={"train": program.train.model_copy(
            update={"packing": packing})})
    if pad_to_seq_len is not None and pad_to_seq_len != params.pad_to_seq_len:
        params = dataclasses.replace(params, pad_to_seq_len=pad_to_seq_len)
    if program is cost.program and params is cost.params:
        return cost
    return build_cost_model(program, params, profile=cost.profile, samples=samples)


# ---- uneven first and last stages --------------------------------------------------------

@dataclass(frozen=True)
class StageWork:
    """Forward and backward seconds of one microbatch on a pipeline's stages: ``fwd`` and
    ``bwd`` per layer, plus what the first (last) stage runs besides its layers (a
    co-located encoder, generator) and what every stage of a deeper pipeline adds (its
    transfers, once each way); ``wgt``: of ``bwd``, the weight gradients' (zero_bubble)."""

    fwd: float
    bwd: float
    wgt: float = 0.0
    first: tuple[float, float] = (0.0, 0.0)
    last: tuple[float, float] = (0.0, 0.0)
    hop: float = 0.0


def one_f_one_b_time(fwd, bwd, microbatches: int, vpp: int = 1):
    """The time 1F1B takes for ``microbatches`` over stages of forward and backward seconds
    ``fwd`` and ``bwd`` (arrays, the stages along the last axis, which may differ): the
    latest of the stages' own bounds. Stage k's: the first microbatch reaching it, all of
    its own work, the wait for its first backward beyond the pp - k - 1 forwards of its
    warm-up, the wait for its last backward beyond the pp - k - 1 backwards of its
    cool-down (each wait: the later stages' work on one microbatch), and the last
    backward going back. With equal stages it is (m + pp - 1) T, Megatron-LM's 1F1B; the
    latencies, not the work, shrink by ``vpp`` with interleaving ((m + (pp - 1) / vpp) T
    for equal stages)."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    t = fwd + bwd
    pp = t.shape[-1]
    done = np.cumsum(t, axis=-1)
    before = done - t
    after = done[..., -1:] - done
    ahead = pp - 1 - np.arange(pp)
    bound = before / vpp + microbatches * t + \
        np.maximum(0.0, (after - ahead * fwd) / vpp) + \
        np.maximum(0.0, (after - ahead * bwd) / vpp)
    return bound.max(axis=-1)


def _split_candidates(layers: int, pp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every split Megatron-LM can express as (first, middle, last) layer counts: first
    and last at least 1, the pp - 2 middle stages the rest in equal parts of at least 1."""
    if pp == 1:
        return np.array([layers]), np.array([0]), np.array([0])
    if pp == 2:
        first = np.arange(1, layers)
        return first, np.zeros_like(first), layers - first
    mids = np.arange(1, (layers - 2) // (pp - 2) + 1)
    rest = layers - (pp - 2) * mids                       # first + last, at least 2
    counts = rest - 1
    middle = np.repeat(mids, counts)
    start = np.cumsum(counts) - counts
    first = np.arange(int(counts.sum())) - np.repeat(start, counts) + 1
    return first, middle, layers - (pp - 2) * middle - first


def megatron_split(layers: int, pp: int, work: StageWork, microbatches: int, vpp: int = 1
                   ) -> tuple[tuple[int, ...], float]:
    """The layers per stage Megatron-LM can give a pipeline of ``pp`` stages
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``,
    each at least 1; the middle stages split the rest in equal parts,
    ``TransformerConfig``'s rule) that runs ``microbatches`` fastest in 1F1B
    (``one_f_one_b_time``), and that time. With interleaving every stage's layers divide
    into its ``vpp`` virtual stages (Megatron-LM checks it for the first, the middle and
    the last alike): the split is in chunks of ``vpp`` layers. Ties go to the smallest
    largest stage, then to the most even split."""
    return _fastest_splits(_SplitTable.of(layers, pp, vpp), work, (microbatches,))[0]


@dataclass(frozen=True)
class _SplitTable:
    """Every split Megatron-LM can express for ``layers`` over ``pp`` stages of ``vpp``
    chunks, as (first, middle, last) layer counts, in the order ties go: the smallest
    largest stage first, then the most even."""

    pp: int
    vpp: int
    first: np.ndarray
    middle: np.ndarray
    last: np.ndarray

    @staticmethod
    def of(layers: int, pp: int, vpp: int) -> _SplitTable:
        if pp < 1 or layers < pp * vpp or layers % vpp:
            raise ValueError(f"cannot split {layers} layers over {pp} stages of {vpp} chunks")
        first, middle, last = (n * vpp for n in _split_candidates(layers // vpp, pp))
        stages = [first] + ([middle] if pp > 2 else []) + ([last] if pp > 1 else [])
        largest = np.maximum.reduce(stages)
        order = np.lexsort((largest - np.minimum.reduce(stages), largest))
        return _SplitTable(pp=pp, vpp=vpp, first=first[order], middle=middle[order],
                           last=last[order])

    def split(self, k: int) -> tuple[int, ...]:
        if self.pp == 1:
            return (int(self.first[k]),)
        return (int(self.first[k]),) + (int(self.middle[k]),) * (self.pp - 2) + \
            (int(self.last[k]),)


def _fastest_splits(table: _SplitTable, work: StageWork, microbatches
                    ) -> list[tuple[tuple[int, ...], float]]:
    """``megatron_split`` for each of ``microbatches`` at once. Of the middle stages,
    which are equal, only the last can bound 1F1B's time (``one_f_one_b_time``: each
    later equal stage's bound is at least the one before's), so three stages stand for
    the pipeline. Under ZB-H1 (``work.wgt``) a stage's part in the latencies shrinks by
    twice its W, at most by its backward (``planner.evaluate``)."""
    pp, v = table.pp, table.vpp
    hop = work.hop if pp > 1 else 0.0
    ms = np.asarray(microbatches, dtype=float)[:, None]
    if pp == 1:
        f = table.first * work.fwd + work.first[0] + work.last[0]
        b = table.first * work.bwd + work.first[1] + work.last[1]
        times = ms * (f + b)
    else:
        f0 = table.first * work.fwd + hop + work.first[0]
        b0 = table.first * work.bwd + hop + work.first[1]
        fl = table.last * work.fwd + hop + work.last[0]
        bl = table.last * work.bwd + hop + work.last[1]
        fm = table.middle * work.fwd + hop
        bm = table.middle * work.bwd + hop
        t0, tm, tl = f0 + b0, fm + bm, fl + bl
        l0, lm, ll = (b - 2 * np.minimum(n * work.wgt, b / 2) for n, b in
                      ((table.first, b0), (table.middle, bm), (table.last, bl)))
        a0, am, al = f0 + l0, fm + lm, fl + ll
        middles = pp - 2

        def stage(before, t, after, f, b, ahead):
            return before / v + ms * t + np.maximum(0.0, (after - ahead * f) / v) + \
                np.maximum(0.0, (after - ahead * b) / v)

        times = np.maximum(stage(0.0, t0, middles * am + al, f0, l0, pp - 1),
                           stage(a0 + middles * am, tl, 0.0, fl, ll, 0))
        if middles:
            times = np.maximum(times, stage(a0 + (middles - 1) * am, tm, al, fm, lm, 1))
    # Rounded so that float noise does not decide a tie; the table's order breaks ties.
    best = np.argmin(np.round(times, 12), axis=1)
    return [(table.split(int(k)), float(times[i, k])) for i, k in enumerate(best)]


def _even_split(layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """The most even split Megatron-LM can express (in chunks of ``vpp``), or None when
    its largest stage is not ceil(layers / pp), the size the evaluator prices."""
    first, middle, last = (n * vpp for n in _split_candidates(layers // vpp, pp))
    counts = np.stack([first] + [middle] * max(pp - 2, 0) + ([last] if pp > 1 else []),
                      axis=-1)
    largest = counts.max(axis=-1)
    k = int(np.lexsort((largest - counts.min(axis=-1), largest))[0])
    split = tuple(int(n) for n in counts[k])
    return split if max(split) == -(-layers // pp) else None


# ---- co-located encoders and generators ---------------------------------------------------

@dataclass(frozen=True)
class _Colocated:
    """A co-located layout's figures, one entry per backbone pipeline depth."""

    time: np.ndarray
    warmup: np.ndarray
    steady: np.ndarray
    sync: np.ndarray
    gpus_ok: np.ndarray           # its GPUs fit the budget
    splits: tuple                 # the backbone's layers per stage
    backbone_sync: np.ndarray     # the backbone's heaviest stage's end of step
    across: np.ndarray            # its TP groups span nodes (priced so)


class Colocation:
    """Co-located layouts of one cost model: encoders on the backbone's first stage,
    generators on its last, all split by the backbone's TP, the first and last stages
    given fewer layers where that balances the stages (``megatron_split``). A module the
    backbone's TP degree cannot split (its heads or channels, ``Space.tps``) runs whole on
    every rank of the TP group (``replicated``): priced at tp 1, as it computes."""

    def __init__(self, ev: Evaluator, microbatches: tuple[int, ...] = (),
                 colocated: frozenset[int] | None = None,
                 phased: frozenset[int] = frozenset()) -> None:
        """``colocated``: the units on the backbone's stages (default: every encoder and
        generator; the others have GPUs of their own and are not priced here).
        ``phased``: encoders that run phased on the backbone's GPUs (``UnitPlan.phased``:
        their forward for the whole step data-parallel over every backbone rank before
        the pipeline, their backward, forward recomputed, after it)."""
        self.ev = ev
        # The microbatch counts the search will ask for: splits for all of them at once.
        self.microbatches = tuple(sorted(set(microbatches)))
        n = len(ev.units)
        here = frozenset(i for i in range(n) if i != ev.backbone) if colocated is None \
            else colocated
        self.enc = [i for i in range(n) if ev.roles[i] == "encoder" and i in here]
        self.gen = [i for i in range(n) if ev.roles[i] == "generator" and i in here]
        self.phase = [i for i in range(n) if ev.roles[i] == "encoder" and i in phased]
        if set(phased) - set(self.phase) or set(self.phase) & here:
            raise ValueError("only encoders run phased, and not also co-located")
        self._splits: dict[tuple, tuple[tuple[int, ...], float]] = {}
        self._tables: dict[tuple[int, int], _SplitTable] = {}
        self._works: dict[tuple[int, bool], StageWork] = {}
        space = Space(ev)
        self._tps = {i: frozenset(space.tps(i)) for i in self.enc + self.gen + self.phase}

    def replicated(self, i: int, tp: int) -> bool:
        """Does co-located unit ``i`` run whole on every rank of a TP group of ``tp``?"""
        return tp > 1 and tp not in self._tps[i]

    def work_tp(self, i: int, tp: int) -> int:
        """The TP degree co-located unit ``i`` computes at on the backbone's TP groups."""
        return 1 if self.replicated(i, tp) else tp

    def sync_s(self, i: int, tp: int, dp: int) -> float:
        """Co-located unit ``i``'s end of a step on the backbone's TP groups of ``tp``: a
        replicated one averages all its gradients over the group."""
        return float(self.ev.cost.dp_sync_time_s(
            self.ev.units[i], self.work_tp(i, tp), 1, dp,
            replicated_over=tp if self.replicated(i, tp) else 1))

    def _work(self, tp: int, across: bool) -> StageWork:
        """A backbone layer's forward and backward seconds of one microbatch, the
        co-located encoders' on the first stage and generators' on the last, and one
        transfer between stages."""
        if (tp, across) not in self._works:
            self._works[(tp, across)] = self._stage_work(tp, across)
        return self._works[(tp, across)]

    def fwd_bwd(self, i: int, tp: int, across: bool) -> tuple[float, float]:
        """Co-located unit ``i``'s forward and backward seconds per microbatch on TP
        groups of ``tp`` (a replicated one has no collectives to cross nodes)."""
        t = self.work_tp(i, tp)
        return self.ev.fwd_bwd(i, t, across and t > 1)

    def phase_s(self, i: int, tp: int, dp: int, pp: int, across: bool
                ) -> tuple[float, float]:
        """Phased encoder ``i``'s forward and backward phase seconds at mean work: each of
        a replica's ``pp`` pipeline ranks a 1/pp share of its step's microbatches, the
        backward recomputing the forward, the shares' outputs handed to the first stage
        (their gradients back) over the pipeline's links."""
        f, b = self.fwd_bwd(i, tp, across)
        share = self.ev.microbatches(dp) / pp
        hop = float(self.ev.cost.p2p_time_s(self.ev.units[i].boundary_bytes)) if pp > 1 \
            else 0.0
        return share * (f + hop), share * (b + f + hop)

    def phase_microbatch_s(self, i: int, tp: int, pp: int, across: bool
                           ) -> tuple[float, float]:
        """Phased encoder ``i``'s forward and backward seconds of one backbone
        microbatch's images, hand-off included, the backward with its recomputed forward
        (``phase_s`` per microbatch)."""
        f, b = self.fwd_bwd(i, tp, across)
        hop = float(self.ev.cost.p2p_time_s(self.ev.units[i].boundary_bytes)) if pp > 1 \
            else 0.0
        return f + hop, b + f + hop

    def bubbles_s(self, tp: int, pp: int, across: bool, split: tuple[int, ...],
                  microbatches: int) -> float:
        """Seconds the phased encoders add to a step: their work placed in 1F1B's bubbles
        by ``reorder.split.bubble_owners`` (what the simulator and the runtime run, from
        the plan's same figures: ``reorder.workload.phase_fit``), what does not fit exposed."""
        if not self.phase:
            return 0.0
        from dtdsl.reorder.split import bubble_owners

        work = self._work(tp, across)
        fwd = [work.fwd * n for n in split]
        bwd = [work.bwd * n for n in split]
        fwd[0] += work.first[0]
        bwd[0] += work.first[1]
        fwd[-1] += work.last[0]
        bwd[-1] += work.last[1]
        enc = [self.phase_microbatch_s(i, tp, pp, across) for i in self.phase]
        fit = bubble_owners(fwd, bwd, microbatches, sum(f for f, _ in enc),
                            sum(b for _, b in enc))
        return fit.exposed_f + fit.exposed_b

    def phase_sync_s(self, i: int, tp: int, dp: int, pp: int) -> float:
        """Phased encoder ``i``'s end of step: its gradients over every backbone rank."""
        return self.sync_s(i, tp, dp * pp)

    def _stage_work(self, tp: int, across: bool) -> StageWork:
        ev = self.ev
        b = ev.backbone
        fwd, bwd = ev.fwd_bwd(b, tp, across)
        layers = ev.units[b].layers
        first = [self.fwd_bwd(i, tp, across) for i in self.enc]
        last = [self.fwd_bwd(i, tp, across) for i in self.gen]
        wgt = ev.cost.weight_grad_share(ev.units[b]) if ev.schedule == "zero_bubble" else 0.0
        return StageWork(fwd=fwd / layers, bwd=bwd / layers, wgt=wgt * bwd / layers,
                         first=(sum(f for f, _ in first), sum(b_ for _, b_ in first)),
                         last=(sum(f for f, _ in last), sum(b_ for _, b_ in last)),
                         hop=float(ev.cost.hop_time_s(ev.units[b], tp, 1.0)))

    def split(self, tp: int, pp: int, vpp: int, across: bool, microbatches: int
              ) -> tuple[tuple[int, ...], float]:
        key = (tp, pp, vpp, across, microbatches)
        if key not in self._splits:
            if (pp, vpp) not in self._tables:
                self._tables[(pp, vpp)] = _SplitTable.of(
                    self.ev.units[self.ev.backbone].layers, pp, vpp)
            ms = self.microbatches if microbatches in self.microbatches else (microbatches,)
            found = _fastest_splits(self._tables[(pp, vpp)], self._work(tp, across), ms)
            for m, best in zip(ms, found, strict=True):
                self._splits[(tp, pp, vpp, across, m)] = best
        return self._splits[key]

    def evaluate(self, tp: int, dp: int, pps, bars=None, *, with_phases: bool = True
                 ) -> _Colocated:
        """The layouts of backbone depths ``pps`` at ``tp`` and ``dp``: 1F1B over the
        uneven stages (``one_f_one_b_time``) and the transfers of the first microbatch's
        forward and the last one's backward between them (as ``Evaluator`` prices
        them), then the slowest stage's end of step. ``bars``: per depth, a time to beat;
        a layout that cannot (its work spread evenly over the stages, every microbatch
        through the slowest) is left at infinity, its split unchosen. ``with_phases``
        False: without the phased encoders' exposed work (``bubbles_s``), for a caller
        that adds it to the layouts it keeps (it costs more than the rest together)."""
        ev = self.ev
        cost = ev.cost
        b = ev.backbone
        unit = ev.units[b]
        m = ev.microbatches(dp)
        pps = np.asarray(pps, dtype=int)
        placed = place_units((tp,), (tp * dp * pps,), ev.gpus_per_node)
        across_all = np.broadcast_to(placed.across_nodes[0] & (tp > 1), pps.shape)
        vpps = np.broadcast_to(ev.vpp(b, pps, m), pps.shape)
        fixed_b, layer_b = cost.dp_sync_coefficients(unit, tp, dp)
        sync_e = sum((self.sync_s(i, tp, dp) for i in self.enc), 0.0)
        sync_g = sum((self.sync_s(i, tp, dp) for i in self.gen), 0.0)
        out = {k: np.empty(pps.shape) for k in ("time", "warmup", "steady", "sync", "bsync")}
        splits = []
        for k, (p, v, x) in enumerate(zip(pps.tolist(), vpps.tolist(), across_all.tolist(),
                                          strict=True)):
            work = self._work(tp, bool(x))
            hop = work.hop if p > 1 else 0.0
            if bars is not None:
                spread = ((work.fwd + work.bwd) * unit.layers + sum(work.first) +
                          sum(work.last)) / p + 2 * hop
                if m * spread >= bars[k]:
                    for name in out:
                        out[name][k] = math.inf
                    splits.append(None)
                    continue
            split, pipeline = self.split(tp, p, int(v), bool(x), m)
            stage = [(work.fwd + work.bwd) * n + 2 * hop for n in split]
            stage[0] += sum(work.first)
            stage[-1] += sum(work.last)
            stage_sync = [float(fixed_b + layer_b * n) for n in split]
            bsync = max(stage_sync)
            stage_sync[0] += sync_e
            stage_sync[-1] += sync_g
            # Phased encoders: their work in the pipeline's bubbles, what does not fit
            # exposed; their gradients synchronised over every rank after the backbone's.
            phases = self.bubbles_s(tp, p, bool(x), split, m) if with_phases else 0.0
            phase_sync = sum(self.phase_sync_s(i, tp, dp, p) for i in self.phase)
            stage_sync = [t + phase_sync for t in stage_sync]
            steady = min(max(stage) * (m - 1), pipeline)
            total = pipeline + 2 * (p - 1) * hop + phases
            out["time"][k] = total + max(stage_sync)
            out["warmup"][k] = total - steady
            out["steady"][k] = steady
            out["sync"][k] = max(stage_sync)
            out["bsync"][k] = bsync
            splits.append(split)
        return _Colocated(time=out["time"], warmup=out["warmup"], steady=out["steady"],
                          sync=out["sync"], gpus_ok=placed.span <= ev.num_gpus,
                          splits=tuple(splits), backbone_sync=out["bsync"],
                          across=across_all)

    def memory(self, tp: int, dp: int, pp: int, split: tuple[int, ...], downstream: int = 0
               ) -> tuple[bool, float, dict[int, float]]:
        """Whether the layout's stages fit, each within the limits of every unit on it: the
        backbone's first stage with the encoders (their activations held for the pp
        microbatches in flight there), its middle stages, its last with the generators.
        ``downstream``: stages after the backbone's last (generators of their own), which
        hold microbatches in flight on every stage. Returns that, the backbone's heaviest
        stage's memory and each co-located unit's own part."""
        ev = self.ev
        cost = ev.cost
        b = ev.backbone
        unit = ev.units[b]
        m = ev.microbatches(dp)
        v = int(np.asarray(ev.vpp(b, pp, m)))
        own = {i: float(cost.memory_bytes(ev.units[i], self.work_tp(i, tp), 1, dp, 1,
                                          pp + downstream, m, 1.0))
               for i in self.enc}
        own.update({i: float(cost.memory_bytes(ev.units[i], self.work_tp(i, tp), 1, dp, 1, 1,
                                               m, 1.0))
                    for i in self.gen})
        # A phased encoder on every stage: its state sharded over all the backbone's ranks,
        # one microbatch step's activations (at most a whole microbatch's images on one
        # rank) while it recomputes; the first stage holds the step's outputs of it.
        own.update({i: float(cost.memory_bytes(ev.units[i], self.work_tp(i, tp), 1, dp * pp,
                                               1, 1, m, 1.0))
                    for i in self.phase})
        held = sum(m * ev.units[i].boundary_bytes for i in self.phase)
        stages = [0] + ([1] if pp > 2 else []) + ([pp - 1] if pp > 1 else [])
        fits, heaviest = True, 0.0
        zb = ev.schedule == "zero_bubble"   # deferred Ws: each stage holds the first's count
        for s in stages:
            depth = (pp if zb else pp - s) + downstream
            mem = cost.stage_memory_bytes(unit, tp=tp, pp=pp, dp=dp, vpp=v, stage=s,
                                          layers=split[s], depth=depth,
                                          microbatches=m,
                                          share=1.0)
            heaviest = max(heaviest, mem)
            on = [b] + self.phase
            if s == 0:
                on += self.enc
                mem += held
            if s == pp - 1:
                on += self.gen
            mem += sum(own[i] for i in on if i != b)
            fits = fits and mem <= min(ev.memory_limit[i] for i in on)
        return fits, heaviest, own


# ---- the search ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """A baseline layout and the cost model that priced it (its padding and
    recomputation), which the simulator must use too."""

    plan: Plan
    cost: CostModel

    @property
    def placement(self) -> str:
        return "colocated" if any(u.colocated for u in self.plan.units) else "stages"

    @property
    def depth(self) -> int:
        return next(u.pp for u in self.plan.units if u.role == "backbone")


@dataclass(frozen=True)
class _Choice:
    time: float
    ev: Evaluator
    tp: int
    dp: int
    pp: int
    side_tp: int                  # own-stage encoders' and generators' TP


class _Search:
    """The best layout at mean work of every placement and backbone depth."""

    def __init__(self, num_gpus: int) -> None:
        self.num_gpus = num_gpus
        self.best: dict[tuple[str, int], _Choice] = {}
        self.evaluated = 0
        self.candidates = 0

    def offer(self, placement: str, choice: _Choice) -> None:
        key = (placement, choice.pp)
        if key not in self.best or choice.time < self.best[key].time:
            self.best[key] = choice

    def bar(self, placement: str, pp: int) -> float:
        found = self.best.get((placement, pp))
        return found.time if found is not None else math.inf


def _side_tps(space: Space, tp: int) -> list[int]:
    """The TP degrees the encoders and generators may take on their own stages at backbone
    TP ``tp``: one for all of them (``--encoder-tensor-model-parallel-size``), allowed
    for each, at most ``tp``."""
    others = [i for i in range(space.n) if i != space.backbone]
    if not others:
        return [tp]
    common = set(space.tps(others[0]))
    for i in others[1:]:
        common &= set(space.tps(i))
    return sorted(t for t in common if t <= tp)


def baseline_candidates(cost: CostModel, num_gpus: int | None = None, *,
                        progress: Progress | None = None,
                        placements: tuple[str, ...] = PLACEMENTS,
                        recompute: bool = True,
                        samples: SampleSet | None = None) -> list[Candidate]:
    """Megatron-LM's rigid layouts on ``num_gpus`` GPUs of ``cost``'s program (its data as
    ``train.packing`` says): for every placement (``placements``) and backbone depth, the
    fastest at mean work over every allowed TP, DP and own-stage TP, the backbone padded
    as Megatron-LM pads it at that depth, recomputing every layer where the layout fits
    only so (unless ``recompute`` is off). Fastest first; empty when nothing fits.
    ``samples``: the draw ``cost`` was built on (``build_cost_model``), to build the
    variants on without drawing again."""
    start = time.perf_counter()
    num_gpus = num_gpus or cost.program.cluster.num_gpus
    if not placements or set(placements) - set(PLACEMENTS):
        raise ValueError(f"placements must be some of {PLACEMENTS}, not {placements!r}")
    if samples is None:
        samples = cost.drawn()
    search = _Search(num_gpus)
    evs: dict[tuple[bool, bool], Evaluator] = {}
    for pad in (False, True):
        base = baseline_cost(cost, pad_to_seq_len=pad, samples=samples)
        evs[(pad, False)] = Evaluator(base, num_gpus)
        again = with_recompute(base, samples) if recompute else None
        if again is not None:
            evs[(pad, True)] = Evaluator(again, num_gpus)
    space = Space(evs[(False, False)])
    b = space.backbone
    layers = space.units[b].layers
    pps_all = np.asarray(efficient_pps(layers, space.pps(b)), dtype=int)
    counts = tuple(space.total_microbatches // dp for dp in space.dp_lms())
    colocations = {key: Colocation(ev, counts) for key, ev in evs.items()}
    tps, dp_lms = space.tps(b), space.dp_lms()
    own_ok = "stages" in placements and all(1 in space.pps(i) for i in range(space.n)
                                            if i != b)
    for step, tp in enumerate(tps):
        if progress is not None:
            progress(step, len(tps), f"tp {tp}")
        for dp in dp_lms:
            if tp * dp > num_gpus:
                continue
            search.candidates += 1
            for pad in (False, True):
                pps = pps_all[pps_all > 1] if pad else pps_all[pps_all == 1]
                if not pps.size:
                    continue
                if own_ok:
                    for side in _side_tps(space, tp):
                        _own_stages(search, evs, pad, tp, dp, side, pps)
                if "colocated" in placements:
                    _colocated(search, evs, colocations, pad, tp, dp, pps)
    if progress is not None:
        progress(len(tps), len(tps), "done")
    solve = time.perf_counter() - start
    out = [_candidate(search, placement, choice, colocations, solve)
           for (placement, _), choice in search.best.items()]
    return sorted(out, key=lambda c: (c.plan.iteration_time_s, c.depth, c.placement))


def _own_stages(search: _Search, evs, pad: bool, tp: int, dp: int, side: int,
                pps: np.ndarray) -> None:
    """Encoders (generators) on one stage of their own before (after) the backbone's
    ``pps`` stages, at TP ``side``."""
    feasible_plain = None
    for again in (False, True):
        ev = evs.get((pad, again))
        if ev is None:
            continue
        b = ev.backbone
        n = len(ev.units)
        tps = tuple(tp if i == b else side for i in range(n))
        est = ev.evaluate(tps, (dp,) * n, [pps if i == b else np.ones_like(pps)
                                            for i in range(n)], chained=True)
        feasible = np.asarray(est.feasible) & (np.asarray(est.gpus) <= search.num_gpus)
        search.evaluated += int(pps.size)
        ok = feasible if feasible_plain is None else feasible & ~feasible_plain
        if feasible_plain is None:
            feasible_plain = feasible
        times = np.asarray(est.iteration_time_s, dtype=float)
        vpps = np.broadcast_to(est.vpp[b], pps.shape)
        layers = ev.units[b].layers
        for k, p in enumerate(pps.tolist()):
            if ok[k] and times[k] < search.bar("stages", p) and \
                    _even_split(layers, p, int(vpps[k])) is not None:
                search.offer("stages", _Choice(float(times[k]), ev, tp, dp, p, side))


def _colocated(search: _Search, evs, colocations, pad: bool, tp: int, dp: int,
               pps: np.ndarray) -> None:
    """Encoders and generators co-located on the backbone's first and last stages."""
    # Recomputation only where nothing fits without: a recomputing layout is slower than
    # the same one without, so it can beat the bar only where that one did, and whether
    # that one fits is known by then.
    fits_plain: dict[int, bool] = {}
    for again in (False, True):
        ev = evs.get((pad, again))
        if ev is None:
            continue
        co = colocations[(pad, again)]
        figures = co.evaluate(tp, dp, pps, [search.bar("colocated", p) for p in pps.tolist()])
        search.evaluated += int(pps.size)
        for k, p in enumerate(pps.tolist()):
            if not figures.gpus_ok[k] or figures.time[k] >= search.bar("colocated", p):
                continue
            if again:
                if p not in fits_plain:
                    plain = colocations[(pad, False)]
                    fits_plain[p] = plain.memory(
                        tp, dp, p, plain.evaluate(tp, dp, np.asarray([p])).splits[0])[0]
                if fits_plain[p]:
                    continue
            fits = co.memory(tp, dp, p, figures.splits[k])[0]
            if not again:
                fits_plain[p] = fits
            if fits:
                search.offer("colocated", _Choice(float(figures.time[k]), ev, tp, dp, p, tp))


def _candidate(search: _Search, placement: str, choice: _Choice, colocations,
               solve_time_s: float) -> Candidate:
    ev = choice.ev
    if placement == "colocated":
        co = next(c for c in colocations.values() if c.ev is ev)
        plan = _colocated_plan(co, choice, solve_time_s=solve_time_s,
                               candidates=search.candidates, evaluated=search.evaluated)
    else:
        n = len(ev.units)
        b = ev.backbone
        layout = Layout(tp=tuple(choice.tp if i == b else choice.side_tp for i in range(n)),
                        dp=(choice.dp,) * n,
                        pp=tuple(choice.pp if i == b else 1 for i in range(n)),
                        iteration_time_s=choice.time, chained=True)
        plan = make_plan(ev, "baseline", layout, solve_time_s=solve_time_s,
                         candidates=search.candidates, convex_solves=0,
                         evaluated=search.evaluated)
        backbone = plan.units[b]
        split = _even_split(ev.units[b].layers, backbone.pp, backbone.vpp)
        assert split is not None, "the search keeps splits Megatron-LM can express"
        plan = _with_unit(plan, b, layers_per_stage=split, padding=_padding(choice.pp))
    return Candidate(plan=plan, cost=ev.cost)


def _padding(pp: int) -> str:
    return "seq_len" if pp > 1 else "longest"


def _with_unit(plan: Plan, index: int, **update) -> Plan:
    units = list(plan.units)
    units[index] = units[index].model_copy(update=update)
    return plan.model_copy(update={"units": tuple(units)})


def _colocated_plan(co: Colocation, choice: _Choice, *, solve_time_s: float,
                    candidates: int, evaluated: int) -> Plan:
    """The Plan of a co-located baseline layout (``colocated_plan``, padded as
    Megatron-LM pads at its depth)."""
    return colocated_plan(co, choice.tp, choice.dp, choice.pp, search="baseline",
                          padding=_padding(choice.pp), solve_time_s=solve_time_s,
                          candidates=candidates, evaluated=evaluated, time=choice.time)


def colocated_plan(co: Colocation, tp: int, dp: int, pp: int, *, search: str, padding: str,
                   solve_time_s: float, candidates: int, evaluated: int,
                   time: float | None = None) -> Plan:
    """The Plan of a co-located layout: the backbone's ranks only; the encoders (first
    stage) and generators (last stage) are listed on those GPUs with ``gpus`` 0, the
    backbone's ``tp`` and ``dp``, starting at its first rank. ``time``: the search's
    figure for it, checked against the plan's."""
    ev = co.ev
    program = ev.cost.program
    b = ev.backbone
    figures = co.evaluate(tp, dp, np.asarray([pp]))
    iteration = float(figures.time[0])
    split = figures.splits[0]
    fits, heaviest, own = co.memory(tp, dp, pp, split)
    assert fits and bool(figures.gpus_ok[0]), "planners return feasible layouts"
    assert time is None or math.isclose(iteration, time, rel_tol=1e-9)
    across = bool(figures.across[0])
    m = ev.microbatches(dp)
    units = []
    hosted = set(co.enc) | set(co.gen)
    for i, unit in enumerate(ev.units):
        own_unit = i == b
        if i in co.phase:
            units.append(_phased_unit(co, i, tp, dp, pp, across, own[i]))
            continue
        if not own_unit and i not in hosted:
            # A module with GPUs of its own beside the backbone: the caller lays it out.
            units.append(_unplaced(unit, program, ev.memory_limit[i]))
            continue
        fwd, bwd = ev.fwd_bwd(i, tp, across) if own_unit else co.fwd_bwd(i, tp, across)
        heaviest_share = max(split) / unit.layers if own_unit else 1.0
        projectors = _projectors(program, unit)
        upp = pp if own_unit else 1
        sync = float(figures.backbone_sync[0]) if own_unit else \
            co.sync_s(i, tp, dp)
        units.append(UnitPlan(
            name=unit.name, role=unit.role, projectors=projectors,
            gpus=tp * dp * pp if own_unit else 0, tp=tp, dp=dp, pp=upp,
            vpp=int(np.asarray(ev.vpp(i, upp, m))), colocated=not own_unit,
            tp_replicated=not own_unit and co.replicated(i, tp),
            recompute=program.module(unit.name).recompute, first_rank=0,
            padding=padding if own_unit else "longest",
            tp_across_nodes=across and (own_unit or not co.replicated(i, tp)),
            layers_per_stage=split if own_unit else (unit.layers,), microbatch_share=1.0,
            fwd_time_s=fwd * heaviest_share, bwd_time_s=bwd * heaviest_share,
            dp_sync_time_s=sync,
            memory_bytes=heaviest if own_unit else own[i],
            memory_limit_bytes=ev.memory_limit[i], ep=unit.ep))
    train = program.train
    return Plan(
        spec=program.name, spec_sha256=program.source_sha256, search=search,
        num_gpus=ev.num_gpus, gpus_used=tp * dp * pp, global_batch=train.global_batch,
        micro_batch=train.micro_batch, num_microbatches=m, schedule=train.schedule,
        iteration_time_s=iteration, warmup_time_s=float(figures.warmup[0]),
        steady_time_s=float(figures.steady[0]), dp_sync_time_s=float(figures.sync[0]),
        model_flops_per_iteration=ev.model_flops_per_iteration, mfu=ev.mfu(iteration),
        mfu_full_attention=ev.mfu(iteration, full_attention=True),
        solve_time_s=solve_time_s, candidates=candidates, convex_solves=0,
        evaluated=evaluated, units=tuple(units))


def _phased_unit(co: Colocation, i: int, tp: int, dp: int, pp: int, across: bool,
                 memory: float) -> UnitPlan:
    """Phased encoder ``i``'s UnitPlan on a backbone of ``tp`` x ``dp`` x ``pp``: a replica
    per backbone rank group (dp x pp), a unit microbatch a 1/pp share of a backbone
    microbatch, its backward recomputing the forward (``Colocation.phase_s``)."""
    ev = co.ev
    unit = ev.units[i]
    program = ev.cost.program
    m = ev.microbatches(dp)
    fwd, bwd = co.phase_s(i, tp, dp, pp, across)
    return UnitPlan(
        name=unit.name, role=unit.role, projectors=_projectors(program, unit), gpus=0,
        tp=tp, dp=dp * pp, pp=1, phased=True, tp_replicated=co.replicated(i, tp),
        recompute=True, first_rank=0,
        tp_across_nodes=across and not co.replicated(i, tp),
        layers_per_stage=(unit.layers,), microbatch_share=1.0 / pp,
        fwd_time_s=fwd / m, bwd_time_s=bwd / m,
        dp_sync_time_s=co.phase_sync_s(i, tp, dp, pp), memory_bytes=memory,
        memory_limit_bytes=ev.memory_limit[i])


def _unplaced(unit, program, limit: float) -> UnitPlan:
    """A placeholder for a module not on the backbone's stages, which the caller of
    ``colocated_plan`` lays out on GPUs of its own."""
    return UnitPlan(name=unit.name, role=unit.role, projectors=_projectors(program, unit),
                    gpus=0, tp=1, dp=1, pp=1, recompute=program.module(unit.name).recompute,
                    first_rank=0, layers_per_stage=(unit.layers,), microbatch_share=1.0,
                    fwd_time_s=0.0, bwd_time_s=0.0, dp_sync_time_s=0.0, memory_bytes=0.0,
                    memory_limit_bytes=limit)


def _projectors(program, unit) -> tuple[str, ...]:
    """The projectors that run with ``unit``: an encoder's into the backbone, the
    backbone's into a generator."""
    if unit.role == "encoder":
        return tuple(p.name for p in program.projectors if p.source == unit.name)
    if unit.role == "generator":
        return tuple(p.name for p in program.projectors if p.target == unit.name)
    return ()


def plan_baseline(cost: CostModel, num_gpus: int | None = None, *,
                  progress: Progress | None = None,
                  placements: tuple[str, ...] = PLACEMENTS, recompute: bool = True) -> Plan:
    """The fastest of ``baseline_candidates`` at mean work (``choose_on_drawn_batches``
    picks among them on drawn batches)."""
    found = baseline_candidates(cost, num_gpus, progress=progress, placements=placements,
                                recompute=recompute)
    if not found:
        raise no_layout_fits(Space(Evaluator(cost, num_gpus or
                                             cost.program.cluster.num_gpus)))
    return found[0].plan


# ---- on drawn batches ---------------------------------------------------------------------

def choose_on_drawn_batches(candidates: list[Candidate], batches,
                            progress: Progress | None = None, *,
                            simulate: int = SIMULATED, within: float = ESTIMATE_WITHIN,
                            ) -> tuple[Candidate, float, int, int]:
    """The fastest on ``batches`` (``planner.simulated.DrawnBatches``, without
    reordering: Megatron-LM does not reorder) of ``candidates`` (fastest first at mean
    work): those within ``within`` times the fastest at mean work are ranked by their
    drawn-batch estimate (``sim.estimate``: each replica's 1F1B chain on the first
    batch), and the ``simulate`` best of them are simulated on every batch. Returns the
    candidate, its mean iteration time there, how many were simulated and how many
    estimated. Ties go to the better estimate."""
    if simulate < 1:
        raise ValueError(f"simulate must be at least 1, not {simulate}")
    if not candidates:
        raise ValueError("no candidates to choose from")
    fastest = candidates[0].plan.iteration_time_s
    near = [c for c in candidates if c.plan.iteration_time_s <= within * fastest]
    total = len(near) + simulate
    estimates = []
    for k, c in enumerate(near):
        if progress is not None:
            progress(k, total, f"estimating {c.placement} pp {c.depth}")
        estimates.append(batches.estimate(c.plan, frozenset()))
    ranked = [near[k] for k in sorted(range(len(near)), key=lambda k: (estimates[k], k))]
    best: tuple[Candidate, float] | None = None
    for k, c in enumerate(ranked[:simulate]):
        if progress is not None:
            progress(len(near) + k, total, f"simulating {c.placement} pp {c.depth}")
        t = batches.mean_time(c.cost, c.plan)
        if best is None or t < best[1]:
            best = (c, t)
    if progress is not None:
        progress(total, total, "done")
    assert best is not None
    return best[0], best[1], min(simulate, len(ranked)), len(near)
