"""The runtime's training step against a plain PyTorch loop of the same model, on the same
device and in the same precision (the issue's target: a ratio of at most 1.05 on a GPU;
on a CPU the figure is information only).

One rank trains a text-only Llama-style backbone (the sizes below; one unit, one rank:
what fits one device) through everything a bundle's rank runs: the schedule executor over
its 1F1B action list (microbatches of ``--micro-batch`` samples), FSDP2 with the spec's
``MixedPrecisionPolicy``, the job-wide gradient norm, clipping and the fused AdamW, with
the step's data built beforehand. The plain loop is what a PyTorch user writes: the same
model (``build_unit``, the same initial weights), the same samples and microbatches,
``torch.autocast`` in bf16 (fp32 otherwise), ``loss.backward()`` per microbatch,
``clip_grad_norm_`` and fused AdamW. Steps alternate between the two (plain first on even
steps) so that load from other jobs hits both alike; each step is timed after a device
synchronisation; the figure is the median over the steps after ``--warmup`` of the
per-step ratio. The losses of the two agree (printed: exactly in fp32 up to summation
order, within bf16's rounding in bf16).

    python benchmarks/step_vs_torch.py [--precision bf16|fp32] [--layers 4 --hidden 128
        --heads 4 --ffn 256 --vocab 512 --seq 512] [--steps 20 --warmup 3]
        [--compile-plain] [--runtime-compile auto|true|false] [--json FILE]
        [--trace FILE.json.gz] [--trace-plain FILE.json.gz] [--save-plan DIR]

The runtime runs as a bundle's rank would: its layers compiled on a GPU (``train {
compile }`` unset), eager on a CPU; ``--runtime-compile true|false`` sets it.
``--compile-plain`` compiles the plain loop's layers (``torch.compile``, layer by layer as
the runtime does), the fair opponent of the compiled runtime; ``--trace`` profiles one more
runtime step; ``--json`` also records the runtime's peak device memory on its last timed
step (less what the plain side holds); ``benchmarks/gpu_check.py`` runs it these ways.
Measured on an H200 (torch 2.11, bf16, the GPU sizes below): compiled runtime against the
compiled plain loop **1.09** over 40 timed steps (1.098 median of per-step ratios, 1.091
ratio of median steps, 217 vs 199 ms; benchmarks/results/
step_vs_torch-h200-2026-11-27-44steps.json), down from 1.165 (run7) once a DP mesh of one
rank makes the stage one FSDP2 unit instead of one per layer (``parallel.fsdp.apply_fsdp``). A
20-step run of the same code read 0.972 and eager 0.982 (run8): whichever side runs first
in a step is 10-25% slower than when it runs second, so short runs swing with the order;
``first_over_first`` compares only the steps each side ran first (1.13 in the 40-step
run). Not the allocator meeting new lengths, as first thought: with the launcher's
expandable segments (which this benchmark now sets, as ``launch.sh`` does) the effect
stays (1.10 ratio of medians, 1.10 first over first, 1.047 median of per-step ratios;
``...-44steps-expandable.json``).
What remains (a traced step, ``--trace``): FSDP2's root hooks at world size 1, about 45 ms
of host per traced step (the once-per-step copy into and out of the reduce buffer 14 ms,
the per-microbatch post-backward callbacks and fp32 accumulation 19 ms, pre-forward 8 ms),
which a plain loop does not run; the runtime's kernels take less time than the plain
loop's (159 vs 169 ms). Earlier, with a unit per layer: ~100 ms more host per traced step.

A 20-step run on 2026-11-28 read 1.091 (1.180 median over median;
``...-2026-11-28-traced.json``); its traced steps, with Python stacks (``--trace-stack``:
the host runs some 3x slower traced, so only the ranking counts), put the device's longest
idle gap (23.5 ms) in FSDP2's ``chunk_cat`` at world size 1, a host stall of 19 ms (now
``parallel.fsdp.reduce_alone``), and about 40 ms of host in walks of the module tree per
microbatch and step (MoE blocks and FSDP2 modules, now found once). Not yet measured again
on a GPU after those changes.

On a GPU, e.g. ``--layers 8 --hidden 2048 --heads 16 --ffn 5632 --vocab 32000 --seq 2048
--micro-batch 2 --batch 16``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtdsl.cost.model import build_cost_model  # noqa: E402
from dtdsl.data.batch import LocalBatches, SyntheticSource  # noqa: E402
from dtdsl.driver import run_frontend  # noqa: E402
from dtdsl.models.multimodal import build_unit, loss_normalizer, microbatch_loss  # noqa: E402
from dtdsl.parallel.device import init_distributed, rank_device  # noqa: E402
from dtdsl.parallel.mesh import build_groups  # noqa: E402
from dtdsl.planner import plan as make_plan  # noqa: E402
from dtdsl.schedule.lower import lower  # noqa: E402
from dtdsl.train.executor import StageExecutor  # noqa: E402
from dtdsl.train.supervise import trainer_env  # noqa: E402

SPEC = """spec step_vs_torch
model {{
  backbone llm {{
    arch = transformer(layers={layers}, hidden={hidden}, heads={heads}, kv_heads={kv},
                       ffn={ffn}, vocab={vocab}, swiglu)
  }}
}}
data text {{
  text.tokens ~ lognormal(median={median}, sigma=0.3) clamp [8, {seq}]
}}
cluster one {{
  gpu = custom(name="bench", memory=80 GiB, peak=1000 TFLOPS)
  gpus = 1
  intra_node_bw = 400 GB/s
  inter_node_bw = 400 Gb/s
}}
train {{
  global_batch = {batch}
  micro_batch = {micro_batch}
  seq_len = {seq}
  schedule = 1f1b
  optimizer = adamw(lr=1e-4, zero=1)
  precision = {precision}
  reorder = []
  grad_clip = 1.0{compile}
}}
"""


class _Prebuilt:
    """A BatchSource serving batches built before the timed steps."""

    def __init__(self, feed: LocalBatches, steps: int):
        self.batches = {s: feed.batch(s) for s in range(steps)}

    def batch(self, step: int):
        return self.batches[step]


def _free_port() -> int:
    """A port no one listens on now: two benchmarks at once (the tests run in parallel)
    must not share a rendezvous port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("kv-heads", 2),
                          ("ffn", 256), ("vocab", 512), ("seq", 512), ("batch", 16),
                          ("micro-batch", 2), ("steps", 20), ("warmup", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--compile-plain", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile every layer of the plain loop's model with BACKEND "
                   "(default inductor): the runtime (compiled on a GPU, see "
                   "--runtime-compile) against a compiled plain loop")
    p.add_argument("--runtime-compile", choices=("auto", "true", "false"), default="auto",
                   help="the spec's train.compile: auto leaves it unset (the runtime "
                   "compiles its layers on a GPU, not on a CPU)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON here")
    p.add_argument("--trace", metavar="FILE",
                   help="after the timed steps, profile one runtime step (torch.profiler, "
                   "Kineto) and write its Chrome trace here (gzip'd if FILE ends in .gz)")
    p.add_argument("--trace-plain", metavar="FILE",
                   help="likewise one step of the plain loop, after the runtime's")
    p.add_argument("--trace-stack", action="store_true",
                   help="record Python stacks in the traces (torch.profiler with_stack), "
                   "so that the device's idle gaps are put down to the Python function "
                   "the host was in (``idle_causes``); the host runs slower while traced")
    p.add_argument("--save-plan", metavar="DIR",
                   help="write the spec (step_vs_torch.dt) and its plan (plan.json) here, "
                   "for `dtc memcheck --plan`")
    return p.parse_args(argv)


