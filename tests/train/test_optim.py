"""The job's optimizer step (dtdsl.train.optim): torch's AdamW on FSDP2/TP shards, the
job-wide gradient norm counting every element once, clipping and the inf/NaN skip."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dtdsl.train.optim import GROUP_PARAMS, StageOptimizer, clip_coefficient, optimizer_step
from tests.dist import run

HYPER = dict(name="adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 4))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 + rank))


def _reference(world: int, max_norm: float) -> tuple[nn.Module, float]:
    """The single-process step: the sum of every replica's gradient, clipped, AdamW."""
    model = _model()
    for r in range(world):
        model(_batch(r)).square().sum().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    torch.optim.AdamW(model.parameters(), lr=HYPER["lr"], betas=HYPER["betas"],
                      eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]).step()
    return model, norm


def _step(rank: int, world: int, dp: int, tp: int, bad_rank: int | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model()
    sharded = set()
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        sharded = {"0.weight", "0.bias", "2.weight"}     # 2.bias stays replicated
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(1.0)
    model.set_force_sum_reduction_for_comms(True)
    replica = mesh["dp"].get_local_rank()
    # Each DP replica its own batch, every TP rank of a replica the same one.
    model(_batch(replica)).square().sum().backward()
    names = [n for n, _ in model.named_parameters()]
    if bad_rank == rank:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    opt = StageOptimizer(list(model.parameters()), **HYPER, tp_index=mesh["tp"].get_local_rank(),
                         counted_on_tp=[n in sharded for n in names])
    result = optimizer_step([opt], step=0, max_norm=0.5, totals=(float(rank),))
    assert result.totals == (sum(range(world)),)
    want, norm = _reference(dp, 0.5)
    if bad_rank is not None:
        assert result.skipped and math.isnan(result.grad_norm)
        for p, q in zip(model.parameters(), _model().parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.detach())     # nobody stepped
        return
    assert not result.skipped
    assert math.isclose(result.grad_norm, norm, rel_tol=1e-5), (result.grad_norm, norm)
    for (n, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=n)


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_step_matches_torch_adamw_on_the_summed_gradient(dp, tp):
    # The norm counts a TP-sharded weight on every TP rank, a replicated bias on one, and
    # each FSDP2 shard once: it equals clip_grad_norm_ of the single-process model.
    run(_step, dp * tp, dp, tp, None, timeout=60)


@pytest.mark.parametrize("bad_rank", [0, 3])
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(bad_rank):
    run(_step, 4, 2, 2, bad_rank, timeout=60)


def test_clip_coefficient_is_torchs():
    for norm, max_norm in ((3.0, 1.0), (0.5, 1.0), (2.0, None), (2.0, 0.0)):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.full((4,), norm / 2)
        coef = clip_coefficient(norm, max_norm)
        if max_norm:
            torch.nn.utils.clip_grad_norm_([p], max_norm)
            assert math.isclose(float(p.grad[0]) * 2, norm * coef, rel_tol=1e-6)
        else:
            assert coef == 1.0


def test_learning_rate_follows_the_schedule_without_distributed():
    model = _model()
    model(_batch(0)).sum().backward()
    opt = StageOptimizer(list(model.parameters()), **HYPER, lr_at=lambda step: 0.1 * step)
    result = optimizer_step([opt], step=3, max_norm=None)
    assert not result.skipped
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.3)
    assert all(p.grad is None for p in model.parameters())


def test_many_parameters_step_in_groups_as_one_adamw_would():
    # Param groups of GROUP_PARAMS (DTensor's multi-tensor ops cost the square of their
    # tensor count): every parameter ends where one AdamW over all of them puts it.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(GROUP_PARAMS)])   # 2x the group
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    twin(x).square().sum().backward()
    opt = StageOptimizer(list(model.parameters()), **HYPER)
    assert [len(g["params"]) for g in opt.optimizer.param_groups] == [GROUP_PARAMS] * 2
    optimizer_step([opt], step=0, max_norm=None)
    hyper = {k: v for k, v in HYPER.items() if k != "name"}
    want = torch.optim.AdamW(twin.parameters(), **hyper, fused=True)
    want.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="needs parameters"):
        StageOptimizer([], **HYPER)
    with pytest.raises(ValueError, match="adamw and adam"):
        StageOptimizer(list(_model().parameters()), **{**HYPER, "name": "sgd"})
