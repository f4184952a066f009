"""What a generated rank program runs: one trainer rank of a launch bundle.

A bundle's ``train.py`` (started by ``torchrun`` on every rank) picks the rank's program
from its rank table (``ranks/<unit>_s<stage>.py``): a module that spells out the rank's
unit, stage, layer range, TP/DP/PP coordinates, process groups and schedule as data in a
``RankProgram`` and calls ``run``. ``run``

1. checks the program against the bundle: the rank's coordinates and groups equal those
   the plan gives (``mesh.role_of``), its action list equals the bundle's schedule;
2. initialises torch.distributed (NCCL on GPUs, gloo on CPUs; the rendezvous comes from
   torchrun's environment) over the plan's ranks and the process groups. Every node is
   launched with ``gpus_per_node`` processes; when the plan's ranks do not fill the last
   node, the processes torchrun numbers past them are spares that exit at once (``Job.
   spares``), whichever node comes last in its rendezvous order. A rank's role follows
   from its ``RANK`` after the rendezvous, nothing from host names;
3. builds the ``executor.StageExecutor`` with the rank's data feed: with preprocessing
   workers (``job.feed.workers > 0``) a ``dtdsl.feed.client.RemoteBatches`` receiving what
   its node's workers ship (the node's feed directory, ``--feed-dir`` or
   ``$DTDSL_FEED_DIR``), else ``batch.LocalBatches`` building batches in-process;
4. resumes (``--resume``, or any later attempt of the same launch: ``_resume_decision``)
   from the newest complete checkpoint of the run directory (``checkpoint.Checkpointer``;
   resharded when it was written under another plan), or starts at step 0;
5. trains up to the job's step count (``--steps``: the total, also when resuming), saving
   a checkpoint every ``job.checkpoint.every`` steps (``--checkpoint-mode``: ``thread``
   writes in the background, ``sync`` on the training thread). Rank 0 writes the run
   directory: ``metrics.jsonl`` (per step: loss, its parts, the measured iteration time,
   the data wait, samples/s, and the seconds a checkpoint save took on the training thread
   where one was saved), ``samples.jsonl`` (per step, unit and DP replica: the keys of the
   samples consumed), ``timelines.jsonl`` (per step, the measured timeline and the
   predicted one, for jobs of at most ``TIMELINE_RANKS`` ranks) and TensorBoard logs
   under ``tb/`` (losses, throughput, data wait, and the measured pipeline Gantt chart
   next to the simulator's prediction for the very batch the step trained on (its
   samples' sizes from the data source, routed as the run routed them): tags
   ``measured/...`` and ``predicted/...``). The measured timeline is gathered to rank 0
   only, every ``timelines.telemetry_every`` steps: every step for small jobs, so that
   rank 0 receives at most ``TELEMETRY_BYTES`` (64 KiB) per step on average. TensorBoard,
   the predictions and ``timelines.jsonl`` are written by a child process of rank 0
   (``_Telemetry``): the training step never waits for them nor shares its GIL with
   them, and when the charts fall behind, steps go without charts rather than the run
   slowing down.

**Resuming at step k** keeps the lines of steps before k in ``metrics.jsonl``,
``samples.jsonl`` and ``timelines.jsonl`` and drops the later ones (the steps after the
checkpoint that a killed run had done: they run again), so a run ends with exactly one
line per step, the last run's; TensorBoard is told to purge its events from step k on
(``purge_step``). A start at step 0 of a new launch (no ``--resume``, or a resume that
finds no checkpoint) never empties an earlier run's lines: ``metrics.jsonl``,
``samples.jsonl``, ``timelines.jsonl`` and ``tb/`` move to ``replaced-<time>/``; a fresh
start also moves an earlier run's checkpoints aside to ``checkpoints.replaced-<time>/``
so that a restart of this run cannot load them (``launch.sh`` refuses a fresh start into
such a directory instead, and lets one launch at a time use it: ``train.rundir``).

**Faults no restart changes** (``feed.faults``): a stale bundle, a resume from a
checkpoint of another spec, a full disk, a job key others may read, bad weights or data,
a stage the bundle's program and plan cannot build.
The rank that meets one records it for the launch and waits to be stopped; the launch's
supervisor stops torchrun and prints the one line (``train.supervise``). Any other error
is raised, and torchrun restarts the job.

**Fault injection** (tests): ``DTDSL_FAULT=rank<r>@<s>`` kills trainer rank ``r`` with
SIGKILL when it reaches step ``s``, once per run directory (``dtdsl.feed.faults.fault_point``,
marker files under ``faults/``); torchrun then restarts every rank and they resume.
``rank<r>@<s>:enospc`` makes rank ``r``'s save of the checkpoint of step ``s`` fail as on
a full disk (``OSError(ENOSPC)``), every time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dtdsl.ir.job import RankEntry, RankProgram
from dtdsl.train.rundir import RECORDS

__all__ = ["TIMELINE_RANKS", "data_source", "exit_process", "run"]

# Jobs of at most this many ranks write every step's timelines to timelines.jsonl.
TIMELINE_RANKS = 64




def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train.py", description="one trainer rank of a bundle "
                                "(started by torchrun; see the bundle's README)")
    p.add_argument("--run-dir", required=True, help="where metrics, samples, TensorBoard "
                   "logs and checkpoints go")
    p.add_argument("--steps", type=int, help="training steps (default: the job's)")
    p.add_argument("--feed-dir", help="the node's feed directory, where its workers "
                   "connect (default: $DTDSL_FEED_DIR, which launch.sh sets)")
    p.add_argument("--data", help="the dataset (default: the job's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete "
                   "checkpoint in the run directory (torchrun restarts always do)")
    p.add_argument("--checkpoint-mode", choices=("thread", "sync"), default="thread",
                   help="thread: save in the background (default); sync: on the training "
                   "thread")
    return p.parse_args(argv)


def _check(program: RankProgram, rank: int, plan: Any, schedule: Any) -> None:
    """The rank program against the bundle's plan and schedule (a hand-edited or stale
    program fails here, before any collective)."""
    from dtdsl.parallel.mesh import role_of

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


def data_source(job: Any, bundle: Path, program_ir: Any, override: str | None) -> Any:
    """The samples' source of a bundle's job: its dataset (or ``override``), or the spec's
    synthetic draw. Read by the in-process feed, rank 0's predictions and the dry run."""
    from dtdsl.data.batch import SyntheticSource

    if job.data.kind == "synthetic" and override is None:
        return SyntheticSource(program_ir)
    from dtdsl.feed.source import DatasetSource

    path = Path(override) if override is not None else bundle / str(job.data.path)
    return DatasetSource(program_ir, path)


