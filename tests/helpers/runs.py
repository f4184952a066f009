"""Training a plan's ranks in forked processes (``tests.dist.run``) against the
single-process reference: the tiny spec varied, plans of hand-picked layouts, the
reference's losses and parameters, and the tolerances between the two."""

from __future__ import annotations

import json
import math
import os
import tempfile
from functools import cache

import torch
from torch.distributed.tensor import DTensor

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan, split_layers
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import build_groups
from dtdsl.parallel.tp import local_tensor
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.reference import train_reference
from dtdsl.train.timelines import gather_timeline
from tests.dist import make_plan, run
from tests.helpers import shared
from tests.specs import variant

# The runtime's acceptance (its issue): 20 steps equal to the reference, which the plain
# DP and PP layouts run (tests/train/test_executor.py). The other layouts run 8: a layout
# that diverges does so from its first step on, and 8 take Adam's moments through
# several updates at a third of the CPU.
ACCEPTANCE_STEPS = 20
STEPS = 8
# A unit under tensor parallelism runs every op through DTensor, whose sharding
# propagation is cached by shape: each microbatch of a new width pays it anew for every
# op, and a step of a TP backbone costs several times a plain one. The TP layouts match
# the reference from the first step on; these steps take Adam's moments through several
# updates.
TP_STEPS = 6
# The runtime tests' text lengths: two, an even and an odd one (the images still vary the
# widths). Drawn from the tiny spec's lognormal, nearly every microbatch had a width of its
# own, and DTensor's propagation was half of a TP test's CPU.
TEXT_TOKENS = ("text.tokens     ~ lognormal(median=48, sigma=0.5) clamp [8, 192]",
               "text.tokens     ~ choice([40, 47])")
LOSS_RTOL = 1e-4
PARAM_RTOL = 5e-3     # of the norm of a parameter's update over the steps
PARAM_RMS = 1e-4      # and the root-mean-square difference per tensor within this (the issue's
                      # 1e-4; single elements can differ by ~2e-4 after 20 steps where Adam's
                      # m / sqrt(v) amplifies float summation order, as between two
                      # micro-batch sizes of the reference itself)


# The first AdamW imports torch._dynamo (seconds); do it once here, before the forks.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def spec(batch: int, *, frozen: tuple[str, ...] = ()) -> ir.Program:
    """tiny_cpu (its text lengths ``TEXT_TOKENS``) with a global batch of ``batch`` and the
    named modules/projectors frozen."""
    p = variant(*TEXT_TOKENS)
    modules = tuple(m.model_copy(update={"frozen": True}) if m.name in frozen else m
                    for m in p.modules)
    projectors = tuple(q.model_copy(update={"frozen": True}) if q.name in frozen else q
                       for q in p.projectors)
    return p.model_copy(update={"modules": modules, "projectors": projectors,
                                "train": p.train.model_copy(update={"global_batch": batch})})


def plan_for(program: ir.Program, *units: tuple[str, str, int, int, int]) -> Plan:
    """``make_plan`` with the program's layer counts, batch and microbatch count."""
    base = make_plan(*units)
    mb = program.train.micro_batch
    dp_lm = next(u.dp for u in base.units if u.role == "backbone")
    m, rest = divmod(program.train.global_batch, dp_lm * mb)
    assert rest == 0
    fixed = tuple(u.model_copy(update={
        "layers_per_stage": split_layers(program.module(u.name).arch.pipeline_layers, u.pp)
        if u.role != "generator" or u.pp > 1 else (1,) * u.pp,   # a DiT's split blocks
        "microbatch_share": dp_lm / u.dp}) for u in base.units)
    return base.model_copy(update={"units": fixed, "global_batch": program.train.global_batch,
                                   "micro_batch": mb, "num_microbatches": m})


@cache
def reference(program: ir.Program, steps: int = STEPS
              ) -> tuple[list[float], dict[str, tuple[torch.Tensor, ...]]]:
    """The reference's losses over ``steps``, and per parameter its (initial, final)
    values: run once a test run (``tests.helpers.shared``)."""
    def make() -> tuple[dict[str, torch.Tensor], list[float]]:
        torch.set_num_threads(1)
        model = build_model(program)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses = [r["loss"] for r in train_reference(program, steps, model=model)]
        tensors = {}
        for n, p in model.named_parameters():
            tensors[f"init/{n.removeprefix('units.')}"] = init[n]
            tensors[f"final/{n.removeprefix('units.')}"] = p.detach().clone()
        return tensors, losses

    tensors, losses = shared.tensors_and_json(f"reference-{shared.digest(program, steps)}",
                                              make)
    names = [k.removeprefix("init/") for k in tensors if k.startswith("init/")]
    return losses, {n: (tensors[f"init/{n}"], tensors[f"final/{n}"]) for n in names}


