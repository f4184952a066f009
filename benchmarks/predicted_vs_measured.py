"""The planner's prediction against a run on this machine (issue 18's check): profile,
plan a two-rank spec with the profile, run its bundle, and print per step each stage's
measured compute and the iteration against the prediction (targets: 15% per stage, 20%
per iteration, on a quiet machine). The same measurement as
``tests/train/test_predicted_vs_measured.py``: its spec routes every batch under the
default reorder policy (intra and inter, the policy that sees the whole pipeline);
``--packing`` runs the same spec with ``train.packing = true``, so the backbone trains
packed rows of several documents with document-causal attention (FlexAttention).

    python benchmarks/predicted_vs_measured.py [--steps 6] [--packing]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from unittest import mock

import _common  # noqa: F401  (puts the repository on the path for tests.*)

import tests.train.test_predicted_vs_measured as check
from tests.train.test_predicted_vs_measured import (
    ENCODER_TOLERANCE,
    ITERATION_TOLERANCE,
    STAGE_TOLERANCE,
    STEPS,
    WARMUP,
    measure,
)


def packed_spec() -> str:
    """The check's spec with its samples packed into rows of seq_len."""
    old = "  micro_batch      = 1\n"
    assert old in check.SPEC
    return check.SPEC.replace(old, old + "  packing          = true\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--packing", action="store_true",
                        help="the spec with train.packing = true (packed attention)")
    args = parser.parse_args()
    spec = packed_spec() if args.packing else check.SPEC
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(check, "SPEC", spec):
        result = measure(Path(tmp), steps=args.steps)
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
