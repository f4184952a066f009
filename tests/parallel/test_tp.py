"""Tensor parallelism (``dtdsl.parallel.tp``) against the single-process modules."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtdsl.models.multimodal import build_unit, init_unit
from dtdsl.parallel.tp import local_tensor, parallelize_unit, tp_conflicts
from tests.dist import run
from tests.specs import program as tiny

TOL = 1e-5
SEED = 7


def _inputs(name: str, module: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if name == "gen":
        arch = tiny().module("gen").arch
        latent = torch.randn(2, arch.latent_channels, 8, 8, generator=gen)
        kwargs = {"latent": latent, "timesteps": torch.tensor([3.0, 500.0]),
                  "context": torch.randn(2, 5, arch.context_dim, generator=gen)}
        return kwargs, torch.randn(latent.shape, generator=gen)
    if name == "vit":
        kwargs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
        return kwargs, torch.randn(2, 16, module.hidden, generator=gen)
    else:
        x = torch.randint(0, module.vocab_shard, (2, 24), generator=gen)
        kwargs = {"tokens": x}
        out_dim = module.vocab_shard
    return kwargs, torch.randn(2, x.shape[1], out_dim, generator=gen)


def _forward_backward(module: torch.nn.Module, kwargs: dict,
                      weight: torch.Tensor) -> torch.Tensor:
    out = module(**kwargs)
    if isinstance(out, DTensor):        # a vocabulary-parallel head's logits
        out = out.full_tensor()
    (out * weight).sum().backward()
    return out.detach()


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal up to fp32 rounding at the tensor's own scale (TP sums in another order)."""
    assert got.shape == want.shape, name
    err = (got - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), (name, err)


def _compare(rank: int, world: int, name: str) -> None:
    program = tiny()
    full = build_unit(program, name, SEED)
    kwargs, weight = _inputs(name, full)
    want_out = _forward_backward(full, kwargs, weight)
    want = {n: (p.detach(), p.grad) for n, p in full.named_parameters()}

    # As the runtime builds it: on meta, sharded, then only this rank's shards
    # materialised and initialised by the layout-independent rules.
    mesh = DeviceMesh("cpu", list(range(world)))
    shard = build_unit(program, name, SEED, device="meta")
    sharded = parallelize_unit(shard, mesh)
    shard.to_empty(device="cpu")
    init_unit(program, name, shard, SEED)
    assert sharded, "nothing was sharded"
    out = _forward_backward(shard, kwargs, weight)
    torch.testing.assert_close(out, want_out, rtol=TOL, atol=TOL)
    for n, p in shard.named_parameters():
        value, grad = want[n]
        if n in sharded:
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
            assert local_tensor(p).shape != value.shape, n
            # The shard holds exactly the reference's values at its positions.
            assert torch.equal(p.full_tensor(), value), n
            _close(p.grad.full_tensor(), grad, n)
        else:   # plain, or a row-parallel layer's bias: a replicated DTensor
            assert torch.equal(local_tensor(p.detach()), value), n
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            _close(g, grad, n)
    if name == "llm":   # vocabulary-parallel embedding and head
        assert {"tok_embeddings.weight", "output.weight"} <= sharded


@pytest.mark.parametrize("name", ["vit", "llm", "gen"])
def test_tp2_matches_single_process(name):
    run(_compare, 2, name, timeout=60)


def test_conflicts_name_the_block():
    vit = build_unit(tiny(), "vit", SEED, device="meta")
    assert tp_conflicts(vit, 2) == []
    assert any("4 attention heads" in c for c in tp_conflicts(vit, 3))


def _uneven(rank: int, world: int) -> None:
    vit = build_unit(tiny(), "vit", SEED, device="meta")
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        parallelize_unit(vit, DeviceMesh("cpu", list(range(world))))


def test_rejects_uneven_heads():
    run(_uneven, 3, timeout=60)


def _compare_dit(rank: int, world: int) -> None:
    from dtdsl.ir import program as ir
    from dtdsl.models.dit import DiT

    arch = ir.DiTArch(layers=2, hidden=32, heads=4, ffn=64, patch=2, latent=8,
                      latent_channels=4, context_dim=24)

    def build() -> DiT:
        dit = DiT(arch)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():       # adaLN-Zero starts every block as the identity: perturb
            for p in dit.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        return dit

    gen = torch.Generator().manual_seed(5)
    kwargs = {"latent": torch.randn(2, 4, 8, 8, generator=gen),
              "timesteps": torch.tensor([7.0, 300.0]),
              "context": torch.randn(2, 3, 24, generator=gen)}
    weight = torch.randn(2, 4, 8, 8, generator=gen)
    full = build()
    want_out = _forward_backward(full, kwargs, weight)
    want = {n: p.grad for n, p in full.named_parameters()}
    shard = build()
    sharded = parallelize_unit(shard, DeviceMesh("cpu", list(range(world))))
    _close(_forward_backward(shard, kwargs, weight), want_out, "output")
    # per block: attn wq, wk, wv, wo; cross wq, wk, wv, wo; mlp w1, w2 (no biases)
    assert len(sharded) == 10 * arch.layers
    for n, p in shard.named_parameters():
        assert want[n] is not None and want[n].abs().max() > 0, n
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        _close(g, want[n], n)


