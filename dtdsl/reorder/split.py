"""Splits of a step's items among groups: without reordering, contiguous runs
(``contiguous_split``); a phased encoder's microbatch steps among the stages of its
backbone replica's pipeline, in 1F1B's bubbles (``bubble_owners``).

Shared by the simulator's routing (``dtdsl.sim.workload``) and the runtime's
(through ``dtdsl.data.batch.route_batch``), so predicted and measured runs route alike.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

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
    f_start = [[0.0] * m for _ in range(pp)]
    f_end = [[0.0] * m for _ in range(pp)]
    b_end = [[0.0] * m for _ in range(pp)]
    free = [0.0] * pp
    for s, forward, j in _one_f_one_b_order(pp, m):
        if forward:
            ready = f_end[s - 1][j] + hop_s if s > 0 else 0.0
            start = max(free[s], ready)
            f_start[s][j], f_end[s][j] = start, start + fwd_s[s]
            free[s] = f_end[s][j]
        else:
            ready = b_end[s + 1][j] + hop_s if s < pp - 1 else f_end[s][j]
            b_end[s][j] = max(free[s], ready) + bwd_s[s]
            free[s] = b_end[s][j]
    return f_start, b_end


@functools.lru_cache(maxsize=256)
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
    the phases before and after the pipeline."""
    pp = len(fwd_s)
    if pp < 1 or m < 1:
        raise ValueError(f"a pipeline of {pp} stages and {m} microbatches has no bubbles")
    if pp == 1:
        return BubbleFit((0,) * m, m * enc_fwd_s, m * enc_bwd_s)
    state = _Bubbles(fwd_s, bwd_s, m, hop_s)
    owners: list[int] = []
    for j in range(m):
        best = None
        for s in range(pp - 1, -1, -1):
            c, t, d, o = state.trial(s, j, enc_fwd_s, enc_bwd_s)
            if best is None or c < best[0] - 1e-12:
                best = (c, s, t, d, o)
        _, s, t, d, o = best
        owners.append(s)
        state.add(s, enc_bwd_s, t, d, o)
    return BubbleFit(tuple(owners), *state.exposed())