def _keep_before(path: Path, first: int) -> None:
    """Keep the JSON lines of ``path`` whose step is before ``first`` (a torn last line of a
    killed run goes too); written to a new file that replaces the old one."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text("utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step < first:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), "utf-8")
    os.replace(tmp, path)


def _skip_note(loss_scale: Any) -> str:
    """The step line's word on a skipped step (a non-finite gradient somewhere)."""
    if loss_scale is None:
        return "  skipped: a gradient was inf/nan"
    return (f"  skipped: a gradient overflowed, loss scale now {loss_scale.scale:g} "
            f"({loss_scale.skipped_steps} skipped so far)")


class _RunLog:
    """Rank 0's writers: metrics.jsonl and samples.jsonl on the training thread (small,
    and what a resumed run must find complete), TensorBoard, the predicted timelines and
    timelines.jsonl in a child process (``_Telemetry``): the training step never waits
    for a Gantt chart, a simulation or TensorBoard's disk."""

    def __init__(self, run_dir: Path, plan: Any, program_ir: Any, schedule: Any,
                 source: Any, first_step: int, cost: Any, *, writer_type: Any = None):
        for name in ("metrics.jsonl", "samples.jsonl", "timelines.jsonl"):
            _keep_before(run_dir / name, first_step)
        self.metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.samples = open(run_dir / "samples.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.telemetry = _Telemetry(run_dir, plan, program_ir, schedule, source, first_step,
                                    cost, writer_type=writer_type)

    def step(self, result: dict[str, Any], timeline: Any, batch: Any, plan: Any,
             checkpoint_s: float | None = None) -> None:
        step, wall = result["step"], result["time_s"]
        n = len(batch.keys)
        record = {"step": step, "loss": result["loss"], "lm_loss": result["lm_loss"],
                  "gen_loss": result["gen_loss"], "grad_norm": result["grad_norm"],
                  "skipped": result["skipped"], "iteration_time_s": wall,
                  "data_wait_s": result["data_wait_s"],
                  "samples_per_s": n / wall if wall > 0 else 0.0,
                  # samples longer than seq_len, cut there (ir.layout), and with packing
                  # the samples the step's sequences hold
                  "cut_samples": sum(z.cut for z in batch.sizes),
                  "documents": sum(z.num_docs for z in batch.sizes)}
        if checkpoint_s is not None:
            record["checkpoint_s"] = checkpoint_s
        if "dp_sync_bytes" in result:
            # bytes the job put into data-parallel collectives (train.executor)
            record["dp_sync_bytes"] = result["dp_sync_bytes"]
        if result.get("loss_scale") is not None:
            # fp16: the scale the step ran with, and the steps skipped so far
            record["loss_scale"] = result["loss_scale"]
            record["skipped_steps"] = result["skipped_steps"]
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
                   "data/wait_fraction": result["data_wait_s"] / wall if wall > 0 else 0.0,
                   "data/cut_samples": record["cut_samples"],
                   "data/documents": record["documents"]}
        if result["grad_norm"] is not None:
            scalars["grad_norm"] = result["grad_norm"]
        if checkpoint_s is not None:
            scalars["checkpoint/save_s"] = checkpoint_s
        if "dp_sync_bytes" in record:
            scalars["comm/dp_sync_bytes"] = record["dp_sync_bytes"]
        if "loss_scale" in record:
            scalars["loss_scale"] = record["loss_scale"]
            scalars["skipped_steps"] = record["skipped_steps"]
        self.telemetry.put(step, scalars, timeline, batch)

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        self.telemetry.close()


