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
from dtdsl.ir.bounds import MAX_CLUSTER_GPUS
from dtdsl.ir.program import Module, ModuleConstraints, Program
from dtdsl.source import Span

if TYPE_CHECKING:
    from dtdsl.cost.model import CostModel, Efficiency
    from dtdsl.ir.plan import Plan, UnitPlan
    from dtdsl.ir.schedule import Schedule

__all__ = ["PROGRESS_AFTER_S", "SIMULATE_STEPS", "Parser", "Stop", "add_placement",
           "add_plan_options", "cost_model", "efficiency", "open_program",
           "plan_and_schedule", "plan_problems", "read_plan", "refused", "report_infeasible",
           "runtime_plan", "slurm_option", "solve", "spec_dir", "usage_diagnostic"]

# Drawn batches dtc plan optimises for by default (and compile and memcheck plan with).
SIMULATE_STEPS = 2
# Work shorter than this shows no progress bar.
PROGRESS_AFTER_S = 2.0
# A plan file larger than this is not one: dtc plan's for 1,172 GPUs is some kilobytes.
MAX_PLAN_BYTES = 16 << 20


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

    from dtdsl.data.paths import Refused, open_regular
    from dtdsl.ir.plan import Plan

    try:
        # A regular file, read up to a bound (a FIFO or a device would never end).
        with open_regular(path) as f:
            data = f.read(MAX_PLAN_BYTES + 1)
        if len(data) > MAX_PLAN_BYTES:
            raise UsageError(f"cannot read plan {path}: over {MAX_PLAN_BYTES >> 20} MiB, "
                             "more than any plan dtc writes")
        the_plan = Plan.model_validate_json(data)
    except Refused as err:
        raise UsageError(f"cannot read plan: {err}") from None
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


def plan_problems(the_plan: Plan, program: Program) -> list[str]:
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
    if the_plan.schedule != train.schedule:
        out.append(f"schedule is {the_plan.schedule}, the spec's is {train.schedule}")
    out += _rank_problems(the_plan)
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
        if min(u.tp, u.dp, u.pp, u.vpp, u.cp, u.ep) < 1:
            out.append(f"{u.name}: tp, dp, pp, vpp, cp and ep must be at least 1")
            continue
        degrees = _degree_problems(u, module, program.constraints_for(u.name))
        if degrees:
            out += degrees
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


def _degree_problems(u: UnitPlan, module: Module, allowed: ModuleConstraints) -> list[str]:
    """A unit's degrees against what its module can take and the spec allows (a plan edited
    by hand; ``Plan`` checks their types only): each within the largest cluster, vpp within
    its layers, tp splitting its heads and widths, ep its experts and its dp (without
    context parallelism, ``parallel.ep_groups``), and a unit of GPUs of its own within its
    ``constraints``."""
    degrees = {"tp": u.tp, "dp": u.dp, "pp": u.pp, "cp": u.cp, "ep": u.ep}
    huge = [f"{k} {v}" for k, v in degrees.items() if v > MAX_CLUSTER_GPUS]
    if huge:
        return [f"{u.name}: {', '.join(huge)}: more than the {MAX_CLUSTER_GPUS} GPUs a "
                "cluster can have"]
    out = []
    arch = module.arch
    if u.vpp > arch.pipeline_layers:
        out.append(f"{u.name}: vpp {u.vpp} is more than its {arch.pipeline_layers} layers")
    conflicts = () if u.tp_replicated else arch.tp_conflicts(u.tp)
    if conflicts:
        out.append(f"{u.name}: tp {u.tp} cannot split its {' and '.join(conflicts)}")
    moe = getattr(arch, "moe", None)
    if u.ep > 1 and moe is None:
        out.append(f"{u.name}: ep {u.ep}, but it has no experts")
    elif u.ep > 1:
        if moe.ep_conflicts(u.ep):
            out.append(f"{u.name}: ep {u.ep} cannot split its {moe.experts} experts")
        if u.dp % u.ep or u.cp != 1:
            out.append(f"{u.name}: ep {u.ep} must divide dp {u.dp}, without context "
                       f"parallelism (cp {u.cp})")
    if not (u.colocated or u.phased):
        out += [f"{u.name}: {k} {v} is not one the spec's constraints allow"
                for k, v in degrees.items() if v not in getattr(allowed, k)]
    return out


def _rank_problems(the_plan: Plan) -> list[str]:
    """The units that hold GPUs tile ranks 0..gpus_used-1 back to back (``ir.plan``), within
    the plan's GPUs (and the largest cluster's): a hand-edited count would launch that many
    ranks."""
    if max(the_plan.num_gpus, the_plan.gpus_used) > MAX_CLUSTER_GPUS:
        return [f"num_gpus {the_plan.num_gpus} and gpus_used {the_plan.gpus_used}: a cluster "
                f"has at most {MAX_CLUSTER_GPUS} GPUs"]
    out, at = [], 0
    for u in sorted((u for u in the_plan.units if u.gpus), key=lambda u: u.first_rank):
        if u.first_rank != at:
            out.append(f"{u.name}: first_rank {u.first_rank}, not {at} (the units hold ranks "
                       "back to back from 0)")
        at = max(at, u.first_rank + u.gpus)
    if the_plan.gpus_used != at:
        out.append(f"gpus_used is {the_plan.gpus_used}, its units hold {at} GPUs")
    if the_plan.gpus_used > the_plan.num_gpus:
        out.append(f"gpus_used {the_plan.gpus_used} is more than num_gpus {the_plan.num_gpus}")
    return out


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
