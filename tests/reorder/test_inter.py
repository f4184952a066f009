"""Inter-microbatch reordering for 1F1B: the simulator against an independent event-loop
reference and the uniform closed form, the timeline, the policies' guarantees, the issue's
quality targets (within 1% of brute force up to 8 microbatches; no worse than the best of
200 random orders at 64 x 8), DistTrain's order, the report, and input errors."""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtdsl.reorder import inter
from dtdsl.reorder.inter import (
    MAX_BRUTE_FORCE,
    best_order,
    brute_force_order,
    disttrain_order,
    improve_order,
    report,
    simulate_1f1b,
    timeline_1f1b,
)

# DTDSL_PROPERTY_EXAMPLES=5000 for a longer soak than CI's default.
PROPERTY_SETTINGS = settings(max_examples=int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 150)),
                             deadline=None, suppress_health_check=list(HealthCheck))
REL = 1e-9   # the simulators add the same times in different orders


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=REL)


# ---------------------------------------------------------------------------------------------
# The reference: a discrete-event loop written from the model, sharing nothing with inter.py


def reference_1f1b(fwd, bwd, stage_forward, stage_backward, stages, order=None):
    """(iteration time, {(stage, kind, microbatch): (start, end)}).

    Every stage keeps a queue of its actions: min(P-1-s, m) warm-up forwards, one forward
    and one backward alternately, the remaining backwards. An idle stage starts its next
    action as soon as what it waits for has ended: forward i on the stage before, backward i
    on the stage after (the last stage: its own forward i)."""
    m, p = len(fwd), stages
    order = list(range(m)) if order is None else list(order)
    queues = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        queue = [("F", k) for k in range(warmup)]
        for k in range(m - warmup):
            queue += [("F", warmup + k), ("B", k)]
        queue += [("B", k) for k in range(m - warmup, m)]
        queues.append(queue)

    def duration(s, kind, k):
        if s == 0:
            return fwd[order[k]] if kind == "F" else bwd[order[k]]
        return stage_forward if kind == "F" else stage_backward

    def waits_for(s, kind, k):
        if kind == "F":
            return (s - 1, "F", k) if s > 0 else None
        return (s + 1, "B", k) if s < p - 1 else (s, "F", k)

    ended: dict[tuple[int, str, int], float] = {}
    spans = {}
    nxt, busy = [0] * p, [False] * p
    events: list[tuple[float, int, int]] = []   # (end time, tie-break, stage)
    now, count = 0.0, 0

    def start_ready():
        nonlocal count
        for s in range(p):
            if busy[s] or nxt[s] == len(queues[s]):
                continue
            kind, k = queues[s][nxt[s]]
            dep = waits_for(s, kind, k)
            if dep is None or dep in ended:
                busy[s] = True
                end = now + duration(s, kind, k)
                spans[(s, kind, order[k])] = (now, end)
                heapq.heappush(events, (end, count, s))
                count += 1

    start_ready()
    while events:
        now, _, s = heapq.heappop(events)
        kind, k = queues[s][nxt[s]]
        ended[(s, kind, k)] = now
        busy[s] = False
        nxt[s] += 1
        start_ready()
    assert all(n == len(q) for n, q in zip(nxt, queues, strict=True)), "deadlock"
    return max(end for _, end in spans.values()), spans


def reference_time(fwd, bwd, f, b, p, order=None) -> float:
    return reference_1f1b(fwd, bwd, f, b, p, order)[0]


def by_size(fwd, bwd):
    return sorted(range(len(fwd)), key=lambda i: (fwd[i] + bwd[i], fwd[i], i))


# ---------------------------------------------------------------------------------------------
# Strategies and seeded cases

_time = st.one_of(st.just(0.0), st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False),
                  st.integers(0, 4).map(float))   # repeated values give ties


@st.composite
def pipelines(draw, max_microbatches=9, max_stages=8):
    """(forward, backward, stage_forward, stage_backward, stages, order)."""
    m = draw(st.integers(1, max_microbatches))
    p = draw(st.integers(1, max_stages))
    fwd = draw(st.lists(_time, min_size=m, max_size=m))
    bwd = draw(st.lists(_time, min_size=m, max_size=m))
    order = draw(st.permutations(range(m)))
    return fwd, bwd, draw(_time), draw(_time), p, order


