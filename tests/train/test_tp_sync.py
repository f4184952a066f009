"""Parameters replicated over a TP group stay equal on its ranks (issue 28 item 5).

On a GPU, nondeterministic kernels give the TP ranks' copies of a replicated parameter
(norms, patch and position embeddings, projectors, a U-Net's convolutions, a whole
``tp_replicated`` module) gradients that differ in their last bits, and without a
synchronisation the copies drift apart. Here a hook adds rank-dependent noise to those
gradients (the CPU's kernels are deterministic, so the noise stands in for a GPU's), and
after a few steps every replicated parameter must still be bitwise the same on both TP
ranks: ``Stage.reduce_gradients`` averages their gradients over TP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtdsl.cost import flops
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.fsdp import param_groups
from dtdsl.parallel.mesh import build_groups
from dtdsl.parallel.tp import local_tensor
from dtdsl.schedule.lower import lower
from dtdsl.train import stage as stage_module
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.plans import colocate
from tests.helpers.runs import plan_for, spec

STEPS = 2       # the noise makes the copies differ from the first step on
NOISE = 1e-3


def _noisy(reduce_gradients):
    """``Stage.reduce_gradients`` after adding noise that depends on the TP rank to the
    unsharded gradient of every parameter TP left replicated (what nondeterministic
    kernels would do): deterministic, seeded by the step and the parameter's position."""
    calls = [0]

    def patched(self):
        calls[0] += 1
        state = self.module._get_fsdp_state()
        position = 0
        for member in state._state_ctx.all_states:
            for group in param_groups(member):
                for fp in group.fsdp_params:
                    position += 1
                    spec = getattr(fp, "_unsharded_dtensor_spec", None)
                    if spec is not None and any(p.is_shard() for p in spec.placements):
                        continue
                    grad = fp.unsharded_accumulated_grad
                    if grad is None and hasattr(fp, "_unsharded_param"):
                        grad = fp.unsharded_param.grad
                    if grad is None:
                        continue
                    local = local_tensor(grad)
                    gen = torch.Generator().manual_seed(1000 * calls[0] + position)
                    noise = torch.randn(local.shape, generator=gen, dtype=local.dtype)
                    with torch.no_grad():
                        local.add_(noise, alpha=NOISE * (1 + self.role.tp_index))
        return reduce_gradients(self)

    return patched


def _train(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    stage_module.Stage.reduce_gradients = _noisy(stage_module.Stage.reduce_gradients)
    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    ex.train(STEPS)
    st = ex.stage
    group = st.tp_group
    assert group is not None and dist.get_world_size(group) == 2
    synced = set(st.tp_synced)
    replicated = [n for n in ex.named_parameters() if n not in st.tp_sharded]
    assert synced and synced <= set(replicated)
    # Sequence-parallel norms: FSDP2 sums their Partial gradients over TP itself.
    assert not any(".attn_norm." in n or ".mlp_norm." in n
                   for n in synced if n.startswith("llm."))
    unequal = []
    for name in replicated:
        local = local_tensor(ex.named_parameters()[name].detach()).contiguous()
        copies = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(copies, local, group=group)
        if not torch.equal(copies[0], copies[1]):
            unequal.append(name)
    assert not unequal, f"rank {rank}: TP copies differ: {unequal}"
    # Every element synced counts in the cost model's figure (its DP shard here is all).
    numel = sum(ex.named_parameters()[n].numel() for n in synced)
    assert numel == sum(_synced_params(program, plan, u) for u in ("vit", "llm", "gen")), \
        (numel, sorted(synced))


def _synced_params(program: ir.Program, plan: Plan, name: str) -> float:
    """The cost model's count of the parameters a unit synchronises over its TP group,
    projectors included, where it runs on the backbone's two TP ranks."""
    unit = plan.unit(name)
    module = program.module(name)
    projectors = [p for p in program.projectors
                  if (p.source == name and module.role == "encoder")
                  or (p.target == name and module.role == "generator")]
    if unit.tp_replicated:
        return flops.module_params(module) + sum(
            flops.projector_params(p.arch) + flops.compression_params(p) for p in projectors)
    return flops.tp_synced_params(module) + sum(
        flops.projector_params(p.arch) + flops.compression_params(p) for p in projectors)


@pytest.mark.parametrize("replicated", [(), ("vit",)], ids=["sharded", "vit-replicated"])
def test_tp_replicated_parameters_stay_bitwise_equal(replicated, deterministic):
    # Backbone TP 2 hosting the encoder (sharded, or whole on both ranks) and the U-Net:
    # norms under sequence parallelism, a ViT's norms and patch embedding, projectors,
    # the U-Net's convolutions and its row-parallel biases, all on two ranks.
    program = spec(4)       # two microbatches: the claim is per step, not per batch size
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 2, 1, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    plan = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"tp_replicated": u.name in replicated}) for u in plan.units)})
    run(_train, plan.gpus_used, program, plan, timeout=300)
