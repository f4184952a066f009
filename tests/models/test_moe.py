"""The MoE block (``dtdsl.models.moe``): equal to transformers' Qwen2-MoE, Qwen3-MoE and
Mixtral blocks on tiny random configs (weights through the Hub mapping), the aux loss equal
to ``load_balancing_loss_func``, token conservation through dispatch and combine, and
capacity drops against a plain per-token reference."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.models import moe
from dtdsl.models.moe import (
    MoE,
    MoEConfig,
    can_group,
    expert_ffn,
    hf_moe_keys,
    load_hf_moe,
    to_hf_moe,
)
from tests.helpers.moe import (
    check_conservation,
    integer_experts,
    label_experts,
    token_ids,
)

TOL = 1e-5

import transformers  # noqa: E402,F401  (a dependency: the reference blocks)


def _hf_config(family: str, cfg: MoEConfig):

    common = dict(vocab_size=32, hidden_size=cfg.hidden, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=cfg.top_k,
                  hidden_act="silu")
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=cfg.ffn,
                                          num_local_experts=cfg.experts, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=cfg.ffn, intermediate_size=24,
                                           num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk,
                                           decoder_sparse_step=1, head_dim=4, **common)
    return transformers.Qwen2MoeConfig(moe_intermediate_size=cfg.ffn, intermediate_size=24,
                                       shared_expert_intermediate_size=cfg.shared_ffn,
                                       num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk,
                                       decoder_sparse_step=1, **common)


def _hf_model(family: str, cfg: MoEConfig, seed: int = 0):

    classes = {"mixtral": transformers.MixtralForCausalLM,
               "qwen3_moe": transformers.Qwen3MoeForCausalLM,
               "qwen2_moe": transformers.Qwen2MoeForCausalLM}
    torch.manual_seed(seed)
    model = classes[family](_hf_config(family, cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():       # random, larger than the init: routing varies
            p.normal_(0.0, 0.3)
    return model


CASES = {
    "qwen2_moe-shared": ("qwen2_moe", MoEConfig(hidden=8, ffn=4, experts=6, top_k=2,
                                                norm_topk=False, shared_ffn=12,
                                                shared_gate=True)),
    "qwen2_moe-norm": ("qwen2_moe", MoEConfig(hidden=8, ffn=4, experts=4, top_k=3,
                                              norm_topk=True, shared_ffn=8, shared_gate=True)),
    "qwen3_moe": ("qwen3_moe", MoEConfig(hidden=8, ffn=4, experts=8, top_k=2, norm_topk=True)),
    "mixtral": ("mixtral", MoEConfig(hidden=8, ffn=8, experts=4, top_k=2, norm_topk=True)),
}


def _hub_layer(model, tmp_path) -> dict[str, torch.Tensor]:
    """Layer 0's tensors as ``save_pretrained`` writes them (the Hub's layout)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    pre = "model.layers.0."
    return {k[len(pre):]: v for k, v in load_file(tmp_path / "model.safetensors").items()
            if k.startswith(pre)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_equals_transformers_block(case, layout, tmp_path):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    family, cfg = CASES[case]
    model = _hf_model(family, cfg)
    block = model.model.layers[0].mlp
    if layout == "hub":
        state = _hub_layer(model, tmp_path)
        assert set(state) >= {k for keys in hf_moe_keys(family, cfg).values() for k in keys}
    else:
        state = {f"mlp.{k}": v for k, v in block.state_dict().items()}
    mine = MoE(cfg)
    mine.load_state_dict(load_hf_moe(state, family, cfg), strict=True)
    x = torch.randn(3, 5, cfg.hidden)
    with torch.no_grad():
        want = block(x)
        want_logits = block.gate(x.reshape(-1, cfg.hidden))[0]
        got = mine(x)
    assert (got.out - want).abs().max() <= TOL
    assert (got.router_logits - want_logits).abs().max() <= TOL
    want_aux = load_balancing_loss_func((want_logits,), cfg.experts, cfg.top_k)
    assert abs(got.aux_loss.item() - want_aux.item()) <= TOL
    assert got.dropped.item() == 0 and bool(got.kept.all())
    assert got.tokens_per_expert.sum().item() == 15 * cfg.top_k


@pytest.mark.parametrize("case", sorted(CASES))
def test_hub_mapping_round_trips(case, tmp_path):
    family, cfg = CASES[case]
    state = _hub_layer(_hf_model(family, cfg), tmp_path)
    back = to_hf_moe(load_hf_moe(state, family, cfg), family, cfg)
    # Every tensor of the layer's MoE block, and nothing else.
    assert set(back) == {k for k in state if k.startswith(("mlp.", "block_sparse_moe."))}
    for k, v in back.items():
        assert torch.equal(v, state[k]), k
    # A rank's share of the experts reads just their keys.
    part = load_hf_moe(state, family, cfg, range(1, 3))
    assert torch.equal(part["w2"][0], state[hf_moe_keys(family, cfg)["w2"][1]])
    assert part["w1"].shape[0] == 2


def test_mapping_errors_name_what_is_wrong():
    family, cfg = CASES["mixtral"]
    with pytest.raises(KeyError, match="block_sparse_moe.gate.weight"):
        load_hf_moe({}, family, cfg)
    with pytest.raises(ValueError, match="no MoE layout for the model family 'llama'"):
        hf_moe_keys("llama", cfg)
    state = {k: torch.zeros(1) for keys in hf_moe_keys(family, cfg).values() for k in keys}
    with pytest.raises(ValueError, match="router.weight has shape"):
        load_hf_moe(state, family, cfg)
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        MoEConfig(hidden=8, ffn=4, experts=4, top_k=5)
    with pytest.raises(ValueError, match="shared expert has a gate"):
        hf_moe_keys("qwen2_moe", MoEConfig(hidden=8, ffn=4, experts=4, top_k=1, shared_ffn=4))
    with pytest.raises(ValueError, match="qwen3_moe block has no shared expert"):
        hf_moe_keys("qwen3_moe", MoEConfig(hidden=8, ffn=4, experts=4, top_k=1, shared_ffn=4))
    with pytest.raises(RuntimeError, match="holds 2 of the 4 experts"):
        MoE(cfg, first_expert=2, local_experts=2)(torch.randn(3, cfg.hidden))
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoEConfig(hidden=8, ffn=4, experts=4, top_k=1, capacity_factor=0)


# ---- conservation ------------------------------------------------------------------------









@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
def test_dispatch_conserves_tokens(monkeypatch, capacity_factor):
    calls: list = []
    monkeypatch.setattr(moe, "expert_ffn", integer_experts(calls))
    cfg = MoEConfig(hidden=6, ffn=4, experts=5, top_k=2, norm_topk=False,
                    capacity_factor=capacity_factor)
    torch.manual_seed(1)
    block = MoE(cfg)
    label_experts(block)
    x = token_ids(37, cfg.hidden)
    with torch.no_grad():
        got = block(x)
    assert sorted(calls) == sorted(check_conservation(block, x, got))
    if capacity_factor is None:
        assert bool(got.kept.all())


# ---- capacity ----------------------------------------------------------------------------

def reference_moe(block: MoE, x: torch.Tensor, cap: int | None):
    """Token by token, slot by slot: the block's arithmetic with none of its dispatch."""
    cfg = block.config
    routing = block.route(x)
    taken = [0] * cfg.experts
    out = torch.zeros_like(x)
    kept = torch.zeros(x.shape[0], cfg.top_k, dtype=torch.bool)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = int(routing.experts[t, j])
            if cap is not None and taken[e] >= cap:
                continue
            taken[e] += 1
            kept[t, j] = True
            h = torch.nn.functional.silu(block.w1[e] @ x[t]) * (block.w3[e] @ x[t])
            out[t] += routing.weights[t, j] * (block.w2[e] @ h)
    return out, kept


@pytest.mark.parametrize("factor", [0.25, 0.75, 1.0, 2.0])
def test_capacity_drops_the_later_tokens(factor):
    cfg = MoEConfig(hidden=6, ffn=4, experts=4, top_k=2, capacity_factor=factor)
    torch.manual_seed(2)
    block = MoE(cfg)
    x = torch.randn(2, 11, cfg.hidden)
    with torch.no_grad():
        got = block(x)
        cap = math.ceil(factor * 22 * 2 / 4)
        want, kept = reference_moe(block, x.reshape(-1, cfg.hidden), cap)
    assert torch.equal(got.kept, kept)
    assert got.dropped.item() == int((~kept).sum())
    assert (got.out.reshape(-1, cfg.hidden) - want).abs().max() <= TOL
    if factor <= 0.75:
        assert got.dropped.item() > 0


def test_dropless_equals_reference_and_has_gradients():
    cfg = MoEConfig(hidden=6, ffn=4, experts=8, top_k=3, norm_topk=True, shared_ffn=5)
    torch.manual_seed(3)
    block = MoE(cfg)
    x = torch.randn(4, cfg.hidden, requires_grad=True)   # fewer slots than experts
    got = block(x)
    with torch.no_grad():
        want, _ = reference_moe(block, x, None)
        want += block.shared(x)
    assert (got.out - want).abs().max() <= TOL
    (got.out.square().sum() + got.aux_loss).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None, name
    assert x.grad is not None


@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0]])
def test_grouped_gemm_equals_the_loop(sizes):
    torch.manual_seed(4)
    w1, w3 = torch.randn(4, 12, 8), torch.randn(4, 12, 8)
    w2 = torch.randn(4, 8, 12)
    x = torch.randn(sum(sizes), 8)
    assert can_group(x, w1, w3, w2) and not can_group(x[:, :6], w1[..., :6], w3[..., :6], w2)
    assert not can_group(x.double(), w1.double(), w3.double(), w2.double())
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        y = expert_ffn(leaves[0], torch.tensor(sizes), *leaves[1:],
                       torch.nn.functional.silu, grouped=grouped)
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        results.append([y] + [t.grad for t in leaves])
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_run(dtype):
    cfg = MoEConfig(hidden=16, ffn=8, experts=4, top_k=2, shared_ffn=8, capacity_factor=1.0)
    torch.manual_seed(5)
    block = MoE(cfg)
    x = torch.randn(2, 5, 16)
    want = block(x).out
    block = block.to(dtype)
    xd = x.to(dtype).requires_grad_()
    got = block(xd)
    got.out.float().sum().backward()
    assert got.out.dtype == dtype and got.aux_loss.dtype == torch.float32
    assert xd.grad is not None and block.w2.grad is not None
    if dtype == torch.float64:
        assert torch.allclose(got.out.float(), want, atol=TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of sm90+ (torch's grouped GEMM kernels)")
@pytest.mark.parametrize("sizes", [[37, 0, 64, 5], [0, 0, 0, 0], [130, 0, 0, 0]])
def test_grouped_gemm_on_cuda_in_bf16_equals_the_fp32_loop(sizes):
    """CUDA's grouped GEMM (bf16, sm90+), forward and backward, against the loop over the
    experts in fp32 on the same device: the tolerance is bf16's rounding of two
    implementations (8 bits of mantissa over sums of 64-128 products), relative to each
    tensor's largest entry."""
    torch.manual_seed(4)
    dev = torch.device("cuda")
    w1, w3 = torch.randn(4, 128, 64, device=dev), torch.randn(4, 128, 64, device=dev)
    w2 = torch.randn(4, 64, 128, device=dev)
    x = torch.randn(sum(sizes), 64, device=dev)
    counts = torch.tensor(sizes, device=dev)
    results = []
    for dtype, grouped in ((torch.bfloat16, True), (torch.float32, False)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (x, w1, w3, w2)]
        assert can_group(*leaves) == (dtype == torch.bfloat16)
        y = expert_ffn(leaves[0], counts, *leaves[1:], torch.nn.functional.silu,
                       grouped=grouped)
        (y.float() * torch.linspace(-1, 1, y.numel(), device=dev).reshape(y.shape)
         ).sum().backward()
        results.append([y] + [t.grad for t in leaves])
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape
        if want.numel():
            scale = want.abs().max().clamp_min(1.0)
            assert (got.float() - want).abs().max() <= 3e-2 * scale


def test_a_tp_ranks_block_holds_its_columns_of_every_expert():
    # build_moe at tp (a rank's shard, as models.transformer's classes take tp: what the
    # profile times) splits each expert's and the shared expert's columns; the router
    # stays whole (every TP rank routes the whole sequence).
    from dtdsl.models.build import build_layer
    from tests.helpers.moe import moe_spec

    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, shared_experts=1")
    block = build_layer(p.backbone, tp=2).mlp
    assert isinstance(block, MoE)
    assert tuple(block.w1.shape) == (4, 32, 128) and tuple(block.w2.shape) == (4, 128, 32)
    assert block.shared.w1.out_features == 32 and block.router.out_features == 4
    with pytest.raises(ValueError, match="cannot split an expert's 64 columns"):
        moe.build_moe(p.backbone.arch, tp=3)
