"""``dtc``: the dtdsl compiler's command line.

Exit codes: 0 no errors, 1 errors in a spec (or `fmt --check` found changes),
2 bad command-line usage, 3 an internal compiler error. A user never sees a
Python traceback unless they pass ``--debug``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dtdsl import __version__
from dtdsl.clihelp import (
    EXIT_ERRORS,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    load_program,
    non_negative,
    positive_int,
    write_file,
)
from dtdsl.codegen.slurm import slurm_name, slurm_time
from dtdsl.codes import CODES, explain
from dtdsl.diagnostics import Diagnostic, render_json, render_text
from dtdsl.driver import STAGES, FrontendResult, UsageError, read_spec, run_frontend
from dtdsl.frontend.ast import dump_ast
from dtdsl.frontend.fmt import format_spec
from dtdsl.ir.program import Program
from dtdsl.source import Span

if TYPE_CHECKING:
    from dtdsl.cost.model import CostModel, Efficiency
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.schedule import Schedule

# Commands that plan or profile import numpy, cvxpy, rich and torch when they run:
# `dtc check` and `dtc fmt` stay quick to start.

__all__ = ["main"]

TRACE_STEPS = 8   # dtc simulate: steps in the Perfetto trace (TensorBoard gets them all)
BUG_REPORT = "https://github.com/dtdsl/dtdsl/issues"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: exit 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"dtc: error: {message}\n")


def _slurm_option(check: Callable[..., str], *args: str) -> Callable[[str], str]:
    """An argparse type: a value ``check`` (``codegen.slurm``) accepts for slurm.sbatch."""
    def parse(text: str) -> str:
        try:
            return check(text, *args)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def _usage_diagnostic(message: str) -> Diagnostic:
    return Diagnostic.error("DT000", message, Span.point(1, 1))


def _cmd_check(args: argparse.Namespace) -> int:
    results: list[tuple[str, Sequence[Diagnostic]]] = []
    exit_code = EXIT_OK
    texts = []
    for path in args.specs:
        try:
            name, data = read_spec(path)
        except UsageError as err:
            if args.format == "json":
                results.append((path, [_usage_diagnostic(str(err))]))
            else:
                print(f"dtc: error: {err}", file=sys.stderr)
            exit_code = EXIT_USAGE
            continue
        stop = args.emit if args.emit in STAGES else "program"
        result = run_frontend(name, data, stop_after=stop)
        if result.ok and result.program is not None and not args.synthetic and not args.emit:
            # The data the spec names must be readable (not part of the pure front end:
            # it reads the file system).
            from dtdsl.data.sources import data_diagnostics

            more = data_diagnostics(result.program, _spec_dir(name))
            if more:
                result = dataclasses.replace(result, diagnostics=(*result.diagnostics, *more))
        results.append((name, result.diagnostics))
        if not result.ok:
            exit_code = max(exit_code, EXIT_ERRORS)
        if args.format == "text" and result.diagnostics:
            # Diagnostics, warnings included, go to stderr: stdout carries only --emit's text.
            sys.stderr.write(render_text(result.diagnostics, result.source, result.name))
        if result.ok and args.emit == "ast" and result.spec is not None:
            texts.append(dump_ast(result.spec))
        elif result.ok and args.emit == "program" and result.program is not None:
            texts.append(result.program.model_dump_json(indent=2) + "\n")
        elif result.ok and args.emit == "graph" and result.program is not None:
            from dtdsl.ir.graph import build_graph, graph_text

            texts.append(graph_text(build_graph(result.program)))
        elif result.ok and args.emit in ("plan", "schedule") and result.program is not None:
            the_plan = _solve(result, result.program, None)
            if the_plan is None:
                exit_code = max(exit_code, EXIT_ERRORS)
            elif args.emit == "plan":
                texts.append(the_plan.model_dump_json(indent=2) + "\n")
            else:
                from dtdsl.ir.schedule import schedule_text
                from dtdsl.schedule.lower import lower

                texts.append(schedule_text(lower(the_plan, result.program)))
    if args.format == "json":
        if args.emit and exit_code == EXIT_OK:
            sys.stdout.write("".join(texts))  # --emit prints the stage's text form
        else:
            sys.stdout.write(render_json(results))
    else:
        if exit_code == EXIT_OK:
            sys.stdout.write("".join(texts))
        if exit_code == EXIT_OK and not args.emit and not args.quiet:
            print(f"checked {len(args.specs)} spec{'s' if len(args.specs) != 1 else ''}: "
                  "no errors", file=sys.stderr)
    return exit_code


def _cmd_fmt(args: argparse.Namespace) -> int:
    exit_code = EXIT_OK
    for path in args.specs:
        try:
            name, data = read_spec(path)
        except UsageError as err:
            print(f"dtc: error: {err}", file=sys.stderr)
            exit_code = EXIT_USAGE
            continue
        result = run_frontend(name, data, stop_after="ast")
        if result.spec is None:
            sys.stderr.write(render_text(result.diagnostics, result.source, result.name))
            exit_code = max(exit_code, EXIT_ERRORS)
            continue
        original = result.source.text
        formatted = format_spec(result.spec)
        if path == "-" and not (args.check or args.diff):
            sys.stdout.write(formatted)
            continue
        if formatted == original:
            continue
        if args.diff:
            sys.stdout.writelines(difflib.unified_diff(
                original.splitlines(keepends=True), formatted.splitlines(keepends=True),
                fromfile=name, tofile=f"{name} (formatted)"))
        if args.check:
            print(f"would reformat {name}", file=sys.stderr)
            exit_code = max(exit_code, EXIT_ERRORS)
        elif not args.diff:
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(formatted)
            print(f"reformatted {name}", file=sys.stderr)
    return exit_code


def _efficiency(values: Sequence[str] | None) -> Efficiency:
    """``--efficiency matmul=0.6`` (repeatable; a bare number sets every kind)."""
    from dtdsl.cost.model import Efficiency

    eff = Efficiency()
    kinds = [f.name for f in dataclasses.fields(Efficiency)]
    for item in values or ():
        key, sep, value = item.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not 0 < number <= 1 or (sep and key not in kinds):
            raise UsageError(f"--efficiency takes KIND=FRACTION with KIND one of "
                             f"{', '.join(kinds)} and 0 < FRACTION <= 1, or one fraction "
                             f"for all, not {item!r}")
        updates = {key: number} if sep else dict.fromkeys(kinds, number)
        eff = dataclasses.replace(eff, **updates)
    return eff


def _cost_model(args: argparse.Namespace, program: Program) -> CostModel:
    """The cost model of ``dtc plan``: analytic, or from ``--profile``. UsageError for an
    unreadable profile or one that does not cover the spec."""
    from dtdsl.cost.model import CostParams, build_cost_model
    from dtdsl.cost.profile import ProfileError, ProfileTable, check_profile, load_profile

    params = CostParams(efficiency=_efficiency(args.efficiency))
    if args.profile is None:
        return build_cost_model(program, params)
    if args.efficiency:
        raise UsageError("--efficiency calibrates the analytic model; a --profile replaces "
                         "it: give one or the other")
    try:
        profile = load_profile(args.profile)
        for warning in check_profile(profile, program):
            print(f"dtc: warning: {warning}", file=sys.stderr)
    except (OSError, ProfileError) as err:
        raise UsageError(f"cannot use profile {args.profile}: {err}") from None
    return build_cost_model(program, params, profile=ProfileTable(profile))


# Work shorter than this shows no progress bar.
# Drawn batches dtc plan optimises for by default (and compile and memcheck plan with).
SIMULATE_STEPS = 2
_PROGRESS_AFTER_S = 2.0


def _add_placement(parser: argparse.ArgumentParser, *, given_plan: bool) -> None:
    """``--placement``: where the planner puts the encoders and generators."""
    from dtdsl.ir.plan import PLACEMENTS

    parser.add_argument(
        "--placement", choices=PLACEMENTS, default="auto" if not given_plan else None,
        help="disaggregated: every module on GPUs of its own; colocated: encoders on the "
        "backbone's first pipeline stage, generators on its last; auto: both weighed, the "
        "faster kept (default)" + ("; not with --plan" if given_plan else ""))


def _cmd_plan(args: argparse.Namespace) -> int:
    from dtdsl.planner import EXHAUSTIVE_MAX_GPUS, Infeasible, PlannerError, plan
    from dtdsl.report import progress_bar, render_plan, wide_console

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    num_gpus = args.gpus or program.cluster.num_gpus
    if args.search == "exhaustive" and num_gpus > EXHAUSTIVE_MAX_GPUS:
        raise UsageError(f"--search exhaustive tries every layout and stops at "
                         f"{EXHAUSTIVE_MAX_GPUS} GPUs; this plan is for {num_gpus} "
                         "(use --gpus or the convex search)")
    cost = _cost_model(args, program)
    try:
        # One bar for every phase (the baselines, the search, the drawn batches), each
        # named in its note; shown where planning takes more than two seconds.
        with progress_bar("planning", delay_s=_PROGRESS_AFTER_S) as progress:
            the_plan = plan(cost, num_gpus, search=args.search, placement=args.placement,
                            compare_baseline=not args.no_baseline, progress=progress,
                            simulate_steps=args.simulate_steps)
    except Infeasible as err:
        span = err.span or program.cluster.span
        diag = Diagnostic.error(err.code, err.message, span, notes=err.notes, hint=err.hint)
        sys.stderr.write(render_text([diag], result.source, result.name))
        return EXIT_ERRORS
    except PlannerError as err:
        raise RuntimeError(f"the planner failed: {err}") from err
    text = the_plan.model_dump_json(indent=2) + "\n"
    if args.output:
        write_file(args.output, text)
    if args.json:
        sys.stdout.write(text)
    else:
        render_plan(the_plan, wide_console())
    return EXIT_OK


def _solve(result: FrontendResult, program: Program, cost: CostModel | None,
           num_gpus: int | None = None, placement: str = "auto") -> Plan | None:
    """The plan ``dtc plan`` gives ``program`` by default (the convex search, the
    objective its time on ``SIMULATE_STEPS`` drawn batches; analytic costs unless
    ``cost``), or None after printing why there is none: what ``dtc compile`` and
    ``dtc memcheck`` build without ``--plan`` is the layout ``dtc plan`` shows."""
    from dtdsl.cost.model import build_cost_model
    from dtdsl.planner import Infeasible, PlannerError, plan
    from dtdsl.report import progress_bar

    cost = cost or build_cost_model(program)
    try:
        with progress_bar("planning", delay_s=_PROGRESS_AFTER_S) as progress:
            return plan(cost, num_gpus or program.cluster.num_gpus, placement=placement,
                        compare_baseline=False, progress=progress,
                        simulate_steps=SIMULATE_STEPS)
    except Infeasible as err:
        span = err.span or program.cluster.span
        diag = Diagnostic.error(err.code, err.message, span, notes=err.notes, hint=err.hint)
        sys.stderr.write(render_text([diag], result.source, result.name))
        return None
    except PlannerError as err:
        raise RuntimeError(f"the planner failed: {err}") from err


def _read_plan(path: str, program: Program) -> Plan:
    """A Plan JSON from ``dtc plan -o``, checked against ``program``'s units."""
    from dtdsl.ir.plan import Plan

    try:
        the_plan = Plan.model_validate_json(Path(path).read_bytes())
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read plan {path}: {err}") from None
    if the_plan.spec_sha256 != program.source_sha256:
        print(f"dtc: warning: {path} was planned for another revision of the spec",
              file=sys.stderr)
    planned = sorted(u.name for u in the_plan.units)
    modules = sorted(m.name for m in program.modules)
    if planned != modules:
        raise UsageError(f"plan {path} has units {', '.join(planned)} but the spec has "
                         f"modules {', '.join(modules)}; plan this spec again")
    problems = _plan_problems(the_plan, program)
    if problems:
        raise UsageError(f"plan {path} does not fit the spec: {'; '.join(problems)}; plan "
                         "this spec again (`dtc plan SPEC -o plan.json`)")
    return the_plan


