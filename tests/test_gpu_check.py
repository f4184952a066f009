"""benchmarks/gpu_check.py: the no-GPU path, its guards, and every section's code run on the
CPU at tiny sizes (``--device cpu --smoke``); the GPU figures themselves come from a run
on a GPU machine."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    proc = run("--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA GPU" in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["gpu"] is False and report["tool"] == "dtdsl gpu_check"
    assert report["sections"] == {}


def test_the_cpu_runs_only_the_smoke_sizes(tmp_path):
    proc = run("--device", "cpu", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--device cpu runs only with --smoke" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_a_report_it_did_not_write_is_left_alone(tmp_path):
    theirs = tmp_path / "gpu_check.json"
    theirs.write_text('{"someone": "else"}')
    proc = run("--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0
    assert "was not written by gpu_check" in proc.stderr
    assert theirs.read_text() == '{"someone": "else"}'


def test_a_section_past_the_budget_is_recorded_as_skipped(tmp_path):
    proc = run("--device", "cpu", "--smoke", "--sections", "layer_mfu", "--budget", "0.001",
               "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["layer_mfu"]
    assert section["status"] == "skipped" and "budget" in section["reason"]


@pytest.mark.parametrize(("name", "preset", "in_table"), [
    ("NVIDIA H100 80GB HBM3", "H100", True),
    ("NVIDIA H200", "H200", True),
    ("NVIDIA A100-SXM4-80GB", "A100", True),
    ("NVIDIA A10G", "H100", False),
    ("NVIDIA H1000", "H100", False),
])
def test_the_assumed_peak_is_dtdsls_own_for_the_gpu(name, preset, in_table):
    from dtdsl.ir.hardware import GPU_PRESETS

    peak = gpu_check.assumed_peak(name)
    assert (peak["preset"], peak["in_table"]) == (preset, in_table)
    assert peak["peak_flops"] == GPU_PRESETS[preset].peak_flops


def test_layer_flops_are_one_layer_of_the_cost_models_count():
    from dtdsl.cost.flops import backbone_forward

    arch = gpu_check._shipped("mllm_9b").backbone.arch
    tokens = 8192
    # The whole backbone's forward less its LM head, over its layers; backward twice.
    head = 2 * tokens * arch.hidden * arch.vocab
    per_layer = (backbone_forward(arch, tokens).total - head) / arch.layers
    assert gpu_check.layer_flops(arch, tokens) == pytest.approx(3 * per_layer)


@pytest.mark.slow
def test_the_smoke_run_exercises_every_section_on_the_cpu(tmp_path):
    # One torch thread: the smoke sizes are tiny, and beside the suite's other processes
    # torch's default of one thread per core spins for its share of the cores.
    proc = run("--device", "cpu", "--smoke", "--budget", "1200", "--out", str(tmp_path),
               env={"OMP_NUM_THREADS": "1"}, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    assert {k: v["status"] for k, v in sections.items()} == dict.fromkeys(sections, "ok")
    assert report["done"] is True and report["gpu"] is False

    env = sections["env"]
    assert env["matmul_bf16"]["tflops"] > 0 and env["assumed_peak"]["peak_flops"] > 0
    runs = sections["layer_mfu"]["runs"]
    assert {(r["mode"], r["tokens"]) for r in runs} == {
        (m, t) for m in ("eager", "compiled") for t in gpu_check.SMOKE.layer_tokens}
    assert all(r["mfu"] > 0 and r["recompiles_while_timed"] == 0 for r in runs)
    assert all(r["graphs_first_call"] >= 1 for r in runs if r["mode"] == "compiled")
    assert any(r.get("attention_kernels", {}).get("attention") for r in runs)

    step = sections["step_vs_torch"]
    assert step["plain"]["compile_plain"] is None
    assert step["compiled_plain"]["compile_plain"] == "aot_eager"
    for side in ("plain", "compiled_plain"):
        assert step[side]["max_rel_loss_diff"] < 1e-2      # bf16 rounding, same losses
    assert step["summary"]["runtime_over_compiled_plain"] > 0

    bundle = sections["bundle"]
    assert bundle["passed"] is True and "(gloo)" in bundle["device_backend"]
    assert len(bundle["losses"]) == gpu_check.SMOKE.bundle_steps
    multimodal = sections["multimodal"]
    assert multimodal["passed"] is True
    assert multimodal["units"] == {"vit": "co-located", "llm": "1 GPU", "gen": "co-located"}

    trace = sections["trace"]
    assert trace["top_kernels"] and trace["file"] == "trace.json.gz"
    events = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert events["traceEvents"]
    assert not (tmp_path / "trace.json").exists()

    (stage,) = sections["memory"]["memcheck"]
    assert stage["predicted_bytes"] > 0 and stage["measured_bytes"] > 0

    # benchmarks/host_overhead.py on the tiny plan, eager on the CPU: its one backbone
    # stage runs the co-located encoder and generator, priced with them; no GPU time
    # beside the plan's.
    (host,) = sections["host"]["stages"]
    assert (host["stage"], host["mode"], host["hosted"]) == ("llm s0", "eager", ["vit", "gen"])
    assert host["host_ms"] > 0 and host["planned_gpu_ms"] > 0 and "gpu_ms" not in host
    assert host["host_over_planned"] == pytest.approx(host["host_ms"] / host["planned_gpu_ms"])


def test_the_targets_read_the_8k_layer_and_the_step_against_the_compiled_loop():
    report = gpu_check.Report(None, {})
    runs = [{"mode": "eager", "tokens": 8192, "mfu": 0.42, "tflops": 415.0},
            {"mode": "compiled", "tokens": 8192, "mfu": 0.55, "tflops": 544.0},
            {"mode": "compiled", "tokens": 2048, "mfu": 0.9, "tflops": 890.0},
            {"mode": "eager", "tokens": 2048, "error": "RuntimeError: out of memory"}]
    report.data["sections"] = {
        "layer_mfu": {"status": "error", "runs": runs},
        "step_vs_torch": {"status": "ok", "summary": {"runtime_over_plain": 0.9,
                                                      "runtime_over_compiled_plain": 1.07}}}
    got = gpu_check.targets(report)
    assert (got["layer_mfu_8k"], got["layer_mfu_8k_met"]) == (0.55, True)
    assert (got["step_over_compiled_plain"], got["step_met"]) == (1.07, False)
    assert any("MFU 55.0%" in line for line in gpu_check.summary(report))

    report.data["sections"] = {"layer_mfu": {"status": "skipped", "reason": "budget"}}
    got = gpu_check.targets(report)
    assert got["layer_mfu_8k_met"] is None and got["step_met"] is None


def test_device_time_splits_a_traced_span_into_kernels_and_idle():
    """Two streams' kernels overlap (counted once in busy, twice in the sum), a gap of
    idle device between them, and CPU events left out."""
    from step_vs_torch import device_time

    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "ts": 50, "dur": 100},    # overlaps: busy to 150
              {"ph": "X", "cat": "kernel", "ts": 400, "dur": 100},   # 250 us idle before
              {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 10_000}]
    got = device_time({"traceEvents": events})
    assert got == {"kernels": 3, "span_ms": 0.5, "kernel_sum_ms": 0.3, "busy_ms": 0.25,
                   "idle_ms": 0.25}
    assert device_time({"traceEvents": events[3:]}) == {}


def test_idle_causes_charges_a_late_launch_to_the_host_frame_and_an_early_one_elsewhere():
    """Kernel b's launch came 300 us after a ended: the 400 us gap is the host's, charged
    to the innermost frames the launching thread was in halfway there; kernel c was
    launched before b ended, so the gap before it waited on something else; a gap
    under the threshold is not counted."""
    from step_vs_torch import idle_causes

    def x(cat, ts, dur, name="k", **args):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "tid": 1,
                "args": args}

    events = [x("kernel", 0, 100, correlation=1), x("kernel", 500, 100, correlation=2),
              x("kernel", 700, 100, correlation=3), x("kernel", 805, 10, correlation=4),
              x("cuda_runtime", 0, 5, "cudaLaunchKernel", correlation=1),
              x("cuda_runtime", 400, 5, "cudaLaunchKernel", correlation=2),
              x("cuda_runtime", 450, 5, "cudaLaunchKernel", correlation=3),
              x("cuda_runtime", 460, 5, "cudaLaunchKernel", correlation=4),
              x("python_function", 50, 1000, "dtdsl/train/executor.py(10): run_step"),
              x("python_function", 200, 150, "torch/distributed/fsdp/x.py(5): pre_forward"),
              x("cpu_op", 380, 30, "aten::copy_")]
    got = idle_causes({"traceEvents": events})
    assert got["gaps_ms"] == 0.5
    assert got["causes"] == [
        {"host": "dtdsl/train/executor.py(10): run_step > "
                 "torch/distributed/fsdp/x.py(5): pre_forward", "ms": 0.4, "gaps": 1},
        {"host": "waited on another stream, a copy or an event", "ms": 0.1, "gaps": 1}]
    assert idle_causes({"traceEvents": events[4:]}) == {}
