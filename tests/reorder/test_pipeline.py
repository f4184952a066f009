"""Whole-pipeline inter-microbatch ordering (``dtdsl.reorder.pipeline``): the 1F1B chain
against an independent event-driven simulation, the orders against brute force on small
cases whose every stage varies, determinism and input checks."""

from __future__ import annotations

import heapq
import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtdsl.reorder import inter
from dtdsl.reorder.pipeline import (
    MAX_BRUTE_FORCE,
    OrderSearch,
    best_order,
    brute_force_order,
    candidate_orders,
    chain_1f1b,
)


def reference_1f1b(fwd, bwd, order) -> float:
    """An event-driven 1F1B simulation written independently of the module: each stage
    holds its action list; an action runs once its stage is free and its input arrived
    (the previous stage's forward, the next stage's backward), events in time order."""
    p, m = len(fwd), len(fwd[0])
    seqs = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        seqs.append(seq)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    events = [(0.0, s) for s in range(p)]
    heapq.heapify(events)
    end = 0.0
    while events:
        _, s = heapq.heappop(events)
        if nxt[s] >= len(seqs[s]):
            continue
        kind, k = seqs[s][nxt[s]]
        need = ("F", s - 1, k) if kind == "F" and s > 0 else \
            ("B", s + 1, k) if kind == "B" and s < p - 1 else None
        if need is not None and need not in done:
            continue    # woken again when the input is done
        start = max(free[s], done[need] if need else 0.0)
        dur = (fwd if kind == "F" else bwd)[s][order[k]]
        done[(kind, s, k)] = free[s] = start + dur
        end = max(end, free[s])
        nxt[s] += 1
        heapq.heappush(events, (free[s], s))
        for t in (s - 1, s + 1):   # a neighbour may have waited for this
            if 0 <= t < p:
                heapq.heappush(events, (free[s], t))
    assert all(nxt[s] == len(seqs[s]) for s in range(p)), "the reference deadlocked"
    return end


def varying_case(rng: np.random.Generator, m: int, p: int):
    """Every stage's time grows with its microbatch's work (the backbone's stages), stage 0
    with another (an encoder's), stages of different weights; backward about twice the
    forward."""
    work = rng.lognormal(0.0, 0.9, m)
    fwd = np.outer(rng.uniform(0.5, 1.5, p), work)
    fwd[0] = rng.lognormal(0.0, 1.0, m) * rng.uniform(0.2, 1.0)
    bwd = 2.0 * fwd * rng.uniform(0.8, 1.2, (p, 1))
    return fwd, bwd


