"""The planner's prediction against a run on this machine (issue 18's check): profile
this machine (``dtc profile``), plan a two-rank spec with the profile, run its bundle (one
thread per rank, each on its own core) and print per step each stage's measured compute
and the iteration against the prediction the run wrote next to them (``timelines.jsonl``:
the simulator on that step's own batch, routed as the run routed it, priced by the
profile). Targets: 15% per stage and 20% per iteration, on a quiet machine; timings, so the
suite asserts only that a run writes both (tests/codegen/test_bundle_reorder.py). The spec
routes every batch under the default reorder policy (intra and inter, the policy that sees
the whole pipeline); ``--packing`` runs it with ``train.packing = true``, so the backbone
trains packed rows of several documents with document-causal attention (FlexAttention).

    python benchmarks/predicted_vs_measured.py [--steps 7] [--packing]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import _common  # noqa: F401  (puts the repository on the path for tests.*)

from dtdsl import cli
from tests.helpers.bundle import launch_ok, read_jsonl

# The targets the ratios are held to. The encoder's passes
# are small (one or two images): the runtime's fixed cost per pass (input preparation,
# FSDP2 hooks, the broker's packing), some 10 ms here, is not in the profile, which times
# layers; it has measured 1.14x to 1.25x, short of STAGE_TOLERANCE.
STAGE_TOLERANCE = 0.15
ITERATION_TOLERANCE = 0.20
ENCODER_TOLERANCE = 0.35
STEPS = 7
WARMUP = 2           # steps not compared: allocations, first-call dispatch, Adam's moments

# An encoder and a backbone on one rank each, large enough that compute, not Python,
# dominates a pass on a CPU core.
SPEC = """\
spec predicted_vs_measured

model {
  encoder vit (image) {
    arch = transformer(layers=4, hidden=384, heads=6, ffn=1536, patch=8)
  }
  backbone llm {
    arch = transformer(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1536, vocab=2048,
                       swiglu)
  }
  projector vit -> llm : mlp(depth=2)
}

data synthetic {
  text.tokens   ~ lognormal(median=96, sigma=0.4) clamp [16, 256]
  image.count   ~ choice([1, 2], p=[0.5, 0.5])
  image.patches ~ choice([64, 144], p=[0.5, 0.5])
}

cluster local {
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 2
  gpus_per_node = 2
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
  cpu_workers   = 0
}

train {
  global_batch     = 8
  micro_batch      = 1
  seq_len          = 512
  schedule         = 1f1b
  optimizer        = adamw(lr=1e-3, weight_decay=0.01, zero=1)
  precision        = fp32
  steps            = 6
  seed             = 7
  checkpoint_every = 0
}

constraints {
  tp(*) == 1
}
"""


@dataclass(frozen=True)
class Comparison:
    """Measured and predicted seconds per compared step: each stage's compute and the
    iteration."""

    measured_s: dict[str, list[float]]
    predicted_s: dict[str, list[float]]

    @property
    def stages(self) -> list[str]:
        return sorted(k for k in self.measured_s if k != "iteration")

    def mean_ratio(self, name: str) -> float:
        """Measured over predicted, over the compared steps (a stage or "iteration")."""
        return fmean(self.measured_s[name]) / fmean(self.predicted_s[name])


def measure(work: Path, text: str = SPEC, *, steps: int = STEPS) -> Comparison:
    """Profile, plan, compile and run the spec ``text`` in ``work``; compare the steps after
    the first WARMUP."""
    from dtdsl.ir.timeline import Timeline

    spec = work / "spec.dt"
    spec.write_text(text)
    profile = work / "profile.json"
    assert cli.main(["profile", str(spec), "-o", str(profile), "--device", "cpu",
                     "--threads", "1", "-q"]) == 0
    bundle = work / "bundle"
    # Disaggregated: each unit's stage timed on its own ranks (co-located, the ViT's
    # passes would be part of the backbone stage's).
    assert cli.main(["compile", str(spec), "--profile", str(profile), "--synthetic",
                     "--workers", "0", "-o", str(bundle), "--placement", "disaggregated"]) == 0
    run_dir = work / "run"
    launch_ok(bundle, run_dir, "--steps", str(steps),
              env={"DTDSL_THREADS": "1", "OMP_NUM_THREADS": "1"})
    measured: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    for line in read_jsonl(run_dir / "timelines.jsonl")[WARMUP:]:
        m = Timeline.from_json(line["measured"])
        p = Timeline.from_json(line["predicted"])
        for stage, seconds in m.compute_s().items():
            measured.setdefault(stage, []).append(seconds)
            predicted.setdefault(stage, []).append(p.compute_s()[stage])
        measured.setdefault("iteration", []).append(m.iteration_time_s)
        predicted.setdefault("iteration", []).append(p.iteration_time_s)
    return Comparison(measured_s=measured, predicted_s=predicted)


def packed_spec() -> str:
    """SPEC with its samples packed into rows of seq_len."""
    old = "  micro_batch      = 1\n"
    assert old in SPEC
    return SPEC.replace(old, old + "  packing          = true\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--packing", action="store_true",
                        help="the spec with train.packing = true (packed attention)")
    args = parser.parse_args()
    spec = packed_spec() if args.packing else SPEC
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Path(tmp), spec, steps=args.steps)
    steps = len(result.measured_s["iteration"])
    print(f"{'':<10} " + " ".join(f"{'step ' + str(k):>16}" for k in
                                  range(WARMUP, WARMUP + steps)) +
          f" {'mean ratio':>11}")
    for name in [*result.stages, "iteration"]:
        cells = " ".join(f"{m * 1e3:7.0f}/{p * 1e3:<6.0f}ms" for m, p in
                         zip(result.measured_s[name], result.predicted_s[name], strict=True))
        ratio = result.mean_ratio(name)
        target = ITERATION_TOLERANCE if name == "iteration" else STAGE_TOLERANCE
        verdict = "meets" if abs(ratio - 1) <= target else (
            "short, within the encoder's allowance" if name.startswith("vit") and
            abs(ratio - 1) <= ENCODER_TOLERANCE else "misses")
        print(f"{name:<10} {cells} {ratio:>10.3f}x  {verdict} +-{target:.0%}")
    print("\nmeasured/predicted per step (a stage's compute: its forward and backward "
          "passes, from when their inputs arrived)")


if __name__ == "__main__":
    main()