def _plan_problems(the_plan: Plan, program: Program) -> list[str]:
    """What makes a plan (with the spec's unit names) unusable for ``program``: another
    batch, other roles or layer counts, or a layout that does not add up (a plan from
    another spec, or edited by hand)."""
    import math

    train = program.train
    out = []
    for name, planned, spec in (("global_batch", the_plan.global_batch, train.global_batch),
                                ("micro_batch", the_plan.micro_batch, train.micro_batch)):
        if planned != spec:
            out.append(f"{name} is {planned}, the spec's is {spec}")
    backbones = [u for u in the_plan.units if u.role == "backbone"]
    if len(backbones) != 1:
        return out + [f"{len(backbones)} backbone units, not 1"]
    dp_lm = backbones[0].dp
    if dp_lm >= 1 and the_plan.num_microbatches * dp_lm * the_plan.micro_batch != \
            the_plan.global_batch:
        out.append(f"num_microbatches {the_plan.num_microbatches} x backbone dp {dp_lm} x "
                   f"micro_batch {the_plan.micro_batch} is not the global batch "
                   f"{the_plan.global_batch}")
    for u in the_plan.units:
        module = program.module(u.name)
        if u.role != module.role:
            out.append(f"{u.name}: role {u.role} in the plan, {module.role} in the spec")
        if min(u.tp, u.dp, u.pp, u.vpp, u.cp) < 1:
            out.append(f"{u.name}: tp, dp, pp, vpp and cp must be at least 1")
            continue
        if u.colocated and (u.gpus != 0 or u.role == "backbone"):
            out.append(f"{u.name}: a co-located unit holds no GPU of its own (it runs on "
                       "the backbone's first or last stage)")
        elif u.phased and (u.gpus != 0 or u.role == "backbone"):
            out.append(f"{u.name}: a phased unit holds no GPU of its own (it runs on all "
                       "the backbone's GPUs, before and after its pipeline)")
        elif not (u.colocated or u.phased) and u.gpus != u.tp * u.cp * u.dp * u.pp:
            out.append(f"{u.name}: gpus {u.gpus} is not tp x cp x dp x pp = "
                       f"{u.tp * u.cp * u.dp * u.pp}")
        layers = module.arch.pipeline_layers
        if len(u.layers_per_stage) != u.pp or sum(u.layers_per_stage) != layers or \
                min(u.layers_per_stage, default=0) < 1:
            out.append(f"{u.name}: layers_per_stage {list(u.layers_per_stage)} does not split "
                       f"its {layers} layers over pp {u.pp}")
        if not math.isclose(u.microbatch_share, dp_lm / u.dp, rel_tol=1e-9):
            out.append(f"{u.name}: microbatch_share {u.microbatch_share:g} is not backbone dp "
                       f"/ dp = {dp_lm}/{u.dp}")
        times = (u.fwd_time_s, u.bwd_time_s, u.dp_sync_time_s)
        if not all(math.isfinite(t) and t >= 0 for t in times):
            out.append(f"{u.name}: fwd_time_s, bwd_time_s and dp_sync_time_s must be finite "
                       "and >= 0")
    return out


