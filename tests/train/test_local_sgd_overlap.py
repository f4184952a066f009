"""train.layerwise: EDiT's layer-wise synchronisation overlapped with the next forward
gives bitwise the numbers of the blocking synchronisation (gloo), applies each layer's
outer step before that layer's first forward, finishes what no forward reached before the
optimizer step, and leaves checkpoints whole."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.layerwise import Overlap, layer_groups
from dtdsl.train.local_sgd import LocalSGD, LocalSGDConfig
from tests.dist import run
from tests.helpers.local_sgd import dp2, local, resumed_as_uninterrupted
from tests.helpers.runs import spec

# -- the mechanism, on a plain module ----------------------------------------------------------


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.layers = nn.ModuleDict({str(i): nn.Linear(6, 6) for i in range(3)})
        self.head = nn.Linear(6, 2)


class _Root(nn.Module):
    """A stage's shape: ``units.<unit>.layers``, with ends outside the layers; ``skip``:
    layers this forward leaves out (a module no microbatch reaches)."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleDict({"u": _Unit()})
        self.skip: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unit = self.units["u"]
        h = unit.embed(x)
        for key, layer in unit.layers.items():
            if key not in self.skip:
                h = torch.tanh(layer(h))
        return unit.head(h)


def _drift(model: nn.Module, replica: int, sync: int) -> None:
    g = torch.Generator().manual_seed(100 * sync + replica)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 + 0.02 * replica))


def _overlapped(rank: int, world: int) -> None:
    cfg = LocalSGDConfig(period=1, outer_lr=0.7, outer_momentum=0.9, penalty=True,
                         clip_norm=None)
    torch.manual_seed(0)
    over, block = _Root(), _Root()
    block.load_state_dict(over.state_dict())
    groups = layer_groups(over, "u", list(over.parameters()))
    # Group 0: the root with the unit's ends; then each layer in forward order.
    assert groups[0][0] is over and [m for m, _ in groups[1:]] == list(
        over.units["u"].layers.values())
    sync = LocalSGD(list(over.parameters()), cfg, layers=[ps for _, ps in groups])
    ref = LocalSGD(list(block.parameters()), cfg, layers=[
        ps for _, ps in layer_groups(block, "u", list(block.parameters()))])
    overlap = Overlap(sync, over, groups)
    seen: dict[str, torch.Tensor] = {}
    for key, layer in over.units["u"].layers.items():
        layer.register_forward_pre_hook(
            lambda _m, _a, key=key: seen.__setitem__(key, _m.weight.detach().clone()))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for step, skip in enumerate(({"1"}, set(), {"0", "2"})):
        _drift(over, rank, step)
        _drift(block, rank, step)
        sync.begin_sync()
        overlap.start()
        ref.maybe_sync(step)
        over.skip, seen = skip, {}
        over(x)           # the next step's forward: the hooks apply the outer steps
        for key in seen:  # ... each before its layer's first forward
            assert torch.equal(seen[key], block.units["u"].layers[key].weight), key
        overlap.settle()  # what the forward skipped, before the optimizer step
        for (n, a), b in zip(over.named_parameters(), block.parameters(), strict=True):
            assert torch.equal(a, b), (step, n)
    # Three forwards reached 4 + 3 + 2 of the four groups; the rest were settled.
    assert (overlap.by_hook, overlap.by_settle) == (9, 3)
    assert sync.stats.syncs == 3 and dist.get_world_size() == 2


def test_layer_hooks_apply_before_each_layer_and_settle_the_rest():
    run(_overlapped, 2)


# -- the executor: overlapped against blocking -------------------------------------------------

def _train(rank: int, world: int, program: ir.Program, plan: Plan, steps: int,
           overlap: bool, out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan, zero=program.train.mesh_zero))
    ex.local_sgd.overlap = overlap
    losses = [r["loss"] for r in ex.train(steps)]
    params = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
              for k, v in ex.named_parameters().items()}
    counts = [(o.by_hook, o.by_settle, len(o.groups)) for o in ex.local_sgd._overlaps
              if o is not None]
    torch.save({"losses": losses, "params": params, "counts": counts}, f"{out}.{rank}")


def _distributed(program: ir.Program, plan: Plan, steps: int, overlap: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        run(_train, plan.gpus_used, program, plan, steps, overlap, out, timeout=240)
        return [torch.load(f"{out}.{r}") for r in range(plan.gpus_used)]


# (In fp32: tests/train/test_local_sgd_shard.py's co-located test holds the overlapped sync
# to the blocking one bitwise.)
@pytest.mark.parametrize("precision", ["bf16"])
def test_overlapped_equals_blocking_bitwise(precision):
    # One microbatch a replica: bitwise equality does not depend on the accumulation.
    base = local(spec(4), period=2, outer_lr=0.7, outer_momentum=0.9)
    program = base.model_copy(update={"train": base.train.model_copy(
        update={"precision": precision})})
    plan = dp2(program)
    steps = 4       # synchronisations after steps 1 and 3
    over = _distributed(program, plan, steps, True)
    block = _distributed(program, plan, steps, False)
    for a, b in zip(over, block, strict=True):
        assert a["losses"] == b["losses"]
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
    # The backbone's two replicas overlapped: the sync after step 1 landed in the next
    # forward's hooks (every group reached), the last one at the end of training.
    counts = [c for r in over for c in r["counts"]]
    assert counts and all(hook == n and settle == n and n > 1
                          for hook, settle, n in counts), counts
    assert all(not c for r in block for c in r["counts"] if c[0])


@pytest.mark.usefixtures("deterministic")
def test_a_checkpoint_at_a_synchronising_step_is_whole(tmp_path):
    # Saved after step 1 (period 2: a synchronising step): the layers' outer steps are
    # still to come in the next forward; the save must finish them first, and a resumed
    # run continue as an uninterrupted one. (Resumed for step 2 alone, the forward that
    # takes the outer steps: a later synchronising step adds nothing to the claim.)
    program = local(spec(4), period=2, outer_lr=0.7, outer_momentum=0.9)
    resumed_as_uninterrupted(tmp_path, program, dp2(program), steps=3, save_at=2)
