"""Zero1AdamW, the global gradient norm and inf/NaN agreement, on gloo ranks.

Every distributed case builds the same synthetic job on every rank: units of (tp, dp) rank
grids (TP innermost, consecutive ranks), each unit with TP-sharded and TP-replicated
parameters. Each rank trains its slice with ``optimizer_step``; each rank also runs the
single-process reference (``torch.optim.AdamW`` on the whole model with the DP-averaged
gradient, ``clip_grad_norm_`` over all units) and compares its slice to it.
"""

from __future__ import annotations

import datetime
import io
import math
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtdsl.train.optim import (
    Zero1AdamW,
    clip_coefficient,
    found_nonfinite,
    global_grad_norm,
    local_grad_sq_norm,
    optimizer_step,
)

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Per unit: (full shape, TP-sharded along dim 0?). 6*3 + 5 + 4*2 + 3 = 34 elements for
# tp=1: not a multiple of 3 (DP 3 pads), nor with the tp=2 slices (9 + 5 + 4 + 3 = 21).
SHAPES = [((6, 3), True), ((5,), False), ((4, 2), True), ((3,), False)]


# -- a private spawn helper ----------------------------------------------------------------

def _child(rank, fn, world, store, args):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    except BaseException as exc:
        raise RuntimeError(f"rank {rank}/{world}:\n{traceback.format_exc()}") from exc
    finally:
        dist.destroy_process_group()


def _spawn(fn, world, *args, timeout=60.0):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # The first torch.optim.AdamW() imports torch._dynamo (seconds); do it once here so
    # that forked children inherit it instead of each paying for it.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    with tempfile.TemporaryDirectory(prefix="dtdsl-optim-") as tmp:
        ctx = mp.start_processes(_child, args=(fn, world, os.path.join(tmp, "store"), args),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks timed out")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)


# -- the synthetic job ---------------------------------------------------------------------

def _layout(units, rank):
    """(unit index, tp, dp, tp_rank, dp_rank) of a global rank; creates every DP group on
    every rank in the same order and returns this rank's."""
    mine, first = None, 0
    for u, (tp, dp) in enumerate(units):
        for t in range(tp):
            group = dist.new_group([first + d * tp + t for d in range(dp)])
            for d in range(dp):
                if first + d * tp + t == rank:
                    mine = (u, tp, dp, t, d, group)
        first += tp * dp
    assert first == dist.get_world_size()
    return mine


def _full_params(u):
    g = torch.Generator().manual_seed(100 + u)
    return [torch.randn(shape, generator=g) for shape, _ in SHAPES]


def _full_grads(u, step, replica):
    g = torch.Generator().manual_seed(10_000 * u + 100 * step + replica)
    return [torch.randn(shape, generator=g) for shape, _ in SHAPES]


def _slice(tensors, tp, t):
    return [x.chunk(tp, dim=0)[t] if sharded else x
            for x, (_, sharded) in zip(tensors, SHAPES, strict=True)]


class _Reference:
    """The whole job in one process: torch.optim.AdamW + clip_grad_norm_."""

    def __init__(self, units, *, average=True, grad_scale=1.0, max_norm=None):
        self.units, self.average = units, average
        self.grad_scale, self.max_norm = grad_scale, max_norm
        self.params = [[p.clone().requires_grad_() for p in _full_params(u)]
                       for u in range(len(units))]
        self.opt = torch.optim.AdamW([p for ps in self.params for p in ps], foreach=False,
                                     **HYPER)

    def step(self, step):
        for u, (_, dp) in enumerate(self.units):
            per_replica = [_full_grads(u, step, d) for d in range(dp)]
            for i, p in enumerate(self.params[u]):
                total = torch.stack([r[i] for r in per_replica]).sum(0)
                p.grad = (total / dp if self.average else total) * self.grad_scale
        everything = [p for ps in self.params for p in ps]
        norm = float(torch.nn.utils.clip_grad_norm_(everything, self.max_norm or math.inf))
        self.opt.step()
        return norm


def _build(units, rank, *, zero=1, average=True, dtype=torch.float32):
    u, tp, dp, t, d, group = _layout(units, rank)
    params = [p.to(dtype).requires_grad_() for p in _slice(_full_params(u), tp, t)]
    replicated = [p for p, (_, sharded) in zip(params, SHAPES, strict=True) if not sharded]
    opt = Zero1AdamW(params, zero=zero, dp_group=group, average=average, tp_rank=t,
                     tp_replicated=replicated, **HYPER)
    return opt, (u, tp, t, d)


def _set_grads(opt, where, step):
    u, tp, t, d = where
    for p, g in zip(opt.params, _slice(_full_grads(u, step, d), tp, t), strict=True):
        p.grad = g.to(p.dtype)


def _assert_matches(opt, ref, where, atol=1e-6):
    u, tp, t, _ = where
    for p, want in zip(opt.params, _slice(ref.params[u], tp, t), strict=True):
        torch.testing.assert_close(p.detach(), want.detach().to(p.dtype), rtol=0, atol=atol)


# -- rank programs (module level: the children find them by name) --------------------------

def _train_and_compare(rank, world, units, zero, average, grad_scale, max_norm, steps):
    opt, where = _build(units, rank, zero=zero, average=average)
    ref = _Reference(units, average=average, grad_scale=grad_scale, max_norm=max_norm)
    if zero == 1 and opt.dp_size > 1:
        assert opt.exp_avg.numel() == opt.padded_numel // opt.dp_size < opt.numel
    clipped = False
    for step in range(steps):
        _set_grads(opt, where, step)
        result = optimizer_step([opt], grad_scale=grad_scale, max_norm=max_norm)
        want_norm = ref.step(step)
        assert not result.skipped
        assert math.isclose(result.grad_norm, want_norm, rel_tol=1e-5), (result, want_norm)
        clipped |= result.clip_coef < 1.0
        _assert_matches(opt, ref, where)
    assert opt.num_steps == steps
    assert clipped == (max_norm is not None)


def _inf_skips_everywhere(rank, world, units, bad_rank, bad_step, value):
    opt, where = _build(units, rank)
    ref = _Reference(units, max_norm=1.0)
    for step in range(3):
        _set_grads(opt, where, step)
        if step == bad_step and rank == bad_rank:
            opt.params[0].grad[0, 0] = value
        before = {k: v.clone() if torch.is_tensor(v) else v
                  for k, v in opt.state_dict().items()}
        params_before = [p.detach().clone() for p in opt.params]
        result = optimizer_step([opt], max_norm=1.0)
        if step == bad_step:
            assert result.skipped
            after = opt.state_dict()
            for k, v in before.items():
                assert torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k], k
            for p, q in zip(opt.params, params_before, strict=True):
                assert torch.equal(p.detach(), q)
        else:
            assert not result.skipped
            ref.step(step)
        _assert_matches(opt, ref, where)
    assert opt.num_steps == 2


