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
@pytest.mark.parametrize(("script", "figure"), [
    ("runtime_overhead.py", r"runtime/plain CPU per step \(median of per-step ratios\): "
                            r"(\d+\.\d+)"),
    ("pipeline_vs_torch.py", r"dtdsl/torch step time \(median\): (\d+\.\d+)"),
])
def test_runtime_benchmark_runs(script, figure):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--steps", "2",
                           "--warmup", "1"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    drift = re.search(r"max rel diff (\d\.\de[-+]\d+)", proc.stdout)     # same losses
    assert drift and float(drift.group(1)) < 1e-4, proc.stdout[-2000:]
    found = re.search(figure, proc.stdout)
    assert found and 0.2 < float(found.group(1)) < 5, proc.stdout[-2000:]
