"""Preprocessing workers: read, decode and reorder each step's samples on CPU and stream
every trainer rank of their node its part, ahead of the trainers.

Every node runs ``job.feed.workers_per_node`` workers for its own trainers (``launch.sh``
starts them before torchrun). They meet over zmq ``ipc://`` sockets in the node's feed
directory (``feed.node.feed_dir``): a worker connects one ``Sender`` to each local
trainer's inbox and one ``Subscriber`` to the node's announcements, so the sockets a
process opens do not grow with the job. Worker ``w`` of ``W`` on a node owns the training
steps ``s`` with ``s mod W == w``. For each it

1. takes the step's samples from the job's source (a dataset: ``feed.source.DatasetSource``,
   whose batches depend on the seed and step alone; or the spec's synthetic draw) and their
   sizes from the dataset's index;
2. routes them under the job's reorder policies with the simulator's rule
   (``runtime.batch.route_batch``: intra-microbatch balancing across every unit's DP
   replicas, inter-microbatch ordering of the steps for 1F1B) and computes the loss
   denominators of the batch; every node's workers compute the same routing;
3. decodes the samples its node's ranks read (images resized to whole patches, text
   tokenized, generation targets encoded; each once) and sends each of those ranks one
   ``protocol`` batch message with the routing and the parts of its samples that its
   rank reads (``data.batch.reads_of``: its stage's parts, and the images of its share of
   a phased encoder's samples).

**Which ranks.** torchrun's rendezvous decides which global ranks a node holds (and may
decide differently after a restart), so a worker does not know them in advance: the
node's first trainer (local rank 0) announces them with its progress (``ranks``, in local
rank order), and the worker sends the message of ``ranks[i]`` to local trainer ``i``.

Pacing: the node's first trainer announces the step it needs next; a worker builds step
``s`` only once ``s < next_step + prefetch``, so at most ``prefetch`` steps wait in the
trainers' queues.

Restarts: a worker killed at any point is started again by ``supervise`` with the same
index (unless it is in a crash loop, or died of an error no restart changes: then the
supervisor records that error as the launch's fatal record and gives up, and
``launch.sh`` ends the launch with its line); it resumes at its first step at or after
the trainers' progress and sends those steps again. A trainer keeps the first copy of
each step it receives and drops copies of steps it has (or had), so no sample is lost
or consumed twice. When the trainers restart (torchrun restarts them all after a
failure, and they resume from a checkpoint) their announcements carry a new session
token: every worker goes back to its first step at or after their ``next_step`` and
sends again, to the ranks the new session names (the new trainers drop copies of steps
they have, or are past). A worker exits only when the
trainers say they are done (or after ``IDLE_S`` without word), not when they pass its
last step: they may come back. ``--resume`` starts the workers at the newest complete
checkpoint's step.

Fault injection (tests): ``DTDSL_FAULT=worker<w>@<s>`` makes worker ``w`` kill itself with
SIGKILL when it reaches step ``s``, once per run directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FeedContext", "build_messages", "main", "run_worker", "supervise"]

log = logging.getLogger("dtdsl.feed.worker")

POLL_S = 0.05
MAX_RESTARTS = 20   # restarts of the node's workers in all
CRASH_LOOP = 3      # failures of one worker within CRASH_WINDOW_S: it will not recover
CRASH_WINDOW_S = 120.0
IDLE_S = 3600.0     # a worker with nothing left to send exits after this long without word


@dataclass
class _Payload:
    tokens: Any = None
    images: tuple = ()
    gen: dict = field(default_factory=dict)
    parts: frozenset[str] = frozenset()
    inputs: dict = field(default_factory=dict)   # other encoders' items, by encoder




class FeedContext:
    """Everything a worker needs of the bundle, loaded once."""

    def __init__(self, bundle: Path, data_override: str | None = None):
        from dtdsl.data.batch import SyntheticSource
        from dtdsl.feed.source import DatasetSource
        from dtdsl.ir.job import load_job
        from dtdsl.ir.plan import Plan
        from dtdsl.ir.program import Program
        from dtdsl.parallel.mesh import role_of

        self.bundle = bundle
        self.job = job = load_job(bundle)
        self.program = Program.model_validate_json((bundle / job.program_file).read_bytes())
        self.plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
        self.policy = frozenset(job.reorder)
        if job.data.kind == "dataset" or data_override is not None:
            path = Path(data_override) if data_override else bundle / str(job.data.path)
            self.source: Any = DatasetSource(self.program, path)
        else:
            self.source = SyntheticSource(self.program)
        self.work_model = None
        if self.policy:
            from dtdsl.cost.model import build_cost_model
            from dtdsl.reorder.workload import WorkModel

            self.work_model = WorkModel(build_cost_model(self.program))
        self.roles = [role_of(self.plan, r) for r in range(job.world_size)]
        self.units = [u.name for u in self.plan.units]


def _payload(ctx: FeedContext, step: int, position: int, parts: frozenset[str],
             cache: dict[int, Any]) -> _Payload:
    from dtdsl.feed.source import DatasetSource

    if not parts:
        return _Payload()
    if isinstance(ctx.source, DatasetSource):
        decoded = cache.get(position)
        if decoded is None:
            decoded = cache[position] = ctx.source.decode(step, position)
        return _Payload(tokens=decoded.tokens if "tokens" in parts else None,
                        images=decoded.images if "images" in parts else (),
                        gen=decoded.gen if "targets" in parts else {}, parts=parts,
                        inputs={k: v for k, v in decoded.inputs.items() if v}
                        if "images" in parts else {})
    s = ctx.source.sample(step, position, parts)
    return _Payload(tokens=s.tokens if "tokens" in parts else None, images=s.images,
                    gen=dict(s.targets), parts=parts,
                    inputs={k: v for k, v in s.inputs.items() if v})


def build_messages(ctx: FeedContext, step: int, ranks: Sequence[int] | None = None
                   ) -> list[tuple[dict, dict]]:
    """Step ``step``'s batch message (meta, arrays) for each of ``ranks`` (default: every
    trainer rank), in that order."""
    from dtdsl.data.batch import normalizer_of, reads_of, route_batch
    from dtdsl.feed.protocol import batch_message

    sizes = ctx.source.sizes(step)
    routing = route_batch(ctx.plan, ctx.program, sizes, ctx.policy, ctx.work_model)
    norm = normalizer_of(ctx.program, sizes)
    keys = ctx.source.keys(step)
    cache: dict[int, Any] = {}
    out = []
    for rank in (range(ctx.job.world_size) if ranks is None else ranks):
        role = ctx.roles[rank]
        samples = {i: _payload(ctx, step, i, parts, cache)
                   for i, parts in reads_of(role, ctx.plan, routing).items()}
        out.append(batch_message(step, routing, norm, samples, ctx.units,
                                 keys if role.rank == 0 else None, sizes))
    return out


def _announced_ranks(meta: dict[str, Any], job: Any) -> tuple[int, ...] | None:
    """The node's ranks an announcement names, if they are a valid set for this node's
    trainers (at most one per local trainer, each a rank of the job)."""
    ranks = meta.get("ranks")
    if not isinstance(ranks, list) or not 0 < len(ranks) <= job.gpus_per_node or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < job.world_size
            for r in ranks):
        return None
    return tuple(ranks)


def run_worker(bundle: Path, index: int, *, run_dir: Path, feed_dir: Path,
               steps: int | None = None, data: str | None = None, first_step: int = 0) -> int:
    """Worker ``index`` of its node: produce its steps from ``first_step`` up to the job's
    step count (``steps``: the total, as the trainers count it) for the node's trainers,
    following them back when they restart, until they say they are done; the exit
    status."""
    from dtdsl.feed import wire
    from dtdsl.feed.faults import fault_point
    from dtdsl.feed.protocol import BATCH, PROGRESS

    ctx = FeedContext(bundle, data)
    job = ctx.job
    workers = job.feed.workers_per_node
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} outside 0..{workers - 1}")
    total = job.steps if steps is None else steps
    secret = wire.read_secret(bundle / job.secret_file)
    context = wire.bounded_context(job.feed.max_sockets(job.gpus_per_node))
    senders = [wire.Sender(job.feed.trainer_address(feed_dir, local), secret,
                           hwm=job.feed.prefetch + 1, linger_s=5.0, context=context)
               for local in range(job.gpus_per_node)]
    progress = wire.Subscriber(job.feed.control_address(feed_dir), secret, context=context)
    next_step = first_step
    done = False
    session: str | None = None
    ranks: tuple[int, ...] = ()     # the node's ranks, by local rank (announced)
    rewind = False          # the trainers restarted: go back to their next step
    heard = time.monotonic()

    def refresh(timeout_s: float = 0.0) -> None:
        nonlocal next_step, done, session, ranks, rewind, heard
        msg = progress.latest(timeout_s)
        if msg is None or msg.kind != PROGRESS:
            return
        got, said = int(msg.meta["next_step"]), msg.meta.get("session")
        if said != session:
            # A start of the trainers: the first this worker hears of, or a new one (a
            # torchrun restart, a resumed run). Either way the steps they need may be ones
            # this worker already sent to trainers that died: go back and send again (the
            # trainers drop copies), to the ranks this start put on the node.
            named = _announced_ranks(msg.meta, job)
            if named is None:
                log.warning("worker %d: an announcement names no valid ranks: %r", index,
                            msg.meta.get("ranks"))
                return
            rewind = True
            log.info("worker %d: the trainers (session %s, ranks %s) start at step %d",
                     index, said, list(named), got)
            session, ranks, next_step, done = said, named, got, bool(msg.meta.get("done"))
        elif got > next_step or msg.meta.get("done"):
            next_step = max(next_step, got)
            done = done or bool(msg.meta.get("done"))
        else:
            return
        heard = time.monotonic()

    def mine(at: int) -> int:
        """This worker's first step at or after ``at``."""
        return at + (index - at) % workers

    try:
        step = mine(next_step)
        while not done:
            if rewind:
                rewind = False
                step = mine(next_step)
            if not ranks or step >= total or step >= next_step + job.feed.prefetch:
                # Not told the node's ranks yet, ahead of the trainers, or all sent: wait
                # for progress, a restart or the end (a worker whose trainers vanished for
                # good gives up after IDLE_S).
                refresh(POLL_S)
                time.sleep(POLL_S)
                if time.monotonic() - heard > IDLE_S and (step >= total or not ranks):
                    log.warning("worker %d: no word from the trainers in %.0f s; exiting",
                                index, IDLE_S)
                    break
                continue
            if step < next_step:        # the trainers are already past it
                step += workers
                continue
            fault_point(f"worker{index}", step, run_dir)
            start = time.perf_counter()
            messages = build_messages(ctx, step, ranks)
            for local, (meta, arrays) in enumerate(messages):
                while not senders[local].send(BATCH, meta, arrays, timeout_s=1.0):
                    refresh()
                    if done or rewind or step < next_step:
                        break
                if done or rewind:
                    break
            else:
                log.info("worker %d: step %d sent to ranks %s in %.3f s", index, step,
                         f"{ranks[0]}..{ranks[-1]}", time.perf_counter() - start)
            step += workers
    finally:
        for s in senders:
            s.close()
        progress.close()
        context.term()
    return 0