def test_dit_tp2_matches_single_process():
    run(_compare_dit, 2, timeout=60)


def _compare_moe(rank: int, world: int) -> None:
    """The MoE block under TP (``parallelize_moe``) on this rank's piece of the sequence
    against the one-process block on the whole one: a shared expert with its gate, a
    capacity that drops, padding rows, the aux loss in the backward."""
    from torch.distributed.tensor import Partial

    from dtdsl.models.moe import MoE, MoEConfig
    from dtdsl.parallel.tp import parallelize_moe

    cfg = MoEConfig(hidden=8, ffn=4, experts=4, top_k=2, capacity_factor=1.0,
                    shared_ffn=6, shared_gate=True)
    torch.manual_seed(0)
    full = MoE(cfg)
    full.aux_weight = 0.3
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, cfg.hidden, generator=gen)
    g = torch.randn(2, 6, cfg.hidden, generator=gen)
    valid = torch.arange(6) < torch.tensor([[6], [4]])      # the second row: 2 of padding
    xf = x.clone().requires_grad_()
    (full.layer_forward(xf, valid) * g).sum().backward()

    mesh = DeviceMesh("cpu", list(range(world)))
    block = MoE(cfg)
    block.aux_weight = 0.3
    block.load_state_dict(full.state_dict())
    parallelize_moe(block, mesh)
    piece = slice(rank * 6 // world, (rank + 1) * 6 // world)
    xp = x[:, piece].clone().requires_grad_()
    out = block.layer_forward(xp, valid)
    torch.testing.assert_close(out, full.layer_forward(x, valid)[:, piece].detach(),
                               rtol=TOL, atol=TOL)
    (out * g[:, piece]).sum().backward()
    _close(xp.grad, xf.grad[:, piece], "input")
    assert local_tensor(block.w1).shape == (4, 4 // world, 8)
    assert local_tensor(block.w2).shape == (4, 8, 4 // world)
    for n, p in block.named_parameters():
        want = dict(full.named_parameters())[n]
        assert torch.equal(p.full_tensor(), want.detach()), n
        # A replicated parameter's gradient is each rank's part of the sum.
        replicated = n in ("router.weight", "shared_gate.weight")
        assert isinstance(p.grad.placements[0], Partial) == replicated, n
        _close(p.grad.full_tensor(), want.grad, n)


def test_moe_block_tp2_matches_single_process():
    run(_compare_moe, 2, timeout=60)


def test_moe_conflicts_name_the_columns():
    from dtdsl.models.moe import MoE, MoEConfig

    block = MoE(MoEConfig(hidden=8, ffn=6, experts=4, top_k=2, shared_ffn=5))
    assert tp_conflicts(block, 2) == ["5 shared expert columns ()"]
    assert tp_conflicts(block, 4) == ["6 expert FFN columns ()", "5 shared expert columns ()"]


def _compare_qk_norm(rank: int, world: int) -> None:
    from dtdsl.ir import program as ir
    from dtdsl.models.build import build_arch

    arch = ir.TransformerArch(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64,
                              swiglu=True, causal=True, qk_norm=True)

    def build() -> torch.nn.Module:
        module = build_arch("backbone", arch)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (p.dim() == 1))
        return module

    gen = torch.Generator().manual_seed(5)
    kwargs = {"tokens": torch.randint(0, 64, (2, 12), generator=gen)}
    weight = torch.randn(2, 12, 64, generator=gen)
    full = build()
    want_out = _forward_backward(full, kwargs, weight)
    want = {n: p.grad for n, p in full.named_parameters()}
    shard = build()
    parallelize_unit(shard, DeviceMesh("cpu", list(range(world))))
    _close(_forward_backward(shard, kwargs, weight), want_out, "output")
    norms = [n for n, _ in shard.named_parameters() if n.endswith(("q_norm.weight",
                                                                    "k_norm.weight"))]
    assert len(norms) == 2 * arch.layers
    for n, p in shard.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        _close(g, want[n], n)


def test_qk_norm_weights_take_every_head_s_gradient_under_tp():
    """Qwen3's QK-norm weights act on each rank's own heads: their gradients are summed
    over the TP group, equal to the single-process ones."""
    run(_compare_qk_norm, 2, timeout=60)