class _Telemetry:
    """Rank 0's TensorBoard writer, the simulator's prediction of each step and
    timelines.jsonl, in a process of their own (``_telemetry_main``): drawing Gantt
    charts and simulating would compete with the training thread for the GIL.

    The child is started with multiprocessing's "spawn" context and fed over its anonymous
    pipe (``multiprocessing.Queue``): what crosses is pickled, which is safe here because
    both ends are this job's own processes and nothing else can write to the pipe. Per
    step only data crosses: the scalars, the measured timeline, the step's sample sizes
    (``source.sizes``: no pixel) and routing (``data.batch.routing_of``: numpy arrays);
    never the batch's tensors nor the data source itself (the child needs neither). The
    child does not import torch (about 1.5 CPU-s a launch): nothing it unpickles or runs
    needs it (``sim.tensorboard``, ``cost.samples.sized_samples``).

    ``put`` only queues. Scalars are never dropped; the measured timeline of a step (and so
    its Gantt charts and prediction) is, when ``MAX_CHARTS_BEHIND`` of them already wait
    (a counter shared with the child, which counts down as it draws): a run whose charts
    cannot keep up gets fewer charts, never a slower step (``skipped`` counts them,
    reported at close). A failure there is reported once and ends the telemetry, not the
    run (``failed``: its message). ``close`` waits for what is queued. The child leaves
    by itself when this process dies without closing it."""

    MAX_CHARTS_BEHIND = 4

    def __init__(self, run_dir: Path, plan: Any, program_ir: Any, schedule: Any,
                 source: Any, first_step: int, cost: Any, *, writer_type: Any = None):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.source, self.plan = source, plan
        self.skipped = 0
        self._failed: str | None = None
        self._closed = False
        self._charts = ctx.Value("i", 0)    # measured timelines queued, not yet drawn
        self._inbox: Any = ctx.Queue()
        self._outbox: Any = ctx.Queue()
        self._process = ctx.Process(
            target=_telemetry_main, name="dtdsl-telemetry", daemon=True,
            args=(self._inbox, self._outbox, self._charts, os.getpid(), run_dir, plan,
                  program_ir, schedule, first_step, cost, writer_type))
        self._process.start()

    @property
    def failed(self) -> str | None:
        """Why the telemetry stopped (None while it works)."""
        if not self._closed:
            self._poll()
        return self._failed

    def _poll(self, *, closing: bool = False) -> None:
        """Takes in what the child reported; a child gone before ``close`` failed."""
        import queue

        while self._failed is None:
            try:
                kind, text = self._outbox.get_nowait()
            except queue.Empty:
                break
            if kind == "failed":
                self._failed = text
        if self._failed is None and not closing and not self._process.is_alive():
            self._failed = f"the telemetry process exited (code {self._process.exitcode})"
            print(f"telemetry stopped: {self._failed}", flush=True)

    def put(self, step: int, scalars: dict[str, float], timeline: Any, batch: Any) -> None:
        """Queue one step's telemetry (``timeline``: None when not gathered this step)."""
        if self.failed is not None:
            return
        sizes = routing = None
        with self._charts.get_lock():
            if timeline is not None and self._charts.value >= self.MAX_CHARTS_BEHIND:
                timeline = None
                self.skipped += 1
            if timeline is not None:
                self._charts.value += 1
        if timeline is not None:    # what the prediction of this very batch needs
            from dtdsl.data.batch import routing_of

            sizes, routing = self.source.sizes(step), routing_of(self.plan, batch.routing)
        self._inbox.put((step, scalars, timeline, sizes, routing))

    def close(self) -> None:
        if self._process.is_alive():
            self._inbox.put(None)
        self._process.join()
        self._poll(closing=True)
        self._closed = True
        self._inbox.close()
        self._outbox.close()
        if self.skipped:
            print(f"telemetry: {self.skipped} step(s) without charts (the charts fell "
                  f"behind by {self.MAX_CHARTS_BEHIND})", flush=True)


