"""Checkpoint tests' shared setup: the tiny program and plan A they save and resume,
the reference they compare with, and the steps that start and close a run."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import (
    Checkpointer,
)
from dtdsl.train.executor import StageExecutor
from dtdsl.train.reference import train_reference
from tests.dist import run
from tests.helpers import shared
from tests.helpers.runs import LOSS_RTOL, PARAM_RMS, PARAM_RTOL, plan_for, spec

PROGRAM = spec(8)



# A: the backbone data parallel (ZeRO-1 shards its Adam state over 2 ranks)
PLAN_A = plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                  ("gen", "generator", 1, 1, 1))



@cache
def _reference() -> tuple[list[float], dict[int, dict[str, tuple[torch.Tensor, ...]]]]:
    """The reference's losses of TOTAL steps, and per step count in (4, 6, 8) every
    parameter's (initial, value after that many steps): run once a test run
    (``tests.helpers.shared``)."""
    def make() -> tuple[dict[str, torch.Tensor], list[float]]:
        torch.set_num_threads(1)
        model = build_model(PROGRAM)
        tensors = {f"init/{n.removeprefix('units.')}": p.detach().clone()
                   for n, p in model.named_parameters()}
        losses = []
        for r in train_reference(PROGRAM, TOTAL, model=model):
            losses.append(r["loss"])
            if r["step"] + 1 in _AT:
                tensors.update({f"{r['step'] + 1}/{n.removeprefix('units.')}": p.detach().clone()
                                for n, p in model.named_parameters()})
        return tensors, losses

    tensors, losses = shared.tensors_and_json(
        f"checkpoints-{shared.digest(PROGRAM, TOTAL, _AT)}", make)
    names = [k.removeprefix("init/") for k in tensors if k.startswith("init/")]
    return losses, {at: {n: (tensors[f"init/{n}"], tensors[f"{at}/{n}"]) for n in names}
                    for at in _AT}


_AT = (4, 6, 8)     # the step counts whose parameters the reference keeps



def _phase(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
           steps: int, saves: dict[int, str], out: str,
           want: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """Resume from ``run_dir`` (or start), train ``steps`` steps, save after the steps in
    ``saves`` (step -> mode); rank 0 writes the first step and the losses to ``out``;
    with ``want`` the full parameters at the end are checked against the reference's."""
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    logs: list[str] = []
    with _over_the_groups_there_are():
        ckpts = {mode: Checkpointer(ex, run_dir, keep=3, mode=mode, log=logs.append)
                 for mode in ("sync", "thread")}
        first = ckpts["sync"].resume()
        losses = []
        for step in range(first, first + steps):
            losses.append(ex.run_step(step)["loss"])
            if step + 1 in saves:
                ckpts[saves[step + 1]].save(step + 1)
        for c in ckpts.values():
            c.close()
    if want is not None:
        for name, p in ex.full_parameters().items():
            init, ref = want[name]
            err = (p - ref).norm().item()
            assert err <= PARAM_RTOL * (ref - init).norm().item() + 1e-7, (name, err)
            assert err <= PARAM_RMS * ref.numel() ** 0.5, (name, err)
    if rank == 0:
        Path(out).write_text(json.dumps({"first": first, "losses": losses, "logs": logs}))



def _go(plan: Plan, run_dir: Path, steps: int, saves: dict[int, str], out: Path,
        want_at: int | None = None) -> dict:
    want = _reference()[1][want_at] if want_at is not None else None
    run(_phase, plan.gpus_used, PROGRAM, plan, str(run_dir), steps, saves, str(out), want,
        timeout=240)
    return json.loads(out.read_text())



def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=LOSS_RTOL)


TOTAL = 8


@contextlib.contextmanager
def _over_the_groups_there_are() -> Iterator[None]:
    """Fail on any process group created in the block, and on any collective or
    point-to-point call from another thread than the calling (training) one: a background
    save must never communicate next to the training thread."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    training = threading.get_ident()
    strays: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a process group was created: {args} {kwargs}")

    def watched(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != training:
                strays.append(f"{fn.__name__} on {threading.current_thread().name}")
            return fn(*args, **kwargs)
        return call

    with contextlib.ExitStack() as patches:
        for module in (dist, c10d):
            patches.enter_context(mock.patch.object(module, "new_group", refuse))
            patches.enter_context(mock.patch.object(module, "split_group", refuse))
            for name in COMMUNICATION:
                patches.enter_context(mock.patch.object(module, name,
                                                        watched(getattr(c10d, name))))
        yield
    assert not strays, strays


# What the ranks' threads may issue on process groups: collectives and P2P, watched
# (isend and irecv only through batch_isend_irecv: P2POp checks their identity).
COMMUNICATION = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                 "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
                 "gather", "gather_object", "recv", "reduce_scatter", "reduce_scatter_tensor",
                 "scatter", "scatter_object_list", "send")
