"""The preprocessing feed: worker throughput, and what the trainers wait for data.

1. Worker throughput: one worker builds the messages of N training steps of the tiny spec
   from a synthesized dataset (read the shards, decode PNG/JPEG, resize, tokenize, encode
   generation targets, route with intra+inter reordering, pack every rank's message):
   samples per second; then two workers at once in two processes, each half the steps:
   the aggregate, and its ratio to one worker. How much of a step is the reordering
   (``route_batch`` with both policies against data order) is printed too.
2. Trainer data wait: the tiny bundle compiled with 2 workers and launched (4 gloo trainer
   ranks) for STEPS steps, with the spec's reordering and without: per step
   ``data_wait_s / iteration_time_s`` from ``metrics.jsonl`` (the first step, which waits
   for the workers to start, is left out), and the mean iteration time of both runs.

On this 2-core machine the two workers and the four trainers share two cores, so the
trainers' data wait includes the time the workers take the CPU from them; on a cluster the
workers run on CPU nodes.

    python benchmarks/feed_wait.py [--steps 20] [--samples 512]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT

from dtdsl import cli

SPEC = ROOT / "specs" / "tiny_cpu.dt"


def _build(bundle: str, steps: list[int], out: mp.Queue) -> None:
    from dtdsl.feed.worker import FeedContext, build_messages

    ctx = FeedContext(Path(bundle))
    build_messages(ctx, steps[0])       # warm: the cost model, first decodes
    start = time.perf_counter()
    for s in steps:
        build_messages(ctx, s)
    out.put(time.perf_counter() - start)


def worker_rates(bundle: Path, steps: int, batch: int) -> tuple[float, float]:
    """Samples/s of one worker, and of two workers at once (aggregate)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_build, args=(str(bundle), list(range(steps)), q))
    p.start()
    one = q.get()
    p.join()
    procs = [ctx.Process(target=_build, args=(str(bundle), list(range(w, steps, 2)), q))
             for w in range(2)]
    for p in procs:
        p.start()
    times = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return steps * batch / one, steps * batch / max(times)


def reorder_cost(bundle: Path, steps: int) -> tuple[float, float]:
    """Seconds per step of routing with the job's policies and in data order."""
    from dtdsl.data.batch import route_batch
    from dtdsl.feed.worker import FeedContext

    ctx = FeedContext(bundle)
    sizes = [ctx.source.sizes(s) for s in range(steps)]
    out = []
    for policy in (ctx.policy, frozenset()):
        start = time.perf_counter()
        for sz in sizes:
            route_batch(ctx.plan, ctx.program, sz, policy, ctx.work_model)
        out.append((time.perf_counter() - start) / steps)
    return out[0], out[1]


def launch(bundle: Path, run_dir: Path, steps: int) -> list[dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(bundle / "launch.sh"), "--run-dir", str(run_dir),
                           "--steps", str(steps)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtdsl-feed-") as tmp:
        root = Path(tmp)
        data = root / "data"
        assert cli.main(["data", "synth", str(SPEC), "-o", str(data), "--samples",
                         str(args.samples), "-q"]) == 0
        bundles = {}
        for name, reorder in (("reorder", None), ("none", "none")):
            spec = SPEC
            if reorder is not None:
                spec = root / "tiny_none.dt"
                spec.write_text(SPEC.read_text().replace("reorder          = [intra, inter]",
                                                         "reorder          = none"))
            bundles[name] = root / f"bundle_{name}"
            assert cli.main(["compile", str(spec), "-o", str(bundles[name]), "--data",
                             str(data), "--workers", "2"]) == 0
        batch = json.loads((bundles["reorder"] / "plan.json").read_text())["global_batch"]

        one, two = worker_rates(bundles["reorder"], args.steps, batch)
        print(f"worker throughput (tiny_cpu, decode + reorder + pack): 1 worker "
              f"{one:.0f} samples/s; 2 workers {two:.0f} samples/s = {two / one:.2f}x")
        with_policy, plain = reorder_cost(bundles["reorder"], args.steps)
        print(f"routing per step: intra+inter {with_policy * 1e3:.1f} ms, data order "
              f"{plain * 1e3:.2f} ms (on the workers, off the trainers)")
        for name, bundle in bundles.items():
            rows = launch(bundle, root / f"run_{name}", args.steps)[1:]
            fractions = [r["data_wait_s"] / r["iteration_time_s"] for r in rows]
            waits = [r["data_wait_s"] for r in rows]
            print(f"trainer, {name:>7}: data wait {statistics.mean(fractions):.2%} of the "
                  f"step (median {statistics.median(fractions):.2%}, max {max(fractions):.2%};"
                  f" mean {statistics.mean(waits) * 1e3:.1f} ms), iteration "
                  f"{statistics.mean(r['iteration_time_s'] for r in rows) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