def _telemetry_main(inbox: Any, outbox: Any, charts: Any, parent: int, run_dir: Path,
                    plan: Any, program_ir: Any, schedule: Any, first_step: int, cost: Any,
                    writer_type: Any) -> None:
    """The telemetry process (``_Telemetry``): writes what ``inbox`` brings until None,
    or until its parent (pid ``parent``) is gone."""
    import queue

    work = None
    failed = False
    try:
        work = _TelemetryWork(run_dir, plan, program_ir, schedule, first_step, cost,
                              writer_type)
    except Exception as err:       # telemetry must not take the run down
        failed = True
        _report(outbox, f"telemetry could not start: {err!r}")
    while True:
        try:
            item = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:      # the trainer died without closing us
                break
            continue
        if item is None:
            break
        step, scalars, timeline, sizes, routing = item
        try:
            if not failed and work is not None:
                work.write(step, scalars, timeline, sizes, routing)
        except Exception as err:
            failed = True
            _report(outbox, f"telemetry stopped at step {step}: {err!r}")
        finally:
            if timeline is not None:
                with charts.get_lock():
                    charts.value -= 1
    if work is not None:
        work.close()


def _report(outbox: Any, text: str) -> None:
    print(text, flush=True)
    outbox.put(("failed", text))


class _TelemetryWork:
    """What the telemetry process writes: TensorBoard (``tb/``), timelines.jsonl, and the
    simulator's prediction of each charted step."""

    def __init__(self, run_dir: Path, plan: Any, program_ir: Any, schedule: Any,
                 first_step: int, cost: Any, writer_type: Any = None):
        from dtdsl.reorder.workload import WorkModel
        from dtdsl.sim.simulate import Simulator
        from dtdsl.sim.tensorboard import TimelineWriter, purge_from

        if first_step > 0 and (run_dir / "tb").is_dir():
            # Events of the steps that run again are purged from view (TensorBoard reads
            # the files in name order: this one sorts before the writer's below).
            purge_from(run_dir / "tb", first_step)
        self.plan, self.program, self.cost = plan, program_ir, cost
        self.writer = (writer_type or TimelineWriter)(run_dir / "tb", prefix=True)
        from dtdsl.report import plan_markdown

        # At the step the run starts from: a resumed run's plan (the same or another it
        # resharded to) beside the one before, the steps before it kept.
        self.writer.add_text("plan", plan_markdown(plan), step=first_step)
        # Per step the measured and the predicted timeline (``ir.timeline.Timeline``
        # JSON), for jobs small enough that their events stay small.
        self.timelines = open(run_dir / "timelines.jsonl", "a", encoding="utf-8") \
            if plan.gpus_used <= TIMELINE_RANKS else None  # noqa: SIM115
        self.simulator = Simulator(schedule)
        self.work_model = WorkModel(cost)

    def write(self, step: int, scalars: dict[str, float], timeline: Any, sizes: Any,
              routing: Any) -> None:
        if timeline is None:        # not gathered this step (timelines.telemetry_every)
            self.writer.add_scalars(step, scalars)
            return
        self.writer.add_step(step, timeline, scalars)
        predicted, predicted_scalars = _prediction(self.cost, self.plan, self.program,
                                                  self.simulator, self.work_model, step,
                                                  sizes, routing)
        self.writer.add_step(step, predicted, predicted_scalars)
        if self.timelines is not None:
            self.timelines.write(json.dumps({"step": step, "measured": timeline.to_json(),
                                             "predicted": predicted.to_json()},
                                            separators=(",", ":")) + "\n")
            self.timelines.flush()

    def close(self) -> None:
        if self.timelines is not None:
            self.timelines.close()
        self.writer.close()


