"""Training a plan with a phased encoder in forked ranks against the reference
(the phased tests' loop, shared with the bubble tests)."""

from __future__ import annotations

import math

import torch

from dtdsl.data.batch import sample_set
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import phased_units, rank_groups
from dtdsl.schedule.lower import lower
from tests.helpers.runs import (
    LOSS_RTOL,
    PARAM_RMS,
    PARAM_RTOL,
    _split_as_planned,
)

STEPS = 8       # the acceptance: 8+ steps



def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict, steps: int, norms: list[float] | None) -> None:
    from dtdsl.parallel.mesh import build_groups
    from dtdsl.train.executor import StageExecutor
    from dtdsl.train.timelines import gather_timeline

    groups = build_groups(plan)
    assert groups.groups() == rank_groups(plan, rank)
    schedule = lower(plan, program)
    ex = StageExecutor(program, plan, schedule, rank=rank, groups=groups)
    assert ex.p2p.check
    results = ex.train(steps)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    for r, want in zip(results, norms or (), strict=False):
        assert math.isclose(r["grad_norm"], want, rel_tol=LOSS_RTOL), (r["step"], want)
    _split_as_planned(ex)
    # The schedule's actions, and around them the phases of each phased encoder this
    # rank runs: its forward first, its backward (where it trains) before SYNC/OPT.
    phased = phased_units(plan, ex.role)
    events = results[-1]["events"]
    kinds = [(e.unit, e.kind, e.microbatch) for e in events]
    actions = [(ex.role.unit, a.kind.value, a.microbatch)
               for a in schedule.stage(ex.role.unit, ex.role.stage).actions]
    front = [(ex.role.unit, "F", None) for u in phased]
    back = [(ex.role.unit, "B", None) for u in phased
            if ex.stage.phased[u.name].trainable()]
    tail = [a for a in actions if a[1] in ("SYNC", "OPT")]
    body = [a for a in actions if a[1] not in ("SYNC", "OPT")]
    assert kinds == front + body + back + tail, kinds
    # One row per GPU: the phases are events of the backbone's rows.
    timeline = gather_timeline(plan, steps - 1, events)
    if timeline is not None:
        assert {e.row for e in timeline.events} == \
            {(u.name, s, r) for u in plan.units if u.gpus for s in range(u.pp)
             for r in range(u.dp)}
        assert len([e for e in timeline.events if e.kind == "F" and e.microbatch is None]) \
            == plan.unit("llm").dp * plan.unit("llm").pp
    # Every rank's parameters, the phased encoder's shards included, are the reference's.
    full = ex.full_parameters()
    if phased:
        assert any(k.startswith("vit.") for k in full)
    for name, p in full.items():
        init, want = params[name]
        assert p.shape == want.shape, name
        if not p.requires_grad and not ex.named_parameters()[name].requires_grad:
            assert torch.equal(p, want), name
            continue
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)
    # Every image patch of the batch is encoded once per TP index, on the rank the
    # routing gives it.
    patches = torch.tensor([results[-1]["processed"]["patches"] if ex.role.tp_index == 0
                            else 0], dtype=torch.int64)
    torch.distributed.all_reduce(patches)
    want = int(sample_set(program, ex.batch.sizes).items["image"].sizes.sum())
    assert int(patches) == want > 0, (int(patches), want)

