"""Per-sample work, routing under the reorder policies, durations and simulated steps."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.cost.samples import draw_samples, microbatch_lengths, positions
from dtdsl.driver import run_frontend
from dtdsl.planner import plan
from dtdsl.reorder.workload import batch_samples, imbalance, parse_policy, route, sample_work
from dtdsl.schedule.lower import lower
from dtdsl.sim.run import simulate_steps
from dtdsl.sim.simulate import Simulator
from dtdsl.sim.workload import iteration_durations

ROOT = Path(__file__).resolve().parents[2]


@cache
def _setup(name: str, constraint: str | None = None, placement: str = "disaggregated"):
    path = ROOT / "specs" / f"{name}.dt"
    text = path.read_text()
    if constraint is not None:
        text = text.replace("constraints {", "constraints {\n  " + constraint, 1)
    program = run_frontend(str(path), text.encode()).program
    cost = build_cost_model(program, CostParams(samples=1024))
    the_plan = plan(cost, program.cluster.num_gpus, compare_baseline=False,
                    placement=placement)
    return program, cost, the_plan, lower(the_plan, program)


def test_policies_parse():
    assert parse_policy("none") == frozenset()
    assert parse_policy("both") == {"intra", "inter"}
    assert parse_policy(("intra",)) == {"intra"}
    with pytest.raises(ValueError, match="one of"):
        parse_policy("sideways")


def test_work_is_relative_to_the_cost_models_samples():
    program, cost, _, _ = _setup("mllm_9b")
    reference = draw_samples(program, cost.params.samples, cost.params.seed)
    work = sample_work(cost, reference)
    backbone = program.backbone.name
    for name, values in work.items():
        if name != backbone:
            assert values.mean() == pytest.approx(1.0), name
    # The backbone's time is relative to a sample's share of a microbatch padded to its
    # longest sequence, as the cost model prices it.
    mb = program.train.micro_batch
    padded = microbatch_lengths(positions(reference), mb)
    longest = np.maximum.reduceat(work[backbone], np.arange(0, len(reference), mb))
    assert len(longest) == len(padded) and longest.mean() == pytest.approx(1.0)
    in_flops = sample_work(cost, reference, timed=False)
    for name, values in in_flops.items():
        assert values.mean() == pytest.approx(1.0), name
    # Attention runs at a lower efficiency than matmuls: in time, big images weigh more.
    encoder = program.encoders[0].name
    big = int(np.argmax(in_flops[encoder]))
    assert work[encoder][big] > in_flops[encoder][big]
    assert set(work) == {m.name for m in program.modules}
    # The backbone's work grows with the sequence's length.
    lengths = positions(reference)
    order = np.argsort(lengths, kind="stable")
    assert np.all(np.diff(work[backbone][order]) >= 0)
    assert work[backbone].std() > 0
    encoder = program.encoders[0].name
    assert work[encoder].std() > 0.1   # images per sample vary a lot in this spec


def test_the_simulator_prices_a_packed_row_by_its_documents():
    """With ``train.packing`` a row's backbone work is its linear work plus the sum of its
    documents' causal attention (``flops.backbone_attention``), in FLOPs (MFU) and in
    time; the same rows taken as one document each would cost more."""
    from dataclasses import replace

    from dtdsl.cost import flops
    from dtdsl.cost.samples import attention_squares
    from dtdsl.reorder.workload import WorkModel

    path = ROOT / "specs" / "mllm_9b.dt"
    text = path.read_text().replace("  seed             = 42\n",
                                    "  seed             = 42\n  packing          = true\n")
    program = run_frontend(str(path), text.encode()).program
    cost = build_cost_model(program, CostParams(samples=512))
    model = WorkModel(cost)
    reference = draw_samples(program, cost.params.samples, cost.params.seed)
    assert model.relative(reference, timed=False)["llm"].mean() == pytest.approx(1.0)
    rows = batch_samples(program, 0, 64)
    whole = replace(rows, doc_squares=None)
    arch = program.backbone.arch
    for timed in (False, True):
        packed, alone = (model.relative(s, timed=timed)["llm"] for s in (rows, whole))
        assert np.all(packed <= alone) and np.any(packed < alone)
    lengths = positions(rows).astype(float)
    saved = flops.backbone_attention(arch, lengths ** 2) - \
        flops.backbone_attention(arch, attention_squares(rows))
    packed, alone = (model.relative(s, timed=False)["llm"] for s in (rows, whole))
    mean = float(np.mean(flops.backbone_forward(arch, positions(reference).astype(float),
                                                attention_squares(reference)).total))
    np.testing.assert_allclose((alone - packed) * mean, saved, rtol=1e-9)


def test_batches_are_seeded_by_step():
    program, *_ = _setup("mllm_9b")
    a, b = batch_samples(program, 3), batch_samples(program, 3)
    assert np.array_equal(a.text_tokens, b.text_tokens)
    assert not np.array_equal(a.text_tokens, batch_samples(program, 4).text_tokens)
    assert len(a) == program.train.global_batch


@pytest.mark.parametrize("policy", ["none", "intra", "inter", "both"])
def test_routing_gives_every_replica_its_share(policy):
    program, cost, the_plan, _ = _setup("mllm_9b")
    work = sample_work(cost, batch_samples(program, 0))
    routing = route(the_plan, work, parse_policy(policy))
    m, mb = the_plan.num_microbatches, the_plan.micro_batch
    backbone = next(u for u in the_plan.units if u.role == "backbone")
    counts = np.bincount(routing.step, minlength=m)
    assert np.all(counts == backbone.dp * mb)
    for u in the_plan.units:
        per = routing.loads(u.name, np.ones(the_plan.global_batch), u.dp)
        assert per.shape == (m, u.dp)
        assert np.all(per.max(axis=1) - per.min(axis=1) <= 1), u.name
    if policy == "none":
        assert np.array_equal(routing.replica[backbone.name],
                              np.arange(the_plan.global_batch) // (m * mb))


def test_intra_balances_the_encoders():
    from dtdsl.reorder.intra import lower_bound

    # Fewer encoder replicas than backbone replicas: each takes several samples of a
    # microbatch step, and intra has something to balance (with as many replicas as the
    # backbone's and one sample per microbatch, every replica takes one sample).
    program, cost, the_plan, _ = _setup("mllm_9b", "dp(vit) <= 2")
    encoder = next(u for u in the_plan.units if u.role == "encoder")
    backbone = next(u for u in the_plan.units if u.role == "backbone")
    assert 1 < encoder.dp < backbone.dp
    only_encoder = the_plan.model_copy(update={"units": (encoder,)})
    for step in range(3):
        work = sample_work(cost, batch_samples(program, step))
        plain = imbalance(only_encoder, route(the_plan, work, frozenset()), work)
        routing = route(the_plan, work, parse_policy("intra"))
        balanced = imbalance(only_encoder, routing, work)
        assert balanced < plain
        # Few heavy-tailed samples per replica cannot always be balanced: compare with
        # the best any assignment could do, step by step.
        costs = work[encoder.name]
        loads = routing.loads(encoder.name, costs, encoder.dp).max(axis=1)
        for j in range(the_plan.num_microbatches):
            members = costs[routing.step == j]
            assert loads[j] <= max(1.01 * lower_bound(members.tolist(), encoder.dp),
                                   _best_split(members, encoder.dp) * (1 + 1e-12))


def _best_split(costs: np.ndarray, groups: int) -> float:
    """The optimal max load over two equal halves (brute force), or inf when not small."""
    n = len(costs)
    if groups != 2 or n > 16 or n % 2:
        return float("inf")
    total = costs.sum()
    best = float("inf")
    for half in itertools.combinations(range(n), n // 2):
        a = costs[list(half)].sum()
        best = min(best, max(a, total - a))
    return best


def test_inter_groups_samples_of_similar_backbone_work():
    """Inter puts samples of similar backbone work into the same microbatch step (the
    dominant loss on unpacked batches is consecutive microbatches of different work), and
    orders the steps by the whole pipeline: a step's samples span a far narrower range of
    backbone work than in data order, and it simulates faster than intra alone."""
    program, cost, the_plan, schedule = _setup("mllm_9b")
    backbone = next(u for u in the_plan.units if u.role == "backbone")
    work = sample_work(cost, batch_samples(program, 0))
    length = work[backbone.name]

    def spread(routing) -> float:
        return float(np.mean([np.ptp(length[routing.step == j])
                              for j in range(the_plan.num_microbatches)]))

    plain = route(the_plan, work, parse_policy("intra"))
    both = route(the_plan, work, parse_policy("both"))
    assert spread(both) < 0.25 * spread(plain)
    simulator = Simulator(schedule)

    def seconds(routing) -> float:
        return simulator.run(iteration_durations(the_plan, cost, schedule, routing,
                                                 work)).iteration_time_s

    assert seconds(both) < 0.7 * seconds(plain)


def test_expected_work_simulates_close_to_the_plan():
    for name in ("tiny_cpu", "mllm_9b", "audio_image"):
        _, cost, the_plan, schedule = _setup(name)
        work = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
        routing = route(the_plan, work, frozenset())
        durations = iteration_durations(the_plan, cost, schedule, routing, work)
        backbone = next(u for u in the_plan.units if u.role == "backbone")
        # The heaviest stage's forward of one microbatch is the plan's.
        heaviest = durations.compute_s[backbone.name][0].max()
        assert heaviest == pytest.approx(backbone.fwd_time_s)
        t = Simulator(schedule).run(durations).iteration_time_s
        # The planner counts transfers as blocking and every stage as the heaviest: it may
        # only be a little pessimistic.
        assert 0.9 * the_plan.iteration_time_s <= t <= 1.001 * the_plan.iteration_time_s, name


def test_colocated_plans_simulate_close_to_the_plan():
    """A co-located plan's passes are its host stages' (the first with the encoders, the
    last with the generators): at mean work the simulator runs the uneven 1F1B the
    planner priced."""
    for name in ("tiny_cpu", "mllm_9b", "audio_image"):
        _, cost, the_plan, schedule = _setup(name, placement="colocated")
        assert the_plan.placement == "colocated"
        assert {u.name for u in schedule.units} == {
            u.name for u in the_plan.units if not u.colocated}
        work = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
        routing = route(the_plan, work, frozenset())
        durations = iteration_durations(the_plan, cost, schedule, routing, work)
        t = Simulator(schedule).run(durations).iteration_time_s
        # The bound of 1F1B over uneven stages (``one_f_one_b_time``) leaves out how a
        # stage's transfers queue behind its passes: within 1%.
        assert 0.9 * the_plan.iteration_time_s <= t <= 1.01 * the_plan.iteration_time_s, \
            (name, t, the_plan.iteration_time_s)


def test_phased_plans_simulate_close_to_the_plan():
    """A phased encoder runs outside the schedule: a sample on the rank of its backbone
    replica's pipeline whose stage ``phase_fit`` gives its step, in whatever order the
    steps run; at mean work its passes in the bubbles and the pipeline simulate to the
    plan's time."""
    from dtdsl.reorder.workload import phase_fit, reordered

    for name in ("tiny_cpu", "mllm_9b"):
        _, cost, the_plan, schedule = _setup(name, placement="phased")
        assert the_plan.placement == "phased"
        backbone = next(u for u in the_plan.units if u.role == "backbone")
        (phased,) = [u for u in the_plan.units if u.phased]
        assert phased.name not in {u.name for u in schedule.units}
        owners = np.asarray(phase_fit(the_plan).owners)
        work = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
        for policy in (frozenset(), frozenset({"intra", "inter"})):
            routing = route(the_plan, work, policy)
            q = routing.replica[phased.name]
            assert np.array_equal(q % backbone.dp, routing.replica[backbone.name])
            assert np.array_equal(q // backbone.dp, owners[routing.step])
        # Reordering the steps keeps each place's stage.
        again = reordered(routing, list(range(the_plan.num_microbatches))[::-1])
        assert np.array_equal(again.replica[phased.name] // backbone.dp, owners[again.step])
        durations = iteration_durations(the_plan, cost, schedule, routing, work)
        assert dict(durations.bubbles) == {phased.name: tuple(owners)}
        t = Simulator(schedule).run(durations).iteration_time_s
        # The plan prices the bubbles' estimate (``bubble_owners``), the simulator places
        # the passes; and the plan's formula ends the step with the slowest stage's sync
        # where the simulator overlaps the later stages' with the first stage's cool-down.
        assert 0.9 * the_plan.iteration_time_s <= t <= 1.03 * the_plan.iteration_time_s, \
            (name, t, the_plan.iteration_time_s)
        # Heavier images on one stage's steps lengthen the step.
        heavy = dict(work)
        heavy[phased.name] = np.where(q // backbone.dp == owners[0], 8.0, 1.0)
        slower = Simulator(schedule).run(iteration_durations(
            the_plan, cost, schedule, routing, heavy)).iteration_time_s
        assert slower > t


@pytest.mark.parametrize("name,placement", [("tiny_cpu", "colocated"), ("mllm_9b", "colocated"),
                                            ("mllm_9b", "stages"), ("mllm_72b", "stages")])
def test_the_baseline_simulates_close_to_its_plan(name, placement):
    """The Megatron-LM baseline's layouts (own stages, or co-located in the backbone's first
    and last stages) simulate to their planned time on expected work, and their replicas
    are one chain each: a sample stays on its replica in every unit."""
    from dtdsl.planner import plan_baseline

    path = ROOT / "specs" / f"{name}.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    cost = build_cost_model(program, CostParams(samples=1024))
    base = plan_baseline(cost, placements=(placement,))
    assert base.rigid
    schedule = lower(base, program)
    assert {u.name for u in schedule.units} == {u.name for u in base.units
                                               if not u.colocated}
    work = {u.name: np.ones(base.global_batch) for u in base.units}
    routing = route(base, work, frozenset())
    backbone = next(u for u in base.units if u.role == "backbone")
    for u in base.units:
        assert np.array_equal(routing.replica[u.name], routing.replica[backbone.name])
    t = Simulator(schedule).run(iteration_durations(base, cost, schedule, routing,
                                                    work)).iteration_time_s
    assert 0.9 * base.iteration_time_s <= t <= 1.001 * base.iteration_time_s


def test_simulated_steps_report_sane_figures():
    program, cost, the_plan, schedule = _setup("mllm_9b", "dp(vit) <= 4")
    plain = list(simulate_steps(program, cost, the_plan, schedule, steps=2,
                                policy=frozenset()))
    both = list(simulate_steps(program, cost, the_plan, schedule, steps=2,
                               policy=parse_policy("both")))
    assert [s.step for s in plain] == [0, 1]
    for a, b in zip(plain, both, strict=True):
        assert 0 < a.mfu < 1 and 0 <= a.bubble_fraction < 1
        assert b.imbalance <= a.imbalance * (1 + 1e-12)   # equal up to rounding
        assert b.iteration_time_s < a.iteration_time_s   # this spec's images are skewed


@pytest.mark.parametrize("global_batch", [2, 8])
def test_interleaved_plans_simulate_no_slower_than_planned(global_batch):
    """The planner interleaves only with at least pp microbatches: with fewer, one
    microbatch still crosses every chunk in turn (a warm-up of pp stage times)."""
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    text = text.replace("schedule         = 1f1b",
                        "schedule         = interleaved(virtual_stages=2)")
    text = text.replace("global_batch     = 16", f"global_batch     = {global_batch}")
    text = text.replace("gpus          = 4", "gpus          = 8")
    text = text.replace("tp(*) in {1, 2}", "tp(*) in {1, 2}\n  pp(llm) == 2")
    result = run_frontend("interleaved.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    program = result.program
    cost = build_cost_model(program, CostParams(samples=512))
    the_plan = plan(cost, program.cluster.num_gpus, compare_baseline=False,
                    placement="disaggregated")
    llm = the_plan.unit("llm")
    assert llm.pp == 2
    assert llm.vpp == (2 if the_plan.num_microbatches >= 2 else 1)
    schedule = lower(the_plan, program)
    work = {u.name: np.ones(the_plan.global_batch) for u in the_plan.units}
    durations = iteration_durations(the_plan, cost, schedule,
                                    route(the_plan, work, frozenset()), work)
    t = Simulator(schedule).run(durations).iteration_time_s
    assert t <= 1.001 * the_plan.iteration_time_s


def test_inter_never_loses_to_data_order():
    # Inter's groupings and orders are chosen on the whole pipeline's model, data order
    # among them; grouping samples of similar work also evens the replicas of a step.
    program, cost, the_plan, schedule = _setup("mllm_9b")
    intra = simulate_steps(program, cost, the_plan, schedule, steps=2,
                           policy=parse_policy("intra"))
    both = simulate_steps(program, cost, the_plan, schedule, steps=2,
                          policy=parse_policy("both"))
    for a, b in zip(intra, both, strict=True):
        assert b.iteration_time_s <= a.iteration_time_s
        assert b.imbalance <= a.imbalance
