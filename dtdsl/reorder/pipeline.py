"""Inter-microbatch ordering that sees the whole pipeline (every stage of every unit).

``dtdsl.reorder.inter`` is DistTrain's model: stage 0 (an encoder) varies per microbatch and
every later stage takes the same time for every microbatch. Unpacked batches break that
model where it matters most: the backbone's work per sample varies as much as an
encoder's (one sample per microbatch, lognormal lengths), and in 1F1B each stage
alternates the forward of microbatch j + p - 1 - s with the backward of microbatch j, so
consecutive microbatches of different work leave stages idle, more so the deeper the
pipeline. Here every stage has its own time per microbatch.

The model: a chain of ``stages`` stages (the encoders' stages, then the backbone's, then
the generators', as ``dtdsl.reorder.workload`` lays them out) under plain 1F1B. Stage ``s``
runs min(P - 1 - s, m) warm-up forwards, then alternates one forward and one backward,
then runs the remaining backwards; forward i at stage s waits for forward i at stage
s - 1, backward i at stage s for backward i at stage s + 1. No communication time. Every
stage ends with backward m - 1, which stage 0 runs last, so the iteration ends there.
``chain_1f1b`` evaluates many orders at once (one numpy column each).

Policies (``best_order``): candidate orders built from each microbatch's size (the largest
of its stage times, and their sum): ascending, descending, a hill (the smallest at both
ends, the largest in the middle: small warm-up and cool-down, neighbours of similar size),
its mirror, DistTrain's shape with the microbatches sorted (the smallest first, the p - 1
next smallest kept for the tail), zig-zag, and the given order; each, the fastest first,
is then improved by a local search over swaps and insertions of microbatches (all of them
up to 8 microbatches, those within two positions beyond) until no move helps, while a
fixed amount of counted work lasts (on large pipelines the first search spends most of
it). On every case of up to 6 microbatches and 2 or 3 stages we tried, that is the
optimum (``tests/reorder/test_pipeline.py``). ``brute_force_order`` tries every permutation (at most
``MAX_BRUTE_FORCE`` microbatches).

Determinism: units and workers compute their routings separately and must agree without
talking, so the answer depends on the times alone: stable sorts with ties broken by
microbatch index, ties between orders broken by the order they were generated in, only
additions and maxima of float64 (every machine rounds them alike), and work counted,
never timed.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

__all__ = ["MAX_BRUTE_FORCE", "OrderSearch", "best_order", "brute_force_order",
           "candidate_orders", "chain_1f1b", "chain_columns"]

MAX_BRUTE_FORCE = 8          # 8! = 40,320 orders
_COLUMNS = 256               # orders per numpy batch: P m 256 floats stay in cache
_REL_TOL = 1e-12             # float noise below which two times are equal
_FULL_NEIGHBOURHOOD = 8      # microbatches up to which every swap and insertion is a move
_WINDOW = 2                  # beyond: moves up to 2 positions apart (wider windows found
                             # another 1-2% on 64 microbatches at ten times the work)
# Work of the local search, counted (never timed, so the answer never depends on the
# clock): one numpy pass over a batch of orders costs about one unit per action of the
# 1F1B program (2 P m), plus its columns' share. The budget is about 0.1 s on the 2-core
# development machine (8 passes over 120 microbatches and 11 stages); the search often
# stops at a local optimum first.
_WORK_BUDGET = 100_000.0
_COLUMN_SHARE = 1 / 128      # of an action's unit cost, per column


def _check_times(forward, backward) -> tuple[np.ndarray, np.ndarray]:
    fwd = np.asarray(forward, dtype=np.float64)
    bwd = np.asarray(backward, dtype=np.float64)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ValueError(f"forward {fwd.shape} and backward {bwd.shape} must both be "
                         "(stages, microbatches) arrays of seconds")
    if fwd.shape[0] < 1 or fwd.shape[1] < 1:
        raise ValueError("give at least one stage and one microbatch")
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()) or \
            fwd.min() < 0 or bwd.min() < 0:
        raise ValueError("stage times must be finite and >= 0")
    return fwd, bwd


def _check_order(order, num_microbatches: int) -> list[int]:
    out = [int(i) for i in order]
    if sorted(out) != list(range(num_microbatches)):
        raise ValueError(f"order {out!r} is not a permutation of 0..{num_microbatches - 1}")
    return out


# ---------------------------------------------------------------------------------------------
# The 1F1B chain


def _program(stages: int, num_microbatches: int) -> list[tuple[bool, int, int]]:
    """Every action ``(is_forward, stage, position)`` of 1F1B in an order that respects its
    dependencies: round robin over the stages, each running while it can."""
    p, m = stages, num_microbatches
    seqs = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        seq = [(True, s, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [(True, s, warm + i), (False, s, i)]
        seq += [(False, s, i) for i in range(m - warm, m)]
        seqs.append(seq)
    done_f = [[False] * m for _ in range(p)]
    done_b = [[False] * m for _ in range(p)]
    cursor = [0] * p
    out: list[tuple[bool, int, int]] = []
    while len(out) < 2 * p * m:
        before = len(out)
        for s in range(p):
            seq, k = seqs[s], cursor[s]
            while k < len(seq):
                forward, _, i = seq[k]
                if forward and s > 0 and not done_f[s - 1][i]:
                    break
                if not forward and s < p - 1 and not done_b[s + 1][i]:
                    break
                (done_f if forward else done_b)[s][i] = True
                out.append(seq[k])
                k += 1
            cursor[s] = k
        assert len(out) > before, "1F1B deadlocked: the per-stage sequences are inconsistent"
    return out


class _Chain:
    """Iteration times of orders of one set of stage times (``chain_1f1b`` many times)."""

    def __init__(self, fwd: np.ndarray, bwd: np.ndarray) -> None:
        self.fwd, self.bwd = fwd, bwd
        self.stages, self.num_microbatches = fwd.shape
        self.program = _program(self.stages, self.num_microbatches)
        self.work = 0.0

    def __call__(self, orders: np.ndarray) -> np.ndarray:
        """Per row of ``orders`` (microbatch indices in execution order): its time."""
        orders = np.atleast_2d(np.asarray(orders, dtype=np.intp))
        out = [self._batch(orders[lo:lo + _COLUMNS])
               for lo in range(0, len(orders), _COLUMNS)]
        return np.concatenate(out) if out else np.zeros(0)

    def _batch(self, orders: np.ndarray) -> np.ndarray:
        cols = orders.T                                   # (m, K)
        k = cols.shape[1]
        self.work += len(self.program) * (1 + k * _COLUMN_SHARE)
        return _run(self.program, self.fwd[:, cols], self.bwd[:, cols])


def _run(program: list[tuple[bool, int, int]], fwd: np.ndarray, bwd: np.ndarray
         ) -> np.ndarray:
    """The end of stage 0's last backward, per column of ``fwd``/``bwd`` (P, m, K)."""
    p, m, k = fwd.shape
    f_end = np.empty((p, m, k))
    b_end = np.empty((p, m, k))
    last = [np.zeros(k) for _ in range(p)]
    add, maximum = np.add, np.maximum
    for forward, s, i in program:
        if forward:
            out = f_end[s, i]
            if s:
                maximum(last[s], f_end[s - 1, i], out=out)
                add(out, fwd[s, i], out=out)
            else:
                add(last[s], fwd[s, i], out=out)
        else:
            out = b_end[s, i]
            if s < p - 1:
                maximum(last[s], b_end[s + 1, i], out=out)
                add(out, bwd[s, i], out=out)
            else:
                add(last[s], bwd[s, i], out=out)
        last[s] = out
    return last[0].copy()