def spec_text(args: argparse.Namespace) -> str:
    """The one-unit text-only spec the benchmark trains, at ``args``' sizes."""
    return SPEC.format(layers=args.layers, hidden=args.hidden, heads=args.heads,
                       kv=args.kv_heads, ffn=args.ffn, vocab=args.vocab, seq=args.seq,
                       median=max(8, args.seq // 2), batch=args.batch,
                       micro_batch=args.micro_batch, precision=args.precision,
                       compile="" if args.runtime_compile == "auto"
                       else f"\n  compile = {args.runtime_compile}")


@dataclass
class Bench:
    """Both sides, built and ready: ``plain(step)`` and ``runtime(step)`` each train one
    step and return its loss."""

    program: Any
    plan: Any
    device: torch.device
    executor: StageExecutor
    plain: Callable[[int], float]
    plain_state: Callable[[], int]

    def runtime(self, step: int) -> float:
        return self.executor.run_step(step)["loss"]


def build(args: argparse.Namespace, text: str) -> Bench:
    """Initialise the one-rank process group and build both sides (module docstring).
    Raises ValueError when the spec does not check."""
    result = run_frontend("step_vs_torch.dt", text.encode())
    if not result.ok:
        raise ValueError("\n".join(d.message for d in result.diagnostics))
    program = result.program
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # The allocator a bundle's ranks run with (``launch.sh``), for both sides alike:
    # read when CUDA first allocates, so before ``rank_device``.
    os.environ.update(trainer_env(os.environ))
    torch.set_num_threads(max(1, int(os.environ.get("DTDSL_THREADS", "1"))))
    device = rank_device()
    init_distributed(device)
    plan = make_plan(build_cost_model(program), compare_baseline=False)
    groups = build_groups(plan, device_type=device.type)
    feed = _Prebuilt(LocalBatches(program, plan, groups.role), args.steps + 1)
    ex = StageExecutor(program, plan, lower(plan, program), rank=0, groups=groups,
                       feed=feed, device=device)

    model = build_unit(program, "llm", program.train.seed, device=device)
    model.train()
    if args.compile_plain:
        # Layer by layer, as torchtitan compiles: the step functions call the layers
        # themselves, and every layer shares the one compiled graph.
        for layer in model.layers.values():
            layer.compile(backend=args.compile_plain)
        # Both models' layers run TransformerLayer.forward, whose compiled graphs dynamo
        # keeps per code object: the plain loop's (automatic dynamic shapes, a graph per
        # new specialisation) must not use up the runtime's recompile limit, which would
        # leave the runtime's layers eager (one process holds both, a rank holds one).
        torch._dynamo.config.recompile_limit += 64
        torch._dynamo.config.accumulated_recompile_limit += 64
    params = list(model.parameters())
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=program.train.optimizer.lr,
                            betas=program.train.optimizer.betas,
                            eps=program.train.optimizer.eps,
                            weight_decay=program.train.optimizer.weight_decay, **fused)
    source = SyntheticSource(program)
    batches = {s: [source.sample(s, i) for i in range(program.train.global_batch)]
               for s in range(args.steps + 1)}
    units = _Units(model, program)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=args.precision == "bf16")

    def plain(step: int) -> float:
        samples = [_to(s, device) for s in batches[step]]
        norm = loss_normalizer(units, samples)
        total = torch.zeros((), device=device)
        mb = program.train.micro_batch
        for start in range(0, len(samples), mb):
            with autocast:
                loss = microbatch_loss(units, samples[start:start + mb], norm).total
            loss.backward()
            total += loss.detach()      # on the device: no host sync per microbatch
        torch.nn.utils.clip_grad_norm_(params, program.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    def plain_state() -> int:
        """Bytes the plain side keeps on the device between steps (weights, gradients,
        optimizer state): what a peak taken during a runtime step holds besides its own."""
        tensors = [*params, *(p.grad for p in params if p.grad is not None),
                   *(v for s in opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))]
        return sum(t.untyped_storage().nbytes() for t in tensors if t.device == device)

    return Bench(program, plan, device, ex, plain, plain_state)