def encoder_case(rng: random.Random, m: int, p: int, sigma: float = 0.6):
    """Lognormal stage-0 forwards, backwards about twice those, the uniform stages around
    the mean stage-0 times (scaled 0.5..1.5: encoder- and backbone-bound both occur)."""
    fwd = [rng.lognormvariate(0.0, sigma) for _ in range(m)]
    bwd = [2.0 * f * rng.uniform(0.8, 1.2) for f in fwd]
    scale = rng.uniform(0.5, 1.5)
    return fwd, bwd, scale * sum(fwd) / m, scale * sum(bwd) / m, p


# ---------------------------------------------------------------------------------------------
# Simulation


@PROPERTY_SETTINGS
@given(pipelines())
def test_simulate_matches_reference(case):
    fwd, bwd, f, b, p, order = case
    assert close(simulate_1f1b(fwd, bwd, f, b, p, order), reference_time(fwd, bwd, f, b, p, order))


@pytest.mark.parametrize(("m", "p"), [(1, 1), (5, 1), (1, 4), (3, 8), (8, 8), (40, 8), (200, 16)])
def test_simulate_matches_reference_seeded(m, p):
    """Fewer microbatches than stages, one stage, and longer pipelines than hypothesis draws."""
    rng = random.Random(m * 100 + p)
    fwd, bwd, f, b, _ = encoder_case(rng, m, p, sigma=1.0)
    order = rng.sample(range(m), m)
    assert close(simulate_1f1b(fwd, bwd, f, b, p, order), reference_time(fwd, bwd, f, b, p, order))
    assert close(simulate_1f1b(fwd, bwd, f, b, p), reference_time(fwd, bwd, f, b, p))


@PROPERTY_SETTINGS
@given(st.integers(1, 12), st.integers(1, 10), _time, _time)
def test_uniform_times_closed_form(m, p, f, b):
    """All times equal: (m + P - 1) (f + b), whatever the order, also with m < P."""
    expected = (m + p - 1) * (f + b)
    assert close(simulate_1f1b([f] * m, [b] * m, f, b, p), expected)
    assert close(reference_time([f] * m, [b] * m, f, b, p), expected)
    assert close(simulate_1f1b([f] * m, [b] * m, f, b, p, list(range(m))[::-1]), expected)


def test_one_stage_is_the_sum():
    fwd, bwd = [1.0, 2.0, 3.0], [0.5, 4.0, 0.0]
    assert simulate_1f1b(fwd, bwd, 7.0, 9.0, 1, [2, 0, 1]) == pytest.approx(10.5)


@PROPERTY_SETTINGS
@given(pipelines())
def test_timeline_matches_simulate_and_reference(case):
    fwd, bwd, f, b, p, order = case
    lanes = timeline_1f1b(fwd, bwd, f, b, p, order)
    total, spans = reference_1f1b(fwd, bwd, f, b, p, order)
    assert len(lanes) == p
    assert close(max(end for lane in lanes for *_, end in lane),
                 simulate_1f1b(fwd, bwd, f, b, p, order))
    assert close(max(end for lane in lanes for *_, end in lane), total)
    for s, lane in enumerate(lanes):
        assert sorted((kind, i) for kind, i, _, _ in lane) == sorted(
            [("F", i) for i in range(len(fwd))] + [("B", i) for i in range(len(fwd))])
        for (_, _, _, end), (_, _, start, _) in itertools.pairwise(lane):
            assert start >= end - REL   # one action at a time, in the listed order
        for kind, i, start, end in lane:
            ref_start, ref_end = spans[(s, kind, i)]
            assert close(start, ref_start) and close(end, ref_end)


# ---------------------------------------------------------------------------------------------
# Policies: permutations and never worse than what they start from


def _is_permutation(order, m):
    return sorted(order) == list(range(m)) and all(type(i) is int for i in order)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(pipelines(max_microbatches=20, max_stages=8))
