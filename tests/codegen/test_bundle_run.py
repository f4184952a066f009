"""A compiled tiny bundle, launched with its launch.sh (torchrun, gloo), trains like the
single-process reference and writes its run directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.driver import run_frontend
from dtdsl.runtime.reference import train_reference

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_cpu.dt"
STEPS = 3
RTOL = 1e-4


def free_port_base(span: int = 16) -> int:
    """A port with ``span`` free ports after it (best effort: bound then released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65000:
            continue
        try:
            socks = []
            for p in range(base, base + span):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def launch(bundle: Path, run_dir: Path, *extra: str, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(bundle / "launch.sh"), "--run-dir", str(run_dir),
                           "--port-base", str(free_port_base()), *extra],
                          capture_output=True, text=True, timeout=timeout, env=full,
                          check=False)


def reference_losses(steps: int) -> list[float]:
    program = run_frontend(str(SPEC), SPEC.read_bytes()).program
    return [r["loss"] for r in train_reference(program, steps)]


@pytest.mark.slow
def test_in_process_bundle_matches_the_reference(tmp_path):
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(SPEC), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    run_dir = tmp_path / "run"
    proc = launch(bundle, run_dir, "--steps", str(STEPS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
        assert m["iteration_time_s"] > 0 and m["data_wait_s"] >= 0
    # every sample of a step consumed once by every unit
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for step in range(STEPS):
        for unit in ("vit", "llm", "gen"):
            keys = [k for r in records if r["step"] == step and r["unit"] == unit
                    for k in r["keys"]]
            assert sorted(keys) == sorted(f"synthetic/{step}/{i}" for i in range(16))
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"measured/pipeline/gantt", "predicted/pipeline/gantt"} <= set(tags["images"])
    assert {"measured/loss/total", "measured/data/wait_s",
            "measured/throughput/samples_per_s", "predicted/time/iteration_s"} <= \
        set(tags["scalars"])