def compare(bench: Bench, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``steps`` steps on both sides, alternating which goes first; the per-step
    times and losses, and the runtime's peak device memory on its last timed step (less
    what the plain side holds meanwhile; None on the CPU)."""
    device = bench.device
    ratios, diffs, times = [], [], {"plain": [], "runtime": []}
    first: dict[str, list[float]] = {"plain": [], "runtime": []}
    losses_all: dict[str, list[float]] = {"plain": [], "runtime": []}
    peak = None
    for step in range(steps):
        order = ("plain", "runtime") if step % 2 == 0 else ("runtime", "plain")
        took, losses = {}, {}
        for side in order:
            _sync(device)
            measure = device.type == "cuda" and side == "runtime" and step == steps - 1
            if measure:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            losses[side] = bench.plain(step) if side == "plain" else bench.runtime(step)
            _sync(device)
            took[side] = time.perf_counter() - t0
            if measure:
                peak = torch.cuda.max_memory_allocated(device) - bench.plain_state()
        diffs.append(abs(losses["runtime"] - losses["plain"]) / abs(losses["plain"]))
        for side in losses:
            losses_all[side].append(losses[side])
        if step >= warmup:
            ratios.append(took["runtime"] / took["plain"])
            for side in took:
                times[side].append(took[side])
            first[order[0]].append(took[order[0]])
    return {"ratios": ratios, "diffs": diffs, "times": times, "first": first,
            "losses": losses_all,
            "runtime_peak_bytes": peak}


def trace_step(bench: Bench, step: int, path: Path, top: int = 10, *,
               side: str = "runtime", stack: bool = False) -> dict[str, Any]:
    """Profile ``side``'s step ``step`` (the runtime's or the plain loop's) with Kineto
    (CPU and, on CUDA, device activities), write its Chrome trace to ``path`` (gzip'd if it
    ends in .gz) and return the ``top`` device kernels by total time (CPU operators where
    there is no device), where the step's time went (``device_time``) and why the device
    sat idle (``idle_causes``; ``stack``: with Python stacks)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if bench.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    run = bench.runtime if side == "runtime" else bench.plain
    _sync(bench.device)
    with profile(activities=activities, with_stack=stack) as prof:
        run(step)
        _sync(bench.device)
    raw = path.with_name(path.name.removesuffix(".gz"))
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    busy, idle = device_time(trace), idle_causes(trace)
    if path.name.endswith(".gz"):
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return {"top_kernels": top_kernels(prof, top, cuda=bench.device.type == "cuda"),
            "device_time": busy, "idle_causes": idle}