def _prediction(cost: Any, plan: Any, program_ir: Any, simulator: Any, work_model: Any,
               step: int, sizes: Any, routing: Any) -> tuple[Any, dict[str, float]]:
    """The simulator's timeline of the very batch a step trained on (``sizes``: its
    samples' sizes from the data source, ``routing``: the run's, ``data.batch.routing_of``)
    and its scalars, which the telemetry writes under ``predicted/``."""
    from dtdsl.cost.samples import sized_samples
    from dtdsl.sim.run import simulate_routed

    r = simulate_routed(cost, plan, simulator, work_model, step,
                        sized_samples(program_ir, sizes), routing)
    return r.result.timeline(step=step), r.scalars()


def _aside(run_dir: Path, name: str) -> Path:
    """A new name in ``run_dir`` for what an earlier run left: ``name-<time>``, with a
    count added when a start in the same second took that one."""
    stamp = int(time.time())
    aside, n = run_dir / f"{name}-{stamp}", 1
    while aside.exists():
        aside, n = run_dir / f"{name}-{stamp}.{n}", n + 1
    return aside


def _set_aside_checkpoints(run_dir: Path) -> None:
    """A fresh start: an earlier run's checkpoints in the same directory move aside, so a
    restart of this run cannot load them (module docstring)."""
    from dtdsl.ir.checkpoint import checkpoint_root

    root = checkpoint_root(run_dir)
    if root.is_dir() and any(root.iterdir()):
        aside = _aside(run_dir, "checkpoints.replaced")
        root.rename(aside)
        print(f"a fresh start: the checkpoints of an earlier run moved to {aside} (use "
              "--resume to continue a run)", flush=True)


def _set_aside_records(run_dir: Path) -> None:
    """A start at step 0 of a new launch: an earlier run's records (``RECORDS``, ``tb/``)
    move to ``replaced-<time>/``, never emptied (module docstring)."""
    found = [run_dir / name for name in RECORDS
             if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    tb = run_dir / "tb"
    if tb.is_dir() and any(tb.iterdir()):
        found.append(tb)
    if not found:
        return
    aside = _aside(run_dir, "replaced")
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    print(f"a start at step 0: the records of an earlier run moved to {aside}", flush=True)


def _resume_decision(run_dir: Path, rank: int, asked: bool, restart: int
                     ) -> tuple[bool, bool]:
    """Whether this attempt resumes, and whether this launch has started before: one
    answer for every rank (rank 0 decides and broadcasts: a collective). It resumes when
    asked (``--resume``), on a counted torchrun restart, and whenever this launch
    (``DTDSL_LAUNCH_ID``, set once per ``launch.sh``) has started before: on several
    nodes, torchrun restarts the workers of the nodes that did not fail without counting a
    restart there, so node 0's ranks would otherwise take the restart for a fresh start."""
    import torch.distributed as dist

    from dtdsl.feed.faults import Fatal
    from dtdsl.train.rundir import check_launch_id

    decision = [asked or restart > 0, restart > 0]
    if rank == 0:
        launch = os.environ.get("DTDSL_LAUNCH_ID", "")
        if launch:
            try:
                check_launch_id(launch)
            except ValueError as err:
                raise Fatal(str(err)) from None
        marker = run_dir / "launches" / launch if launch else None
        if marker is not None and marker.exists():
            decision = [True, True]
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0]), bool(decision[1])


