"""What a checkpoint save adds to training: a synchronous save, and a background-thread save
(``runtime.checkpoint.Checkpointer``, modes ``sync`` and ``thread``), against steps without
a save, as ratios measured in the same run.

tiny_cpu (global batch 16) runs on 4 gloo ranks (vit, llm data parallel 2 with ZeRO-1, gen)
in this process's children, each step's batch built before the timed loop. Rounds repeat
the pattern

    none:   step s, step s+1, step s+2                         (no save)
    sync:   step s + save(s+1) on the training thread, s+1, s+2
    thread: step s + save(s+1) staged, then written in the background, s+1, s+2
    thread-nice0: the same with the background thread at the training's CPU priority

with the background save waited for (untimed) before the next pattern. A step's time is
barrier to barrier, the slowest rank's, the save call included (in the launched trainer the
save runs right after its step, so this is the step "in which it happens"). Printed per
mode, medians over rounds: each of the three steps over the median step without a save,
and the time all three add over three plain steps, as a fraction of one step; plus the save
call itself (sync: all of it; thread: the gather of the full tensors and the CPU copy), how
long the background write took until its commit, and the checkpoint's size.

On the development machine (2 cores for 4 ranks and the background threads, shared with
other jobs; two runs of 8 rounds, 22.4 MiB checkpoints, steps of 0.4-0.5 s):

    mode          save step   next    after   added/step
    sync          2.4-3.1x    ~1.0x   ~1.0x   +1.2 .. +2.4
    thread        1.1-1.2x    1.2-1.3x 1.0-1.3x +0.5 .. +0.7
    thread-nice0  0.9-1.3x    1.6-2.5x 1.4-2.0x +1.4 .. +2.9

The background save takes the save off its step (the call is 10-30 ms: gathering and the
CPU copy) and, at nice +10, costs about a third of what a synchronous save does in all;
at the training's priority it competes for the saturated cores and costs as much as the
synchronous save or more. On a GPU node training leaves host cores idle and the write
overlaps better; these are CPU times of a tiny model, not a GPU figure.

    python benchmarks/checkpoint_save.py [--rounds 5] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist

from dtdsl.data.batch import LocalBatches, StepBatch
from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import latest_checkpoint
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import Checkpointer
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.train.test_executor import plan_for, spec

MODES = ("none", "sync", "thread", "thread-nice0")
SPAN = 3            # steps timed per pattern: the save's step and the two after it


class _Prebuilt:
    """A ``batch.BatchSource`` serving batches built before the timed loop."""

    def __init__(self, feed: LocalBatches, steps: int):
        self._batches = {s: feed.batch(s) for s in range(steps)}

    def batch(self, step: int) -> StepBatch:
        return self._batches[step]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _bench(rank: int, world: int, program: ir.Program, plan: Plan, rounds: int, warmup: int,
           run_dir: str, out: str) -> None:
    groups = build_groups(plan)
    steps = warmup + rounds * len(MODES) * SPAN
    feed = _Prebuilt(LocalBatches(program, plan, groups.role), steps)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups,
                       feed=feed)
    committed: list[float] = []
    def log(_: str) -> None:
        committed.append(time.perf_counter())

    ckpts = {"sync": Checkpointer(ex, run_dir, keep=2, mode="sync", log=log),
             "thread": Checkpointer(ex, run_dir, keep=2, mode="thread", log=log),
             "thread-nice0": Checkpointer(ex, run_dir, keep=2, mode="thread", log=log,
                                          nice=0)}
    step = 0
    for _ in range(warmup):
        ex.run_step(step)
        step += 1
    # Both modes once before timing (imports, first-use allocations).
    for c in ckpts.values():
        c.save(step)
        c.wait()
    rows = []
    for r in range(rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            times, save_s, write_s, t0 = [], None, None, 0.0
            for k in range(SPAN):
                dist.barrier()
                start = time.perf_counter()
                ex.run_step(step)
                if k == 0 and mode != "none":
                    committed.clear()
                    t0 = time.perf_counter()
                    ckpts[mode].save(step + 1)
                    save_s = time.perf_counter() - t0
                times.append(_slowest(time.perf_counter() - start))
                step += 1
            if mode != "none":
                ckpts[mode].wait()      # untimed: the background save's commit
                if rank == 0 and committed:
                    write_s = committed[-1] - t0
            rows.append({"mode": mode, "times": times, "save_s": save_s, "write_s": write_s})
    for c in ckpts.values():
        c.close()
    if rank == 0:
        newest = latest_checkpoint(run_dir)
        assert newest is not None
        size = sum(f.stat().st_size for f in newest.iterdir())
        Path(out).write_text(json.dumps({"rows": rows, "bytes": size}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    program = spec(16)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                    ("gen", "generator", 1, 1, 1))
    with tempfile.TemporaryDirectory(prefix="dtdsl-ckpt-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        run(_bench, plan.gpus_used, program, plan, args.rounds, args.warmup,
            os.path.join(tmp, "run"), out, timeout=1800)
        result = json.loads(Path(out).read_text())
    rows = result["rows"]
    base = statistics.median(t for r in rows if r["mode"] == "none" for t in r["times"])
    print(f"tiny_cpu, 4 gloo ranks (vit | llm DP 2, ZeRO-1 | gen), {args.rounds} rounds; "
          f"checkpoint {result['bytes'] / 2**20:.1f} MiB")
    print(f"step without a save: {base * 1e3:.0f} ms (median)")
    print(f"{'mode':12} {'save step':>10} {'next':>7} {'after':>7} {'added/step':>11} "
          f"{'save call':>10} {'write':>8}")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ratios = [statistics.median(r["times"][k] for r in mine) / base for k in range(SPAN)]
        added = statistics.median(sum(r["times"]) - SPAN * base for r in mine) / base
        call = ("-" if mode == "none" else
                f"{statistics.median(r['save_s'] for r in mine) * 1e3:.0f} ms")
        writes = [r["write_s"] for r in mine if r["write_s"] is not None]
        write = f"{statistics.median(writes) * 1e3:.0f} ms" if writes else "-"
        print(f"{mode:12} {ratios[0]:>9.2f}x {ratios[1]:>6.2f}x {ratios[2]:>6.2f}x "
              f"{added:>+10.2f} {call:>10} {write:>8}")
    print("ratios: each step's time over the median step without a save; added/step: what "
          "the three steps took beyond three plain steps, in steps")


if __name__ == "__main__":
    main()
