"""Context parallelism in the cost model: work, activations and the CP collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtdsl.cost import flops
from dtdsl.cost.model import _BYTES_BF16, _COLLECTIVE_LATENCY_S, build_cost_model
from tests.helpers.costs import program

ARGS = {"tp": 4, "pp": 4, "vpp": 1, "depth": 4, "microbatches": 32, "share": 1.0}


def _method(method: str):
    return program("mllm_9b", (("swiglu)", f"swiglu)\n    context_parallel = {method}"),))


@pytest.fixture(scope="module")
def ring():
    return build_cost_model(_method("ring"))


def test_cp_fields_come_from_the_spec(ring):
    llm = ring.unit("llm")
    assert llm.cp == 1 and llm.cp_method == "ring"
    arch = ring.program.backbone.arch
    assert llm.cp_q_width == arch.hidden
    assert llm.cp_kv_width == arch.hidden * arch.kv_heads / arch.heads
    assert llm.cp_tokens > 0
    assert build_cost_model(_method("ulysses")).unit("llm").cp_method == "ulysses"


def test_activations_split_over_cp(ring):
    llm = ring.unit("llm")
    two = ring.with_cp({"llm": 2}).unit("llm")
    assert two.cp == 2 and ring.unit("vit").cp == 1
    static = ring.memory_bytes(replace(llm, act_bytes_per_layer=0.0,
                                       act_bytes_per_layer_tp_split=0.0), dp=8, **ARGS)
    whole = ring.memory_bytes(llm, dp=8, **ARGS) - static
    # dp 4 x cp 2 shards the optimizer state as dp 8 does: the rest is activations / 2.
    halved = ring.memory_bytes(two, dp=4, **ARGS) - static
    logits = ring.logits_bytes(4) - ring.logits_bytes(4, 2)
    assert halved == pytest.approx(whole / 2 - logits, rel=1e-9)


def test_compute_splits_over_cp_and_gradients_sync_over_dp_x_cp(ring):
    llm = ring.unit("llm")
    two = ring.with_cp({"llm": 2}).unit("llm")
    assert ring.compute_time_s(two, 4) == pytest.approx(ring.compute_time_s(llm, 4) / 2)
    assert ring.tp_comm_time_s(two, 4) < ring.tp_comm_time_s(llm, 4)
    # With compute that hides what it can either way, dp 4 x cp 2 syncs as dp 8 does.
    slow = replace(llm, fwd_work=flops.Work(matmul=llm.fwd_work.matmul * 1e6))
    for k in (0, 1):
        assert ring.dp_sync_coefficients(replace(slow, cp=2), 4, 4)[k] == \
            pytest.approx(ring.dp_sync_coefficients(slow, 4, 8)[k])
    assert ring.dp_sync_coefficients(replace(slow, cp=2), 4, 4)[0] != \
        pytest.approx(ring.dp_sync_coefficients(slow, 4, 4)[0])


def test_ring_sends_kv_blocks_behind_the_attention(ring):
    llm = ring.unit("llm")
    cluster = ring.program.cluster
    c, tp = 4, 2
    unit = replace(llm, cp=c)
    fwd, bwd = ring.cp_comm_time_s(unit, tp)
    block = 2 * llm.cp_tokens / c * llm.cp_kv_width / tp * _BYTES_BF16
    send = block / cluster.intra_node_bw_bytes_per_s + _COLLECTIVE_LATENCY_S
    attend = ring._attention_layer_s(unit, tp) / c
    assert fwd == pytest.approx(llm.layers * (c - 1) * max(0.0, send - attend))
    assert bwd == pytest.approx(llm.layers * (c - 1) *
                                max(0.0, 2 * send - llm.backward_factor * attend))
    # Slow links expose the sends; compute hides them where the blocks are large enough.
    slow = replace(ring, program=ring.program.model_copy(update={"cluster": cluster.model_copy(
        update={"intra_node_bw_bytes_per_s": 1e6, "inter_node_bw_bytes_per_s": 1e6})}))
    assert slow.cp_comm_time_s(unit, tp)[0] > 0
    assert ring.cp_comm_time_s(llm, tp) == (0.0, 0.0)


def test_ring_across_nodes_uses_the_network(ring):
    llm = ring.unit("llm")
    cluster = ring.program.cluster
    slow = replace(ring, program=ring.program.model_copy(update={"cluster": cluster.model_copy(
        update={"intra_node_bw_bytes_per_s": 1e9, "inter_node_bw_bytes_per_s": 1e7})}))
    inside = slow.cp_comm_time_s(replace(llm, cp=4), 2)[0]       # 8 ranks: one node
    across = slow.cp_comm_time_s(replace(llm, cp=8), 2)[0]       # 16 ranks: two nodes
    assert across > 50 * inside


def test_ulysses_all_to_alls_on_the_right_link():
    cost = build_cost_model(_method("ulysses"))
    llm = cost.unit("llm")
    cluster = cost.program.cluster
    tp, c = 2, 4
    fwd, bwd = cost.cp_comm_time_s(replace(llm, cp=c), tp)
    elements = llm.cp_tokens / c * (2 * llm.cp_q_width + 2 * llm.cp_kv_width) / tp
    one = elements * _BYTES_BF16 * (c - 1) / c / cluster.intra_node_bw_bytes_per_s + \
        4 * (c - 1) * _COLLECTIVE_LATENCY_S
    assert fwd == pytest.approx(llm.layers * one) and bwd == pytest.approx(fwd)
    # tp 4 x Ulysses 4 spans two nodes of 8: the network's bandwidth.
    far = cost.cp_comm_time_s(replace(llm, cp=c), 4)[0]
    elements = llm.cp_tokens / c * (2 * llm.cp_q_width + 2 * llm.cp_kv_width) / 4
    assert far == pytest.approx(llm.layers * (
        elements * _BYTES_BF16 * (c - 1) / c / cluster.inter_node_bw_bytes_per_s +
        4 * (c - 1) * _COLLECTIVE_LATENCY_S))


def test_hybrid_is_ulysses_inside_a_node_and_ring_across():
    cost = build_cost_model(_method("hybrid"))
    llm = cost.unit("llm")
    cluster = cost.program.cluster
    # tp 2, cp 8 on nodes of 8: Ulysses over 4 (8 ranks, NVLink), a ring of 2 across nodes.
    tp, c, u, r = 2, 8, 4, 2
    unit = replace(llm, cp=c)
    fwd, _ = cost.cp_comm_time_s(unit, tp)
    elements = llm.cp_tokens / c * (2 * llm.cp_q_width + 2 * llm.cp_kv_width) / tp
    uly = elements * _BYTES_BF16 * (u - 1) / u / cluster.intra_node_bw_bytes_per_s + \
        4 * (u - 1) * _COLLECTIVE_LATENCY_S
    block = 2 * llm.cp_tokens / r * llm.cp_kv_width / (tp * u) * _BYTES_BF16
    send = block / cluster.inter_node_bw_bytes_per_s + _COLLECTIVE_LATENCY_S
    attend = cost._attention_layer_s(unit, tp) / r
    assert fwd == pytest.approx(llm.layers * (uly + (r - 1) * max(0.0, send - attend)))


def test_an_encoder_adds_the_gather_of_its_output_rows(ring):
    # Its CP collectives are the backbone's kind (attention split evenly), plus the
    # last stage's all-gather of the rows for the projector (backward: an all-reduce).
    vit = ring.with_cp({"vit": 2}).unit("vit")
    assert vit.cp == 2 and vit.cp_tokens > 0 and vit.cp_q_width == ring.program.module(
        "vit").arch.hidden
    fwd, bwd = ring.cp_comm_time_s(vit, 1)
    base_fwd, base_bwd = ring.cp_comm_time_s(replace(vit, role="backbone"), 1)
    bw = ring.program.cluster.intra_node_bw_bytes_per_s
    gather = vit.cp_tokens * vit.cp_q_width * _BYTES_BF16 / 2 / bw + _COLLECTIVE_LATENCY_S
    assert fwd - base_fwd == pytest.approx(gather, rel=1e-9)
    if vit.backward_factor:
        assert bwd - base_bwd == pytest.approx(2 * gather, rel=1e-9)
    assert ring.cp_comm_time_s(ring.unit("vit"), 1) == (0.0, 0.0)