def chain_1f1b(forward, backward, orders=None) -> np.ndarray:
    """The 1F1B iteration time of a chain of stages for each order.

    ``forward``/``backward``: (stages, microbatches) seconds of each microbatch on each
    stage; ``orders``: rows of microbatch indices in execution order (default: the one
    order 0..m-1). Returns one time per order."""
    search = OrderSearch(forward, backward)
    return search.times([list(range(search.num_microbatches))] if orders is None else orders)


def chain_columns(forward, backward) -> np.ndarray:
    """The 1F1B iteration time of each column of ``forward``/``backward`` (stages,
    microbatches, columns) seconds, every column run in the given order: many pipelines
    of the same shape at once (a rigid plan's replicas, say)."""
    fwd = np.asarray(forward, dtype=np.float64)
    bwd = np.asarray(backward, dtype=np.float64)
    if fwd.ndim != 3 or fwd.shape != bwd.shape:
        raise ValueError(f"forward {fwd.shape} and backward {bwd.shape} must both be "
                         "(stages, microbatches, columns) arrays of seconds")
    if min(fwd.shape) < 1:
        raise ValueError("give at least one stage, one microbatch and one column")
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()) or \
            fwd.min() < 0 or bwd.min() < 0:
        raise ValueError("stage times must be finite and >= 0")
    stages, m, _ = fwd.shape
    return _run(_program(stages, m), fwd, bwd)


