"""``reorder.split.bubble_owners`` made fast (its greedy priced stage by stage, or as
numpy vectors on deep pipelines) against the plain greedy it replaced, kept here as the
reference (with the equal share it falls back to): the same owners and the same seconds,
to the bit, on many random pipelines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtdsl.reorder import split
from dtdsl.reorder.split import BubbleFit, bubble_exposure, bubble_owners, one_f_one_b_times
from tests.pipeline_ref import one_f_one_b_events

# ---- the reference: bubble_owners and its estimate as they were before the rewrite ------


def _ref_others(values: Sequence[float]) -> list[float]:
    if len(values) < 2:
        return [0.0] * len(values)
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)
    top, second = values[order[0]], values[order[1]]
    return [second if i == order[0] else top for i in range(len(values))]


class _RefBubbles:
    def __init__(self, fwd_s, bwd_s, m, hop_s):
        pp = len(fwd_s)
        # the times from the event loop of tests/pipeline_ref.py, not from split.py
        self.f_start, self.b_end = one_f_one_b_events(list(fwd_s), list(bwd_s), m, hop_s)
        self.end = max(self.b_end[s][-1] for s in range(pp))
        self.first = [self.f_start[s][0] for s in range(pp)]
        self.last = [self.b_end[s][-1] for s in range(pp)]
        self.last_fwd0 = self.f_start[0][m - 1] + fwd_s[0]
        self.enc_end = [0.0] * pp
        self.back = [0.0] * pp
        self.delays = [0.0] * pp
        self.overruns = [0.0] * pp

    def trial(self, s, j, ef, eb):
        t = self.enc_end[s] + ef
        if s == 0:
            d = t
            o = self.back[s] + eb
        else:
            d = max(self.delays[s], t - self.f_start[0][j], t - self.first[s])
            ready = max(self.b_end[0][j], self.last_fwd0 if s == 1 else 0.0)
            o = max(0.0, max(self.last[s], ready) + self.back[s] + eb - self.end)
        dl = max(_ref_others(self.delays)[s], d)
        ov = max(_ref_others(self.overruns)[s], o)
        return dl + ov, t, d, o

    def add(self, s, eb, t, d, o):
        self.enc_end[s], self.delays[s], self.overruns[s] = t, d, o
        self.back[s] += eb

    def exposed(self):
        return max(self.delays), max(self.overruns)


def _ref_owners(fwd_s, bwd_s, m, enc_fwd_s, enc_bwd_s, hop_s=0.0) -> BubbleFit:
    pp = len(fwd_s)
    if pp == 1:
        return BubbleFit((0,) * m, m * enc_fwd_s, m * enc_bwd_s)
    state = _RefBubbles(fwd_s, bwd_s, m, hop_s)
    owners = []
    for j in range(m):
        best = None
        for s in range(pp - 1, -1, -1):
            c, t, d, o = state.trial(s, j, enc_fwd_s, enc_bwd_s)
            if best is None or c < best[0] - 1e-12:
                best = (c, s, t, d, o)
        _, s, t, d, o = best
        owners.append(s)
        state.add(s, enc_bwd_s, t, d, o)
    fit = BubbleFit(tuple(owners), *state.exposed())
    # Past the bound of an equal share for every stage in order: that share, if better.
    if fit.exposed_f + fit.exposed_b > -(-m // pp) * (enc_fwd_s + enc_bwd_s):
        even = tuple(j * pp // m for j in range(m))
        state = _RefBubbles(fwd_s, bwd_s, m, hop_s)
        for j, s in enumerate(even):
            _, t, d, o = state.trial(s, j, enc_fwd_s, enc_bwd_s)
            state.add(s, enc_bwd_s, t, d, o)
        f, b = state.exposed()
        if f + b < fit.exposed_f + fit.exposed_b:
            return BubbleFit(even, f, b)
    return fit


# ---- the comparisons --------------------------------------------------------------------

def _same(a: BubbleFit, b: BubbleFit) -> None:
    assert a.owners == b.owners
    # to the bit (repr shows the sign of a zero and every digit)
    assert (repr(a.exposed_f), repr(a.exposed_b)) == (repr(b.exposed_f), repr(b.exposed_b))
    assert type(a.exposed_f) is float and type(a.exposed_b) is float


# Seconds drawn from a few values, so that ties (exact, and within the tie tolerance)
# are common, and from anywhere.
_TIED = st.sampled_from([0.0, 1.0, 1.0 + 4e-13, 1.0 - 4e-13, 2.0, 0.5, 3.0, 1e-12])
_SECONDS = st.one_of(_TIED, st.floats(0.0, 50.0, allow_nan=False, allow_subnormal=False))


@settings(max_examples=400, deadline=None)
@given(pp=st.integers(1, 30), m=st.integers(1, 40), data=st.data())
def test_owners_are_the_reference_greedys(pp, m, data):
    fwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    bwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    ef, eb, hop = (data.draw(_SECONDS) for _ in range(3))
    _same(bubble_owners(fwd, bwd, m, ef, eb, hop), _ref_owners(fwd, bwd, m, ef, eb, hop))


@pytest.mark.parametrize("wide", [2, 10 ** 6])
@settings(max_examples=150, deadline=None)
@given(pp=st.integers(2, 16), m=st.integers(1, 24), data=st.data())
def test_both_greedies_are_the_reference(wide, pp, m, data):
    """Either way of pricing a step's stages, on the same pipelines (the switch between
    them moved to the extremes: every depth through one, then through the other)."""
    fwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    bwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    ef, eb = data.draw(_SECONDS), data.draw(_SECONDS)
    with mock.patch.object(split, "_WIDE_STAGES", wide):
        got = bubble_owners(fwd, bwd, m, ef, eb)
    _same(got, _ref_owners(fwd, bwd, m, ef, eb))


def test_paper_scale_shapes_are_the_reference_greedys():
    """Deep pipelines of many microbatches (the 72b search prices up to 80 stages), the
    stages' seconds uneven as a split's are."""
    import random

    rng = random.Random(7)
    for pp, m in ((80, 48), (40, 60), (27, 90), (12, 80), (3, 20)):
        fwd = [rng.uniform(0.01, 0.05) for _ in range(pp)]
        bwd = [2 * f + rng.uniform(0.0, 0.01) for f in fwd]
        for ef in (0.0, 0.002, 0.02, 0.3):
            _same(bubble_owners(fwd, bwd, m, ef, 2.5 * ef),
                  _ref_owners(fwd, bwd, m, ef, 2.5 * ef))


@settings(max_examples=100, deadline=None)
@given(pp=st.integers(2, 12), m=st.integers(1, 16), data=st.data())
def test_the_exposure_of_the_greedys_owners_is_its_estimate(pp, m, data):
    """``bubble_exposure`` (the unchanged estimate, per step's work) of the owners at
    every step's same work prices them as the greedy did."""
    fwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    bwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    ef, eb = data.draw(_SECONDS), data.draw(_SECONDS)
    fit = bubble_owners(fwd, bwd, m, ef, eb)
    got = bubble_exposure(fwd, bwd, fit.owners, [ef] * m, [eb] * m)
    assert (repr(got[0]), repr(got[1])) == (repr(fit.exposed_f), repr(fit.exposed_b))


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 20), m=st.integers(1, 30), data=st.data())
def test_times_are_the_event_loops_on_tied_seconds(pp, m, data):
    fwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    bwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    hop = data.draw(_SECONDS)
    assert one_f_one_b_times(fwd, bwd, m, hop) == one_f_one_b_events(fwd, bwd, m, hop)