def _plan_and_schedule(plan_path: str | None, result: FrontendResult, program: Program,
                       cost: CostModel, num_gpus: int | None = None,
                       placement: str | None = None) -> tuple[Plan, Schedule] | None:
    """The plan (read from ``plan_path``, else solved) and its lowered schedule, or None
    after printing why there is no plan."""
    from dtdsl.schedule.lower import LoweringError, lower

    if plan_path:
        if placement is not None:
            raise UsageError("--placement chooses where the planner puts the encoders and "
                             "generators; with --plan the plan is given: use one or the "
                             "other")
        the_plan = _read_plan(plan_path, program)
    else:
        the_plan = _solve(result, program, cost, num_gpus, placement or "auto")
        if the_plan is None:
            return None
    try:
        return the_plan, lower(the_plan, program)
    except LoweringError as err:
        raise UsageError(f"cannot lower the plan: {err}") from None


def _runtime_plan(plan_path: str | None, result: FrontendResult, program: Program,
                  cost: CostModel, placement: str | None = None
                  ) -> tuple[Plan, Schedule] | None:
    """``_plan_and_schedule`` for a command that builds the runtime (compile, memcheck):
    None after printing DT601 errors for what the runtime cannot train yet, the spec's own
    features before planning (no need to wait for the planner), the plan's after."""
    from dtdsl.codegen.support import runtime_support

    assert result.source is not None
    unsupported = runtime_support(program)
    planned = None
    if not unsupported:
        planned = _plan_and_schedule(plan_path, result, program, cost, placement=placement)
        if planned is None:
            return None
        unsupported = runtime_support(program, planned[0])
    if unsupported:
        sys.stderr.write(render_text(unsupported, result.source, result.name))
        return None
    return planned


