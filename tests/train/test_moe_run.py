"""An MoE backbone trained by the runtime against the single-process reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from dtdsl.models.moe import MoE, moe_blocks, set_loss_scale, take_aux_losses
from dtdsl.models.multimodal import build_model
from dtdsl.train.reference import train_reference
from tests.helpers.moe import (
    ir,
    moe_spec,
)
from tests.helpers.runs import check, plan_for
from tests.specs import program


def test_moe_layers_replace_the_mlp():
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, moe_every=2")
    llm = build_model(p).unit("llm")
    kinds = [isinstance(layer.mlp, MoE) for layer in llm.layers.values()]
    assert kinds == [False, True, False, True]
    block = llm.layers["1"].mlp
    assert tuple(block.w1.shape) == (4, 64, 128)
    # coef / sequences: the step's aux loss is the mean over its 8 sequences.
    assert math.isclose(block.aux_weight, 0.001 / 8)


def test_reference_loss_includes_the_aux_loss():
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=0.5")
    without = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=0")
    a = next(train_reference(p, 1))
    b = next(train_reference(without, 1))
    # Same initial weights and batch: the first step's losses differ by the aux loss
    # alone: 0.5 x the mean over sequences, summed over 4 layers, of E * sum_e f_e P_e,
    # about top_k = 2 with a nearly uniform router at the start.
    assert a["gen_loss"] == b["gen_loss"]
    assert 0.5 * 4 * 2 * 0.9 < a["lm_loss"] - b["lm_loss"] < 0.5 * 4 * 2 * 1.5


def test_aux_gradient_reaches_the_router():
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=1")
    llm = build_model(p).unit("llm")
    x = torch.randn(2, 5, 128)
    out = llm.hidden_states(embeds=x)
    out.sum().backward()
    with_aux = llm.layers["0"].mlp.router.weight.grad.clone()
    assert float(take_aux_losses(moe_blocks(llm))) > 0
    llm.zero_grad()
    for layer in llm.layers.values():
        layer.mlp.aux_weight = 0.0
    llm.hidden_states(embeds=x).sum().backward()
    assert not torch.allclose(with_aux, llm.layers["0"].mlp.router.weight.grad)
    assert float(take_aux_losses(moe_blocks(llm))) == 0.0
    assert take_aux_losses(moe_blocks(llm)) is not None and take_aux_losses(moe_blocks(
        build_model(program()).unit("llm"))) is None


# (An MoE backbone trains in fp16 in test_ep_run's
# test_expert_parallel_in_fp16_within_the_bf16_tolerance.)
def test_aux_gradient_carries_fp16s_loss_scale():
    """Under fp16 every backward starts from the loss scale; the aux losses' gradient,
    which joins inside the layers, must carry it too: every gradient (the router's, fed
    by the aux loss as well as by the LM loss) is the scale times the unscaled one."""
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=1")
    llm = build_model(p).unit("llm")
    x = torch.randn(2, 5, 128, dtype=torch.float64)
    llm.double()
    blocks = moe_blocks(llm)
    grads = []
    for scale in (1.0, 1024.0):
        llm.zero_grad()
        set_loss_scale(blocks, SimpleNamespace(scale=scale))
        (llm.hidden_states(embeds=x).sum() * scale).backward()
        take_aux_losses(blocks)
        grads.append({n: q.grad.clone() for n, q in llm.named_parameters()
                      if q.grad is not None})
    router = "layers.0.mlp.router.weight"
    assert router in grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], 1024.0 * g, rtol=1e-12, atol=0,
                                   msg=name)


def test_moe_backbone_pipeline_matches_the_reference():
    # 4 steps: Adam's moments through several updates (4 microbatches over 2 stages).
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=0.1")
    check(p, plan_for(p, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2),
                      ("gen", "generator", 1, 1, 1)), steps=4)


def test_compile_refuses_what_the_runtime_does_not_run_yet():
    from dtdsl.codegen.support import runtime_support

    p = moe_spec()
    plan = plan_for(p, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                    ("gen", "generator", 1, 1, 1))
    assert not runtime_support(p, plan)
    llm = plan.unit("llm")

    def refused(program: ir.Program, update: dict) -> list[str]:
        units = tuple(u.model_copy(update=update) if u.name == "llm" else u
                      for u in plan.units)
        return [d.message for d in runtime_support(program, plan.model_copy(
            update={"units": units})) if d.code == "DT601"]

    # Tensor parallelism inside the experts runs, with expert parallelism too
    # (tests/train/test_ep_run.py); context parallelism runs dropless
    # (tests/train/test_cp_run.py), not with a capacity, which counts one process's tokens.
    assert refused(p, {"tp": 2, "gpus": 4}) == []
    assert refused(p, {"tp": 2, "gpus": 4, "ep": 2}) == []
    assert refused(p, {"cp": 2, "gpus": 4}) == []
    capped = moe_spec(args="experts=4, top_k=2, expert_ffn=64, capacity=1.5")
    found = refused(capped, {"cp": 2, "gpus": 4})
    assert len(found) == 1 and "MoE module llm" in found[0] and "cp 2" in found[0]
    # Expert parallelism runs, under Local SGD too where its groups lie inside a replica
    # (DT636 otherwise: tests/train/test_local_sgd_ep.py).
    assert refused(p, {"ep": 2}) == []
    local = p.model_copy(update={"train": p.train.model_copy(update={
        "sync": p.train.sync.model_copy(update={"kind": "local_sgd", "replica_dp": 2})})})
    assert refused(local, {"ep": 2}) == []
    assert llm.ep == 1
    # A dense backbone at tp 2 is no concern of this check.
    dense = program()
    units = tuple(u.model_copy(update={"tp": 2, "gpus": 4}) if u.name == "llm" else u
                  for u in plan.units)
    assert not [d for d in runtime_support(dense, plan.model_copy(update={"units": units}))
                if "MoE" in d.message]
    # fp16 runs: the aux gradient carries the loss scale (the test above).
    fp16 = p.model_copy(update={"train": p.train.model_copy(update={"precision": "fp16"})})
    assert not runtime_support(fp16)
    assert not runtime_support(p)


def test_moe_backbone_recomputed_matches_the_reference():
    # Recomputation runs each MoE layer's forward again in backward: its aux loss must
    # not be counted twice, nor its gradient given twice. Data parallel (dp 2): the MoE
    # backbone's data-parallel run.
    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, aux_loss=0.1")
    modules = tuple(m.model_copy(update={"recompute": ir.Recompute.FULL}) if m.name == "llm" else m
                    for m in p.modules)
    p = p.model_copy(update={"modules": modules})
    check(p, plan_for(p, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                      ("gen", "generator", 1, 1, 1)), steps=4)


def test_moe_layers_are_left_out_of_compiled_blocks():
    # An MoE layer's routing has data-dependent sizes: it runs eager; its dense
    # neighbours are compiled as before.
    from torch import nn

    from dtdsl.train.compiled import compile_blocks

    p = moe_spec(args="experts=4, top_k=2, expert_ffn=64, moe_every=2")
    model = build_model(p)
    stage = nn.Module()
    stage.units = nn.ModuleDict({"llm": model.unit("llm")})
    layers = model.unit("llm").layers
    names = [name for name, _, _ in compile_blocks(stage)]
    dense = [f"llm.layers.{k}" for k, layer in layers.items() if not getattr(layer, "moe", False)]
    assert names == dense and len(dense) < len(layers)
