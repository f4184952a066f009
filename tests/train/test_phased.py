"""Phased encoders (issue 27): an encoder whose forward runs for the whole step before
the backbone's pipeline and whose backward runs after it, data-parallel over all the
backbone's ranks, trained by the runtime and held against the single-process
reference."""

from __future__ import annotations

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import phased_problems
from dtdsl.schedule.lower import lower
from tests.dist import run
from tests.helpers.phased import (
    STEPS,
    _train,
)
from tests.helpers.plans import (
    chunked,
    interleaved,
    phase,
)
from tests.helpers.runs import (
    plan_for,
    reference,
    reference_grad_norms,
    spec,
)


def check(program: ir.Program, plan: Plan, steps: int = STEPS, *,
          grad_norms: bool = False) -> None:
    assert not phased_problems(plan)
    losses, params = reference(program, steps)
    norms = reference_grad_norms(program, steps) if grad_norms else None
    run(_train, plan.gpus_used, program, plan, losses, params, steps, norms, timeout=240)


# The phased encoder on a two-stage backbone (dp 1): test_phased_encoder_on_a_pipelined_
# data_parallel_backbone runs it over the same two stages at dp 2 (and the frozen, bf16
# and zero-bubble tests at dp 1).


def test_phased_encoder_beside_an_interleaved_backbone():
    # Two model chunks per stage: the first stage's chunk-1 backwards come before the
    # chunk-0 backwards that complete the embeddings' gradients, and the stages exchange
    # pipeline messages both ways beside the phases' hand-offs (their own channel).
    program = interleaved(spec(8))
    check(program, phase(program, chunked(plan_for(program, ("vit", "encoder", 1, 1, 1),
                                                   ("llm", "backbone", 1, 1, 2),
                                                   ("gen", "generator", 1, 1, 1)), "llm")))


def test_phased_encoder_on_a_pipelined_data_parallel_backbone():
    # Four encoder replicas: each backbone replica's samples split over its two stages.
    program = spec(8)
    check(program, phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                           ("llm", "backbone", 1, 2, 2),
                                           ("gen", "generator", 1, 1, 1))))


@pytest.mark.parametrize("replicated", ["gen", "vit"], ids=["sharded", "vit-replicated"])
def test_phased_encoder_with_tensor_parallelism(replicated):
    # The encoder's blocks split over the backbone's TP group of 2 (its DP group: the
    # ranks of one TP index over both stages), or whole on both TP ranks; beside it the
    # generator co-located on the last stage, whole on both TP ranks (``tp_replicated``:
    # the planner's choice for a module the backbone's TP degree cannot split) or its
    # blocks split, counted once in the norm. (The co-located generator took over
    # test_colocated's TP test: one run for a phased and a co-located unit under TP.)
    from tests.helpers.plans import colocate

    program = spec(8)
    plan = phase(program, colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                                     ("llm", "backbone", 2, 1, 2),
                                                     ("gen", "generator", 1, 1, 1)),
                                   "gen", split=(3, 1)))
    plan = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"tp_replicated": u.name == replicated}) for u in plan.units)})
    assert plan.gpus_used == 4
    # 4 steps: a TP layout matches from its first step, and Adam's moments go through
    # several updates (TP_STEPS' 6 cost ~2.5 CPU-s a step here).
    check(program, plan, 4, grad_norms=True)


def test_frozen_backbone_with_a_trainable_phased_encoder():
    # The backbone trains nothing, yet every stage runs B (the first stage's inputs'
    # gradients feed the backward phase) and steps the encoder's shards it holds.
    program = spec(8, frozen=("llm",))
    plan = phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                   ("llm", "backbone", 1, 1, 2),
                                   ("gen", "generator", 1, 1, 1)))
    schedule = lower(plan, program)
    for s in range(2):
        assert {"B", "SYNC", "OPT"} <= {a.kind.value for a in schedule.stage("llm", s).actions}
    check(program, plan)


def test_phased_encoder_with_a_co_located_generator():
    from tests.helpers.plans import colocate

    program = spec(8)
    plan = phase(program, colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                                     ("llm", "backbone", 1, 1, 2),
                                                     ("gen", "generator", 1, 1, 1)),
                                   "gen", split=(3, 1)))
    assert plan.gpus_used == 2
    check(program, plan)


# Phased <-> other plans' checkpoints: test_colocated's
# test_checkpoints_reshard_between_co_located_phased_and_disaggregated_plans (one run
# through co-located, phased under TP and disaggregated plan A).


def test_memcheck_counts_the_phased_encoder_on_every_backbone_rank():
    from dtdsl.train.memplan import check_memory

    program = spec(8)
    own = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2),
                   ("gen", "generator", 1, 1, 1))
    phased = {(s.unit, s.stage): s for s in check_memory(program, phase(program, own),
                                                          jobs=2)}
    # Without it: the backbone's stages only (what the phased plan's are held to).
    alone = {(s.unit, s.stage): s for s in check_memory(
        program, own, jobs=2, stages={("llm", 0), ("llm", 1)})}
    # Nothing of its own to measure: each backbone stage holds its shards of it (half
    # of each tensor: its DP group spans both stages) and runs its phases.
    assert list(phased) == [("llm", 0), ("llm", 1), ("gen", 0)]
    for stage in (0, 1):
        got, without = phased[("llm", stage)], alone[("llm", stage)]
        assert got.measured_bytes > without.measured_bytes, stage
        assert got.predicted_bytes > without.predicted_bytes, stage
        for what in ("params", "optimizer_state"):
            assert got.by_category[what] > without.by_category[what], (stage, what)


def test_frozen_phased_encoder_has_no_backward_phase():
    # A frozen ViT and projector: only the forward phase (no B event, nothing stepped
    # on its account); the backbone trains as before.
    program = spec(8, frozen=("vit", "vit_to_llm"))
    assert [p.frozen for p in program.projectors if p.source == "vit"] == [True]
    check(program, phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                           ("llm", "backbone", 1, 1, 2),
                                           ("gen", "generator", 1, 1, 1))))


def _train_bf16(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
                steps: int) -> None:
    from dtdsl.parallel.mesh import build_groups
    from dtdsl.train.executor import StageExecutor

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    if ex.role.role == "backbone":
        assert ex.stage.phased["vit"].compute_dtype == torch.bfloat16
    for r, want in zip(ex.train(steps), losses, strict=True):
        assert abs(r["loss"] - want) <= 0.03 * abs(want), (r["step"], r["loss"], want)
        assert r["loss"] != want, "bf16 computed exactly the fp32 loss"


def test_bf16_phased_encoder_trains_within_three_percent_of_the_fp32_reference():
    # The hand-offs carry bf16 embeddings and gradients; the encoder's shards stay fp32.
    program = spec(8)
    bf16 = program.model_copy(update={"train": program.train.model_copy(
        update={"precision": "bf16"})})
    plan = phase(bf16, plan_for(bf16, ("vit", "encoder", 1, 1, 1),
                                ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)))
    losses, _ = reference(program, 4)
    run(_train_bf16, plan.gpus_used, bf16, plan, losses, 4, timeout=240)
