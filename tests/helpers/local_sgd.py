"""Local SGD test helpers: a program under ``sync = local_sgd(...)``, the backbone at DP 2,
and a run resumed from a checkpoint held against an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.runs import plan_for


def local(program: ir.Program, **sync) -> ir.Program:
    """``program`` with ``train.sync = local_sgd(**sync)``."""
    return program.model_copy(update={"train": program.train.model_copy(update={
        "sync": ir.Sync(kind="local_sgd", **sync)})})


def dp2(program: ir.Program) -> Plan:
    return plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                    ("gen", "generator", 1, 1, 1))


def phase(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
          steps: int, save_at: int | None, out: str) -> None:
    """Resume from ``run_dir`` (or start), train ``steps`` steps, save after ``save_at``;
    every rank writes its losses, parameters and Local SGD statistics to ``out``."""
    from dtdsl.train.checkpoint import Checkpointer

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan, zero=program.train.mesh_zero,
                                           replica_dp=program.train.replica_dp))
    ckpt = Checkpointer(ex, run_dir, keep=3, mode="sync", log=lambda _line: None)
    first = ckpt.resume()
    losses = []
    for step in range(first, first + steps):
        losses.append(ex.run_step(step)["loss"])
        if step + 1 == save_at:
            ckpt.save(step + 1)
    ckpt.close()
    stats = [(s.stats.mean, s.stats.var, s.stats.seen, s.stats.syncs)
             for s, _, _ in ex.local_sgd.syncs]
    # Every replica's own parameters (not gathered over replicas: they differ).
    mine = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in ex.named_parameters().items()}
    torch.save({"first": first, "losses": losses, "stats": stats, "params": mine},
               f"{out}.{rank}")


def resumed_as_uninterrupted(tmp_path: Path, program: ir.Program, plan: Plan, *,
                             steps: int, save_at: int, timeout: float = 240
                             ) -> list[dict]:
    """Train ``steps`` steps whole, and again saved after ``save_at`` and resumed; assert
    the resumed steps' losses, every rank's parameters and its Local SGD statistics are
    bitwise the uninterrupted run's. Every rank's results of the whole run."""
    def go(run_dir: Path, n: int, save: int | None, name: str) -> list[dict]:
        out = str(tmp_path / name)
        run(phase, plan.gpus_used, program, plan, str(run_dir), n, save, out,
            timeout=timeout)
        return [torch.load(f"{out}.{r}") for r in range(plan.gpus_used)]

    whole = go(tmp_path / "whole", steps, None, "whole")
    go(tmp_path / "split", save_at, save_at, "first")
    second = go(tmp_path / "split", steps - save_at, None, "second")
    assert second[0]["first"] == save_at
    assert second[0]["losses"] == whole[0]["losses"][save_at:]
    for a, b in zip(whole, second, strict=True):
        assert a["stats"] == b["stats"]
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
    return whole