def test_policies_return_permutations_never_worse(case):
    fwd, bwd, f, b, p, start = case
    m = len(fwd)
    best = best_order(fwd, bwd, f, b, p)
    improved = improve_order(start, fwd, bwd, f, b, p)
    dist = disttrain_order(fwd, bwd, p, f, b)
    for order in (best, improved, dist, disttrain_order(fwd, bwd, p)):
        assert _is_permutation(order, m)
    t_best = reference_time(fwd, bwd, f, b, p, best)
    ascending = by_size(fwd, bwd)
    for other in (dist, list(range(m)), ascending, ascending[::-1]):
        assert t_best <= reference_time(fwd, bwd, f, b, p, other) * (1 + REL) + REL
    assert (reference_time(fwd, bwd, f, b, p, improved)
            <= reference_time(fwd, bwd, f, b, p, start) * (1 + REL) + REL)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(pipelines(max_microbatches=6, max_stages=6))
def test_brute_force_is_optimal(case):
    """Against every permutation, each simulated by the reference."""
    fwd, bwd, f, b, p, _ = case
    m = len(fwd)
    order = brute_force_order(fwd, bwd, f, b, p)
    assert _is_permutation(order, m)
    optimum = min(reference_time(fwd, bwd, f, b, p, perm)
                  for perm in itertools.permutations(range(m)))
    assert close(reference_time(fwd, bwd, f, b, p, order), optimum)
    # No order is below the bound that stops the search early.
    assert inter._lower_bound(fwd, bwd, f, b, p) <= optimum * (1 + REL) + REL


def test_longer_pipelines_use_the_windowed_neighbourhood():
    """Beyond 64 microbatches the search moves only nearby and end positions."""
    fwd, bwd, f, b, p = encoder_case(random.Random(11), 96, 6, sigma=1.0)
    best = best_order(fwd, bwd, f, b, p)
    assert _is_permutation(best, 96)
    t_best = simulate_1f1b(fwd, bwd, f, b, p, best)
    ascending = by_size(fwd, bwd)
    for other in (disttrain_order(fwd, bwd, p, f, b), list(range(96)), ascending,
                  ascending[::-1]):
        assert t_best <= simulate_1f1b(fwd, bwd, f, b, p, other)
    assert t_best < simulate_1f1b(fwd, bwd, f, b, p, disttrain_order(fwd, bwd, p, f, b))
    assert close(t_best, reference_time(fwd, bwd, f, b, p, best))


@pytest.mark.parametrize(("m", "window", "ends", "reach"), [(2, 2, 0, 2), (7, 7, 0, 7),
                                                             (30, 3, 4, 6), (30, 5, 0, 5)])
def test_moves_simulated_as_applied(m, window, ends, reach):
    """The local search simulates each move from a sparse list of changed positions and
    applies it by the microbatches it names: both must be the same order."""
    rng = np.random.default_rng(m + window)
    fwd, bwd = list(rng.lognormal(0, 1, m)), list(rng.lognormal(0, 1, m))
    evaluator = inter._Evaluator(fwd, bwd, 0.7, 1.3, 5)
    moves = inter._Neighbourhood(m, window, ends, reach, 64)
    orders = [rng.permutation(m), rng.permutation(m)]
    some = np.arange(0, moves.size, 2)
    times, sums = evaluator.neighbours(orders, [moves.changes(np.arange(moves.size)),
                                                moves.changes(some)])
    for k, (order, move) in enumerate([(orders[0], j) for j in range(moves.size)]
                                      + [(orders[1], j) for j in some]):
        applied = [int(i) for i in order]
        moves.apply(applied, order, move)
        as_array, where = order.copy(), np.argsort(order)
        moves.apply_array(as_array, where, order, move)
        assert as_array.tolist() == applied and (where == np.argsort(as_array)).all()
        a, b = moves.a[move], moves.b[move]
        expected = [int(i) for i in order]
        if moves.is_swap[move]:
            expected[a], expected[b] = expected[b], expected[a]
        else:
            expected.insert(b, expected.pop(a))
        assert applied == expected
        assert (times[k], sums[k]) == evaluator.one(applied)   # the very same floats
        assert abs(a - b) <= window or min(a, b) < ends or max(a, b) >= m - ends
        assert moves.is_swap[move] or abs(a - b) <= reach
    assert len(set(zip(moves.a, moves.b, moves.is_swap, strict=True))) == moves.size