# ---------------------------------------------------------------------------------------------
# Candidate orders


def _by_size(size: np.ndarray) -> list[int]:
    """Microbatch indices by size, ascending, ties by index."""
    return [int(i) for i in np.argsort(size, kind="stable")]


def _shapes(ascending: list[int], stages: int) -> dict[str, list[int]]:
    q = min(stages - 1, len(ascending) - 1)
    hill = ascending[0::2] + ascending[1::2][::-1]
    return {
        "ascending": ascending,
        "descending": ascending[::-1],
        "hill": hill,
        "hill mirrored": hill[::-1],
        # DistTrain's shape, sorted: the smallest first (a short warm-up), the p - 1 next
        # smallest last (exposed in the cool-down), the middle ascending.
        "disttrain sorted": ascending[:1] + ascending[q + 1:] + ascending[1:q + 1][::-1],
        "zig-zag": [ascending[k // 2] if k % 2 == 0 else ascending[-1 - k // 2]
                    for k in range(len(ascending))],
    }


def candidate_orders(forward, backward) -> dict[str, list[int]]:
    """Named candidate orders of the microbatches (see the module docstring): length-grouped
    shapes by each microbatch's slowest stage (``ascending``, ``hill``, ...) and by its
    total over the stages (``... by total``), and ``given`` (0..m-1). Duplicates are
    dropped, the first name kept."""
    fwd, bwd = _check_times(forward, backward)
    both = fwd + bwd
    found: dict[str, list[int]] = {}
    seen: set[tuple[int, ...]] = set()
    for suffix, size in (("", both.max(axis=0)), (" by total", both.sum(axis=0))):
        for name, order in _shapes(_by_size(size), fwd.shape[0]).items():
            key = tuple(order)
            if key not in seen:
                seen.add(key)
                found[name + suffix] = order
    given = list(range(fwd.shape[1]))
    if tuple(given) not in seen:
        found["given"] = given
    return found


# ---------------------------------------------------------------------------------------------
# Local search


def _moves(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, a, b): swaps of positions a < b and insertions (the microbatch at a taken out
    and put back at b), every pair up to ``_FULL_NEIGHBOURHOOD`` microbatches, beyond those
    at most ``_WINDOW`` apart. An insertion to the next position is the swap."""
    window = m if m <= _FULL_NEIGHBOURHOOD else _WINDOW
    a, b = np.nonzero(np.abs(np.subtract.outer(np.arange(m), np.arange(m))) <= window)
    swap = a < b
    insert = np.abs(a - b) > 1
    kind = np.concatenate([np.zeros(swap.sum(), dtype=np.int8),
                           np.ones(insert.sum(), dtype=np.int8)])
    return kind, np.concatenate([a[swap], a[insert]]), np.concatenate([b[swap], b[insert]])


def _neighbours(order: np.ndarray, kind: np.ndarray, a: np.ndarray, b: np.ndarray
                ) -> np.ndarray:
    """(moves, m): ``order`` with each move applied."""
    m = len(order)
    pos = np.arange(m)[None, :]
    a_, b_ = a[:, None], b[:, None]
    # Insertion a -> b: positions between them shift by one towards a.
    src = pos.repeat(len(a), axis=0)
    ins = kind[:, None] == 1
    fwd_shift = ins & (a_ < b_) & (pos >= a_) & (pos < b_)
    back_shift = ins & (a_ > b_) & (pos > b_) & (pos <= a_)
    src = np.where(fwd_shift, pos + 1, src)
    src = np.where(back_shift, pos - 1, src)
    src = np.where(ins & (pos == b_), a_, src)
    swap = ~ins
    src = np.where(swap & (pos == a_), b_, src)
    src = np.where(swap & (pos == b_), a_, src)
    return order[src]


class OrderSearch:
    """The orders of one pipeline's stage times: ``forward``/``backward`` (stages,
    microbatches) seconds of each microbatch on each stage."""

    def __init__(self, forward, backward) -> None:
        self.forward, self.backward = _check_times(forward, backward)
        self._chain = _Chain(self.forward, self.backward)

    @property
    def num_microbatches(self) -> int:
        return self._chain.num_microbatches

    def times(self, orders) -> np.ndarray:
        """The iteration time of each order (rows of microbatch indices, execution order)."""
        m = self.num_microbatches
        rows = [_check_order(o, m) for o in orders]
        return self._chain(np.asarray(rows, dtype=np.intp).reshape(len(rows), m))

    def candidates(self) -> dict[str, list[int]]:
        """``candidate_orders`` of these times."""
        return candidate_orders(self.forward, self.backward)

    def best_candidate(self) -> tuple[list[int], float]:
        """The fastest candidate (the first of equals: the candidates' order is fixed)
        and its time."""
        orders = list(self.candidates().values())
        times = self._chain(np.asarray(orders, dtype=np.intp))
        k = int(np.argmin(times))
        return orders[k], float(times[k])

    def improve(self, order, *, budget: float | None = None) -> tuple[list[int], float]:
        """Best-improvement local search from ``order`` while ``budget`` units of work last
        (default ``_WORK_BUDGET``; 0: none): each pass simulates every move and takes the
        best one that shortens the iteration (the first of equals); it stops at a local
        optimum. Never worse than ``order``. Returns the order and its time."""
        chain = self._chain
        current = np.asarray(_check_order(order, self.num_microbatches), dtype=np.intp)
        budget = _WORK_BUDGET if budget is None else float(budget)
        if not (math.isfinite(budget) and budget >= 0):
            raise ValueError(f"budget = {budget!r}: must be a finite amount of work >= 0")
        time_s = float(chain(current[None, :])[0])
        m = chain.num_microbatches
        if m < 2 or chain.stages < 2:
            return [int(i) for i in current], time_s
        kind, a, b = _moves(m)
        start = chain.work
        while chain.work - start < budget:
            neighbours = _neighbours(current, kind, a, b)
            times = chain(neighbours)
            k = int(np.argmin(times))
            if not times[k] < time_s - _REL_TOL * max(1.0, abs(time_s)):
                break
            current, time_s = neighbours[k], float(times[k])
        return [int(i) for i in current], time_s

    def best(self, *, budget: float | None = None) -> tuple[list[int], float]:
        """``improve`` from each candidate, the fastest first, while ``budget`` lasts (shared;
        default ``_WORK_BUDGET``): the best order found and its time. Small pipelines are
        searched from every candidate; on large ones the first search spends most of it."""
        budget = _WORK_BUDGET if budget is None else float(budget)
        orders = list(self.candidates().values())
        times = self._chain(np.asarray(orders, dtype=np.intp))
        ranked = np.argsort(times, kind="stable")
        best = (orders[ranked[0]], float(times[ranked[0]]))
        start = self._chain.work
        for k in ranked:
            left = budget - (self._chain.work - start)
            if left <= 0:
                break
            order, t = self.improve(orders[k], budget=left)
            if t < best[1]:
                best = (order, t)
        return best


def best_order(forward, backward, *, budget: float | None = None) -> list[int]:
    """Our whole-pipeline policy (``OrderSearch.best``): every candidate of
    ``candidate_orders`` simulated and improved by the local search (``budget``: its work,
    default ``_WORK_BUDGET``; 0: the best candidate). Never worse than any candidate;
    deterministic."""
    return OrderSearch(forward, backward).best(budget=budget)[0]


def brute_force_order(forward, backward) -> list[int]:
    """The optimal order by simulating every permutation (at most ``MAX_BRUTE_FORCE``
    microbatches); ties: the lexicographically first."""
    fwd, bwd = _check_times(forward, backward)
    m = fwd.shape[1]
    if m > MAX_BRUTE_FORCE:
        raise ValueError(f"brute force over {m} microbatches means {math.factorial(m):,} "
                         f"orders; use at most {MAX_BRUTE_FORCE} or best_order")
    chain = _Chain(fwd, bwd)
    best_t, best = math.inf, list(range(m))
    perms = itertools.permutations(range(m))
    while chunk := list(itertools.islice(perms, 8 * _COLUMNS)):
        times = chain(np.asarray(chunk, dtype=np.intp))
        k = int(np.argmin(times))
        if times[k] < best_t:
            best_t, best = float(times[k]), list(chunk[k])
    return best
