"""What ``dtc`` shows people: plans and profiles as tables, and progress while it works.

Everything here renders with rich to a console the caller chooses (stdout for
results, stderr for progress), so ``dtc plan > plan.txt`` and pipes stay clean.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dtdsl.cost.profile import Profile
from dtdsl.ir.plan import BASELINES, Packing, Plan, UnitPlan

__all__ = ["baseline_layout", "format_bytes", "format_flops", "format_seconds", "plan_markdown",
           "plan_table", "profile_table", "progress_bar", "render_plan", "render_profile",
           "wide_console"]


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_flops(flops: float) -> str:
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if flops >= size:
            return f"{flops / size:.1f} {unit}"
    return f"{flops:.3g} FLOP"


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _count(n: int, one: str, many: str) -> str:
    """``n`` and the noun that goes with it: "1 microbatch", "4 microbatches"."""
    return f"{n} {one if n == 1 else many}"


def _layers(per_stage: tuple[int, ...]) -> str:
    if len(set(per_stage)) == 1:
        return f"{per_stage[0]}" if len(per_stage) == 1 else f"{per_stage[0]} x{len(per_stage)}"
    return "/".join(str(n) for n in per_stage) if len(per_stage) <= 4 else \
        f"{max(per_stage)}..{min(per_stage)} x{len(per_stage)}"


def _role(plan: Plan, u) -> str:
    """A unit's role with how the baseline runs it."""
    notes = []
    if u.tp_replicated:
        notes.append("replicated over TP")
    if u.colocated:
        notes.append("on the backbone's " + ("first" if u.role == "encoder" else "last") +
                     " stage")
    if u.phased:
        notes.append("phased on the backbone's GPUs, in its bubbles")
    if u.recompute:     # full, or selective (the attention core only)
        notes.append("recompute selective" if u.recompute == "selective" else "recompute")
    if u.ep > 1:
        notes.append(f"experts over ep {u.ep}")
    return u.role + (f" ({', '.join(notes)})" if notes else "")


def _uses_cp(plan: Plan) -> bool:
    """Whether the tables show a CP column: only where a unit uses context parallelism."""
    return any(u.cp > 1 for u in plan.units)


def _tp_cp(plan: Plan, u: UnitPlan) -> list[str]:
    """A unit's TP cell, and its CP cell where the plan shows one."""
    return [str(u.tp), str(u.cp)] if _uses_cp(plan) else [str(u.tp)]


