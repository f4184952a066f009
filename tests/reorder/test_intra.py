"""Intra-microbatch reordering over DP groups: group sizes, never worse than DistTrain's
greedy, the true optimum on tiny inputs (independent brute force), the quality targets on
skewed costs (mean ratio to the lower bound at most 1.002, worst at most 1.01), the time
target, determinism across processes, the report, and input errors."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtdsl.reorder import intra
from dtdsl.reorder.intra import balance, greedy_lpt, group_loads, lower_bound, report

ROOT = Path(__file__).resolve().parents[2]
# DTDSL_PROPERTY_EXAMPLES=5000 for a longer soak than CI's default.
PROPERTY_SETTINGS = settings(max_examples=int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 150)),
                             deadline=None, suppress_health_check=list(HealthCheck))
REL = 1e-12   # a bound and a load computed by different sums may differ in the last bit


# ---------------------------------------------------------------------------------------------
# Independent references


def sizes_of(n: int, groups: int) -> list[int]:
    return [n // groups + (1 if g < n % groups else 0) for g in range(groups)]


def loads_of(costs: list[float], assignment: list[int], groups: int) -> list[float]:
    out = [[] for _ in range(groups)]
    for c, g in zip(costs, assignment, strict=True):
        out[g].append(c)
    return [math.fsum(v) for v in out]


def bound_of(costs: list[float], groups: int) -> float:
    ascending = sorted(costs)
    cap = len(costs) // groups
    return max(math.fsum(costs) / groups,
               ascending[-1] + math.fsum(ascending[:max(cap - 1, 0)]))


def optimum(costs: list[float], groups: int) -> float:
    """The smallest maximum load over every assignment with the right group sizes (depth-first
    over samples, pruned by the best so far; groups with equal load and room are the same)."""
    sizes = sizes_of(len(costs), groups)
    best = math.inf
    loads, count = [0.0] * groups, [0] * groups

    def place(i: int) -> None:
        nonlocal best
        if max(loads) >= best:
            return
        if i == len(costs):
            best = max(loads)
            return
        seen = set()
        for g in range(groups):
            key = (loads[g], sizes[g] - count[g])
            if count[g] < sizes[g] and key not in seen:
                seen.add(key)
                loads[g] += costs[i]
                count[g] += 1
                place(i + 1)
                loads[g] -= costs[i]
                count[g] -= 1

    place(0)
    return best


def worst(costs: list[float], assignment: list[int], groups: int) -> float:
    return max(loads_of(costs, assignment, groups))


# ---------------------------------------------------------------------------------------------
# Skewed costs (benchmarks/reorder_intra.py draws the same)


from tests.reorder.costs import KINDS, draw  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Group sizes and the greedy


@pytest.mark.parametrize("n, groups", [(64, 8), (70, 8), (5, 8), (1, 1), (13, 4), (100, 7),
                                       (2048, 64), (2049, 64), (1000, 24)])
def test_group_sizes_are_exact(n, groups):
    costs = draw("lognormal-1.5", n, seed=n)
    for policy in (greedy_lpt, balance):
        assignment = policy(costs, groups)
        count = Counter(assignment)
        assert [count[g] for g in range(groups)] == sizes_of(n, groups), policy.__name__


def test_greedy_is_disttrains():
    # Largest first to the least-loaded group with room, ties to the lower index.
    assert greedy_lpt([1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 0, 1]
    # 5 -> 0, 4 -> 1, 3 -> 1, 3 -> 0, 2 -> 1 (now full), 1 -> 0 (the only room left).
    assert greedy_lpt([5.0, 1.0, 4.0, 2.0, 3.0, 3.0], 2) == [0, 0, 1, 1, 1, 0]
    # The first group has room for two, so it takes the largest and then the last sample:
    # 3/2 of the optimum, which gives the 2 a group of its own.
    costs = [2.0, 1.0, 1.0, 1.0]
    assert greedy_lpt(costs, 3) == [0, 1, 2, 0]
    assert worst(costs, balance(costs, 3), 3) == 2.0


def test_more_groups_than_samples():
    costs = [3.0, 1.0]
    assert balance(costs, 5) == [0, 1]
    assert lower_bound(costs, 5) == 3.0   # max(total / 5, largest)
    out = report(costs, 5)
    assert out["loads"] == [3.0, 1.0, 0.0, 0.0, 0.0] and out["ratio"] == 1.0


# ---------------------------------------------------------------------------------------------
# Never worse than greedy; the bound holds


_costs = st.one_of(
    st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=80),
    # Few distinct values: ties everywhere.
    st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 1e-9, 0.1 + 0.2]), min_size=1, max_size=80),
    st.lists(st.floats(1.0, 1e3).map(lambda v: v ** 3), min_size=1, max_size=80),
)


@PROPERTY_SETTINGS
@given(costs=_costs, groups=st.integers(1, 12))
def test_never_worse_than_greedy(costs, groups):
    ours = balance(costs, groups)
    greedy = greedy_lpt(costs, groups)
    count = Counter(ours)
    assert [count[g] for g in range(groups)] == sizes_of(len(costs), groups)
    assert worst(costs, ours, groups) <= worst(costs, greedy, groups)
    assert lower_bound(costs, groups) <= worst(costs, ours, groups) * (1 + REL)
    assert intra._sharper_bound(costs, groups) <= worst(costs, ours, groups) * (1 + REL)


# ---------------------------------------------------------------------------------------------
# Tiny inputs against the true optimum


def test_tiny_inputs_against_brute_force():
    rng = random.Random(20240611)
    ratios = []
    for _ in range(300):
        n, groups = rng.randint(1, 8), rng.randint(1, 5)
        kind = rng.choice(["uniform", "lognormal", "small integers"])
        if kind == "uniform":
            costs = [rng.uniform(0, 10) for _ in range(n)]
        elif kind == "lognormal":
            costs = [rng.lognormvariate(0, 1.5) for _ in range(n)]
        else:
            costs = [float(rng.randint(0, 5)) for _ in range(n)]
        best = optimum(costs, groups)
        assert lower_bound(costs, groups) <= best * (1 + REL), (costs, groups)
        # The search stops at the sharper bound: above the optimum it would stop too early.
        assert intra._sharper_bound(costs, groups) <= best * (1 + REL), (costs, groups)
        ours = worst(costs, balance(costs, groups), groups)
        assert ours >= best * (1 - REL)
        assert worst(costs, greedy_lpt(costs, groups), groups) >= ours
        ratios.append(ours / best if best > 0 else 1.0)
    assert max(ratios) <= 1.01
    assert sum(r <= 1 + 1e-9 for r in ratios) >= 0.99 * len(ratios)


# ---------------------------------------------------------------------------------------------
# Quality on skewed costs


@pytest.mark.parametrize("kind", KINDS)
def test_near_the_lower_bound_on_skewed_costs(kind):
    ratios = []
    for n, groups in [(64, 8), (256, 16), (256, 32), (1024, 32), (2048, 64)]:
        for seed in range(3):
            costs = draw(kind, n, seed)
            assignment = balance(costs, groups)
            ratios.append(worst(costs, assignment, groups) / bound_of(costs, groups))
    assert sum(ratios) / len(ratios) <= 1.002, ratios
    assert max(ratios) <= 1.01, ratios


def test_uneven_groups_are_balanced_too():
    for n, groups in [(1000, 24), (300, 7), (2047, 64)]:
        costs = draw("lognormal-1", n, seed=n)
        assert worst(costs, balance(costs, groups), groups) / bound_of(costs, groups) <= 1.01


# ---------------------------------------------------------------------------------------------
# Determinism


CASES = [("lognormal-1", 512, 16, 1), ("pareto-1.5", 300, 7, 2), ("mm-zipf-attn", 256, 32, 3)]


def _ties() -> list[float]:
    return [1.0] * 50 + [2.0] * 30 + [0.0] * 7


def test_same_costs_same_assignment():
    for kind, n, groups, seed in CASES:
        costs = draw(kind, n, seed)
        first = balance(costs, groups)
        assert balance(list(costs), groups) == first
        assert balance(np.array(costs), groups) == first
    assert balance(_ties(), 8) == balance(_ties(), 8)


@pytest.mark.parametrize("hash_seed", ["1", "4242"])
def test_same_assignment_in_another_process(hash_seed):
    inputs = [(draw(kind, n, seed), groups) for kind, n, groups, seed in CASES]
    inputs.append((_ties(), 8))
    code = ("import json, sys\n"
            "from dtdsl.reorder.intra import balance\n"
            "print(json.dumps([balance(c, g) for c, g in json.load(sys.stdin)]))\n")
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(inputs), env=env,
                          capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(done.stdout) == [balance(c, g) for c, g in inputs]


# ---------------------------------------------------------------------------------------------
# The report


def test_report_agrees_with_an_independent_recomputation():
    costs = draw("mm-zipf-attn", 300, seed=5)
    out = report(costs, 16)
    assert set(out) == {"assignment", "loads", "lower_bound", "ratio"}
    assert json.loads(json.dumps(out)) == out
    assert out["assignment"] == balance(costs, 16)
    assert out["loads"] == loads_of(costs, out["assignment"], 16)
    assert out["loads"] == group_loads(costs, out["assignment"], 16)
    assert out["lower_bound"] == pytest.approx(bound_of(costs, 16), rel=REL)
    assert out["ratio"] == pytest.approx(max(out["loads"]) / bound_of(costs, 16), rel=REL)
    assert 1.0 - REL <= out["ratio"] <= 1.01


def test_report_when_every_cost_is_zero():
    out = report([0.0, 0, 0.0], 2)
    assert out["lower_bound"] == 0.0 and out["ratio"] == 1.0 and out["loads"] == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Input errors


@pytest.mark.parametrize("costs, message", [
    ([], "costs is empty"),
    ([1.0, -1.0], r"costs\[1\] = -1.0: costs must be finite and >= 0 \(1 bad value"),
    ([float("nan"), 2.0], r"costs\[0\] = nan"),
    ([1.0, 2.0, float("inf"), -3.0], r"costs\[2\] = inf: .*\(2 bad value"),
    (np.array([1.0, -2.5]), r"costs\[1\] = -2.5"),
    (["3", 1.0], r"costs\[0\] = '3': costs must be numbers"),
    ([1.0, None], r"costs\[1\] = None"),
    (5, "costs must be a sequence of numbers"),
    ([1e308, 1e308], "add up to more than the largest float"),
    ([1, 10 ** 400], r"costs\[1\] is too large for a float"),
])
def test_bad_costs(costs, message):
    for call in (lambda: balance(costs, 2), lambda: greedy_lpt(costs, 2),
                 lambda: lower_bound(costs, 2), lambda: report(costs, 2),
                 lambda: group_loads(costs, [0, 0], 2)):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("groups", [0, -3, 2.0, True, "2", None])
def test_bad_groups(groups):
    for call in (lambda: balance([1.0, 2.0], groups), lambda: greedy_lpt([1.0], groups),
                 lambda: lower_bound([1.0], groups), lambda: report([1.0], groups)):
        with pytest.raises(ValueError, match=r"groups = .*whole number of data-parallel"):
            call()


def test_bad_assignment():
    with pytest.raises(ValueError, match="assignment has 1 entries for 2 samples"):
        group_loads([1.0, 2.0], [0], 2)
    with pytest.raises(ValueError, match=r"assignment\[1\] = 2: write a group index in 0..1"):
        group_loads([1.0, 2.0], [0, 2], 2)
    with pytest.raises(ValueError, match=r"assignment\[0\] = -1"):
        group_loads([1.0, 2.0], [-1, 0], 2)