def device_time(trace: dict[str, Any]) -> dict[str, Any]:
    """Where a traced step's time went on the device, from its Chrome trace: the span from
    the first to the last kernel, the kernels' summed time, the time some kernel ran
    (their union: on one stream, the sum less nothing), and the idle rest of the span
    (the device waiting on the host, or on a copy), in milliseconds; ``kernels`` counts
    launches. Empty where the trace holds no kernel (a CPU run)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                   for e in trace.get("traceEvents", [])
                   if e.get("ph") == "X" and e.get("cat") == "kernel")
    if not spans:
        return {}
    busy, end = 0.0, spans[0][0]
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    span = spans[-1][1] - spans[0][0]
    return {"kernels": len(spans), "span_ms": span / 1e3,
            "kernel_sum_ms": sum(hi - lo for lo, hi in spans) / 1e3,
            "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3}


# What keeps a device busy in a Kineto trace: kernels, copies and fills.
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def idle_causes(trace: dict[str, Any], *, min_gap_us: float = 20.0,
                top: int = 12) -> dict[str, Any]:
    """Why the device sat idle in a traced step, from its Chrome trace: every gap of at
    least ``min_gap_us`` between device activities, put down to what the host was doing.
    A gap whose next kernel was launched after the gap began is the host's (the device
    waited for the launch): it is charged to the innermost host frames (Python functions
    with ``with_stack``, else operators) running on the launching thread halfway between
    the gap's start and that launch. A gap whose next kernel was launched before it began
    waited on something else (another stream, a copy, an event). Milliseconds by cause,
    the largest ``top``; empty where the trace holds no device activity (a CPU run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e)
                    for e in events if e.get("cat") in _DEVICE_CATS)
    if not device:
        return {}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    host: dict[Any, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") in _HOST_CATS:
            host.setdefault(e.get("tid"), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]))
    causes: dict[str, float] = {}
    counts: dict[str, int] = {}
    end = device[0][1]
    total = 0.0
    for lo, hi, e in device[1:]:
        gap = lo - end
        if gap >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is None or float(launch["ts"]) <= end:
                key = "waited on another stream, a copy or an event"
            else:
                at = (end + float(launch["ts"])) / 2
                frames = sorted((f for f in host.get(launch.get("tid"), ())
                                 if f[0] <= at <= f[1]), key=lambda f: (f[0], -f[1]))
                key = " > ".join(_short(f[2]) for f in frames[-3:]) or "host, untraced"
            causes[key] = causes.get(key, 0.0) + gap
            counts[key] = counts.get(key, 0) + 1
            total += gap
        end = max(end, hi)
    ranked = sorted(causes, key=lambda k: -causes[k])[:top]
    return {"gaps_ms": total / 1e3, "min_gap_us": min_gap_us,
            "causes": [{"host": k, "ms": round(causes[k] / 1e3, 3), "gaps": counts[k]}
                       for k in ranked]}


