"""The broker: sample routing (pure), and activations forward / gradients backward
between units on gloo ranks over ordered point-to-point transfers with receiver-known
shapes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dtdsl.parallel.broker import Broker, StepSamples, reverse, route
from dtdsl.parallel.mesh import build_groups
from dtdsl.parallel.p2p import P2P, TensorSpec
from dtdsl.reorder.intra import balance
from tests.dist import ChildFailed, make_plan, run

# ---- routing (pure) ---------------------------------------------------------------------------


def _random_assignment(rng: random.Random, n: int, dp: int) -> list[int]:
    return [rng.randrange(dp) for _ in range(n)]


@pytest.mark.parametrize(("pdp", "cdp"), [(2, 3), (3, 2), (1, 4), (4, 4), (4, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_route_carries_each_sample_on_exactly_its_pair(pdp, cdp, seed):
    rng = random.Random(seed * 31 + pdp * 7 + cdp)
    n = rng.randrange(1, 20)
    ids = rng.sample(range(1000), n)                  # arbitrary, unsorted ids
    prod = _random_assignment(rng, n, pdp)
    cons = _random_assignment(rng, n, cdp)
    routes = route(ids, prod, cons, producer_dp=pdp, consumer_dp=cdp)
    assert list(routes) == sorted(routes)
    assert all(routes.values())                       # no empty pair
    carried = [s for v in routes.values() for s in v]
    assert sorted(carried) == sorted(ids)             # every sample exactly once
    where = {s: (p, c) for s, p, c in zip(ids, prod, cons, strict=True)}
    for (p, c), v in routes.items():
        assert all(where[s] == (p, c) for s in v)
        assert list(v) == [s for s in ids if s in set(v)]   # step order
    # the gradient direction: the same samples, keys swapped
    back = reverse(routes)
    assert list(back) == sorted(back)
    assert {(c, p): v for (p, c), v in routes.items()} == back
    # what each consumer replica receives is exactly what its assignment names
    samples = StepSamples(tuple(ids), {"a": prod, "b": cons})
    for c in range(cdp):
        got = {s for (_, cc), v in routes.items() if cc == c for s in v}
        assert got == set(samples.samples_of("b", c))


def test_route_with_balanced_assignments_from_costs():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    ids = list(range(10, 18))
    routes = route(ids, balance(costs, 2), balance(costs, 3), producer_dp=2, consumer_dp=3)
    assert sorted(s for v in routes.values() for s in v) == ids


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="3 samples"):
        route([1, 2, 3], [0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="distinct"):
        route([1, 1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="consumer replica 3"):
        route([1, 2], [0, 1], [0, 3], producer_dp=2, consumer_dp=3)
    with pytest.raises(TypeError):
        route([1], [0.5], [0])
    assert route([], [], []) == {}


# ---- wire format (pure) -----------------------------------------------------------------------

PLAN_2_3 = make_plan(("vit", "encoder", 1, 2, 1), ("llm", "backbone", 1, 3, 1))


def test_broker_checks_edges_stages_and_samples():
    samples = StepSamples((1, 2, 3), {"vit": [0, 1, 0], "llm": [2, 1, 0]})
    p2p = P2P(torch.device("cpu"))
    consumer = Broker(PLAN_2_3, 2, p2p)
    spec = _spec(0)
    with pytest.raises(RuntimeError, match=r"rank 2 \(llm.s0\) cannot send"):
        consumer.send_forward(0, "vit", "llm", {}, samples)
    with pytest.raises(ValueError, match="does not feed"):
        consumer.recv_forward(0, "llm", "vit", samples, spec)
    with pytest.raises(KeyError, match="no unit 'sd'"):
        consumer.recv_forward(0, "vit", "sd", samples, spec)
    producer = Broker(PLAN_2_3, 0, p2p)
    with pytest.raises(ValueError, match=r"missing \[3\], not its own \[2\]"):
        producer.send_forward(0, "vit", "llm", {1: torch.zeros(1), 2: torch.zeros(1)}, samples)
    assert producer.routes("vit", "llm", samples) == {(0, 0): (3,), (0, 2): (1,), (1, 1): (2,)}


# ---- broker over gloo ---------------------------------------------------------------------------

STEPS = 3


def _step_samples(step: int, producer: str, pdp: int, consumer: str, cdp: int) -> StepSamples:
    """A step's samples and assignments: the same on every rank (seeded by the step)."""
    rng = random.Random(1000 + step)
    n = rng.randrange(4, 9)
    ids = [100 * step + 7 * i + 3 for i in range(n)]
    rng.shuffle(ids)                               # step order is not id order
    ids = tuple(ids)
    costs = [rng.uniform(1, 10) for _ in range(n)]
    return StepSamples(ids, {producer: balance(costs, pdp),
                             consumer: _random_assignment(rng, n, cdp)})


