"""Co-located plans (issue 27): an encoder on the backbone's first pipeline stage, a
generator on its last, with the backbone's TP and DP and no GPUs of their own, trained
by the runtime and held against the single-process reference."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import colocation_problems, hosted_units, role_of
from dtdsl.schedule.lower import lower
from tests.dist import run
from tests.helpers.plans import (
    colocate,
    phase,
)
from tests.helpers.runs import check, plan_for, spec


def test_a_co_located_plan_places_its_units_on_the_backbones_stages():
    program = spec(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 2, 2),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    assert plan.gpus_used == 4 and not colocation_problems(plan)
    assert [u.name for u in hosted_units(plan, role_of(plan, 0))] == ["vit"]
    assert [u.name for u in hosted_units(plan, role_of(plan, 3))] == ["gen"]
    # The schedule has no stage of theirs: their passes are the host stages'.
    assert [u.name for u in lower(plan, program).units] == ["llm"]
    bad = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"dp": 1}) if u.name == "gen" else u for u in plan.units)})
    assert colocation_problems(bad) == [
        "gen: dp 1, but a co-located unit runs on the backbone's ranks with its dp (llm: 2)"]
    with pytest.raises(ValueError, match="co-located units cannot run: gen: dp 1"):
        hosted_units(bad, role_of(bad, 3))


def test_co_located_encoder_on_a_pipelined_data_parallel_backbone():
    program = spec(8)
    check(program, colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 1, 2, 2),
                                              ("gen", "generator", 1, 1, 1)),
                            "vit", split=(1, 3)))


def test_co_located_generator():
    program = spec(8)
    check(program, colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 1, 2, 2),
                                              ("gen", "generator", 1, 1, 1)),
                            "gen", split=(3, 1)))


# Co-located units under the backbone's TP 2 x PP 2: test_zero_bubble's
# test_zero_bubble_tensor_parallel_backbone runs both split (their TP shards and the
# gradient norms checked), test_phased's test_phased_encoder_with_tensor_parallelism the
# generator co-located under 1F1B, split and whole on both TP ranks (``tp_replicated``).


def test_frozen_backbone_with_a_trainable_co_located_encoder():
    # The backbone trains nothing, yet its first stage runs B (the encoder under it
    # trains) and steps an optimizer over the encoder and its projector.
    program = spec(8, frozen=("llm",))
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 1, 2),
                                      ("gen", "generator", 1, 1, 1)), "vit")
    first = {a.kind.value for a in lower(plan, program).stage("llm", 0).actions}
    assert {"B", "SYNC", "OPT"} <= first
    check(program, plan)


@cache
def _reference_every_step() -> tuple[list[float], dict[int, dict]]:
    """tests.helpers.checkpoints' reference (its PROGRAM, TOTAL steps): the losses, and
    after every step each parameter's (initial, value then)."""
    from dtdsl.models.multimodal import build_model
    from dtdsl.train.reference import train_reference
    from tests.helpers.checkpoints import PROGRAM, TOTAL

    torch.set_num_threads(1)
    model = build_model(PROGRAM)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, params = [], {}
    for r in train_reference(PROGRAM, TOTAL, model=model):
        losses.append(r["loss"])
        params[r["step"] + 1] = {n.removeprefix("units."): (init[n], p.detach().clone())
                                 for n, p in model.named_parameters()}
    return losses, params


