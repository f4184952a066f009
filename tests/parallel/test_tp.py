"""Tensor parallelism (``dtdsl.parallel.tp``) against the single-process modules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtdsl.models.multimodal import build_unit
from dtdsl.parallel.tp import ShardSplit, local_tensor, shard_unit
from tests.dist import run
from tests.train.test_reference import program as tiny

TOL = 1e-5
SEED = 7



def test_split_take_and_join_round_trip():
    full = torch.arange(24.0).reshape(12, 2)
    split = ShardSplit(0, (4, 4, 4))
    shards = [split.take(full, 2, r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert torch.equal(split.join(shards), full)
    cols = ShardSplit(1, (2,))
    assert torch.equal(cols.join([cols.take(full, 2, r) for r in range(2)]), full)


def _inputs(name: str, module: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if name == "gen":
        arch = tiny().module("gen").arch
        latent = torch.randn(2, arch.latent_channels, 8, 8, generator=gen)
        kwargs = {"latent": latent, "timesteps": torch.tensor([3.0, 500.0]),
                  "context": torch.randn(2, 5, arch.context_dim, generator=gen)}
        return kwargs, torch.randn(latent.shape, generator=gen)
    if name == "vit":
        x = torch.randn(2, 16, module.patch_dim, generator=gen)
        out_dim = module.hidden
        kwargs = {"patches": x}
    else:
        x = torch.randint(0, module.vocab_shard, (2, 24), generator=gen)
        out_dim = module.vocab_shard
        kwargs = {"tokens": x}
    weight = torch.randn(2, x.shape[1], out_dim, generator=gen)
    return kwargs, weight


def _forward_backward(module: torch.nn.Module, kwargs: dict,
                      weight: torch.Tensor) -> torch.Tensor:
    out = module(**kwargs)
    (out * weight).sum().backward()
    return out.detach()


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal up to fp32 rounding at the tensor's own scale (TP sums in another order; the
    U-Net's gradients reach ~30, where 1e-5 absolute is a few ulps)."""
    assert got.shape == want.shape, name
    err = (got - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), (name, err)


def _compare(rank: int, world: int, name: str) -> None:
    program = tiny()
    full = build_unit(program, name, SEED)
    kwargs, weight = _inputs(name, full)
    want_out = _forward_backward(full, kwargs, weight)
    want = {n: (p.detach(), p.grad) for n, p in full.named_parameters()}

    shard = build_unit(program, name, SEED)
    layout = shard_unit(shard, world, rank, dist.group.WORLD)
    out = _forward_backward(shard, kwargs, weight)
    torch.testing.assert_close(out, want_out, rtol=TOL, atol=TOL)
    sharded = 0
    replicated_dtensors = 0
    for n, p in shard.named_parameters():
        value, grad = want[n]
        if layout.is_sharded(n):
            sharded += 1
            split = layout.splits[n]
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
            local, local_grad = local_tensor(p.detach()), local_tensor(p.grad)
            assert local.shape != value.shape, n
            assert local.shape[split.dim] * world == value.shape[split.dim], n
            assert torch.equal(local, split.take(value, world, rank)), n
            _close(local_grad, split.take(grad, world, rank), n)
            _close(layout.full(n, p.grad), grad, n)
            assert torch.equal(layout.full(n, p), value), n
        else:   # plain, or a row-parallel layer's bias: a replicated DTensor
            replicated_dtensors += isinstance(p, DTensor)
            assert torch.equal(local_tensor(p.detach()), value), n
            grad_here = p.grad
            if isinstance(grad_here, DTensor):
                grad_here = grad_here.full_tensor()
            _close(grad_here, grad, n)
            assert torch.equal(layout.full(n, p), value), n
    if name == "gen":
        # Per U-Net transformer block, split: attn1 wqkv, wo; attn2 wq, wkv, wo; ff proj
        # (weight and bias), out; replicated DTensors: the row-parallel biases (attn1 wo,
        # attn2 wo, ff out).
        count = sum(1 for m in full.modules() if type(m).__name__ == "_TransformerBlock")
        assert count and sharded == count * 8, sharded
        assert replicated_dtensors == count * 3
    else:       # per layer: wqkv, wo, w1, w2
        assert sharded == 4 * len(full.layers) and replicated_dtensors == 0
    assert {id(p) for p in layout.replicated(shard)}.isdisjoint(
        id(p) for n, p in shard.named_parameters() if layout.is_sharded(n))


@pytest.mark.parametrize("name", ["vit", "llm", "gen"])
def test_tp2_matches_single_process(name):
    run(_compare, 2, name, timeout=60)


def test_rejects_uneven_heads():
    program = tiny()
    vit = build_unit(program, "vit", SEED)
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        shard_unit(vit, 3, 0, None)
    with pytest.raises(ValueError, match="outside"):
        shard_unit(vit, 2, 2, None)


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
    layout = shard_unit(shard, world, rank, dist.group.WORLD)
    _close(_forward_backward(shard, kwargs, weight), want_out, "output")
    # per block: attn wqkv, wo; cross wq, wkv, wo; mlp w1, w2 (no biases)
    assert len(layout.splits) == 7 * arch.layers
    for n, p in shard.named_parameters():
        assert want[n] is not None and want[n].abs().max() > 0, n
        _close(layout.full(n, p.grad), want[n], n)


def test_dit_tp2_matches_single_process():
    run(_compare_dit, 2, timeout=60)