@settings(max_examples=150, deadline=None)
@given(pp=st.integers(1, 20), m=st.integers(1, 30), data=st.data())
def test_times_without_a_hop_are_the_event_loops(pp, m, data):
    """``one_f_one_b_times`` leaves a zero hop out of its sums (the planner's case): the
    same floats as the event loop's, which adds it."""
    fwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    bwd = data.draw(st.lists(_SECONDS, min_size=pp, max_size=pp))
    assert one_f_one_b_times(fwd, bwd, m, 0.0) == one_f_one_b_events(fwd, bwd, m, 0.0)


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (1, 5), (2, 1), (4, 3), (5, 16), (13, 7)])
def test_every_pass_waits_on_passes_timed_before_it(pp, m):
    """``_flat_order``: each pass once, after its stage's previous pass and its input
    (or on the 0.0 cell), with the hop exactly where its input crossed a stage."""
    n = pp * m
    outs, prevs, deps, durs, hops = split._flat_order(pp, m)
    assert sorted(outs) == list(range(2 * n))
    done = {2 * n}
    for o, p, d, t, h in zip(outs, prevs, deps, durs, hops, strict=True):
        assert p in done and d in done
        backward, s = o >= n, (o % n) // m
        assert t == (pp + s if backward else s)
        want = (o + m if s < pp - 1 else o - n) if backward else \
            (o - m if s > 0 else 2 * n)
        assert (d, h) == (want, int(want != 2 * n and want != o - n))
        done.add(o)


def test_no_nan_is_taken_for_a_time():
    assert not math.isnan(bubble_owners([1.0] * 14, [2.0] * 14, 30, 0.5, 1.0).exposed_f)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 9), data=st.data())
def test_the_kept_top_two_are_the_others_of_every_value(n, data):
    """``_TopTwo``, kept as values grow and shrink (a greedy's delays only grow), gives
    every index the reference's largest other value."""
    kept = split._TopTwo(n)
    values = [0.0] * n
    for _ in range(data.draw(st.integers(1, 30))):
        i = data.draw(st.integers(0, n - 1))
        values[i] = data.draw(st.one_of(_TIED, st.floats(-5.0, 5.0, allow_nan=False)))
        kept.set(i, values[i])
        got = [kept.second if k == kept.at else kept.top for k in range(n)]
        assert got == _ref_others(values)
