"""What ``dtc simulate`` and ``dtc reorder`` print: JSON-ready results and rich tables."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any

from rich.console import Console
from rich.table import Table

from dtdsl.ir.plan import Plan
from dtdsl.report import format_seconds
from dtdsl.sim.run import StepResult

__all__ = ["render_reorder", "render_simulation", "simulation_report"]


def _step(s: StepResult) -> dict[str, Any]:
    return {"step": s.step, "iteration_time_s": s.iteration_time_s,
            "bubble_fraction": s.bubble_fraction, "mfu": s.mfu, "imbalance": s.imbalance}


def simulation_report(plan: Plan, steps: Sequence[StepResult],
                      baseline: Sequence[StepResult], policy: frozenset[str], *,
                      logdir: str, trace: str, trace_steps: int | None = None
                      ) -> dict[str, Any]:
    """The simulated steps and their means; with a reorder policy, the same batches
    without reordering (``no_reorder``) and the speedup over them."""
    def mean(rows: Sequence[StepResult]) -> dict[str, float]:
        return {"iteration_time_s": fmean(s.iteration_time_s for s in rows),
                "bubble_fraction": fmean(s.bubble_fraction for s in rows),
                "mfu": fmean(s.mfu for s in rows),
                "imbalance": fmean(s.imbalance for s in rows)}

    out: dict[str, Any] = {
        "spec": plan.spec, "reorder": sorted(policy) or ["none"],
        "planned_iteration_time_s": plan.iteration_time_s, "planned_mfu": plan.mfu,
        "steps": [_step(s) for s in steps], "mean": mean(steps),
    }
    if baseline:
        out["no_reorder"] = {"steps": [_step(s) for s in baseline], "mean": mean(baseline)}
        out["speedup"] = out["no_reorder"]["mean"]["iteration_time_s"] / \
            out["mean"]["iteration_time_s"]
    out["logdir"] = logdir
    out["trace"] = trace
    out["trace_steps"] = len(steps) if trace_steps is None else trace_steps
    return out


def render_simulation(report: dict[str, Any], console: Console) -> None:
    policy = "+".join(report["reorder"])
    table = Table(title=f"{report['spec']}: simulated steps (reorder: {policy})",
                  title_justify="left")
    for name in ("step", "iteration", "bubble", "MFU", "imbalance"):
        table.add_column(name, justify="right")
    baseline = report.get("no_reorder")
    if baseline:
        table.add_column("without reordering", justify="right")
    for k, s in enumerate(report["steps"]):
        row = [str(s["step"]), format_seconds(s["iteration_time_s"]),
               f"{s['bubble_fraction']:.1%}", f"{s['mfu']:.1%}", f"{s['imbalance']:.3f}"]
        if baseline:
            b = baseline["steps"][k]
            row.append(f"{format_seconds(b['iteration_time_s'])}, imbalance "
                       f"{b['imbalance']:.3f}")
        table.add_row(*row)
    console.print(table)
    m = report["mean"]
    lines = [f"mean            {format_seconds(m['iteration_time_s'])} per iteration, "
             f"MFU {m['mfu']:.1%}, bubbles {m['bubble_fraction']:.1%}",
             f"planned         {format_seconds(report['planned_iteration_time_s'])} "
             f"(MFU {report['planned_mfu']:.1%}, expected sample costs)"]
    if baseline:
        lines.append(f"reordering      {report['speedup']:.3f}x faster than no reordering "
                     f"({format_seconds(baseline['mean']['iteration_time_s'])})")
    lines += [f"tensorboard     tensorboard --logdir {report['logdir']}",
              f"trace           {report['trace']} (open in https://ui.perfetto.dev)"
              + (f", the first {report['trace_steps']} steps"
                 if report["trace_steps"] < len(report["steps"]) else "")]
    for line in lines:
        console.print(line, highlight=False, markup=False)


def render_reorder(policy: str, out: dict[str, Any], console: Console) -> None:
    if policy == "intra":
        loads = out["loads"]
        console.print(f"{len(out['assignment'])} samples over {len(loads)} groups: max load "
                      f"{max(loads):.6g}, lower bound {out['lower_bound']:.6g}, ratio "
                      f"{out['ratio']:.6f}", highlight=False, markup=False)
        table = Table(title="groups", title_justify="left")
        for name in ("group", "samples", "load"):
            table.add_column(name, justify="right")
        for g, load in enumerate(loads):
            table.add_row(str(g), str(out["assignment"].count(g)), f"{load:.6g}")
        console.print(table)
    else:
        console.print(f"order           {' '.join(str(i) for i in out['order'])}",
                      highlight=False, markup=False)
        console.print(f"iteration time  {out['iteration_time']:.6g}", highlight=False,
                      markup=False)
