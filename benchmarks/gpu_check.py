"""The GPU check of issue 28 (item 9): one command that, on a machine with one CUDA GPU,
measures what the issue's figures need and writes them to ``gpu_check.json``.

    python benchmarks/gpu_check.py --out DIR [--budget 360]
    python benchmarks/gpu_check.py --device cpu --smoke --out DIR    # the code paths, tiny

Sections, in order of value; each is timed, its error recorded without stopping the
others, and the JSON rewritten after every one (a killed run keeps what it finished);
a section that would start past the budget is recorded as skipped:

1. ``env``: torch, CUDA, NCCL and cuDNN versions, the GPU, a bf16 8192^3 matrix product's
   TFLOP/s (a ceiling), and the peak dtdsl's cost model assumes for this GPU
   (``ir.hardware.GPU_PRESETS``; the H100 figure, said so, for a GPU not in the table).
2. ``layer_mfu``: one backbone layer of ``specs/mllm_9b.dt`` (dtdsl's
   ``TransformerLayer``, TP 1, bf16 weights), forward and backward of one sequence of 2K
   and 8K tokens, eager and ``torch.compile``d; FLOPs from the cost model's own counts
   (``cost.flops``: the layer's projections and MLP, its causal attention, backward twice
   the forward), time by CUDA events after warm-up; the graphs compiled; which attention
   kernels one forward ran.
3. ``step_vs_torch``: ``benchmarks/step_vs_torch.py`` in bf16 at a GPU size: the eager
   runtime against a plain loop, and the runtime as a GPU rank runs it (its layers
   compiled, ``train.compile`` unset) against a compiled plain loop (a process each).
4. ``bundle``: a one-unit text-only spec on one GPU, compiled by ``dtc compile``, launched
   by its ``launch.sh`` (one rank: NCCL refuses two ranks on one GPU, and a multimodal
   spec needs a GPU per unit), in bf16, its losses against ``dtc reference`` (fp32, CPU);
   on a GPU its layers are compiled, the graphs it compiled counted from its output.
5. ``trace``: a Kineto trace of one runtime step of section 3 (``trace.json.gz``) and its
   ten most expensive kernels.
6. ``memory``: the runtime step's peak allocated device memory in section 3 against what
   ``dtc memcheck`` predicts and measures for the same spec and plan.
7. ``host``: ``benchmarks/host_overhead.py --device cuda`` on ``specs/mllm_9b.dt``'s plan:
   each measured stage at its own sizes, compiled, the host's time to issue one microbatch
   beside the GPU's time for it and the plan's (its budget does not fit the default
   ``--budget``: ask for it, ``--sections host --budget 300``).

Without a CUDA GPU (and without ``--device cpu``) it says so, writes
``{"gpu": false, ...}`` and exits 0. Exit status 1 when a section failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["SECTIONS", "main"]

SECTIONS = ("env", "layer_mfu", "step_vs_torch", "bundle", "multimodal", "trace", "memory",
            "host")
TOOL = "dtdsl gpu_check"
REPORT = "gpu_check.json"
TRACE = "trace.json.gz"
# A bf16 run's losses against the fp32 reference, relative: bf16 keeps 8 bits of
# mantissa, and a few steps of training compound its rounding (tests/test_gpu.py's bound).
BUNDLE_RTOL = 0.03
# Each section's most seconds (on an H100; compile time included). A section starts only
# while its budget fits in what is left of the whole run's.
BUDGET_S = {"env": 30, "layer_mfu": 150, "step_vs_torch": 170, "bundle": 70,
            "multimodal": 90, "trace": 0, "memory": 50, "host": 240}
ATTENTION_KERNEL = re.compile(r"flash|cudnn|efficient|fmha|flex|attention|sdpa|scaled_dot",
                              re.IGNORECASE)

BUNDLE_SPEC = """spec gpu_check_bundle
model {{
  backbone llm {{
    arch = transformer(layers={layers}, hidden={hidden}, heads=4, kv_heads=2, ffn={ffn},
                       vocab=512, swiglu)
  }}
}}
data text {{
  text.tokens ~ lognormal(median=96, sigma=0.5) clamp [8, 256]
}}
cluster one {{
  gpu           = custom(name="one", memory=80 GiB, peak=1000 TFLOPS)
  gpus          = 1
  gpus_per_node = 1
  intra_node_bw = 400 GB/s
  inter_node_bw = 400 Gb/s
}}
train {{
  global_batch = 8
  micro_batch  = 2
  seq_len      = 256
  schedule     = 1f1b
  optimizer    = adamw(lr=1e-3, weight_decay=0.01, zero=1)
  precision    = bf16
  reorder      = []
  steps        = {steps}
  seed         = 1234
}}
"""


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the full sizes on a GPU, tiny ones for ``--smoke``."""

    matmul: int
    layer_spec: str
    layer_tokens: tuple[int, ...]
    warmup: int
    iters: int
    compile_backend: str
    step_args: tuple[str, ...]
    bundle_layers: int
    bundle_hidden: int
    bundle_steps: int
    host_args: tuple[str, ...]      # benchmarks/host_overhead.py's


