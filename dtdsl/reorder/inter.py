"""Inter-microbatch reordering for non-interleaved 1F1B (DistTrain section 6.2).

The model: a pipeline of ``stages`` stages under 1F1B. Stage 0 (the modality encoder) takes
``forward[i]`` and ``backward[i]`` for microbatch ``i``; stages 1..P-1 (the LLM backbone, whose
sequence length is fixed) take ``stage_forward`` and ``stage_backward`` for every microbatch.
No communication time. Stage ``s`` runs min(P-1-s, m) warm-up forwards, then alternates one
forward and one backward, then runs the remaining backwards; forward ``i`` at stage ``s`` waits
for forward ``i`` at stage ``s-1``, backward ``i`` at stage ``s`` for backward ``i`` at stage
``s+1`` (the last stage's backward for its own forward). The iteration time is when the last
action ends (stage 0's last backward). An order is a permutation: ``order[k]`` is the
microbatch that runs k-th.

Each stage's action sequence is fixed, so every action starts at max(end of the previous action
on its stage, end of its dependency). Because stages 1..P-1 are uniform, the gradient reaching
stage 0 has a closed form (``_stage0_steps``): evaluating an order only walks stage 0's
2m actions, O(m) instead of O(P m), and thousands of orders are the same walk over numpy rows
(one column per order). Beyond 64 microbatches the local search's moves change a few positions
of its order: each is walked only from the order's state there until its state is the order's
shifted (``_Walked``, ``_Patches``), a few dozen steps instead of 2m (1024 microbatches x 8
stages: about 1 s, was about 12 s). ``_Program``, the general per-action simulation, draws the
timeline.

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
from dataclasses import dataclass

import numpy as np

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
_FWD_STAGE, _BWD_STAGE = -1, -2   # duration codes of stages 1..P-1 (codes >= 0: stage 0)
_BATCH_CELLS = 1 << 21       # microbatches x orders per numpy batch: bounds memory (~50 MiB)
_DEFAULT_MAX_PASSES = 200    # numpy passes; up to 256 microbatches a local optimum comes first
_REL_TOL = 1e-12             # float noise below which two times are equal
_EXTRA_TRIES = 32            # further improving moves composed (and simulated) per pass
_SCAN = 128                  # improving moves looked at per pass for those
_SCALAR_TRIES = 8            # up to this many, those are simulated one by one
_FOCUS_MIN, _FOCUS_SHARE = 64, 16   # focused passes: the 1/16 closest moves, at least 64
_FOCUS_MAX = 1024                   # and at most this many
_FULL_NEIGHBOURHOOD = 64     # microbatches up to which every swap and insertion is a move
# Beyond: swaps up to 16 apart or touching the first or last 2 P positions; insertions up to
# max(16, 2 P) apart (they shift everything between: farther ones cost much and rarely help).
_WINDOW, _ENDS_PER_STAGE, _REACH_PER_STAGE = 16, 2, 2
_CHUNK = 2048                # moves simulated per pass: enough to amortise numpy's overhead


# ---------------------------------------------------------------------------------------------
# Input checks


def _check_times(name: str, values: Sequence[float]) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}") from None
    bad = [(i, v) for i, v in enumerate(out) if not math.isfinite(v) or v < 0]
    if bad:
        i, v = bad[0]
        raise ValueError(f"{name}[{i}] = {v!r}: times must be finite and >= 0 "
                         f"({len(bad)} bad value(s))")
    return out


def _check_scalar(name: str, value: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name} = {value!r}: must be finite and >= 0")
    return out


def _check_stages(stages: int) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int | np.integer) or stages < 1:
        raise ValueError(f"stages = {stages!r}: write a whole number of pipeline stages >= 1")
    return int(stages)


def _check_inputs(forward, backward, stage_forward, stage_backward, stages):
    fwd = _check_times("forward", forward)
    bwd = _check_times("backward", backward)
    if len(fwd) != len(bwd):
        raise ValueError(f"forward has {len(fwd)} microbatches but backward has {len(bwd)}; "
                         "give one forward and one backward time per microbatch")
    if not fwd:
        raise ValueError("no microbatches: forward and backward are empty")
    return (fwd, bwd, _check_scalar("stage_forward", stage_forward),
            _check_scalar("stage_backward", stage_backward), _check_stages(stages))


def _check_order(order: Sequence[int] | None, num_microbatches: int) -> list[int]:
    if order is None:
        return list(range(num_microbatches))
    out = list(order)
    if sorted(out) != list(range(num_microbatches)) or any(
            isinstance(i, bool) or not isinstance(i, int | np.integer) for i in out):
        raise ValueError(f"order {out!r} is not a permutation of 0..{num_microbatches - 1}")
    return [int(i) for i in out]


# ---------------------------------------------------------------------------------------------
# The 1F1B program: fixed per-stage action sequences in one topological order


def _stage_actions(stage: int, stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    warmup = min(stages - 1 - stage, num_microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return actions


@dataclass(frozen=True, kw_only=True)
class _Program:
    """1F1B for (stages, num_microbatches) as straight-line code.

    ``ops[k] = (out, prev, dep, code)``: slot ``out`` = max(slot ``prev``, slot ``dep``) plus
    the duration ``code`` names (0..m-1: stage 0's forward at that position, m..2m-1: its
    backward, ``_FWD_STAGE``/``_BWD_STAGE``: the uniform stages). Slot 0 always holds 0.
    ``actions[k] = (stage, kind, position)`` for the timeline.
    """

    stages: int
    num_microbatches: int
    ops: tuple[tuple[int, int, int, int], ...]
    actions: tuple[tuple[int, str, int], ...]
    num_slots: int
    result_slot: int


def _build_program(stages: int, num_microbatches: int) -> _Program:
    p, m = stages, num_microbatches
    # Action ids: forward i on stage s is s*2m + i, backward i is s*2m + m + i.
    seqs = []
    for s in range(p):
        base = s * 2 * m
        seqs.append([base + i if kind == "F" else base + m + i
                     for kind, i in _stage_actions(s, p, m)])
    num_actions = 2 * p * m
    # dep[a]: the action a waits for on another stage (-1: none). The last stage's backward
    # waits for its own forward, which precedes it on the stage anyway.
    dep = [-1] * num_actions
    for s in range(p):
        base = s * 2 * m
        for i in range(m):
            if s > 0:
                dep[base + i] = base - 2 * m + i
            if s < p - 1:
                dep[base + m + i] = base + 2 * m + m + i

    # Round-robin over the stages, each running while its next action's dependency is done:
    # the order depends only on the structure, never on the durations, so it is valid for all.
    done = bytearray(num_actions)
    order: list[int] = []
    cursor = [0] * p
    while len(order) < num_actions:
        before = len(order)
        for s in range(p):
            seq, k = seqs[s], cursor[s]
            while k < len(seq) and (dep[seq[k]] < 0 or done[dep[seq[k]]]):
                done[seq[k]] = 1
                order.append(seq[k])
                k += 1
            cursor[s] = k
        assert len(order) > before, "1F1B deadlocked: the per-stage sequences are inconsistent"

    # prev[a]: the action before a on its stage; a value lives until its last reader.
    prev = [-1] * num_actions
    for seq in seqs:
        for a, b in itertools.pairwise(seq):
            prev[b] = a
    step = [0] * num_actions
    for k, a in enumerate(order):
        step[a] = k
    last_use = [-1] * num_actions
    for a in order:
        for x in (prev[a], dep[a]):
            if x >= 0 and step[a] > last_use[x]:
                last_use[x] = step[a]
    final = m + m - 1   # stage 0's last backward
    last_use[final] = num_actions

    slot_of = [0] * num_actions
    free: list[int] = []
    num_slots = 1
    ops = []
    actions = []
    for k, a in enumerate(order):
        x, y = prev[a], dep[a]
        prev_slot = slot_of[x] if x >= 0 else 0
        dep_slot = slot_of[y] if y >= 0 else 0
        for z in (x, y):   # an input read for the last time frees its slot for the output
            if z >= 0 and last_use[z] == k:
                free.append(slot_of[z])
        if free:
            out = free.pop()
        else:
            out, num_slots = num_slots, num_slots + 1
        slot_of[a] = out
        s, r = divmod(a, 2 * m)
        kind, i = ("F", r) if r < m else ("B", r - m)
        if s == 0:
            code = r
        else:
            code = _FWD_STAGE if kind == "F" else _BWD_STAGE
        ops.append((out, prev_slot, dep_slot, code))
        actions.append((s, kind, i))
    return _Program(stages=p, num_microbatches=m, ops=tuple(ops), actions=tuple(actions),
                    num_slots=num_slots, result_slot=slot_of[final])


def _run(program: _Program, fwd: list[float], bwd: list[float], stage_forward: float,
         stage_backward: float, order: list[int]) -> list[tuple[float, float]]:
    """(start, end) of every action of ``program.actions``, by the general simulation."""
    durations = [fwd[i] for i in order] + [bwd[i] for i in order]
    vals = [0.0] * program.num_slots
    spans = []
    for out, prev, dep, code in program.ops:
        start = vals[prev]
        if vals[dep] > start:
            start = vals[dep]
        if code >= 0:
            end = start + durations[code]
        else:
            end = start + (stage_forward if code == _FWD_STAGE else stage_backward)
        vals[out] = end
        spans.append((start, end))
    return spans


# ---------------------------------------------------------------------------------------------
# Fast evaluation: stage 0 alone, the uniform stages in closed form


def _stage0_steps(stages: int, num_microbatches: int, cycle: float,
                  ) -> list[tuple[bool, int, int, float]]:
    """Stage 0's actions as steps ``(is_forward, position, lag, offset)`` for ``_walk``.

    With a_j the end of stage 0's forward at position j, c = ``cycle`` = stage_forward +
    stage_backward and Q = P - 1, the gradient of position k reaches stage 0 (stage 1's
    backward k ends) at

        g_k = (k + Q) c + max over j <= min(k + Q - 1, m - 1) of (a_j - j c).

    At least: from forward j on stage 1, going down microbatch j's forwards, along the last
    stage to backward k and up takes (k - j + Q) c (for j > k, turning back at the stage
    whose steady state runs forward j just before backward k); stage 1 runs forwards up to
    k + Q - 1 before backward k, and nothing later reaches it. At most: for a_j = j c the
    schedule "stage s runs forward i from i c + (s-1) f, ends backward i at
    i c + Q f + (Q-s+1) b" (f, b: the uniform stages' times) meets every constraint and ends
    stage 1's backward k at (k + Q) c; shifting each action by the running maximum of
    a_j - j c over the forwards j it depends on still meets them. Stage 0 starts backward k
    at max(the end of its previous action, g_k). The tests check this against an
    independent event-driven simulator.

    ``lag`` is the bound on j (-1: no gradient to wait for, one stage); ``offset`` is j c
    for a forward, (k + Q) c for a backward."""
    q, m = stages - 1, num_microbatches
    steps = []
    for kind, i in _stage_actions(0, stages, m):
        if kind == "F":
            steps.append((True, i, -1, i * cycle))
        else:
            steps.append((False, i, min(i + q - 1, m - 1) if q else -1, (i + q) * cycle))
    return steps


def _walk(steps: list[tuple[bool, int, int, float]], fwd: list[float], bwd: list[float],
          ) -> tuple[float, float]:
    """(iteration time, sum of stage 0's backward end times) for stage 0's times by position.

    ``_Evaluator._batch`` is the same arithmetic on numpy rows, so both give identical
    floats."""
    t = acc = 0.0
    best = -math.inf
    prefix = [0.0] * len(fwd)   # prefix[j]: max of a_i - i c over i <= j
    for forward, pos, lag, offset in steps:
        if forward:
            t += fwd[pos]
            v = t - offset
            if v > best:
                best = v
            prefix[pos] = best
        else:
            if lag >= 0:
                g = prefix[lag] + offset
                if g > t:
                    t = g
            t += bwd[pos]
            acc += t
    return t, acc


class _Evaluator:
    """Iteration times (and a tie-breaker) of orders: one by ``one``, many at once (one numpy
    column each) by calling it."""

    def __init__(self, fwd: list[float], bwd: list[float], stage_forward: float,
                 stage_backward: float, stages: int):
        self.fwd = np.asarray(fwd, dtype=np.float64)
        self.bwd = np.asarray(bwd, dtype=np.float64)
        self.num_microbatches = len(fwd)
        self.stages, self.cycle = stages, stage_forward + stage_backward
        self.steps = _stage0_steps(stages, len(fwd), self.cycle)
        self.evaluated = 0
        self._fwd_list, self._bwd_list = fwd, bwd
        self._scratch = [np.empty(0) for _ in range(3)]   # reused: fresh pages cost faults

    def _arrays(self, columns: int) -> list[np.ndarray]:
        """Three (microbatches x ``columns``) scratch arrays, contiguous."""
        size = self.num_microbatches * columns
        for k, buf in enumerate(self._scratch):
            if buf.size < size:
                self._scratch[k] = np.empty(size)
        return [buf[:size].reshape(self.num_microbatches, columns) for buf in self._scratch]

    def pair_offsets(self) -> list[float]:
        """k c for k < m + Q, as ``_stage0_steps`` computes them."""
        if not hasattr(self, "_pair_offsets"):
            self._pair_offsets = [k * self.cycle
                                  for k in range(self.num_microbatches + self.stages - 1)]
        return self._pair_offsets

    def patch_offsets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``_Patches``, by k (pair k - Q): the forward's offset k c (inf: no forward),
        the backward's (k c; -inf: none) and 1.0 where there is a backward (0.0: none)."""
        if not hasattr(self, "_offsets"):
            m, q = self.num_microbatches, self.stages - 1
            k = np.arange(m + q)
            x = k * self.cycle
            self._offsets = (np.where(k < m, x, math.inf), np.where(k >= q, x, -math.inf),
                             (k >= q).astype(np.float64))
        return self._offsets

    def one(self, order: Sequence[int]) -> tuple[float, float]:
        """(iteration time, tie-breaker) of one order."""
        self.evaluated += 1
        return _walk(self.steps, [self._fwd_list[i] for i in order],
                     [self._bwd_list[i] for i in order])

    def __call__(self, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(iteration time, sum of stage 0's backward end times) per row of ``orders``.

        The sum breaks ties between orders of the same iteration time: among them, the one
        whose encoder stage finishes its backwards earlier leaves more room to improve
        later."""
        orders = np.atleast_2d(np.asarray(orders, dtype=np.intp))
        chunk = max(1, _BATCH_CELLS // max(1, orders.shape[1]))
        times, sums = [], []
        for lo in range(0, len(orders), chunk):
            cols = orders[lo:lo + chunk].T
            t, s = self._batch(self.fwd[cols], self.bwd[cols], np.empty(cols.shape))
            times.append(t)
            sums.append(s)
        self.evaluated += len(orders)
        return np.concatenate(times), np.concatenate(sums)

    def neighbours(self, orders: list[np.ndarray],
                   changes: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(time, tie-breaker) of candidates given as changes to orders: for each order and
        its ``(count, rows, cols, sources)``, candidate ``c`` (of ``count``) is the order with
        position ``r`` taking the microbatch at position ``s`` for every ``(r, c, s)`` listed
        (gathering whole position maps instead moved many times the memory)."""
        total = sum(count for count, *_ in changes)
        fwd, bwd, prefix = self._arrays(total)
        lo = 0
        for order, (size, rows, cols, sources) in zip(orders, changes, strict=True):
            f, b = self.fwd[order], self.bwd[order]
            fwd[:, lo:lo + size] = f[:, None]
            bwd[:, lo:lo + size] = b[:, None]
            flat = rows * total + (cols + lo)   # np.put: twice as fast as fwd[rows, cols]
            np.put(fwd, flat, f[sources])
            np.put(bwd, flat, b[sources])
            lo += size
        self.evaluated += lo
        return self._batch(fwd, bwd, prefix)

    def _batch(self, fwd: np.ndarray, bwd: np.ndarray, prefix: np.ndarray,
               ) -> tuple[np.ndarray, np.ndarray]:
        """``_walk`` on stage 0's times by position, one column per order (``prefix``:
        scratch of the same shape)."""
        k = fwd.shape[1]
        fwd, bwd, prefix = list(fwd), list(bwd), list(prefix)   # rows, indexed fast
        t, acc, g = np.zeros(k), np.zeros(k), np.empty(k)
        best = np.full(k, -np.inf)
        add, subtract, maximum = np.add, np.subtract, np.maximum
        for forward, pos, lag, offset in self.steps:
            if forward:
                add(t, fwd[pos], out=t)
                subtract(t, offset, out=g)
                best = maximum(best, g, out=prefix[pos])
            else:
                if lag >= 0:
                    add(prefix[lag], offset, out=g)
                    maximum(t, g, out=t)
                add(t, bwd[pos], out=t)
                add(acc, t, out=acc)
        return t, acc


# ---------------------------------------------------------------------------------------------
# Patched evaluation: many orders that differ from one base order in a few places


_COUPLE_PAIRS = 1            # pairs walked past a patch's last change before it must have coupled
_PATCHED_MIN = _FULL_NEIGHBOURHOOD + 1   # microbatches from which the local search uses it


class _Walked:
    """Stage 0 walked pair by pair over one order, its state kept at every pair boundary.

    Pair ``i`` (-Q <= i < m) is stage 0's forward at position i + Q (when < m), then its
    backward at position i (when >= 0): the same steps as ``_walk``, in the same order, with
    the same floats. Boundary ``k`` (0..m+Q) is the state after the first k pairs: ``t``
    (stage 0's clock), ``p`` (the running max of a_j - j c) and ``acc`` (the tie-breaker so
    far). The state (t, p) moves through a pair max-plus linearly, so an order differing from
    this one only at positions lo..hi runs as this one up to boundary lo, and once its state
    after hi is this one's plus the same shift d in both t and p, it stays so to the end:
    time and backward ends all d later (``_Patches``)."""

    def __init__(self, evaluator: _Evaluator, order: Sequence[int]):
        self.ev = evaluator
        m, q = evaluator.num_microbatches, evaluator.stages - 1
        self.order = np.array(order, dtype=np.intp)
        self._t = [0.0] * (m + q + 1)
        self._p = [-math.inf] * (m + q + 1)
        self._acc = [0.0] * (m + q + 1)
        self._walk(0)

    def update(self, order: np.ndarray) -> None:
        """Walk ``order`` again from the first position where it differs."""
        diff = np.flatnonzero(order != self.order)
        self.order = np.array(order, dtype=np.intp)
        if len(diff):
            self._walk(int(diff[0]))

    def _walk(self, start: int) -> None:
        ev = self.ev
        m, q = ev.num_microbatches, ev.stages - 1
        fwd, bwd = ev.fwd[self.order], ev.bwd[self.order]
        fpos, bpos = fwd.tolist(), bwd.tolist()
        ts, ps, accs = self._t, self._p, self._acc
        t, best, acc = ts[start], ps[start], accs[start]
        offsets = ev.pair_offsets()
        # Pair k - Q: the forward at position k (k < m), then the backward at k - Q (k >= Q);
        # its state goes to boundary k + 1.
        k0, k1 = start, min(q, m + q)
        for k, x, f in zip(range(k0 + 1, k1 + 1), offsets[k0:k1], fpos[k0:k1],
                           strict=True):                                  # warm-up
            t += f
            v = t - x
            if v > best:
                best = v
            ts[k] = t
            ps[k] = best
        k0 = max(start, q)
        for k, x, f, b in zip(range(k0 + 1, m + 1), offsets[k0:m], fpos[k0:m],
                              bpos[k0 - q:m - q], strict=True):          # steady state
            g = best + x
            t += f
            v = t - x
            if v > best:
                best = v
            if g > t:
                t = g
            t += b
            acc += t
            ts[k] = t
            ps[k] = best
            accs[k] = acc
        k0 = max(start, m)
        for k, x, b in zip(range(k0 + 1, m + q + 1), offsets[k0:m + q],
                           bpos[k0 - q:m], strict=True):                  # cool-down
            g = best + x
            if g > t:
                t = g
            t += b
            acc += t
            ts[k] = t
            ps[k] = best
            accs[k] = acc
        self.t, self.p, self.acc = np.array(ts), np.array(ps), np.array(accs)
        self.fpad = np.concatenate([fwd, np.zeros(q)])
        self.bpad = np.concatenate([np.zeros(q), bwd])
        self.time, self.sum = t, acc


def _end_zone(horizon: int, q: int, m: int) -> int:
    """The first position from which a patch is walked to the end: the cool-down's state
    seldom couples."""
    return m - 1 - horizon - 2 * q - _COUPLE_PAIRS


def _cuts(pos: np.ndarray, horizon: int, q: int, m: int) -> np.ndarray:
    """Where a new patch starts among one candidate's changed positions (ascending): at the
    first, and at each at least ``horizon`` + Q + 1 after the one before (whose patch then
    ends before it), unless that one's patch is walked to the end."""
    cut = np.ones(len(pos), dtype=bool)
    cut[1:] = (pos[1:] - pos[:-1] >= horizon + q + 1) & (pos[:-1] < _end_zone(horizon, q, m))
    return cut


class _Patches:
    """Candidate orders given by their changes to a base order, cut into patches: runs of
    changed positions less than ``horizon`` + Q + 1 apart. A patch is walked from the base
    state at its first position's boundary through ``horizon`` pairs past its last change;
    there its state must be the base's shifted (coupled, see ``_Walked``), else its candidate
    is evaluated again with a longer horizon (which also merges its patches). Shifts add up
    over a candidate's patches, and so do tie-breaker differences.

    Changes are (candidate, position, source), sorted by candidate then position; the source
    is the base position whose microbatch moves there (``by_position``) or that microbatch."""

    def __init__(self, evaluator: _Evaluator, cand: np.ndarray, pos: np.ndarray,
                 src: np.ndarray, by_position: bool, horizon: int = _COUPLE_PAIRS):
        m, q = evaluator.num_microbatches, evaluator.stages - 1
        self.ev, self.horizon, self.by_position = evaluator, horizon, by_position
        self.cand, self.pos, self.src = cand, pos, src
        breaks = _cuts(pos, horizon, q, m)
        breaks[1:] |= cand[1:] != cand[:-1]
        patch = np.cumsum(breaks) - 1
        first = np.flatnonzero(breaks)
        last = np.append(first[1:] - 1, len(pos) - 1)
        lo, hi = pos[first], pos[last]
        last_pair = np.where(hi >= _end_zone(horizon, q, m), m - 1, hi + horizon)
        pairs = last_pair - lo + q + 1
        # Stable sorts of small integers: radix sorts.
        small = np.int16 if m + q < 1 << 15 else np.int32
        perm = np.argsort((pairs.max(initial=0) - pairs).astype(small), kind="stable")
        rank = np.empty_like(perm)
        rank[perm] = np.arange(len(perm))
        self.lo, self.end = lo[perm], lo[perm] + pairs[perm]
        self.patch_cand = cand[first][perm]
        self.rounds = int(pairs.max()) if len(pairs) else 0
        counts = np.bincount(pairs, minlength=self.rounds + 1)
        self.active = [int(x) for x in np.cumsum(counts[::-1])[::-1][1:]]
        rf = pos - lo[patch]   # the round of a change's forward; its backward comes Q later
        order = np.argsort(rf.astype(small), kind="stable")
        self.cols, self.run_src = rank[patch][order], src[order]
        rounds = np.arange(self.rounds + 1)
        self.f_bounds = np.searchsorted(rf[order], rounds).tolist()
        self.b_bounds = np.searchsorted(rf[order] + q, rounds).tolist()

    def evaluate(self, base: _Walked, num_candidates: int) -> tuple[np.ndarray, np.ndarray]:
        """(iteration time, tie-breaker) of every candidate."""
        ev = self.ev
        times, sums, uncoupled = self._run(base, num_candidates)
        self.retried = bool(len(uncoupled))
        if len(uncoupled):
            keep = np.isin(self.cand, uncoupled)
            again = _Patches(ev, self.cand[keep], self.pos[keep], self.src[keep],
                             self.by_position, horizon=4 * self.horizon + 1)
            t2, s2 = again.evaluate(base, num_candidates)
            times[uncoupled], sums[uncoupled] = t2[uncoupled], s2[uncoupled]
        return times, sums

    def _run(self, base: _Walked, num_candidates: int):
        ev = self.ev
        m, q = ev.num_microbatches, ev.stages - 1
        ids = base.order[self.run_src] if self.by_position else self.run_src
        vf, vb = ev.fwd[ids], ev.bwd[ids]
        xf, xb, hb = ev.patch_offsets()
        fpad, bpad = base.fpad, base.bpad
        lo = self.lo
        t, p = base.t[lo], base.p[lo]
        acc = np.zeros(len(lo))
        fb, bb, cols = self.f_bounds, self.b_bounds, self.cols
        for r in range(self.rounds):
            n = self.active[r]
            j = lo[:n] + r
            f, b = fpad[j], bpad[j]
            if fb[r + 1] > fb[r]:
                f[cols[fb[r]:fb[r + 1]]] = vf[fb[r]:fb[r + 1]]
            if bb[r + 1] > bb[r]:
                b[cols[bb[r]:bb[r + 1]]] = vb[bb[r]:bb[r + 1]]
            tt, pp = t[:n], p[:n]
            tt += f
            g = pp + xb[j]
            np.maximum(pp, tt - xf[j], out=pp)
            np.maximum(tt, g, out=tt)
            tt += b
            if r < q:   # warm-up pairs (no backward) only in the first Q rounds
                acc[:n] += tt * hb[j]
            else:
                acc[:n] += tt
        end = self.end
        shift = t - base.t[end]
        coupled = np.abs(shift - (p - base.p[end])) <= _REL_TOL * max(1.0, abs(base.time))
        coupled |= end == m + q
        dacc = acc - (base.acc[end] - base.acc[lo]) + (m + q - np.maximum(end, q)) * shift
        cand = self.patch_cand
        times = base.time + np.bincount(cand, shift, minlength=num_candidates)
        sums = base.sum + np.bincount(cand, dacc, minlength=num_candidates)
        return times, sums, np.unique(cand[~coupled])


# ---------------------------------------------------------------------------------------------
# Simulation


def simulate_1f1b(forward: Sequence[float], backward: Sequence[float], stage_forward: float,
                  stage_backward: float, stages: int,
                  order: Sequence[int] | None = None) -> float:
    """The 1F1B iteration time (see the module docstring for the model) when the microbatches
    run in ``order`` (default: as given). Exact; O(microbatches)."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    seq = _check_order(order, len(fwd))
    steps = _stage0_steps(p, len(fwd), f + b)
    return _walk(steps, [fwd[i] for i in seq], [bwd[i] for i in seq])[0]


def timeline_1f1b(forward: Sequence[float], backward: Sequence[float], stage_forward: float,
                  stage_backward: float, stages: int, order: Sequence[int] | None = None,
                  ) -> list[list[tuple[str, int, float, float]]]:
    """Per stage, its actions in the order they run as (kind "F"/"B", microbatch, start, end);
    the microbatch is the caller's index (``order[position]``). O(stages * microbatches)."""
    fwd, bwd, f, b, p = _check_inputs(forward, backward, stage_forward, stage_backward, stages)
    seq = _check_order(order, len(fwd))
    program = _build_program(p, len(fwd))
    spans = _run(program, fwd, bwd, f, b, seq)
    lanes: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    for (stage, kind, pos), (start, end) in zip(program.actions, spans, strict=True):
        lanes[stage].append((kind, seq[pos], start, end))
    return lanes


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
