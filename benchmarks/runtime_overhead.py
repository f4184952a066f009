"""What the disaggregated runtime costs on top of a plain PyTorch loop (the issue's target:
at most 5% more).

A world of one rank cannot hold the three units (each unit has its own ranks), so the
runtime runs tiny_cpu (global batch 16, 8 microbatches of 2) as three units of one rank
each (vit, llm, gen: 3 gloo ranks, 1F1B, the broker between units) and the baseline is
``reference.train_reference``: the same model, data, microbatches, clip and AdamW in one
process, in a loop. Both start from the same weights; their losses agree (printed).

On 2 cores the wall time of 3 processes says little about parallel speed, so the figure
is CPU time: per training step, ``time.process_time`` (every thread of the process,
gloo's included) summed over the three ranks, against the plain loop's per step. The
work the runtime does on top of the loop's is in it: communication (the broker's
serialisation and gloo), the batch, loss denominators and routing every rank rebuilds,
the sharded optimizer with its collectives (grad-norm all-reduce, inf/NaN agreement) and
the barrier and loss all-reduce of every step. Where it goes is printed per rank from the
executor's measured events (wall time summed per action kind; RECV includes the wait for
the peer, SYNC is ``optimizer_step``) and the main thread's CPU time (``thread_time``;
the rest of the process CPU is gloo's threads).

**Contention control.** The runtime's three processes share 2 cores, which inflates the
CPU time of the same work (caches, SMT siblings, the scheduler) whatever the runtime does.
So the plain loop also runs as three concurrent copies (three busy processes, as many as
the runtime's ranks; each its own full loop) and its CPU per step, per copy, is the control:
``runtime / plain x3`` is the runtime's own overhead with contention factored out, ``plain
x3 / plain`` the contention itself. (The runtime's ranks are not all busy all the time,
the vit rank mostly waits, so the control is an upper bound on the contention it sees.)

The plain loop, the plain loop x3 and the runtime alternate ``--rounds`` times (fresh
processes each), one thread per process; medians over the steps after ``--warmup`` of
every round.

    python benchmarks/runtime_overhead.py [--steps 8] [--warmup 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.runtime.executor import StageExecutor
from dtdsl.runtime.mesh import build_groups
from dtdsl.runtime.reference import train_reference
from dtdsl.schedule.lower import lower
from tests.runtime.dist import run
from tests.runtime.test_executor import plan_for, spec

TARGET = 1.05
BATCH = 16


def _plain(rank: int, world: int, program: ir.Program, steps: int, out: str) -> None:
    rows = []
    c0, w0, t0 = time.process_time(), time.perf_counter(), time.thread_time()
    for r in train_reference(program, steps):
        c1, w1, t1 = time.process_time(), time.perf_counter(), time.thread_time()
        rows.append({"cpu": c1 - c0, "wall": w1 - w0, "thread": t1 - t0, "loss": r["loss"]})
        c0, w0, t0 = c1, w1, t1
    with open(os.path.join(out, f"plain{rank}.json"), "w") as f:
        json.dump(rows, f)


def _runtime(rank: int, world: int, program: ir.Program, plan: Plan, steps: int,
             out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    rows = []
    for i in range(steps):
        c0, t0 = time.process_time(), time.thread_time()
        r = ex.run_step(i)
        kinds: dict[str, float] = {}
        for e in r["events"]:
            if e.kind != "OPT":     # the same interval as SYNC
                kinds[e.kind] = kinds.get(e.kind, 0.0) + e.end_s - e.start_s
        rows.append({"cpu": time.process_time() - c0, "thread": time.thread_time() - t0,
                     "wall": r["time_s"], "loss": r["loss"], "kinds": kinds})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"unit": ex.role.unit, "rows": rows}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    program = spec(BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    total = args.warmup + args.steps
    plain: list[dict] = []
    plain3: list[dict] = []      # the contention control: every copy's rows
    ranks: list[list[dict]] = [[] for _ in range(plan.gpus_used)]
    units = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as out:
            run(_plain, 1, program, total, out, timeout=600)
            with open(os.path.join(out, "plain0.json")) as f:
                rows = json.load(f)
            plain += rows[args.warmup:]
            plain_losses = [x["loss"] for x in rows]
        with tempfile.TemporaryDirectory() as out:
            run(_plain, plan.gpus_used, program, total, out, timeout=600)
            for r in range(plan.gpus_used):
                with open(os.path.join(out, f"plain{r}.json")) as f:
                    plain3 += json.load(f)[args.warmup:]
        with tempfile.TemporaryDirectory() as out:
            run(_runtime, plan.gpus_used, program, plan, total, out, timeout=600)
            for r in range(plan.gpus_used):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    got = json.load(f)
                ranks[r] += got["rows"][args.warmup:]
                if len(units) < plan.gpus_used:
                    units.append(got["unit"])
            runtime_losses = [x["loss"] for x in got["rows"]]
    drift = max(abs(a - b) / abs(b) for a, b in zip(runtime_losses, plain_losses, strict=True))
    print(f"tiny_cpu, global batch {BATCH} in {plan.num_microbatches} microbatches of "
          f"{plan.micro_batch}; runtime: vit, llm, gen on 1 gloo rank each (1F1B); plain: "
          f"train_reference in 1 process; 1 thread each; {args.rounds} rounds x "
          f"{args.steps} steps after {args.warmup} warm-up")
    print(f"losses agree: max rel diff {drift:.1e} over {total} steps")
    print()

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rows)

    print(f"{'who':<14} {'cpu/step':>9} {'main thr':>9} {'wall/step':>10}")
    p_cpu = med(plain, "cpu")
    print(f"{'plain loop':<14} {p_cpu * 1e3:>7.1f}ms {med(plain, 'thread') * 1e3:>7.1f}ms "
          f"{med(plain, 'wall') * 1e3:>8.1f}ms")
    p3_cpu = med(plain3, "cpu")
    print(f"{'plain x' + str(plan.gpus_used) + ' (each)':<14} {p3_cpu * 1e3:>7.1f}ms "
          f"{med(plain3, 'thread') * 1e3:>7.1f}ms {med(plain3, 'wall') * 1e3:>8.1f}ms")
    for unit, rows in zip(units, ranks, strict=True):
        print(f"{'rank ' + unit:<14} {med(rows, 'cpu') * 1e3:>7.1f}ms "
              f"{med(rows, 'thread') * 1e3:>7.1f}ms {med(rows, 'wall') * 1e3:>8.1f}ms")
    steps = len(plain)
    per_step = [sum(rows[i]["cpu"] for rows in ranks) for i in range(steps)]
    per_step_thr = [sum(rows[i]["thread"] for rows in ranks) for i in range(steps)]
    r_cpu = statistics.median(per_step)
    print(f"{'runtime (sum)':<14} {r_cpu * 1e3:>7.1f}ms "
          f"{statistics.median(per_step_thr) * 1e3:>7.1f}ms")
    print()
    print("the runtime's steps by action kind (median ms of wall time per step; RECV waits "
          "for the peer, SYNC = optimizer_step):")
    for unit, rows in zip(units, ranks, strict=True):
        names = list(rows[-1]["kinds"])
        parts = "  ".join(f"{n} {statistics.median(x['kinds'].get(n, 0.0) for x in rows) * 1e3:.1f}"
                          for n in names)
        print(f"  {unit:<5} {parts}")
    print()
    ratio = r_cpu / p_cpu
    crit = max(med(rows, "cpu") for rows in ranks)
    print(f"runtime/plain CPU per step: {ratio:.3f} (target <= {TARGET:.2f}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}); busiest rank / plain: "
          f"{crit / p_cpu:.3f}")
    print(f"contention control: runtime / plain x{plan.gpus_used} CPU per step: "
          f"{r_cpu / p3_cpu:.3f} (the runtime's own overhead); plain x{plan.gpus_used} / "
          f"plain: {p3_cpu / p_cpu:.3f} (contention of {plan.gpus_used} busy processes on "
          f"{os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
