"""Tensor parallelism (``dtdsl.runtime.tp``) against the single-process modules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtdsl.runtime.model import build_unit
from dtdsl.runtime.tp import ShardSplit, local_tensor, shard_transformer
from tests.runtime.dist import run
from tests.runtime.test_reference import program as tiny

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


def _compare(rank: int, world: int, name: str) -> None:
    program = tiny()
    full = build_unit(program, name, SEED)
    kwargs, weight = _inputs(name, full)
    want_out = _forward_backward(full, kwargs, weight)
    want = {n: (p.detach(), p.grad) for n, p in full.named_parameters()}

    shard = build_unit(program, name, SEED)
    layout = shard_transformer(shard, world, rank, dist.group.WORLD)
    out = _forward_backward(shard, kwargs, weight)
    torch.testing.assert_close(out, want_out, rtol=TOL, atol=TOL)
    sharded = 0
    for n, p in shard.named_parameters():
        value, grad = want[n]
        if layout.is_sharded(n):
            sharded += 1
            split = layout.splits[n]
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
            local, local_grad = local_tensor(p.detach()), local_tensor(p.grad)
            assert local.shape != value.shape, n
            assert list(local.shape) == layout.local_shape(n, value.shape), n
            assert torch.equal(local, split.take(value, world, rank)), n
            torch.testing.assert_close(local_grad, split.take(grad, world, rank),
                                       rtol=TOL, atol=TOL, msg=n)
            torch.testing.assert_close(layout.full(n, p.grad), grad, rtol=TOL, atol=TOL)
            assert torch.equal(layout.full(n, p), value), n
        else:
            assert not isinstance(p, DTensor), n
            assert torch.equal(p.detach(), value), n
            torch.testing.assert_close(p.grad, grad, rtol=TOL, atol=TOL, msg=n)
    assert sharded == 4 * len(shard.layers)
    assert {id(p) for p in layout.replicated(shard)}.isdisjoint(
        id(p) for n, p in shard.named_parameters() if layout.is_sharded(n))


@pytest.mark.parametrize("name", ["vit", "llm"])
def test_tp2_matches_single_process(name):
    run(_compare, 2, name, timeout=60)


def test_rejects_uneven_heads():
    program = tiny()
    vit = build_unit(program, "vit", SEED)
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        shard_transformer(vit, 3, 0, None)
    with pytest.raises(ValueError, match="outside"):
        shard_transformer(vit, 2, 2, None)
