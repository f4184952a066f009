"""On a GPU: the tiny bundle on CUDA with NCCL in bf16, and the runtime's step against a
plain PyTorch loop. Marked ``gpu``; skipped where CUDA (or enough GPUs) is missing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtdsl import cli
from tests.helpers.bundle import SPEC, launch_ok, read_jsonl, reference_losses

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4,
                    reason="the tiny bundle runs 4 ranks, one per GPU (NCCL)")
def test_tiny_bundle_trains_on_cuda_with_nccl_in_bf16(tmp_path):
    spec = tmp_path / "tiny_bf16.dt"
    spec.write_text(SPEC.read_text().replace("precision        = fp32",
                                             "precision        = bf16"))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic", "--workers", "0",
                     "--steps", str(STEPS)]) == 0
    run_dir = tmp_path / "run"
    proc = launch_ok(bundle, run_dir)
    assert "on cuda:0 (nccl)" in proc.stdout, proc.stdout[-2000:]
    losses = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    want = reference_losses(STEPS)                    # fp32, one process, on the CPU
    assert len(losses) == STEPS
    for got, ref in zip(losses, want, strict=True):
        assert abs(got - ref) <= 0.03 * abs(ref), (got, ref)


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_runtime_step_against_a_plain_loop_on_one_gpu(precision):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_vs_torch.py"), "--precision",
         precision, "--steps", "12", "--warmup", "4", "--layers", "4", "--hidden", "1024",
         "--heads", "8", "--kv-heads", "8", "--ffn", "2816", "--vocab", "32000",
         "--seq", "1024", "--batch", "8", "--micro-batch", "2"],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "device cuda" in proc.stdout, proc.stdout
    drift = float(re.search(r"max rel diff (\S+)", proc.stdout).group(1))
    assert drift < (1e-4 if precision == "fp32" else 3e-2), proc.stdout
    ratio = float(re.search(r"\(median of per-step ratios\): (\d+\.\d+)", proc.stdout).group(1))
    print(json.dumps({"precision": precision, "runtime_over_plain": ratio}))
    assert 0.2 < ratio < 5, proc.stdout


@requires_cuda
def test_attention_of_changing_lengths_runs_flash_not_cudnn():
    """cuDNN's fused attention plans every new shape (milliseconds of host time); the
    runtime's microbatches change length every step, so dense attention prefers flash
    (``models.attention.DENSE_BACKENDS``; measured in benchmarks/gpu_check.py).

    The process's first call is left out: on an H200 (torch 2.11) it ran cuDNN's kernel
    under the same priority order and every later call flash, whatever its shape
    (benchmarks/results/gpu_check-h200-2026-11-27-run7.json's session); one plan per
    process is not the per-shape cost this guards against."""
    from torch.profiler import ProfilerActivity, profile

    from dtdsl.models.attention import dense_attention

    q = torch.randn(2, 8, 32, 64, device="cuda", dtype=torch.bfloat16)
    dense_attention(q, q[:, :2], q[:, :2], causal=True)
    names = set()
    for seq in (96, 160, 224):
        q = torch.randn(2, 8, seq, 64, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(2, 2, seq, 64, device="cuda", dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dense_attention(q, kv, kv, causal=True)
            torch.cuda.synchronize()
        names |= {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    assert not any("cudnn" in n.lower() for n in names), sorted(names)
    assert any("flash" in n.lower() for n in names), sorted(names)