def test_checkpoints_reshard_between_co_located_phased_and_disaggregated_plans(tmp_path):
    # The checkpoint's keys are the units' own ("units.vit...", its optimizer state too)
    # wherever they ran, co-located or phased: one run resumed under another plan at
    # each save, co-located -> phased under TP -> disaggregated (plan A), each leg's
    # losses and final parameters the reference's. Every kind of plan saves and a TP plan
    # resumes; a disaggregated save resumed co-located is test_modal's
    # test_a_checkpoint_resumes_with_the_audio_encoder_moved_onto_the_backbone.
    from tests.helpers.checkpoints import PLAN_A, PROGRAM, _close, _phase

    def units(tp: int, dp: int) -> Plan:
        return plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, dp, 2),
                        ("gen", "generator", 1, 1, 1))

    ref, params = _reference_every_step()
    legs = [  # (plan, save mode after its 2 steps, what its resume logs)
        (colocate(PROGRAM, units(1, 2), "vit", "gen", split=(1, 3)), "sync", None),
        (phase(PROGRAM, units(2, 1)), "thread",
         "resharded from vit:colocated llm:tp1dp2pp2 gen:colocated"),
        (PLAN_A, None, "resharded from vit:phased llm:tp2dp1pp2 gen:tp1dp1pp1"),
    ]
    run_dir, step = tmp_path / "run", 0
    for i, (plan, mode, log) in enumerate(legs):
        out = tmp_path / f"{i}.json"
        run(_phase, plan.gpus_used, PROGRAM, plan, str(run_dir), 2,
            {step + 2: mode} if mode else {}, str(out), params[step + 2], timeout=240)
        got = json.loads(out.read_text())
        assert got["first"] == step, (i, got["first"])
        if log is not None:
            assert log in got["logs"][0], (i, got["logs"])
        _close(got["losses"], ref[step:step + 2])
        step += 2
    assert step == 6


def _wrapped(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from dtdsl.parallel.mesh import build_groups
    from dtdsl.train.executor import StageExecutor

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    wrapped = {name for name, m in ex.stage.module.named_modules()
               if isinstance(m, CheckpointWrapper)}
    if (ex.role.unit, ex.role.stage) == ("llm", 0):     # vit's two layers, none of llm's
        assert wrapped == {"units.vit.layers.0", "units.vit.layers.1"}, wrapped
        assert ex.stage.hosted == ("vit",)
    else:
        assert not wrapped


def test_co_located_modules_recompute_as_their_spec_or_plan_says():
    # The spec recomputes nothing; the plan recomputes vit (as a planner may, to fit a
    # layout): its layers on the backbone's first stage are wrapped, the backbone's not.
    program = spec(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 1, 2),
                                      ("gen", "generator", 1, 1, 1)), "vit")
    plan = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"recompute": ir.Recompute.of(u.name == "vit")}) for u in plan.units)})
    run(_wrapped, plan.gpus_used, program, plan, timeout=120)


def _rare_images(batch: int) -> ir.Program:
    """tiny_cpu where most samples have no image and few a generation target: some data
    replica of a step holds neither."""
    from dtdsl.driver import run_frontend
    from tests.specs import TINY

    text = TINY.read_text()
    for old, new in (("image.count     ~ zipf(a=2.0) clamp [0, 3]",
                      "image.count     ~ choice([0, 1], p=[0.85, 0.15])"),
                     ("image.gen_count ~ choice([0, 1], p=[0.6, 0.4])",
                      "image.gen_count ~ choice([0, 1], p=[0.9, 0.1])"),
                     ("global_batch     = 16", f"global_batch     = {batch}")):
        assert old in text, old
        text = text.replace(old, new)
    result = run_frontend("rare.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def test_a_replica_without_images_or_targets_reduces_with_the_others():
    """A co-located encoder and generator that a data replica never runs in a step (no
    image, no generation target among its samples) still join its DP ranks' gradient
    reduce-scatter with every parameter (zeros): the launched tiny bundle on a dataset
    once crashed in gloo on exactly that."""
    from dtdsl.cost.model import build_cost_model
    from dtdsl.data.batch import SyntheticSource, route_batch
    from dtdsl.reorder.workload import WorkModel

    program = _rare_images(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 4, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    # The draw has a step where some replica of the backbone holds no image.
    source, work = SyntheticSource(program), WorkModel(build_cost_model(program))
    empty = 0
    for step in range(4):
        sizes = source.sizes(step)
        routing = route_batch(plan, program, sizes, frozenset(program.train.reorder), work)
        for r in range(4):
            ids = [i for s in routing for i in s.samples_of("llm", r)]
            empty += all(not sizes[i].image_shapes for i in ids)
    assert empty, "the draw must leave a replica without images"
    check(program, plan, steps=4)
