"""Local SGD (EDiT, ``sync = local_sgd``) against synchronous data parallelism
(``sync = allreduce``): bytes each GPU sends over its data-parallel links per step and the
simulated iteration time on a paper-scale plan (the cost model's figures: no cluster here),
then the tiny spec's convergence over its steps in the single-process reference semantics
(``dtc reference``) with the backbone at DP 2.

    python benchmarks/local_sgd.py [--spec mllm_72b] [--period 4] [--replica-dp 8] [--steps 200]
"""

from __future__ import annotations

import argparse
import time

from _common import compile_text, spec_path

from dtdsl.cost.model import build_cost_model
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.planner import plan as make_plan
from dtdsl.reorder.workload import parse_policy
from dtdsl.schedule.lower import lower
from dtdsl.sim.run import simulate_steps

SIM_STEPS = 3


def with_sync(name: str, sync: str) -> ir.Program:
    """Shipped spec ``name`` with ``sync = ...`` added to its train block."""
    text = spec_path(name).read_text()
    head, brace, rest = text.partition("train {")
    if not brace:
        raise SystemExit(f"{name} has no train block")
    return compile_text(f"{name}.dt", f"{head}train {{\n  sync = {sync}\n{rest}")


def _resync(program: ir.Program, the_plan: Plan) -> Plan:
    """``the_plan`` with each unit's end-of-step synchronisation priced by ``program``'s
    cost model (the same layout, the other sync)."""
    cost = build_cost_model(program)
    units = tuple(u.model_copy(update={"dp_sync_time_s": float(cost.dp_sync_time_s(
        cost.unit(u.name), 1 if u.tp_replicated else u.tp, u.pp, u.dp,
        replicated_over=u.tp if u.tp_replicated else 1))}) for u in the_plan.units)
    return the_plan.model_copy(update={"units": units})


def _figures(program: ir.Program, the_plan: Plan) -> tuple[float, float]:
    """(bytes per GPU per step summed over the job, simulated iteration seconds)."""
    cost = build_cost_model(program)
    sent = sum(cost.dp_sync_bytes(cost.unit(u.name), 1 if u.tp_replicated else u.tp,
                                  u.pp, u.dp) * u.gpus for u in the_plan.units)
    schedule = lower(the_plan, program)
    times = [r.iteration_time_s for r in simulate_steps(
        program, cost, the_plan, schedule, steps=SIM_STEPS, policy=parse_policy("none"))]
    return sent, sum(times) / len(times)


def paper_scale(name: str, period: int, replica_dp: int = 1) -> None:
    base = with_sync(name, "allreduce")
    local = with_sync(name, f"local_sgd(period={period}, outer_lr=0.7, outer_momentum=0.9)")
    base_plan = make_plan(build_cost_model(base), base.cluster.num_gpus,
                          compare_baseline=False)
    rows = [("allreduce", *_figures(base, base_plan)),
            (f"local_sgd(period={period}), same plan",
             *_figures(local, _resync(local, base_plan)))]
    if replica_dp > 1:
        sharded = with_sync(name, f"local_sgd(period={period}, outer_lr=0.7, "
                            f"outer_momentum=0.9, replica_dp={replica_dp})")
        odd = [u.name for u in base_plan.units if u.dp > 1 and u.dp % replica_dp]
        if odd:
            print(f"replica_dp={replica_dp} does not divide the dp of {', '.join(odd)}")
        else:
            rows.append((f"  ... replica_dp={replica_dp}, same plan",
                         *_figures(sharded, _resync(sharded, base_plan))))
    try:
        own = make_plan(build_cost_model(local), local.cluster.num_gpus,
                        compare_baseline=False)
        rows.append((f"local_sgd(period={period}), planned", *_figures(local, own)))
    except Exception as err:     # the planner's own error: report it, keep the rest
        print(f"local_sgd planning failed: {err}")
    layout = " ".join(f"{u.name}:tp{u.tp}/dp{u.dp}/pp{u.pp}" for u in base_plan.units)
    print(f"{name} on {base.cluster.num_gpus} GPUs, allreduce plan {layout}")
    print(f"{'sync':<36} {'DP bytes/step (job)':>20} {'ratio':>7} {'iteration s':>12} "
          f"{'ratio':>7}")
    for label, sent, it in rows:
        print(f"{label:<36} {sent / 1e9:>17.1f} GB {sent / rows[0][1]:>7.3f} {it:>12.3f} "
              f"{it / rows[0][2]:>7.3f}")


