"""Inter-microbatch reordering for non-interleaved 1F1B (DistTrain section 6.2).

The model (``reorder.inter_model``): stage 0 (the modality encoder) takes ``forward[i]`` and
``backward[i]`` for microbatch ``i``, stages 1..P-1 (the LLM backbone) a fixed time each, under
1F1B with no communication time; an order is a permutation (``order[k]`` is the microbatch
that runs k-th), timed exactly by ``simulate_1f1b`` in O(m) and by the thousand at once as
numpy rows. Beyond 64 microbatches the local search's moves are walked only where they change
the order (1024 microbatches x 8 stages: about 1 s, was about 12 s).

Policies: ``disttrain_order`` (the smallest microbatch first, the p-1 next smallest kept for the
tail, every other position filled best-fit into its pipeline interval, O(m (m + p))),
``improve_order`` (a simulator-guided swap/insertion local search), ``best_order`` (the local
search from DistTrain's order and from a sorted one, the best of everything evaluated) and
``brute_force_order`` (every permutation).
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from dtdsl.reorder.inter_model import (
    _COUPLE_PAIRS,
    _REL_TOL,
    _check_inputs,
    _check_order,
    _check_times,
    _cuts,
    _Evaluator,
    _Patches,
    _stage_actions,
    _Walked,
    simulate_1f1b,
    timeline_1f1b,
)

__all__ = [
    "MAX_BRUTE_FORCE",
    "best_order",
    "brute_force_order",
    "disttrain_order",
    "improve_order",
    "report",
    "simulate_1f1b",
    "timeline_1f1b",
]

MAX_BRUTE_FORCE = 9          # 9! = 362,880 orders, under a second; 10! is ten times that
_DEFAULT_MAX_PASSES = 200    # numpy passes; up to 256 microbatches a local optimum comes first
_EXTRA_TRIES = 32            # further improving moves composed (and simulated) per pass
_SCAN = 128                  # improving moves looked at per pass for those
_SCALAR_TRIES = 8            # up to this many, those are simulated one by one
_FOCUS_MIN, _FOCUS_SHARE = 64, 16   # focused passes: the 1/16 closest moves, at least 64
_FOCUS_MAX = 1024                   # and at most this many
_FULL_NEIGHBOURHOOD = 64     # microbatches up to which every swap and insertion is a move
# Beyond: swaps up to 16 apart or touching the first or last 2 P positions; insertions up to
# max(16, 2 P) apart (they shift everything between: farther ones cost much and rarely help).
_WINDOW, _ENDS_PER_STAGE, _REACH_PER_STAGE = 16, 2, 2
_PATCHED_MIN = _FULL_NEIGHBOURHOOD + 1   # microbatches from which the local search uses it
_CHUNK = 2048                # moves simulated per pass: enough to amortise numpy's overhead


# ---------------------------------------------------------------------------------------------
# DistTrain's policy


class _Incremental:
    """1F1B computed lazily as stage 0's positions are decided one by one: an action is
    computed on demand, after the actions it waits for (each exactly once)."""

    def __init__(self, stages: int, num_microbatches: int, stage_forward: float,
                 stage_backward: float):
        self.p, self.m = stages, num_microbatches
        self.seqs = [_stage_actions(s, stages, num_microbatches) for s in range(stages)]
        self.index = [{a: k for k, a in enumerate(seq)} for seq in self.seqs]
        self.ends: list[list[float]] = [[] for _ in range(stages)]
        self.f, self.b = stage_forward, stage_backward
        self.fwd: list[float] = []   # stage 0's times by position, as decided
        self.bwd: list[float] = []

    def end(self, stage: int, kind: str, i: int) -> float:
        """End time of ``kind`` ``i`` on ``stage``, computing what it needs first."""
        return self.end_at(stage, self.index[stage][(kind, i)])

    def end_at(self, stage: int, k: int) -> float:
        # Iterative: one stage at a time, descending into a dependency when it is missing.
        stack = [(stage, k)]
        while stack:
            s, target = stack[-1]
            ends = self.ends[s]
            while len(ends) <= target:
                kind, i = self.seqs[s][len(ends)]
                if kind == "F":
                    dep = (s - 1, self.index[s - 1][("F", i)]) if s > 0 else None
                elif s < self.p - 1:
                    dep = (s + 1, self.index[s + 1][("B", i)])
                else:
                    dep = None   # the last stage's own forward precedes it on the stage
                if dep is not None and len(self.ends[dep[0]]) <= dep[1]:
                    stack.append(dep)
                    break
                start = ends[-1] if ends else 0.0
                if dep is not None:
                    start = max(start, self.ends[dep[0]][dep[1]])
                if s == 0:
                    assert i < len(self.fwd), "stage 0 ran past the decided positions"
                    duration = self.fwd[i] if kind == "F" else self.bwd[i]
                else:
                    duration = self.f if kind == "F" else self.b
                ends.append(start + duration)
            else:
                stack.pop()
        return self.ends[stage][k]

    def interval(self, position: int) -> float:
        """How long stage 0's forward at ``position`` can take without delaying the pipeline:
        from when stage 0 is free for it to when the action after it could start anyway (the
        gradient arriving for stage 0's next backward in steady state; stage 1 being ready for
        this forward in warm-up)."""
        k = self.index[0][("F", position)]
        free = self.end_at(0, k - 1) if k > 0 else 0.0
        nxt = self.seqs[0][k + 1] if k + 1 < len(self.seqs[0]) else None
        j = self.index[1][("F", position)]
        if nxt is not None and nxt[0] == "B" and self.index[1][("B", nxt[1])] < j:
            deadline = self.end(1, "B", nxt[1])
        else:   # warm-up, or so few microbatches that the gradient waits on this forward
            deadline = self.end_at(1, j - 1) if j > 0 else 0.0
        return deadline - free

    def place(self, forward: float, backward: float) -> None:
        self.fwd.append(forward)
        self.bwd.append(backward)


def _by_size(fwd: list[float], bwd: list[float]) -> list[int]:
    return sorted(range(len(fwd)), key=lambda i: (fwd[i] + bwd[i], fwd[i], i))


def disttrain_order(forward: Sequence[float], backward: Sequence[float], stages: int,
                    stage_forward: float | None = None,
                    stage_backward: float | None = None) -> list[int]:
    """DistTrain's inter-microbatch order (section 6.2) for stage 0's per-microbatch times.

    A microbatch's size is its stage-0 forward plus backward. The smallest runs first (a short
    warm-up); the p-1 next smallest are kept for the last p-1 positions, whose backwards run
    in the cool-down with nothing to hide them. Every other position k, in order, gets the
    largest remaining forward that fits its pipeline interval (best fit: the time stage 0 has
    before the pipeline would wait on it, simulated from positions 0..k-1), or the smallest
    when none fits; the tail positions are filled the same way from the kept p-1.
    ``stage_forward``/``stage_backward`` (stages 1..P-1) default to the mean stage-0 times.
    O(m (m + p)).
    """
    if stage_forward is None or stage_backward is None:
        fwd0 = _check_times("forward", forward)
        bwd0 = _check_times("backward", backward)
        if stage_forward is None:
            stage_forward = sum(fwd0) / len(fwd0) if fwd0 else 0.0
        if stage_backward is None:
            stage_backward = sum(bwd0) / len(bwd0) if bwd0 else 0.0
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    return _disttrain(fwd, bwd, f, b, p)


def _disttrain(fwd: list[float], bwd: list[float], f: float, b: float, p: int) -> list[int]:
    m = len(fwd)
    ranked = _by_size(fwd, bwd)
    if p == 1:   # no pipeline: every order takes sum(forward + backward)
        return ranked
    first, tail, middle = ranked[0], ranked[1:p], ranked[p:]
    sim = _Incremental(p, m, f, b)
    sim.place(fwd[first], bwd[first])
    order = [first]
    for pool in (middle, tail):
        # (forward, size, index) ascending: bisect finds the largest forward <= the interval.
        keyed = sorted((fwd[i], fwd[i] + bwd[i], i) for i in pool)
        while keyed:
            room = sim.interval(len(order))
            j = bisect_right(keyed, (room, math.inf, m)) - 1
            _, _, chosen = keyed.pop(max(j, 0))
            order.append(chosen)
            sim.place(fwd[chosen], bwd[chosen])
    return order


# ---------------------------------------------------------------------------------------------
# Local search


class _Neighbourhood:
    """Every swap of positions a and b with |a - b| <= ``window`` or one of them among the
    first or last ``ends``, and every insertion (take the microbatch at position a out, put
    it back at b) with |a - b| <= ``reach``; in a fixed shuffled order, cut into chunks of
    about ``chunk`` moves."""

    def __init__(self, num_microbatches: int, window: int, ends: int, reach: int, chunk: int):
        m = self.num_microbatches = num_microbatches
        pos = np.arange(m)
        near = np.abs(np.subtract.outer(pos, pos)) <= window
        edge = (pos < ends) | (pos >= m - ends)
        a, b = np.nonzero(near | edge[:, None] | edge[None, :])
        # Adjacent insertions are adjacent swaps.
        swap, insert = a < b, (np.abs(a - b) > 1) & (np.abs(a - b) <= reach)
        a = np.concatenate([a[swap], a[insert]])
        b = np.concatenate([b[swap], b[insert]])
        is_swap = np.arange(len(a)) < swap.sum()
        shuffle = np.random.default_rng(0).permutation(len(a))
        self.a, self.b, self.is_swap = a[shuffle], b[shuffle], is_swap[shuffle]
        self.size = len(a)
        num_chunks = max(1, round(self.size / max(1, chunk)))
        bounds = np.linspace(0, self.size, num_chunks + 1).astype(int)
        self.chunks = [np.arange(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        self._kept: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._patches: dict[int, _Patches] = {}

    def chunk_changes(self, c: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        if c not in self._kept:
            self._kept[c] = self.changes(self.chunks[c])
        return self._kept[c]

    def chunk_patches(self, evaluator: _Evaluator, c: int) -> _Patches:
        if c not in self._patches:
            self._patches[c] = self.patches(evaluator, self.chunks[c])
        return self._patches[c]

    def patches(self, evaluator: _Evaluator, moves: np.ndarray) -> _Patches:
        """The moves (candidate k: ``moves[k]``) as ``_Patches`` of the order they act on:
        the changes of ``changes``, by candidate and position."""
        a, b, swap = self.a[moves], self.b[moves], self.is_swap[moves]
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        span = np.where(swap, 2, hi - lo + 1)
        starts = np.cumsum(span) - span
        col = np.repeat(np.arange(len(moves)), span)
        offset = np.arange(len(col)) - starts[col]
        a, b, lo, hi, swap = a[col], b[col], lo[col], hi[col], swap[col]
        pos = np.where(swap, np.where(offset == 0, lo, hi), lo + offset)
        source = np.where(a < b, pos + 1, pos - 1)   # insertions: the microbatches between
        source = np.where(swap, np.where(pos == a, b, a), np.where(pos == b, a, source))
        return _Patches(evaluator, col, pos, source, by_position=True)

    def changes(self, moves: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(count, rows, cols, sources) of the moves (column k: ``moves[k]``) for
        ``_Evaluator.neighbours``: a swap changes its two positions; an insertion later takes
        each position in [a, b) from the next one and b from a, one earlier each in (b, a]
        from the previous one and b from a."""
        a, b, swap = self.a[moves], self.b[moves], self.is_swap[moves]
        cols = np.arange(len(moves))
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        # Every position of [lo, hi] of every move, as one flat range per move.
        span = np.where(swap, 0, hi - lo + 1)
        col = np.repeat(cols, span)
        row = np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span) + lo[col]
        later = a[col] < b[col]
        source = np.where(later, row + 1, row - 1)
        source = np.where(row == b[col], a[col], source)
        return (len(moves), np.concatenate([a[swap], b[swap], row]),
                np.concatenate([cols[swap], cols[swap], col]),
                np.concatenate([b[swap], a[swap], source]))

    def apply_array(self, order: np.ndarray, where: np.ndarray, base: np.ndarray,
                    move: int) -> None:
        """``apply`` on an array, ``where`` its inverse (the position of each microbatch),
        both kept up to date."""
        x, y = base[self.a[move]], base[self.b[move]]
        i, k = int(where[x]), int(where[y])
        if self.is_swap[move]:
            order[i], order[k] = y, x
            where[x], where[y] = k, i
            return
        # x out, then back in just after y (moving later) or just before it (earlier).
        to = k + int(self.a[move] < self.b[move]) - (i < k)
        if i < to:
            order[i:to] = order[i + 1:to + 1]
        elif to < i:
            order[to + 1:i + 1] = order[to:i]
        order[to] = x
        lo, hi = min(i, to), max(i, to)
        where[order[lo:hi + 1]] = np.arange(lo, hi + 1)

    def apply(self, order: list[int], base: np.ndarray, move: int) -> None:
        """Apply ``move``, as found on ``base``, to ``order`` in place by the microbatches it
        names (which an earlier move may have shifted)."""
        x, y = int(base[self.a[move]]), int(base[self.b[move]])
        if self.is_swap[move]:
            i, j = order.index(x), order.index(y)
            order[i], order[j] = y, x
        else:   # x goes just after y when it moves later, just before it when earlier
            order.remove(x)
            j = order.index(y)
            order.insert(j + 1 if self.a[move] < self.b[move] else j, x)


