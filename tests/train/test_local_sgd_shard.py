"""Local SGD with replicas of several ranks (``local_sgd(replica_dp=N)``, EDiT's model
sharding and model synchronisation groups): the mesh's layout, the diagnostic, and the
backbone at dp 4 as 2 replicas of 2 FSDP2 shards against ``dtc reference`` (gloo)."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import (
    UnitGrid,
    build_groups,
    dim_groups,
    rank_groups,
    unit_mesh_shape,
)
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.reference import train_reference
from tests.dist import run
from tests.helpers.local_sgd import local, resumed_as_uninterrupted
from tests.helpers.runs import PARAM_RTOL, plan_for, spec

LOSS_RTOL = 1e-4


def dp4(program: ir.Program) -> Plan:
    """The tiny spec with its backbone on 4 DP ranks (6 ranks with the encoder's and the
    generator's)."""
    return plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 4, 1),
                    ("gen", "generator", 1, 1, 1))


def test_the_mesh_splits_dp_into_replicas_of_consecutive_ranks():
    program = local(spec(8), period=2, replica_dp=2)
    plan = dp4(program)
    llm = plan.unit("llm")
    first = llm.first_rank
    assert unit_mesh_shape(UnitGrid.of(llm), 0, 2) == (1, 2, 2, 1)
    assert unit_mesh_shape(UnitGrid.of(llm), 0) == (1, 4, 1, 1)
    # Rank first + 3: replica 1, shard 1: synchronised with first + 1, sharded with + 2.
    got = rank_groups(plan, first + 3, 0, replica_dp=2)
    assert got["dp_replicate"] == (first + 1, first + 3)
    assert got["dp_shard"] == (first + 2, first + 3)
    assert dim_groups(plan, "dp_shard", 0, 2) == ((first, first + 1), (first + 2, first + 3))
    assert dim_groups(plan, "dp_replicate", 0, 2) == ((first, first + 2), (first + 1, first + 3))
    # One replica of every rank (replica_dp=1) and synchronous DP are unchanged.
    assert rank_groups(plan, first + 3, 0)["dp_replicate"] == tuple(range(first, first + 4))
    assert rank_groups(plan, first + 3, 1)["dp_shard"] == tuple(range(first, first + 4))


def test_replica_dp_must_divide_each_dp_and_is_not_built_beside_tp():
    from dtdsl.codegen.support import runtime_support

    program = local(spec(8), period=2, replica_dp=2)
    assert not runtime_support(program, dp4(program))
    odd = local(spec(6), period=2, replica_dp=2)
    plan = plan_for(odd, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 3, 1),
                    ("gen", "generator", 1, 1, 1))
    (diag,) = runtime_support(odd, plan)
    assert diag.code == "DT636" and "dp 3" in diag.message and diag.hint
    wide = dp4(program)
    wide = wide.model_copy(update={"units": tuple(
        u.model_copy(update={"tp": 2}) if u.name == "llm" else u for u in wide.units)})
    assert [d.code for d in runtime_support(program, wide)
            if "replica_dp" in d.message] == ["DT601"]


def _train(rank: int, world: int, program: ir.Program, plan: Plan, steps: int,
           overlap: bool, out: str) -> None:
    groups = build_groups(plan, zero=program.train.mesh_zero,
                          replica_dp=program.train.replica_dp)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    ex.local_sgd.overlap = overlap
    results = []
    for step in range(steps):
        results.append(ex.run_step(step))
        # (With the penalty's clip the synchronisation blocks: nothing is left running.)
        for o in ex.local_sgd._overlaps if step == 1 and ex.local_sgd.overlap and \
                not ex.local_sgd.cfg.clips else ():
            # Between a synchronising step and the next forward: each group's hook is
            # its module's first forward pre-hook, ahead of FSDP2's gather (the layers of
            # the replica's 2 ranks are FSDP2 units of their own).
            assert o is not None and o.active and len(o.groups) > 1
            for (module, _), hook in zip(o.groups, o._hooks, strict=True):
                assert next(iter(module._forward_pre_hooks)) == hook.id
            layers = [m for m, _ in o.groups[1:]]
            assert all(isinstance(m, FSDPModule) and len(m._forward_pre_hooks) >= 2
                       for m in layers)
            # ... and Stage.begin_step will leave them (and the root) to it.
            assert {id(m) for m, _ in o.groups} <= {id(m) for m in o.pending_modules}
    ex.local_sgd.settle()     # as train() ends
    local_params = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                    for k, v in ex.named_parameters().items()}
    counts = [(o.by_hook, o.by_settle, len(o.groups)) for o in ex.local_sgd._overlaps
              if o is not None]
    shapes = {k: (tuple(v.shape), tuple(local_params[k].shape))
              for k, v in ex.named_parameters().items()}
    full = {k: v.clone() for k, v in ex.full_parameters().items()}
    torch.save({"losses": [r["loss"] for r in results], "local": local_params,
                "counts": counts, "shapes": shapes, "full": full,
                "bytes": [r["dp_sync_bytes"] for r in results],
                "replicas": [(n, s.replicas) for s, n, _ in ex.local_sgd.syncs]},
               f"{out}.{rank}")