def _cmd_memcheck(args: argparse.Namespace) -> int:
    from dtdsl.report import progress_bar
    from dtdsl.train.memplan import check_memory, format_stages

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    cost = _cost_model(args, program)
    # Only what the runtime can build can be measured: dtc compile's diagnostics.
    planned = _runtime_plan(args.plan, result, program, cost, args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, _ = planned
    with progress_bar("memcheck", enabled=not args.json and sys.stderr.isatty()) as bar:
        stages = check_memory(program, the_plan, cost=cost, jobs=args.jobs, progress=bar)
    if args.json:
        print(json.dumps({"stages": [s.as_json() for s in stages]}, indent=2))
    else:
        print("\n".join(format_stages(stages)))
    over = [s for s in stages if s.total_bytes > s.capacity_bytes]
    return EXIT_ERRORS if over else EXIT_OK


def _cmd_simulate(args: argparse.Namespace) -> int:
    from dtdsl.report import plan_markdown, progress_bar, wide_console
    from dtdsl.sim.report import simulation_report
    from dtdsl.sim.run import simulate_steps
    from dtdsl.sim.simulate import Simulator
    from dtdsl.sim.tensorboard import TimelineWriter
    from dtdsl.sim.trace import write_trace
    from dtdsl.sim.workload import WorkModel, parse_policy

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    cost = _cost_model(args, program)
    if args.plan:
        if args.gpus:
            raise UsageError("--gpus plans for another cluster size; with --plan the plan "
                             "is given: use one or the other")
    planned = _plan_and_schedule(args.plan, result, program, cost, args.gpus,
                                 args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, schedule = planned
    policy = parse_policy(args.reorder if args.reorder else program.train.reorder)
    logdir = Path(args.logdir)
    if logdir.exists() and not logdir.is_dir():
        raise UsageError(f"--logdir {args.logdir} is a file; give a directory (it is "
                         "created if missing)")
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create {args.logdir}: {err.strerror or err}") from None
    earlier = sorted(logdir.glob("events.out.tfevents.*"))
    if earlier and not args.overwrite:
        raise UsageError(f"--logdir {args.logdir} already holds TensorBoard events of an "
                         f"earlier run ({len(earlier)} file{'s' if len(earlier) > 1 else ''}); "
                         "TensorBoard would mix the runs: give a new directory, or "
                         "--overwrite to delete them")
    try:
        for path in earlier:
            path.unlink()
        # Try a file first: a SummaryWriter that cannot write leaves a thread that prints
        # a traceback at exit.
        with tempfile.TemporaryFile(dir=logdir):
            pass
        writer = TimelineWriter(logdir)
    except OSError as err:
        raise UsageError(f"cannot write to {args.logdir}: {err.strerror or err}") from None
    steps, baseline, timelines = [], [], []
    shared = {"simulator": Simulator(schedule), "work_model": WorkModel(cost)}
    with progress_bar("simulating") as progress, writer:
        writer.add_text("plan", plan_markdown(the_plan))
        for k, step in enumerate(simulate_steps(program, cost, the_plan, schedule,
                                                steps=args.steps, policy=policy, **shared)):
            timeline = step.result.timeline(step=step.step)
            writer.add_step(step.step, timeline, step.scalars())
            if k < TRACE_STEPS:   # a paper-scale step has ~50k events: keep the trace small
                timelines.append(timeline)
            steps.append(step)
            progress(k + 1, args.steps, f"step {step.step}")
        if policy:
            baseline = list(simulate_steps(program, cost, the_plan, schedule,
                                           steps=args.steps, policy=frozenset(), **shared))
    trace_path = logdir / "trace.json"
    try:
        write_trace(trace_path, timelines)
    except OSError as err:
        raise UsageError(f"cannot write {trace_path}: {err.strerror or err}") from None
    report = simulation_report(the_plan, steps, baseline, policy, logdir=str(logdir),
                               trace=str(trace_path), trace_steps=len(timelines))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        from dtdsl.sim.report import render_simulation

        render_simulation(report, wide_console())
    return EXIT_OK


def _read_costs(path: str) -> object:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        return json.loads(text)
    except OSError as err:
        raise UsageError(f"cannot read costs {path}: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"costs {path} is not JSON: {err}") from None


def _cmd_reorder(args: argparse.Namespace) -> int:
    data = _read_costs(args.costs)
    try:
        if args.policy == "intra":
            from dtdsl.reorder.intra import report

            if not isinstance(data, list):
                raise ValueError("expected a JSON list of per-sample costs")
            out = report(data, args.groups)
        else:
            from dtdsl.reorder.inter import report

            keys = ("forward", "backward", "stage_forward", "stage_backward")
            if not isinstance(data, dict) or any(k not in data for k in keys):
                raise ValueError('expected a JSON object {"forward": [...], "backward": [...], '
                                 '"stage_forward": f, "stage_backward": b}')
            extra = sorted(set(data) - set(keys))
            if extra:
                raise ValueError(f"unknown key{'s' if len(extra) > 1 else ''} "
                                 f"{', '.join(extra)}; expected {', '.join(keys)}")
            out = report(data["forward"], data["backward"], data["stage_forward"],
                         data["stage_backward"], args.stages)
    except ValueError as err:
        raise UsageError(f"{args.costs}: {err}") from None
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        from dtdsl.report import wide_console
        from dtdsl.sim.report import render_reorder

        render_reorder(args.policy, out, wide_console())
    return EXIT_OK


def _cmd_profile(args: argparse.Namespace) -> int:
    from dtdsl.cost.profile import profile_program, save_profile
    from dtdsl.report import progress_bar, render_profile, wide_console

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    tps = None
    if args.tp:
        try:
            degrees = tuple(sorted({int(t) for t in args.tp.split(",")}))
        except ValueError:
            raise UsageError(f"--tp takes TP degrees such as 1,2,4, not {args.tp!r}") from None
        tps = {name: degrees for name in
               [m.name for m in program.modules] + [p.name for p in program.projectors]}
    try:
        with progress_bar("profiling") as progress:
            profile = profile_program(program, tps=tps, repeats=args.repeats,
                                      warmup=args.warmup, device=args.device,
                                      num_threads=args.threads, progress=progress)
    except ValueError as err:
        raise UsageError(str(err)) from None
    save_profile(profile, args.output)
    if not args.quiet:
        render_profile(profile, wide_console(stderr=True))
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _cmd_graph(args: argparse.Namespace) -> int:
    from dtdsl.ir.graph import build_graph, graph_dot, graph_text
    from dtdsl.ir.plan import Plan

    result, code = load_program(args.spec)
    if result is None:
        return code
    plan = None
    if args.plan:
        try:
            plan = Plan.model_validate_json(Path(args.plan).read_bytes())
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot read plan {args.plan}: {err}") from None
        assert result.program is not None
        if plan.spec_sha256 != result.program.source_sha256:
            print(f"dtc: warning: {args.plan} was planned for another revision of the spec",
                  file=sys.stderr)
    graph = build_graph(result.program, plan)
    text = graph_dot(graph) if args.dot else graph_text(graph)
    if args.output:
        write_file(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    if args.code is None:
        for code, entry in CODES.items():
            print(f"{code}  {entry.title}")
        return EXIT_OK
    text = explain(args.code)
    if text is None:
        print(f"dtc: error: no diagnostic code {args.code!r}; `dtc explain` lists them",
              file=sys.stderr)
        return EXIT_USAGE
    print(text, end="")
    return EXIT_OK


def _cmd_reference(args: argparse.Namespace) -> int:
    import time

    import torch

    from dtdsl.train.reference import train_reference

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None
    if args.micro_batch is not None and args.micro_batch > program.train.global_batch:
        raise UsageError(f"--micro-batch {args.micro_batch} is larger than the global batch "
                         f"of {program.train.global_batch}")
    steps = args.steps or program.train.steps
    source = None
    if args.data is not None:
        from dtdsl.data.shards import DatasetError
        from dtdsl.feed.source import DatasetSource

        try:
            source = DatasetSource(program, args.data)
        except (DatasetError, ValueError) as err:
            raise UsageError(f"cannot read dataset {args.data}: {err}") from None
    out = sys.stdout if args.out in (None, "-") else None
    if out is None:
        target = Path(args.out)
        if target.is_dir():
            raise UsageError(f"{args.out} is a directory; give a file name")
        try:
            out = open(target, "w", encoding="utf-8", newline="\n")  # noqa: SIM115
        except OSError as err:
            raise UsageError(f"cannot write {args.out}: {err.strerror or err}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    the_plan = None
    if program.train.sync.local:
        # Local SGD's replicas train on the samples the plan routes to them.
        the_plan = _read_plan(args.plan, program) if args.plan else \
            _solve(result, program, None)
        if the_plan is None:
            return EXIT_ERRORS
    elif args.plan:
        print("dtc: note: --plan is read only with sync = local_sgd; synchronous data "
              "parallelism has the same losses under every plan", file=sys.stderr)
    start = time.perf_counter()
    try:
        for record in train_reference(program, steps, micro_batch=args.micro_batch,
                                      seed=args.seed, source=source, plan=the_plan):
            out.write(json.dumps(record) + "\n")
            out.flush()
            if not args.quiet:
                print(f"step {record['step'] + 1}/{steps}  loss {record['loss']:.6f}  "
                      f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    except ValueError as err:
        raise UsageError(f"cannot train {result.name}: {err}") from None
    finally:
        if out is not sys.stdout:
            out.close()
    return EXIT_OK


def _spec_dir(name: str) -> Path:
    """The folder a spec's relative paths start from."""
    return Path(name).resolve().parent if name not in ("-", "<stdin>") else Path.cwd()


def _data_ready(args: argparse.Namespace, result: FrontendResult, program: Program) -> bool:
    """Whether the data a bundle will train on can be read: ``--data``, else the spec's
    source (DT314 at its line otherwise). A spec without a source needs ``--data`` or
    ``--synthetic``: a bundle never falls back to drawn samples by itself."""
    from dtdsl.data.sources import (
        data_diagnostics,
        is_synthetic,
        source_problem,
        unread_encoders,
    )

    if args.data is not None:
        problem = source_problem(args.data, Path.cwd()) or unread_encoders(program)
        if problem is not None:
            raise UsageError(f"--data {args.data}: {problem}")
        if program.data.tokenizer is None and not is_synthetic(args.data, Path.cwd()):
            raise UsageError(f"--data {args.data} is real text, which needs a tokenizer: add "
                             '`tokenizer = "PATH"` to the spec\'s data block (the hashing '
                             "tokenizer is only for synthetic data)")
        return True
    if program.data.source is None:
        raise UsageError("the spec's data block names no source: give --data SOURCE (a "
                         "dataset, WebDataset shards, a LLaVA JSON) or --synthetic (samples "
                         "drawn from the spec's distributions)")
    found = data_diagnostics(program, _spec_dir(result.name))
    if found:
        assert result.source is not None
        sys.stderr.write(render_text(found, result.source, result.name))
        return False
    return True


def _cmd_compile(args: argparse.Namespace) -> int:
    from dtdsl.codegen.compile import BundleOptions, compile_bundle
    from dtdsl.codegen.emit import BundleError
    from dtdsl.codegen.slurm import SlurmOptions

    result, code = load_program(args.spec)
    if result is None:
        return code
    program = result.program
    assert program is not None and result.source is not None
    if args.data is not None and args.synthetic:
        raise UsageError("--data names a dataset and --synthetic draws samples instead: "
                         "give one or the other")
    if not args.synthetic and not _data_ready(args, result, program):
        return EXIT_ERRORS
    # What the runtime cannot train is an error before anything is written.
    cost = _cost_model(args, program)
    planned = _runtime_plan(args.plan, result, program, cost, args.placement)
    if planned is None:
        return EXIT_ERRORS
    the_plan, schedule = planned
    options = BundleOptions(
        steps=args.steps, workers=args.workers, data=args.data, synthetic=args.synthetic,
        max_restarts=args.max_restarts, cost=cost,
        slurm=SlurmOptions(time=args.time, partition=args.partition, account=args.account))
    try:
        written = compile_bundle(args.output, source=result.source.text.encode("utf-8"),
                                 spec_path=args.spec, program=program, plan=the_plan,
                                 schedule=schedule, options=options, overwrite=args.overwrite)
    except (BundleError, ValueError) as err:
        raise UsageError(str(err)) from None
    ranks = the_plan.gpus_used
    # Several nodes (more ranks than a node has GPUs): Slurm, or launch.sh on every node.
    how = (f"sbatch {Path(args.output) / 'slurm.sbatch'}"
           if ranks > program.cluster.gpus_per_node else f"{Path(args.output) / 'launch.sh'}")
    print(f"dtc: wrote {len(written)} files to {args.output} ({ranks} ranks); launch with "
          f"{how}", file=sys.stderr)
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    from dtdsl.models.hf import HFError
    from dtdsl.train.checkpoint import CheckpointError
    from dtdsl.train.export import export_checkpoint

    program = None
    if args.spec is not None:
        result, code = load_program(args.spec)
        if result is None:
            return code
        program = result.program
    out = Path(args.output)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"{out} is not empty; pass --overwrite to write into it")
    units = tuple(u for u in args.units.split(",") if u) if args.units else None
    try:
        done = export_checkpoint(args.run_dir, out, step=args.step, dtype=args.dtype,
                                 units=units, program=program,
                                 log=lambda line: print(f"dtc export: {line}", file=sys.stderr))
    except (CheckpointError, HFError) as err:
        raise UsageError(str(err)) from None
    hf = sum(u.hf for u in done)
    print(f"dtc: exported {len(done)} units to {out} ({hf} as Hugging Face models)",
          file=sys.stderr)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtc", description="dtdsl: compile multimodal LLM training specs.")
    parser.add_argument("--version", action="version", version=f"dtc {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an internal compiler error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = sub.add_parser("check", help="check specs and report every problem")
    check.add_argument("specs", nargs="+", metavar="SPEC", help="spec files ('-' for stdin)")
    check.add_argument("--format", choices=("text", "json"), default="text")
    check.add_argument("--emit", choices=(*STAGES, "graph", "plan", "schedule"),
                       help="print the text form of a stage (ast: the syntax tree with spans; "
                       "program: the resolved program as JSON; graph: the stage graph)")
    check.add_argument("--synthetic", action="store_true",
                       help="do not check that the data source can be read (a spec planned, "
                       "or compiled to train on samples drawn from its distributions; "
                       "--emit does not check it either)")
    check.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    check.set_defaults(func=_cmd_check)

    fmt = sub.add_parser("fmt", help="rewrite specs in the canonical layout")
    fmt.add_argument("specs", nargs="+", metavar="SPEC", help="spec files ('-': stdin to stdout)")
    fmt.add_argument("--check", action="store_true",
                     help="change nothing; exit 1 if a spec is not formatted")
    fmt.add_argument("--diff", action="store_true", help="print the changes instead of writing")
    fmt.set_defaults(func=_cmd_fmt)

    plan = sub.add_parser("plan", help="choose GPUs and TP/DP/PP for every module")
    plan.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    plan.add_argument("--gpus", type=positive_int, metavar="N",
                      help="plan for N GPUs instead of the spec's cluster.gpus")
    plan.add_argument("--search", choices=("convex", "exhaustive", "baseline"),
                      default="convex", help="convex: DistTrain's Algorithm 1 (default); "
                      "exhaustive: every layout (<= 128 GPUs); baseline: Megatron-LM's "
                      "rigid layout, unpacked (the `megatron` baseline)")
    plan.add_argument("--profile", metavar="PROFILE",
                      help="measured module times from `dtc profile` instead of the "
                      "analytic model")
    plan.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                      help="calibrate the analytic model: the fraction of peak FLOPs that "
                      "matmul, attention or conv work reaches (repeatable; a bare "
                      "fraction sets all)")
    plan.add_argument("--json", action="store_true", help="print the Plan as JSON")
    plan.add_argument("-o", "--output", metavar="FILE", help="also write the Plan JSON here")
    plan.add_argument("--simulate-steps", type=non_negative, default=SIMULATE_STEPS,
                      metavar="N",
                      help="plan for N global batches drawn from the spec's data: the "
                      "layouts near the optimum at mean work, ranked by their estimated "
                      "time on those batches, the best two simulated (the fastest there "
                      "is the plan), reported with and without reordering, and each "
                      "Megatron-LM baseline chosen alike (default 2; 0: the mean-work "
                      "prediction only)")
    plan.add_argument("--no-baseline", action="store_true",
                      help="skip planning the Megatron-LM baselines (no speedups reported)")
    _add_placement(plan, given_plan=False)
    plan.set_defaults(func=_cmd_plan)

    prof = sub.add_parser("profile", help="measure every module's forward and backward time "
                          "on this machine")
    prof.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    prof.add_argument("-o", "--output", metavar="FILE", required=True,
                      help="where to write the profile JSON")
    prof.add_argument("--tp", metavar="DEGREES",
                      help="TP degrees to measure, e.g. 1,2,4 (default: those each module "
                      "allows up to 8)")
    prof.add_argument("--repeats", type=positive_int, default=3,
                      help="timed passes per point (the median is kept)")
    prof.add_argument("--warmup", type=int, default=1, help="untimed passes per point")
    prof.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    prof.add_argument("--threads", type=positive_int, default=1,
                      help="torch CPU threads while measuring (default 1)")
    prof.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    prof.set_defaults(func=_cmd_profile)

    graph = sub.add_parser("graph", help="print the stage graph (text, or Graphviz DOT)")
    graph.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    graph.add_argument("--dot", action="store_true", help="Graphviz DOT instead of text")
    graph.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`): add "
                       "each module's pipeline stages")
    graph.add_argument("-o", "--output", metavar="FILE", help="write here, not to stdout")
    graph.set_defaults(func=_cmd_graph)

    comp = sub.add_parser("compile", help="write a launch bundle: rank programs, "
                          "preprocessing workers, launch.sh, slurm.sbatch")
    comp.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    comp.add_argument("-o", "--output", required=True, metavar="DIR",
                      help="the bundle directory (created; must be new or empty)")
    comp.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`); default: "
                      "plan the spec now (convex search)")
    comp.add_argument("--profile", metavar="PROFILE",
                      help="a profile from `dtc profile`: measured module times")
    comp.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                      help="analytic model efficiency (see `dtc plan --help`)")
    comp.add_argument("--steps", type=positive_int, metavar="N",
                      help="training steps (default: the spec's train.steps)")
    comp.add_argument("--workers", type=int, metavar="N",
                      help="preprocessing worker processes, spread over the nodes: each "
                      "node runs ceil(N / nodes) for its own trainers (default: "
                      "cluster.cpu_workers; 0 builds batches inside the trainers)")
    comp.add_argument("--data", metavar="SOURCE", help="the data: a dataset directory or "
                      "WebDataset shards (a folder, a brace pattern; default: the spec's "
                      "data.source, relative to the spec)")
    comp.add_argument("--synthetic", action="store_true",
                      help="train on samples drawn from the spec's distributions")
    comp.add_argument("--time", type=_slurm_option(slurm_time), metavar="LIMIT",
                      help="slurm.sbatch's time limit (#SBATCH --time: MINUTES, HH:MM:SS, "
                      "D-HH:MM:SS, ...; default: a commented line to fill in)")
    comp.add_argument("--partition", type=_slurm_option(slurm_name, "partition"), metavar="P",
                      help="slurm.sbatch's partition (#SBATCH --partition)")
    comp.add_argument("--account", type=_slurm_option(slurm_name, "account"), metavar="A",
                      help="slurm.sbatch's account (#SBATCH --account)")
    comp.add_argument("--max-restarts", type=int, metavar="N",
                      help="torchrun restarts after a failed rank, each resuming from the "
                      "newest checkpoint (default 3)")
    comp.add_argument("--overwrite", action="store_true",
                      help="replace an earlier bundle in DIR (its run directories are kept)")
    _add_placement(comp, given_plan=True)
    comp.set_defaults(func=_cmd_compile)

    from dtdsl.data.cli import register as register_data

    register_data(sub)

    sim = sub.add_parser("simulate", help="simulate training steps of a plan: TensorBoard "
                         "scalars and Gantt charts, a Perfetto trace")
    sim.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    sim.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`); default: "
                     "plan the spec now (convex search)")
    sim.add_argument("--gpus", type=positive_int, metavar="N",
                     help="plan for N GPUs instead of the spec's cluster")
    sim.add_argument("--steps", type=positive_int, default=4,
                     help="training steps (global batches) to simulate (default 4)")
    sim.add_argument("--reorder", choices=("none", "intra", "inter", "both"),
                     help="sample reordering (default: the spec's train.reorder)")
    sim.add_argument("--logdir", required=True, metavar="DIR",
                     help="TensorBoard log directory (also gets trace.json)")
    sim.add_argument("--profile", metavar="PROFILE",
                     help="a profile from `dtc profile`: measured module times")
    sim.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                     help="analytic model efficiency (see `dtc plan --help`)")
    sim.add_argument("--overwrite", action="store_true",
                     help="delete the event files of an earlier run in --logdir")
    sim.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_placement(sim, given_plan=True)
    sim.set_defaults(func=_cmd_simulate)

    reo = sub.add_parser("reorder", help="run a reordering policy on given sample costs")
    reo_sub = reo.add_subparsers(dest="policy", metavar="POLICY", required=True)
    intra = reo_sub.add_parser("intra", help="balance samples over DP groups of equal count")
    intra.add_argument("--costs", required=True, metavar="FILE",
                       help="a JSON list of per-sample costs ('-' for stdin)")
    intra.add_argument("--groups", required=True, type=positive_int, metavar="G",
                       help="number of data-parallel groups")
    intra.add_argument("--json", action="store_true", help="print the result as JSON")
    intra.set_defaults(func=_cmd_reorder)
    inter = reo_sub.add_parser("inter", help="order microbatches for 1F1B")
    inter.add_argument("--costs", required=True, metavar="FILE",
                       help='a JSON object {"forward": [...], "backward": [...], '
                       '"stage_forward": f, "stage_backward": b} (\'-\' for stdin)')
    inter.add_argument("--stages", required=True, type=positive_int, metavar="P",
                       help="pipeline stages: the first takes the per-microbatch times, "
                       "P-1 more take stage_forward and stage_backward")
    inter.add_argument("--json", action="store_true", help="print the result as JSON")
    inter.set_defaults(func=_cmd_reorder)

    mem = sub.add_parser("memcheck", help="measure every stage's peak memory on fake "
                         "tensors (the runtime's real modules, one rank per stage) next to "
                         "the planner's prediction")
    mem.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    mem.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`); default: "
                     "plan the spec now (convex search)")
    mem.add_argument("--profile", metavar="PROFILE",
                     help="a profile from `dtc profile`: measured module times")
    mem.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                     help="analytic model efficiency (see `dtc plan --help`)")
    mem.add_argument("--json", action="store_true", help="print JSON: {\"stages\": [...]}")
    mem.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                     help="stages measured at once, each in a process of its own (default: "
                     "the CPU count)")
    _add_placement(mem, given_plan=True)
    mem.set_defaults(func=_cmd_memcheck)

    ref = sub.add_parser("reference", help="train the spec single-process in fp32 on the CPU: "
                         "the per-step losses a distributed run must match")
    ref.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    ref.add_argument("--steps", type=positive_int, metavar="N",
                     help="training steps (default: the spec's train.steps)")
    ref.add_argument("--out", metavar="FILE",
                     help="write one JSON line per step here (default: stdout)")
    ref.add_argument("--micro-batch", type=positive_int, metavar="M",
                     help="samples per microbatch (default: the spec's train.micro_batch)")
    ref.add_argument("--seed", type=int, help="initialisation seed (default: train.seed)")
    ref.add_argument("--data", metavar="DIR", help="train on this dataset's batches (as a "
                     "launched bundle reads them) instead of the spec's synthetic samples")
    ref.add_argument("--plan", metavar="FILE", help="with sync = local_sgd: the plan (`dtc "
                     "plan -o`) whose replicas and routing to follow (default: the plan dtc "
                     "plan gives)")
    ref.add_argument("--threads", type=positive_int, help="torch CPU threads")
    ref.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    ref.set_defaults(func=_cmd_reference)

    exp = sub.add_parser("export", help="write a run's checkpoint as Hugging Face model "
                         "directories, one per unit (transformers / diffusers load them)")
    exp.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its newest "
                     "checkpoint) or a checkpoint directory")
    exp.add_argument("--step", type=positive_int, metavar="N",
                     help="the checkpoint after N steps (default: the newest)")
    exp.add_argument("-o", "--output", required=True, metavar="DIR",
                     help="where to write: DIR/<unit>/ for each unit")
    exp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                     help="cast the weights (default: as trained, fp32)")
    exp.add_argument("--units", metavar="A,B", help="only these units (default: all)")
    exp.add_argument("--spec", metavar="SPEC", help="the spec it was trained from, for a "
                     "checkpoint that does not carry its program.json")
    exp.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR")
    exp.set_defaults(func=_cmd_export)

    expl = sub.add_parser("explain", help="explain a diagnostic code (all codes without one)")
    expl.add_argument("code", nargs="?", metavar="CODE")
    expl.set_defaults(func=_cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as err:
        print(f"dtc: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dtc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:  # noqa: BLE001 - the one place that turns bugs into exit 3
        if args.debug:
            traceback.print_exc()
        print(f"dtc: internal compiler error: {type(err).__name__}: {err}. This is a bug in "
              f"dtc, not in your spec; please report it at {BUG_REPORT} with the spec "
              "(rerun with --debug for the traceback).", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