def _short(name: str) -> str:
    """A traced frame's name without its site-packages prefix."""
    for marker in ("site-packages/", "dtdsl/"):
        if marker in name:
            return ("dtdsl/" if marker == "dtdsl/" else "") + name.split(marker, 1)[1]
    return name


def top_kernels(prof: Any, top: int, *, cuda: bool) -> list[dict[str, Any]]:
    """The ``top`` device kernels of a finished profile by total device time (CPU
    operators by self time without a device, or where the profile lists no kernel of its
    own: then by the device time of their kernels)."""
    events = list(prof.key_averages())
    rows = []
    if cuda:
        rows = [_row(e, _device_time_us(e)) for e in events
                if _device_time_us(e) > 0 and not _is_cpu_op(e)]
        if not rows:
            rows = [_row(e, _device_time_us(e)) for e in events if _device_time_us(e) > 0]
    if not rows:
        rows = [_row(e, e.self_cpu_time_total) for e in events]
    rows.sort(key=lambda r: -r["total_us"])
    return rows[:top]


def _row(e: Any, us: float) -> dict[str, Any]:
    return {"name": e.key, "total_us": round(float(us), 1), "calls": e.count}


def _device_time_us(e: Any) -> float:
    # self_device_time_total in newer torch; self_cuda_time_total before it.
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def _is_cpu_op(e: Any) -> bool:
    """An operator launched from the CPU (aten::..., a profiler label) rather than a
    kernel: its device time is its kernels', counted under their own names already."""
    device_type = str(getattr(e, "device_type", ""))
    return device_type.endswith("CPU")