def _split_as_planned(ex: StageExecutor) -> None:
    """Under zero_bubble, the backbone's backwards ran as a B and a W (train.zerobubble);
    on the first stage a microbatch with no received rows to send gradients to (text
    only, a co-located encoder's) runs whole in its W."""
    if ex.split.split and ex.role.role == "backbone":
        ran = ex.split.ran
        assert set(ran) == {"split"} or (ex.role.stage == 0 and set(ran) <= {"split", "in W"}
                                         ), (ex.role, ran)


def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict[str, torch.Tensor], metrics: str, steps: int) -> None:
    groups = build_groups(plan)
    schedule = lower(plan, program)
    ex = StageExecutor(program, plan, schedule, rank=rank, groups=groups)
    assert ex.p2p.check     # every transfer is checked against NCCL's in-order matching
    results = ex.train(steps, metrics_path=metrics)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    _split_as_planned(ex)
    # Every action of the stage is in the measured events, in order (SYNC and OPT are
    # the last actions, and the last events).
    actions = schedule.stage(ex.role.unit, ex.role.stage).actions
    events = results[-1]["events"]
    assert [(e.kind, e.microbatch, e.chunk) for e in events] == \
        [(a.kind.value, a.microbatch, a.chunk) for a in actions]
    assert all(0 <= e.start_s <= e.end_s for e in events)
    # The whole timeline reaches rank 0 only.
    timeline = gather_timeline(plan, steps - 1, events)
    assert (timeline is None) == (torch.distributed.get_rank() != 0)
    if timeline is not None:
        assert len(timeline.events) == sum(len(st.actions) * schedule.unit(st.unit).dp
                                           for st in schedule.stages)
        assert set(timeline.rows()) == {e.row for e in timeline.events}
    mine = ex.full_parameters()     # collective over the stage's ranks
    trains = {n: p.requires_grad for n, p in ex.named_parameters().items()}
    assert mine, "every stage holds parameters"
    for name, p in mine.items():
        init, want = params[name]
        if not trains[name]:
            assert torch.equal(p.detach(), want), name
            continue
        # Adam amplifies rounding where a gradient is near zero (the reference itself
        # moves by ~2e-4 between micro_batch 2 and 8), so compare the whole update.
        err = (p.detach() - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


def check(program: ir.Program, plan: Plan, steps: int = STEPS) -> None:
    losses, params = reference(program, steps)
    world = plan.gpus_used
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        run(_train, world, program, plan, losses, params, metrics, steps, timeout=180)
        with open(metrics) as f:
            lines = [json.loads(line) for line in f]
    assert [x["step"] for x in lines] == list(range(steps))
    for x, want in zip(lines, losses, strict=True):
        assert math.isclose(x["loss"], want, rel_tol=LOSS_RTOL)


def _train_tp(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
              params: dict[str, torch.Tensor], steps: int,
              norms: list[float] | None = None) -> None:
    groups = build_groups(plan)
    schedule = lower(plan, program)
    ex = StageExecutor(program, plan, schedule, rank=rank, groups=groups)
    results = ex.train(steps)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    _split_as_planned(ex)
    for r, want in zip(results, norms or (), strict=False):
        # Every gradient element counted once in the job's norm (TP shards, replicas).
        assert math.isclose(r["grad_norm"], want, rel_tol=LOSS_RTOL), (r["step"], want)
    timeline = gather_timeline(plan, steps - 1, results[-1]["events"])
    assert (timeline is None) == (rank != 0)
    if timeline is not None:
        assert len(timeline.events) == sum(len(st.actions) * schedule.unit(st.unit).dp
                                           for st in schedule.stages)
    local = ex.named_parameters()
    full = ex.full_parameters()     # collective over the TP group
    assert full.keys() == local.keys() and full
    if ex.role.grid.tp > 1:
        sharded = ex.stage.tp_sharded
        assert sharded, "nothing was sharded"
        for n in sharded:       # the DTensor's local shard: a slice of the full tensor
            assert local_tensor(local[n]).shape != full[n].shape, n
            assert not isinstance(full[n], DTensor), n
    for name, p in full.items():
        init, want = params[name]
        assert p.shape == want.shape, name
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


@cache
def reference_grad_norms(program: ir.Program, steps: int) -> list[float]:
    """The reference's global gradient norm (before clipping) at each of ``steps``: computed
    once a test run (``tests.helpers.shared``)."""
    def make() -> list[float]:
        torch.set_num_threads(1)
        return [r["grad_norm"] for r in train_reference(program, steps)]

    return shared.json_value(f"grad-norms-{shared.digest(program, steps)}", make)


def check_tp(program: ir.Program, plan: Plan, steps: int = TP_STEPS, *,
             grad_norms: bool = False) -> None:
    """``_train_tp`` of ``plan`` against the reference's losses and parameters (and
    gradient norms, with ``grad_norms``)."""
    losses, params = reference(program, steps)
    norms = reference_grad_norms(program, steps) if grad_norms else None
    run(_train_tp, plan.gpus_used, program, plan, losses, params, steps, norms, timeout=180)
