"""Splits of a step's items among groups: without reordering, contiguous runs
(``contiguous_split``); a phased encoder's microbatch steps among the stages of its
backbone replica's pipeline, in 1F1B's bubbles (``bubble_owners``).

Shared by the simulator's routing (``dtdsl.reorder.workload``) and the runtime's
(through ``dtdsl.data.batch.route_batch``), so predicted and measured runs route alike.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BubbleFit", "bubble_exposure", "bubble_owners", "contiguous_split",
           "one_f_one_b_times"]


def contiguous_split(n: int, groups: int) -> tuple[int, ...]:
    """The group of each of ``n`` items cut into ``groups`` contiguous runs whose sizes
    differ by at most one (the first ``n % groups`` are the longer)."""
    if groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    base, extra = divmod(n, groups)
    out: list[int] = []
    for g in range(groups):
        out += [g] * (base + (1 if g < extra else 0))
    return tuple(out)


@dataclass(frozen=True)
class BubbleFit:
    """A phased encoder's microbatches placed in a 1F1B pipeline's bubbles
    (``bubble_owners``): ``owners[j]``, the pipeline stage whose ranks encode microbatch
    step j's images (its forward before the stage's first action, its backward after the
    stage's last); ``exposed_f`` and ``exposed_b``, the seconds the estimate says the
    encoder's work still adds to the step before and after the pipeline (what did not fit)."""

    owners: tuple[int, ...]
    exposed_f: float
    exposed_b: float


def one_f_one_b_times(fwd_s: Sequence[float], bwd_s: Sequence[float], m: int,
                      hop_s: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """Start of every forward and end of every backward of plain 1F1B with ``m``
    microbatches over ``len(fwd_s)`` stages, stage s's passes taking ``fwd_s[s]`` and
    ``bwd_s[s]`` and every hop between stages ``hop_s``: (f_start[s][j], b_end[s][j]).
    Stage s runs min(pp - 1 - s, m) forwards, then alternates backward and forward
    (``schedule.lower``'s order). Each pass starts when its stage is free and its input
    has arrived; the passes are taken in ``_one_f_one_b_order``, which depends on the
    shape alone (the planner times many layouts of one shape)."""
    pp = len(fwd_s)
    n = pp * m
    # One table of pass ends (a forward's at its cell s * m + j, a backward's at n + cell,
    # a 0.0 at 2n for what waits on nothing) and one of starts: each pass starts at the
    # later of its stage's previous pass's end and its input's (plus the hop where the
    # input crossed a stage), the comparisons and sums of a pass-by-pass timing, so the
    # same floats. The planner times thousands of layouts: this loop is its core.
    end = [0.0] * (2 * n + 1)
    begin = [0.0] * (2 * n)
    durations = [*fwd_s, *bwd_s]
    outs, prevs, deps, durs, hops = _flat_order(pp, m)
    if hop_s == 0.0:
        # x + 0.0 is x for every time here (none is -0.0), so the hop is left out.
        for o, p, d, t in zip(outs, prevs, deps, durs, strict=True):
            start = end[p]
            ready = end[d]
            if ready > start:
                start = ready
            begin[o] = start
            end[o] = start + durations[t]
    else:
        hop_of = (0.0, hop_s)
        for o, p, d, t, h in zip(outs, prevs, deps, durs, hops, strict=True):
            start = end[p]
            ready = end[d] + hop_of[h]
            if ready > start:
                start = ready
            begin[o] = start
            end[o] = start + durations[t]
    return ([begin[s * m:(s + 1) * m] for s in range(pp)],
            [end[n + s * m:n + (s + 1) * m] for s in range(pp)])


def _one_f_one_b_order(pp: int, m: int) -> tuple[tuple[int, bool, int], ...]:
    """Every pass of 1F1B over ``pp`` stages and ``m`` microbatches as (stage, forward?,
    microbatch), each stage's in its own order and each after the pass it waits for on
    the neighbouring stage (the forward of the stage before, the backward of the stage
    after): an order in which ``one_f_one_b_times`` can time them one by one."""
    orders = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        order = [(True, j) for j in range(warm)]
        nf = warm
        for j in range(m):
            if nf < m:
                order.append((True, nf))
                nf += 1
            order.append((False, j))
        orders.append(order)
    pos = [0] * pp
    done_f = [[False] * m for _ in range(pp)]
    done_b = [[False] * m for _ in range(pp)]
    seq: list[tuple[int, bool, int]] = []
    while len(seq) < 2 * pp * m:
        moved = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                forward, j = orders[s][pos[s]]
                if forward and s > 0 and not done_f[s - 1][j]:
                    break
                if not forward and s < pp - 1 and not done_b[s + 1][j]:
                    break
                (done_f if forward else done_b)[s][j] = True
                seq.append((s, forward, j))
                pos[s] += 1
                moved = True
        if not moved:
            raise AssertionError("1F1B's order cannot deadlock")
    return tuple(seq)


@functools.lru_cache(maxsize=1024)
def _flat_order(pp: int, m: int) -> tuple[array, array, array, array, array]:
    """``_one_f_one_b_order`` as five compact arrays, one entry a pass, indices into
    ``one_f_one_b_times``' tables (n = pp * m): where the pass's end goes (cell
    s * m + j for a forward, n + cell for a backward), where its stage's previous pass
    ended and where its input did (2n, a 0.0, for none: a stage's first pass, the first
    stage's forwards, which wait on the data alone), its seconds (s for a forward, pp + s
    for a backward) and whether its input crossed a stage (a hop: a later stage's
    forward, an earlier stage's backward; the last stage's backward waits on its own
    forward). Kept for many shapes (the planner times hundreds of (pp, m) in one search,
    over and over), so small: 17 bytes a pass."""
    n = pp * m
    outs, prevs, deps, durs, hops = (array("i"), array("i"), array("i"), array("i"),
                                     array("b"))
    last = [2 * n] * pp
    for s, forward, j in _one_f_one_b_order(pp, m):
        k = s * m + j
        out = k if forward else n + k
        if forward:
            dep = k - m if s > 0 else 2 * n
            crossed = s > 0
        else:
            dep = n + k + m if s < pp - 1 else k
            crossed = s < pp - 1
        outs.append(out)
        prevs.append(last[s])
        deps.append(dep)
        durs.append(s if forward else pp + s)
        hops.append(1 if crossed else 0)
        last[s] = out
    return outs, prevs, deps, durs, hops


@functools.lru_cache(maxsize=1024)
def _times(fwd_s: tuple[float, ...], bwd_s: tuple[float, ...], m: int, hop_s: float
           ) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """``one_f_one_b_times``, read-only and kept: the planner prices the same backbone
    layout for many placements of its encoders."""
    f_start, b_end = one_f_one_b_times(fwd_s, bwd_s, m, hop_s)
    return tuple(map(tuple, f_start)), tuple(map(tuple, b_end))


def _others(values: Sequence[float]) -> list[float]:
    """For each index, the largest of the other values (0.0 when there is none)."""
    if len(values) < 2:
        return [0.0] * len(values)
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)
    top, second = values[order[0]], values[order[1]]
    return [second if i == order[0] else top for i in range(len(values))]


