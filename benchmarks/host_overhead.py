"""Host time per microbatch of every unit of a plan, eager and compiled, against the cost
model's GPU time for the same microbatch (issue 28, item 8), measured on this CPU.

A GPU runs its kernels asynchronously: what a training step costs the host is Python, the
dispatcher, DTensor's sharding propagation, autograd's bookkeeping, FSDP2's hooks and one
launch per kernel; the GPU stays busy while the host keeps ahead of it. The target: the
host time of one microbatch (forward and backward) at most ``TARGET`` (50%) of the GPU
time the plan prices it at (``UnitPlan.fwd_time_s + bwd_time_s``: one unit microbatch on
its slowest stage).

**Method.** Each unit's slowest stage (the most layers; the first such) is built by the
runtime itself (``train.stage.build_stage``: tensor parallelism at the plan's TP, that
stage's layers, activation checkpointing where planned, FSDP2 with the spec's mixed
precision, compiled blocks for the compiled figure) as one rank of the plan's world, on
this CPU, with every collective sent to torch's ``fake`` process group (it returns at
once and moves nothing: communication is the GPU's and the network's time, not the
host's). Its forward and backward then run on real tensors whose widths are divided by
``--shrink`` (16: hidden sizes, FFN, vocabulary, U-Net channels, head widths and groups,
the U-Net's latent to the smallest its levels divide; the heads, layers, blocks and their
structure are the spec's) and whose token counts are divided by ``--tokens`` (128: the
sequence length, image sides by its square root): the number of operators, the modules, hooks
and sharding decisions are those of the real shapes, while each kernel's arithmetic
shrinks to microseconds, about what launching it costs a GPU's host (a CUDA launch is
some 3-6 us of CPU), in fp32 (this CPU's bf16 kernels take tens of microseconds even on
tiny tensors; bf16 adds no operator per microbatch: FSDP2 casts the parameters at the
step's all-gather). Eager runs PyTorch's CPU kernels; compiled runs inductor's CPU (C++)
kernels, the same graphs' guard checks, AOT autograd's wrappers and one call per fused
kernel that a GPU's compiled blocks launch as Triton kernels, with the matmuls and
convolutions as library calls (cuBLAS, cuDNN there; oneDNN here).

**An upper bound.** This CPU's smallest library kernels still take 10-70 us each (a
matmul, a convolution, their backward: oneDNN's fixed cost per call) where a GPU's host
pays a launch; they show in the profile (``--profile N``: the functions the time goes
to, their own time) as ``torch.mm``, ``torch.conv2d`` and the autograd engine's own time
(``run_backward``: the backward's kernels run inside it). The rest (Python, dynamo's
guards, AOT autograd, DTensor, FSDP2's hooks) is what a GPU's host pays too. The JSON
keeps the factors, the profile and the figures per unit.

A stage that hosts co-located units (``UnitPlan.colocated``) is measured with them,
against its own and their GPU times (a co-located encoder's images, and the sequence that
holds them, at their own sizes). What a microbatch is: the cost model's average one (as
``dtc memcheck`` builds it, ``train.memplan``): a backbone microbatch of ``micro_batch``
sequences of ``seq_len`` positions (the first stage embeds the tokens, the last runs the
LM head and its loss; longer than the average microbatch the plan prices, so a GPU's time
here is more than the plan's while the host's hardly depends on the length), an encoder's
average images (one group of the mean image size: a
microbatch of k sizes runs its layers k times), a generator's average targets. Included:
the stage's forward and backward as the executor calls them, with FSDP2's hooks (its
parameters gathered once per step, as ZeRO-1 does) and DTensor. Excluded: what happens
once per step (the all-gather, the gradient reduction, the optimizer, the feed),
point-to-point transfers (the executor's ``P2P``), and on the GPU the attention kernel's
own host path (flex or flash attention there, SDPA's CPU kernel here). Times are the
fastest of ``--repeats`` microbatches after ``--warmup`` (compiled: after its graphs are
compiled), the least disturbed by other processes on a shared machine; the JSON keeps the
median too.

**Stages.** Of each unit with GPUs of its own, its slowest stage and every stage that
runs co-located units (a backbone's first and last), each against its GPU time as the plan
prices it: the slowest stage's by its share of the layers, plus the co-located units'.
A co-located encoder's items have their patches divided by ``--tokens`` as the sequence
that holds them is (their count is the average microbatch's).

**On a GPU** (``--device cuda``): the spec's own sizes and precision, the same stage and
fake collectives; the host's time to issue a microbatch from an idle device (it never
waits on a full launch queue: a microbatch is some hundreds of kernels) beside the GPU's
time for it (CUDA events around it). The GPU's time includes any wait for the host: a
host time close to it says the GPU waited, in part of the microbatch at least.

    python benchmarks/host_overhead.py [SPEC] [--plan plan.json] [--units vit,llm]
        [--shrink 16] [--repeats 5] [--device cpu|cuda] [--stages 0,2]
        [--json benchmarks/results/host_overhead-<spec>[-cuda].json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import ROOT, shipped, spec_path

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan

TARGET = 0.5        # host time per microbatch over its GPU time, compiled (issue 28)


def dtc_plan(name: str) -> Plan:
    """``dtc plan SPEC``'s plan (the planner as a user runs it)."""
    from dtdsl import cli

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        with contextlib.redirect_stdout(io.StringIO()):     # its table (and JSON)
            code = cli.main(["plan", str(spec_path(name)), "-o", str(out), "--json"])
        if code != 0:
            raise SystemExit(f"dtc plan {name} failed")
        return Plan.model_validate_json(out.read_text())


