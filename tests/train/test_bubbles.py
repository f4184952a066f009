"""Phased encoders in the pipeline's bubbles (issue 27's stretch): each microbatch step's
images encoded by the backbone stage the plan gives it (``reorder.workload.phase_fit``), the
embeddings handed to the first stage step by step, the gradients back after the first
stage's backward of the stage's last step; trained against the single-process
reference over 8 steps on pipelines of 2 and 3 stages."""

from __future__ import annotations

import pytest
import torch

from dtdsl.data.batch import sample_set
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import phased_problems
from dtdsl.reorder.workload import phase_fit
from tests.dist import run
from tests.helpers.phased import STEPS, _train
from tests.helpers.plans import phase
from tests.helpers.runs import plan_for, reference, spec


def _train_owned(rank: int, world: int, program: ir.Program, plan: Plan, losses, params,
                 steps: int) -> None:
    """``test_phased._train`` (losses, parameters, events, every patch once), and each
    backbone rank encodes exactly the images of the steps its stage owns."""
    from dtdsl.parallel.mesh import build_groups, role_of
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor

    _train(rank, world, program, plan, losses, params, steps, None)
    torch.distributed.barrier()
    # One more step on a fresh executor (every rank), counting this rank's patches.
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    (result,) = ex.train(1)
    role = role_of(plan, rank)
    if role.unit != "llm":
        return
    owners = phase_fit(plan).owners
    mine = [i for j, s in enumerate(ex.steps) if owners[j] == role.stage
            for i in s.samples_of("llm", role.replica)]
    sizes = sample_set(program, [ex.batch.sizes[i] for i in mine]).items["image"].sizes
    assert result["processed"]["patches"] == int(sizes.sum()), (rank, mine)


def _check(pp: int, dp: int) -> None:
    program = spec(8)
    plan = phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                   ("llm", "backbone", 1, dp, pp),
                                   ("gen", "generator", 1, 1, 1)))
    assert not phased_problems(plan)
    owners = phase_fit(plan).owners
    # The later stages take steps (their bubbles), the first stage waits for them.
    assert any(s > 0 for s in owners), owners
    losses, params = reference(program, STEPS)
    run(_train_owned, plan.gpus_used, program, plan, losses, params, STEPS, timeout=300)


# (3, 2): DP replicas and a third stage together; (2, 1): the two-stage pipeline alone.
@pytest.mark.parametrize("pp,dp", [(2, 1), (3, 2)])
def test_bubble_phased_encoder_matches_the_reference(pp, dp):
    _check(pp, dp)