def _tiny_plan(program: ir.Program) -> Plan:
    """The tiny spec with its backbone at DP 2, the other units at 1 (5 ranks)."""
    from dtdsl.ir.plan import UnitPlan, split_layers

    mb = program.train.micro_batch
    units, first = [], 0
    for name, role, dp in (("vit", "encoder", 1), ("llm", "backbone", 2),
                           ("gen", "generator", 1)):
        layers = split_layers(program.module(name).arch.pipeline_layers, 1) \
            if role != "generator" else (1,)
        units.append(UnitPlan(
            name=name, role=role, projectors=(), gpus=dp, tp=1, dp=dp, pp=1,
            first_rank=first, layers_per_stage=layers, microbatch_share=2 / dp,
            fwd_time_s=1.0, bwd_time_s=2.0, dp_sync_time_s=0.1, memory_bytes=1e9,
            memory_limit_bytes=8e10))
        first += dp
    return Plan(spec="tiny", spec_sha256="0" * 64, search="exhaustive", num_gpus=first,
                gpus_used=first, global_batch=program.train.global_batch, micro_batch=mb,
                num_microbatches=program.train.global_batch // (2 * mb), schedule="1f1b",
                iteration_time_s=1.0, warmup_time_s=0.1, steady_time_s=0.8,
                dp_sync_time_s=0.1, model_flops_per_iteration=1e15, mfu=0.5,
                solve_time_s=0.0, candidates=1, convex_solves=0, evaluated=1,
                units=tuple(units))


def tiny(steps: int, period: int, batch: int | None) -> None:
    from dtdsl.train.reference import train_reference

    rows = []
    for sync in ("allreduce", f"local_sgd(period={period}, outer_lr=0.7, "
                 "outer_momentum=0.9)"):
        program = with_sync("tiny_cpu", sync)
        program = program.model_copy(update={"train": program.train.model_copy(
            update={"steps": steps,
                    "global_batch": batch or program.train.global_batch})})
        start = time.perf_counter()
        losses = []
        for r in train_reference(program, steps, plan=_tiny_plan(program)):
            losses.append(r["loss"])
            if (r["step"] + 1) % 25 == 0:
                print(f"  {sync.split('(')[0]}: step {r['step'] + 1} loss {r['loss']:.4f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
        tail = losses[-10:]
        rows.append((sync, losses[0], sum(tail) / len(tail), time.perf_counter() - start))
    print(f"tiny_cpu, backbone DP 2, global batch {batch or 'as specified'}, {steps} steps "
          "(reference semantics)")
    print(f"{'sync':<52} {'first loss':>10} {'last 10 mean':>12} {'ratio':>7} {'wall s':>7}")
    for sync, first, last, wall in rows:
        print(f"{sync:<52} {first:>10.4f} {last:>12.4f} {last / rows[0][2]:>7.3f} "
              f"{wall:>7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="mllm_72b")
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--replica-dp", type=int, default=1,
                        help="also price replicas of this many DP ranks (local_sgd replica_dp)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=None,
                        help="the tiny spec's global batch (a multiple of 4; default its own)")
    parser.add_argument("--skip-paper", action="store_true")
    args = parser.parse_args()
    if not args.skip_paper:
        paper_scale(args.spec, args.period, args.replica_dp)
        print()
    tiny(args.steps, args.period, args.batch)


if __name__ == "__main__":
    main()