def _even(x: float, multiple: int = 2) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def shrunk(program: ir.Program, shrink: int, tokens: int, tp: int) -> ir.Program:
    """``program`` with its widths divided by ``shrink`` and its sequence length by
    ``tokens`` (module docstring): the same heads, layers and blocks."""
    modules = []
    for m in program.modules:
        a = m.arch
        if isinstance(a, ir.TransformerArch):
            width = _even(a.hidden / a.heads / shrink)        # a head's width (RoPE: even)
            update: dict[str, Any] = {"hidden": a.heads * width,
                                      "ffn": _even(a.ffn / shrink, 8 * tp)}
            if a.vocab:
                update["vocab"] = _even(a.vocab / shrink, 64 * tp)
            if a.kv_channels:
                update["kv_channels"] = width
            a = a.model_copy(update=update)
        elif isinstance(a, ir.UNetArch):
            levels = 2 ** (len(a.mult) - 1)
            step = math.gcd(shrink, a.groups, a.head_dim)
            a = a.model_copy(update={
                "channels": a.channels // step, "head_dim": a.head_dim // step,
                "groups": a.groups // step, "context_dim": _even(a.context_dim / shrink),
                "latent": max(levels, _even(a.latent / shrink, levels))})
        elif isinstance(a, ir.DiTArch):
            a = a.model_copy(update={"hidden": a.heads * _even(a.hidden / a.heads / shrink),
                                     "ffn": _even(a.ffn / shrink, 8 * tp),
                                     "context_dim": _even(a.context_dim / shrink)})
        modules.append(m.model_copy(update={"arch": a}))
    widths = {m.name: m.arch.hidden if not isinstance(m.arch, ir.UNetArch)
              else m.arch.context_dim for m in modules}
    projectors = []
    for p in program.projectors:
        a = p.arch
        if isinstance(a, ir.MLPArch):
            source = widths[p.source]
            # An encoder's projector reads its (possibly pixel-shuffled) tokens.
            factor = max(1, a.in_dim // next(m.arch.hidden for m in program.modules
                                             if m.name == p.source))
            a = a.model_copy(update={"in_dim": source * factor, "out_dim": widths[p.target],
                                     "hidden": _even(a.hidden / shrink)})
        projectors.append(p.model_copy(update={"arch": a}))
    # fp32: this CPU's bf16 kernels are slow even on tiny tensors (some 70 us a matmul),
    # which would count arithmetic as host time; the operators are the same (FSDP2 casts
    # the parameters once per step, at the all-gather; the norms and the loss upcast
    # under either).
    train = program.train.model_copy(update={
        "seq_len": _even(program.train.seq_len / tokens, 8 * tp), "precision": "fp32"})
    return program.model_copy(update={"modules": tuple(modules),
                                      "projectors": tuple(projectors), "train": train})


def _slowest_stage(unit: Any) -> int:
    layers = unit.layers_per_stage
    return max(range(len(layers)), key=lambda s: (layers[s], -s))