class _Bubbles:
    """The estimate ``bubble_owners`` fills: per stage, where its encoder forwards end,
    the worst delay they cause the first stage's forwards (or, on the first stage, its
    schedule's start), and how far its encoder backwards run past the pipeline's end."""

    def __init__(self, fwd_s: Sequence[float], bwd_s: Sequence[float], m: int,
                 hop_s: float) -> None:
        pp = len(fwd_s)
        self.f_start, self.b_end = _times(tuple(fwd_s), tuple(bwd_s), m, hop_s)
        self.end = max(self.b_end[s][-1] for s in range(pp))
        self.first = [self.f_start[s][0] for s in range(pp)]   # bubble before
        self.last = [self.b_end[s][-1] for s in range(pp)]     # bubble after
        # The first stage's last forward: its last message to stage 1 before the gradients.
        self.last_fwd0 = self.f_start[0][m - 1] + fwd_s[0]
        self.enc_end = [0.0] * pp
        self.back = [0.0] * pp
        self.delays = [0.0] * pp
        self.overruns = [0.0] * pp
        # The largest delay and overrun of every stage but s, for each s (``_others``):
        # a trial reads them in O(1), an ``add`` makes them again.
        self._delay_others = [0.0] * pp
        self._overrun_others = [0.0] * pp

    def trial(self, s: int, j: int, ef: float, eb: float) -> tuple[float, float, float, float]:
        """(estimated exposed seconds, encoder end, delay, overrun) with step j's encoder
        work on stage s: the worst forward delay plus the worst backward overrun."""
        t = self.enc_end[s] + ef
        if s == 0:
            d = t                                   # before its schedule's first action
            o = self.back[s] + eb                   # after its last
        else:
            d = max(self.delays[s], t - self.f_start[0][j], t - self.first[s])
            ready = max(self.b_end[0][j], self.last_fwd0 if s == 1 else 0.0)
            o = max(0.0, max(self.last[s], ready) + self.back[s] + eb - self.end)
        dl = max(self._delay_others[s], d)
        ov = max(self._overrun_others[s], o)
        return dl + ov, t, d, o

    def add(self, s: int, eb: float, t: float, d: float, o: float) -> None:
        self.enc_end[s], self.delays[s], self.overruns[s] = t, d, o
        self.back[s] += eb
        self._delay_others = _others(self.delays)
        self._overrun_others = _others(self.overruns)

    def exposed(self) -> tuple[float, float]:
        return max(self.delays), max(self.overruns)


