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

from dtdsl.models.moe import MoE, MoEConfig, Routing

__all__ = ["ExpertParallelMoE", "all_to_all", "ep_conflicts"]


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