def _lower_bound(fwd: list[float], bwd: list[float], stage_forward: float,
                 stage_backward: float, stages: int) -> float:
    """No order's iteration time is below this.

    Stage 0 works sum(forward + backward). And with the gradient formula of
    ``_stage0_steps`` for the last position, the time is at least
    a_j + (m - 1 - j + Q) c + (the last backward) for every j, where a_j is at least the j + 1
    forwards and the max(0, j - Q) backwards stage 0 runs by then: each bounded by the
    smallest such times."""
    total = sum(fwd) + sum(bwd)
    m, q, c = len(fwd), stages - 1, stage_forward + stage_backward
    if q == 0 or m == 0:
        return total
    j = np.arange(m)
    fwd_sums = np.cumsum(np.sort(fwd))                       # the j + 1 smallest forwards
    bwd_sums = np.concatenate([[0.0], np.cumsum(np.sort(bwd))])
    arrival = fwd_sums + bwd_sums[np.maximum(0, j - q)]
    return max(total, float(np.max(arrival + (m - 1 - j + q) * c)) + min(bwd))


def _better(t: float, s: float, best_t: float, best_s: float) -> bool:
    """(t, s) < (best_t, best_s) lexicographically, beyond float noise."""
    tol = _REL_TOL * max(1.0, abs(best_t))
    if t < best_t - tol:
        return True
    return abs(t - best_t) <= tol and s < best_s - _REL_TOL * max(1.0, abs(best_s))


