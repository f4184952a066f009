"""The Megatron-LM baselines as Megatron-LM's LLaVA runs them: microbatches padded to
seq_len under pipeline parallelism, uneven first and last stages, an own-stage encoder's TP
at most the decoder's, recomputation only where nothing fits without, and the layout
chosen on the drawn batches rather than by mean work."""

from __future__ import annotations

import itertools
import math
import random
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dtdsl.cost import flops
from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.ir.plan import split_layers
from dtdsl.planner import plan_baselines, simulate_plan
from dtdsl.planner.baseline import (
    Colocation,
    StageWork,
    baseline_candidates,
    baseline_cost,
    megatron_split,
    one_f_one_b_time,
    with_recompute,
)
from dtdsl.planner.evaluate import Evaluator
from dtdsl.reorder.workload import WorkModel, batch_samples, route
from dtdsl.schedule.lower import lower
from dtdsl.sim.simulate import Simulator
from dtdsl.sim.workload import iteration_durations
from tests.pipeline_ref import one_f_one_b_events

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "specs" / "tiny_cpu.dt").read_text()


def program_of(text: str):
    result = run_frontend("test.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def heavy_images(memory: str, encoder_layers: int, *, gpus: int = 8, global_batch: int = 32,
                 median: int = 900) -> str:
    """tiny_cpu grown: a backbone of 8 layers at hidden 256, an encoder at hidden 256 on
    up to 8 images of up to 256 patches, sequences of up to 1024 positions, most of them
    long, at tp 1, one sample a microbatch."""
    text = TINY.replace("gpus          = 4", f"gpus          = {gpus}")
    text = text.replace("gpus_per_node = 4", "gpus_per_node = 8")
    text = text.replace("memory=4 GiB", f"memory={memory}")
    text = text.replace("layers=2, hidden=64, heads=4, ffn=128",
                        f"layers={encoder_layers}, hidden=256, heads=4, ffn=1024")
    text = text.replace("layers=4, hidden=128", "layers=8, hidden=256")
    text = text.replace("ffn=256, vocab", "ffn=1024, vocab")
    text = text.replace("lognormal(median=48, sigma=0.5) clamp [8, 192]",
                        f"lognormal(median={median}, sigma=0.5) clamp [8, 1024]")
    text = text.replace("zipf(a=2.0) clamp [0, 3]", "zipf(a=1.3) clamp [0, 8]")
    text = text.replace("choice([16, 64], p=[0.7, 0.3])", "choice([16, 256], p=[0.7, 0.3])")
    text = text.replace("global_batch     = 16", f"global_batch     = {global_batch}")
    text = text.replace("micro_batch      = 2", "micro_batch      = 1")
    text = text.replace("seq_len          = 512", "seq_len          = 1024")
    return text.replace("tp(*) in {1, 2}", "tp(*) in {1}")


@cache
def tiny_cost():
    return build_cost_model(program_of(TINY))


def backbone_of(plan):
    return next(u for u in plan.units if u.role == "backbone")


# ---- padding ------------------------------------------------------------------------------

