"""What a generated rank program runs: one trainer rank of a launch bundle.

A bundle's ``train.py`` (started by ``torchrun`` on every rank) picks the rank's program
from its rank table (``ranks/<unit>_s<stage>.py``): a module that spells out the rank's
unit, stage, layer range, TP/DP/PP coordinates, process groups and schedule as data in a
``RankProgram`` and calls ``run``. ``run``

1. checks the program against the bundle: the rank's coordinates and groups equal those
   the plan gives (``mesh.role_of``), its action list equals the bundle's schedule;
2. initialises torch.distributed (gloo on CPUs, NCCL where CUDA is available; the
   rendezvous comes from torchrun's environment) and every process group;
3. builds the ``executor.StageExecutor`` with the rank's data feed: with preprocessing
   workers (``job.feed.workers > 0``) a ``dtdsl.feed.client.RemoteBatches`` receiving what
   the workers ship, else ``batch.LocalBatches`` building batches in-process;
4. trains the job's steps. Rank 0 writes the run directory: ``metrics.jsonl`` (per step:
   loss, its parts, the measured iteration time, the data wait, samples/s),
   ``samples.jsonl`` (per step, unit and DP replica: the keys of the samples consumed) and
   TensorBoard logs under ``tb/`` (losses, throughput, data wait, and the measured
   pipeline Gantt chart of every step next to the simulator's predicted one of the same
   plan: tags ``measured/...`` and ``predicted/...``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RankEntry", "RankProgram", "run"]


@dataclass(frozen=True)
class RankEntry:
    """One global rank of a rank program: its coordinates and the ranks of its groups."""

    replica: int
    tp_index: int
    tp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    pp_group: tuple[int, ...]


@dataclass(frozen=True)
class RankProgram:
    """A pipeline stage of one unit, as a generated rank program states it."""

    unit: str
    role: str
    stage: int
    layers: tuple[int, int]                 # [first, last) of the unit's layers
    tp: int
    dp: int
    pp: int
    ranks: Mapping[int, RankEntry]          # global rank -> its entry
    schedule: tuple[str, ...]               # the stage's actions, text form


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train.py", description="one trainer rank of a bundle "
                                "(started by torchrun; see the bundle's README)")
    p.add_argument("--run-dir", required=True, help="where metrics, samples, TensorBoard "
                   "logs and checkpoints go")
    p.add_argument("--steps", type=int, help="training steps (default: the job's)")
    p.add_argument("--port-base", type=int, help="the feed's port base (default: the job's)")
    p.add_argument("--data", help="the dataset (default: the job's)")
    return p.parse_args(argv)


def _check(program: RankProgram, rank: int, plan: Any, schedule: Any) -> None:
    """The rank program against the bundle's plan and schedule (a hand-edited or stale
    program fails here, before any collective)."""
    from dtdsl.runtime.mesh import role_of

    if rank not in program.ranks:
        raise RuntimeError(f"rank {rank} is not in the rank table of {program.unit}.s"
                           f"{program.stage} ({sorted(program.ranks)})")
    role = role_of(plan, rank)
    entry = program.ranks[rank]
    want = RankEntry(replica=role.replica, tp_index=role.tp_index, tp_group=role.tp_ranks,
                     dp_group=role.dp_ranks, pp_group=role.pp_ranks)
    if (role.unit, role.stage) != (program.unit, program.stage) or entry != want:
        raise RuntimeError(f"rank {rank}: the rank program says {program.unit}.s"
                           f"{program.stage} {entry} but plan.json gives {role.unit}.s"
                           f"{role.stage} {want}; recompile the bundle")
    actions = tuple(str(a) for a in schedule.stage(program.unit, program.stage).actions)
    if actions != tuple(program.schedule):
        raise RuntimeError(f"{program.unit}.s{program.stage}: the rank program's schedule "
                           "differs from schedule.txt; recompile the bundle")


def _data_source(job: Any, bundle: Path, program_ir: Any, override: str | None) -> Any:
    from dtdsl.runtime.batch import SyntheticSource

    if job.data.kind == "synthetic" and override is None:
        return SyntheticSource(program_ir)
    from dtdsl.feed.source import DatasetSource

    path = Path(override) if override is not None else bundle / str(job.data.path)
    return DatasetSource(program_ir, path)


class _RunLog:
    """Rank 0's writers: metrics.jsonl, samples.jsonl and TensorBoard."""

    def __init__(self, run_dir: Path, plan: Any, program_ir: Any, schedule: Any,
                 job: Any, first_step: int, steps: int):
        from dtdsl.sim.tensorboard import TimelineWriter

        self.run_dir = run_dir
        self.plan = plan
        self.metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.samples = open(run_dir / "samples.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.writer = TimelineWriter(run_dir / "tb", prefix=True)
        from dtdsl.report import plan_markdown

        self.writer.add_text("plan", plan_markdown(plan))
        self._predict(program_ir, schedule, job, first_step, steps)

    def _predict(self, program_ir: Any, schedule: Any, job: Any, first: int,
                 steps: int) -> None:
        """The simulator's timelines of the same plan and steps (its own draw of the
        spec's data), under ``predicted/``."""
        from dtdsl.cost.model import build_cost_model
        from dtdsl.sim.run import simulate_steps

        cost = build_cost_model(program_ir)
        for r in simulate_steps(program_ir, cost, self.plan, schedule, steps=steps,
                                policy=frozenset(job.reorder), first_step=first):
            self.writer.add_step(r.step, r.result.timeline(step=r.step), r.scalars())

    def step(self, result: dict[str, Any], timeline: Any, batch: Any, plan: Any) -> None:
        step, wall = result["step"], result["time_s"]
        n = len(batch.keys)
        record = {"step": step, "loss": result["loss"], "lm_loss": result["lm_loss"],
                  "gen_loss": result["gen_loss"], "grad_norm": result["grad_norm"],
                  "skipped": result["skipped"], "iteration_time_s": wall,
                  "data_wait_s": result["data_wait_s"],
                  "samples_per_s": n / wall if wall > 0 else 0.0}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        for u in plan.units:
            for replica in range(u.dp):
                keys = [batch.keys[i] for s in batch.routing
                        for i in s.samples_of(u.name, replica)]
                self.samples.write(json.dumps({"step": step, "unit": u.name,
                                               "replica": replica, "keys": keys}) + "\n")
        self.samples.flush()
        scalars = {"loss/total": result["loss"], "loss/lm": result["lm_loss"],
                   "loss/gen": result["gen_loss"], "throughput/samples_per_s":
                   record["samples_per_s"], "data/wait_s": result["data_wait_s"],
                   "data/wait_fraction": result["data_wait_s"] / wall if wall > 0 else 0.0}
        if result["grad_norm"] is not None:
            scalars["grad_norm"] = result["grad_norm"]
        self.writer.add_step(step, timeline, scalars)

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        self.writer.close()


def run(program: RankProgram, bundle: str | Path, argv: Sequence[str] | None = None) -> int:
    """Train this rank (``RANK`` / ``WORLD_SIZE`` from torchrun's environment) per the
    bundle at ``bundle``; the module docstring says how. Returns the exit status."""
    import torch
    import torch.distributed as dist

    from dtdsl.ir.plan import Plan
    from dtdsl.ir.program import Program
    from dtdsl.ir.schedule import parse_schedule
    from dtdsl.runtime.batch import LocalBatches
    from dtdsl.runtime.executor import StageExecutor, gather_timeline
    from dtdsl.runtime.job import load_job
    from dtdsl.runtime.mesh import build_groups

    args = _parse(argv)
    bundle = Path(bundle)
    job = load_job(bundle)
    program_ir = Program.model_validate_json((bundle / job.program_file).read_bytes())
    plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
    schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != job.world_size:
        raise RuntimeError(f"started with {world} ranks; the bundle needs {job.world_size}")
    _check(program, rank, plan, schedule)
    steps = args.steps if args.steps is not None else job.steps
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(max(1, int(os.environ.get("DTDSL_THREADS", "1"))))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    log = None
    try:
        groups = build_groups(plan)
        if job.feed.workers > 0:
            from dtdsl.feed.client import RemoteBatches

            feed: Any = RemoteBatches(job, bundle, program_ir, plan, groups.role,
                                      port_base=args.port_base)
        else:
            feed = LocalBatches(program_ir, plan, groups.role,
                                source=_data_source(job, bundle, program_ir, args.data),
                                policy=frozenset(job.reorder))
        ex = StageExecutor(program_ir, plan, schedule, rank=rank, groups=groups, feed=feed)
        first = 0
        if rank == 0:
            log = _RunLog(run_dir, plan, program_ir, schedule, job, first, steps)
        start = time.perf_counter()
        for step in range(first, first + steps):
            result = ex.run_step(step)
            timeline = gather_timeline(plan, step, result["events"])
            if log is not None:
                assert ex.batch is not None
                log.step(result, timeline, ex.batch, plan)
                print(f"step {step + 1}/{first + steps}  loss {result['loss']:.5f}  "
                      f"{result['time_s'] * 1e3:.0f} ms  data wait "
                      f"{result['data_wait_s'] * 1e3:.1f} ms  "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
        if hasattr(feed, "close"):
            feed.close()
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()
    return 0