class _Search:
    """One local search's state: its order, its (time, tie-breaker), each move's gap (its
    time minus the best when last simulated), where it is in its round."""

    def __init__(self, evaluator: _Evaluator, start: list[int], num_moves: int,
                 patched: bool = False):
        self.current = np.asarray(start, dtype=np.intp)
        # Patched: the order's walk, kept up to date (its time and tie-breaker exact).
        self.walked = _Walked(evaluator, self.current) if patched else None
        self.best = ((self.walked.time, self.walked.sum) if self.walked is not None
                     else evaluator.one(self.current))
        self.gap = np.zeros(num_moves)
        self.chunk = 0               # the next chunk of the sweep; past the last: focused
        self.round_start = self.best[0]
        self.done = False


def _local_search(evaluator: _Evaluator, starts: list[list[int]], moves: _Neighbourhood,
                  max_passes: int, deadline: float | None,
                  lower_bound: float = 0.0) -> list[tuple[list[int], float, float]]:
    """Local searches on (iteration time, sum of stage 0's backward end times),
    lexicographically, one from each start, run in lockstep so each numpy pass serves all.

    A pass simulates a batch of moves on each search's order and takes the best improving
    one, with as many of the next improving ones as helps (``_propose``, ``_take``). A round
    is a sweep over the whole neighbourhood, chunk by chunk, then focused passes over the
    moves that came closest to improving when last simulated, for as long as those improve
    (most moves stay far from improving; re-simulating them every pass was most of the
    work). A search stops after a round without a shorter time (a local optimum for the
    time), at ``lower_bound``, after ``max_passes`` passes, or at ``deadline``.

    Patched (beyond 64 microbatches, at most m stages): each search keeps its order walked
    (``_Walked``); moves are evaluated as patches of it (``_Patches``), the orders ``_take``
    tries by clusters of changes (``_prefix_times``), and the order a search then holds is
    walked again, so its time and tie-breaker stay exact."""
    m = evaluator.num_microbatches
    patched = m >= _PATCHED_MIN and evaluator.stages <= m
    searches = [_Search(evaluator, start, moves.size, patched) for start in starts]
    focus = min(moves.size, _FOCUS_MAX, max(_FOCUS_MIN, moves.size // _FOCUS_SHARE))
    for npass in range(max_passes + 1):
        for s in searches:
            s.done = s.done or npass == max_passes or s.best[0] <= lower_bound * (1 + _REL_TOL)
        active = [s for s in searches if not s.done]
        if not active or (deadline is not None and time.perf_counter() >= deadline):
            break
        batches = []
        for s in active:
            if s.chunk < len(moves.chunks):
                chosen = moves.chunks[s.chunk]
                changes = (moves.chunk_patches(evaluator, s.chunk) if patched
                           else moves.chunk_changes(s.chunk))
            elif patched:
                chosen = _smallest(s.gap, focus)
                changes = moves.patches(evaluator, chosen)
            else:
                chosen = np.sort(np.argpartition(s.gap, focus - 1)[:focus])
                changes = moves.changes(chosen)
            batches.append((chosen, changes))
        if patched:
            results = [changes.evaluate(s.walked, len(chosen))
                       for s, (chosen, changes) in zip(active, batches, strict=True)]
        else:
            times, sums = evaluator.neighbours([s.current for s in active],
                                               [changes for _, changes in batches])
            bounds = np.cumsum([0] + [len(chosen) for chosen, _ in batches])
            results = [(times[lo:hi], sums[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        proposals = [_propose(s, moves, chosen, t, sums)
                     for s, (chosen, _), (t, sums) in zip(active, batches, results, strict=True)]
        if patched:
            _take_patched(evaluator, active, proposals)
        else:
            _take(evaluator, active, proposals)
        for s, (_, kept) in zip(active, proposals, strict=True):
            if s.chunk < len(moves.chunks):
                s.chunk += 1
            elif not kept:   # the end of a round
                if not _better(s.best[0], math.inf, s.round_start, math.inf):
                    s.done = True
                s.chunk, s.round_start = 0, s.best[0]
    return [([int(i) for i in s.current], s.best[0], s.best[1]) for s in searches]


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of ``k`` smallest values, ascending (ties at the k-th: the first ones); a
    partition costs a fraction of an argpartition."""
    kth = np.partition(values, k - 1)[k - 1]
    below = np.flatnonzero(values < kth)
    return np.sort(np.concatenate([below, np.flatnonzero(values == kth)[:k - len(below)]]))


def _propose(search: _Search, moves: _Neighbourhood, chosen: np.ndarray, times: np.ndarray,
             sums: np.ndarray) -> tuple[list[np.ndarray], int]:
    """Record the gaps of the moves ``chosen`` (simulated: ``times``, ``sums``); return the
    orders for ``_take`` to simulate and the number of improving moves proposed (0: none;
    a lone one is taken at once, its time already known).

    The improving moves, best first, are applied one after another by the microbatches they
    name, skipping those naming one an earlier move named; every prefix of that sequence is
    an order to try. Moves interact through the pipeline (and a later one may act on
    positions an earlier one shifted), so taking them all is not always best."""
    best_t, best_s = search.best
    search.gap[chosen] = times - best_t
    tol_t = _REL_TOL * max(1.0, abs(best_t))
    improving = (times < best_t - tol_t) | (
        (np.abs(times - best_t) <= tol_t) & (sums < best_s - _REL_TOL * max(1.0, abs(best_s))))
    candidates = np.flatnonzero(improving)
    if not len(candidates):
        return [], 0
    ranked = candidates[np.lexsort((sums[candidates], times[candidates]))]
    trial = search.current.copy()
    where = np.empty_like(trial)
    where[trial] = np.arange(len(trial))
    named: set[int] = set()
    prefixes = []
    for k in ranked[:_SCAN]:
        move = chosen[k]
        x, y = int(search.current[moves.a[move]]), int(search.current[moves.b[move]])
        if x in named or y in named:
            continue
        moves.apply_array(trial, where, search.current, move)
        named |= {x, y}
        prefixes.append(trial.copy())
        if len(prefixes) > _EXTRA_TRIES:
            break
    if len(prefixes) == 1:
        search.current = prefixes[0]
        search.best = (float(times[ranked[0]]), float(sums[ranked[0]]))
        return [], 1
    return prefixes, len(prefixes)


def _take(evaluator: _Evaluator, searches: list[_Search],
          proposals: list[tuple[list[np.ndarray], int]]) -> None:
    """Simulate every search's proposed orders at once; each takes its best (the first
    proposed order, the best move alone, improves, so the best of them does)."""
    tried = [order for prefixes, _ in proposals for order in prefixes]
    if not tried:
        return
    if len(tried) <= _SCALAR_TRIES:   # a numpy pass costs as much as this many plain walks
        times, sums = (np.array(x) for x in zip(*map(evaluator.one, tried), strict=True))
    else:
        times, sums = evaluator(np.array(tried))
    lo = 0
    for s, (prefixes, _) in zip(searches, proposals, strict=True):
        if prefixes:
            hi = lo + len(prefixes)
            n = lo + int(np.lexsort((sums[lo:hi], times[lo:hi]))[0])
            s.current, s.best = tried[n], (float(times[n]), float(sums[n]))
            lo = hi


def _take_patched(evaluator: _Evaluator, searches: list[_Search],
                  proposals: list[tuple[list[np.ndarray], int]]) -> None:
    """``_take`` for patched searches: each search's proposed orders are evaluated as
    changes to its order; whichever order a search then holds is walked again, its time and
    tie-breaker exact."""
    for s, (prefixes, _) in zip(searches, proposals, strict=True):
        if prefixes:
            tried = np.array(prefixes)
            times, sums = _prefix_times(evaluator, s.walked, tried)
            evaluator.evaluated += len(tried)
            s.current = tried[int(np.lexsort((sums, times))[0])]
        s.walked.update(s.current)
        s.best = (s.walked.time, s.walked.sum)


def _prefix_times(evaluator: _Evaluator, base: _Walked, tried: np.ndarray,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(time, tie-breaker) of orders each made from the one before by a few changes (from
    ``base`` for the first), as ``_propose`` makes them.

    The positions any of them changes, cut where ``_Patches`` would cut, make clusters; an
    order changes few clusters from the order before, so each cluster's content at each
    order it changes is one candidate for ``_Patches`` (about as many as there are orders,
    where walking every order's patches walked each many times), and an order's shift is
    its clusters' latest. Should a patch not couple (its walk would then reach into the
    next cluster), every order is evaluated whole instead."""
    q = evaluator.stages - 1
    diff = tried != base.order
    union = np.flatnonzero(diff.any(axis=0))
    if not len(union):
        return np.full(len(tried), base.time), np.full(len(tried), base.sum)
    starts = np.flatnonzero(_cuts(union, _COUPLE_PAIRS, q, evaluator.num_microbatches))
    content = tried[:, union]
    changed = np.empty(content.shape, dtype=bool)
    changed[0] = diff[0, union]
    changed[1:] = content[1:] != content[:-1]
    changed = np.logical_or.reduceat(changed, starts, axis=1)   # (order, cluster)
    order_of, cluster = np.nonzero(changed)                      # versions, by order
    sizes = np.diff(np.append(starts, len(union)))
    version = np.repeat(np.arange(len(cluster)), sizes[cluster])
    column = np.arange(len(version)) - np.repeat(np.cumsum(sizes[cluster]) - sizes[cluster],
                                                 sizes[cluster]) + starts[cluster][version]
    pos = union[column]
    keep = diff[order_of[version], pos]
    version, pos = version[keep], pos[keep]
    patches = _Patches(evaluator, version, pos, tried[order_of[version], pos],
                       by_position=False)
    times, sums = patches.evaluate(base, len(cluster))
    if patches.retried:
        cand, pos = np.nonzero(diff)
        return _Patches(evaluator, cand, pos, tried[cand, pos],
                        by_position=False).evaluate(base, len(tried))
    latest = np.full(changed.shape, -1)
    latest[order_of, cluster] = np.arange(len(cluster))
    latest = np.maximum.accumulate(latest, axis=0)
    shift = np.append(times - base.time, 0.0)[latest].sum(axis=1)
    dsum = np.append(sums - base.sum, 0.0)[latest].sum(axis=1)
    return base.time + shift, base.sum + dsum


def _neighbourhood(num_microbatches: int, stages: int) -> _Neighbourhood:
    m = num_microbatches
    if m <= _FULL_NEIGHBOURHOOD:
        return _Neighbourhood(m, m, 0, m, _CHUNK)
    return _Neighbourhood(m, _WINDOW, _ENDS_PER_STAGE * stages,
                          max(_WINDOW, _REACH_PER_STAGE * stages), _CHUNK)


def improve_order(order: Sequence[int], forward: Sequence[float], backward: Sequence[float],
                  stage_forward: float, stage_backward: float, stages: int, *,
                  budget_s: float | None = None, max_passes: int | None = None) -> list[int]:
    """Local search from ``order`` over swaps and insertions of microbatches (all of them up
    to 64 microbatches; beyond, those within 16 positions, swaps with the first and last
    2 P positions, insertions within 2 P): each pass simulates a batch of moves and takes
    the best improving ones, on the iteration time and then, for ties, the lower sum of
    stage 0's backward end times. It stops at a local optimum (a sweep of every move and
    the passes after it without a shorter time), at a lower bound no order can beat, after
    ``max_passes`` passes (default 200), or after ``budget_s`` seconds. Never returns a
    worse order; deterministic unless ``budget_s`` cuts it. Beyond 64 microbatches moves are
    evaluated as patches of the order (``_Patches``): equal to whole walks up to float
    rounding, so ties may break otherwise than with whole walks."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    start = _check_order(order, len(fwd))
    _check_budget(budget_s, max_passes)
    evaluator = _Evaluator(fwd, bwd, f, b, p)
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    passes = _DEFAULT_MAX_PASSES if max_passes is None else max_passes
    if len(fwd) < 2 or p == 1:
        return start
    moves = _neighbourhood(len(fwd), p)
    return _local_search(evaluator, [start], moves, passes, deadline,
                         _lower_bound(fwd, bwd, f, b, p))[0][0]


def _check_budget(budget_s: float | None, max_passes: int | None) -> None:
    if budget_s is not None and (not math.isfinite(budget_s) or budget_s < 0):
        raise ValueError(f"budget_s = {budget_s!r}: must be a finite number of seconds >= 0")
    if max_passes is not None and (isinstance(max_passes, bool) or max_passes < 0):
        raise ValueError(f"max_passes = {max_passes!r}: must be a whole number >= 0")


def best_order(forward: Sequence[float], backward: Sequence[float], stage_forward: float,
               stage_backward: float, stages: int, *, budget_s: float | None = None,
               max_passes: int | None = None) -> list[int]:
    """Our policy: DistTrain's order, the identity and both sorted orders are simulated; the
    local search (``improve_order``) runs from DistTrain's order and from the better sorted
    one, in lockstep (one numpy pass serves both; ``max_passes`` counts those); the best
    order of all is returned, so it is never worse than any of those four. Deterministic
    unless ``budget_s`` cuts the search."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    _check_budget(budget_s, max_passes)
    return _best(fwd, bwd, f, b, p, budget_s=budget_s, max_passes=max_passes)[0]


def _best(fwd, bwd, f, b, p, *, budget_s=None, max_passes=None) -> tuple[list[int], float]:
    m = len(fwd)
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    passes = _DEFAULT_MAX_PASSES if max_passes is None else max_passes
    evaluator = _Evaluator(fwd, bwd, f, b, p)
    ascending = _by_size(fwd, bwd)
    starts = [_disttrain(fwd, bwd, f, b, p), list(range(m)), ascending, ascending[::-1]]
    times, sums = evaluator(np.array(starts, dtype=np.intp))
    ranked = sorted(range(len(starts)), key=lambda k: (times[k], sums[k], k))
    best = (float(times[ranked[0]]), float(sums[ranked[0]]), starts[ranked[0]])
    if m < 2 or p == 1:
        return best[2], best[0]
    moves = _neighbourhood(m, p)
    lower_bound = _lower_bound(fwd, bwd, f, b, p)
    if best[0] <= lower_bound * (1 + _REL_TOL):
        return best[2], best[0]
    sorted_start = 2 if (times[2], sums[2]) <= (times[3], sums[3]) else 3
    for order, t, s in _local_search(evaluator, [starts[0], starts[sorted_start]],
                                     moves, passes, deadline, lower_bound):
        if _better(t, s, best[0], best[1]):
            best = (t, s, order)
    return best[2], best[0]


def brute_force_order(forward: Sequence[float], backward: Sequence[float],
                      stage_forward: float, stage_backward: float, stages: int) -> list[int]:
    """The optimal order by simulating every permutation (at most ``MAX_BRUTE_FORCE``
    microbatches); ties: the lexicographically first order."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    m = len(fwd)
    if m > MAX_BRUTE_FORCE:
        raise ValueError(f"brute force over {m} microbatches means {math.factorial(m):,} "
                         f"orders; use at most {MAX_BRUTE_FORCE} or best_order")
    evaluator = _Evaluator(fwd, bwd, f, b, p)
    best_t, best = math.inf, list(range(m))
    perms = itertools.permutations(range(m))
    while chunk := list(itertools.islice(perms, 40_320)):
        times, _ = evaluator(np.array(chunk, dtype=np.intp))
        k = int(np.argmin(times))   # first minimum: permutations come in lexicographic order
        if times[k] < best_t:
            best_t, best = float(times[k]), list(chunk[k])
    return best


def report(forward: Sequence[float], backward: Sequence[float], stage_forward: float,
           stage_backward: float, stages: int) -> dict[str, object]:
    """``best_order`` and its simulated iteration time, JSON-ready:
    ``{"order": [...], "iteration_time": t}``."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    order, t = _best(fwd, bwd, f, b, p)
    return {"order": order, "iteration_time": t}
