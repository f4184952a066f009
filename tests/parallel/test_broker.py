"""The broker: sample routing (pure), the tensor wire format (pure and over gloo), and
activations forward / gradients backward between units on gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dtdsl.parallel import broker as B
from dtdsl.parallel.broker import (
    MAX_NDIM,
    Broker,
    StepSamples,
    WireError,
    broadcast_tensors,
    recv_tensors,
    reverse,
    route,
    send_tensors,
)
from dtdsl.parallel.mesh import build_groups
from dtdsl.reorder.intra import balance
from tests.dist import make_plan, run

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

def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.tensor(7, dtype=torch.int64),                        # 0-d
        torch.empty(0, 4),                                         # empty
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randn(4, generator=g, dtype=torch.float64),
        torch.arange(6, dtype=torch.int8).reshape(1, 2, 3),
        torch.randn(2, 2, generator=g).to(torch.complex64),
        torch.randn(4, 6, generator=g).t(),                        # not contiguous
        torch.tensor(1.5, dtype=torch.float16),                    # 0-d, 2 bytes
        torch.zeros(*([1] * MAX_NDIM)),
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def _many() -> list[torch.Tensor]:
    """More tensors than the header holds inline: the overflow part is used."""
    return [torch.full((i % 4, 2), float(i), dtype=torch.float64 if i % 2 else torch.float32)
            for i in range(B.INLINE_TENSORS + 5)]


def _roundtrip(tensors, max_bytes=B.DEFAULT_MAX_BYTES):
    header, extra, payload = B._encode(tensors, max_bytes)
    assert header.shape == (B.HEADER_LEN,)
    assert (extra is not None) == (len(tensors) > B.INLINE_TENSORS)
    count, total = B._check_header(header, max_bytes)
    return B._unpack(payload, B._check_specs(header, extra, count, total), "cpu")


def test_wire_encoding_round_trips_mixed_tensors():
    tensors = _mixed()
    _same(tensors, _roundtrip(tensors))
    assert _roundtrip([]) == []
    _same([torch.empty(0)], _roundtrip([torch.empty(0)]))
    _same(_many(), _roundtrip(_many()))
    out = _roundtrip([torch.ones(1, dtype=torch.uint8), torch.ones(2, dtype=torch.complex128)])
    assert out[1].data_ptr() % B.ALIGN == 0          # views start aligned


def test_wire_limits_raise_clear_errors():
    with pytest.raises(WireError, match="exceeds the limit of 100 bytes"):
        B._encode([torch.zeros(200, dtype=torch.uint8)], 100)
    with pytest.raises(WireError, match="dimensions; the limit"):
        B._encode([torch.zeros(*([1] * (MAX_NDIM + 1)))], 1 << 20)
    with pytest.raises(WireError, match="not supported"):
        B._encode([torch.zeros(2, dtype=torch.uint16)], 1 << 20)
    with pytest.raises(WireError, match="not a tensor"):
        B._encode([[1, 2]], 1 << 20)
    header, _, _ = B._encode([torch.zeros(10)], 1 << 20)
    with pytest.raises(WireError, match="announces 40 bytes; the limit is 8"):
        B._check_header(header, 8)

    def broken(index: int, value: int) -> torch.Tensor:
        bad = header.clone()
        bad[index] = value
        return bad

    with pytest.raises(WireError, match="bad magic"):
        B._check_header(broken(0, 12345), 1 << 20)
    with pytest.raises(WireError, match="announces 70000 tensors"):
        B._check_header(broken(1, 70000), 1 << 20)
    row = B._PREAMBLE                         # the first tensor's row
    with pytest.raises(WireError, match="unknown dtype code 99"):
        B._check_specs(broken(row, 99), None, 1, 40)
    with pytest.raises(WireError, match="ndim 9"):
        B._check_specs(broken(row + 1, 9), None, 1, 40)
    with pytest.raises(WireError, match="bad shape"):
        B._check_specs(broken(row + 2, -1), None, 1, 40)
    with pytest.raises(WireError, match="bad shape"):
        B._check_specs(broken(row + 3, 5), None, 1, 40)      # past ndim: must be 0
    with pytest.raises(WireError, match="beyond the tensor count"):
        B._check_specs(broken(row + B._WIDTH, 1), None, 1, 40)
    with pytest.raises(WireError, match="need 40 payload bytes"):
        B._check_specs(header, None, 1, 48)


# ---- wire format over gloo ----------------------------------------------------------------------

def _wire_ranks(rank: int, world: int) -> None:
    tensors = _mixed()
    other = [torch.arange(5.0), torch.tensor(3)] + _many()
    if rank == 0:
        # two messages on different tags, received in the opposite order
        works = send_tensors(tensors, 1, tag=4) + send_tensors(other, 1, tag=5)
        works += send_tensors([], 2, tag=0)
        for w in works:
            w.wait()
    elif rank == 1:
        _same(other, recv_tensors(0, tag=5))
        _same(tensors, recv_tensors(0, tag=4))
    else:
        assert recv_tensors(0, tag=0) == []
    # a broadcast of variable shapes from rank 1 to everyone
    got = broadcast_tensors(tensors if rank == 1 else None, 1)
    _same(tensors, got)
    got = broadcast_tensors([] if rank == 2 else None, 2)
    assert got == []
    _same(_many(), broadcast_tensors(_many() if rank == 0 else None, 0))


def test_wire_round_trip_over_gloo():
    run(_wire_ranks, 3)


def _wire_limit_ranks(rank: int, world: int) -> None:
    if rank == 0:
        for w in send_tensors([torch.zeros(64)], 1):
            w.wait()
    else:
        with pytest.raises(WireError, match="announces 256 bytes; the limit is 128"):
            recv_tensors(0, max_bytes=128)
        # the rejected message's payload is still on the way: drain it by hand
        dist.recv(torch.empty(256, dtype=torch.uint8), 0, tag=B._part(0, 2))


def test_receiver_enforces_its_size_limit():
    run(_wire_limit_ranks, 2)


# ---- broker (pure checks) -----------------------------------------------------------------------

PLAN_2_3 = make_plan(("vit", "encoder", 1, 2, 1), ("llm", "backbone", 1, 3, 1))


def test_broker_checks_edges_stages_and_samples():
    samples = StepSamples((1, 2, 3), {"vit": [0, 1, 0], "llm": [2, 1, 0]})
    consumer = Broker(PLAN_2_3, 2)
    with pytest.raises(RuntimeError, match=r"rank 2 \(llm.s0\) cannot send"):
        consumer.send_forward(0, "vit", "llm", {}, samples)
    with pytest.raises(ValueError, match="does not feed"):
        consumer.recv_forward(0, "llm", "vit", samples)
    with pytest.raises(KeyError, match="no unit 'sd'"):
        consumer.recv_forward(0, "vit", "sd", samples)
    producer = Broker(PLAN_2_3, 0)
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


def _broker_ranks(rank: int, world: int, units: tuple, producer: str, consumer: str) -> None:
    plan = make_plan(*units)
    groups = build_groups(plan)
    broker = Broker(plan, rank, groups)
    me = groups.role
    pg, cg = broker.grids[producer], broker.grids[consumer]
    steps = {j: _step_samples(j, producer, pg.dp, consumer, cg.dp) for j in range(STEPS)}

    if me.unit == producer and me.is_last_stage:
        works = []
        for j in range(STEPS):     # every step's sends in flight together
            mine = steps[j].samples_of(producer, me.replica)
            works += broker.send_forward(j, producer, consumer,
                                         {s: _activation(j, s) for s in mine}, steps[j])
        if not me.is_leader:
            assert works == []
        for w in works:
            w.wait()
        for j in reversed(range(STEPS)):   # tags keep out-of-order receives apart
            got = broker.recv_backward(j, producer, consumer, steps[j])
            mine = steps[j].samples_of(producer, me.replica)
            assert list(got) == list(mine)
            for s, g in got.items():
                assert torch.equal(g, _gradient(j, s)), (j, s)

    elif me.unit == consumer and me.is_first_stage:
        received = {}
        for j in reversed(range(STEPS)):
            got = broker.recv_forward(j, producer, consumer, steps[j])
            mine = steps[j].samples_of(consumer, me.replica)
            assert list(got) == list(mine), (j, me)
            for s, x in got.items():
                assert torch.equal(x, _activation(j, s)), (j, s)
            received[j] = got
        works = []
        for j in range(STEPS):
            works += broker.send_backward(
                j, producer, consumer, {s: -2.0 * x + 0.5 for s, x in received[j].items()},
                steps[j])
        if not me.is_leader:
            assert works == []
        for w in works:
            w.wait()
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


# ---- eager messages (one transfer for a small message) -----------------------------------------

def _eager_ranks(rank: int, world: int) -> None:
    small = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2, 3])]
    large = [torch.ones(B.EAGER_BYTES // 4 + 1)]                     # payload over the bound
    if rank == 0:
        works = send_tensors(small, 1, tag=1, eager=True)
        assert len(works) == 1                                      # one transfer
        works += send_tensors(large, 1, tag=2, eager=True)
        assert len(works) == 3                                      # header + payload
        works += send_tensors(_many(), 1, tag=3, eager=True)        # overflow rows: parts
        works += send_tensors([], 1, tag=4, eager=True)
        works += send_tensors(small, 1, tag=5)                      # a plain sender
        for w in works:
            w.wait()
    else:
        _same(small, recv_tensors(0, tag=1, eager=True))
        _same(large, recv_tensors(0, tag=2, eager=True))
        _same(_many(), recv_tensors(0, tag=3, eager=True))
        assert recv_tensors(0, tag=4, eager=True) == []
        _same(small, recv_tensors(0, tag=5, eager=True))            # eager receiver, plain msg


def test_eager_messages_round_trip_and_fall_back_over_gloo():
    run(_eager_ranks, 2)


def test_eager_header_is_checked_against_its_limits():
    header, _, _ = B._encode([torch.zeros(3)], B.DEFAULT_MAX_BYTES)
    header[0] = B.MAGIC_EAGER
    assert B._check_header(header, B.DEFAULT_MAX_BYTES, eager=True) == (1, 12)
    with pytest.raises(WireError, match="bad magic"):
        B._check_header(header, B.DEFAULT_MAX_BYTES)               # not an eager receiver
    header[2] = B.EAGER_BYTES + 16
    with pytest.raises(WireError, match="eager message"):
        B._check_header(header, B.DEFAULT_MAX_BYTES, eager=True)
