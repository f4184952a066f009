"""Co-located plans (issue 27): an encoder on the backbone's first pipeline stage, a
generator on its last, with the backbone's TP and DP and no GPUs of their own, trained
by the runtime and held against the single-process reference."""

from __future__ import annotations

import pytest

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import colocation_problems, hosted_units, role_of
from dtdsl.schedule.lower import lower
from tests.dist import run
from tests.helpers.plans import (
    colocate,
)
from tests.helpers.runs import check, check_tp, plan_for, spec


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


@pytest.mark.parametrize("replicated", [(), ("vit",)], ids=["sharded", "vit-replicated"])
def test_both_co_located_with_tensor_parallelism(replicated):
    # The encoder's and the U-Net's blocks split over the backbone's TP group of 2, or
    # the encoder whole on both TP ranks (``tp_replicated``: the planner's choice for a
    # module the backbone's TP degree cannot split), counted once in the norm.
    program = spec(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 2, 1, 2),
                                      ("gen", "generator", 1, 1, 1)),
                    "vit", "gen", split=(1, 3))
    plan = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"tp_replicated": u.name in replicated}) for u in plan.units)})
    check_tp(program, plan, grad_norms=True)


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


def test_checkpoints_reshard_between_co_located_and_disaggregated_plans(tmp_path):
    # The checkpoint's keys are the units' own ("units.vit...") wherever they ran: a
    # co-located run resumes under a disaggregated plan of the same spec and back.
    from tests.helpers.checkpoints import PLAN_A, PROGRAM, _close, _go, _reference

    ref, _ = _reference()
    run_dir = tmp_path / "run"
    hosted = colocate(PROGRAM, plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1),
                                        ("llm", "backbone", 1, 2, 2),
                                        ("gen", "generator", 1, 1, 1)),
                      "vit", "gen", split=(1, 3))
    a = _go(hosted, run_dir, 4, {4: "sync"}, tmp_path / "a.json", want_at=4)
    assert a["first"] == 0
    _close(a["losses"], ref[:4])
    b = _go(PLAN_A, run_dir, 2, {6: "thread"}, tmp_path / "b.json", want_at=6)
    assert b["first"] == 4
    assert "resharded from vit:colocated llm:tp1dp2pp2 gen:colocated" in b["logs"][0]
    _close(b["losses"], ref[4:6])
    tp = colocate(PROGRAM, plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1),
                                    ("llm", "backbone", 2, 1, 2),
                                    ("gen", "generator", 1, 1, 1)), "vit", "gen",
                  split=(3, 1))
    c = _go(tp, run_dir, 2, {}, tmp_path / "c.json", want_at=8)
    assert c["first"] == 6 and "resharded from" in c["logs"][0]
    _close(c["losses"], ref[6:8])


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
        u.model_copy(update={"recompute": u.name == "vit"}) for u in plan.units)})
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
    from dtdsl.sim.workload import WorkModel

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