# ---------------------------------------------------------------------------------------------
# Patched evaluation (beyond 64 microbatches): against whole walks

PATCHED_CASES = [(65, 2, 1.0), (96, 6, 0.6), (200, 16, 1.3), (300, 8, 1.0), (120, 40, 0.8),
                 (130, 65, 1.0), (70, 70, 1.0), (1024, 8, 1.0)]


def _patched_setup(m, p, scale, seed=0):
    rng = random.Random(seed)
    fwd, bwd, f, b, _ = encoder_case(rng, m, p, sigma=1.0)
    f, b = f * scale, b * scale
    evaluator = inter._Evaluator(fwd, bwd, f, b, p)
    order = np.random.default_rng(seed).permutation(m)
    return evaluator, inter._neighbourhood(m, p), order


def _rel(x, y):
    return float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / np.maximum(1.0, np.abs(y))))


@pytest.mark.parametrize(("m", "p", "scale"), PATCHED_CASES)
def test_walked_is_the_walk(m, p, scale):
    """The order's state at every pair boundary, kept up to date from the first change:
    its time and tie-breaker the very floats of a whole walk."""
    evaluator, moves, order = _patched_setup(m, p, scale)
    walked = inter._Walked(evaluator, order)
    assert (walked.time, walked.sum) == evaluator.one(order)
    other = order.copy()
    moves.apply_array(other, np.argsort(other), order, moves.size // 2)
    other[[m - 1, m // 3]] = other[[m // 3, m - 1]]
    walked.update(other)
    assert (walked.time, walked.sum) == evaluator.one(other)
    fresh = inter._Walked(evaluator, other)
    for name in ("t", "p", "acc", "fpad", "bpad"):
        assert np.array_equal(getattr(walked, name), getattr(fresh, name)), name


@pytest.mark.parametrize(("m", "p", "scale"), PATCHED_CASES)
def test_patched_moves_match_whole_walks(m, p, scale):
    """Every move of a few chunks, evaluated as patches of the order, against whole walks of
    the moved orders: the same times and tie-breakers up to float rounding."""
    evaluator, moves, order = _patched_setup(m, p, scale)
    walked = inter._Walked(evaluator, order)
    chosen = np.concatenate([moves.chunks[0], moves.chunks[-1]])[:3000]
    times, sums = moves.patches(evaluator, chosen).evaluate(walked, len(chosen))
    whole_t, whole_s = evaluator.neighbours([order], [moves.changes(chosen)])
    assert _rel(times, whole_t) < 1e-12 and _rel(sums, whole_s) < 1e-12


@pytest.mark.parametrize(("m", "p", "scale"), PATCHED_CASES)
def test_prefix_orders_match_whole_walks(m, p, scale):
    """The orders ``_take`` tries (each one more move than the one before), evaluated by
    clusters of changes, against whole walks; also far-apart and clustered changes."""
    evaluator, moves, order = _patched_setup(m, p, scale, seed=1)
    rng = np.random.default_rng(m)
    trial, where, tried, named = order.copy(), np.argsort(order), [], set()
    for move in rng.integers(0, moves.size, 400):
        x, y = int(order[moves.a[move]]), int(order[moves.b[move]])
        if {x, y} & named:
            continue
        named |= {x, y}
        moves.apply_array(trial, where, order, move)
        tried.append(trial.copy())
        if len(tried) == 33:
            break
    tried.append(order[::-1].copy())      # every position changed
    tried.append(rng.permutation(m))
    tried = np.array(tried)
    walked = inter._Walked(evaluator, order)
    times, sums = inter._prefix_times(evaluator, walked, tried)
    whole_t, whole_s = evaluator(tried)
    assert _rel(times, whole_t) < 1e-12 and _rel(sums, whole_s) < 1e-12


@pytest.mark.parametrize(("m", "p", "sigma"), [(65, 2, 1.0), (70, 70, 0.6), (130, 65, 1.0),
                                               (200, 3, 0.6)])
def test_patched_searches_never_worse(m, p, sigma):
    """Patched local searches (also with as many stages as microbatches) return an order no
    worse than the starts, its time exact against the reference."""
    fwd, bwd, f, b, p = encoder_case(random.Random(m + p), m, p, sigma)
    best = best_order(fwd, bwd, f, b, p)
    assert _is_permutation(best, m)
    t_best = simulate_1f1b(fwd, bwd, f, b, p, best)
    ascending = by_size(fwd, bwd)
    for other in (disttrain_order(fwd, bwd, p, f, b), list(range(m)), ascending,
                  ascending[::-1]):
        assert t_best <= simulate_1f1b(fwd, bwd, f, b, p, other)
    assert close(t_best, reference_time(fwd, bwd, f, b, p, best))
    start = list(range(m))[::-1]
    improved = improve_order(start, fwd, bwd, f, b, p, max_passes=20)
    assert simulate_1f1b(fwd, bwd, f, b, p, improved) <= simulate_1f1b(fwd, bwd, f, b, p, start)


def test_patches_that_do_not_couple_are_walked_further(monkeypatch):
    """A patch whose state has not coupled by its end is walked again with a longer
    horizon; the prefix orders then fall back to whole candidates. Forced here: every
    first walk reports all its candidates uncoupled."""
    evaluator, moves, order = _patched_setup(300, 8, 1.0)
    walked = inter._Walked(evaluator, order)
    run = inter._Patches._run
    calls = []

    def uncoupled_once(self, base, num_candidates):
        times, sums, uncoupled = run(self, base, num_candidates)
        calls.append(self.horizon)
        if len(calls) == 1:
            uncoupled = np.unique(self.cand)
        return times, sums, uncoupled

    monkeypatch.setattr(inter._Patches, "_run", uncoupled_once)
    chosen = moves.chunks[0]
    times, sums = moves.patches(evaluator, chosen).evaluate(walked, len(chosen))
    whole_t, whole_s = evaluator.neighbours([order], [moves.changes(chosen)])
    assert calls[1] > calls[0]
    assert _rel(times, whole_t) < 1e-12 and _rel(sums, whole_s) < 1e-12
    calls.clear()
    tried = np.array([np.roll(order, k) for k in range(1, 5)])
    times, sums = inter._prefix_times(evaluator, walked, tried)
    whole_t, whole_s = evaluator(tried)
    assert len(calls) >= 3   # clusters (reported uncoupled), their retry, whole orders
    assert _rel(times, whole_t) < 1e-12 and _rel(sums, whole_s) < 1e-12


def test_1024_microbatches():
    """Issue 18 item 6: 1024 microbatches x 8 stages, lognormal(0, 0.6) forwards and
    backwards twice those: the result no worse than the starts and exact (its time is
    benchmarks/reorder_inter.py's to measure: about 1 s of CPU on a quiet machine, the
    whole walks took about 12 s; the suite asserts no timings)."""
    rng = random.Random(0)
    m, p = 1024, 8
    fwd = [rng.lognormvariate(0.0, 0.6) for _ in range(m)]
    bwd = [2.0 * x for x in fwd]
    f, b = sum(fwd) / m, sum(bwd) / m
    order = best_order(fwd, bwd, f, b, p)
    assert _is_permutation(order, m)
    ours = simulate_1f1b(fwd, bwd, f, b, p, order)
    assert ours < simulate_1f1b(fwd, bwd, f, b, p, disttrain_order(fwd, bwd, p, f, b))
    assert ours < simulate_1f1b(fwd, bwd, f, b, p) * 0.95


def test_policies_are_deterministic():
    fwd, bwd, f, b, p = encoder_case(random.Random(7), 48, 8)
    assert best_order(fwd, bwd, f, b, p) == best_order(fwd, bwd, f, b, p)
    start = list(range(48))[::-1]
    assert improve_order(start, fwd, bwd, f, b, p) == improve_order(start, fwd, bwd, f, b, p)


def test_budgets_still_return_permutations():
    fwd, bwd, f, b, p = encoder_case(random.Random(3), 40, 6)
    for kwargs in ({"budget_s": 0.0}, {"max_passes": 0}, {"max_passes": 1}):
        order = best_order(fwd, bwd, f, b, p, **kwargs)
        assert _is_permutation(order, 40)
        assert (simulate_1f1b(fwd, bwd, f, b, p, order)
                <= simulate_1f1b(fwd, bwd, f, b, p, disttrain_order(fwd, bwd, p, f, b)))
    assert improve_order(list(range(40)), fwd, bwd, f, b, p, max_passes=0) == list(range(40))


# ---------------------------------------------------------------------------------------------
# The targets


def test_within_one_percent_of_brute_force_up_to_8_microbatches():
    rng = random.Random(2024)
    gaps = []
    for _ in range(60):
        m, p = rng.randint(2, 8), rng.randint(2, 6)
        fwd, bwd, f, b, p = encoder_case(rng, m, p)
        optimum = simulate_1f1b(fwd, bwd, f, b, p, brute_force_order(fwd, bwd, f, b, p))
        ours = simulate_1f1b(fwd, bwd, f, b, p, best_order(fwd, bwd, f, b, p))
        assert ours >= optimum * (1 - REL)
        gaps.append(ours / optimum - 1)
    assert sum(gaps) / len(gaps) <= 0.01, f"mean gap {sum(gaps) / len(gaps):.4%}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_worse_than_best_of_200_random_orders_64x8(seed):
    rng = random.Random(seed)
    m, p = 64, 8
    fwd = [rng.lognormvariate(0.0, 0.6) for _ in range(m)]
    bwd = [2.0 * f for f in fwd]
    f, b = sum(fwd) / m, sum(bwd) / m
    ours = simulate_1f1b(fwd, bwd, f, b, p, best_order(fwd, bwd, f, b, p))
    shuffles = min(simulate_1f1b(fwd, bwd, f, b, p, rng.sample(range(m), m)) for _ in range(200))
    assert ours <= shuffles
    assert ours < simulate_1f1b(fwd, bwd, f, b, p)   # and better than no reordering


# ---------------------------------------------------------------------------------------------
# DistTrain's order


@pytest.mark.parametrize(("m", "p"), [(12, 4), (30, 8), (5, 8), (9, 2), (3, 3)])
def test_disttrain_smallest_first_next_smallest_last(m, p):
    rng = random.Random(m + 31 * p)
    fwd = [rng.lognormvariate(0.0, 0.8) for _ in range(m)]
    bwd = [rng.lognormvariate(0.7, 0.8) for _ in range(m)]
    order = disttrain_order(fwd, bwd, p)
    ranked = by_size(fwd, bwd)
    assert order[0] == ranked[0]
    tail = min(p - 1, m - 1)
    assert sorted(order[m - tail:]) == sorted(ranked[1:1 + tail])


def test_disttrain_defaults_to_mean_stage_times():
    rng = random.Random(5)
    fwd = [rng.lognormvariate(0.0, 0.6) for _ in range(24)]
    bwd = [2.0 * f for f in fwd]
    assert disttrain_order(fwd, bwd, 6) == disttrain_order(fwd, bwd, 6, sum(fwd) / 24,
                                                           sum(bwd) / 24)


# ---------------------------------------------------------------------------------------------
# The report


@pytest.mark.parametrize(("m", "p"), [(1, 1), (6, 3), (20, 5)])
def test_report(m, p):
    fwd, bwd, f, b, p = encoder_case(random.Random(m), m, p)
    out = report(fwd, bwd, f, b, p)
    assert set(out) == {"order", "iteration_time"}
    assert _is_permutation(out["order"], m)
    assert isinstance(out["iteration_time"], float)
    assert close(out["iteration_time"], reference_time(fwd, bwd, f, b, p, out["order"]))
    assert out["order"] == best_order(fwd, bwd, f, b, p)
    assert json.loads(json.dumps(out)) == out


# ---------------------------------------------------------------------------------------------
# Input errors


GOOD = ([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1.0, 2.0, 2)


def _policies():
    """Every public entry point, called with (forward, backward, f, b, stages) and extras."""
    return [
        ("simulate", lambda fw, bw, f, b, p, **kw: simulate_1f1b(fw, bw, f, b, p, **kw)),
        ("timeline", lambda fw, bw, f, b, p, **kw: timeline_1f1b(fw, bw, f, b, p, **kw)),
        ("best", lambda fw, bw, f, b, p: best_order(fw, bw, f, b, p)),
        ("improve", lambda fw, bw, f, b, p: improve_order(list(range(len(fw))), fw, bw, f, b, p)),
        ("disttrain", lambda fw, bw, f, b, p: disttrain_order(fw, bw, p, f, b)),
        ("brute", lambda fw, bw, f, b, p: brute_force_order(fw, bw, f, b, p)),
        ("report", lambda fw, bw, f, b, p: report(fw, bw, f, b, p)),
    ]


@pytest.mark.parametrize("name_fn", _policies(), ids=lambda nf: nf[0])
@pytest.mark.parametrize(("args", "match"), [
    (([1.0, 2.0], [1.0], 1.0, 1.0, 2), r"forward has 2 microbatches but backward has 1"),
    (([], [], 1.0, 1.0, 2), r"no microbatches"),
    (([1.0, -1.0], [1.0, 1.0], 1.0, 1.0, 2), r"forward\[1\] = -1\.0: times must be finite"),
    (([1.0, 1.0], [1.0, math.nan], 1.0, 1.0, 2), r"backward\[1\] = nan"),
    (([1.0, 1.0], [math.inf, 1.0], 1.0, 1.0, 2), r"backward\[0\] = inf"),
    (([1.0, "x"], [1.0, 1.0], 1.0, 1.0, 2), r"forward must be a sequence of numbers"),
    (([1.0], [1.0], -2.0, 1.0, 2), r"stage_forward = -2\.0: must be finite and >= 0"),
    (([1.0], [1.0], 1.0, math.nan, 2), r"stage_backward = nan"),
    (([1.0], [1.0], 1.0, 1.0, 0), r"stages = 0: write a whole number of pipeline stages >= 1"),
    (([1.0], [1.0], 1.0, 1.0, -3), r"stages = -3"),
    (([1.0], [1.0], 1.0, 1.0, 2.5), r"stages = 2\.5"),
    (([1.0], [1.0], 1.0, 1.0, True), r"stages = True"),
])
def test_input_errors(name_fn, args, match):
    _, fn = name_fn
    with pytest.raises(ValueError, match=match):
        fn(*args)


@pytest.mark.parametrize("order", [[0, 1], [0, 1, 1], [0, 1, 3], [2, 1, 0, 3], [0, 1, 2.0],
                                   [True, False, 2], "012"])
def test_orders_must_be_permutations(order):
    fwd, bwd, f, b, p = GOOD
    for call in (lambda: simulate_1f1b(fwd, bwd, f, b, p, order),
                 lambda: timeline_1f1b(fwd, bwd, f, b, p, order),
                 lambda: improve_order(order, fwd, bwd, f, b, p)):
        with pytest.raises(ValueError, match=r"is not a permutation of 0\.\.2"):
            call()


def test_numpy_inputs_are_accepted():
    fwd, bwd = np.array([1.0, 3.0, 2.0]), np.array([2.0, 6.0, 4.0])
    order = np.array([2, 0, 1])
    assert close(simulate_1f1b(fwd, bwd, np.float64(1.0), 2.0, np.int64(2), order),
                 reference_time(list(fwd), list(bwd), 1.0, 2.0, 2, [2, 0, 1]))
    assert _is_permutation(best_order(fwd, bwd, 1.0, 2.0, np.int64(2)), 3)


def test_brute_force_limit():
    m = MAX_BRUTE_FORCE + 1
    with pytest.raises(ValueError, match=rf"brute force over {m} microbatches .* at most "
                                         rf"{MAX_BRUTE_FORCE}"):
        brute_force_order([1.0] * m, [2.0] * m, 1.0, 2.0, 4)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"budget_s": -1.0}, r"budget_s = -1\.0"), ({"budget_s": math.nan}, r"budget_s = nan"),
    ({"max_passes": -1}, r"max_passes = -1"), ({"max_passes": True}, r"max_passes = True"),
])
def test_budget_errors(kwargs, match):
    fwd, bwd, f, b, p = GOOD
    with pytest.raises(ValueError, match=match):
        best_order(fwd, bwd, f, b, p, **kwargs)
    with pytest.raises(ValueError, match=match):
        improve_order([0, 1, 2], fwd, bwd, f, b, p, **kwargs)