FULL = Sizes(matmul=8192, layer_spec="mllm_9b", layer_tokens=(2048, 8192), warmup=3,
             iters=10, compile_backend="inductor",
             step_args=("--layers", "8", "--hidden", "2048", "--heads", "16", "--kv-heads",
                        "4", "--ffn", "5632", "--vocab", "32000", "--seq", "2048",
                        "--micro-batch", "2", "--batch", "16", "--steps", "20", "--warmup",
                        "3"),
             bundle_layers=4, bundle_hidden=256, bundle_steps=6,
             host_args=("mllm_9b", "--device", "cuda", "--modes", "compiled", "--warmup", "2",
                        "--repeats", "5"))
# aot_eager: the compiled paths' tracing without inductor's C++ builds on a CPU.
SMOKE = Sizes(matmul=256, layer_spec="tiny_cpu", layer_tokens=(64, 128), warmup=1, iters=2,
              compile_backend="aot_eager",
              step_args=("--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                         "--ffn", "128", "--vocab", "256", "--seq", "128", "--micro-batch",
                         "2", "--batch", "4", "--steps", "3", "--warmup", "1"),
              bundle_layers=2, bundle_hidden=64, bundle_steps=2,
              # The tiny spec as it is, eager: inductor's C++ builds would be most of it.
              host_args=("tiny_cpu", "--device", "cpu", "--modes", "eager", "--shrink", "1",
                         "--tokens", "1", "--warmup", "1", "--repeats", "2"))


def _say(start: float, text: str) -> None:
    print(f"[gpu_check {time.perf_counter() - start:6.1f}s] {text}", flush=True)


class Report:
    """The JSON report, rewritten whole (through a temporary file) after every section."""

    def __init__(self, out: Path | None, head: dict[str, Any]):
        self.out = out
        self.data: dict[str, Any] = {"tool": TOOL, **head, "sections": {}}

    def write(self) -> None:
        if self.out is None:
            return
        tmp = self.out / (REPORT + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.out / REPORT)


def _out_dir(path: str | None) -> Path | None:
    """``--out``, created; refuses a folder whose gpu_check.json another tool wrote."""
    if path is None:
        return None
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    old = out / REPORT
    if old.exists():
        try:
            ours = json.loads(old.read_text()).get("tool") == TOOL
        except (ValueError, OSError, AttributeError):
            ours = False
        if not ours:
            raise SystemExit(f"gpu_check: {old} exists and was not written by gpu_check; "
                             "give another --out folder")
    return out


# ---- 1. env ---------------------------------------------------------------------------

