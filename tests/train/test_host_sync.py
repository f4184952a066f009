"""No host stall inside a step: a training step reads nothing back from the device until
it ends (issue 28, item 3).

Each rank runs its steps under a dispatch-mode logger that records every read of a device
value on the host (``aten._local_scalar_dense``: ``item``, ``float``, ``bool``, ``int``
of a tensor) and every ``Tensor.tolist`` (which reads the data without dispatching), with
the action or phase it happened in. On a GPU each such read waits for every kernel queued
before it; the step's one read is the job's optimizer message (losses, gradient norm,
non-finite flag) after the last action. The logger sees the same calls on the CPU: the
path the test runs is the path a GPU runs.

The image path runs on a dataset's uint8 pixels (normalised inside the encoder's ``F``,
``data.images.Pixels``), through an encoder unit and a co-located encoder. Copies from
the host to another device that block (``non_blocking=False``) and pinning inside an
action are recorded too (the feed pins, the training thread copies without blocking);
on this CPU-only machine no copy crosses devices, so those two checks bite on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.plans import colocate
from tests.helpers.runs import plan_for, spec

_READ = torch.ops.aten._local_scalar_dense.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_PIN = (torch.ops.aten._pin_memory.default,)


class _HostReads(TorchDispatchMode):
    """Counts host reads of device values by (phase, dtdsl call site)."""

    def __init__(self, phase: list[str], reads: Counter):
        super().__init__()
        self.phase, self.reads = phase, reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _READ:
            self.reads[(self.phase[0], "item " + _site())] += 1
        elif func in _PIN:
            self.reads[(self.phase[0], "pin " + _site())] += 1
        elif func in _COPIES and _blocking_upload(func, args, kwargs):
            self.reads[(self.phase[0], "blocking copy " + _site())] += 1
        return func(*args, **kwargs)


def _blocking_upload(func, args, kwargs) -> bool:
    """A copy from host memory to another device that waits for the device
    (``non_blocking`` false)."""
    if func is torch.ops.aten._to_copy.default:
        source, target = args[0], kwargs.get("device") or args[0].device
    else:
        target, source = args[0].device, args[1]
    return (source.device.type == "cpu" and torch.device(target).type != "cpu"
            and not kwargs.get("non_blocking", False))


def _as_pixels(batch):
    """``batch`` with its float images in [-1, 1] (the synthetic data's) as the uint8
    pixels a dataset's feed delivers."""
    samples = {i: dataclasses.replace(s, images=tuple(
        ((im + 1) * 127.5).round().clamp(0, 255).to(torch.uint8) for im in s.images))
        for i, s in batch.samples.items()}
    return dataclasses.replace(batch, samples=samples)


def _site() -> str:
    """The innermost dtdsl frame of the caller."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/dtdsl/" in frame.filename:
            return f"{frame.filename.split('/dtdsl/')[1]}:{frame.lineno} {frame.name}"
    return "?"


def _steps(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    # The transfer-ordering check (a debugging aid, off in jobs) reads each message's
    # descriptor on the host by design.
    os.environ["DTDSL_P2P_CHECK"] = "0"
    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    assert not ex.p2p.check
    ex.run_step(0)      # first-step work (lazy builds, caches) is not the steady state
    phase = ["step"]
    normalised: Counter = Counter()     # (phase, dtype) of the images Pixels was given
    if ex._pixels is not None:
        normalise = ex._pixels

        def pixels(x):
            normalised[(phase[0], x.dtype)] += 1
            return normalise(x)

        ex._pixels = pixels
    phase = ["step"]
    reads: Counter = Counter()
    run_action, batch = ex._run, ex.feed.batch

    def fed(step):
        # The feed builds batches on the host (workers, or here in process): host data.
        phase[0] = "feed"
        try:
            return _as_pixels(batch(step))
        finally:
            phase[0] = "step"

    def logged_run(index, action):
        phase[0] = f"action {action.kind.value}"
        try:
            return run_action(index, action)
        finally:
            phase[0] = "step"

    tolist = torch.Tensor.tolist

    def logged_tolist(self):
        reads[(phase[0], "tolist " + _site())] += 1
        return tolist(self)

    ex._run, ex.feed.batch = logged_run, fed
    torch.Tensor.tolist = logged_tolist
    try:
        with _HostReads(phase, reads):
            ex.run_step(1)      # one steady step: the claim is per step
    finally:
        torch.Tensor.tolist = tolist
    inside = {k: n for k, n in reads.items() if k[0].startswith("action")}
    assert not inside, f"rank {rank}: host reads inside actions: {inside}"
    # After the actions: the optimizer's one message, read once per step.
    step = {k: n for k, n in reads.items() if k[0] == "step"}
    assert sum(step.values()) == 1, f"rank {rank}: host reads in one step: {step}"
    if ex._pixels is not None and ex.role.is_first_stage:
        # The feed's uint8 pixels reached the device and were normalised inside F.
        assert set(normalised) == {("action F", torch.uint8)}, normalised


@pytest.mark.parametrize(("layout", "hosted"), [
    ((("vit", "encoder", 1, 1, 2), ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)),
     ()),
    ((("vit", "encoder", 2, 1, 1), ("llm", "backbone", 2, 1, 1), ("gen", "generator", 1, 1, 1)),
     ()),
    # The encoder on the backbone's first stage, packing its images inside F.
    ((("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 1, 1), ("gen", "generator", 1, 1, 1)),
     ("vit",)),
], ids=["pp", "tp2", "colocated"])
def test_a_step_reads_the_device_once_after_its_last_action(layout, hosted):
    # Two microbatches (the pipeline's two stages need two): every action kind runs more
    # than once in a step; more add nothing to a per-step count.
    program = spec(4)
    plan = plan_for(program, *layout)
    if hosted:
        plan = colocate(program, plan, *hosted)
    run(_steps, plan.gpus_used, program, plan, timeout=180)
