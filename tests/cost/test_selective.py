"""The cost model's selective recomputation: each layer drops what its attention cores
alone keep (``_attention_core_bytes``) and backward runs their forward again."""

from __future__ import annotations

import pytest

from dtdsl.cost.unit import _attention_core_bytes
from dtdsl.ir import program as ir
from dtdsl.planner.baseline import with_recompute
from tests.helpers.planning import cost


def _modes():
    none = cost("tiny_cpu")
    return (none, with_recompute(none, mode=ir.Recompute.SELECTIVE),
            with_recompute(none, mode=ir.Recompute.FULL))


def test_selective_memory_lies_between_none_and_full():
    none, selective, full = _modes()
    for name in ("vit", "llm"):        # transformers
        mem = [m.memory_bytes(m.unit(name), 1, 1, 1, 1, 1, 8, 1.0) for m in (none, selective,
                                                                             full)]
        assert mem[0] > mem[1] > mem[2], (name, mem)
    # The U-Net's attention cores are a small part of its layers' activations.
    gen = [m.memory_bytes(m.unit("gen"), 1, 1, 1, 1, 1, 8, 1.0) for m in (none, selective)]
    assert gen[0] > gen[1]


def test_selective_drops_the_queries_keys_and_values_of_each_layer():
    none, selective, _ = _modes()
    for name in ("vit", "llm"):
        a, b = none.unit(name), selective.unit(name)
        tokens = a.act_bytes_per_layer / _bytes_per_token(none, name)
        arch = none.program.module(name).arch
        core = _attention_core_bytes(arch.hidden, arch.kv_heads / arch.heads, tokens)
        assert a.act_bytes_per_layer - b.act_bytes_per_layer == pytest.approx(core)
        # All of it is divided by TP; backward holds one layer's cores again.
        assert a.act_bytes_per_layer_tp_split - b.act_bytes_per_layer_tp_split == \
            pytest.approx(core)
        assert b.recompute_layer_bytes == b.recompute_layer_bytes_tp_split == \
            pytest.approx(core)
        assert b.recompute is ir.Recompute.SELECTIVE


def _bytes_per_token(cost_model, name: str) -> float:
    """What ``_transformer_activation_bytes`` charges a token of ``name``'s layers."""
    from dtdsl.cost.unit import _mlp_factor, _transformer_activation_bytes

    arch = cost_model.program.module(name).arch
    backbone = name == "llm"
    return _transformer_activation_bytes(
        arch.hidden, arch.ffn, arch.kv_heads / arch.heads, _mlp_factor(arch), 1.0,
        rms_norm=backbone, sequence_parallel=backbone)[0]


def test_selective_backward_runs_the_attention_cores_forward_again():
    """The Q, K and V projections and attention: every attention FLOP of the forward, a
    part of its matmuls (the backbone's: Q, K, V over Q, K, V, O and the MLP)."""
    none, selective, full = _modes()
    eff = none.params.efficiency
    for name in ("vit", "llm", "gen"):
        fwd, bwd = none.fwd_bwd_time_s(none.unit(name), 1)
        s_fwd, s_bwd = selective.fwd_bwd_time_s(selective.unit(name), 1)
        f_bwd = full.fwd_bwd_time_s(full.unit(name), 1)[1]
        unit = selective.unit(name)
        work = unit.selective_work
        assert work.attention == pytest.approx(unit.fwd_work.attention)
        assert 0 < work.matmul < unit.fwd_work.matmul
        again = (work.matmul / eff.matmul + work.attention / eff.attention) / none.peak_flops
        assert s_fwd == pytest.approx(fwd)
        assert s_bwd - bwd == pytest.approx(again)
        assert bwd < s_bwd < f_bwd
    arch = none.program.module("llm").arch
    h, d = arch.hidden, arch.head_dim
    per_token = 2 * h * d * (2 * arch.heads + 2 * arch.kv_heads) + 2 * h * arch.ffn * 3
    llm = selective.unit("llm")
    assert llm.selective_work.matmul / llm.fwd_work.matmul == pytest.approx(
        2 * h * d * (arch.heads + 2 * arch.kv_heads) / per_token)
