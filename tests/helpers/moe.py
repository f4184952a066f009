"""MoE tests' shared parts: the tiny spec with an MoE backbone, token inputs, experts
that label or count what they receive, and the token-conservation check."""

from __future__ import annotations

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.moe import MoE
from tests.helpers.runs import plan_for
from tests.specs import TINY, program


def integer_experts(calls: list) -> callable:
    """An ``expert_ffn`` whose expert ``e`` maps a row whose first entry is the token id
    ``t`` to a row of ``1000 (e + 1) + t``: exact in fp32, and it says who computed what.
    ``e`` is read from ``w1[:, 0, 0]`` (``label_experts``); each (expert, token) pair
    computed is appended to ``calls``."""
    def ffn(x, sizes, w1, w3, w2, act):
        assert int(sizes.sum()) == x.shape[0] and sizes.numel() == w1.shape[0]
        expert = torch.repeat_interleave(w1[:, 0, 0].detach(), sizes)
        calls.extend(zip(expert.long().tolist(), x[:, 0].long().tolist(), strict=True))
        value = 1000.0 * (expert + 1) + x[:, 0]
        return value[:, None].expand(-1, w2.shape[1]) + 0.0 * w2.sum()
    return ffn



def label_experts(block: MoE) -> None:
    """``w1[e, 0, 0]`` = the global index of the block's expert ``e``."""
    with torch.no_grad():
        block.w1[:, 0, 0] = torch.arange(block.first_expert,
                                         block.first_expert + block.local_experts)



def check_conservation(block: MoE, x: torch.Tensor, got) -> list[tuple[int, int]]:
    """The output of each token is its kept slots' expert values, each once, weighted:
    ``out[t] = sum_j kept w[t, j] (1000 (e_tj + 1) + id_t)``. Returns the (expert, id)
    pairs of the kept slots."""
    cfg = block.config
    x2 = x.reshape(-1, cfg.hidden)
    routing = block.route(x2)
    value = 1000.0 * (routing.experts + 1) + x2[:, :1]
    want = (routing.weights * value * got.kept).sum(-1)
    out = got.out.reshape(-1, cfg.hidden)
    assert torch.allclose(out, want[:, None].expand_as(out), rtol=1e-6, atol=0)
    ids = x2[:, 0].long()
    return [(int(routing.experts[t, j]), int(ids[t])) for t in range(x2.shape[0])
            for j in range(cfg.top_k) if got.kept[t, j]]



def token_ids(tokens: int, hidden: int, first: int = 0, seed: int = 0) -> torch.Tensor:
    """Random rows whose first entries are the ids ``first, first + 1, ...``."""
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden)
    x[:, 0] = torch.arange(first, first + tokens, dtype=x.dtype)
    return x


def moe_spec(batch: int = 8, args: str = "experts=4, top_k=2, expert_ffn=64", *,
             two_lengths: bool = False) -> ir.Program:
    """tiny_cpu.dt with an MoE backbone and a global batch of ``batch``; ``two_lengths``:
    its text lengths ``tests.helpers.runs.TEXT_TOKENS``' two (fewer microbatch widths for
    DTensor's sharding propagation to pay for under tensor parallelism)."""
    text = TINY.read_text()
    assert _DENSE in text
    if two_lengths:
        from tests.helpers.runs import TEXT_TOKENS

        assert TEXT_TOKENS[0] in text
        text = text.replace(*TEXT_TOKENS)
    p = program(text.replace(_DENSE, _DENSE[:-1] + ", " + args + ")"))
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})


_DENSE = "ffn=256, vocab=512, swiglu)"


STEPS = 8


ARGS = "experts=4, top_k=2, expert_ffn=64, aux_loss=0.1"


def with_ep(plan: Plan, ep: int) -> Plan:
    """``plan`` with expert parallelism ``ep`` on its backbone."""
    units = tuple(u.model_copy(update={"ep": ep}) if u.role == "backbone" else u
                  for u in plan.units)
    return plan.model_copy(update={"units": units})


def ep_plan(p: ir.Program, dp: int, pp: int, ep: int, tp: int = 1) -> Plan:
    """The tiny spec's plan with the backbone at ``tp`` x ``dp`` x ``pp`` and ``ep``."""
    return with_ep(plan_for(p, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, dp, pp),
                            ("gen", "generator", 1, 1, 1)), ep)