def _state_dict_round_trip(rank, world, units):
    opt, where = _build(units, rank)
    for step in range(2):
        _set_grads(opt, where, step)
        optimizer_step([opt])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)     # plain tensors and numbers only
    twin = Zero1AdamW([p.detach().clone().requires_grad_() for p in opt.params],
                      dp_group=opt.dp_group, lr=1.0)
    twin.load_state_dict(state)
    assert twin.num_steps == 2 and twin.lr == HYPER["lr"] and twin.betas == HYPER["betas"]
    for step in range(2, 4):
        for o in (opt, twin):
            _set_grads(o, where, step)
            optimizer_step([o])
    for p, q in zip(opt.params, twin.params, strict=True):
        assert torch.equal(p, q)
    for k, v in opt.state_dict().items():
        assert torch.equal(v, twin.state_dict()[k]) if torch.is_tensor(v) else v == \
            twin.state_dict()[k]
    other = Zero1AdamW([torch.zeros(3, requires_grad=True)], dp_group=opt.dp_group, lr=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(state)


def _bf16_dp(rank, world, units):
    """bf16 parameters: the fp32 master shard follows fp32 AdamW on the upcast gradients."""
    opt, where = _build(units, rank, dtype=torch.bfloat16)
    assert opt.master is not None
    ref = _Reference(units)
    with torch.no_grad():          # start the reference from the bf16-rounded values
        for ps in ref.params:
            for p in ps:
                p.copy_(p.to(torch.bfloat16))
    for step in range(3):
        _set_grads(opt, where, step)
        optimizer_step([opt])
        # the reference sees the bf16-rounded gradients too
        for u, (_, dp) in enumerate(units):
            for i, p in enumerate(ref.params[u]):
                rs = [_full_grads(u, step, d)[i].to(torch.bfloat16).float() for d in range(dp)]
                p.grad = torch.stack(rs).sum(0) / dp
        ref.opt.step()
        u, tp, t, _ = where
        full = torch.cat([x.detach().reshape(-1) for x in _slice(ref.params[u], tp, t)])
        full = torch.cat([full, full.new_zeros(opt.padded_numel - opt.numel)])
        torch.testing.assert_close(opt.master, full[opt.shard_start:opt.shard_end],
                                   rtol=0, atol=1e-6)
        flat = torch.cat([p.detach().reshape(-1) for p in opt.params])
        flat = torch.cat([flat, flat.new_zeros(opt.padded_numel - opt.numel)])
        # the parameters are the (gathered) master weights rounded to bf16
        assert torch.equal(flat, torch.cat(_gather_all(opt.master)).to(torch.bfloat16))


def _gather_all(shard):
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(out, shard)
    return out


def _dtensor_tp(rank, world):
    """DTensor TP parameters (a Shard(0) weight, a Replicate norm) go through their local
    tensors, and the replicated norm counts once in the global norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dp_groups = [dist.new_group([r]) for r in range(world)]
    g = torch.Generator().manual_seed(7)
    full_w, full_n = torch.randn(2 * world, 3, generator=g), torch.randn(3, generator=g)
    w = torch.nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    n = torch.nn.Parameter(distribute_tensor(full_n, mesh, [Replicate()]))
    ref = [torch.nn.Parameter(full_w.clone()), torch.nn.Parameter(full_n.clone())]
    opt = Zero1AdamW([w, n], dp_group=dp_groups[rank], tp_rank=rank, tp_replicated=[n],
                     **HYPER)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for _ in range(3):
        for (a, b), o in (((w, n), opt), ((ref[0], ref[1]), ref_opt)):
            o.zero_grad()
            ((a * a).sum() * 3 + (b * a.sum(0)).sum()).backward()
        result = opt.step(max_norm=1.0)
        want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
        ref_opt.step()
        assert math.isclose(result.grad_norm, want, rel_tol=1e-5) and result.clip_coef < 1
        torch.testing.assert_close(w.to_local(), ref[0].detach().chunk(world)[rank],
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(n.to_local(), ref[1].detach(), rtol=0, atol=1e-6)


# -- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [2, 3])
def test_zero1_matches_torch_adamw(dp):
    _spawn(_train_and_compare, dp, [(1, dp)], 1, True, 0.5, None, 4)


def test_zero0_matches_torch_adamw():
    _spawn(_train_and_compare, 2, [(1, 2)], 0, True, 1.0, None, 3)


def test_summed_gradients_not_averaged():
    # the loss was normalised by the global batch: sum over DP, scale by 1/global_batch
    _spawn(_train_and_compare, 3, [(1, 3)], 1, False, 1 / 6, None, 3)


@pytest.mark.parametrize(("world", "units", "zero"), [
    (3, [(1, 2), (1, 1)], 1),        # DP replicas + a second unit
    (4, [(2, 2)], 1),                # TP shards x DP replicas, replicated norms
    (4, [(2, 2)], 0),                # the same without sharding: DP rank 0 counts
    (4, [(2, 1), (1, 2)], 1),        # a TP unit and a DP unit
])
def test_global_clip_matches_clip_grad_norm(world, units, zero):
    _spawn(_train_and_compare, world, units, zero, True, 1.0, 1.0, 3)


@pytest.mark.parametrize(("bad_rank", "value"), [(3, math.inf), (0, math.nan)])
def test_nonfinite_on_one_rank_skips_everywhere(bad_rank, value):
    _spawn(_inf_skips_everywhere, 4, [(1, 2), (1, 2)], bad_rank, 1, value)


def test_state_dict_round_trip():
    _spawn(_state_dict_round_trip, 2, [(1, 2)])


def test_bf16_master_weights_dp2():
    _spawn(_bf16_dp, 2, [(1, 2)])


def test_dtensor_tp_parameters():
    _spawn(_dtensor_tp, 2)


# -- single process ------------------------------------------------------------------------

def test_clip_coefficient_is_torchs():
    for norm, max_norm in [(10.0, 1.0), (0.5, 1.0), (1.0, 1.0)]:
        g = torch.full((4,), norm / 2)
        p = torch.zeros(4, requires_grad=True)
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], max_norm)
        coef = clip_coefficient(norm, max_norm)
        assert coef <= 1.0
        torch.testing.assert_close(p.grad, g * coef)


def test_without_distributed():
    assert not dist.is_initialized()
    assert global_grad_norm(9.0) == 3.0
    assert found_nonfinite(True) and not found_nonfinite(False)
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    a.grad, b.grad = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([3.0, 4.0])
    assert local_grad_sq_norm([a, b]) == 34.0
    assert local_grad_sq_norm([a, b], tp_rank=1, tp_replicated=[b]) == 9.0
    assert local_grad_sq_norm([a, b], dp_rank=1) == 0.0
    opt = Zero1AdamW([a, b], lr=0.1)
    assert opt.dp_size == 1 and opt.step().grad_norm == math.sqrt(34.0)


def test_rejects_bad_arguments():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="zero=2"):
        Zero1AdamW([p], lr=0.1, zero=2)
    with pytest.raises(ValueError, match="one dtype"):
        Zero1AdamW([p, torch.zeros(2, dtype=torch.bfloat16)], lr=0.1)
    with pytest.raises(ValueError, match="not among params"):
        Zero1AdamW([p], lr=0.1, tp_replicated=[torch.zeros(1)])
    with pytest.raises(RuntimeError, match="reduce_grads"):
        Zero1AdamW([p], lr=0.1).apply()


def test_fused_norm_and_flag_match_the_separate_ones():
    """``grad_sq_norm_and_nonfinite`` is ``(grad_sq_norm(), local_nonfinite())``, with
    finite, huge (whose fp32 square would overflow) and inf/NaN gradients."""
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3, 2))]
    opt = Zero1AdamW(params, lr=1e-3)
    for fill in (0.5, 3e38, math.inf, math.nan):
        params[0].grad = torch.linspace(-1, 1, 5)
        params[1].grad = torch.full((3, 2), fill)
        opt.reduce_grads()
        sq, bad = opt.grad_sq_norm_and_nonfinite()
        ref_sq, ref_bad = opt.grad_sq_norm(), opt.local_nonfinite()
        assert bad == ref_bad == (not math.isfinite(fill))
        if not bad:
            assert sq == ref_sq
        opt.skip()
