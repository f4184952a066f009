"""dtdsl.train.memcheck: one rank's peak memory on fake tensors and a fake process group.

The models here are written for the tests (a Linear stack, a small Llama-style stage), not
the runtime's: the harness is measured on shapes whose bytes can be counted by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from dtdsl.train.memcheck import (
    CATEGORIES,
    MemoryReport,
    fake_world,
    init_optimizer_state,
    measure_held_peaks,
    measure_peak,
)

F32, BF16 = 4, 2  # bytes per element


# -- a small Llama-style pipeline stage ----------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under TP the projections return local tensors: this rank's heads.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = _Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = _SwiGLU(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class _LastStage(nn.Module):
    """A backbone's last pipeline stage: blocks, the final norm and the LM head."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, layers: int,
                 vocab: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tensor_parallel(stage: _LastStage, tp_mesh) -> None:
    """Megatron TP with sequence parallelism; the head's logits stay vocab-sharded."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in stage.layers:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": gather,
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "ffn": gather,
            "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(stage, tp_mesh, {
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })


# -- tests ------------------------------------------------------------------------------------


def _linear_stack_step(dim: int, layers: int, batch: int) -> MemoryReport:
    """Two AdamW steps of a bias-free Linear stack on a fake world of one rank."""
    with fake_world(world_size=1, rank=0) as world:
        with torch.device(world.device):  # fake parameters: no bytes allocated
            model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers)))
        opt = torch.optim.AdamW(model.parameters(), fused=True)

        def step() -> None:
            for _ in range(2):  # the second step runs with the optimizer state
                model(torch.randn(batch, dim, device=world.device)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # gradients stay allocated

        return measure_peak(step, allocation_granularity_bytes=1)


def test_linear_stack_peak_matches_hand_count():
    dim, layers, batch = 512, 4, 2048
    report = _linear_stack_step(dim, layers, batch)

    layer = dim * dim * F32
    params = layers * layer
    act = batch * dim * F32  # one layer's input
    # At the peak (the last layer's backward): parameters, gradients, the two AdamW
    # moments, the input of every layer, the output gradient being formed and that
    # layer's new weight gradient (accumulated into .grad right after).
    expected = params + params + 2 * params + layers * act + act + layer
    assert report.peak_phase == "backward"
    assert report.peak_bytes == pytest.approx(expected, rel=0.01)
    assert report.by_category["params"] == params
    assert report.by_category["grads"] == params
    assert report.by_category["optimizer_state"] == pytest.approx(2 * params, abs=64)
    assert report.by_category["activations"] == pytest.approx(layers * act, abs=64)
    assert sum(report.by_category.values()) == report.peak_bytes
    assert tuple(report.by_category) == CATEGORIES
    # After the step: parameters, gradients (zeroed, not freed) and the AdamW state.
    assert report.final_bytes == pytest.approx(4 * params, abs=64)
    assert "backward" in str(report)


def _held_step(times: int | None, holds: tuple[int, ...] | None = None) -> object:
    """A Linear stack's step with two microbatches in flight, ``times`` (or each count of
    ``holds``) more like the first held during the second's forward."""
    with fake_world(world_size=1, rank=0) as world:
        with torch.device(world.device):
            model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3)))
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        init_optimizer_state(opt)

        def step(flight) -> None:
            before = flight.mark()
            outs = [model(torch.randn(32, 64, device=world.device))]
            flight.hold(before, flight.mark(), *(() if times is None else (times,)))
            outs.append(model(torch.randn(32, 64, device=world.device)))
            flight.release()
            for out in outs:
                out.sum().backward()
            outs.clear()
            opt.step()
            opt.zero_grad()

        if holds is None:
            return measure_peak(step, track=(model, opt), allocation_granularity_bytes=1,
                                in_flight=True)
        return measure_held_peaks(step, holds, track=(model, opt),
                                  allocation_granularity_bytes=1)


def test_one_step_reports_each_hold_count_as_its_own_step_would():
    counts = (0, 2, 40)     # 1 left out: 2 is another small count held less than 40
    several = _held_step(None, holds=counts)
    alone = tuple(_held_step(n) for n in counts)
    assert several == alone
    # The counts are told apart: few held peak in the backward, many while held.
    assert several[0].peak_phase == "backward" and several[-1].peak_phase == "forward"
    assert several[-1].peak_bytes > several[0].peak_bytes
    with pytest.raises(ValueError, match="holds"):
        _held_step(3, holds=counts)
    with pytest.raises(ValueError, match="holds"):
        _held_step(None)


def test_worlds_follow_one_another_in_one_process():
    first = _linear_stack_step(128, 2, 64)
    assert not dist.is_initialized()
    second = _linear_stack_step(128, 2, 64)
    assert not dist.is_initialized()
    assert first == second


