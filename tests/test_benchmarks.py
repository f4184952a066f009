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
def test_runtime_benchmark_runs():
    # fp32, the same losses up to summation order. Its bf16 run (and the compiled loop's)
    # is tests/test_gpu_check.py's smoke run of the step_vs_torch section. The ratio is a
    # timing: printed, never bounded here. 4 steps: Adam's state through a few
    # updates for the losses' drift, 3 timed steps for a median.
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "step_vs_torch.py"), "--steps",
                           "4", "--warmup", "1", "--precision", "fp32"], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    drift = re.search(r"max rel diff (\d\.\de[-+]\d+)", proc.stdout)     # same losses
    assert drift and float(drift.group(1)) < 1e-4, proc.stdout[-2000:]
    found = re.search(r"runtime/plain step time \(median of per-step ratios\): (\d+\.\d+)",
                      proc.stdout)
    assert found and float(found.group(1)) > 0, proc.stdout[-2000:]


def test_suite_cpu_counts_the_tests_and_the_processes_they_start(tmp_path):
    # One test that runs `dtc explain` three times as subprocesses, without xdist: each dtc
    # process is recorded by kind, the test by its file, and what no process recorded
    # (nothing forks here) is the rest of the tree's CPU, never negative.
    import json

    out = tmp_path / "cpu"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "suite_cpu.py"), "--workers", "0",
                           "--out", str(out), "tests/test_cli.py::test_explain"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tests"] == 1 and summary["tree_cpu_s"] > 0
    assert summary["by_kind"]["dtc"]["processes"] == 3
    assert summary["by_kind"]["pytest (main)"]["processes"] == 1
    assert summary["by_kind"]["forked children (not recorded: the rest)"]["cpu_s"] >= 0
    assert list(summary["by_file"]) == ["tests/test_cli.py"]
    (test,) = [r.split("\t") for r in (out / "tests.tsv").read_text().splitlines()]
    assert test[0] == "tests/test_cli.py::test_explain"
    assert 0 <= float(test[3]) <= float(test[1])     # the pytest process's own, of the CPU
    rows = (out / "processes.tsv").read_text().splitlines()
    assert sum(r.startswith("dtc\t") and "explain" in r for r in rows) == 3
    assert "by kind of process" in proc.stdout