def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(fn: Callable[[], Any], device: Any, warmup: int, iters: int) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` calls after ``warmup``: CUDA events on a
    GPU, the host clock after a synchronisation otherwise."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def assumed_peak(gpu_name: str) -> dict[str, Any]:
    """The dense bf16 peak dtdsl's cost model uses for a GPU of this name: its preset in
    ``GPU_PRESETS`` (the name as a word in the device's name), else the H100's, said so."""
    from dtdsl.ir.hardware import GPU_PRESETS

    for key, preset in GPU_PRESETS.items():
        if re.search(rf"\b{re.escape(key)}\b", gpu_name, re.IGNORECASE):
            return {"preset": key, "peak_flops": preset.peak_flops, "in_table": True}
    return {"preset": "H100", "peak_flops": GPU_PRESETS["H100"].peak_flops, "in_table": False,
            "note": f"{gpu_name!r} is not in dtdsl's GPU table; the H100 SXM figure is used"}


def _matmul(dev: Any, n: int) -> dict[str, float]:
    """An n x n x n bf16 matrix product on random data (zeros run faster): the ceiling."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = _timed_ms(lambda: a @ b, dev, warmup=3, iters=10 if dev.type == "cuda" else 2)
    return {"n": n, "ms": ms, "tflops": 2 * n ** 3 / (ms / 1e3) / 1e12}


def section_env(ctx: Context) -> dict[str, Any]:
    import torch

    dev = ctx.device
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": sys.version.split()[0]}
    # TF32 for any fp32 matrix product on the GPU (every figure here is bf16 regardless).
    torch.backends.cuda.matmul.allow_tf32 = True
    info["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, sm_count=props.multi_processor_count,
                    memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}",
                    cudnn=torch.backends.cudnn.version())
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - a version string is not worth failing on
            info["nccl"] = f"unknown: {err}"
    else:
        info.update(gpu=None, note="no GPU: the CPU ran the smoke sizes")
    info["matmul_bf16"] = _matmul(dev, ctx.sizes.matmul)
    peak = assumed_peak(info["gpu"] or "")
    info["assumed_peak"] = peak
    ctx.peak_flops = peak["peak_flops"]
    return info


# ---- 2. layer MFU ------------------------------------------------------------------------

def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far (-1 where torch hides it)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, KeyError, TypeError):
        return -1


def layer_flops(arch: Any, tokens: int) -> float:
    """Forward and backward FLOPs of one backbone layer on one sequence of ``tokens``, as
    the cost model counts them (``cost.flops``; a trainable layer's backward is twice its
    forward, ``backward_factor``)."""
    from dtdsl.cost.flops import backbone_attention, transformer_layer_matmul_per_token

    forward = tokens * transformer_layer_matmul_per_token(arch) + \
        backbone_attention(arch, tokens * tokens) / arch.layers
    return 3.0 * forward


def _kernel_names(prof: Any, cuda: bool) -> list[str]:
    """Device kernels of a profile (CPU operators where there is no device), most
    expensive first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_vs_torch import top_kernels

    return [r["name"] for r in top_kernels(prof, 1000, cuda=cuda)]


def _attention_kernels(fn: Callable[[], Any], device: Any) -> dict[str, Any]:
    """Which attention kernels one call of ``fn`` ran (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # With gradients on, as trained: a compiled layer would compile again without them.
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    names = _kernel_names(prof, cuda)
    return {"attention": [k for k in names if ATTENTION_KERNEL.search(k)][:8],
            "triton_kernels": sum("triton" in k.lower() for k in names),
            "kernels": len(names)}


def section_layer_mfu(ctx: Context) -> dict[str, Any]:
    import torch

    from dtdsl.models.transformer import TransformerLayer

    if not ctx.peak_flops:      # the env section failed: dtdsl's figure for no known GPU
        ctx.peak_flops = assumed_peak("")["peak_flops"]
    arch = _shipped(ctx.sizes.layer_spec).backbone.arch
    out: dict[str, Any] = {"spec": ctx.sizes.layer_spec, "dtype": "bfloat16",
                           "arch": {k: getattr(arch, k) for k in ("hidden", "heads",
                                                                  "kv_heads", "ffn")},
                           "peak_flops": ctx.peak_flops, "runs": []}
    try:
        out["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled()}
    except AttributeError:
        pass
    deadline = ctx.section_deadline
    for mode in ("eager", "compiled"):
        # The largest first: the figure is at 8K, and compiling may use up the
        # budget.
        for tokens in sorted(ctx.sizes.layer_tokens, reverse=True):
            if time.perf_counter() > deadline:
                out["runs"].append({"mode": mode, "tokens": tokens,
                                    "skipped": "over the section's budget"})
                continue
            ctx.say(f"layer_mfu: {mode}, {tokens} tokens")
            try:
                out["runs"].append(_layer_run(ctx, arch, mode, tokens, TransformerLayer))
            except Exception as err:  # noqa: BLE001 - recorded, the other runs go on
                out["runs"].append({"mode": mode, "tokens": tokens, "error": _err(err)})
            _free()
    failed = [f"{r['mode']} {r['tokens']}" for r in out["runs"] if "error" in r]
    if failed:
        out["error"] = f"runs {', '.join(failed)} failed"
    return out


def _layer_run(ctx: Context, arch: Any, mode: str, tokens: int, layer_cls: Any
               ) -> dict[str, Any]:
    import torch

    dev = ctx.device
    torch.manual_seed(0)
    layer = layer_cls(arch, tp=1, role="backbone").to(device=dev, dtype=torch.bfloat16)
    if mode == "compiled":
        torch._dynamo.reset()    # this size's graphs counted on their own
        fn = torch.compile(layer, dynamic=False, backend=ctx.sizes.compile_backend)
    else:
        fn = layer
    x = torch.randn(1, tokens, arch.hidden, device=dev, dtype=torch.bfloat16,
                    requires_grad=True)
    positions = torch.arange(tokens, device=dev)
    grad = torch.randn_like(x)
    params = list(layer.parameters())

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        fn(x, positions).backward(grad)

    graphs0 = _graphs()
    t0 = time.perf_counter()
    step()
    _sync(dev)
    first_s = time.perf_counter() - t0
    graphs1 = _graphs()
    ms = _timed_ms(step, dev, warmup=ctx.sizes.warmup, iters=ctx.sizes.iters)
    graphs2 = _graphs()
    flops = layer_flops(arch, tokens)
    run = {"mode": mode, "tokens": tokens, "ms": ms, "flops": flops,
           "tflops": flops / (ms / 1e3) / 1e12,
           "mfu": flops / (ms / 1e3) / ctx.peak_flops, "first_call_s": first_s,
           "graphs_first_call": graphs1 - graphs0 if graphs0 >= 0 else None,
           "recompiles_while_timed": graphs2 - graphs1 if graphs0 >= 0 else None}
    if tokens == max(ctx.sizes.layer_tokens):
        run["attention_kernels"] = _attention_kernels(lambda: fn(x, positions), dev)
    if dev.type == "cuda":
        run["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    return run


# ---- 3, 5, 6. step_vs_torch, its trace, memory --------------------------------------------

def section_step(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, extra in (("plain", ()), ("compiled_plain",
                                          ("--compile-plain", ctx.sizes.compile_backend))):
        left = ctx.section_deadline - time.perf_counter()
        if left < 20:
            out[name] = {"skipped": "over the section's budget"}
            continue
        result = ctx.work / f"step_{name}.json"
        args = [*ctx.sizes.step_args, "--precision", "bf16", "--json", str(result), *extra]
        if name == "plain":
            # Eager against eager: the runtime's host overhead. This run also traces one
            # more step and keeps its spec and plan for memcheck (sections 5 and 6; memcheck
            # measures eager modules). Against the compiled loop the runtime runs as a
            # bundle's rank does: compiled on a GPU (train.compile unset).
            args += ["--runtime-compile", "false", "--trace", str(ctx.trace_path()),
                     "--save-plan", str(ctx.work)]
        else:
            # Both compiled sides traced too, with Python stacks: where the runtime's
            # excess goes (the device idle between kernels, and what the host was doing
            # then: ``idle_causes``, or more kernel time).
            args += ["--trace", str(ctx.trace_path("compiled")),
                     "--trace-plain", str(ctx.trace_path("compiled_plain")),
                     "--trace-stack"]
        ctx.say(f"step_vs_torch: against the {name.replace('_', ' ')} loop")
        rc, tail = ctx.child([str(ROOT / "benchmarks" / "step_vs_torch.py"), *args], left,
                             f"step {name}")
        if rc != 0 or not result.exists():
            out[name] = {"error": f"exit {rc}", "output_tail": tail}
            continue
        out[name] = json.loads(result.read_text())
    ctx.step_results = out
    ratios = {k: v.get("runtime_over_plain") for k, v in out.items()}
    out["summary"] = {"runtime_over_plain": ratios.get("plain"),
                      "runtime_over_compiled_plain": ratios.get("compiled_plain"),
                      "median_over_median": {k: v.get("median_over_median")
                                             for k, v in out.items()},
                      "runtime_compiled": out["compiled_plain"].get("runtime_compiled"),
                      "target": "<= 1.05 against the compiled plain loop on a GPU"}
    failed = [k for k in ("plain", "compiled_plain") if "error" in out[k]]
    if failed:
        out["error"] = f"the run against the {' and '.join(failed)} loop failed"
    return out


def section_trace(ctx: Context) -> dict[str, Any]:
    plain = ctx.step_results.get("plain", {})
    path = ctx.trace_path()
    if "trace_top_kernels" not in plain or not path.exists():
        raise RuntimeError("section step_vs_torch's eager run left no trace: see its error")
    out = {"file": path.name if ctx.out is not None else str(path),
           "bytes": path.stat().st_size, "step": "one runtime step (step_vs_torch sizes)",
           "top_kernels": plain["trace_top_kernels"],
           "device_time": plain.get("trace_device_time")}
    # The compiled runtime against the compiled plain loop, a step of each.
    compiled = ctx.step_results.get("compiled_plain", {})
    for key in ("trace", "trace_plain"):
        if f"{key}_device_time" in compiled:
            side = "runtime" if key == "trace" else "plain"
            out[f"compiled_{side}"] = {"top_kernels": compiled[f"{key}_top_kernels"],
                                       "device_time": compiled[f"{key}_device_time"],
                                       "idle_causes": compiled.get(f"{key}_idle_causes")}
    if out["bytes"] > 16 * 2**20:
        out["note"] = "over 16 MiB: a device machine's $OUT may not bring it back"
    return out


def section_memory(ctx: Context) -> dict[str, Any]:
    plain = ctx.step_results.get("plain", {})
    spec, plan = ctx.work / "step_vs_torch.dt", ctx.work / "plan.json"
    if not spec.exists() or not plan.exists():
        raise RuntimeError("section step_vs_torch's eager run left no spec and plan")
    left = ctx.section_deadline - time.perf_counter()
    found_path = ctx.work / "memcheck.json"
    rc, tail = ctx.child(["-m", "dtdsl.cli", "memcheck", str(spec), "--plan", str(plan),
                          "--json", "--jobs", "1"], left, "memcheck", stdout=found_path)
    if rc != 0:
        raise RuntimeError(f"dtc memcheck exited {rc}: {tail[-2000:]}")
    found = json.loads(found_path.read_text())["stages"]
    measured = plain.get("runtime_peak_bytes")
    out: dict[str, Any] = {"runtime_peak_bytes": measured, "memcheck": found}
    if measured is None:
        out["note"] = "no CUDA peak on the CPU: memcheck's figures only"
    elif len(found) == 1:
        stage = found[0]
        out["measured_over_predicted"] = measured / stage["predicted_bytes"]
        out["measured_over_memcheck_measured"] = measured / stage["measured_bytes"]
    return out


# ---- 4. bundle --------------------------------------------------------------------------

def section_bundle(ctx: Context) -> dict[str, Any]:
    steps = ctx.sizes.bundle_steps
    text = BUNDLE_SPEC.format(layers=ctx.sizes.bundle_layers, hidden=ctx.sizes.bundle_hidden,
                              ffn=4 * ctx.sizes.bundle_hidden, steps=steps)
    return _bundle(ctx, "bundle", text, steps,
                   "one text-only unit on one GPU (world size 1), bf16")


def section_multimodal(ctx: Context) -> dict[str, Any]:
    """The shipped tiny spec (ViT, backbone, U-Net) on one GPU in bf16: dtc plan co-locates
    the ViT and the U-Net on the backbone's GPU, so one NCCL rank runs all three."""
    steps = ctx.sizes.bundle_steps
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    for old, new in (('gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)',
                      'gpu           = custom(name="one", memory=80 GiB, peak=1000 TFLOPS)'),
                     ("gpus          = 4", "gpus          = 1"),
                     ("gpus_per_node = 4", "gpus_per_node = 1"),
                     # Eager: compiling the ViT, backbone and U-Net blocks for the drawn
                     # image and batch sizes took over 100 s on an H200 (dynamo
                     # specialises sizes of 1); the bundle section runs compiled.
                     ("precision        = fp32",
                      "precision        = bf16\n  compile          = false"),
                     ('  source = "data/tiny"\n', ""),
                     ("steps            = 20", f"steps            = {steps}"),
                     ("checkpoint_every = 10", f"checkpoint_every = {10 * steps}")):
        if old not in text:
            raise RuntimeError(f"specs/tiny_cpu.dt changed: {old!r} is not in it")
        text = text.replace(old, new)
    out = _bundle(ctx, "multimodal", text, steps,
                  "tiny_cpu (ViT, backbone, U-Net) on one GPU, co-located, bf16")
    plan = json.loads((ctx.work / "multimodal" / "bundle" / "plan.json").read_text())
    out["units"] = {u["name"]: ("co-located" if u["colocated"] else f"{u['gpus']} GPU")
                    for u in plan["units"]}
    return out


def _bundle(ctx: Context, name: str, text: str, steps: int, what: str) -> dict[str, Any]:
    """Compile ``text`` for one GPU, launch it, and compare its losses with the fp32
    reference's."""
    work = ctx.work / name
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.dt"
    spec.write_text(text)
    bundle, run, ref = work / "bundle", work / "run", work / "reference.jsonl"
    out: dict[str, Any] = {"what": what, "steps": steps, "rtol": BUNDLE_RTOL}

    def left() -> float:
        return ctx.section_deadline - time.perf_counter()

    rc, tail = ctx.child(["-m", "dtdsl.cli", "compile", str(spec), "-o", str(bundle),
                          "--synthetic", "--workers", "0"], left(), "compile")
    if rc != 0:
        raise RuntimeError(f"dtc compile exited {rc}: {tail[-2000:]}")
    rc, launch_tail = ctx.child(["bash", str(bundle / "launch.sh"), "--run-dir", str(run)],
                                left(), "launch", python=False, keep=200)
    if rc != 0:
        raise RuntimeError(f"launch.sh exited {rc}: {launch_tail[-3000:]}")
    backend = re.search(r"on (\S+) \((\w+)\)", launch_tail)
    out["device_backend"] = backend.group(0) if backend else None
    # The rank compiles its layers on a GPU (train.compile unset): one line per graph.
    out["compiled_graphs"] = sum(int(n) for n in re.findall(r"compiled (\d+) graph",
                                                            launch_tail))
    rc, tail = ctx.child(["-m", "dtdsl.cli", "reference", str(spec), "--steps", str(steps),
                          "--out", str(ref), "-q"], left(), "reference", cpu=True)
    if rc != 0:
        raise RuntimeError(f"dtc reference exited {rc}: {tail[-2000:]}")
    got = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x)["loss"] for x in ref.read_text().splitlines()]
    diffs = [abs(g - w) for g, w in zip(got, want, strict=False)]
    out.update(losses=got, reference=want, max_abs_diff=max(diffs, default=None),
               max_rel_diff=max((d / abs(w) for d, w in zip(diffs, want, strict=False)),
                                default=None))
    out["passed"] = (len(got) == len(want) == steps and
                     all(d <= BUNDLE_RTOL * abs(w) for d, w in zip(diffs, want, strict=True)))
    if not out["passed"]:
        raise RuntimeError(f"the bundle's losses {got} are not within {BUNDLE_RTOL:.0%} of "
                           f"the reference's {want}")
    return out


# ---- the run ----------------------------------------------------------------------------

def _shipped(name: str) -> Any:
    from dtdsl.driver import read_spec, run_frontend

    path, data = read_spec(str(ROOT / "specs" / f"{name}.dt"))
    result = run_frontend(path, data)
    if not result.ok or result.program is None:
        raise RuntimeError(f"{path} does not check: {[d.message for d in result.diagnostics]}")
    return result.program


def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:4000]


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Context:
    """What the sections share: the device, the sizes, the clock, a scratch folder."""

    def __init__(self, device: Any, sizes: Sizes, out: Path | None, work: Path,
                 start: float):
        self.device, self.sizes, self.out, self.work = device, sizes, out, work
        self.start = start
        self.peak_flops = 0.0
        self.section_deadline = start
        self.step_results: dict[str, Any] = {}

    def say(self, text: str) -> None:
        _say(self.start, text)

    def trace_path(self, run: str = "") -> Path:
        """The eager runtime step's trace; ``run`` names another run's."""
        name = TRACE if not run else TRACE.replace("trace", f"trace_{run}")
        return (self.out or self.work) / name

    def child(self, args: Sequence[str], timeout: float, tag: str, *, python: bool = True,
              cpu: bool = False, keep: int = 60, stdout: Path | None = None
              ) -> tuple[int | None, str]:
        """Run a child process (``python args`` unless ``python`` is off) in a session of
        its own, echoing its output (its standard output goes to ``stdout`` instead when
        given); killed with its children after ``timeout`` seconds. Its exit status (None
        when killed) and its last ``keep`` lines."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if self.device.type == "cpu" or cpu:
            env["DTDSL_DEVICE"] = "cpu"
        cmd = [sys.executable, *args] if python else list(args)
        sink = open(stdout, "w") if stdout is not None else None  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=sink or subprocess.PIPE,
                                stderr=subprocess.PIPE if sink else subprocess.STDOUT,
                                text=True, env=env, cwd=self.work, start_new_session=True)
        lines: deque[str] = deque(maxlen=keep)

        def pump() -> None:
            stream = proc.stderr if sink else proc.stdout
            assert stream is not None
            for line in stream:
                lines.append(line.rstrip("\n"))
                print(f"    [{tag}] {line.rstrip()}"[:300], flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)     # our own child's session
            proc.wait()
            rc = None
            lines.append(f"killed after {timeout:.0f} s (the section's budget)")
        reader.join(10)
        if sink is not None:
            sink.close()
        return rc, "\n".join(lines)


def section_host(ctx: Context) -> dict[str, Any]:
    """``benchmarks/host_overhead.py`` (``Sizes.host_args``): per measured stage, the host's
    time to issue one microbatch, the GPU's time for it (on CUDA) and the plan's."""
    result = ctx.work / "host.json"
    left = ctx.section_deadline - time.perf_counter()
    rc, tail = ctx.child([str(ROOT / "benchmarks" / "host_overhead.py"), *ctx.sizes.host_args,
                          "--json", str(result)], left, "host")
    if rc != 0 or not result.exists():
        raise RuntimeError(f"host_overhead exited {rc}: {tail[-2000:]}")
    found = json.loads(result.read_text())
    stages = []
    for row in found["units"]:
        for mode in ("eager", "compiled"):
            got = row.get(mode)
            if got is None:
                continue
            entry = {"stage": f"{row['unit']} s{row['stage']}", "mode": mode,
                     "hosted": row.get("hosted", [])}
            if "error" in got:
                entry["error"] = got["error"][:600]
            else:
                entry.update(host_ms=got["host_s"] * 1e3, planned_gpu_ms=row["gpu_s"] * 1e3,
                             host_over_planned=got["over_gpu"])
                if "gpu_s" in got:
                    entry.update(gpu_ms=got["gpu_s"] * 1e3,
                                 host_over_gpu=got["host_s"] / got["gpu_s"])
            stages.append(entry)
    out: dict[str, Any] = {"spec": found["spec"], "device": found["device"],
                           "stages": stages, "target": found["target"], "met": found["met"]}
    failed = [s["stage"] for s in stages if "error" in s]
    if failed:
        out["error"] = f"stages {', '.join(failed)} failed: see their error"
    return out


RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "env": section_env, "layer_mfu": section_layer_mfu, "step_vs_torch": section_step,
    "bundle": section_bundle, "multimodal": section_multimodal, "trace": section_trace,
    "memory": section_memory, "host": section_host}


def run_sections(ctx: Context, report: Report, budget_s: float,
                 only: Sequence[str]) -> bool:
    """Every section in order; True when none failed."""
    ok = True
    for name in SECTIONS:
        if name not in only:
            continue
        left = budget_s - (time.perf_counter() - ctx.start)
        # The budgets are maxima, compile time included; a section starts while half of
        # its budget is left (it stops its own parts at its deadline).
        need = min(BUDGET_S[name], budget_s)
        if need > 0 and left < need * 0.5:
            report.data["sections"][name] = {
                "status": "skipped", "reason": f"{left:.0f} s of the {budget_s:.0f} s budget "
                f"left, the section needs up to {BUDGET_S[name]} s"}
            ctx.say(f"{name}: skipped (budget)")
            report.write()
            continue
        # A section's own budget is a GPU's; the smoke sizes on a shared CPU (the test
        # suite's, loaded by other tests) may take what is left of the whole budget.
        own = left if ctx.sizes is SMOKE else min(BUDGET_S[name] or 30, left)
        ctx.section_deadline = time.perf_counter() + own
        ctx.say(f"{name}: start")
        t0 = time.perf_counter()
        try:
            found = RUNNERS[name](ctx)
            # A section that kept partial figures says what failed under "error".
            entry = {"status": "error" if "error" in found else "ok", **found}
            ok = ok and entry["status"] == "ok"
        except Exception as err:  # noqa: BLE001 - recorded; the next sections still run
            entry = {"status": "error", "error": _err(err)}
            ok = False
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        report.data["sections"][name] = entry
        report.data["elapsed_s"] = round(time.perf_counter() - ctx.start, 2)
        report.write()
        ctx.say(f"{name}: {entry['status']} in {entry['seconds']:.1f} s")
        _free()
    return ok


def targets(report: Report) -> dict[str, Any]:
    """The issue's two figures against their targets (None where not measured): one
    backbone layer at 8K tokens at least 50% MFU (the better of eager and compiled), the
    runtime's step within 5% of the compiled plain loop's."""
    s = report.data["sections"]
    big = max(FULL.layer_tokens)
    mfus = [r["mfu"] for r in s.get("layer_mfu", {}).get("runs", [])
            if "mfu" in r and r["tokens"] == big]
    ratio = s.get("step_vs_torch", {}).get("summary", {}).get("runtime_over_compiled_plain")
    return {"layer_mfu_8k": max(mfus) if mfus else None,
            "layer_mfu_8k_target": 0.5,
            "layer_mfu_8k_met": max(mfus) >= 0.5 if mfus else None,
            "step_over_compiled_plain": ratio, "step_target": 1.05,
            "step_met": ratio <= 1.05 if ratio is not None else None}


def summary(report: Report) -> list[str]:
    """The lines the issue's figures come from."""
    s = report.data["sections"]
    lines = []
    env = s.get("env", {})
    if "matmul_bf16" in env:
        lines.append(f"GPU {env.get('gpu')}: bf16 matmul {env['matmul_bf16']['tflops']:.0f} "
                     f"TFLOP/s; dtdsl assumes {env['assumed_peak']['peak_flops'] / 1e12:.0f}")
    for r in s.get("layer_mfu", {}).get("runs", []):
        if "mfu" in r:
            lines.append(f"layer {r['mode']:8s} {r['tokens']:5d} tokens: MFU {r['mfu']:.1%} "
                         f"({r['tflops']:.0f} TFLOP/s)")
    step = s.get("step_vs_torch", {}).get("summary", {})
    for key in ("runtime_over_plain", "runtime_over_compiled_plain"):
        if step.get(key) is not None:
            lines.append(f"step {key}: {step[key]:.3f}")
    bundle = s.get("bundle", {})
    if "max_rel_diff" in bundle:
        lines.append(f"bundle ({bundle.get('device_backend')}): losses within "
                     f"{bundle['max_rel_diff']:.1e} of the reference")
    if "targets" in report.data:
        lines.append(f"targets: {json.dumps(report.data['targets'])}")
    mem = s.get("memory", {})
    if "measured_over_predicted" in mem:
        lines.append(f"memory: measured/predicted {mem['measured_over_predicted']:.2f}")
    for st in s.get("host", {}).get("stages", []):
        if "host_ms" in st:
            gpu = f", GPU {st['gpu_ms']:.1f} ms ({st['host_over_gpu']:.2f})" \
                if "gpu_ms" in st else ""
            lines.append(f"host {st['stage']} {st['mode']}: {st['host_ms']:.1f} ms{gpu}, plan "
                         f"{st['planned_gpu_ms']:.1f} ms ({st['host_over_planned']:.2f})")
    lines += [f"{k}: {v['status']}" + (f" ({v.get('error', v.get('reason'))})"[:300]
                                      if v["status"] != "ok" else "") for k, v in s.items()]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", help="write gpu_check.json (and trace.json.gz) here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs the code paths at tiny sizes (needs --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the code paths only")
    p.add_argument("--budget", type=float, default=360.0, metavar="S",
                   help="seconds for the whole run; sections that would not fit are "
                   "skipped (default 360)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = p.parse_args(argv)
    only = [x for x in args.sections.split(",") if x]
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device == "cpu" and not args.smoke:
        p.error("--device cpu runs only with --smoke: the full sizes need a GPU")
    start = time.perf_counter()
    out = _out_dir(args.out)

    import torch

    head = {"torch": torch.__version__, "smoke": args.smoke, "budget_s": args.budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU on this machine (torch {torch.__version__}); nothing "
              "to measure (--device cpu --smoke runs the code paths on the CPU)", flush=True)
        report = Report(out, {"gpu": False, **head,
                              "reason": "torch.cuda.is_available() is False"})
        report.write()
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    report = Report(out, {"gpu": device.type == "cuda", "device": str(device), **head})
    report.write()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        ctx = Context(device, SMOKE if args.smoke else FULL, out, Path(work), start)
        ctx.say(f"on {device}, torch {torch.__version__}, budget {args.budget:.0f} s")
        ok = run_sections(ctx, report, args.budget, only)
    report.data["elapsed_s"] = round(time.perf_counter() - start, 2)
    report.data["done"] = True
    if device.type == "cuda":
        report.data["targets"] = targets(report)
    report.write()
    print("\n".join(["", "== gpu_check summary =="] + summary(report)), flush=True)
    if out is not None:
        print(f"report: {out / REPORT}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