def _check_resumable(run_dir: Path, spec_sha256: str, program_sha256: str | None = None
                     ) -> None:
    """Fatal when the checkpoint a resume loads (the newest complete one) is of another
    spec: no restart changes that (``launch.sh``'s preflight says so before torchrun
    starts; this is for ``train.py`` run otherwise)."""
    from dtdsl.feed.faults import Fatal
    from dtdsl.ir.checkpoint import CheckpointError, latest_checkpoint, read_manifest, same_spec

    path = latest_checkpoint(run_dir)
    if path is None:
        return
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        raise Fatal(str(err)) from None
    if not same_spec(manifest, spec_sha256, program_sha256):
        raise Fatal(f"{path} was written for spec {manifest.spec} (sha256 "
                    f"{manifest.spec_sha256[:12]}...), this bundle's spec is sha256 "
                    f"{spec_sha256[:12]}...: resume it with the bundle it was trained "
                    "with, or choose another --run-dir")


def _disk_fault(rank: int, step: int, run_dir: Path) -> None:
    """Raise the OSError of a full disk when ``DTDSL_FAULT`` names ``rank<r>@<s>:enospc``
    for this rank and the checkpoint of step ``step`` (tests; every time: a full disk
    stays full)."""
    import errno

    for item in filter(None, (s.strip() for s in os.environ.get("DTDSL_FAULT", "").split(","))):
        if item == f"rank{rank}@{step}:enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                          str(run_dir / "checkpoints" / f"ckpt-{step}.tmp"))


def _load_bundle(bundle: Path, program: RankProgram, rank: int, world: int) -> Any:
    """The bundle's job, program, plan and schedule, checked against this rank program
    and the world torchrun started; Fatal when they do not fit (a restart reads the same
    files)."""
    from dtdsl.feed.faults import Fatal
    from dtdsl.ir.job import load_job
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.program import Program
    from dtdsl.ir.schedule import parse_schedule

    try:
        job = load_job(bundle)
        program_ir = Program.model_validate_json((bundle / job.program_file).read_bytes())
        plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
        schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise Fatal(f"the bundle {bundle}: {err}") from err
    if world not in (job.world_size, job.launched):
        raise Fatal(f"started with {world} ranks; the bundle needs {job.world_size} "
                    f"({job.nodes} node(s) of {job.gpus_per_node} processes)")
    if rank < job.world_size:
        try:
            _check(program, rank, plan, schedule)
        except RuntimeError as err:
            raise Fatal(str(err)) from None
    return job, program_ir, plan, schedule