def test_a_pipelined_backbone_is_priced_at_seq_len_and_pp_1_at_its_longest():
    """Megatron-LM's LLaVA pads every microbatch to seq_len when the language model is
    pipelined ("pipeline parallel expects fixed input size") and to its longest sequence
    at pp 1: in the cost model, in the baseline's layouts and in the simulator."""
    cost = tiny_cost()
    program = cost.program
    arch, seq_len, mb = program.backbone.arch, program.train.seq_len, program.train.micro_batch
    padded = build_cost_model(program, CostParams(pad_to_seq_len=True))
    full = flops.backbone_forward(arch, np.array([float(seq_len)]),
                                  np.array([float(seq_len) ** 2]))
    work = padded.unit("llm").fwd_work
    assert work.matmul == pytest.approx(float(full.matmul[0]) * mb)
    assert work.attention == pytest.approx(float(full.attention[0]) * mb)
    assert cost.unit("llm").fwd_work.total < 0.5 * work.total     # tiny_cpu's are short

    candidates = baseline_candidates(cost, 4)
    assert {c.depth for c in candidates} >= {1, 2}
    for c in candidates:
        b = backbone_of(c.plan)
        assert b.padding == ("seq_len" if c.depth > 1 else "longest")
        assert c.cost.params.pad_to_seq_len == (c.depth > 1)
        fwd, _ = c.cost.fwd_bwd_time_s(c.cost.unit(b.name), b.tp, b.tp_across_nodes)
        assert b.fwd_time_s == pytest.approx(fwd * max(b.layers_per_stage) / 4)

    # The simulator: a pipelined baseline's backbone takes the same time every microbatch
    # whatever its samples; at pp 1 each microbatch takes its longest sample's.
    own = {c.depth: c for c in baseline_candidates(cost, 4, placements=("stages",))}
    samples = batch_samples(program, 0)
    for depth in (1, 2):
        c = own[depth]
        b = backbone_of(c.plan)
        model = WorkModel(c.cost)
        relative = model.relative(samples)
        routing = route(c.plan, relative, frozenset())
        durations = iteration_durations(c.plan, c.cost, lower(c.plan, c.cost.program),
                                        routing, relative)
        forward = durations.compute_s["llm"][0]               # (pp, vpp, steps, dp)
        if depth > 1:
            assert np.allclose(forward, b.fwd_time_s)
        else:
            longest = routing.padded_loads("llm", relative["llm"], b.dp)
            assert np.ptp(forward) > 0
            assert np.allclose(forward[0, 0], b.fwd_time_s / mb * longest)


# ---- chosen on drawn batches --------------------------------------------------------------

def test_the_layout_is_chosen_on_the_drawn_batches_not_by_mean_work():
    """Mean work and drawn batches disagree: at pp 1 (padded to each microbatch's
    longest, sixteen replicas, recomputing to fit) the baseline is fastest in
    expectation, but on real batches the replicas wait at the gradient sync for the one
    that drew the longest samples; at pp 2 every microbatch is padded to seq_len, priced
    so, and only the co-located encoder's work varies. The baseline is the one that is
    fastest on the drawn batches."""
    cost = build_cost_model(program_of(heavy_images("220 MiB", 2, gpus=16, global_batch=64,
                                                    median=700)))
    candidates = baseline_candidates(cost)
    by_mean_work = candidates[0]
    assert by_mean_work.depth == 1

    chosen = plan_baselines(cost, steps=2)["megatron"]
    assert backbone_of(chosen.layout).pp > 1
    assert chosen.candidates > 1
    assert chosen.planned_s > by_mean_work.plan.iteration_time_s
    drawn = simulate_plan(by_mean_work.cost, by_mean_work.plan, policy=frozenset(), steps=2)
    assert chosen.simulated_s < drawn
    # Without drawn batches, the fastest in expectation.
    assert plan_baselines(cost, steps=0)["megatron"].layout.units == by_mean_work.plan.units


# ---- uneven first and last stages ---------------------------------------------------------

def one_f_one_b_by_events(fwd, bwd, microbatches):
    """1F1B played out (``tests.pipeline_ref``): when every stage's last backward ends."""
    _, b_end = one_f_one_b_events(fwd, bwd, microbatches, 0.0)
    return max(stage[-1] for stage in b_end)