def _error_file(feed: Path, index: int) -> Path:
    """Where worker ``index`` leaves the line of the error it died of (for its
    supervisor)."""
    return feed / f"worker-{index}.error"


def _report_error(feed: Path | None, index: int, err: BaseException) -> None:
    """Leave the error worker ``index`` is dying of where its supervisor reads it: one
    line, marked ``fatal`` when no restart can change it (``feed.faults``)."""
    from dtdsl.feed.faults import fatal_cause, one_line

    if feed is None:
        return
    cause = fatal_cause(err)
    text = json.dumps({"error": one_line(cause or f"{type(err).__name__}: {err}"),
                       "fatal": cause is not None})
    try:
        tmp = _error_file(feed, index).with_suffix(".tmp")
        tmp.write_text(text, "utf-8")
        os.replace(tmp, _error_file(feed, index))
    except OSError:
        pass


def _last_error(feed: Path | None, index: int) -> tuple[str | None, bool]:
    """The error worker ``index`` left (taken: the file is removed), and whether it is
    fatal."""
    if feed is None:
        return None, False
    path = _error_file(feed, index)
    try:
        said = json.loads(path.read_text("utf-8"))
        path.unlink()
        return str(said["error"]), bool(said.get("fatal"))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None, False


class _Failures:
    """A worker's recent failures: too many too fast is a crash loop, not bad luck."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}
        self.restarts = 0

    def give_up(self, index: int, fatal: bool) -> str | None:
        """Count a failure of worker ``index`` (``fatal``: of an error no restart
        changes); why to give up on it, or None to restart it (counted in ``restarts``)."""
        now = time.monotonic()
        recent = [t for t in self.times.get(index, []) if now - t < CRASH_WINDOW_S]
        recent.append(now)
        self.times[index] = recent
        if fatal:
            return "cannot go on"
        if len(recent) >= CRASH_LOOP:
            return f"failed {len(recent)} times in {CRASH_WINDOW_S:.0f} s"
        if self.restarts >= MAX_RESTARTS:
            return f"failed after {MAX_RESTARTS} restarts"
        self.restarts += 1
        return None


def supervise(bundle: Path, argv: Sequence[str], feed: Path | None = None) -> int:
    """Run every worker as a child process and start again any that dies abnormally, up
    to ``MAX_RESTARTS`` restarts in all; the exit status.

    A worker that fails ``CRASH_LOOP`` times within ``CRASH_WINDOW_S`` is in a crash loop,
    and one whose error no restart changes (``feed.faults``: a job key others may read,
    bad data) fails for good at once: then the supervisor gives up, records the worker's
    last error as the launch's fatal record (``launch.sh`` stops the launch with that
    line) and stops the other workers. ``feed``: the node's feed directory, where a dying
    worker leaves its error."""
    import socket

    from dtdsl.feed.faults import die_with_parent, record_fatal
    from dtdsl.ir.job import load_job

    workers = load_job(bundle).feed.workers_per_node
    script = bundle / "workers" / "worker.py"
    me = os.getpid()
    host = socket.gethostname()

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), "--index", str(i), *argv],
                                preexec_fn=die_with_parent(me))  # noqa: PLW1509

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)      # so that the workers are stopped below

    signal.signal(signal.SIGTERM, stop)
    procs = {i: start(i) for i in range(workers)}
    failures = _Failures()
    try:
        while procs:
            time.sleep(0.2)
            for i, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                if code == 0:
                    del procs[i]
                    continue
                error, fatal = _last_error(feed, i)
                said = error or f"it {_exit_text(code)}"
                why = failures.give_up(i, fatal)
                if why is None:
                    print(f"supervisor: worker {i} exited with {code} ({said}); restarting "
                          f"it ({failures.restarts}/{MAX_RESTARTS})", file=sys.stderr,
                          flush=True)
                    procs[i] = start(i)
                    continue
                line = f"preprocessing worker {i} on {host} {why}; its last error: {said}"
                print(f"supervisor: {line}; giving up", file=sys.stderr, flush=True)
                record_fatal("workers", line)
                del procs[i]
                return 1
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _check_expected(bundle: Path, expected: dict[str, Any]) -> None:
    """The worker program's stated configuration against job.json (a stale or edited
    program fails here)."""
    from dtdsl.ir.job import load_job

    job = load_job(bundle)
    actual = {"workers": job.feed.workers_per_node, "prefetch": job.feed.prefetch,
              "reorder": tuple(job.reorder), **worker_fields(job)}
    for key, value in expected.items():
        if actual.get(key) != value:
            raise SystemExit(f"worker.py says {key} = {value!r} but job.json gives "
                             f"{actual.get(key)!r}: recompile the bundle")


def main(bundle: Path, argv: Sequence[str] | None = None,
         expected: dict[str, Any] | None = None) -> int:
    """The command line of a bundle's ``workers/worker.py``; ``expected``: what the
    generated program states, checked against the bundle's job.json."""
    if expected is not None:
        _check_expected(bundle, expected)
    p = argparse.ArgumentParser(prog="worker.py", description="preprocessing workers")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--all", action="store_true", help="run every worker, restarting any "
                     "that dies")
    who.add_argument("--index", type=int, help="run this worker")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int)
    p.add_argument("--feed-dir", help="the node's feed directory (default: "
                   "$DTDSL_FEED_DIR, which launch.sh sets)")
    p.add_argument("--data")
    p.add_argument("--resume", action="store_true", help="start at the step of the newest "
                   "complete checkpoint in the run directory (the trainers resume there)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    from dtdsl.feed.node import FEED_DIR_ENV, feed_dir

    given = args.feed_dir or os.environ.get(FEED_DIR_ENV)
    if args.all:      # where its workers leave their errors, be it fit for sockets or not
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--all"]
        return supervise(bundle, rest, feed=Path(given) if given else None)
    try:
        where = feed_dir(args.feed_dir)
    except ValueError as err:
        from dtdsl.feed.faults import Fatal

        _report_error(Path(given) if given else None, args.index, Fatal(str(err)))
        raise SystemExit(f"worker.py: {err}") from None
    try:
        first = 0
        if args.resume:
            from dtdsl.ir.checkpoint import complete_checkpoints

            done = complete_checkpoints(args.run_dir)
            first = done[-1][0] if done else 0
        return run_worker(bundle, args.index, run_dir=Path(args.run_dir), feed_dir=where,
                          steps=args.steps, data=args.data, first_step=first)
    except Exception as err:
        _report_error(where, args.index, err)
        raise


def worker_fields(job: Any) -> dict[str, Any]:
    """What the worker program states as data (and checks against job.json)."""
    return {"data": job.data.path if job.data.kind == "dataset" else None}