def bubble_exposure(fwd_s: Sequence[float], bwd_s: Sequence[float], owners: Sequence[int],
                    enc_fwd_s: Sequence[float], enc_bwd_s: Sequence[float],
                    hop_s: float = 0.0) -> tuple[float, float]:
    """``bubble_owners``' estimate of the exposed (forward, backward) seconds of a given
    assignment ``owners`` with each microbatch step's own encoder seconds (a drawn batch's
    work, where the owners were chosen at mean work)."""
    m = len(owners)
    if len(fwd_s) == 1:
        return float(sum(enc_fwd_s)), float(sum(enc_bwd_s))
    state = _Bubbles(fwd_s, bwd_s, m, hop_s)
    for j, s in enumerate(owners):
        _, t, d, o = state.trial(s, j, enc_fwd_s[j], enc_bwd_s[j])
        state.add(s, enc_bwd_s[j], t, d, o)
    return state.exposed()


def bubble_owners(fwd_s: Sequence[float], bwd_s: Sequence[float], m: int,
                  enc_fwd_s: float, enc_bwd_s: float, hop_s: float = 0.0) -> BubbleFit:
    """Which pipeline stage encodes each of ``m`` microbatch steps of a phased encoder, so
    that its work hides in 1F1B's bubbles: stage s > 0 idles before its first forward
    (encode there, each microbatch's embeddings sent to the first stage as it is done,
    in time for the first stage's forward of it) and after its last backward (run the
    backward there, once the first stage has sent the gradients of all its microbatches:
    after its backward of the last of them, and for stage 1 after its last forward, the
    order of their messages). The first stage has no bubble: what it takes is exposed.

    Greedy over the steps in order: each to the stage where the estimated step time grows
    least (the latest forward delay plus the latest backward overrun over all stages),
    ties to the deeper stage (more bubble). ``fwd_s``/``bwd_s``: the backbone stages'
    seconds of a microbatch; ``enc_fwd_s``/``enc_bwd_s``: the encoder's seconds of one
    (hand-off included; the backward with its recomputed forward); ``hop_s``: a hop
    between stages. A function of the plan alone, so the simulator, the planner and every
    rank derive the same owners. One stage (or one microbatch) gives everything to stage 0,
    the phases before and after the pipeline.

    The planner calls this thousands of times a search: deep pipelines price every
    stage of a step at once (``_greedy_wide``), shallow ones one by one
    (``_greedy_narrow``); both take the same steps as ``_Bubbles.trial`` and ``add``, so
    the owners and the seconds are the same to the bit."""
    pp = len(fwd_s)
    if pp < 1 or m < 1:
        raise ValueError(f"a pipeline of {pp} stages and {m} microbatches has no bubbles")
    if pp == 1:
        return BubbleFit((0,) * m, m * enc_fwd_s, m * enc_bwd_s)
    state = _Bubbles(fwd_s, bwd_s, m, hop_s)
    greedy = _greedy_wide if pp >= _WIDE_STAGES else _greedy_narrow
    fit = greedy(state, pp, m, enc_fwd_s, enc_bwd_s)
    # Looking one step ahead, the greedy can end past what an equal share for every stage,
    # in order, exposes at most (a stage's own share: ceil(m / pp) steps); then that share.
    if fit.exposed_f + fit.exposed_b > -(-m // pp) * (enc_fwd_s + enc_bwd_s):
        even = tuple(j * pp // m for j in range(m))
        f, b = bubble_exposure(fwd_s, bwd_s, even, [enc_fwd_s] * m, [enc_bwd_s] * m, hop_s)
        if f + b < fit.exposed_f + fit.exposed_b:
            return BubbleFit(even, f, b)
    return fit


# From this many stages on, a step's trials as numpy vectors beat a Python loop over them.
_WIDE_STAGES = 12
# ``bubble_owners``' tolerance: a shallower stage must be this much better to win a tie.
_TIE_S = 1e-12


def _greedy_narrow(state: _Bubbles, pp: int, m: int, ef: float, eb: float) -> BubbleFit:
    """``bubble_owners``' greedy, ``_Bubbles.trial`` inlined over plain lists, the
    largest other delay and overrun of each stage read from ``_TopTwo``."""
    f0, b0 = state.f_start[0], state.b_end[0]
    first, last, end, last_fwd0 = state.first, state.last, state.end, state.last_fwd0
    enc_end, back = state.enc_end, state.back
    delays, overruns = state.delays, state.overruns
    top_d, top_o = _TopTwo(pp), _TopTwo(pp)         # ``_others`` of each, kept
    owners: list[int] = []
    for j in range(m):
        f0j = f0[j]
        ready1, ready2 = max(b0[j], last_fwd0), max(b0[j], 0.0)
        d_at, d_top, d_second = top_d.at, top_d.top, top_d.second
        o_at, o_top, o_second = top_o.at, top_o.top, top_o.second
        best = None
        for s in range(pp - 1, 0, -1):
            # max(a, b) spelt ``b if b > a else a``, as max() decides (the later value
            # only when strictly greater): the same floats without its call.
            t = enc_end[s] + ef
            d = delays[s]
            x = t - f0j
            if x > d:
                d = x
            x = t - first[s]
            if x > d:
                d = x
            r = last[s]
            x = ready1 if s == 1 else ready2
            if x > r:
                r = x
            x = r + back[s] + eb - end
            o = x if x > 0.0 else 0.0
            dl = d_second if s == d_at else d_top
            ov = o_second if s == o_at else o_top
            c = (d if d > dl else dl) + (o if o > ov else ov)
            if best is None or c < best[0] - _TIE_S:
                best = (c, s, t, d, o)
        t = enc_end[0] + ef
        o = back[0] + eb
        c = max(d_second if d_at == 0 else d_top, t) + max(o_second if o_at == 0 else o_top, o)
        if c < best[0] - _TIE_S:
            best = (c, 0, t, t, o)
        _, s, t, d, o = best
        owners.append(s)
        enc_end[s], delays[s], overruns[s] = t, d, o
        back[s] += eb
        top_d.set(s, d)
        top_o.set(s, o)
    return BubbleFit(tuple(owners), *state.exposed())


def _greedy_wide(state: _Bubbles, pp: int, m: int, ef: float, eb: float) -> BubbleFit:
    """``bubble_owners``' greedy, each step's trials on every stage as numpy vectors
    (float64 sums and maxima, the same roundings as Python's floats), the choice then
    made as the loop over the stages would make it (``_first_within``)."""
    f0, b0 = state.f_start[0], state.b_end[0]
    end, last_fwd0 = state.end, state.last_fwd0
    first, last = np.array(state.first), np.array(state.last)
    enc_end, back, delays, overruns = (np.zeros(pp) for _ in range(4))
    # ``_others`` of the delays and of the overruns: every stage's is the largest value,
    # but the largest's own, which is the second largest.
    top_d, top_o = _TopTwo(pp), _TopTwo(pp)
    owners: list[int] = []
    for j in range(m):
        t = enc_end + ef
        d = np.maximum(np.maximum(delays, t - f0[j]), t - first)
        d[0] = t[0]                                 # before its schedule's first action
        ready = np.maximum(last, max(b0[j], 0.0))
        ready[1] = max(last[1], max(b0[j], last_fwd0))
        o = np.maximum(0.0, ready + back + eb - end)
        o[0] = back[0] + eb                         # after its last
        dl = np.maximum(d, top_d.top)
        dl[top_d.at] = max(top_d.second, d[top_d.at])
        ov = np.maximum(o, top_o.top)
        ov[top_o.at] = max(top_o.second, o[top_o.at])
        c = dl + ov
        s = pp - 1 - _first_within(c[::-1])
        owners.append(s)
        enc_end[s], delays[s], overruns[s] = t[s], d[s], o[s]
        back[s] += eb
        top_d.set(s, float(d[s]))
        top_o.set(s, float(o[s]))
    return BubbleFit(tuple(owners), float(delays.max()), float(overruns.max()))


class _TopTwo:
    """The largest of ``n`` values (``top``, at index ``at``) and the largest of the
    others (``second``), kept as the values change one at a time: in O(1) when one grows
    (as a greedy's delays do), a new look at them all when one shrinks."""

    def __init__(self, n: int) -> None:
        self.values = [0.0] * n
        self.at, self.top, self.second = 0, 0.0, 0.0

    def set(self, i: int, value: float) -> None:
        old, self.values[i] = self.values[i], value
        if not value >= old:
            values = self.values
            self.at = max(range(len(values)), key=values.__getitem__)
            self.top, self.second = values[self.at], max(values[:self.at] +
                                                         values[self.at + 1:])
        elif i == self.at:
            self.top = value
        elif value > self.top:
            self.at, self.top, self.second = i, value, self.top
        elif value > self.second:
            self.second = value


def _first_within(costs) -> int:
    """The index the loop ``if best is None or c < best - _TIE_S: best = c`` ends on over
    ``costs`` (a numpy vector): the first minimum when every cost before it exceeds it
    by more than the tolerance (then nothing before it can be kept, nothing after it can
    replace it), else the loop itself."""
    k = int(costs.argmin())
    if k == 0 or costs[k] < (costs[:k] - _TIE_S).min():
        return k
    best, at = None, 0
    for i, c in enumerate(costs.tolist()):
        if best is None or c < best - _TIE_S:
            best, at = c, i
    return at