def exit_process(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its run has returned: what ``sys.exit``
    does that matters (the atexit handlers run, stdout and stderr flushed) without the
    interpreter's teardown of every module and object, which only runs destructors (torch's,
    the process groups') with nothing left to save: every file the run writes is closed by
    then. That teardown took 1.4 s for ``import torch`` alone and 2 s with a gloo group on
    this machine, per rank, so a job ended seconds after its last step."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run(program: RankProgram, bundle: str | Path, argv: Sequence[str] | None = None) -> int:
    """Train this rank (``RANK`` / ``WORLD_SIZE`` from torchrun's environment) per the
    bundle at ``bundle``; the module docstring says how. Returns the exit status. An
    error no restart can change is recorded for the launch and ends it
    (``feed.faults``) instead of a torchrun restart."""
    from dtdsl.feed.faults import hold_if_fatal

    who = f"rank {os.environ.get('RANK', '?')}"
    try:
        return _run(program, Path(bundle), argv, who)
    except Exception as err:
        hold_if_fatal(err, who)
        raise


def _run(program: RankProgram, bundle: Path, argv: Sequence[str] | None, who: str) -> int:
    from dtdsl.feed.faults import hold_if_fatal

    args = _parse(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job, program_ir, plan, schedule = _load_bundle(bundle, program, rank, world)
    if rank >= job.world_size:
        print(f"rank {rank}: a spare (the plan uses ranks 0..{job.world_size - 1} of the "
              f"{world} started); exiting", flush=True)
        return 0
    trainer = _Trainer(args, job, program_ir, plan, schedule, bundle, rank)
    trainer.start()
    try:
        trainer.setup()
        trainer.train()
        trainer.finish()
    except Exception as err:
        # Recorded before the cleanup below, which may wait on peers or a save.
        hold_if_fatal(err, who)
        raise
    finally:
        trainer.close()
    return 0


class _Trainer:
    """One rank's run of a bundle, in the order ``_run`` calls its steps: ``start`` (the
    device, the process group of the plan's ranks, whether to resume), ``setup`` (groups,
    feed, executor, checkpointer, rank 0's records), ``train`` (the steps, saving as the
    job says), ``finish`` (every rank waits for the last save; the feed closes), and
    ``close``, always, even on a failure (rank 0's records, a save in flight abandoned,
    the process group)."""

    def __init__(self, args: argparse.Namespace, job: Any, program_ir: Any, plan: Any,
                 schedule: Any, bundle: Path, rank: int):
        self.args, self.job, self.program_ir = args, job, program_ir
        self.plan, self.schedule, self.bundle, self.rank = plan, schedule, bundle, rank
        self.steps = args.steps if args.steps is not None else job.steps
        self.run_dir = Path(args.run_dir)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.log: Any = None
        self.ckpt: Any = None
        self.first = 0

    def start(self) -> None:
        import torch
        import torch.distributed as dist

        from dtdsl.parallel.device import init_distributed, rank_device

        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(max(1, int(os.environ.get("DTDSL_THREADS", "1"))))
        # cuda:LOCAL_RANK with NCCL where there is a GPU, the CPU with gloo otherwise.
        self.device = rank_device()
        # The plan's ranks only: spares (rendezvous ranks past the plan's) never join.
        init_distributed(self.device, timeout_s=600, rank=self.rank,
                         world_size=self.job.world_size)
        if self.rank == 0:
            print(f"rank 0 of {self.job.world_size} on {self.device} ({dist.get_backend()}), "
                  f"{self.program_ir.train.precision}", flush=True)
        self.resume, self.again = _resume_decision(self.run_dir, self.rank, self.args.resume,
                                                   self.restart)

    def setup(self) -> None:
        from dtdsl.parallel.mesh import build_groups, cp_ulysses
        from dtdsl.train.checkpoint import Checkpointer
        from dtdsl.train.executor import StageExecutor

        job, program_ir, plan, rank = self.job, self.program_ir, self.plan, self.rank
        if not self.resume and rank == 0:
            _set_aside_checkpoints(self.run_dir)
        groups = build_groups(plan, device_type=self.device.type,
                              ulysses=cp_ulysses(program_ir, plan),
                              zero=program_ir.train.mesh_zero,
                              replica_dp=program_ir.train.replica_dp)
        # The samples' source: read by the in-process feed, and by rank 0's predictions.
        source = (data_source(job, self.bundle, program_ir, self.args.data)
                  if job.feed.workers == 0 or rank == 0 else None)
        self.feed = self._feed(groups, source)
        # A resumed run takes every parameter from its checkpoint: nothing is initialised
        # or read from pretrained weights first (unless it finds no checkpoint).
        try:
            self.ex = StageExecutor(program_ir, plan, self.schedule, rank=rank,
                                    groups=groups, feed=self.feed, device=self.device,
                                    initialize=not self.resume)
        except ValueError as err:
            # The bundle's program and plan build the same modules on every attempt: a
            # module they cannot build is no restart's to change.
            from dtdsl.feed.faults import Fatal

            raise Fatal(f"cannot build this rank's stage: {err}") from err
        # Collective (its store keys' nonce is broadcast): every rank builds it here.
        self.ckpt = Checkpointer(self.ex, self.run_dir, keep=job.checkpoint.keep,
                                 mode=self.args.checkpoint_mode, spec_sha256=job.spec_sha256)
        if self.resume and rank == 0:
            _check_resumable(self.run_dir, job.spec_sha256, job.program_sha256)
            print(f"resuming (torchrun restart {self.restart})" if self.restart else
                  "resuming", flush=True)
        self.first = self.ckpt.resume() if self.resume else 0
        if self.resume and self.ckpt.loaded is None:
            self.ex.stage.initialize(program_ir, program_ir.train.seed)
        if rank == 0:
            if self.first == 0 and not self.again:
                _set_aside_records(self.run_dir)
            from dtdsl.cost.job import job_cost_model

            self.log = _RunLog(self.run_dir, plan, program_ir, self.schedule, source,
                               self.first, job_cost_model(job.cost, program_ir, self.bundle))
            if self.first >= self.steps:
                print(f"nothing to do: the run is at step {self.first} of {self.steps}",
                      flush=True)

    def _feed(self, groups: Any, source: Any) -> Any:
        """The rank's batches: from the job's preprocessing workers, or built here."""
        from dtdsl.data.batch import LocalBatches

        job = self.job
        if job.feed.workers == 0:
            return LocalBatches(self.program_ir, self.plan, groups.role, source=source,
                                policy=frozenset(job.reorder))
        from dtdsl.feed.client import RemoteBatches
        from dtdsl.feed.node import feed_dir

        local = int(os.environ.get("LOCAL_RANK", "0"))
        node = job.node_ranks(self.rank, local, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return RemoteBatches(job, self.bundle, self.program_ir, self.plan, groups.role,
                             feed_dir=feed_dir(self.args.feed_dir), local_rank=local,
                             node_ranks=node)

    def train(self) -> None:
        from dtdsl.feed.faults import fault_point
        from dtdsl.train.timelines import gather_timeline, telemetry_every

        ex, ckpt, rank, every = self.ex, self.ckpt, self.rank, self.job.checkpoint.every
        # Measured timelines, bounded in bytes: every step for small jobs (executor).
        telemetry = telemetry_every(self.plan, self.schedule)
        start = time.perf_counter()
        if ex.local_sgd is not None:     # A-EDiT's interval counts from here, not from setup
            ex.local_sgd.start_clock(start)
        for step in range(self.first, self.steps):
            fault_point(f"rank{rank}", step, self.run_dir)
            ckpt.poll()     # a failed background save stops the run now
            timed = (step - self.first) % telemetry == 0
            result = ex.run_step(step, timed=timed)
            timeline = gather_timeline(self.plan, step, result["events"],
                                       device=self.device) if timed else None
            saved = None
            # And after the last step (as torchtitan and Megatron-LM save at the end): a
            # run's final weights are not lost for not ending on a multiple.
            if every > 0 and ((step + 1) % every == 0 or step + 1 == self.steps):
                _disk_fault(rank, step + 1, self.run_dir)
                saved = ckpt.save(step + 1)
            if self.log is not None:
                assert ex.batch is not None
                self.log.step(result, timeline, ex.batch, self.plan, checkpoint_s=saved)
                note = "" if saved is None else f"  checkpoint {saved * 1e3:.0f} ms"
                if result["skipped"]:
                    note += _skip_note(ex.loss_scale)
                print(f"step {step + 1}/{self.steps}  loss {result['loss']:.5f}  "
                      f"{result['time_s'] * 1e3:.0f} ms  data wait "
                      f"{result['data_wait_s'] * 1e3:.1f} ms{note}  "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)

    def finish(self) -> None:
        # Every rank waits here for rank 0's commit of the last save and for the saving
        # thread to end (rank 0 also for every rank to get here): no rank leaves, nor
        # destroys the process group, with a save in flight.
        if self.ex.local_sgd is not None:     # the last synchronisation's layers land
            self.ex.local_sgd.settle()
        self.ckpt.close()
        self.ckpt = None
        if hasattr(self.feed, "close"):
            self.feed.close()

    def close(self) -> None:
        import torch.distributed as dist

        if self.log is not None:
            self.log.close()
        if self.ckpt is not None:  # failing: abandon a save in flight (thread released, joined)
            self.ckpt.close(wait=False)
        dist.destroy_process_group()