def _activation(step: int, sid: int) -> torch.Tensor:
    """Variable-shaped per-sample activations whose values name the step and sample."""
    rows = 1 + sid % 3
    return torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000.0 * step + sid


def _gradient(step: int, sid: int) -> torch.Tensor:
    return -2.0 * _activation(step, sid) + 0.5


def _spec(step: int):
    """What a receiver expects of a sample's tensor: known from the step's data alone."""
    return lambda sid: TensorSpec((1 + sid % 3, 4), torch.float32)


def _broker_ranks(rank: int, world: int, units: tuple, producer: str, consumer: str,
                  misorder: bool = False) -> None:
    plan = make_plan(*units)
    groups = build_groups(plan)
    p2p = P2P(torch.device("cpu"))
    assert p2p.check
    broker = Broker(plan, rank, p2p, groups)
    me = groups.role
    pg, cg = broker.grids[producer], broker.grids[consumer]
    steps = {j: _step_samples(j, producer, pg.dp, consumer, cg.dp) for j in range(STEPS)}

    if me.unit == producer and me.is_last_stage:
        order = list(range(STEPS))
        if misorder:        # the producer sends steps 0 and 1 the wrong way round
            order[0], order[1] = order[1], order[0]
        for j in order:     # every step's sends go out together
            mine = steps[j].samples_of(producer, me.replica)
            broker.send_forward(j, producer, consumer, {s: _activation(j, s) for s in mine},
                                steps[j])
        pending = {j: broker.recv_backward(j, producer, consumer, steps[j], _spec(j))
                   for j in range(STEPS)}
        p2p.flush()
        for j in range(STEPS):
            got = pending[j].wait()
            mine = steps[j].samples_of(producer, me.replica)
            assert list(got) == list(mine)
            for s, g in got.items():
                assert torch.equal(g, _gradient(j, s)), (j, s)

    elif me.unit == consumer and me.is_first_stage:
        pending = {j: broker.recv_forward(j, producer, consumer, steps[j], _spec(j))
                   for j in range(STEPS)}
        p2p.flush()
        for j in range(STEPS):
            got = pending[j].wait()
            mine = steps[j].samples_of(consumer, me.replica)
            assert list(got) == list(mine), (j, me)
            for s, x in got.items():
                assert torch.equal(x, _activation(j, s)), (j, s)
            broker.send_backward(j, producer, consumer,
                                 {s: -2.0 * x + 0.5 for s, x in got.items()}, steps[j])
    p2p.wait_sends()
    dist.barrier()


CASES = {
    # encoder dp 2 -> backbone dp 3 (the ratio that does not divide): 5 ranks
    "enc-dp2-to-llm-dp3": (("vit", "encoder", 1, 2, 1), ("llm", "backbone", 1, 3, 1)),
    # encoder dp 1 -> backbone dp 2 x tp 2: TP members of the receiver get every sample
    "enc-dp1-to-llm-dp2-tp2": (("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 2, 1)),
    # backbone dp 1 x tp 2 -> generator dp 3: gradients broadcast on the producer's TP group
    "llm-tp2-to-gen-dp3": (("llm", "backbone", 2, 1, 1), ("sd", "generator", 1, 3, 1)),
    # pipelines on both sides: last stage of vit -> first stage of llm, dp 1 -> 2
    "enc-pp2-to-llm-pp2-dp2": (("vit", "encoder", 1, 1, 2), ("llm", "backbone", 1, 2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broker_forward_and_backward(case):
    units = CASES[case]
    world = sum(tp * dp * pp for _, _, tp, dp, pp in units)
    assert 2 <= world <= 6
    run(_broker_ranks, world, units, units[0][0], units[1][0])




def test_a_misordered_broker_transfer_fails_the_ordering_check():
    # Same sizes, wrong order: NCCL would deliver step 1's activations as step 0's.
    units = CASES["enc-dp2-to-llm-dp3"]
    with pytest.raises(ChildFailed, match=r"OrderingError: message #0 from rank \d: "
                                          r"expected 'vit->llm F 0"):
        run(_broker_ranks, 5, units, "vit", "llm", True)


def test_the_broker_has_no_routes_for_co_located_units():
    from dtdsl.parallel.mesh import grids
    from tests.helpers.plans import colocate
    from tests.helpers.runs import plan_for, spec

    program = spec(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 2, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit")
    assert [g.name for g in grids(plan)] == ["llm", "gen"]
    broker = Broker(plan, 0, P2P(torch.device("cpu")))
    assert broker.grids.keys() == {"llm", "gen"}
    samples = StepSamples(sample_ids=(0, 1), assignment={"vit": (0, 1), "llm": (0, 1),
                                                         "gen": (0, 0)})
    with pytest.raises(KeyError, match="co-located on the backbone's stages"):
        broker.routes("vit", "llm", samples)
    assert broker.routes("llm", "gen", samples) == {(0, 0): (0,), (1, 0): (1,)}