def test_the_1f1b_time_of_uneven_stages():
    """Equal stages: Megatron-LM's (m + pp - 1) T, and (m + (pp - 1) / v) T interleaved;
    uneven ones: a lower bound of 1F1B played out, and close to it."""
    for pp, m in itertools.product(range(1, 6), range(1, 10)):
        equal = one_f_one_b_time(np.full(pp, 1.0), np.full(pp, 2.0), m)
        assert equal == pytest.approx(one_f_one_b_by_events([1.0] * pp, [2.0] * pp, m))
        if m >= pp:
            assert equal == pytest.approx(3.0 * (m + pp - 1))
            assert one_f_one_b_time(np.full(pp, 1.0), np.full(pp, 2.0), m, vpp=2) == \
                pytest.approx(3.0 * (m + (pp - 1) / 2))
    rng = random.Random(3)
    for _ in range(200):
        pp = rng.randint(1, 6)
        m = rng.randint(pp, 3 * pp + 2)
        fwd = [rng.uniform(0.5, 1.0) for _ in range(pp)]
        bwd = [f * rng.uniform(1.8, 2.2) for f in fwd]
        played = one_f_one_b_by_events(fwd, bwd, m)
        bound = float(one_f_one_b_time(np.array(fwd), np.array(bwd), m))
        assert 0.95 * played <= bound <= played * (1 + 1e-12)


def test_megatron_split_is_the_fastest_split_megatron_can_express():
    rng = random.Random(7)
    for layers, pp, vpp in itertools.product(range(1, 13), range(1, 6), (1, 2)):
        if layers < pp * vpp or layers % vpp:
            continue
        for _ in range(3):
            work = StageWork(fwd=rng.uniform(0.5, 2), bwd=rng.uniform(1, 4),
                             first=(rng.uniform(0, 3), rng.uniform(0, 6)),
                             last=(rng.uniform(0, 1), rng.uniform(0, 2)),
                             hop=rng.uniform(0, 0.2))
            m = rng.randint(pp, 3 * pp)
            split, time = megatron_split(layers, pp, work, m, vpp)
            assert len(split) == pp and sum(split) == layers and min(split) >= vpp
            assert all(n % vpp == 0 for n in split)
            assert len(set(split[1:-1])) <= 1               # the middle stages are equal
            assert time == pytest.approx(brute_force_split(layers, pp, work, m, vpp),
                                         rel=1e-9)
    # Nothing besides the layers: as fast as 1F1B played out allows.
    even = StageWork(fwd=1.0, bwd=2.0)
    split, time = megatron_split(80, 3, even, 8)
    assert max(split) == 27
    assert one_f_one_b_by_events([1.0 * n for n in split], [2.0 * n for n in split], 8) == \
        pytest.approx(time) == pytest.approx(3.0 * (27 * 8 + 26 + 26))