def _distributed(program: ir.Program, plan: Plan, steps: int, overlap: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        run(_train, plan.gpus_used, program, plan, steps, overlap, out, timeout=300)
        return [torch.load(f"{out}.{r}") for r in range(plan.gpus_used)]


@pytest.mark.parametrize("penalty", [False, True])
def test_two_replicas_of_two_shards_match_the_reference(penalty):
    # With the penalty the replicas' weights are 1 / their pseudo-gradient norms (global
    # over a replica's two shards: a wrong shard-group sum would weigh them wrongly), and
    # the clip keeps the synchronisation blocking (``train.layerwise``).
    program = local(spec(8), period=2, outer_lr=0.7, outer_momentum=0.9, replica_dp=2,
                    penalty=penalty)
    plan = dp4(program)
    # 6 steps: three synchronisations (period 2), two of them landing in a next forward
    # and the last settled, as 8 steps' four did (three and one).
    steps = 6
    torch.set_num_threads(1)
    model = build_model(program)
    init = {n.removeprefix("units."): p.detach().clone() for n, p in model.named_parameters()}
    want = [r["loss"] for r in train_reference(program, steps, model=model, plan=plan)]
    ranks = _distributed(program, plan, steps, True)
    got = ranks[0]["losses"]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (step, g, w)
    ref = {n.removeprefix("units."): p for n, p in model.named_parameters()}
    llm = [r for r in ranks if any(k.startswith("llm.") for k in r["full"])]
    assert len(llm) == 4
    for r in llm:
        for name, p in r["full"].items():
            err = (p - ref[name]).norm().item()
            assert err <= PARAM_RTOL * (ref[name] - init[name]).norm().item() + 1e-7, \
                (name, err)
        # Each rank holds half of a replica's parameters (FSDP2 over the replica's 2
        # ranks), and syncs them with the one rank of the other replica at its place.
        sharded = [k for k, (whole, mine) in r["shapes"].items() if whole != mine]
        assert sharded and all(r["shapes"][k][1][0] * 2 >= r["shapes"][k][0][0]
                               for k in sharded)
        assert r["replicas"] == [(2, 2)]
        # The layer-wise overlap ran: syncs after steps 1, 3 in the next forward.
        assert r["counts"] and all((h, s) == ((0, 0) if penalty else (2 * n, n))
                                   for h, s, n in r["counts"])
    # Two replicas of 2 ranks is not four replicas of 1: the check can fail.
    four = [x["loss"] for x in train_reference(
        local(spec(8), period=2, outer_lr=0.7, outer_momentum=0.9, penalty=penalty), steps,
        plan=plan)]
    assert max(abs(a - b) for a, b in zip(four, want, strict=True)) > 1e-4
    # (That the overlapped sync of replicas of 2 shards equals the blocking one bitwise:
    # test_co_located_units_in_sharded_replicas_match_the_reference runs both.)


@pytest.mark.usefixtures("deterministic")
def test_resume_of_sharded_replicas_equals_an_uninterrupted_run(tmp_path):
    # Saved after step 2 (period 2: a synchronising step, its layers' outer steps still
    # to land in the next forward): each rank saves its shard of its replica's
    # parameters, optimizer state, anchor and momentum; the resumed run continues
    # bitwise as the uninterrupted one (to step 4: the next synchronisation too).
    program = local(spec(8), period=2, outer_lr=0.7, outer_momentum=0.9, penalty=True,
                    replica_dp=2)
    whole = resumed_as_uninterrupted(tmp_path, program, dp4(program), steps=4, save_at=2,
                                     timeout=300)
    llm = [r for r in whole if r["stats"]]
    assert len(llm) == 4 and llm[0]["stats"][0][3] == 2      # two synchronisations


def test_co_located_units_in_sharded_replicas_match_the_reference():
    # The encoder and generator co-located on the backbone's ranks (4 ranks: 2 replicas
    # of 2): their layers are FSDP2 units in the root's group 0, gathered by the root's
    # hook after its outer step (a microbatch may leave the encoder idle on a rank).
    from tests.helpers.plans import colocate

    program = local(spec(8), period=2, outer_lr=0.7, outer_momentum=0.9, replica_dp=2)
    plan = colocate(program, dp4(program), "vit", "gen")
    assert plan.gpus_used == 4
    # 4 steps: two synchronisations (period 2), the first landing in the next forward
    # (the root's hook gathers the co-located layers), the last settled.
    steps = 4
    torch.set_num_threads(1)
    want = [r["loss"] for r in train_reference(program, steps, plan=plan)]
    ranks = _distributed(program, plan, steps, True)
    for step, (g, w) in enumerate(zip(ranks[0]["losses"], want, strict=True)):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (step, g, w)
    assert all(any(k.startswith("vit.") for k in r["shapes"]) for r in ranks)
    block = _distributed(program, plan, steps, False)
    for a, b in zip(ranks, block, strict=True):
        assert a["losses"] == b["losses"]
        for name, p in a["local"].items():
            assert torch.equal(p, b["local"][name]), name
