"""Expert parallelism: an MoE block's experts sharded over an EP process group.

``ExpertParallelMoE(config, group)`` is ``models.moe.MoE`` holding ``experts / e`` of the
experts on each of the group's ``e`` ranks (rank ``r``: experts ``[r E/e, (r + 1) E/e)``,
the rows of the stacked ``w1``/``w3``/``w2``). The router, the shared expert and its gate
are replicated: every rank routes its own tokens. One forward:

1. **Counts**: the ranks all-gather their slots per expert ``[e, E]``. From it every rank
   knows the group's tokens (the aux loss and the capacity are the group's, so the block
   over ``e`` ranks equals one process running all their tokens, rank after rank), what
   it sends to each rank and what it receives from each.
2. **Capacity** (when set): an expert keeps the group's first ``capacity`` slots in
   (rank, token) order (``models.moe.keep_counts``); a rank sends only the slots kept, so
   dropped tokens cost no traffic, and every rank reports the group's drop count.
3. **Dispatch**: the kept slots' rows, sorted by expert then token, go to their experts'
   ranks in one ``all_to_all_single`` with split sizes; a rank regroups what it received
   (by source, then expert) by expert, runs its experts (``MoE.experts_forward``: grouped
   GEMM on CUDA, a loop on CPU) and puts the rows back in received order.
4. **Combine**: the inverse ``all_to_all_single`` returns each slot's output to the rank
   its token lives on, which weights and sums them in token order as the one-process block
   does.

Both all-to-alls are differentiable (the backward of one is the other with the splits
swapped), and so is the sum of router probabilities the aux loss reads (its backward sums
the gradients over the group). So the block computes, on every rank, the group's aux loss;
the gradients a backward leaves are those of the sum of the ranks' losses: an expert's on
its rank (every token's contribution; nothing to reduce over the EP group), the replicated
parameters' and the input's per rank, summed by the data-parallel reduction as usual. A rank
that adds ``aux / e`` to its loss makes the group's total loss count the aux loss once (the
one-process block's); under gradient averaging, add ``aux`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch import nn

from dtdsl.models.moe import MoE, MoEConfig, Routing

__all__ = ["EXPERT_PARAMS", "ExpertParallelMoE", "all_to_all", "apply_ep", "ep_conflicts",
           "expert_blocks", "full_parameters"]

# The stacked expert weights: what an EP rank holds a slice of and FSDP2 shards over the
# expert DP group (``parallel.fsdp.apply_fsdp``); every other parameter is replicated.
EXPERT_PARAMS = ("w1", "w3", "w2")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any) -> torch.Tensor:
    """Rows ``x`` sent ``in_splits[r]`` to rank ``r`` of ``group``, ``out_splits[r]``
    received from each; differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _AllReduce(torch.autograd.Function):
    """A sum over the group on every rank; backward: the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def ep_conflicts(config: MoEConfig, ep: int) -> list[str]:
    """What an EP degree ``ep`` cannot split (empty when it can)."""
    if config.experts % ep:
        return [f"{config.experts} experts over {ep} expert-parallel ranks"]
    return []


class ExpertParallelMoE(MoE):
    """The MoE block with its experts sharded over ``group`` (module docstring). Its
    parameters keep the one-process block's names; ``w1``/``w3``/``w2`` hold rows
    ``first_expert .. first_expert + local_experts - 1``."""

    def __init__(self, config: MoEConfig, group: Any = None):
        ep = dist.get_world_size(group)
        problems = ep_conflicts(config, ep)
        if problems:
            raise ValueError(f"expert parallelism cannot split {problems[0]}: give an EP "
                             f"degree that divides the expert count")
        rank = dist.get_rank(group)
        local = config.experts // ep
        super().__init__(config, first_expert=rank * local, local_experts=local)
        self.group = group
        self.ep = ep
        self.rank = rank

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(counts) for _ in range(self.ep)]
        dist.all_gather(parts, counts.contiguous(), group=self.group)
        return torch.stack(parts)

    def reduce_prob_sum(self, prob_sum: torch.Tensor) -> torch.Tensor:
        return _AllReduce.apply(prob_sum, self.group)

    def run_experts(self, x: torch.Tensor, routing: Routing, kept_counts: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.local_experts
        rows = self.kept_slots(routing, kept_counts[self.rank])
        # Per destination rank, what this rank sends; per source rank, what it receives.
        by_rank = kept_counts.reshape(self.ep, self.ep, n)   # [source, destination, expert]
        send = by_rank[self.rank].sum(1).tolist()
        mine = by_rank[:, self.rank]                          # [source, local expert]
        recv = mine.sum(1).tolist()
        received = all_to_all(x[rows // self.config.top_k], recv, send, self.group)
        # Received rows come by source, then expert: regroup them by expert (stably, so
        # each expert's rows stay in (source, token) order) and back after.
        expert = torch.repeat_interleave(torch.arange(n, device=x.device).repeat(self.ep),
                                         mine.reshape(-1))
        order = torch.argsort(expert, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        y = self.experts_forward(received[order], mine.sum(0))[inverse]
        back = all_to_all(y, send, recv, self.group)
        return self.scatter_slots(x, routing, rows, back)


def apply_ep(module: nn.Module, group: Any) -> list[ExpertParallelMoE]:
    """Replace every MoE block in ``module`` (a backbone stage's unit, on the meta device
    before anything is sharded or allocated) by an ``ExpertParallelMoE`` over ``group``,
    on the block's device, with the block's own settings (its aux loss weight, its
    initialisation scales); the new blocks, in module order. Their parameters keep the
    one-process names, their experts' rows placed by ``MoE.global_block``, so
    initialisation and checkpoint loading give each rank its experts' slice of the full
    tensors."""
    out = []
    for owner in list(module.modules()):
        for attr, child in list(owner.named_children()):
            if not isinstance(child, MoE) or isinstance(child, ExpertParallelMoE):
                continue
            with torch.device(child.w1.device):
                block = ExpertParallelMoE(child.config, group)
            for key in ("aux_weight", "param_init_std"):
                if key in child.__dict__:
                    setattr(block, key, child.__dict__[key])
            setattr(owner, attr, block)
            out.append(block)
    return out


def expert_blocks(module: nn.Module) -> list[ExpertParallelMoE]:
    """The expert-parallel MoE blocks in ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]


def full_parameters(module: nn.Module, named: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """Parameters ``named`` (of ``module``, by any names) as full single-process tensors,
    detached: a DTensor's ``full_tensor`` (collective over its mesh), and the stacked
    experts of an expert-parallel block in ``module`` (whose full tensor holds the EP
    rank's experts only) all-gathered over its EP group, in expert order. Collective over
    the stage's ranks."""
    groups = {id(getattr(b, n)): b.group for b in expert_blocks(module) for n in EXPERT_PARAMS}
    out = {}
    for key, p in named.items():
        full = getattr(p, "full_tensor", None)
        t = (full() if callable(full) else p).detach()
        group = groups.get(id(p))
        if group is not None:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
        out[key] = t
    return out
