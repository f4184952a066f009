"""A backbone's layers reduce-scatter their gradients during the step's last backward
(``Stage.reduce_early``), and training still matches the single-process reference."""

from __future__ import annotations

import math

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.fsdp import param_groups, stage_layers
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.train.test_executor import LOSS_RTOL, plan_for, reference, spec

STEPS = 3


def _train(rank: int, world: int, program: ir.Program, plan: Plan,
           losses: list[float]) -> None:
    from torch.distributed.fsdp import FSDPModule

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    stage = ex.stage
    # Each layer is an FSDP2 unit of its own where there is a DP group to reduce over;
    # on a unit of one DP rank only the stage is (no per-layer hooks to pay for). (A
    # U-Net has no per-layer units.)
    layers = [m for _, _, m in stage_layers(stage.module.units)]
    assert isinstance(stage.module, FSDPModule)
    assert layers or ex.role.role == "generator"
    assert [isinstance(m, FSDPModule) for m in layers] == [ex.role.grid.dp > 1] * len(layers)
    seen: list[bool] = []
    reduce = stage.reduce_gradients

    def reduce_and_look() -> None:
        # On entry: have the backbone's layers' gradients reached their shards already?
        # (FSDP2 registers the unsharded parameters on a module while it is gathered: read
        # the shards through its state.)
        shards = [fp.sharded_param for layer in stage.layers
                  for group in param_groups(layer._get_fsdp_state())
                  for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        seen.append(bool(shards) and all(p.grad is not None for p in shards))
        reduce()

    stage.reduce_gradients = reduce_and_look
    results = ex.train(STEPS)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    if ex.role.role != "backbone":
        assert stage.early == []
        return
    n_layers = stage.stop - stage.start
    assert len(stage.early) == n_layers, (len(stage.early), n_layers)
    # The first step learns which layers are early and reduces everything at its end;
    # from the second on, the layers' reduce-scatters ran inside the last backward.
    assert seen == [False] + [True] * (STEPS - 1), seen


def test_a_backbones_layers_reduce_during_the_last_backward():
    program = spec(8)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 2),
                    ("gen", "generator", 1, 1, 1))
    losses, _ = reference(program, STEPS)
    torch.set_num_threads(1)
    run(_train, plan.gpus_used, program, plan, losses, timeout=240)
