"""Single-process reference training: the losses every distributed layout must match.

Each step ``s`` (0, 1, ...) takes the global batch of a ``batch.SampleSource`` (by default
the spec's synthetic data, ``data.make_batch(program, s)``; a dataset's batches with
``dtdsl.feed.source.DatasetSource``), in position order,
computes the loss denominators over the whole batch (``model.loss_normalizer``), runs
the batch in microbatches of ``train.micro_batch`` consecutive samples, accumulating
gradients (the microbatch losses are already divided by the global denominators, so
they are summed, not averaged), clips the global gradient norm to
``train.grad_clip`` (all trainable parameters together; 0 disables) and takes one
optimizer step: AdamW (or Adam) with the spec's betas, eps and weight decay, on every
trainable parameter (norms and biases decay too), at the learning rate of the spec's
schedule for that step (``train.lr.lr_at``: ``lr`` is the peak).

The step's loss is the sum of its microbatch losses, i.e. the loss of the whole global
batch; microbatching changes it only by floating-point rounding. An MoE backbone adds its
load-balancing loss to the LM loss: each MoE layer's over each microbatch's tokens, times
``aux_loss_coef / num_microbatches`` (``models.moe.set_aux_weight``), so a different
``micro_batch`` changes that term. Everything runs in
fp32 on one device (CPU by default), whatever ``train.precision`` says: the reference a
bf16 or fp16 run is held against. fp16's loss scale has no counterpart here: scaling by a
power of two and unscaling change no number, and an fp32 step does not overflow, so the
reference never skips a step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dtdsl.data.batch import SampleSource, SyntheticSource
from dtdsl.ir import program as ir
from dtdsl.models.moe import take_aux_losses
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
                    model: Model | None = None, source: SampleSource | None = None
                    ) -> Iterator[dict[str, float | int]]:
    """Train ``steps`` steps, yielding ``{"step", "loss", "lm_loss", "gen_loss",
    "grad_norm"}`` after each (``loss = lm_loss + gen_loss``, each already normalised;
    ``grad_norm``: the global gradient norm before clipping).

    ``micro_batch`` overrides ``train.micro_batch`` (``global_batch`` runs the batch
    whole); ``seed`` the initialisation seed (default ``train.seed``); ``pad_to``
    pads every backbone sequence to a fixed length (e.g. ``seq_len``) instead of the
    microbatch's longest; ``model`` trains a given model (built here otherwise);
    ``source`` where the batches come from (default: the spec's synthetic data)."""
    train = program.train
    mb = train.micro_batch if micro_batch is None else micro_batch
    if mb < 1:
        raise ValueError(f"micro_batch must be at least 1, not {mb}")
    if model is None:
        model = build_model(program, seed).to(device)
    model.train()
    optimizer = make_optimizer(program, model)
    params = [p for p in model.parameters() if p.requires_grad]
    source = source if source is not None else SyntheticSource(program)
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
            aux = take_aux_losses(model)
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
