"""Expert parallelism (``dtdsl.parallel.ep``) on gloo: the block over 2 and 4 EP ranks
equals the one-process block on all the ranks' tokens (outputs, router logits, aux loss,
capacity drops, gradients of every parameter and of the input), and dispatch conserves
tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtdsl.models import moe
from dtdsl.models.moe import MoE, MoEConfig, can_group
from dtdsl.parallel.ep import ExpertParallelMoE, ep_conflicts
from tests.dist import run
from tests.helpers.moe import check_conservation, integer_experts, label_experts, token_ids

TOL = 1e-5

CONFIGS = {
    "dropless-shared": MoEConfig(hidden=6, ffn=4, experts=8, top_k=2, norm_topk=False,
                                 shared_ffn=5, shared_gate=True),
    "norm-top3": MoEConfig(hidden=6, ffn=4, experts=4, top_k=3, norm_topk=True),
    "capacity-0.5": MoEConfig(hidden=6, ffn=4, experts=8, top_k=2, capacity_factor=0.5),
    # Aligned widths: the experts run through the grouped GEMM.
    "grouped-capacity-1": MoEConfig(hidden=8, ffn=4, experts=4, top_k=2, capacity_factor=1.0,
                                    shared_ffn=4, shared_gate=True),
    "capacity-1.25": MoEConfig(hidden=6, ffn=4, experts=4, top_k=2, norm_topk=False,
                               capacity_factor=1.25, shared_ffn=3),
}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=TOL)


def _tokens(world: int) -> list[int]:
    """Each rank's token count: uneven on purpose (the ranks' batches need not match),
    the last one tiny; in 4 ranks one has none."""
    return [7 + 3 * (world - r) for r in range(world - 1)] + [2 if world == 2 else 0]


def _groups(world: int, ep: int) -> Any:
    """This rank's EP group: ranks split into consecutive groups of ``ep``."""
    mine = None
    for start in range(0, world, ep):
        group = dist.new_group(list(range(start, start + ep)))
        if start <= dist.get_rank() < start + ep:
            mine = group
    return mine


def _check_ep(rank: int, world: int, name: str, ep: int) -> None:
    cfg = CONFIGS[name]
    group = _groups(world, ep)
    base = rank - rank % ep                  # the group's first rank
    sizes = _tokens(world)[base:base + ep]
    torch.manual_seed(0)
    full = MoE(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.5)
    torch.manual_seed(1 + base)
    x = torch.randn(sum(sizes), cfg.hidden)
    g = torch.randn(sum(sizes), cfg.hidden)

    xf = x.clone().requires_grad_()
    want = full(xf)
    ((want.out * g).sum() + want.aux_loss).backward()

    block = ExpertParallelMoE(cfg, group)
    me = rank - base
    lo, hi = block.first_expert, block.first_expert + block.local_experts
    assert (lo, hi) == (me * cfg.experts // ep, (me + 1) * cfg.experts // ep)
    state = {k: v[lo:hi] if k in ("w1", "w3", "w2") else v
             for k, v in full.state_dict().items()}
    block.load_state_dict(state, strict=True)
    start = sum(sizes[:me])
    rows = slice(start, start + sizes[me])
    xr = x[rows].clone().requires_grad_()
    got = block(xr)
    ((got.out * g[rows]).sum() + got.aux_loss / ep).backward()

    assert close(got.out, want.out[rows])
    assert close(got.router_logits, want.router_logits[rows])
    assert abs(got.aux_loss.item() - want.aux_loss.item()) <= TOL
    assert torch.equal(got.kept, want.kept[rows])
    assert got.dropped.item() == want.dropped.item()
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    if cfg.capacity_factor is not None and cfg.capacity_factor < 1:
        assert got.dropped.item() > 0
    assert close(xr.grad, xf.grad[rows])
    assert can_group(xr, block.w1, block.w3, block.w2) == (cfg.hidden == 8)
    for pname, p in block.named_parameters():
        ref = dict(full.named_parameters())[pname].grad
        grad = p.grad.clone()
        if pname in ("w1", "w3", "w2"):
            ref = ref[lo:hi]                 # experts: every token's gradient is here
        else:
            dist.all_reduce(grad, group=group)   # replicated: the ranks' parts sum up
        assert close(grad, ref), pname


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_ep_equals_one_process(name, world, ep):
    if ep_conflicts(CONFIGS[name], ep):
        pytest.skip("the EP degree does not divide the experts")
    run(_check_ep, world, name, ep, timeout=120)


def _check_conservation(rank: int, world: int, factor: float | None) -> None:
    calls: list = []
    moe.expert_ffn = integer_experts(calls)      # this child process's copy only
    cfg = MoEConfig(hidden=6, ffn=4, experts=2 * world, top_k=2, norm_topk=False,
                    capacity_factor=factor)
    torch.manual_seed(0)
    block = ExpertParallelMoE(cfg)
    label_experts(block)
    with torch.no_grad():
        block.router.weight.normal_()
        x = token_ids(9 + rank, cfg.hidden, first=100 * rank, seed=rank)
        got = block(x)
    kept = check_conservation(block, x, got)
    # Across the group: every kept slot was computed once, by its expert's rank.
    assert all(block.first_expert <= e < block.first_expert + block.local_experts
               for e, _ in calls)
    both: list = [None] * world
    dist.all_gather_object(both, (calls, kept))
    assert sorted(c for cs, _ in both for c in cs) == sorted(k for _, ks in both for k in ks)
    if factor is not None and factor < 1:
        assert got.dropped.item() > 0


@pytest.mark.parametrize("factor", [None, 0.5])
@pytest.mark.parametrize("world", [2, 4])
def test_ep_dispatch_conserves_tokens(world, factor):
    run(_check_conservation, world, factor, timeout=120)


def test_ep_degree_must_divide_the_experts():
    cfg = CONFIGS["norm-top3"]
    assert ep_conflicts(cfg, 3) == ["4 experts over 3 expert-parallel ranks"]
    assert ep_conflicts(cfg, 2) == []
