"""The zero-bubble schedule (ZB-H1) in the executor: each backward split into its input
gradients (``B``) and its weight gradients (``W``, ``train.zerobubble``), against the
single-process reference (multi-rank gloo runs)."""

from __future__ import annotations

import contextlib
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import checkpoint_root
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ActionKind
from dtdsl.schedule.lower import lower
from dtdsl.train.zerobubble import SplitBackward
from tests.dist import run
from tests.helpers.phased import _train as train_phased
from tests.helpers.plans import colocate, phase
from tests.helpers.runs import check, check_tp, plan_for, reference, spec

# 4 steps: a split backward that went wrong shows from the first step, and Adam's
# moments go through several updates.
STEPS = 4


def zero_bubble(program: ir.Program) -> ir.Program:
    """``program`` with ``schedule = zero_bubble``."""
    return program.model_copy(update={"train": program.train.model_copy(
        update={"schedule": "zero_bubble"})})


def zb_plan(plan: Plan) -> Plan:
    """``plan`` lowered as zero_bubble."""
    return plan.model_copy(update={"schedule": "zero_bubble"})


class _Tower(nn.Module):
    """Two layers over a received activation, optionally checkpointed (recomputed in
    backward), and a weight (``bias``) only an extra loss reads."""

    def __init__(self, recompute: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)
        self.bias = nn.Parameter(torch.randn(4))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

        return checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)


def _losses(tower: _Tower, x: torch.Tensor, extra: bool) -> list[torch.Tensor]:
    out = [tower(x).square().sum()]
    return out + [tower.bias.exp().sum()] if extra else out


@pytest.mark.parametrize(("recompute", "wants_grad", "extra", "ran"), [
    (False, True, False, "split"),
    (True, True, False, "split"),       # the checkpoint recomputes in B and again in W
    (False, False, False, "in W"),      # no input to send a gradient to: whole in W
    (False, True, True, "in B"),        # a weight no input reaches: whole in B
])
def test_b_then_w_gives_a_whole_backwards_gradients(recompute, wants_grad, extra, ran):
    x0 = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    whole, split = _Tower(recompute), _Tower(recompute)
    x = x0.clone().requires_grad_(wants_grad)
    torch.autograd.backward(_losses(whole, x, extra))
    stage = SimpleNamespace(module=split, backward_context=contextlib.nullcontext)
    runner = SplitBackward(stage, [SimpleNamespace(kind=ActionKind.W)])
    assert stage.early == []    # no layer reduces early: its W comes after the last B
    xs = x0.clone().requires_grad_(wants_grad)
    losses = _losses(split, xs, extra)
    runner.backward((0, 3), losses, [torch.ones(()) for _ in losses])
    assert runner.ran == {ran: 1}
    if wants_grad:      # B gave the input its gradient
        torch.testing.assert_close(xs.grad, x.grad, rtol=0, atol=0)
    # B computed no weight gradient (unless it ran whole)
    assert all((p.grad is None) == (ran != "in B") for p in split.parameters())
    runner.weights((0, 3))
    assert not runner.pending
    want = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-6, atol=1e-7)


def test_zero_bubble_backbone_over_two_stages_matches_the_reference():
    program = zero_bubble(spec(8))
    plan = zb_plan(plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)))
    schedule = lower(plan, program)
    for s in (0, 1):
        kinds = [a.kind for a in schedule.stage("llm", s).actions]
        assert kinds.count(ActionKind.W) == kinds.count(ActionKind.B) > 0
    check(program, plan, STEPS)


def test_zero_bubble_over_three_stages_with_co_located_units():
    # The encoder runs in stage 0's B (no W of its own: its images want no gradient, so
    # a microbatch's whole backward of stage 0 may run in its W), the generator in stage
    # 2's; the middle stage splits every backward.
    program = zero_bubble(spec(8))
    plan = zb_plan(colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 1, 1, 3),
                                              ("gen", "generator", 1, 1, 1)), "vit", "gen"))
    assert [u.name for u in lower(plan, program).units] == ["llm"]
    check(program, plan, STEPS)


def test_zero_bubble_data_parallel_fsdp():
    # DP 2: FSDP2 neither reduces nor reshards in a B (the W needs the unsharded weights)
    # and reduce-scatters once, after the stage's last W. Full recomputation (torch's
    # non-reentrant checkpoint) recomputes in B and again in W: the same gradients. (The
    # other zero-bubble runs split backwards without recomputation.)
    program = zero_bubble(spec(8))
    plan = zb_plan(colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 1, 2, 2),
                                              ("gen", "generator", 1, 1, 1)), "vit", "gen"))
    plan = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"recompute": ir.Recompute.FULL}) if u.role == "backbone" else u
        for u in plan.units)})
    check(program, plan, STEPS)


def test_zero_bubble_tensor_parallel_backbone():
    # TP 2 over 2 stages: the weights W differentiates are DTensors (sequence
    # parallelism's pieces, the vocabulary-parallel head under loss_parallel).
    program = zero_bubble(spec(8))
    plan = zb_plan(colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 2, 1, 2),
                                              ("gen", "generator", 1, 1, 1)), "vit", "gen"))
    # Both co-located units split over TP, their gradients counted once in the norm. 4 steps:
    # a TP layout matches from its first step, and Adam's moments go through several updates.
    check_tp(program, plan, STEPS, grad_norms=True)


def test_zero_bubble_in_fp16(tmp_path):
    # fp16's loss scale seeds B; W's weight gradients (fp16, FSDP2's unsharded weights)
    # join the fp32 accumulation FSDP2 keeps between the B's: within bf16's tolerance of
    # the fp32 reference, no step skipped.
    from tests.helpers.fp16 import check_within_bf16

    program = zero_bubble(spec(8))
    plan = zb_plan(plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)))
    check_within_bf16(program, plan, tmp_path)     # trains fp16(program)


@pytest.mark.usefixtures("deterministic")   # compares losses bitwise
def test_zero_bubble_resumes_like_an_uninterrupted_run(tmp_path):
    # W's pending weight gradients never cross a step (the last W runs before the
    # reduction), so a checkpoint after a step holds everything: a run resumed from
    # ckpt-2 takes the uninterrupted run's steps 2 and 3 bitwise.
    from tests.helpers.checkpoints import PROGRAM, _close, _go, _reference

    plan = zb_plan(plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)))
    assert any(a.kind is ActionKind.W for a in lower(plan, PROGRAM).stage("llm", 1).actions)
    ref, _ = _reference()
    a = _go(plan, tmp_path / "a", 4, {2: "sync"}, tmp_path / "a.json")
    assert a["first"] == 0
    _close(a["losses"], ref[:4])
    same = tmp_path / "same"
    shutil.copytree(checkpoint_root(tmp_path / "a") / "ckpt-2", checkpoint_root(same) / "ckpt-2")
    s = _go(plan, same, 2, {}, tmp_path / "same.json")
    assert s["first"] == 2 and s["losses"] == a["losses"][2:4]


def test_zero_bubble_beside_a_phased_encoder():
    # The phased encoder's embeddings are leaves of the backbone's first stage: its B
    # gives them their gradients (the backward phase, after the last W, reads them).
    program = zero_bubble(spec(8))
    plan = zb_plan(phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                           ("llm", "backbone", 1, 1, 2),
                                           ("gen", "generator", 1, 1, 1))))
    losses, params = reference(program, STEPS)
    # tests.helpers.phased's run: the phases' events around the schedule's actions
    run(train_phased, plan.gpus_used, program, plan, losses, params, STEPS, None, timeout=240)
