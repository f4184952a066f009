"""Expert parallelism inside Local SGD replicas (issue 31): the tiny MoE spec under
``local_sgd(period=2, replica_dp=2)`` with ``ep(llm) == 2`` on 4 gloo ranks, 2 replicas
of 2, each replica's EP group its own 2 ranks. A rank's experts meet only the ranks
holding the same experts in the other replica; the run equals ``dtc reference``, each
replica's checkpoint holds every expert under its single-process name, a run resumed
at ep 1 from a checkpoint written at ep 2 continues as the uninterrupted run, and one
replica loads it (fewer replicas); the planner and ``dtc compile`` keep ep inside a
replica, and the cost model prices a rank's own experts."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.ep import EXPERT_PARAMS, ExpertParallelMoE
from dtdsl.parallel.mesh import build_groups, ep_lines, rank_groups, role_of
from dtdsl.parallel.tp import local_tensor
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.reference import train_reference
from tests.dist import run
from tests.helpers.local_sgd import local
from tests.helpers.moe import ARGS, ep_plan, moe_spec
from tests.helpers.plans import colocate
from tests.helpers.runs import PARAM_RTOL

LOSS_TOL = 1e-4
SAVE_AT = 2         # a synchronising step (period 2): its outer steps still to land
# Syncs after steps 1 and 3: one before the save (the outer momentum it holds), one after
# it in the resumed run.
STEPS = 4


def spec() -> ir.Program:
    return local(moe_spec(args=ARGS), period=2, outer_lr=0.7, outer_momentum=0.9,
                 replica_dp=2)


def plan_at(program: ir.Program, ep: int) -> Plan:
    """The backbone at dp 4 (2 replicas of 2) with ``ep``, the encoder and generator
    co-located on its 4 ranks."""
    plan = colocate(program, ep_plan(program, 4, 1, ep), "vit", "gen")
    assert plan.gpus_used == 4
    return plan


def test_ep_groups_lie_inside_a_replica():
    program = spec()
    plan = plan_at(program, 2)
    # Replicas {0, 1} and {2, 3}: EP groups are replicas, the expert DP group inside a
    # replica is one rank, and Local SGD's group joins rank 0 with 2 (experts 0-1) and
    # 1 with 3 (experts 2-3).
    for rank in range(4):
        lines = ep_lines(role_of(plan, rank), 2, 2)
        assert lines == {"ep": (rank - rank % 2, rank - rank % 2 + 1), "ep_dp": (rank,)}
        got = rank_groups(plan, rank, 0, replica_dp=2)
        assert got["dp_replicate"] == (rank % 2, rank % 2 + 2)
        assert "llm.ep_dp" not in got
    # Without Local SGD the expert DP group spans the replicas.
    assert ep_lines(role_of(plan, 1), 2) == {"ep": (0, 1), "ep_dp": (1, 3)}
    # Replicas of 4 at ep 2: two ranks of a replica hold each expert.
    assert ep_lines(role_of(plan, 1), 2, 4)["ep_dp"] == (1, 3)


def test_the_diagnostic_wants_ep_inside_a_replica():
    from dtdsl.codegen.support import runtime_support

    program = spec()
    assert not runtime_support(program, plan_at(program, 2))
    whole = local(moe_spec(args=ARGS), period=2)
    (diag,) = runtime_support(whole, plan_at(whole, 2))
    assert diag.code == "DT636" and "ep 2" in diag.message and diag.hint
    wide = plan_at(program, 4)
    assert [d.code for d in runtime_support(program, wide)] == ["DT636"]


def _train(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
           steps: int, save_at: int | None, out: str) -> None:
    """Resume from ``run_dir`` (or start), train ``steps`` steps, save after ``save_at``;
    write what each rank holds and synchronises to ``out.<rank>``."""
    from dtdsl.train.checkpoint import Checkpointer

    groups = build_groups(plan, zero=program.train.mesh_zero,
                          replica_dp=program.train.replica_dp)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    ckpt = Checkpointer(ex, run_dir, keep=3, mode="sync", log=lambda _line: None)
    first = ckpt.resume()
    # Whether each synchronised parameter starts at its anchor with no outer momentum
    # (a resume from a checkpoint of fewer replicas: Local SGD starts again there).
    anchored = [torch.equal(s.anchor_of(p), local_tensor(p)) and not s.momentum_of(p).any()
                for s, _, _ in ex.local_sgd.syncs for p in s.params]
    results = []
    for step in range(first, first + steps):
        results.append(ex.run_step(step))
        if step + 1 == save_at:
            ckpt.save(step + 1)
    ckpt.close()
    ex.local_sgd.settle()
    blocks = [m for m in ex.stage.module.modules() if isinstance(m, ExpertParallelMoE)]
    mine = {"first": first, "losses": [r["loss"] for r in results],
            "bytes": [r["dp_sync_bytes"] for r in results],
            "experts": [(b.first_expert, b.local_experts) for b in blocks],
            "anchored": anchored}
    if ex.local_sgd.syncs:      # several replicas
        (sync, replicas, mine["replica"]), = ex.local_sgd.syncs
        experts = {id(getattr(b, n)) for b in blocks for n in EXPERT_PARAMS}
        # What the sync all-reduces of the experts: this rank's blocks (fp32), and which
        # experts the other replica's rank it meets holds.
        mine["expert_bytes"] = sum(local_tensor(p).numel() * 4 for p in sync.params
                                   if id(p) in experts)
        mine["peers"] = [None] * replicas
        torch.distributed.all_gather_object(mine["peers"], [b.first_expert for b in blocks],
                                            group=sync.group)
    mine["full"] = {k: v.clone() for k, v in ex.full_parameters().items()}
    torch.save(mine, f"{out}.{rank}")


def _launch(tmp_path, program: ir.Program, plan: Plan, name: str, steps: int,
            save_at: int | None) -> list[dict]:
    out = str(tmp_path / name)
    run(_train, plan.gpus_used, program, plan, str(tmp_path / "run"), steps, save_at, out,
        timeout=300)
    return [torch.load(f"{out}.{r}") for r in range(plan.gpus_used)]


def test_ep_in_replicas_matches_the_reference_and_resumes_elsewhere(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from dtdsl.ir.checkpoint import checkpoint_root

    program = spec()
    two, one = plan_at(program, 2), plan_at(program, 1)
    torch.set_num_threads(1)
    model = build_model(program)
    init = {n.removeprefix("units."): p.detach().clone() for n, p in model.named_parameters()}
    want = [r["loss"] for r in train_reference(program, STEPS, model=model, plan=two)]
    ref = {n.removeprefix("units."): p for n, p in model.named_parameters()}

    ranks = _launch(tmp_path, program, two, "whole", STEPS, SAVE_AT)
    for step, (g, w) in enumerate(zip(ranks[0]["losses"], want, strict=True)):
        assert abs(g - w) <= LOSS_TOL, (step, g, w)
    for r in ranks:
        for name, p in r["full"].items():
            err = (p - ref[name]).norm().item()
            assert err <= PARAM_RTOL * (ref[name] - init[name]).norm().item() + 1e-7, \
                (name, err)
    llm = ranks[0]["full"]
    assert any(k.endswith(".mlp.w1") for k in llm)
    layers = sum(1 for k in llm if k.endswith(".mlp.w1"))
    per_expert = 3 * 64 * 128          # w1, w3, w2 of one expert (expert_ffn 64, hidden 128)
    for rank, r in enumerate(ranks):
        # EP rank rank % 2 of its replica holds experts 2 (rank % 2), +1 and meets the
        # rank of the other replica that holds the same ones.
        assert r["replica"] == rank // 2
        assert r["experts"] == [(2 * (rank % 2), 2)] * layers
        assert r["peers"] == [[2 * (rank % 2)] * layers] * 2
        # It synchronises its own two experts of each layer, whole (the expert DP group
        # inside a replica is one rank): half of the experts, not all of them.
        assert r["expert_bytes"] == layers * 2 * per_expert * 4
        # Syncs after steps 1, 3 (period 2): bytes then, none between.
        assert all((b > 0) == (step % 2 == 1) for step, b in enumerate(r["bytes"]))
    # The job's bytes at a sync: every rank's share once (the dense parameters are split
    # over a replica's 2 ranks, the experts over its EP group): per replica one copy of
    # the model's trained fp32 parameters, with the penalty's norms off.
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ranks[0]["bytes"][1] == 2 * trained * 4

    # Each replica's checkpoint entries hold all four experts (ranks of both EP ranks
    # wrote them), under the single-process name and shape.
    meta = FileSystemReader(str(checkpoint_root(tmp_path / "run") / f"ckpt-{SAVE_AT}")
                            ).read_metadata().state_dict_metadata
    for key in ("model.units.llm.layers.0.mlp.w1", "local_sgd.replica0.llm.layers.0.mlp.w1",
                "local_sgd.replica1.llm.layers.0.mlp.w1", "local_sgd.anchor.llm.layers.0.mlp.w1",
                "local_sgd.replica1.optim.llm.layers.0.mlp.w1.exp_avg"):
        assert tuple(meta[key].size) == (4, 64, 128), key
        assert sorted(c.offsets[0] for c in meta[key].chunks) == [0, 2], key

    # Resumed at ep 1 (the experts FSDP2-sharded over each replica's 2 ranks like the
    # rest) from the checkpoint written at ep 2: the uninterrupted run's steps.
    again = _launch(tmp_path, program, one, "resumed", STEPS - SAVE_AT, None)
    assert again[0]["first"] == SAVE_AT
    for step, (g, w) in enumerate(zip(again[0]["losses"], ranks[0]["losses"][SAVE_AT:],
                                      strict=True)):
        assert math.isclose(g, w, rel_tol=1e-5), (SAVE_AT + step, g, w)
    for a, b in zip(ranks, again, strict=True):
        assert a["replica"] == b["replica"] and b["experts"] == []
        for name, p in a["full"].items():
            err = (p - b["full"][name]).norm().item()
            assert err <= PARAM_RTOL * (p - init[name]).norm().item() + 1e-7, (name, err)

    # Loaded at dp 2 (one replica of 2 ranks, ep 2): the model the replicas agreed on at
    # the synchronisation the checkpoint was saved after, whose loss on step SAVE_AT's
    # batch is the reference's.
    single = colocate(program, ep_plan(program, 2, 1, 2), "vit", "gen")
    (alone, _) = _launch(tmp_path, program, single, "single", 2, SAVE_AT + 1)
    assert alone["first"] == SAVE_AT and "replica" not in alone
    assert alone["experts"] == [(0, 2)] * layers
    assert abs(alone["losses"][0] - want[SAVE_AT]) <= LOSS_TOL
    # ... and saved after step SAVE_AT + 1, resumed by 2 replicas again: both start from
    # the saved model (its loss at that step the one replica's), anchored there, and
    # train on.
    grown = _launch(tmp_path, program, two, "grown", 2, None)
    assert grown[0]["first"] == SAVE_AT + 1
    assert all(r["anchored"] and all(r["anchored"]) for r in grown)
    assert math.isclose(grown[0]["losses"][0], alone["losses"][1], rel_tol=1e-5)
    assert all(math.isfinite(x) for x in grown[0]["losses"])


def _planned(replica_dp: int) -> tuple[ir.Program, Plan]:
    from dtdsl.cost.model import build_cost_model
    from dtdsl.planner import plan
    from tests.specs import TINY, program

    text = TINY.read_text().replace("vocab=512, swiglu)", "vocab=512, swiglu, " + ARGS + ")")
    text = text.replace("  checkpoint_every = 10\n", "  checkpoint_every = 10\n  sync = "
                        f"local_sgd(period=2, replica_dp={replica_dp})\n")
    text = text.replace("tp(*) in {1, 2}", "tp(*) == 1\n  ep(llm) == 2")
    cost = build_cost_model(program(text))
    return cost.program, plan(cost, compare_baseline=False)


def test_the_planner_plans_ep_inside_replicas_only():
    from dtdsl.codegen.support import runtime_support
    from dtdsl.planner.result import Infeasible

    program, planned = _planned(2)
    llm = planned.unit("llm")
    assert llm.ep == 2 and program.train.sync.replica_ranks(llm.dp) % 2 == 0
    assert not runtime_support(program, planned)
    # Whole replicas (one rank each) hold no EP group: nothing to plan.
    with pytest.raises(Infeasible):
        _planned(1)


def test_the_cost_model_prices_a_ranks_own_experts():
    from dtdsl.cost.model import build_cost_model

    cost = build_cost_model(spec())
    one, two = cost.unit("llm"), cost.with_ep({"llm": 2}).unit("llm")
    experts = one.expert_params * one.trainable_params / one.params
    assert experts > 0 and two.ep == 2
    # dp 4 = 2 replicas of 2. Local SGD all-reduces a rank's 1 / 2 of the replica's
    # parameters at ep 1 and at ep 2 alike (at ep 2: its 2 of 4 experts, whole on it);
    # inside a replica FSDP2 no longer moves the experts at ep 2 (each is on one rank
    # there): 2 bytes x 2 (n - 1) / n at n = 2 of each expert parameter less.
    at_one = cost.dp_sync_bytes(one, 1, 1, 4)
    at_two = cost.with_ep({"llm": 2}).dp_sync_bytes(two, 1, 1, 4)
    assert at_one - at_two == pytest.approx(2 * experts)
    # The optimizer state, anchor and outer momentum of a rank's experts are sharded
    # over the replica's ranks holding them (one at ep 2), not over the replica's 2.
    model = cost.with_ep({"llm": 2})
    layers = one.layers
    extra = model._expert_optimizer_bytes(two, layers, 1, 4)
    per = model.optimizer_bytes_per_param() / 2 + 4
    assert extra == pytest.approx(two.expert_params / 2 * per)
