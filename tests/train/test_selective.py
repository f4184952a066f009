"""Selective recomputation at run time (issue 30 item 4): the attention cores run under a
non-reentrant checkpoint, which changes no number, and keep less for backward."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dtdsl.data.sample import make_batch
from dtdsl.ir import program as ir
from dtdsl.models.multimodal import build_model, loss_normalizer, microbatch_loss
from dtdsl.models.transformer import CrossAttention, SelfAttention
from dtdsl.parallel.recompute import apply_ac
from tests.helpers.runs import check, plan_for, spec

ROOT = Path(__file__).resolve().parents[2]


def _loss_and_grads(model, samples):
    model.zero_grad(set_to_none=True)
    loss = microbatch_loss(model, samples, loss_normalizer(model, samples)).total
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_selective_changes_no_loss_or_gradient():
    """Every unit of the tiny spec (ViT, Llama-style backbone, U-Net) with its attention
    cores recomputed: the loss and every gradient as without, within 1e-6 (fp32)."""
    program = spec(8)
    torch.manual_seed(0)
    plain = build_model(program)
    selective = copy.deepcopy(plain)
    apply_ac(selective.units, lambda name: ir.Recompute.SELECTIVE
             if name in {m.name for m in program.modules} else ir.Recompute.NONE)
    cores = [m for m in selective.modules() if isinstance(m, (SelfAttention, CrossAttention))]
    assert cores and all(m.recompute_core for m in cores)
    assert not any(m.recompute_core for m in plain.modules()
                   if isinstance(m, (SelfAttention, CrossAttention)))
    samples = make_batch(program, 0)[:4]
    assert any(s.images for s in samples) and any(s.targets for s in samples)
    want_loss, want = _loss_and_grads(plain, samples)
    got_loss, got = _loss_and_grads(selective, samples)
    assert torch.allclose(got_loss, want_loss, rtol=0, atol=1e-6)
    assert got.keys() == want.keys() and len(want) > 0
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=1e-6, atol=1e-6), name


def _saved_bytes(attention: SelfAttention, x: torch.Tensor) -> int:
    """Bytes of the distinct activation storages autograd keeps for ``attention(x)``'s
    backward (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x)
    return sum(seen.values())


def test_selective_drops_the_queries_keys_and_values():
    """What the cost model says selective saves (``cost.unit._attention_core_bytes``, fp32
    here: 4 bytes an element): the rotated queries and keys and the values, beyond which
    only attention's statistics and the rotary table go (the layer keeps ``x`` anyway).
    The output projection's input is attention's output, kept either way."""
    torch.manual_seed(0)
    batch, seq, dim, heads, kv_heads, d = 2, 32, 64, 4, 2, 16
    attention = SelfAttention(dim, heads, kv_heads, d, causal=True,
                              rope=ir.RoPE(theta=10000.0))
    x = torch.randn(batch, seq, dim, requires_grad=True)
    whole = _saved_bytes(attention, x)
    attention.recompute_core = True
    kept = _saved_bytes(attention, x)
    qkv = batch * seq * (heads + 2 * kv_heads) * d * 4
    statistics = batch * heads * seq * 4
    rotary = 2 * seq * d * 4          # cosines and sines of this call's positions
    assert whole - kept == qkv + statistics + rotary


def test_selective_trains_as_the_reference():
    """The runtime with selective recomputation of the encoder and backbone (pipelined)
    matches the one-process reference, as full recomputation does."""
    base = spec(8)
    modules = tuple(m.model_copy(update={"recompute": ir.Recompute.SELECTIVE
                                         if m.name in ("vit", "llm") else ir.Recompute.NONE})
                    for m in base.modules)
    program = base.model_copy(update={"modules": modules})
    check(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 2, 1, 2), ("gen", "generator", 1, 1, 1)), 4)


@pytest.mark.slow
def test_memcheck_of_a_selective_backbone_is_within_the_tolerance(tmp_path, capsys):
    """mllm_9b with its backbone's attention cores recomputed (`recompute = selective`):
    every stage the runtime builds peaks within 15% of the cost model, under the shipped
    zero_bubble schedule (every backbone stage holding its first stage's microbatches)."""
    from dtdsl import cli

    text = (ROOT / "specs" / "mllm_9b.dt").read_text()
    assert "= zero_bubble" in text
    head = "vocab=128256,\n                       swiglu)\n"
    assert head in text
    spec_path = tmp_path / "mllm_9b.dt"
    spec_path.write_text(text.replace(head, head + "    recompute = selective\n", 1))
    assert cli.main(["memcheck", str(spec_path), "--json", "--jobs", "2"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages
    for s in stages:
        error = (s["measured_bytes"] - s["predicted_bytes"]) / s["predicted_bytes"]
        assert abs(error) <= 0.15, (s["unit"], s["stage"], error)
