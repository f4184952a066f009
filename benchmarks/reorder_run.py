"""Measured step times of a real run under each reorder policy: a small backbone-only bundle
(two pipeline stages, gloo on this machine's CPUs, one thread a rank) whose samples vary
widely in length, compiled and launched with launch.sh once per policy, and the predicted
(simulated) step times of the same batches next to the measured ones.

The routing is ``dtdsl.reorder.workload.route`` in both the run (the ranks' batch source calls
``data.batch.route_batch``) and the prediction, so the figures come from the tree on
PYTHONPATH: run it with another tree's dtdsl first on the path to measure that tree's
policy (e.g. main's, to compare the old policy with the new one).

    python benchmarks/reorder_run.py [--steps 12] [--policies none both] [--keep DIR]

Steps 0 and 1 (start-up) are left out of the means. Run it on a quiet machine: the two
ranks share the CPUs with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT

from dtdsl import cli
from dtdsl.ir.timeline import Timeline

SPEC = """spec reorder_run

model {
  backbone llm {
    arch = transformer(layers=4, hidden=256, heads=4, kv_heads=2, ffn=768, vocab=512, swiglu)
  }
}

data varying {
  text.tokens ~ lognormal(median=96, sigma=1.0) clamp [16, 768]
}

cluster local {
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 2
  gpus_per_node = 2
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
  cpu_workers   = 1
}

train {
  global_batch     = 16
  micro_batch      = 1
  seq_len          = 1024
  schedule         = 1f1b
  optimizer        = adamw(lr=1e-3, weight_decay=0.01, zero=1)
  precision        = fp32
  reorder          = POLICY
  steps            = 100
  seed             = 1234
  checkpoint_every = 1000
}

constraints {
  tp(*) == 1
  pp(llm) == 2
}
"""
SKIP = 2


def run_policy(policy: str, steps: int, work: Path) -> tuple[list[float], list[float]]:
    """(measured, predicted) seconds per step of the bundle under ``policy``."""
    spec = work / f"{policy}.dt"
    spec.write_text(SPEC.replace("POLICY", "none" if policy == "none" else
                                 "[intra, inter]" if policy == "both" else f"[{policy}]"))
    bundle, run_dir = work / f"bundle-{policy}", work / f"run-{policy}"
    if cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic", "--workers", "0"]) != 0:
        raise SystemExit(f"dtc compile failed for {policy}")
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT))
                                         if p)}
    proc = subprocess.run(["bash", str(bundle / "launch.sh"), "--run-dir", str(run_dir),
                           "--steps", str(steps)], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {policy} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [json.loads(line) for line in
             (run_dir / "timelines.jsonl").read_text().splitlines()]
    measured = [m["iteration_time_s"] for m in metrics[SKIP:]]
    # The predictions are written on a background thread, which skips steps when it falls
    # behind: those it wrote.
    predicted = [Timeline.from_json(line["predicted"]).iteration_time_s for line in lines
                 if line["step"] >= SKIP]
    return measured, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--policies", nargs="+", default=["none", "both"],
                        choices=["none", "intra", "inter", "both"])
    parser.add_argument("--keep", type=Path, help="keep the bundles and runs here")
    args = parser.parse_args()
    if args.steps <= SKIP:
        raise SystemExit(f"--steps must be above {SKIP} (the start-up steps left out)")
    import dtdsl

    print(f"dtdsl from {Path(dtdsl.__file__).parent}")
    print(f"{'policy':<8} {'measured':>10} {'median':>10} {'predicted':>10}   per step (s)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for policy in args.policies:
            measured, predicted = run_policy(policy, args.steps, work)
            guess = f"{statistics.fmean(predicted):>9.3f}s" if predicted else f"{'-':>10}"
            print(f"{policy:<8} {statistics.fmean(measured):>9.3f}s "
                  f"{statistics.median(measured):>9.3f}s {guess}   "
                  + " ".join(f"{t:.3f}" for t in measured), flush=True)


if __name__ == "__main__":
    main()
