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

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtdsl.models.moe import MoE, MoEConfig, Routing

__all__ = ["EXPERT_PARAMS", "ExpertParallelMoE", "all_to_all", "apply_ep", "ep_conflicts",
           "expert_blocks", "expert_layout", "full_parameters", "global_experts",
           "local_experts"]

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
        # Assumed sizes (``models.moe.assumed_kept``, lists: fake tensors' values are
        # unknown): the same arithmetic on a tensor made here, in the fake mode.
        assumed = isinstance(kept_counts, list)
        counts = torch.tensor(kept_counts, device=x.device) if assumed else kept_counts
        # Per destination rank, what this rank sends; per source rank, what it receives.
        by_rank = counts.reshape(self.ep, self.ep, n)   # [source, destination, expert]
        mine = by_rank[:, self.rank]                          # [source, local expert]
        if assumed:
            send = [sum(kept_counts[self.rank][d * n:(d + 1) * n]) for d in range(self.ep)]
            recv = [sum(c[self.rank * n:(self.rank + 1) * n]) for c in kept_counts]
        else:
            send = by_rank[self.rank].sum(1).tolist()
            recv = mine.sum(1).tolist()
        # Received rows come by source, then expert: regroup them by expert (stably, so
        # each expert's rows stay in (source, token) order) and back after.
        expert = torch.tensor([e for c in kept_counts for e in range(n)
                               for _ in range(c[self.rank * n + e])], device=x.device) \
            if assumed else torch.repeat_interleave(
                torch.arange(n, device=x.device).repeat(self.ep), mine.reshape(-1))
        order = torch.argsort(expert, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        sizes = [sum(c[self.rank * n + e] for c in kept_counts) for e in range(n)] \
            if assumed else mine.sum(0)
        # No name holds a buffer the next step no longer needs (the rows as received,
        # the outputs before they go back): the block's peak is the one-process block's.
        received = all_to_all(x[rows // self.config.top_k], recv, send, self.group)[order]
        back = all_to_all(self.experts_forward(received, sizes)[inverse], send, recv,
                          self.group)
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


# ---- checkpoints: the experts under their single-process names and shapes ----------------


def expert_layout(ep: Any, dp_ranks: Sequence[int]) -> Any:
    """The DeviceMesh ``(ep, ep_dp)`` over a stage's DP ranks ``dp_ranks`` (replica order,
    at this rank's TP index) under expert parallelism (``ep``: its
    ``parallel.mesh.ExpertGroups``), ``(ep, ep_dp, tp)`` where the experts are split over
    TP too: column ``j`` the EP group of replicas ``j ep .. j ep + ep - 1``, row ``i`` the
    expert DP group of EP rank ``i``. A stacked expert weight is ``Shard(0)`` over ``ep``
    (EP rank ``i``: experts ``[i E/ep, (i + 1) E/ep)``), then as FSDP2 holds it over
    ``ep_dp``, then its TP split: so a rank's block has its offset in the full ``[E, ...]``
    tensor. Under Local SGD (``ExpertGroups.replicas``) the mesh is over this rank's
    replica only: every replica holds (and saves) all the experts. Made from the groups
    there are (no collective, no new group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    e, tp = ep.degree, ep.mesh["tp"]
    t, index = tp.size(), tp.get_local_rank()
    span = e * dist.get_world_size(ep.dp_group)      # the replica's DP ranks (all of dp)
    at = list(dp_ranks).index(dist.get_rank())
    dp_ranks = dp_ranks[at - at % span:at - at % span + span]
    table = torch.tensor([[r - index + i for i in range(t)] for r in dp_ranks],
                         dtype=torch.int).reshape(-1, e, t).transpose(0, 1).contiguous()
    if t == 1:
        return DeviceMesh.from_group([ep.group, ep.dp_group], ep.mesh.device_type,
                                     mesh=table[..., 0], mesh_dim_names=("ep", "ep_dp"))
    return DeviceMesh.from_group([ep.group, ep.dp_group, tp.get_group()],
                                 ep.mesh.device_type, mesh=table,
                                 mesh_dim_names=("ep", "ep_dp", "tp"))


def _expert_keys(module: nn.Module) -> dict[str, tuple[ExpertParallelMoE, str]]:
    """The state-dict key (``get_state_dict``'s: wrappers' prefixes left out) of every
    stacked expert weight of ``module``'s expert-parallel blocks -> (block, attribute)."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, ExpertParallelMoE):
            clean = name.replace("_checkpoint_wrapped_module.", "").replace(
                "_fsdp_wrapped_module.", "")
            out.update({f"{clean}.{attr}": (m, attr) for attr in EXPERT_PARAMS})
    return out


def _entries(state: dict[str, Any], key: str) -> list[tuple[dict[str, Any], str]]:
    """Where ``state`` (``train.checkpoint.state_dict``'s) holds tensors shaped as
    parameter ``key``: the model's entry and its Adam moments; under Local SGD its anchor,
    outer momentum and each replica's copy and moments (``train.local_sgd.StageSync.
    state_dict``'s keys, named as the stage names parameters: ``units.`` left out)."""
    out = [(state["model"], key)] if key in state.get("model", {}) else []
    moments = {}
    if key in state.get("optim", {}):
        # A copy: ``Optimizer.state_dict`` hands out the live per-parameter dicts, and
        # the optimizer must keep its own tensors when training goes on after a save.
        state["optim"][key] = moments = dict(state["optim"][key])
    out += [(moments, k) for k in ("exp_avg", "exp_avg_sq") if k in moments]
    local = state.get("local_sgd", {})
    name = key.removeprefix("units.")
    for k in local:
        head, _, rest = k.partition(".")
        if rest == name and (head in ("anchor", "momentum") or head.startswith("replica")) \
                or head.startswith("replica") and rest in (f"optim.{name}.exp_avg",
                                                          f"optim.{name}.exp_avg_sq"):
            out.append((local, k))
    return out


def global_experts(state: dict[str, Any], module: nn.Module, layout: Any) -> None:
    """Make ``state``'s stacked expert weights of ``module`` (and their Adam moments),
    which FSDP2 holds as DTensors of this EP rank's experts only (the same name and
    shape on every EP rank, different values), DTensors of the full ``[E, ...]``
    tensor on ``layout`` (``expert_layout``) sharing their storage: a checkpoint then
    holds each expert once under the single-process name, and DCP reshards it to any
    EP degree (ep 1 included) on load. In place."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for key, (block, attr) in _expert_keys(module).items():
        split = getattr(getattr(block, attr), "placements", ())
        tp = [pl for pl in split if pl.is_shard() and pl.dim > 0]     # its TP split
        for holder, k in _entries(state, key):
            t = holder[k]
            local = t.to_local() if isinstance(t, DTensor) else t
            shape = (block.config.experts, *t.shape[1:])
            sharded = local.shape[0] != t.shape[0]      # FSDP2 shards over ep_dp
            holder[k] = DTensor.from_local(
                local, layout, [Shard(0), Shard(0) if sharded else Replicate(), *tp],
                run_check=False, shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride())


def local_experts(state: dict[str, Any], module: nn.Module) -> None:
    """Undo ``global_experts`` (after DCP loaded into the shared storage): each entry
    back on its parameter's own mesh and placements, as ``set_state_dict`` expects. In
    place."""
    from torch.distributed.tensor import DTensor

    for key, (block, attr) in _expert_keys(module).items():
        param = getattr(block, attr)
        for holder, k in _entries(state, key):
            t = holder[k]
            if isinstance(t, DTensor) and isinstance(param, DTensor) and \
                    t.device_mesh is not param.device_mesh:
                holder[k] = DTensor.from_local(t.to_local(), param.device_mesh,
                                               param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
