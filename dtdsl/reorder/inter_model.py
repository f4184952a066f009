"""The 1F1B model that inter-microbatch reordering evaluates (``reorder.inter``), and its
fast evaluation of many orders at once.

A pipeline of ``stages`` stages under 1F1B. Stage 0 (the modality encoder) takes
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
(one column per order, ``_Evaluator``). A local search's move changes a few positions of its
order: each is walked only from the order's state there until its state is the order's
shifted (``_Walked``, ``_Patches``), a few dozen steps instead of 2m. ``_Program``, the
general per-action simulation, draws the timeline (``timeline_1f1b``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["simulate_1f1b", "timeline_1f1b"]

_FWD_STAGE, _BWD_STAGE = -1, -2   # duration codes of stages 1..P-1 (codes >= 0: stage 0)
_BATCH_CELLS = 1 << 21       # microbatches x orders per numpy batch: bounds memory (~50 MiB)
_REL_TOL = 1e-12             # float noise below which two times are equal

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
