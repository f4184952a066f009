"""1F1B played out by an event loop: the reference the planner's and the bubble
estimate's closed timings are tested against (tests/sim/test_bubbles.py,
tests/planner/test_baseline.py)."""

from __future__ import annotations

__all__ = ["one_f_one_b_events"]


def one_f_one_b_events(fwd_s, bwd_s, m, hop_s):
    """(f_start[s][j], b_end[s][j]) of 1F1B over stages of ``fwd_s``/``bwd_s`` seconds and
    ``m`` microbatches, every hop ``hop_s``: stage s runs min(pp - 1 - s, m) forwards,
    then alternates a forward and a backward; a forward waits for the stage before, a
    backward for the stage after (the last stage's for its own forward). Each stage is
    retried until its next pass's input is ready."""
    pp = len(fwd_s)
    f_start, f_end, b_end = ([[0.0] * m for _ in range(pp)] for _ in range(3))
    done_f, done_b = ([[False] * m for _ in range(pp)] for _ in range(2))
    orders = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        order, nf = [("F", j) for j in range(warm)], warm
        for j in range(m):
            if nf < m:
                order.append(("F", nf))
                nf += 1
            order.append(("B", j))
        orders.append(order)
    pos, free = [0] * pp, [0.0] * pp
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                if kind == "F":
                    if s > 0 and not done_f[s - 1][j]:
                        break
                    start = max(free[s], f_end[s - 1][j] + hop_s if s > 0 else 0.0)
                    f_start[s][j], f_end[s][j] = start, start + fwd_s[s]
                    free[s], done_f[s][j] = f_end[s][j], True
                else:
                    if s < pp - 1 and not done_b[s + 1][j]:
                        break
                    ready = b_end[s + 1][j] + hop_s if s < pp - 1 else f_end[s][j]
                    b_end[s][j] = max(free[s], ready) + bwd_s[s]
                    free[s], done_b[s][j] = b_end[s][j], True
                pos[s] += 1
    return f_start, b_end