def test_fake_world_refuses_misuse():
    with fake_world(world_size=8, rank=3) as world:
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
        assert isinstance(torch.empty(2, device=world.device), torch._subclasses.FakeTensor)
        with pytest.raises(RuntimeError, match="already exists"):
            with fake_world(world_size=8, rank=3):
                pass
        with pytest.raises(ValueError, match="not in the mesh"):
            world.device_mesh(range(4, 8), (2, 2), ("dp", "tp"))
        with pytest.raises(ValueError, match="do not fill"):
            world.device_mesh(range(0, 8), (3, 2), ("dp", "tp"))
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not a rank"):
        with fake_world(world_size=8, rank=8):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            with fake_world(world_size=8, rank=3, device_type="cuda"):
                pass
    assert not dist.is_initialized()


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_tp_fsdp_rank_holds_its_shard(optimizer):
    """Rank 13 of a world of 24: the unit owns ranks 8..23 as (pp 2, dp 2, tp 4); TP with
    sequence parallelism and loss_parallel, FSDP2 over dp (bf16 compute, fp32 reduce, no
    reshard after forward), two microbatches in flight, AdamW."""
    pp, dp, tp = 2, 2, 4
    dim, heads, kv_heads, ffn, layers, vocab = 64, 4, 4, 128, 2, 1024
    batch, seq = 2, 64
    with fake_world(world_size=24, rank=13) as world:
        mesh = world.device_mesh(range(8, 24), (pp, dp, tp), ("pp", "dp", "tp"))
        assert tuple(mesh.get_coordinate()) == (0, 1, 1)
        with torch.device("meta"):
            stage = _LastStage(dim, heads, kv_heads, ffn, layers, vocab)
        _tensor_parallel(stage, mesh["tp"])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in [*stage.layers, stage]:
            fully_shard(module, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
        stage.to_empty(device=world.device)
        opt = torch.optim.AdamW(stage.parameters(), **{optimizer: True})
        init_optimizer_state(opt)

        def step() -> None:
            hidden = [torch.randn(batch, seq // tp, dim, device=world.device,
                                  dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
            logits = [stage(h) for h in hidden]  # both microbatches in flight
            for out in logits:
                labels = torch.randint(0, vocab, (batch * seq,), device=world.device)
                with loss_parallel():
                    F.cross_entropy(out.flatten(0, 1).float(), labels).backward()
            del logits, out
            opt.step()

        report = measure_peak(step, track=(stage, opt), allocation_granularity_bytes=1)

    # Matrices are sharded over TP and then over DP; norm weights are replicated over TP,
    # so only DP shards them.
    matrices = layers * (4 * dim * dim + 3 * dim * ffn) + vocab * dim
    norms = (2 * layers + 1) * dim
    sharded_fp32 = (matrices // (tp * dp) + norms // dp) * F32
    unsharded_bf16 = (matrices // tp + norms) * BF16  # all-gathered, kept through backward
    final = report.final_by_category
    assert final["params"] == sharded_fp32
    assert final["grads"] == sharded_fp32
    assert final["optimizer_state"] == pytest.approx(2 * sharded_fp32, abs=256)
    assert report.by_category["params"] == sharded_fp32 + unsharded_bf16
    assert report.by_category["activations"] > 0
    # DTensor's shape propagation makes fake tensors of the global shapes, here of the
    # logits' gradient in loss_parallel's backward; none may be counted. This rank holds
    # a 1/tp vocabulary shard of the logits (the peak is in that backward: three fp32
    # tensors of the shard's size; counting the propagation's tensors adds over 2x).
    global_logits_fp32 = batch * seq * vocab * F32
    assert report.peak_phase == "backward"
    assert report.by_category["temporaries"] < global_logits_fp32


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_optimizer_state_is_made_a_chunk_at_a_time_as_one_step_makes_it(optimizer):
    """init_optimizer_state steps a few parameters at a time (DTensor's multi-tensor ops
    are quadratic in their tensor count): every parameter ends with the state one step
    over all of them gives it, and no gradient."""
    def state_of(chunk: int | None) -> list[dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))   # 10 parameters
        model[2].requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), **{optimizer: True})
        if chunk is None:   # one plain step on zero gradients
            for p in model.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            init_optimizer_state(opt, chunk=chunk)
        assert all(p.grad is None for p in model.parameters())
        return [opt.state.get(p, {}) for p in model.parameters()]

    want = state_of(None)
    assert sum(bool(s) for s in want) == 8      # the frozen Linear has none
    for chunk in (1, 3, 100):
        got = state_of(chunk)
        assert [sorted(s) for s in got] == [sorted(s) for s in want]
        for a, b in zip(got, want, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), key
    with pytest.raises(ValueError, match="chunk"):
        init_optimizer_state(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), chunk=0)
