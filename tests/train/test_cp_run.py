"""Context parallelism run by the executor (issue 30 item 2): the tiny spec's backbone
split over CP ranks (ring, Ulysses, hybrid; with pipeline and tensor parallelism) trains
as the single-process reference does, on gloo."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups, cp_ulysses, rank_groups
from dtdsl.schedule.lower import lower
from tests.dist import run
from tests.train.test_executor import LOSS_RTOL, PARAM_RMS, PARAM_RTOL, plan_for, reference, spec

STEPS = 8       # the acceptance: 8+ steps


def with_cp(program: ir.Program, plan: Plan, cp: int, method: str, name: str = "llm"
            ) -> tuple[ir.Program, Plan]:
    """``program`` with ``name``'s ``context_parallel = method`` and ``plan`` with its
    unit at ``cp`` (cp times the GPUs), the units laid out again in order."""
    modules = tuple(m.model_copy(update={"context_parallel": method}) if m.name == name
                    else m for m in program.modules)
    program = program.model_copy(update={"modules": modules})
    units, first = [], 0
    for u in plan.units:
        update: dict = {"first_rank": first}
        if u.name == name:
            update.update(cp=cp, gpus=u.gpus * cp)
        u = u.model_copy(update=update)
        units.append(u)
        first += u.gpus
    return program, plan.model_copy(update={"units": tuple(units), "num_gpus": first,
                                            "gpus_used": first})


def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict, steps: int) -> None:
    from dtdsl.train.executor import StageExecutor

    uly = cp_ulysses(program, plan)
    groups = build_groups(plan, ulysses=uly)
    assert groups.groups() == rank_groups(plan, rank, ulysses=uly)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    assert ex.p2p.check
    results = ex.train(steps)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    for name, p in ex.full_parameters().items():
        init, want = params[name]
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


def check(program: ir.Program, plan: Plan, steps: int = STEPS) -> None:
    losses, params = reference(program, steps)
    run(_train, plan.gpus_used, program, plan, losses, params, steps, timeout=300)


def tiny_cp(cp: int, method: str, *, tp: int = 1, pp: int = 1) -> tuple[ir.Program, Plan]:
    program = spec(8)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, 1, pp),
                    ("gen", "generator", 1, 1, 1))
    return with_cp(program, plan, cp, method)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_backbone_context_parallel_matches_the_reference(method):
    check(*tiny_cp(2, method))


def test_context_parallel_with_a_pipeline():
    # Stage s's CP rank r sends its shard to stage s+1's CP rank r.
    check(*tiny_cp(2, "ring", pp=2))


def test_context_parallel_with_tensor_parallelism():
    # TP innermost, CP next: sequence parallelism cuts each CP shard over the TP ranks.
    check(*tiny_cp(2, "ulysses", tp=2), steps=4)


def test_hybrid_context_parallelism():
    # Two nodes of two: Ulysses over the pair inside a node, the ring across the nodes.
    program, plan = tiny_cp(4, "hybrid")
    cluster = program.cluster.model_copy(update={"gpus_per_node": 2})
    program = program.model_copy(update={"cluster": cluster})
    assert cp_ulysses(program, plan) == {"llm": 2}
    check(program, plan, steps=4)