def report(args: argparse.Namespace, bench: Bench, figures: dict[str, Any]) -> dict[str, Any]:
    """Print the figures (the lines the tests read) and return them as JSON values."""
    ratios, times, diffs = figures["ratios"], figures["times"], figures["diffs"]
    device = bench.device
    plain = "compiled plain" if args.compile_plain else "plain"
    compiled = bench.executor.stage.compiled
    runtime = "compiled runtime" if compiled is not None else "eager runtime"
    print(f"device {device} ({torch.accelerator.current_accelerator() or 'cpu'}), "
          f"precision {args.precision}, {len(ratios)} timed steps, {runtime} against the "
          f"{plain} loop")
    if compiled is not None:
        print(f"runtime: {len(compiled.blocks)} blocks compiled, {compiled.graphs} graph(s) "
              "over the run")
    for side in ("plain", "runtime"):
        print(f"{side:8s} step: median {statistics.median(times[side]) * 1e3:.1f} ms")
    print(f"losses: max rel diff {max(diffs):.1e}")
    print("runtime/plain median step time over median step time: "
          f"{statistics.median(times['runtime']) / statistics.median(times['plain']):.3f}")
    first = figures["first"]
    first_ratio = (statistics.median(first["runtime"]) / statistics.median(first["plain"])
                   if first["runtime"] and first["plain"] else None)
    if first_ratio is not None:
        print(f"runtime/plain median step time, each side first in its step: "
              f"{first_ratio:.3f}")
    print(f"runtime/plain step time (median of per-step ratios): "
          f"{statistics.median(ratios):.3f} (target <= 1.05 on a GPU; a CPU figure is "
          "information only)")
    return {"device": str(device), "precision": args.precision,
            "compile_plain": args.compile_plain, "timed_steps": len(ratios),
            "runtime_compiled": compiled is not None,
            "runtime_graphs": compiled.graphs if compiled is not None else None,
            "plain_ms": statistics.median(times["plain"]) * 1e3,
            "runtime_ms": statistics.median(times["runtime"]) * 1e3,
            "runtime_over_plain": statistics.median(ratios),
            # The other reading of the same steps: the two sides' median step times.
            "median_over_median": (statistics.median(times["runtime"])
                                   / statistics.median(times["plain"])),
            # Only the steps each side ran first, right after its own previous step: the
            # step's new lengths meet that side's allocator and compiled graphs first
            # (the second side finds blocks of those sizes cached), as every step of a
            # real run does. On an H200 the first side ran 10-25% slower than the second.
            "first_over_first": first_ratio,
            "step_ms": {side: [t * 1e3 for t in times[side]] for side in times},
            "max_rel_loss_diff": max(diffs), "losses": figures["losses"],
            "runtime_peak_bytes": figures["runtime_peak_bytes"],
            "sizes": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                   "ffn", "vocab", "seq", "batch",
                                                   "micro_batch")}}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps <= args.warmup:
        print("no timed steps: raise --steps above --warmup", file=sys.stderr)
        return 2
    text = spec_text(args)
    try:
        bench = build(args, text)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.save_plan:
        out = Path(args.save_plan)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_vs_torch.dt").write_text(text)
        (out / "plan.json").write_text(bench.plan.model_dump_json(indent=2) + "\n")
    figures = compare(bench, args.steps, args.warmup)
    result = report(args, bench, figures)
    for side, path in (("runtime", args.trace), ("plain", args.trace_plain)):
        if path:
            traced = trace_step(bench, args.steps, Path(path), side=side,
                                stack=args.trace_stack)
            key = "trace" if side == "runtime" else "trace_plain"
            result[f"{key}_top_kernels"] = traced["top_kernels"]
            result[f"{key}_device_time"] = traced["device_time"]
            result[f"{key}_idle_causes"] = traced["idle_causes"]
            print(f"trace of {side} step {args.steps} written to {path}: "
                  + (", ".join(f"{k} {v:.1f}" for k, v in traced["device_time"].items())
                     or "no device kernels"))
            for cause in traced["idle_causes"].get("causes", [])[:6]:
                print(f"  idle {cause['ms']:7.2f} ms in {cause['gaps']:4d} gaps: "
                      f"{cause['host']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


class _Units:
    """The plain loop's model as ``models.multimodal``'s step functions read it."""

    def __init__(self, model: torch.nn.Module, program):
        self.units = {"llm": model}
        self.backbone = "llm"
        self.encoder = None
        self.generators = ()
        self.gen_proj = {}
        self.patch = 1
        self.image_tokens = program.image_tokens()
        self.seq_len = program.train.seq_len

    def unit(self, name: str) -> torch.nn.Module:
        return self.units[name]


def _to(sample, device):
    from dtdsl.parallel.device import to_device

    return to_device(sample, device)


if __name__ == "__main__":
    sys.exit(main())
