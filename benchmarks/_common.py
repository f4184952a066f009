"""Shared helpers of the benchmarks: load shipped specs, time things."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # for tests.planner.random_specs

from dtdsl.cost.model import CostModel, build_cost_model  # noqa: E402
from dtdsl.driver import read_spec, run_frontend  # noqa: E402
from dtdsl.ir import program as ir  # noqa: E402

SHIPPED = ("tiny_cpu", "mllm_9b", "mllm_15b", "mllm_72b", "audio_image", "internvl_9b")
PAPER_SCALE = ("mllm_9b", "mllm_15b", "mllm_72b")
# Specs that are not shipped (benchmarks/specs/): other sizes, a video encoder, a heavy
# encoder, for figures on models the planner was not tuned on.
UNSHIPPED = ("mllm_3b", "video_7b", "heavy_vit_34b", "heavy_vit_9b")


def compile_text(name: str, text: str) -> ir.Program:
    result = run_frontend(name, text.encode())
    if not result.ok or result.program is None:
        raise SystemExit(f"{name} does not check: {[d.message for d in result.diagnostics]}")
    return result.program


def spec_path(name: str) -> Path:
    """A shipped spec's path (specs/), or a benchmark's own (benchmarks/specs/)."""
    path = ROOT / "specs" / f"{name}.dt"
    return path if path.exists() else ROOT / "benchmarks" / "specs" / f"{name}.dt"


@cache
def shipped(name: str) -> ir.Program:
    path, data = read_spec(str(spec_path(name)))
    return compile_text(path, data.decode())


@cache
def cost(name: str) -> CostModel:
    return build_cost_model(shipped(name))


def timed(fn: Callable[[], object], repeats: int = 5) -> tuple[object, float, float]:
    """The result of fn, and the median and best of ``repeats`` wall times."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times), min(times)
