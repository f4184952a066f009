"""train.local_sgd: EDiT Local SGD against its one-process reference, synchronous data
parallelism, an independent computation of the penalty, sharded replicas and A-EDiT's
interval agreement (gloo, CPU, float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dtdsl.ir import program as ir
from dtdsl.train.local_sgd import (
    LocalSGD,
    LocalSGDConfig,
    ReferenceLocalSGD,
    config_of,
    reference_local_sgd,
)
from tests.dist import run

STEPS = 9
CORRUPT_STEP = 7        # replica 1's data is scaled at this step (the third sync at period 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def _batch(replica: int, step: int, corrupt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    if corrupt and replica == 1 and step == CORRUPT_STEP:
        x, y = x * 30, y * 30       # corrupted data: huge gradients on one replica
    return x, y


def _inner(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.01)


def _local_step(model, opt, replica: int, step: int, corrupt: bool) -> None:
    x, y = _batch(replica, step, corrupt)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _reference(cfg: LocalSGDConfig, replicas: int, inner: str, corrupt: bool):
    models = [_model() for _ in range(replicas)]
    opts = [_inner(inner, m.parameters()) for m in models]
    state = ReferenceLocalSGD(list(models[0].parameters()), cfg)
    weights = []
    for step in range(STEPS):
        for r, (m, o) in enumerate(zip(models, opts, strict=True)):
            _local_step(m, o, r, step, corrupt)
        if (step + 1) % cfg.period == 0:
            reference_local_sgd([list(m.parameters()) for m in models], state)
            weights.append(state.last_weights)
    return models, weights


def _train_vs_reference(rank, world, cfg, inner, corrupt):
    model = _model()
    opt = _inner(inner, model.parameters())
    ls = LocalSGD(list(model.parameters()), cfg)
    weights = []
    for step in range(STEPS):
        _local_step(model, opt, rank, step, corrupt)
        if ls.maybe_sync(step):
            weights.append(ls.last_weights)
    ref, ref_weights = _reference(cfg, world, inner, corrupt)
    for mine, theirs in zip(model.parameters(), ref[rank].parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6), (mine - theirs).abs().max()
    assert len(weights) == len(ref_weights) == STEPS // cfg.period
    for w, rw in zip(weights, ref_weights, strict=True):
        assert w == pytest.approx(rw, abs=1e-12)
    if corrupt:
        # syncs 0 and 1 are the warm-up; at sync 2 the z-test drops replica 1
        assert all(x > 0 for w in weights[:2] for x in w), weights
        assert weights[2][1] == 0 and weights[2][0] == pytest.approx(1.0), weights
    # the model moved away from the start (the comparison is not of two idle copies)
    assert any(not torch.equal(a, b)
               for a, b in zip(model.parameters(), _model().parameters(), strict=True))


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_matches_reference(inner):
    cfg = LocalSGDConfig(period=3, outer_lr=0.7, outer_momentum=0.9)
    run(_train_vs_reference, 2, cfg, inner, False)


def test_penalty_drops_a_corrupted_replica_like_the_reference():
    cfg = LocalSGDConfig(period=3, outer_lr=0.7, outer_momentum=0.9, penalty=True,
                         warmup_syncs=2, ema_alpha=0.5, z_threshold=3.0, clip_norm=0.05)
    run(_train_vs_reference, 2, cfg, "sgd", True)


def _period_one_is_data_parallel(rank, world):
    model, dp = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    ls = LocalSGD(list(model.parameters()),
                  LocalSGDConfig(period=1, outer_lr=1.0, outer_momentum=0.0))
    for step in range(STEPS):
        _local_step(model, opt, rank, step, False)
        assert ls.maybe_sync(step)
        x, y = _batch(rank, step, False)
        dp_opt.zero_grad()
        torch.nn.functional.mse_loss(dp(x), y).backward()
        for p in dp.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        dp_opt.step()
    for mine, theirs in zip(model.parameters(), dp.parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6), (mine - theirs).abs().max()


def test_period_one_equals_synchronous_data_parallelism():
    run(_period_one_is_data_parallel, 2)


# -- the penalty against a computation written out here ---------------------------------

def _norm(ts) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in ts))


def _moved(anchor, deltas):
    return [[a - d for a, d in zip(anchor, ds, strict=True)] for ds in deltas]


def _deltas(sync: int, replicas: int, scale: dict[int, float]):
    g = torch.Generator().manual_seed(sync)
    shapes = [(3, 4), (5,)]
    return [[torch.randn(*s, generator=g, dtype=torch.float64) * (0.1 + 0.05 * r)
             * scale.get(r, 1.0) for s in shapes] for r in range(replicas)]


def test_penalty_weights_clipping_and_rollback_by_hand():
    cfg = LocalSGDConfig(outer_lr=0.7, outer_momentum=0.0, penalty=True, warmup_syncs=3,
                         ema_alpha=0.2, z_threshold=3.0, clip_norm=None)
    anchor = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    state = ReferenceLocalSGD(anchor, cfg)

    def sync(deltas, clip=None):
        nonlocal state
        start = [a.clone() for a in state.anchor]
        reps = _moved(start, deltas)
        if clip is not None:
            state.cfg = LocalSGDConfig(**{**cfg.__dict__, "clip_norm": clip})
        reference_local_sgd(reps, state)
        return start, reps

    norms = []
    for s in range(3):
        deltas = _deltas(s, 3, {})
        norms += [_norm(ds) for ds in deltas]
        sync(deltas)
    mean, var = norms[0], 0.0      # the exponentially weighted mean and variance
    for g in norms[1:]:
        delta = g - mean
        mean += 0.2 * delta
        var = 0.8 * (var + 0.2 * delta * delta)
    assert (state.stats.mean, state.stats.var) == pytest.approx((mean, var), rel=1e-12)
    # the warm-up: the same history and the same outlier, a longer warm-up keeps it in
    late = ReferenceLocalSGD(anchor, LocalSGDConfig(**{**cfg.__dict__, "warmup_syncs": 4}))
    for s in range(3):
        reference_local_sgd(_moved(late.anchor, _deltas(s, 3, {})), late)
    reference_local_sgd(_moved(late.anchor, _deltas(3, 3, {2: 20.0})), late)
    assert late.last_weights[2] > 0
    # after the warm-up: replica 2 scaled 20x is dropped; the rest weighted by 1/norm
    deltas = _deltas(3, 3, {2: 20.0})
    start, reps = sync(deltas)
    inv = [1 / _norm(deltas[0]), 1 / _norm(deltas[1])]
    w = [inv[0] / sum(inv), inv[1] / sum(inv)]
    expect = [a - 0.7 * (w[0] * d0 + w[1] * d1)
              for a, d0, d1 in zip(start, deltas[0], deltas[1], strict=True)]
    assert state.last_weights[2] == 0
    for rep in reps:
        for got, want in zip(rep, expect, strict=True):
            assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # clipping: the averaged pseudo-gradient's global norm is cut to the threshold
    deltas = _deltas(4, 3, {})
    start, reps = sync(deltas, clip=0.01)
    assert all(w > 0 for w in state.last_weights), state.last_weights
    inv = [1 / _norm(ds) for ds in deltas]
    avg = [sum(i / sum(inv) * ds[k] for i, ds in zip(inv, deltas, strict=True)) for k in range(2)]
    assert _norm(avg) > 0.01
    expect = [a - 0.7 * d * (0.01 / _norm(avg)) for a, d in zip(start, avg, strict=True)]
    for got, want in zip(reps[0], expect, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # every replica anomalous: all roll back to the anchor, statistics untouched
    stats = (state.stats.mean, state.stats.var, state.stats.seen)
    syncs = state.stats.syncs
    start, reps = sync(_deltas(5, 3, {0: 50.0, 1: 50.0, 2: 50.0}))
    assert state.last_weights == []
    for rep in reps:
        for got, want in zip(rep, start, strict=True):
            assert torch.equal(got, want)
    assert (state.stats.mean, state.stats.var, state.stats.seen) == stats
    assert state.stats.syncs == syncs + 1


def test_outer_step_is_nesterov_by_hand():
    lr, mu = 0.7, 0.9
    start = [torch.ones(3, 4, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    state = ReferenceLocalSGD(start, LocalSGDConfig(outer_lr=lr, outer_momentum=mu))
    theta, mom = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for sync in range(3):
        deltas = _deltas(10 + sync, 2, {})
        reps = _moved(state.anchor, deltas)
        reference_local_sgd(reps, state)
        for k in range(2):
            d = (deltas[0][k] + deltas[1][k]) / 2
            mom[k] = mu * mom[k] + d
            theta[k] = theta[k] - lr * (d + mu * mom[k])
            for rep in reps:
                assert torch.allclose(rep[k], theta[k], rtol=0, atol=1e-12)


# -- distributed synthetic syncs: whole, sharded, many replicas --------------------------

SHAPES = [(6, 4), (10,), (4, 3)]
SYNCS = 6


def _whole_deltas(sync: int, replicas: int):
    scale = {1: 40.0} if sync == 4 else ({} if sync != 5 else
                                         {r: 40.0 for r in range(replicas)})
    g = torch.Generator().manual_seed(77 + sync)
    return [[torch.randn(*s, generator=g, dtype=torch.float64) * (0.1 + 0.03 * r)
             * scale.get(r, 1.0) for s in SHAPES] for r in range(replicas)]


def _chunk(t: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    return t.reshape(-1).tensor_split(shards)[shard].clone()


def _synthetic(rank, world, shards, cfg, layered, offload):
    replicas = world // shards
    replica, shard = divmod(rank, shards)
    groups = [dist.new_group([r * shards + s for r in range(replicas)]) for s in range(shards)]
    sgroups = [dist.new_group([r * shards + s for s in range(shards)]) for r in range(replicas)]
    group = groups[shard] if replicas < world else None
    shard_group = sgroups[replica] if shards > 1 else None
    g = torch.Generator().manual_seed(5)
    start = [torch.randn(*s, generator=g, dtype=torch.float64) for s in SHAPES]
    mine = [_chunk(t, shard, shards) for t in start]
    layers = [mine[:2], mine[2:]] if layered else None
    ls = LocalSGD(mine, cfg, group=group, shard_group=shard_group, layers=layers,
                  offload=offload)
    ref = ReferenceLocalSGD(start, cfg)
    for sync in range(SYNCS):
        deltas = _whole_deltas(sync, replicas)
        reps = _moved(ref.anchor, deltas)
        for p, d in zip(mine, deltas[replica], strict=True):
            p.sub_(_chunk(d, shard, shards))
        assert ls.maybe_sync(sync)
        reference_local_sgd(reps, ref)
        assert ls.last_weights == pytest.approx(ref.last_weights, abs=1e-12)
        for got, want in zip(mine, reps[replica], strict=True):
            assert torch.allclose(got, _chunk(want, shard, shards), rtol=0, atol=1e-10)
    # the run exercised a drop and a rollback
    assert ls.stats.syncs == SYNCS and ls.stats.seen < SYNCS * replicas


@pytest.mark.parametrize("world,shards,layered,offload", [
    (4, 2, False, False), (4, 2, True, True), (4, 1, False, False), (2, 1, True, True)])
def test_sharded_and_whole_replicas_match_reference(world, shards, layered, offload):
    cfg = LocalSGDConfig(period=1, outer_lr=0.7, outer_momentum=0.9, penalty=True,
                         warmup_syncs=3, ema_alpha=0.5, z_threshold=2.0, clip_norm=0.2)
    run(_synthetic, world, shards, cfg, layered, offload)


def _dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    replica = mesh.get_local_rank("replica")
    cfg = LocalSGDConfig(period=1, outer_lr=0.7, outer_momentum=0.9, penalty=True,
                         warmup_syncs=3, ema_alpha=0.5, z_threshold=2.0, clip_norm=0.2)
    g = torch.Generator().manual_seed(5)
    start = [torch.randn(*s, generator=g, dtype=torch.float64) for s in SHAPES]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh["shard"], [Shard(0)]))
              for t in start]
    ls = LocalSGD(params, cfg, group=mesh.get_group("replica"),
                  shard_group=mesh.get_group("shard"))
    ref = ReferenceLocalSGD(start, cfg)
    for sync in range(SYNCS):
        deltas = _whole_deltas(sync, 2)
        reps = _moved(ref.anchor, deltas)
        with torch.no_grad():
            for p, d in zip(params, deltas[replica], strict=True):
                p.sub_(distribute_tensor(d, mesh["shard"], [Shard(0)]))
        assert ls.maybe_sync(sync)
        reference_local_sgd(reps, ref)
        assert ls.last_weights == pytest.approx(ref.last_weights, abs=1e-12)
        for got, want in zip(params, reps[replica], strict=True):
            assert torch.allclose(got.full_tensor(), want, rtol=0, atol=1e-10)


def test_fsdp_style_dtensor_shards_match_reference():
    run(_dtensor, 4)


# -- A-EDiT --------------------------------------------------------------------------------

def _interval(rank, world):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ls = LocalSGD(list(model.parameters()), LocalSGDConfig(interval=1.0, outer_lr=0.7))
    tick = [0.3, 0.45, 0.2, 0.5][rank]       # every replica's clock runs at its own pace
    since, synced, snapshot = 0, [], None
    for step in range(10):
        _local_step(model, opt, rank, step, False)
        since += 1
        if ls.maybe_sync(step, elapsed_s=tick * since):
            synced.append(step)
            since = 0
            snapshot = [p.detach().clone() for p in model.parameters()]
    everyone = [None] * world
    dist.all_gather_object(everyone, synced)
    assert all(s == synced for s in everyone), everyone
    # the fastest clock decides: at 0.45 s/step (world 2) the third step after a sync
    # reaches 1 s, at 0.5 s/step (world 4) the second
    gap = math.ceil(1.0 / max([0.3, 0.45, 0.2, 0.5][:world]))
    assert synced == list(range(gap - 1, 10, gap)), synced
    snapshots = [None] * world
    dist.all_gather_object(snapshots, snapshot)
    for other in snapshots:
        for a, b in zip(other, snapshot, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_interval_sync_agrees_across_clocks(world):
    run(_interval, world)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="period 0"):
        LocalSGDConfig(period=0)
    with pytest.raises(ValueError, match="outer_momentum 1"):
        LocalSGDConfig(outer_momentum=1)
    with pytest.raises(ValueError, match="interval -1"):
        LocalSGDConfig(interval=-1)
    with pytest.raises(ValueError, match="clip_norm 0"):
        LocalSGDConfig(clip_norm=0)


def test_a_programs_sync_is_its_config():
    sync = ir.Sync(kind="local_sgd", period=3, outer_lr=0.7, outer_momentum=0.9,
                   penalty=True, penalty_warmup=2)
    assert config_of(sync) == LocalSGDConfig(period=3, outer_lr=0.7, outer_momentum=0.9,
                                             penalty=True, warmup_syncs=2)
    # Unset, the program's warm-up is the runtime's default.
    assert config_of(ir.Sync(kind="local_sgd", penalty=True)).warmup_syncs == \
        LocalSGDConfig().warmup_syncs == ir.PENALTY_WARMUP