def brute_force_split(layers, pp, work, m, vpp):
    """The fastest of every split Megatron-LM can express (first and last at least 1, the
    middle stages the rest in equal parts, each a multiple of vpp)."""
    best = math.inf
    for first, last in itertools.product(range(1, layers + 1), repeat=2):
        rest = layers - first - last
        if pp == 1:
            if first != layers or last != layers:
                continue
            stages = (layers,)
        elif pp == 2:
            if rest != 0:
                continue
            stages = (first, last)
        else:
            if rest < pp - 2 or rest % (pp - 2):
                continue
            stages = (first, *(rest // (pp - 2),) * (pp - 2), last)
        if any(n % vpp for n in stages):
            continue
        hop = work.hop if pp > 1 else 0.0
        fwd = np.array([work.fwd * n + hop for n in stages])
        bwd = np.array([work.bwd * n + hop for n in stages])
        fwd[0] += work.first[0]
        bwd[0] += work.first[1]
        fwd[-1] += work.last[0]
        bwd[-1] += work.last[1]
        best = min(best, float(one_f_one_b_time(fwd, bwd, m, vpp)))
    return best


def test_a_colocated_encoder_gets_a_lighter_first_stage_where_that_runs_faster():
    """--decoder-first-pipeline-num-layers: the first stage, which carries the encoder,
    takes fewer layers where 1F1B runs faster so; the simulator agrees that the even
    split of the same layout is slower."""
    cost = build_cost_model(program_of(heavy_images("1 GiB", 4)))
    colocated = [c for c in baseline_candidates(cost, placements=("colocated",))
                 if c.depth > 1]
    uneven = [c for c in colocated if backbone_of(c.plan).layers_per_stage !=
              split_layers(sum(backbone_of(c.plan).layers_per_stage), c.depth)]
    assert uneven
    for c in uneven:
        b = backbone_of(c.plan)
        split = b.layers_per_stage
        assert split[0] < max(split), split
        even = split_layers(sum(split), len(split))
        b_even = b.model_copy(update={
            "layers_per_stage": even,
            "fwd_time_s": b.fwd_time_s * max(even) / max(split),
            "bwd_time_s": b.bwd_time_s * max(even) / max(split)})
        times = []
        for layout in (c.plan, c.plan.model_copy(update={"units": tuple(
                b_even if u.role == "backbone" else u for u in c.plan.units)})):
            # Expected work: every sample the mean.
            work = {u.name: np.ones(layout.global_batch) for u in layout.units}
            schedule = lower(layout, c.cost.program)
            durations = iteration_durations(layout, c.cost, schedule,
                                            route(layout, work, frozenset()), work)
            times.append(Simulator(schedule).run(durations).iteration_time_s)
        assert times[0] < times[1]


# ---- an encoder's own stage ---------------------------------------------------------------

def test_an_own_stage_encoder_is_split_by_at_most_the_decoders_tp():
    """--encoder-tensor-model-parallel-size: at most the decoder's TP ("We do not support
    encoders with more TP than the decoder"); the encoder is split by it, not replicated
    over the stage's TP group."""
    for cost, gpus in ((build_cost_model(program_of(TINY.replace(
            "tp(*) in {1, 2}", "tp(*) in {1, 2}\n  tp(vit) == 2"))), 6),
            (tiny_cost(), 6), (build_cost_model(program_of(
                (ROOT / "specs" / "mllm_9b.dt").read_text())), 96)):
        own = baseline_candidates(cost, gpus, placements=("stages",))
        assert own
        for c in own:
            b = backbone_of(c.plan)
            for u in c.plan.units:
                if u.role == "backbone":
                    continue
                assert not u.tp_replicated and not u.colocated
                assert u.tp <= b.tp and u.gpus == u.tp * u.dp and u.dp == b.dp
                fwd, _ = c.cost.fwd_bwd_time_s(c.cost.unit(u.name), u.tp, u.tp_across_nodes)
                assert u.fwd_time_s == pytest.approx(fwd)
    # An encoder that must take tp 2 runs only next to a backbone of tp 2 or more.
    pinned = build_cost_model(program_of(TINY.replace(
        "tp(*) in {1, 2}", "tp(*) in {1, 2}\n  tp(vit) == 2")))
    for c in baseline_candidates(pinned, 6, placements=("stages",)):
        assert c.plan.unit("vit").tp == 2 and backbone_of(c.plan).tp == 2


# ---- recomputation ------------------------------------------------------------------------

def test_each_recomputing_layout_does_not_fit_without():
    """Full recomputation (--recompute-granularity full) only where the same layout does
    not fit without it."""
    cost = build_cost_model(program_of(TINY.replace("memory=4 GiB", "memory=24 MiB")))
    candidates = baseline_candidates(cost, 4)
    assert any(u.recompute for c in candidates for u in c.plan.units)
    assert not all(u.recompute for c in candidates for u in c.plan.units)
    for c in candidates:
        if not any(u.recompute for u in c.plan.units):
            continue
        plain = baseline_cost(cost, pad_to_seq_len=c.depth > 1)
        assert with_recompute(plain).program == c.cost.program
        ev = Evaluator(plain, 4)
        b = backbone_of(c.plan)
        if c.placement == "colocated":
            co = Colocation(ev)
            split = co.evaluate(b.tp, b.dp, np.asarray([b.pp])).splits[0]
            fits, _, _ = co.memory(b.tp, b.dp, b.pp, split)
        else:
            est = ev.evaluate(tuple(u.tp for u in c.plan.units),
                              tuple(u.dp for u in c.plan.units),
                              tuple(u.pp for u in c.plan.units), chained=True)
            fits = bool(est.feasible)
        assert not fits, (c.placement, c.depth)
