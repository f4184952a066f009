"""A backbone's layers reduce-scatter their gradients during the step's last backward
(``Stage.reduce_early``), and training still matches the single-process reference."""

from __future__ import annotations

import math

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.fsdp import param_groups, reduce_alone, stage_layers
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.plans import chunked, interleaved
from tests.helpers.runs import LOSS_RTOL, plan_for, reference, spec

# Two steps: the first learns the early layers, the second reduces them early.
STEPS = 2


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
        # On entry: have the early layers' gradients (all the backbone's layers once
        # learnt) reached their shards already? (FSDP2 registers the unsharded parameters
        # on a module while it is gathered: read the shards through its state.)
        early = stage.layers if stage.early is None else stage.early
        shards = [fp.sharded_param for layer in early
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
    # Interleaved, the layers of chunk 0 (whose backward is the step's last) only.
    start, stop = stage.chunks[0] if stage.chunks else (stage.start, stage.stop)
    n_layers = stop - start
    assert len(stage.early) == n_layers, (len(stage.early), n_layers)
    assert len(stage.layers) == stage.held_layers
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


def test_an_interleaved_stages_chunk_0_layers_reduce_during_the_last_backward():
    # Interleaved: only chunk 0's layers reduce early (``_train`` checks the count).
    program = interleaved(spec(8))
    plan = chunked(plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 2, 2), ("gen", "generator", 1, 1, 1)),
                   "llm")
    losses, _ = reference(program, STEPS)
    torch.set_num_threads(1)
    run(_train, plan.gpus_used, program, plan, losses, timeout=240)


def _alone(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    """Train the plan twice from the same initial weights: with ``reduce_alone`` handing
    a lone DP rank's gradients over, and with FSDP2's own reduction; the losses, gradient
    norms and trained weights are bitwise the same."""
    from unittest import mock

    from dtdsl.parallel.tp import local_tensor

    def trained(alone: bool) -> tuple[list, dict[str, torch.Tensor]]:
        took: list[bool] = []

        def spy(group: object) -> bool:
            took.append(reduce_alone(group) if alone else False)
            return took[-1]

        with mock.patch("dtdsl.train.stage.reduce_alone", side_effect=spy):
            ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                               groups=build_groups(plan))
            # One step: its reduction is the claim (each step reduces the same way).
            records = [(r["loss"], r["grad_norm"]) for r in ex.train(1)]
        # Every group of these dp-1 stages took the short way (or, patched, FSDP2's).
        assert took and all(took) == alone, took
        return records, {k: local_tensor(p.detach()).clone()
                         for k, p in ex.named_parameters().items()}

    (got, weights), (want, want_weights) = trained(True), trained(False)
    assert got == want, (got, want)
    assert weights.keys() == want_weights.keys()
    for k, w in weights.items():
        assert torch.equal(w, want_weights[k]), k


def test_a_lone_dp_rank_takes_its_gradients_as_fsdp2_would_reduce_them():
    """bf16 (gradients accumulated in fp32 by FSDP2, a cast on the way) with the backbone
    at tp 2 (DTensor gradients, a sequence-parallel norm's Partial over TP) and every
    unit at dp 1."""
    program = spec(4)       # two microbatches: the claim is about one step's reduction
    program = program.model_copy(update={"train": program.train.model_copy(
        update={"precision": "bf16"})})
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    torch.set_num_threads(1)
    run(_alone, plan.gpus_used, program, plan, timeout=240)
