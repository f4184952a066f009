"""Single-process reference training: the losses every distributed layout must match.

Each step ``s`` (0, 1, ...) takes the global batch of a ``batch.SampleSource`` (by default
the spec's synthetic data, ``data.make_batch(program, s)``; a dataset's batches with
``dtdsl.feed.source.DatasetSource``), in position order,
computes the loss denominators over the whole batch (``models.multimodal.loss_normalizer``), runs
the batch in microbatches of ``train.micro_batch`` consecutive samples, accumulating
gradients (the microbatch losses are already divided by the global denominators, so
they are summed, not averaged), clips the global gradient norm to
``train.grad_clip`` (all trainable parameters together; 0 disables) and takes one
optimizer step: AdamW (or Adam) with the spec's betas, eps and weight decay, on every
trainable parameter (norms and biases decay too), at the learning rate of the spec's
schedule for that step (``train.lr.lr_at``: ``lr`` is the peak).

The step's loss is the sum of its microbatch losses, i.e. the loss of the whole global
batch; microbatching changes it only by floating-point rounding. An MoE backbone adds its
load-balancing loss to the LM loss: each MoE layer's over each sequence's tokens, times
``aux_loss_coef / global_batch`` (``models.moe.set_aux_weight``), so microbatching does
not change that term either. Everything runs in
fp32 on one device (CPU by default), whatever ``train.precision`` says: the reference a
bf16 or fp16 run is held against. fp16's loss scale has no counterpart here: scaling by a
power of two and unscaling change no number, and an fp32 step does not overflow, so the
reference never skips a step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from dtdsl.data.batch import SampleSource, SyntheticSource
from dtdsl.ir import program as ir
from dtdsl.models.moe import moe_blocks, take_aux_losses
from dtdsl.models.multimodal import Model, build_model, loss_normalizer, microbatch_loss
from dtdsl.train.lr import lr_at

__all__ = ["make_optimizer", "train_reference"]


def make_optimizer(program: ir.Program, model: Model) -> torch.optim.Optimizer:
    """The spec's optimizer over the model's trainable parameters."""
    opt = program.train.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    cls = torch.optim.AdamW if opt.name == "adamw" else torch.optim.Adam
    return cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
               weight_decay=opt.weight_decay, foreach=False)


def train_reference(program: ir.Program, steps: int, *, micro_batch: int | None = None,
                    seed: int | None = None, first_step: int = 0,
                    pad_to: int | None = None, device: str | torch.device = "cpu",
                    model: Model | None = None, source: SampleSource | None = None,
                    plan: Any = None) -> Iterator[dict[str, float | int]]:
    """Train ``steps`` steps, yielding ``{"step", "loss", "lm_loss", "gen_loss",
    "grad_norm"}`` after each (``loss = lm_loss + gen_loss``, each already normalised;
    ``grad_norm``: the global gradient norm before clipping).

    ``micro_batch`` overrides ``train.micro_batch`` (``global_batch`` runs the batch
    whole); ``seed`` the initialisation seed (default ``train.seed``); ``pad_to``
    pads every backbone sequence to a fixed length (e.g. ``seq_len``) instead of the
    microbatch's longest; ``model`` trains a given model (built here otherwise);
    ``source`` where the batches come from (default: the spec's synthetic data);
    ``plan``: the plan a ``sync = local_sgd`` run trains under (``_local_sgd_reference``;
    unused for synchronous DP, whose losses no plan changes)."""
    train = program.train
    mb = train.micro_batch if micro_batch is None else micro_batch
    if mb < 1:
        raise ValueError(f"micro_batch must be at least 1, not {mb}")
    if model is None:
        model = build_model(program, seed).to(device)
    model.train()
    source = source if source is not None else SyntheticSource(program)
    if train.sync.local:
        if plan is None:
            raise ValueError("sync = local_sgd: the reference needs the plan, whose data "
                             "parallelism and routing say which samples each replica "
                             "trains on")
        yield from _local_sgd_reference(program, plan, model, source, steps, first_step,
                                        pad_to)
        return
    optimizer = make_optimizer(program, model)
    params = [p for p in model.parameters() if p.requires_grad]
    blocks = moe_blocks(model)
    for step in range(first_step, first_step + steps):
        sizes = source.sizes(step)
        samples = [source.sample(step, i, sizes=sz) for i, sz in enumerate(sizes)]
        norm = loss_normalizer(model, samples)
        optimizer.zero_grad(set_to_none=True)
        total = lm = gen = 0.0
        for start in range(0, len(samples), mb):
            parts = microbatch_loss(model, samples[start:start + mb], norm, pad_to)
            if parts.total.requires_grad:   # else it reaches nothing that trains (a
                parts.total.backward()      # frozen backbone, and no image or target)
            # An MoE backbone's aux losses: their gradients joined the backward through
            # the layers' outputs (models.moe.MoE.layer_output); the LM loss reports them.
            aux = take_aux_losses(blocks)
            aux = 0.0 if aux is None else aux.item()
            total += parts.total.item() + aux
            lm += parts.lm_sum.item() / max(1, norm.text_tokens) + aux
            gen += parts.gen_sum.item() / max(1, norm.gen_targets)
        # A parameter the step did not reach (a generator when no sample of the batch has
        # a target) steps with a zero gradient, as in any data-parallel runtime (FSDP2
        # reduces zeros for it): Adam's moments decay and weight decay applies.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # The norm before clipping (an infinite limit clips nothing).
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, train.grad_clip if train.grad_clip > 0 else float("inf"), foreach=False)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(train.lr_schedule, train.optimizer.lr, train.steps, step)
        optimizer.step()
        yield {"step": step, "loss": total, "lm_loss": lm, "gen_loss": gen,
               "grad_norm": float(grad_norm)}


# ---- Local SGD ---------------------------------------------------------------------------

def _owners(program: ir.Program) -> dict[str, str]:
    """Each unit of the model -> the plan unit whose replicas hold it: a module itself, an
    encoder's projector its encoder, a generator's projector its generator (where the
    runtime builds them, ``train.stage``)."""
    out = {m.name: m.name for m in program.modules}
    for p in program.projectors:
        out[p.name] = p.source if p.target == program.backbone.name else p.target
    return out


def _view(base: Model, copies: list[Model], replica_of: dict[str, int],
          owners: dict[str, str]) -> Model:
    """``base`` with each unit taken from the copy of its owner's replica (shared
    parameters, so a backward reaches each replica's own)."""
    view = copy.copy(base)
    view._modules = dict(base._modules)
    view.units = torch.nn.ModuleDict({n: copies[replica_of[owners[n]]].units[n]
                                      for n in base.units})
    return view


def _local_sgd_reference(program: ir.Program, plan: Any, model: Model, source: SampleSource,
                         steps: int, first_step: int, pad_to: int | None
                         ) -> Iterator[dict[str, float | int]]:
    """``sync = local_sgd`` in one process (docs/language.md). Every plan unit of ``dp``
    DP ranks has ``dp / replica_dp`` copies (replicas; ``ir.Sync.replica_ranks``); a
    sample runs through the copy of each unit the plan's routing sends it to
    (``data.batch.route_batch``, as the runtime routes it: DP rank ``r`` is in replica
    ``r // replica_dp``, whose ranks' gradients FSDP2 sums), each
    copy's gradients times its unit's replica count step with an optimizer of its own
    after one job-wide clip (the root mean square over replicas, ``local_sgd.ReplicaScaled``),
    and every ``period`` steps each unit's copies synchronise (``ReferenceLocalSGD``).
    The penalty's norm is per unit here, per stage in the runtime: the two agree where
    each unit runs on one pipeline stage on ranks of its own."""
    from dtdsl.data.batch import route_batch
    from dtdsl.train.local_sgd import ReferenceLocalSGD, config_of, corrupt, corruption

    train = program.train
    if train.sync.interval_s is not None:
        raise ValueError("local_sgd(interval=...) synchronises by the replicas' clocks, "
                         "which one process does not have: give the reference a period")
    owners = _owners(program)
    ranks = {u.name: train.sync.replica_ranks(u.dp) for u in plan.units}
    dps = {u.name: u.dp // ranks[u.name] for u in plan.units}
    replicas = {n: dps.get(owners[n], 1) for n in model.units}
    copies = [model] + [copy.deepcopy(model) for _ in range(max(replicas.values()) - 1)]
    trained = {(n, r): [p for p in copies[r].units[n].parameters() if p.requires_grad]
               for n in model.units for r in range(replicas[n])}
    optimizers = [make_optimizer(program, c) for c in copies]
    for opt, r in zip(optimizers, range(len(copies)), strict=True):
        keep = {id(p) for (n, rr), ps in trained.items() if rr == r for p in ps}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
    cfg = config_of(train.sync)
    syncs = {n: ReferenceLocalSGD(trained[(n, 0)], cfg) for n in model.units
             if replicas[n] > 1 and trained[(n, 0)]}
    hook = corruption()
    blocks = [b for c in copies for b in moe_blocks(c)]
    policy = frozenset(train.reorder)
    work = None
    if policy:
        from dtdsl.cost.model import build_cost_model
        from dtdsl.reorder.workload import WorkModel

        work = WorkModel(build_cost_model(program))
    for step in range(first_step, first_step + steps):
        sizes = source.sizes(step)
        samples = [source.sample(step, i, sizes=sz) for i, sz in enumerate(sizes)]
        norm = loss_normalizer(model, samples)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        total = lm = gen = 0.0
        for micro in route_batch(plan, program, sizes, policy, work):
            groups: dict[tuple[int, ...], list[int]] = {}
            for k, i in enumerate(micro.sample_ids):
                key = tuple(micro.assignment[u.name][k] for u in plan.units)
                groups.setdefault(key, []).append(i)
            for key, ids in groups.items():
                replica_of = {u.name: r // ranks[u.name]
                              for u, r in zip(plan.units, key, strict=True)}
                replica_of.update({n: 0 for n in owners.values() if n not in replica_of})
                view = _view(model, copies, replica_of, owners)
                parts = microbatch_loss(view, [samples[i] for i in ids], norm, pad_to)
                if parts.total.requires_grad:
                    parts.total.backward()
                # An MoE backbone's aux losses, reported with the LM loss as
                # ``train_reference`` reports them (their gradients are in the backward).
                aux = take_aux_losses(blocks)
                aux = 0.0 if aux is None else aux.item()
                total += parts.total.item() + aux
                lm += parts.lm_sum.item() / max(1, norm.text_tokens) + aux
                gen += parts.gen_sum.item() / max(1, norm.gen_targets)
        grad_norm = _clip_replicas(trained, replicas, train.grad_clip)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr_at(train.lr_schedule, train.optimizer.lr, train.steps, step)
            opt.step()
        if (step + 1) % cfg.period == 0:
            for n, state in syncs.items():
                reps = [trained[(n, r)] for r in range(replicas[n])]
                if hook is not None and hook.applies(hook.replica, step) and \
                        hook.replica < replicas[n]:
                    corrupt(reps[hook.replica], state.anchor, hook.scale)
                state.sync(reps)
        yield {"step": step, "loss": total, "lm_loss": lm, "gen_loss": gen,
               "grad_norm": grad_norm}


def _clip_replicas(trained: dict[tuple[str, int], list[torch.Tensor]],
                   replicas: dict[str, int], grad_clip: float) -> float:
    """Scale each replica's gradients by its unit's replica count, then clip them all by
    one coefficient from the job-wide norm: the root mean square over each unit's
    replicas (``local_sgd.ReplicaScaled``, as the runtime computes it). Returns the norm."""
    sq = 0.0
    for (n, _), params in trained.items():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(replicas[n])
            sq += float(p.grad.double().pow(2).sum()) / replicas[n]
    norm = sq ** 0.5
    if grad_clip > 0:
        coefficient = min(1.0, grad_clip / (norm + 1e-6))
        for params in trained.values():
            for p in params:
                p.grad.mul_(coefficient)
    return norm
