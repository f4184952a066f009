"""The runtime's benchmarks still run end to end (a couple of steps each; the figures
themselves are measured by hand: see the benchmarks' docstrings)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize(("script", "figure", "args"), [
    ("step_vs_torch.py", r"runtime/plain step time \(median of per-step ratios\): "
                         r"(\d+\.\d+)", ("--precision", "fp32")),
    ("step_vs_torch.py", r"runtime/plain step time \(median of per-step ratios\): "
                         r"(\d+\.\d+)", ("--precision", "bf16")),
])
def test_runtime_benchmark_runs(script, figure, args):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--steps", "5",
                           "--warmup", "2", *args], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    drift = re.search(r"max rel diff (\d\.\de[-+]\d+)", proc.stdout)     # same losses
    # the same losses: fp32 up to summation order, bf16 within its rounding
    limit = 1e-4 if "fp32" in args else 1e-2
    assert drift and float(drift.group(1)) < limit, proc.stdout[-2000:]
    found = re.search(figure, proc.stdout)
    assert found and 0.2 < float(found.group(1)) < 5, proc.stdout[-2000:]