@st.composite
def pipelines(draw, max_microbatches=7, max_stages=6):
    m = draw(st.integers(1, max_microbatches))
    p = draw(st.integers(1, max_stages))
    times = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
    fwd = draw(st.lists(st.lists(times, min_size=m, max_size=m), min_size=p, max_size=p))
    bwd = draw(st.lists(st.lists(times, min_size=m, max_size=m), min_size=p, max_size=p))
    order = draw(st.permutations(range(m)))
    return fwd, bwd, list(order)


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_chain_matches_an_event_driven_reference(case):
    fwd, bwd, order = case
    got = chain_1f1b(fwd, bwd, [order])[0]
    assert got == pytest.approx(reference_1f1b(fwd, bwd, order), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("m,p", [(1, 3), (5, 1), (8, 4), (20, 6)])
def test_chain_equals_disttrain_model_where_later_stages_are_uniform(m, p):
    """Where only stage 0 varies, the chain is ``reorder.inter``'s model."""
    rng = random.Random(m * 31 + p)
    f0 = [rng.lognormvariate(0.0, 0.7) for _ in range(m)]
    b0 = [2.0 * x for x in f0]
    f, b = 0.8, 1.7
    fwd = np.array([f0] + [[f] * m] * (p - 1))
    bwd = np.array([b0] + [[b] * m] * (p - 1))
    order = list(range(m))
    rng.shuffle(order)
    assert chain_1f1b(fwd, bwd, [order])[0] == pytest.approx(
        inter.simulate_1f1b(f0, b0, f, b, p, order), rel=1e-12)


def test_uniform_chain_takes_the_textbook_time():
    p, m, f, b = 5, 12, 1.0, 2.0
    t = chain_1f1b(np.full((p, m), f), np.full((p, m), b))[0]
    assert t == pytest.approx((m + p - 1) * (f + b))


def test_orders_against_brute_force_on_small_varying_pipelines():
    """m <= 6 microbatches, p in {2, 3}, every stage's time varying: our order is the best
    of every permutation (up to float rounding: the same time by another path); the
    candidates alone can be 10% off (the local search matters)."""
    rng = np.random.default_rng(0)
    ratios, candidate_ratios = [], []
    for _ in range(240):
        p = int(rng.integers(2, 4))
        m = int(rng.integers(2, 7))
        fwd, bwd = varying_case(rng, m, p)
        search = OrderSearch(fwd, bwd)
        optimum = search.times([brute_force_order(fwd, bwd)])[0]
        assert optimum == pytest.approx(min(search.times(
            [list(o) for o in itertools.permutations(range(m))])))
        _, ours = search.best()
        _, candidate = search.best_candidate()
        ratios.append(ours / optimum)
        candidate_ratios.append(candidate / optimum)
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-12
    assert ratios.max() <= 1 + 1e-12
    assert max(candidate_ratios) > 1.05


def test_never_worse_than_any_candidate_and_a_permutation():
    rng = np.random.default_rng(1)
    for m, p in [(1, 3), (2, 2), (9, 3), (40, 6), (70, 12)]:
        fwd, bwd = varying_case(rng, m, p)
        search = OrderSearch(fwd, bwd)
        order, t = search.best()
        assert sorted(order) == list(range(m))
        assert t == pytest.approx(search.times([order])[0], rel=0)
        candidates = candidate_orders(fwd, bwd)
        assert t <= search.times(list(candidates.values())).min() * (1 + 1e-12)


def test_candidates_are_length_grouped_shapes():
    size = np.array([5.0, 1.0, 4.0, 2.0, 3.0, 6.0])
    fwd = np.vstack([size, size]) / 3
    names = candidate_orders(fwd, 2 * fwd)
    ascending = [1, 3, 4, 2, 0, 5]
    assert names["ascending"] == ascending
    assert names["descending"] == ascending[::-1]
    hill = names["hill"]                 # the smallest at both ends, the largest inside
    assert {hill[0], hill[-1]} == {1, 3} and 5 not in (hill[0], hill[-1])
    assert names["disttrain sorted"][0] == 1 and names["disttrain sorted"][-1] == 3
    assert names["zig-zag"][:2] == [1, 5]
    # Sorting by the slowest stage and by the total agree here: no "by total" duplicates.
    assert not any(name.endswith("by total") for name in names)


def test_grouped_orders_beat_data_order_where_work_varies():
    """The issue's finding in the model: with the backbone's work varying per microbatch,
    a length-grouped order is far faster than an unsorted one, more so deeper."""
    rng = np.random.default_rng(2)
    work = rng.lognormal(0.0, 0.9, 64)
    gains = []
    for p in (2, 4, 11):
        fwd = np.tile(work, (p, 1)) / 3
        search = OrderSearch(fwd, 2 * fwd)
        data = search.times([list(range(64))])[0]
        gains.append(data / search.best()[1])
    assert gains[0] > 1.1 and gains[-1] > gains[0]


def test_deterministic():
    rng = np.random.default_rng(3)
    fwd, bwd = varying_case(rng, 48, 8)
    assert best_order(fwd, bwd) == best_order(fwd.tolist(), bwd.tolist())
    assert best_order(fwd, bwd, budget=0) == OrderSearch(fwd, bwd).best_candidate()[0]


@pytest.mark.parametrize("fwd,bwd,match", [
    ([[1.0, 2.0]], [[1.0]], "must both be"),
    ([1.0, 2.0], [1.0, 2.0], "must both be"),
    ([[]], [[]], "at least one"),
    ([[1.0, -1.0]], [[1.0, 1.0]], "finite and >= 0"),
    ([[1.0, float("nan")]], [[1.0, 1.0]], "finite and >= 0"),
])
def test_input_errors(fwd, bwd, match):
    with pytest.raises(ValueError, match=match):
        chain_1f1b(fwd, bwd)


def test_order_and_budget_errors():
    fwd = np.ones((2, 3))
    with pytest.raises(ValueError, match="not a permutation"):
        chain_1f1b(fwd, fwd, [[0, 0, 1]])
    with pytest.raises(ValueError, match="budget"):
        OrderSearch(fwd, fwd).improve([0, 1, 2], budget=float("inf"))
    with pytest.raises(ValueError, match=f"at most {MAX_BRUTE_FORCE}"):
        brute_force_order(np.ones((2, MAX_BRUTE_FORCE + 1)), np.ones((2, MAX_BRUTE_FORCE + 1)))