def measured_stages(plan: Plan, unit_name: str) -> list[int]:
    """The stages of ``unit_name`` (a unit with GPUs of its own) that are measured: its
    slowest, and every one that runs co-located units (the backbone's first and last)."""
    from dtdsl.parallel.mesh import RankRole, grids, hosted_units

    unit = plan.unit(unit_name)
    grid = next(g for g in grids(plan) if g.name == unit_name)
    stages = {_slowest_stage(unit)}
    for s in range(unit.pp):
        role = RankRole(rank=grid.rank(s, 0, 0), grid=grid, stage=s, replica=0, tp_index=0)
        if hosted_units(plan, role):
            stages.add(s)
    return sorted(stages)


def planned_gpu_s(plan: Plan, unit_name: str, stage: int, hosted: list[str]) -> float:
    """The plan's GPU time of one microbatch's forward and backward on ``stage``: the
    unit's slowest stage's (``UnitPlan.fwd_time_s + bwd_time_s``) by the stage's share of
    its layers, as the planner prices stages, and the co-located units it runs."""
    unit = plan.unit(unit_name)
    layers = unit.layers_per_stage
    own = (unit.fwd_time_s + unit.bwd_time_s) * layers[stage] / max(layers)
    return own + sum(plan.unit(n).fwd_time_s + plan.unit(n).bwd_time_s for n in hosted)


def _inputs(program: ir.Program, real: ir.Program, cost: Any, plan: Plan, role: Any,
            dtype: torch.dtype, tokens: int, device: torch.device) -> Any:
    """A maker of one average microbatch's forward arguments for ``role``'s stage
    (``train.memplan``'s, its images' sides divided by sqrt(``tokens``))."""
    from dtdsl.train import memplan

    unit = plan.unit(role.unit)
    dp_lm = next(u.dp for u in plan.units if u.role == "backbone")
    share = dp_lm / unit.dp
    if role.role != "encoder":
        return memplan._inputs(program, cost, plan, cost.unit(role.unit), role, share,
                               dtype, device, False, role.is_first_stage)
    im = memplan._encoder_images(real, cost, role.unit, cost.unit(role.unit), share, False)
    side = max(1, round(im.side / math.sqrt(tokens)))
    arch = program.module(role.unit).arch
    rows = side * side + int(arch.cls_token)

    def encoder() -> tuple[tuple, dict]:
        if role.is_first_stage:
            return ([torch.randn(im.n, side * side, im.width, dtype=dtype,
                                 device=device)],), {"first": True, "grids": [(side, side)]}
        x = torch.randn(im.n, rows, arch.hidden, dtype=dtype, device=device,
                        requires_grad=True)
        return ([x],), {"first": False}
    return encoder


@contextlib.contextmanager
def _hosted_items_shrunk(tokens: int):
    """While ``memplan`` makes a backbone stage's inputs: its co-located encoders' items
    with their patches divided by ``tokens``, as the sequence that holds them is (their
    count is the average microbatch's; ``memplan._encoder_images`` wrapped)."""
    from dtdsl.ir.modal import InputRule
    from dtdsl.train import memplan

    own = memplan._encoder_images

    def shrunk(program: ir.Program, *args: Any) -> Any:
        im = own(program, *args)
        if tokens == 1:
            return im
        rule = InputRule.of(program, program.module(args[1]))
        patches = max(1.0, im.side * im.side / tokens)
        side = rule.image.square_side(patches) if rule.image is not None else \
            max(1, round(math.sqrt(patches)))
        return dataclasses.replace(im, side=side, rows=im.rows - im.side ** 2 + side ** 2)

    memplan._encoder_images = shrunk
    try:
        yield
    finally:
        memplan._encoder_images = own


def _stand_in_loss(role: Any, out: Any) -> torch.Tensor:
    from dtdsl.train.memplan import _loss_of

    return _loss_of(role, out, role.is_last_stage)


