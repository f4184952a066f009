"""What ``dtc``'s commands share: the parser class, the cost model and plan every
planning command opens with (``cost_model``, ``solve``, ``read_plan``,
``plan_and_schedule``, ``runtime_plan``) and their options."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtdsl.clihelp import EXIT_USAGE, load_program
from dtdsl.codes import DT000
from dtdsl.diagnostics import Diagnostic, has_errors, render_text
from dtdsl.driver import FrontendResult, UsageError
from dtdsl.errors import validation_problems
from dtdsl.ir.plan_check import MAX_PLAN_BYTES, plan_problems
from dtdsl.ir.program import Program
from dtdsl.source import Span

if TYPE_CHECKING:
    from dtdsl.cost.model import CostModel, Efficiency
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.schedule import Schedule

__all__ = ["PROGRESS_AFTER_S", "SIMULATE_STEPS", "Parser", "Stop", "add_placement",
           "add_plan_options", "cost_model", "efficiency", "open_program",
           "plan_and_schedule", "read_plan", "refused", "report_infeasible",
           "runtime_plan", "slurm_option", "solve", "spec_dir", "usage_diagnostic"]

# Drawn batches dtc plan optimises for by default (and compile and memcheck plan with).
SIMULATE_STEPS = 2
# Work shorter than this shows no progress bar.
PROGRESS_AFTER_S = 2.0


class Stop(Exception):  # noqa: N818 - a way out of a command, not an error
    """Leave the command with exit ``code``: what the user needs to know was printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def open_program(path: str) -> tuple[FrontendResult, Program]:
    """The checked spec at ``path`` and its Program, the opening of every command that
    needs one; ``Stop`` after printing why there is none (``clihelp.load_program``)."""
    result, code = load_program(path)
    if result is None or result.program is None or result.source is None:
        raise Stop(code)
    return result, result.program


class Parser(argparse.ArgumentParser):
    """argparse with dtc's usage errors: exit 2, no traceback."""

    def error(self, message: str):  # argparse's own usage errors: exit 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"dtc: error: {message}\n")


def slurm_option(check: Callable[..., str], *args: str) -> Callable[[str], str]:
    """An argparse type: a value ``check`` (``codegen.slurm``) accepts for slurm.sbatch."""
    def parse(text: str) -> str:
        try:
            return check(text, *args)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def usage_diagnostic(message: str) -> Diagnostic:
    return Diagnostic.error(DT000, message, Span.point(1, 1))


def spec_dir(name: str) -> Path:
    """The folder a spec's relative paths start from."""
    return Path(name).resolve().parent if name not in ("-", "<stdin>") else Path.cwd()


def efficiency(values: Sequence[str] | None) -> Efficiency:
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


def cost_model(args: argparse.Namespace, program: Program) -> CostModel:
    """The cost model of ``dtc plan``: analytic, or from ``--profile``. UsageError for an
    unreadable profile or one that does not cover the spec."""
    from dtdsl.cost.model import CostParams, build_cost_model
    from dtdsl.cost.profile import ProfileError, ProfileTable, check_profile, load_profile

    params = CostParams(efficiency=efficiency(args.efficiency))
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


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """``--plan`` and the cost model's options, for a command that plans the spec unless
    given a plan (compile, memcheck, simulate; ``plan_and_schedule``)."""
    parser.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`); default: "
                        "plan the spec now (convex search)")
    parser.add_argument("--profile", metavar="PROFILE",
                        help="a profile from `dtc profile`: measured module times")
    parser.add_argument("--efficiency", action="append", metavar="KIND=FRACTION",
                        help="analytic model efficiency (see `dtc plan --help`)")


def report_infeasible(err: Any, result: FrontendResult, program: Program) -> None:
    """Print the planner's ``Infeasible`` ``err`` as a diagnostic at its span in the spec
    (the cluster block when it names none)."""
    span = err.span or program.cluster.span
    diag = Diagnostic.error(err.code, err.message, span, notes=err.notes, hint=err.hint)
    sys.stderr.write(render_text([diag], result.source, result.name))


def add_placement(parser: argparse.ArgumentParser, *, given_plan: bool) -> None:
    """``--placement``: where the planner puts the encoders and generators."""
    from dtdsl.ir.plan import PLACEMENTS

    parser.add_argument(
        "--placement", choices=PLACEMENTS, default=None,
        help="disaggregated: every module on GPUs of its own; colocated: encoders on the "
        "backbone's first pipeline stage, generators on its last; auto: both weighed, the "
        "faster kept (default)" + ("; not with --plan" if given_plan else
                                   "; not with --search baseline"))


def solve(result: FrontendResult, program: Program, cost: CostModel | None,
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
        with progress_bar("planning", delay_s=PROGRESS_AFTER_S) as progress:
            return plan(cost, num_gpus or program.cluster.num_gpus, placement=placement,
                        compare_baseline=False, progress=progress,
                        simulate_steps=SIMULATE_STEPS)
    except Infeasible as err:
        report_infeasible(err, result, program)
        return None
    except PlannerError as err:
        raise RuntimeError(f"the planner failed: {err}") from err


def read_plan(path: str, program: Program) -> Plan:
    """A Plan JSON from ``dtc plan -o``, checked against ``program``'s units."""
    from pydantic import ValidationError

    from dtdsl.ir.plan import Plan
    from dtdsl.outdir import read_bounded

    try:
        # A regular file, read up to a bound (a FIFO or a device would never end).
        data = read_bounded(path, MAX_PLAN_BYTES)
        if len(data) > MAX_PLAN_BYTES:
            raise UsageError(f"cannot read plan {path}: over {MAX_PLAN_BYTES >> 20} MiB, "
                             "more than any plan dtc writes")
        the_plan = Plan.model_validate_json(data)
    except ValidationError as err:
        raise UsageError(f"cannot read plan {path}: {validation_problems(err)}; plan the "
                         "spec again (`dtc plan SPEC -o plan.json`)") from None
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
    problems = plan_problems(the_plan, program)
    if problems:
        raise UsageError(f"plan {path} does not fit the spec: {'; '.join(problems)}; plan "
                         "this spec again (`dtc plan SPEC -o plan.json`)")
    return the_plan


def plan_and_schedule(plan_path: str | None, result: FrontendResult, program: Program,
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
        the_plan = read_plan(plan_path, program)
    else:
        the_plan = solve(result, program, cost, num_gpus, placement or "auto")
        if the_plan is None:
            return None
    try:
        return the_plan, lower(the_plan, program)
    except LoweringError as err:
        raise UsageError(f"cannot lower the plan: {err}") from None


def runtime_plan(plan_path: str | None, result: FrontendResult, program: Program,
                  cost: CostModel, placement: str | None = None
                  ) -> tuple[Plan, Schedule] | None:
    """``plan_and_schedule`` for a command that builds the runtime (compile, memcheck):
    None after printing DT601 errors for what the runtime cannot train yet, the spec's own
    features before planning (no need to wait for the planner), the plan's after."""
    if refused(result, program):
        return None
    planned = plan_and_schedule(plan_path, result, program, cost, placement=placement)
    if planned is None or refused(result, program, planned[0]):
        return None
    return planned


def refused(result: FrontendResult, program: Program, plan: Plan | None = None) -> bool:
    """True after printing DT601 errors for what of the spec (and ``plan``) the runtime
    cannot train yet (``codegen.support.runtime_support``); its warnings are printed and
    refuse nothing."""
    from dtdsl.codegen.support import runtime_support

    assert result.source is not None
    found = runtime_support(program, plan)
    if found:
        sys.stderr.write(render_text(found, result.source, result.name))
    return has_errors(found)
