"""Mixture of experts in the cost model and the planner: active FLOPs, every expert's
memory, expert parallelism's memory and all-to-alls, ep in the search."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from dtdsl.cost import flops
from dtdsl.cost.model import (
    _BYTES_BF16,
    _COLLECTIVE_LATENCY_S,
    _PARAM_BYTES,
    build_cost_model,
)
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.models.multimodal import build_model
from dtdsl.planner import ep_choices, plan, plan_convex
from tests.helpers.moe import moe_spec
from tests.specs import ROOT

ARGS = {"tp": 1, "pp": 1, "vpp": 1, "depth": 1, "microbatches": 4, "share": 1.0}
MOE_30B = ROOT / "specs" / "moe_vl_30b.dt"


def _spec(text: str = ""):
    source = MOE_30B.read_text()
    if text:
        source = source.replace("  memory(*) <= 90%", "  memory(*) <= 90%\n  " + text)
    result = run_frontend(str(MOE_30B), source.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


@pytest.mark.parametrize("args", ["experts=4, top_k=2, expert_ffn=64",
                                  "experts=4, top_k=3, expert_ffn=64, moe_every=2, "
                                  "shared_experts=2"])
def test_parameters_are_the_models(args):
    p = moe_spec(args=args)
    llm = build_model(p).unit("llm")
    assert flops.module_params(p.backbone) == sum(x.numel() for x in llm.parameters())
    experts = sum(layer.mlp.w1.numel() * 3 for layer in llm.layers.values()
                  if hasattr(layer.mlp, "router"))
    assert flops.expert_params(p.backbone) == experts > 0


def test_flops_count_the_active_experts():
    # An MoE layer costs a token what a dense MLP of top_k x expert_ffn (+ the shared
    # expert) columns does, plus its router: the active parameters, not the held ones.
    p = moe_spec(args="experts=8, top_k=2, expert_ffn=64, shared_experts=1")
    arch = p.backbone.arch
    dense = arch.model_copy(update={"moe": None, "ffn": 2 * 64 + 64})
    router = 2 * arch.hidden * 8
    assert flops.transformer_layer_matmul_per_token(arch) == \
        flops.transformer_layer_matmul_per_token(dense) + router
    every = arch.model_copy(update={"moe": arch.moe.model_copy(update={"every": 2})})
    plain = arch.model_copy(update={"moe": None})
    assert flops.transformer_layer_matmul_per_token(every) == pytest.approx(
        (flops.transformer_layer_matmul_per_token(arch)
         + flops.transformer_layer_matmul_per_token(plain)) / 2)


@pytest.mark.parametrize("update", [{}, {"top_k": 3, "norm_topk": False, "experts": 8},
                                    {"shared_ffn": 128, "shared_gate": True}])
def test_activation_bytes_are_what_the_block_keeps(update):
    # The MoE block's tensors kept for backward (saved-tensor hooks, each storage once,
    # parameters left out), bf16, per token: its normed input's copy (priced as a dense
    # MLP's input) and _moe_block_bytes. Every slot is kept (dropless), so the sizes do
    # not depend on where the router sends the tokens.
    import torch

    from dtdsl.cost.unit import _moe_block_bytes
    from dtdsl.models.moe import MoE, moe_config

    arch = moe_spec().backbone.arch
    arch = arch.model_copy(update={"moe": arch.moe.model_copy(update=update)})
    torch.manual_seed(0)
    block = MoE(moe_config(arch)).to(torch.bfloat16)
    params = {t.untyped_storage().data_ptr() for t in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    batch, seq = 2, 96
    x = torch.randn(batch, seq, arch.hidden, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block.layer_forward(x, None)
    assert y.requires_grad
    # Beyond the tokens' bytes, each sequence's balance loss keeps its expert counts and
    # probabilities (fp32 rows of E) and its token count: per sequence, not per token.
    extra = sum(kept.values()) - batch * seq * (2 * arch.hidden + _moe_block_bytes(arch)[0])
    assert 0 <= extra <= batch * (2 * 4 * arch.moe.experts + 16)


def test_expert_parallelism_divides_the_experts_memory():
    cost = build_cost_model(moe_spec())
    llm = cost.unit("llm")
    two = cost.with_ep({"llm": 2}).unit("llm")
    assert (llm.ep, two.ep) == (1, 2) and cost.unit("vit").ep == 1
    assert two.held_params == llm.params - llm.expert_params / 2
    weight, grad, optim = _PARAM_BYTES[cost.program.train.precision]
    for dp in (2, 4):
        one_b = cost.memory_bytes(llm, dp=dp, **ARGS)
        two_b = cost.with_ep({"llm": 2}).memory_bytes(two, dp=dp, **ARGS)
        # Weights and gradients of half the experts; their optimizer state is the
        # experts' over dp either way (a rank's half, sharded over dp / 2).
        assert one_b - two_b == pytest.approx(llm.expert_params / 2 * (weight + grad))
        stage = cost.with_ep({"llm": 2}).stage_memory_bytes(
            two, tp=1, pp=1, dp=dp, vpp=1, stage=0, layers=llm.layers, depth=1,
            microbatches=4, share=1.0)
        assert stage == pytest.approx(two_b)
        # Without ZeRO the optimizer state is whole: the experts' halves too.
        assert optim > 0


def test_all_to_alls_are_priced_at_the_ep_groups_links():
    p = moe_spec()
    # A network slower than the node's links (the tiny spec's are equal).
    p = p.model_copy(update={"cluster": p.cluster.model_copy(
        update={"inter_node_bw_bytes_per_s": p.cluster.intra_node_bw_bytes_per_s / 4})})
    cost = build_cost_model(p)
    llm = cost.unit("llm")
    assert cost.ep_comm_time_s(llm, 1) == (0.0, 0.0)
    arch = cost.program.backbone.arch
    assert llm.ep_layers == 4
    assert llm.ep_elements > 0 and math.isclose(
        llm.ep_elements / flops.moe_dispatch_elements_per_token(arch),
        llm.cp_tokens)      # the microbatch's mean tokens
    cluster = cost.program.cluster
    assert cluster.gpus_per_node == 4
    data = 2 * llm.ep_elements * _BYTES_BF16     # dispatch and combine, bf16
    # One collective step's latency per all-to-all (all peers at once), 2 per MoE layer.
    latency = 2 * llm.ep_layers * _COLLECTIVE_LATENCY_S
    two = cost.with_ep({"llm": 2})
    fwd, bwd = two.ep_comm_time_s(two.unit("llm"), 1)
    assert fwd == bwd == pytest.approx(data / 2 / cluster.intra_node_bw_bytes_per_s + latency)
    # ep 4 at tp 1 fills the node: 3 of 4 shares over NVLink; at tp 2 the group spans
    # two nodes: the peer on the rank's node over NVLink, the two on the other over the
    # network at the same time (the network's share is the slower).
    four = cost.with_ep({"llm": 4})
    assert four.ep_comm_time_s(four.unit("llm"), 1)[0] == pytest.approx(
        data * 3 / 4 / cluster.intra_node_bw_bytes_per_s + latency)
    assert four.ep_comm_time_s(four.unit("llm"), 2)[0] == pytest.approx(
        data * 2 / 4 / cluster.inter_node_bw_bytes_per_s + latency)
    # On top of the compute (whose experts run faster at ep 2: test_expert_gemms_*).
    held = two.unit("llm")
    assert held.recompute is ir.Recompute.NONE
    compute = two.compute_time_s(held, 1)
    assert two.fwd_bwd_time_s(held, 1) == pytest.approx(
        (compute + fwd, held.backward_factor * compute
         + two.expert_backward_extra_s(held, 1) + bwd))
    frozen = replace(two.unit("llm"), backward_factor=0.0)
    assert two.ep_comm_time_s(frozen, 1)[1] == 0.0
    # At tp 2 every TP rank routes the whole sequence and sends all its routed rows.
    assert two.ep_comm_time_s(two.unit("llm"), 2) == pytest.approx((fwd, bwd))


def test_the_router_runs_whole_on_every_tp_rank():
    # TP divides the experts' GEMMs; each TP rank runs the router (h x E per token and
    # MoE layer) on the whole sequence (models.moe, "Tensor parallelism").
    cost = build_cost_model(moe_spec())
    llm = cost.unit("llm")
    arch = cost.program.backbone.arch
    assert llm.tp_whole_matmul == pytest.approx(
        llm.cp_tokens * llm.ep_layers * 2 * arch.hidden * arch.moe.experts)
    whole_s = llm.tp_whole_matmul / cost.params.efficiency.matmul / cost.peak_flops
    assert cost.compute_time_s(llm, 2) == pytest.approx(
        cost.compute_time_s(llm, 1) / 2 + whole_s / 2)
    dense = replace(llm, tp_whole_matmul=0.0)
    assert cost.compute_time_s(dense, 2) == pytest.approx(cost.compute_time_s(dense, 1) / 2)


def test_ep_choices_follow_the_constraints():
    assert ep_choices(build_cost_model(_spec())) == [
        (", ep llm=2", {"vit": 1, "llm": 2}), (", ep llm=4", {"vit": 1, "llm": 4}),
        (", ep llm=8", {"vit": 1, "llm": 8})]
    # Without an ep constraint: ep 1 only, nothing more to search.
    assert ep_choices(build_cost_model(moe_spec())) == []


def test_the_shipped_moe_spec_is_30b_with_3b_active():
    program = _spec()
    arch = program.backbone.arch
    assert (arch.moe.experts, arch.moe.top_k, arch.moe.ffn) == (128, 8, 768)
    assert program.constraints_for("llm").ep.candidates(8) == (1, 2, 4, 8)
    assert 29e9 < flops.module_params(program.backbone) < 32e9
    # Active per token: attention and the router, 8 experts of 768 columns (2 FLOPs a
    # multiply-accumulate), embedding and head aside.
    active = flops.transformer_layer_matmul_per_token(arch) / 2 * arch.layers
    assert 1.5e9 < active < 2.5e9


def test_a_pinned_ep_is_planned():
    cost = build_cost_model(_spec("ep(llm) == 2"))
    unit = plan(cost, compare_baseline=False).unit("llm")
    assert unit.ep == 2 and unit.dp % 2 == 0
    convex = plan_convex(cost.with_ep({"llm": 4}))
    assert convex.unit("llm").ep == 4 and convex.unit("llm").dp % 4 == 0


def test_expert_gemms_run_faster_with_more_rows_per_expert():
    # The shipped spec's experts get ~150 rows each per microbatch at ep 1 (128 experts, 8
    # per token): short GEMMs that stream the weights (cost.gemm). EP gives each local
    # expert ep times the rows: the same FLOPs, run faster. The forward's extra is the
    # experts' FLOPs at the rule's slowdown; the backward's input and weight gradients
    # at theirs (expert_backward_extra_s).
    cost = build_cost_model(_spec())
    llm = cost.unit("llm")
    arch = cost.program.backbone.arch
    assert llm.expert_rows == pytest.approx(llm.cp_tokens * 8 / 128)
    assert llm.expert_dims == (2048, 768)
    assert llm.expert_matmul == pytest.approx(
        llm.cp_tokens * 48 * 8 * 2 * 3 * arch.hidden * arch.moe.ffn)
    eff = cost.params.efficiency.matmul
    plain = cost.compute_time_s(replace(llm, expert_matmul=0.0), 2)
    fwd, dgrad, wgrad = cost.expert_gemm_slowdown(llm, 2)
    assert fwd > 1.4 and wgrad > 1.3 and fwd == dgrad
    base = llm.expert_matmul / eff / (cost.peak_flops * 2)
    assert cost.compute_time_s(llm, 2) == pytest.approx(plain + base * (fwd - 1))
    assert cost.expert_backward_extra_s(llm, 2) == pytest.approx(base * (wgrad - fwd))
    times = [cost.with_ep({"llm": ep}).compute_time_s(
        cost.with_ep({"llm": ep}).unit("llm"), 2) for ep in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[0] > 1.25 * times[-1] > plain


def _expert_share(program, tp: int = 2) -> list[float]:
    """The backbone's forward compute at ep 1, 2, 4, 8 over the same without the expert
    GEMM rule (its experts' FLOPs at the large-GEMM rate)."""
    cost = build_cost_model(program)
    plain = cost.compute_time_s(replace(cost.unit("llm"), expert_matmul=0.0), tp)
    return [cost.with_ep({"llm": ep}).compute_time_s(cost.with_ep({"llm": ep}).unit("llm"),
                                                      tp) / plain for ep in (1, 2, 4, 8)]


def test_few_wide_experts_barely_change():
    # Mixtral-like: 8 experts of 14336 columns, 2 per token: each expert gets a quarter of
    # the microbatch's tokens (~500 rows), compute-bound GEMMs, so the rule adds about
    # half a 128-row tile (~10%) at ep 1 and EP wins little back; the shipped spec's 128
    # experts (~130 rows each at ep 1) are memory-bound and ep 8 wins back ~50%.
    text = MOE_30B.read_text().replace(
        "hidden=2048, heads=32, kv_heads=4, ffn=6144, vocab=151936, swiglu,\n"
        "                       experts=128, top_k=8, expert_ffn=768",
        "hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, swiglu,\n"
        "                       experts=8, top_k=2, expert_ffn=14336")
    result = run_frontend(str(MOE_30B), text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    llm = build_cost_model(result.program).unit("llm")
    assert llm.expert_rows == pytest.approx(llm.cp_tokens / 4) and llm.expert_rows > 500
    wide, fine = _expert_share(result.program), _expert_share(_spec())
    assert wide == sorted(wide, reverse=True) and fine == sorted(fine, reverse=True)
    assert 1.0 < wide[-1] < wide[0] < 1.12
    assert fine[0] > 1.4 and fine[-1] < 1.05
    assert wide[0] - wide[-1] < (fine[0] - fine[-1]) / 5


def test_the_shipped_moe_spec_plans_expert_parallelism():
    # Issue 31: the shipped MoE spec's plan uses EP (its comment says why: at 4,096-token
    # sequences ep 8 at tp 1 beats ep 1's tp 2 and 16 stages).
    chosen = plan(build_cost_model(_spec()), compare_baseline=False).unit("llm")
    assert chosen.ep > 1 and chosen.dp % chosen.ep == 0