def measure(program: ir.Program, real: ir.Program, cost: Any, plan: Plan, unit_name: str,
            stage: int, *, compile: bool, tokens: int, warmup: int, repeats: int,
            profile: int = 0, device: torch.device | None = None) -> dict[str, Any]:
    """Host seconds per microbatch (the fastest) of ``unit_name``'s ``stage``: forward,
    stand-in loss and backward, as one rank of the plan in a fake-collective world;
    ``profile``: that many of the functions the timed microbatches spent most time in
    (cProfile, their own time), under ``"profile"``. On a CUDA ``device`` also the GPU's
    time of each timed microbatch (CUDA events around it, ``gpu_s``: the fastest
    microbatch's), the device idle before each starts."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtdsl.parallel.mesh import MESH_DIMS, RankRole, grids, hosted_units, unit_mesh_shape
    from dtdsl.train.executor import stage_run
    from dtdsl.train.stage import build_stage

    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    grid = next(g for g in grids(plan) if g.name == unit_name)
    role = RankRole(rank=grid.rank(stage, 0, 0), grid=grid, stage=stage, replica=0,
                    tp_index=0)
    dist.init_process_group("fake", store=FakeStore(), rank=role.rank,
                            world_size=plan.gpus_used)
    try:
        table = torch.tensor(list(grid.ranks)).reshape(
            unit_mesh_shape(grid, program.train.optimizer.zero))
        mesh = DeviceMesh(device.type, table, mesh_dim_names=MESH_DIMS)
        built = build_stage(program, plan, role, mesh, device,
                            run=stage_run(role.role), compile=compile)
        with _hosted_items_shrunk(tokens):
            make = _inputs(program, real, cost, plan, role, built.compute_dtype, tokens,
                           device)
        trains = any(p.requires_grad for p in built.module.parameters())

        def microbatch() -> None:
            args, kwargs = make()
            out = built.module(*args, **kwargs)
            if trains:
                with built.backward_context():
                    _stand_in_loss(role, out).backward()

        built.begin_step()      # ZeRO-1: the step's one all-gather, before the timing
        start = time.perf_counter()
        for _ in range(warmup):
            microbatch()
        warm_s = time.perf_counter() - start
        times, gpu = [], []
        for _ in range(repeats):
            if cuda:        # the device idle, so that the host never waits on its queue
                torch.cuda.synchronize(device)
                events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                events[0].record()
            start = time.perf_counter()
            microbatch()
            times.append(time.perf_counter() - start)
            if cuda:
                events[1].record()
                events[1].synchronize()
                gpu.append(events[0].elapsed_time(events[1]) / 1e3)
        profiler = None
        if profile:     # more microbatches, apart: the profiler's own cost is not timed
            profiler = cProfile.Profile()
            for _ in range(repeats):
                profiler.enable()
                microbatch()
                profiler.disable()
        compiled = built.compiled
        top = []
        if profiler is not None:
            stats = pstats.Stats(profiler).stats       # (file, line, name) -> (.., tt, ct, ..)
            for (file, line, fn), (_, calls, own, cum, _) in sorted(
                    stats.items(), key=lambda kv: -kv[1][2])[:profile]:
                where = f"{Path(file).name}:{line} {fn}" if file != "~" else fn
                top.append({"where": where, "calls": calls / repeats,
                            "own_s": own / repeats, "cum_s": cum / repeats})
        # The fastest microbatch: the least disturbed by other processes of a shared
        # machine (the median is kept too).
        return {"stage": stage, "layers": built.held_layers, "tp": grid.tp,
                "hosted": [h.name for h in hosted_units(plan, role)],
                "host_s": min(times), "median_s": statistics.median(times),
                "warmup_s": warm_s, **({"gpu_s": min(gpu), "gpu_median_s":
                                        statistics.median(gpu)} if cuda else {}),
                "graphs": compiled.graphs if compiled is not None else None,
                **({"profile": top} if profile else {})}
    finally:
        dist.destroy_process_group()


def _run_one(args: argparse.Namespace, plan: Plan, unit: str, stage: int,
             compile: bool) -> dict:
    """``measure`` in a child process (a fresh process group, dynamo state and caches; the
    parent never touches CUDA, so the fork is safe)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target() -> None:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(args.threads)
        try:
            real = shipped(args.spec)
            device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
            if device.type == "cuda":   # the spec's own sizes and precision
                torch.cuda.set_device(device)
                program, tokens = real, 1
            else:
                program = shrunk(real, args.shrink, args.tokens, plan.unit(unit).tp)
                tokens = args.tokens
            from _common import cost

            child.send(measure(program, real, cost(args.spec), plan, unit, stage,
                               compile=compile, tokens=tokens, warmup=args.warmup,
                               repeats=args.repeats, profile=args.profile, device=device))
        except BaseException as err:  # noqa: BLE001 - reported by the parent
            child.send({"error": f"{type(err).__name__}: {err}"})
        finally:
            os._exit(0)

    proc = ctx.Process(target=target)
    proc.start()
    got = parent.recv()
    proc.join()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", default="mllm_9b")
    parser.add_argument("--plan", help="a plan JSON (default: dtc plan SPEC's)")
    parser.add_argument("--units", help="comma-separated units (default: every one with "
                        "GPUs of its own)")
    parser.add_argument("--shrink", type=int, default=16, help="widths divided by this")
    parser.add_argument("--tokens", type=int, default=128,
                        help="sequence length divided by this, image sides by its root")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--stages", help="comma-separated stage indices (default: each "
                        "unit's slowest and those that run co-located units)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the spec's own sizes and precision on the GPU, its "
                        "measured time beside the plan's (--shrink and --tokens unused)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print (and keep) the N functions the host time goes to")
    parser.add_argument("--json", help="where to write the figures (default: "
                        "benchmarks/results/host_overhead-<spec>.json)")
    args = parser.parse_args()
    plan = (Plan.model_validate_json(Path(args.plan).read_text()) if args.plan
            else dtc_plan(args.spec))
    names = args.units.split(",") if args.units else [u.name for u in plan.units
                                                      if not u.colocated]
    modes = args.modes.split(",")
    cuda = args.device == "cuda"
    rows = []
    sizes = ("the spec's sizes on the GPU" if cuda else
             f"this CPU, widths / {args.shrink}, tokens / {args.tokens}")
    print(f"{args.spec}: host time per microbatch ({sizes}, collectives stubbed) against "
          "the plan's GPU time" + (" and the GPU's own" if cuda else ""))
    print(f"{'stage':<18} {'layers':>6} {'tp':>3} {'GPU ms':>8} "
          + " ".join(f"{m + ' ms':>12} {'x GPU':>6}" + (f" {'GPU ran':>8}" if cuda else "")
                     for m in modes) + "  graphs")
    for name in names:
        unit = plan.unit(name)
        stages = measured_stages(plan, name) if args.stages is None else \
            [int(s) for s in args.stages.split(",") if int(s) < unit.pp]
        for stage in stages:
            row: dict[str, Any] = {"unit": name, "role": unit.role, "stage": stage}
            for mode in modes:
                got = _run_one(args, plan, name, stage, mode == "compiled")
                row[mode] = got
                if "error" not in got:
                    # The stage's F and B include the co-located units it runs, as the
                    # plan prices them.
                    gpu_s = planned_gpu_s(plan, name, stage, got["hosted"])
                    got["over_gpu"] = got["host_s"] / gpu_s if gpu_s > 0 else None
                    row.update(layers=got["layers"], tp=got["tp"], hosted=got["hosted"],
                               gpu_s=gpu_s)
            rows.append(row)
            cells = []
            for mode in modes:
                got = row[mode]
                ran = f" {got['gpu_s'] * 1e3:>8.2f}" if cuda and "gpu_s" in got else ""
                cells.append(f"{'error':>19}" if "error" in got else
                             f"{got['host_s'] * 1e3:>12.2f} {got['over_gpu']:>6.2f}{ran}")
            graphs = row.get("compiled", {}).get("graphs")
            label = "+".join([f"{name} s{stage}", *row.get("hosted", [])])
            gpu_s = row.get("gpu_s", float("nan"))
            print(f"{label:<18} {row.get('layers', '-'):>6} {row.get('tp', '-'):>3} "
                  f"{gpu_s * 1e3:>8.2f} " + " ".join(cells)
                  + (f"  {graphs}" if graphs is not None else ""), flush=True)
            for mode in modes:
                if "error" in row[mode]:
                    print(f"  {label} {mode}: {row[mode]['error']}")
                for entry in row[mode].get("profile", []):
                    print(f"  {mode:>8} {entry['own_s'] * 1e3:8.2f} ms own "
                          f"{entry['cum_s'] * 1e3:8.2f} ms with callees "
                          f"{entry['calls']:8.0f} calls  {entry['where']}")
    compiled = [r["compiled"].get("over_gpu") for r in rows if "compiled" in r]
    met = bool(compiled) and all(x is not None and x <= TARGET for x in compiled)
    print(f"target: compiled host time <= {TARGET:.0%} of the GPU time for every stage "
          f"measured: {'met' if met else 'not met'}")
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / (
        f"host_overhead-{args.spec}" + ("-cuda" if cuda else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "tool": "benchmarks/host_overhead.py", "spec": args.spec, "torch": torch.__version__,
        "device": args.device, "cpu": os.cpu_count(), "threads": args.threads,
        **({} if cuda else {"shrink": args.shrink, "tokens": args.tokens}),
        "warmup": args.warmup, "repeats": args.repeats, "target": TARGET, "met": met,
        "units": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    sys.exit(main())