def plan_table(plan: Plan) -> Table:
    """One row per unit: its share of the cluster, layout and predicted costs (times per
    unit microbatch on the slowest stage; memory of the first stage's GPUs). A CP column
    where a unit uses context parallelism."""
    title = (f"{plan.spec}: {plan.search} plan, {plan.gpus_used} of {plan.num_gpus} GPUs, "
             f"{plan.schedule}, {_count(plan.num_microbatches, 'microbatch', 'microbatches')} per "
             "replica")
    table = Table(title=title, title_justify="left")
    for name, justify in (("unit", "left"), ("role", "left"), ("GPUs", "right"),
                          ("TP", "right"), *((("CP", "right"),) if _uses_cp(plan) else ()),
                          ("DP", "right"), ("PP", "right"), ("vpp", "right"),
                          ("layers/stage", "right"), ("fwd", "right"), ("bwd", "right"),
                          ("sync + opt", "right"), ("memory/GPU", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for u in plan.units:
        name = u.name + "".join(f" + {p}" for p in u.projectors)
        role = _role(plan, u)
        share = u.memory_bytes / u.memory_limit_bytes if u.memory_limit_bytes else 0.0
        table.add_row(
            name, role, str(u.gpus), *_tp_cp(plan, u), str(u.dp), str(u.pp), str(u.vpp),
            _layers(u.layers_per_stage), format_seconds(u.fwd_time_s),
            format_seconds(u.bwd_time_s), format_seconds(u.dp_sync_time_s),
            f"{format_bytes(u.memory_bytes)} of {format_bytes(u.memory_limit_bytes)} "
            f"({share:.0%})")
    return table


def _summary(plan: Plan) -> list[str]:
    lines = [
        f"iteration time  {format_seconds(plan.iteration_time_s)}  (warm-up "
        f"{format_seconds(plan.warmup_time_s)}, steady {format_seconds(plan.steady_time_s)}, "
        f"sync + optimizer {format_seconds(plan.dp_sync_time_s)})",
        f"MFU             {plan.mfu:.1%}  ({format_flops(plan.model_flops_per_iteration)} "
        f"per iteration of {plan.global_batch} samples; causal attention half)",
    ]
    if plan.mfu_full_attention is not None:
        lines.append(f"MFU, paper-era  {plan.mfu_full_attention:.1%}  (causal attention "
                     "counted whole: Megatron-LM 2021, DistTrain)")
    sim = plan.simulated
    if sim is not None:
        policy = "+".join(sim.policy) if sim.policy else "none"
        scored = _scored(sim.candidates, sim.estimated)
        line = (f"simulated       {format_seconds(sim.iteration_time_s)} per iteration on "
                f"{sim.steps} drawn batches (reorder {policy}{scored})")
        if sim.policy:
            line += f", {format_seconds(sim.no_reorder_iteration_time_s)} without reordering"
        lines.append(line)
    if plan.offload > 0 or plan.offload_chosen:
        why = ("offload=auto: the least of 0, 25%, 50% and 100% with which a layout fits"
               if plan.offload_chosen else "the spec's offload")
        lines.append(f"optimizer       {plan.offload:.0%} of each rank's optimizer state and "
                     f"update on the CPU ({why}); memory/GPU counts what stays")
    lines.extend(_placement_lines(plan))
    lines.extend(_baseline_lines(plan))
    if sim is not None and sim.packing is not None:
        lines.append(_packing_line(sim.packing))
    lines.append(
        f"search          {plan.search} in {format_seconds(plan.solve_time_s)}: "
        f"{plan.candidates:,} TP/DP candidates, {plan.convex_solves:,} convex solves, "
        f"{plan.evaluated:,} integer layouts evaluated")
    return lines


def _placement_lines(plan: Plan) -> list[str]:
    """Where the encoders and generators run, and each other placement weighed with its
    best time (on the drawn batches where the plan was simulated): why this one."""
    if plan.rigid:
        return []
    where = {"colocated": "encoders and generators on the backbone's first and last "
                          "stages", "disaggregated": "every module on GPUs of its own",
             "phased": "encoders on every backbone GPU, in its pipeline's bubbles where "
                       "they fit"}
    line = f"{'placement':<16}{plan.placement}: {where[plan.placement]}"
    if plan.placement == "phased":
        from dtdsl.reorder.workload import phase_fit

        fit = phase_fit(plan)
        later = sum(1 for s in fit.owners if s > 0)
        line += (f" ({later} of {len(fit.owners)} microbatches on the later stages, "
                 f"{1e3 * (fit.exposed_f + fit.exposed_b):.1f} ms exposed at mean work)")
    others = {k: t for k, t in (plan.placements or {}).items() if k != plan.placement}
    if others:
        mine = (plan.placements or {}).get(plan.placement)
        basis = "on the drawn batches" if plan.simulated is not None else "at mean work"
        parts = [f"{k} {format_seconds(t)}" + (f" ({t / mine:.2f}x the time)" if mine else "")
                 for k, t in sorted(others.items(), key=lambda x: x[1])]
        line += f"; next best {basis}: {', '.join(parts)}"
    return [line]


def baseline_layout(plan: Plan) -> str:
    """A baseline's layout in a line: the backbone's TP, DP, PP and layers per stage, where
    the encoders and generators run, recomputation and how a microbatch is padded."""
    backbone = next(u for u in plan.units if u.role == "backbone")
    parts = [f"{backbone.name} tp {backbone.tp} "
             + (f"cp {backbone.cp} " if backbone.cp > 1 else "")
             + f"dp {backbone.dp} pp {backbone.pp} "
             f"({_split(backbone.layers_per_stage)} layers)"]
    colocated = [u.name for u in plan.units if u.colocated]
    if colocated:
        parts.append(f"{', '.join(colocated)} on its first/last stage")
    parts.extend(f"{u.name} own stage tp {u.tp}" for u in plan.units
                 if u.role != "backbone" and not u.colocated)
    if any(u.recompute for u in plan.units):
        selective = any(u.recompute == "selective" for u in plan.units)
        parts.append("recompute selective" if selective else "recompute")
    parts.append("padded to seq_len" if backbone.padding == "seq_len" else
                 "padded to the longest")
    return ", ".join(parts)


def _split(per_stage: tuple[int, ...]) -> str:
    """Layers per stage, a long run of equal middle stages folded (``5+7x10+5``)."""
    if len(per_stage) <= 4:
        return "/".join(str(n) for n in per_stage)
    middle = set(per_stage[1:-1])
    if len(middle) == 1:
        return f"{per_stage[0]}+{per_stage[1]}x{len(per_stage) - 2}+{per_stage[-1]}"
    return f"{max(per_stage)}..{min(per_stage)} x{len(per_stage)}"


def _scored(simulated: int, estimated: int) -> str:
    """How a layout was chosen on the drawn batches: the best few of those estimated
    (``sim.estimate``) simulated, the fastest kept."""
    if estimated > simulated:
        return f", the fastest of the {simulated} best by estimate of {estimated} layouts"
    if simulated > 1:
        return f", the fastest of {simulated} layouts"
    return ""


def _baseline_lines(plan: Plan) -> list[str]:
    """Each Megatron-LM baseline: its layout, planned and simulated times, and the plan's
    speedup over it (per position where its data are packed otherwise)."""
    if plan.baselines is None:
        return [f"{'baselines':<16}not compared"]
    lines = []
    for name in BASELINES:
        base = plan.baselines.get(name)
        if base is None:
            lines.append(f"{'baseline':<16}{name}: no layout fits this cluster")
            continue
        times = f"{format_seconds(base.planned_s)} planned"
        if base.simulated_s is not None:
            times += f", {format_seconds(base.simulated_s)} on {base.steps} drawn batches" \
                f"{_scored(base.candidates, base.estimated)}"
        lines.append(f"{'baseline':<16}{name} ({'packed' if base.packing else 'unpacked'}): "
                     f"{times}")
        lines.append(f"{'':<18}{baseline_layout(base.layout)}")
        if plan.search == "baseline" and name == "megatron":
            lines.append(f"{'':<18}(this plan)")
            continue
        speedup = f"{base.speedup:.2f}x planned" if base.speedup is not None else "n/a"
        if base.simulated_speedup is not None:
            speedup += f", {base.simulated_speedup:.2f}x simulated"
        if base.positions_ratio != 1.0:
            ratio = base.simulated_positions_ratio if base.simulated_speedup is not None \
                else base.positions_ratio
            speedup += f" (per position: its steps hold {ratio:.2f}x the positions)"
        lines.append(f"{'  speedup':<18}{speedup} over {name}")
    return lines


def _packing_line(p: Packing) -> str:
    """The plan's drawn steps packed and not, and which trains more positions a second."""
    def per_k(seconds: float, positions: float) -> str:
        return format_seconds(seconds / positions * 1000) if positions > 0 else "n/a"

    def count(n: float) -> str:
        return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} k" if n >= 1e3 else \
            f"{n:.0f}"

    text = (f"packing         {format_seconds(p.packed_s)} per step vs "
            f"{format_seconds(p.unpacked_s)} unpacked ({count(p.packed_positions)} vs "
            f"{count(p.unpacked_positions)} positions a step, "
            f"{'reorder ' + '+'.join(p.policy) if p.policy else 'no reordering'}"
            f"{'; this layout does not fit the other way: its own layout' if p.replanned else ''}"
            "): "
            f"{per_k(p.packed_s, p.packed_positions)} vs "
            f"{per_k(p.unpacked_s, p.unpacked_positions)} per 1k positions")
    if p.packing_faster != p.spec_packs:
        return text + f": set train.packing = {'true' if p.packing_faster else 'false'}"
    return text + f" (train.packing = {'true' if p.spec_packs else 'false'} is the faster)"


def plan_markdown(plan: Plan) -> str:
    """The plan as Markdown (TensorBoard's text tab renders it): the unit table and the
    summary lines."""
    head = ["unit", "role", "GPUs", "TP", *(["CP"] if _uses_cp(plan) else []), "DP", "PP",
            "vpp", "layers/stage", "fwd", "bwd", "sync + opt", "memory/GPU"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for u in plan.units:
        rows.append("| " + " | ".join([
            u.name + "".join(f" + {p}" for p in u.projectors), _role(plan, u), str(u.gpus),
            *_tp_cp(plan, u),
            str(u.dp), str(u.pp), str(u.vpp), _layers(u.layers_per_stage),
            format_seconds(u.fwd_time_s), format_seconds(u.bwd_time_s),
            format_seconds(u.dp_sync_time_s), format_bytes(u.memory_bytes)]) + " |")
    title = (f"**{plan.spec}**: {plan.search} plan, {plan.gpus_used} of {plan.num_gpus} GPUs, "
             f"{plan.schedule}, {_count(plan.num_microbatches, 'microbatch', 'microbatches')} per "
             "replica")
    summary = "\n".join(f"    {line}" for line in _summary(plan))
    return f"{title}\n\n" + "\n".join(rows) + f"\n\n{summary}\n"


def wide_console(**kwargs) -> Console:
    """A console that does not fold tables when writing to a file or pipe."""
    console = Console(**kwargs)
    if not console.is_terminal:
        console = Console(width=200, **kwargs)
    return console


def plan_tables_stacked(plan: Plan) -> tuple[Table, Table]:
    """``plan_table`` for narrow terminals: the layout, then the costs, each with its
    unit column (names and roles wrap; numbers never do)."""
    title = (f"{plan.spec}: {plan.search} plan, {plan.gpus_used} of {plan.num_gpus} GPUs, "
             f"{plan.schedule}, {_count(plan.num_microbatches, 'microbatch', 'microbatches')} per "
             "replica")
    layout = Table(title=title, title_justify="left")
    layout.add_column("unit", overflow="fold", ratio=1)
    layout.add_column("role", overflow="fold", ratio=1)
    for name in ("GPUs", "TP", *(["CP"] if _uses_cp(plan) else []), "DP", "PP", "vpp",
                 "layers/stage"):
        layout.add_column(name, justify="right", no_wrap=True)
    limits = {u.memory_limit_bytes for u in plan.units}
    memory = "memory/GPU" + (f" of {format_bytes(limits.pop())}" if len(limits) == 1 else "")
    costs = Table(title="per unit microbatch, slowest stage", title_justify="left")
    costs.add_column("unit", overflow="fold", ratio=1)
    for name in ("fwd", "bwd", "sync + opt", memory):
        costs.add_column(name, justify="right", no_wrap=True)
    for u in plan.units:
        name = u.name + "".join(f" + {p}" for p in u.projectors)
        layout.add_row(name, _role(plan, u), str(u.gpus), *_tp_cp(plan, u), str(u.dp),
                       str(u.pp), str(u.vpp), _layers(u.layers_per_stage))
        share = u.memory_bytes / u.memory_limit_bytes if u.memory_limit_bytes else 0.0
        used = f"{format_bytes(u.memory_bytes)} ({share:.0%})"
        if len({v.memory_limit_bytes for v in plan.units}) > 1:
            used = f"{format_bytes(u.memory_bytes)} of {format_bytes(u.memory_limit_bytes)}"
        costs.add_row(name, format_seconds(u.fwd_time_s), format_seconds(u.bwd_time_s),
                      format_seconds(u.dp_sync_time_s), used)
    return layout, costs


def _natural_width(table: Table) -> int:
    """The columns ``table`` takes when nothing is squeezed."""
    probe = Console(width=10_000, file=io.StringIO(), color_system=None)
    probe.print(table)
    return max((len(line.rstrip()) for line in probe.file.getvalue().splitlines()),
               default=0)


def render_plan(plan: Plan, console: Console) -> None:
    """The plan's table, stacked in two when the console is too narrow for one (no cell
    is ever dropped), then the summary lines."""
    table = plan_table(plan)
    if _natural_width(table) <= console.width:
        console.print(table)
    else:
        for part in plan_tables_stacked(plan):
            console.print(part)
    for line in _summary(plan):
        console.print(line, highlight=False, markup=False)


def profile_table(profile: Profile) -> Table:
    """Per module and TP degree: the sizes measured and the time at the largest."""
    dev = profile.device
    table = Table(title=f"profile of {profile.spec} on {dev.name} ({dev.type}, {dev.dtype}, "
                  f"torch {dev.torch_version})", title_justify="left")
    for name, justify in (("module", "left"), ("role", "left"), ("TP", "right"),
                          ("sizes x", "right"), ("fwd @max x", "right"),
                          ("bwd @max x", "right"), ("peak memory", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for m in profile.modules:
        by_tp: dict[int, list] = {}
        for p in m.points:
            by_tp.setdefault(p.tp, []).append(p)
        for tp, points in sorted(by_tp.items()):
            points.sort(key=lambda p: p.x)
            top = points[-1]
            table.add_row(m.name, m.role, str(tp), ", ".join(str(p.x) for p in points),
                          format_seconds(top.fwd_time_s), format_seconds(top.bwd_time_s),
                          format_bytes(top.peak_memory_bytes))
    return table


def render_profile(profile: Profile, console: Console) -> None:
    console.print(profile_table(profile))


@contextlib.contextmanager
def progress_bar(label: str, *, enabled: bool | None = None, delay_s: float = 0.0
                 ) -> Iterator[Callable[[int, int, str], None]]:
    """A ``progress(done, total, note)`` callback drawing a bar on stderr while the block
    runs (only on a terminal unless ``enabled``), erased when it ends. ``delay_s``: the
    bar appears only once the block has run that long (work that ends sooner leaves the
    terminal as it was)."""
    console = Console(stderr=True)
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda done, total, note: None
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                   console=console, transient=True)
    task = bar.add_task(label, total=None, note="")
    start = time.monotonic()
    shown = False

    def update(done: int, total: int, note: str) -> None:
        nonlocal shown
        bar.update(task, completed=done, total=max(total, 1), note=note)
        if not shown and time.monotonic() - start >= delay_s:
            bar.start()
            shown = True

    try:
        yield update
    finally:
        if shown:
            bar.stop()
