"""A launch bundle brought up without training: every rank's process groups, its node's
feed connections and its share of the data, checked on one machine.

``python -m dtdsl.train.dryrun BUNDLE [--node K] [--steps N] [--json]`` (``launch.sh
--dry-run`` runs it; under ``srun`` each node checks its own share, ``--node
$SLURM_NODEID``). For every rank of the bundle (or of node K):

1. **groups**: the default group is torch's ``fake`` backend (no peer is needed, one
   process can be any rank of any world), and the rank runs the very ``build_groups`` a
   training rank runs; the groups it asks torch for (``new_group``, ``split_group``,
   recorded) must be its TP, DP and PP groups of the plan (``mesh.role_of``), each of more
   than one rank and once, and nothing else but placeholders of one rank of the ``fake``
   backend for the mesh dimensions it is alone on (no communicator, no socket);
2. **descriptors**: what the trainer process will hold at most: this interpreter's own
   (torch loaded) and ``RUNTIME_FDS`` more, one connection to the rendezvous store, each
   group's connections (at most one per other member, plus ``COMM_FDS`` for a
   communicator), the default group's (gloo: one per other rank, a full mesh; NCCL:
   ``COMM_FDS`` and one per peer it sends to or receives from: pipeline neighbours and,
   for a unit's edge stages, the other units' replica leaders) and its feed sockets; a
   worker process likewise. The feed's socket costs are measured here, on real zmq
   sockets of one node;
3. **feed**: every checked node's feed is brought up for real in a temporary directory
   (each local trainer's inbox, the node's announcement, one worker): the worker hears
   the node's ranks and reaches each of its trainers;
4. **data**: the first ``--steps`` steps are drawn and routed as the workers route them,
   and every rank's share counted (samples per step); with ``--feed-bytes`` the first
   checked node's ranks get step 0's batch messages built and encoded as a worker does,
   their bytes reported (what a rank receives from the feed per step; real decoding, so
   one node's worth and asked for); rank 0's telemetry bytes per step
   (``timelines.telemetry_bytes`` over ``telemetry_every``) are held to
   ``timelines.TELEMETRY_BYTES``.

The rendezvous store is one process's business at any size: it holds one connection per
rank (under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``launch.sh`` sets, trainer
rank 0 hosts it). It is reported on its own line; ``launch.sh`` raises the open-file limit
to the hard limit for it. Exit status 0 when every check passes, 1 otherwise (the
problems are printed), 2 for a bundle that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COMM_FDS", "MAX_FDS", "RUNTIME_FDS", "DryRun", "dry_run", "main"]

MAX_FDS = 1000      # what a trainer or worker process may hold
COMM_FDS = 4        # a communicator's own: its bootstrap listener, ring neighbours, proxy
# A rank's own beyond this interpreter's: the accelerator driver's device files, its logs,
# TensorBoard's and a checkpoint's open files (an allowance, not a measurement).
RUNTIME_FDS = 64


@dataclass
class RankCheck:
    rank: int
    unit: str
    stage: int
    replica: int
    tp_index: int
    node: int
    groups: dict[str, list[int]]
    placeholders: int       # dimensions it is alone on: fake-backend groups, no sockets
    descriptors: int
    telemetry_bytes_per_step: float
    samples_per_step: list[int]
    # step 0's batch message from the feed, measured on the first node checked (None
    # elsewhere, or without workers)
    feed_bytes: int | None = None


@dataclass
class DryRun:
    """What the dry run found (``main`` prints it; ``--json`` writes it)."""

    bundle: str
    world_size: int
    nodes: int
    gpus_per_node: int
    backend: str
    checked_ranks: int = 0
    checked_nodes: list[int] = field(default_factory=list)
    base_fds: int = 0
    feed: dict[str, int] = field(default_factory=dict)
    worker_descriptors: int = 0
    max_trainer_descriptors: int = 0
    max_groups_per_rank: int = 0
    store_connections: int = 0
    telemetry_every: int = 1
    max_telemetry_bytes_per_step: float = 0.0
    seconds: float = 0.0
    ranks: list[RankCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:         # not Linux: count what can be stat'ed
        count = 0
        for fd in range(4096):
            try:
                os.fstat(fd)
            except OSError:
                continue
            count += 1
        return count


# ------------------------------------------------------------------------------ groups


def _expected_groups(plan: Any, role: Any, zero: int, ulysses: dict[str, int] | None = None,
                     replica_dp: int = 1) -> dict[str, tuple[int, ...]]:
    """The groups ``role``'s rank must be in: its unit's TP, DP and PP groups of more
    than one rank (the DP group split in two under Local SGD with replicas of several
    ranks: ``dp_replicate`` and ``dp_shard``), and a phased encoder's DP group where it
    is one of its own (``mesh.rank_groups``: ``"<unit>.<dimension>"``)."""
    from dtdsl.parallel.mesh import rank_groups

    mine = rank_groups(plan, role.rank, zero, ulysses, replica_dp)
    named = {"tp": role.tp_ranks, "pp": role.pp_ranks}
    if "dp_replicate" in mine and "dp_shard" in mine:
        named.update({k: mine[k] for k in ("dp_replicate", "dp_shard")})
    else:
        named["dp"] = role.dp_ranks
    named.update({k: v for k, v in mine.items() if "." in k})
    return {k: tuple(sorted(v)) for k, v in named.items() if len(v) > 1}


class _Recorded:
    """Every ``new_group`` and ``split_group`` this process asks torch for while it is
    installed: (member ranks, backend asked for) of the groups this rank is in."""

    def __init__(self, rank: int):
        self.rank = rank
        self.made: list[tuple[tuple[int, ...], str | None]] = []

    def __enter__(self) -> _Recorded:
        import torch.distributed as dist

        self._saved = dist.new_group, dist.split_group

        def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
            members = tuple(sorted(ranks)) if ranks is not None else \
                tuple(range(dist.get_world_size()))
            if self.rank in members:
                self.made.append((members, kwargs.get("backend")))
            return self._saved[0](ranks, *args, **kwargs)

        def split_group(*args: Any, **kwargs: Any) -> Any:
            for members in kwargs.get("split_ranks") or []:
                if self.rank in members:
                    self.made.append((tuple(sorted(members)), None))
            return self._saved[1](*args, **kwargs)

        dist.new_group, dist.split_group = new_group, split_group
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.new_group, dist.split_group = self._saved


def _check_groups(plan: Any, rank: int, zero: int, device_type: str,
                  ulysses: dict[str, int] | None = None, replica_dp: int = 1
                  ) -> tuple[dict[str, tuple[int, ...]], int, list[str]]:
    """Bring up ``rank``'s groups over the fake backend: its groups, the placeholders it
    holds for dimensions it is alone on (groups of one rank of torch's ``fake`` backend:
    no communicator), and what is wrong."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtdsl.parallel.mesh import build_groups, role_of

    world = sum(u.gpus for u in plan.units)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with _Recorded(rank) as recorded:
            build_groups(plan, device_type=device_type, zero=zero, ulysses=ulysses,
                         replica_dp=replica_dp)
    finally:
        dist.destroy_process_group()
    placeholders = [m for m, backend in recorded.made if backend == "fake" and len(m) == 1]
    real = [m for m, backend in recorded.made if not (backend == "fake" and len(m) == 1)]
    want = _expected_groups(plan, role_of(plan, rank), zero, ulysses, replica_dp)
    problems = []
    for name, members in want.items():
        if members not in real:
            problems.append(f"rank {rank}: no {name} group {list(members)}")
    for members in real:
        # A CP group may have the ranks of its unit's DP group (dp 1): a communicator of
        # its own, apart from FSDP's reduction (``parallel.mesh``).
        if members in want.values() and \
                real.count(members) == list(want.values()).count(members):
            continue
        what = "a one-rank group" if len(members) == 1 else \
            "a world-size group" if len(members) == world else \
            "a second copy of a group" if members in want.values() else \
            "a group the plan has not"
        problems.append(f"rank {rank}: {what} {list(members)}")
    return want, len(placeholders), problems


# ------------------------------------------------------------------------ descriptors


def _p2p_peers(plan: Any, role: Any) -> int:
    """The ranks this rank may exchange activations with over the default group: its
    pipeline neighbours (interleaved, the first and last stage each other too), and for
    the TP leader of a unit's first or last stage, every
    other unit's edge-stage replica leaders (the broker's pairs; an upper bound). A phased
    encoder's hand-offs go over the PP group (``train.phases``), counted with the groups."""
    from dtdsl.parallel.mesh import grids

    peers = int(role.stage > 0) + int(role.stage < role.grid.pp - 1)
    if plan.unit(role.unit).vpp > 1 and role.grid.pp > 2 and \
            (role.is_first_stage or role.is_last_stage):
        peers += 1      # interleaved: the last stage's chunk c feeds stage 0's chunk c + 1
    if role.is_leader and (role.is_first_stage or role.is_last_stage):
        peers += sum(g.dp * (1 if g.pp == 1 else 2) for g in grids(plan)
                     if g.name != role.unit)
    return peers


def _trainer_descriptors(report: DryRun, role: Any, groups: dict[str, tuple[int, ...]],
                         plan: Any, local_rank: int) -> int:
    feed = report.feed
    world = report.world_size
    default = world - 1 if report.backend == "gloo" else COMM_FDS + _p2p_peers(plan, role)
    own = sum(COMM_FDS + len(m) - 1 for m in groups.values())
    zmq = 0
    if feed:
        zmq = feed["trainer"] + (feed["publisher"] if local_rank == 0 else 0)
    return report.base_fds + RUNTIME_FDS + 1 + default + own + zmq


def _measure_feed(job: Any, directory: Path) -> dict[str, int]:
    """The descriptors of a node's feed sockets, measured on real zmq sockets: a
    trainer's context with its inbox and one connection per worker, the node's
    announcement socket with one per worker, a worker's context with its senders and
    subscription."""
    from dtdsl.feed import wire

    secret = b"d" * 32
    n, workers = job.gpus_per_node, max(1, job.feed.workers_per_node)
    before = _open_fds()
    trainer = wire.bounded_context(job.feed.max_sockets(n))
    inbox = wire.Receiver(job.feed.trainer_address(directory, 0), secret, context=trainer)
    with_inbox = _open_fds()
    announce = wire.Publisher(job.feed.control_address(directory), secret, context=trainer)
    with_publisher = _open_fds()
    worker = wire.bounded_context(job.feed.max_sockets(n))
    senders = [wire.Sender(job.feed.trainer_address(directory, i), secret, context=worker)
               for i in range(n)]
    subscription = wire.Subscriber(job.feed.control_address(directory), secret,
                                   context=worker)
    with_worker = _open_fds()
    try:
        return {"trainer": with_inbox - before + workers,       # + one connection each
                "publisher": with_publisher - with_inbox + workers,
                "worker": with_worker - with_publisher + n + 1}
    finally:
        for s in senders:
            s.close(0)
        subscription.close()
        announce.close()
        inbox.close()
        worker.term()
        trainer.term()


def _bring_up_node(job: Any, ranks: Sequence[int], directory: Path,
                   timeout_s: float = 10.0) -> list[str]:
    """The node's feed for real: every local trainer's inbox and the announcement of
    its ranks, and one worker that hears them and reaches each trainer."""
    from dtdsl.feed import wire
    from dtdsl.feed.protocol import PROGRESS

    secret = b"d" * 32
    n = job.gpus_per_node
    trainers = wire.bounded_context(job.feed.max_sockets(n))
    worker = wire.bounded_context(job.feed.max_sockets(n))
    inboxes = [wire.Receiver(job.feed.trainer_address(directory, i), secret,
                             context=trainers) for i in range(len(ranks))]
    announce = wire.Publisher(job.feed.control_address(directory), secret, context=trainers)
    senders = [wire.Sender(job.feed.trainer_address(directory, i), secret, context=worker)
               for i in range(n)]
    heard = wire.Subscriber(job.feed.control_address(directory), secret, context=worker)
    problems: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        told = None
        while told is None and time.monotonic() < deadline:
            announce.publish(PROGRESS, {"next_step": 0, "done": False, "session": "dry-run",
                                        "ranks": list(ranks)})
            told = heard.recv(timeout_s=0.05)
        if told is None or told.meta.get("ranks") != list(ranks):
            return [f"ranks {ranks[0]}..{ranks[-1]}: the worker did not hear the node's "
                    "announcement"]
        for local, rank in enumerate(told.meta["ranks"]):
            if not senders[local].send("dryrun", {"rank": rank}, timeout_s=timeout_s):
                problems.append(f"rank {rank}: the worker could not reach its inbox")
                continue
            got = inboxes[local].recv(timeout_s=timeout_s)
            if got is None or got.meta.get("rank") != rank:
                problems.append(f"rank {rank}: its inbox did not receive the worker's message")
    finally:
        for s in senders:
            s.close(0)
        heard.close()
        announce.close()
        for inbox in inboxes:
            inbox.close()
        worker.term()
        trainers.term()
    return problems


# ------------------------------------------------------------------------------- data


def _message_bytes(bundle: Path, ranks: Sequence[int], data: str | None) -> list[int]:
    """The bytes of step 0's batch message to each of ``ranks``, as a worker builds and
    encodes it (its samples decoded or drawn: real work, so one node's worth)."""
    from dtdsl.feed import wire
    from dtdsl.feed.protocol import BATCH
    from dtdsl.feed.worker import FeedContext, build_messages

    ctx = FeedContext(bundle, data)
    return [sum(len(memoryview(f).cast("B")) for f in wire.encode(BATCH, meta, arrays,
                                                                  b"d" * 32))
            for meta, arrays in build_messages(ctx, 0, ranks)]


def _shares(bundle: Path, job: Any, program: Any, plan: Any, steps: int,
            data: str | None) -> list[list[int]]:
    """Samples per step of every rank, for the first ``steps`` steps, routed as the
    workers (or the in-process feed) route them."""
    from dtdsl.data.batch import route_batch
    from dtdsl.parallel.mesh import role_of
    from dtdsl.train.launch import data_source

    source = data_source(job, bundle, program, data)
    work_model = None
    if job.reorder:
        from dtdsl.cost.job import job_cost_model
        from dtdsl.reorder.workload import WorkModel

        work_model = WorkModel(job_cost_model(job.cost, program, bundle))
    roles = [role_of(plan, r) for r in range(job.world_size)]
    out: list[list[int]] = [[] for _ in roles]
    for step in range(steps):
        routing = route_batch(plan, program, source.sizes(step), frozenset(job.reorder),
                              work_model)
        per: dict[tuple[str, int], int] = {}
        for s in routing:
            for u in plan.units:
                for replica in range(u.dp):
                    key = (u.name, replica)
                    per[key] = per.get(key, 0) + len(s.samples_of(u.name, replica))
        for r, role in enumerate(roles):
            out[r].append(per.get((role.unit, role.replica), 0))
    return out


# ------------------------------------------------------------------------------ main


def dry_run(bundle: str | Path, *, node: int | None = None, steps: int = 1,
            data: str | None = None, max_fds: int = MAX_FDS,
            device_type: str | None = None, feed_bytes: bool = False) -> DryRun:
    """Check ``bundle`` (every rank, or node ``node``'s): the module docstring says what."""
    from dtdsl.ir.job import load_job
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.program import Program
    from dtdsl.ir.schedule import parse_schedule
    from dtdsl.parallel.mesh import cp_ulysses, role_of
    from dtdsl.train.timelines import TELEMETRY_BYTES, telemetry_bytes, telemetry_every

    start = time.perf_counter()
    bundle = Path(bundle)
    job = load_job(bundle)
    program = Program.model_validate_json((bundle / job.program_file).read_bytes())
    plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
    schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    if device_type is None:     # what the cluster's ranks run on: NCCL on its GPUs
        device_type = "cpu" if program.cluster.gpu.name.lower() == "cpu" else "cuda"
    report = DryRun(bundle=str(bundle), world_size=job.world_size, nodes=job.nodes,
                    gpus_per_node=job.gpus_per_node,
                    backend="nccl" if device_type == "cuda" else "gloo")
    if node is not None and not 0 <= node < job.nodes:
        raise ValueError(f"--node {node}: the bundle has nodes 0..{job.nodes - 1}")
    nodes = range(job.nodes) if node is None else range(node, node + 1)
    report.checked_nodes = list(nodes)
    report.base_fds = _open_fds()
    report.store_connections = job.world_size
    every = telemetry_every(plan, schedule)
    report.telemetry_every = every
    received = telemetry_bytes(plan, schedule) / every
    zero = program.train.mesh_zero
    shares = _shares(bundle, job, program, plan, steps, data)

    with tempfile.TemporaryDirectory(prefix="dtdsl-dry-") as tmp:
        if job.feed.workers_per_node > 0:
            (Path(tmp) / "measure").mkdir()
            report.feed = _measure_feed(job, Path(tmp) / "measure")
            report.worker_descriptors = report.base_fds + report.feed["worker"]
            if report.worker_descriptors > max_fds:
                report.problems.append(f"a worker process holds {report.worker_descriptors} "
                                       f"descriptors (over {max_fds})")
        for k in nodes:
            ranks = job.node_ranks(k * job.gpus_per_node, 0, job.gpus_per_node)
            if job.feed.workers_per_node > 0:
                where = Path(tmp) / f"node{k}"
                where.mkdir()
                report.problems += _bring_up_node(job, list(ranks), where)
            for local, r in enumerate(ranks):
                role = role_of(plan, r)
                groups, alone, problems = _check_groups(plan, r, zero, device_type,
                                                        cp_ulysses(program, plan),
                                                        program.train.replica_dp)
                report.problems += problems
                fds = _trainer_descriptors(report, role, groups, plan, local)
                if fds > max_fds:
                    report.problems.append(f"rank {r}: its process holds up to {fds} "
                                           f"descriptors (over {max_fds})")
                mine = received if r == 0 else 0.0
                if mine > TELEMETRY_BYTES:
                    report.problems.append(f"rank {r}: {mine:.0f} bytes of telemetry per "
                                           f"step (over {TELEMETRY_BYTES})")
                report.ranks.append(RankCheck(
                    rank=r, unit=role.unit, stage=role.stage, replica=role.replica,
                    tp_index=role.tp_index, node=k,
                    groups={n: list(m) for n, m in groups.items()}, placeholders=alone,
                    descriptors=fds,
                    telemetry_bytes_per_step=mine, samples_per_step=shares[r]))
    if feed_bytes and job.feed.workers_per_node > 0 and report.ranks:
        first = [c for c in report.ranks if c.node == report.checked_nodes[0]]
        for c, n in zip(first, _message_bytes(bundle, [c.rank for c in first], data),
                        strict=True):
            c.feed_bytes = n
    report.checked_ranks = len(report.ranks)
    report.max_trainer_descriptors = max((c.descriptors for c in report.ranks), default=0)
    report.max_groups_per_rank = max((len(c.groups) for c in report.ranks), default=0)
    report.max_telemetry_bytes_per_step = received     # rank 0's; the others receive none
    report.seconds = time.perf_counter() - start
    return report


def _summary(r: DryRun) -> str:
    feed = (f"a worker {r.feed['worker']} zmq descriptors, a trainer {r.feed['trainer']} "
            f"(+{r.feed['publisher']} on a node's first)" if r.feed else "no workers")
    lines = [
        f"dry run of {r.bundle}: {r.checked_ranks} of {r.world_size} ranks on "
        f"{len(r.checked_nodes)} of {r.nodes} node(s) of {r.gpus_per_node}, {r.backend}, "
        f"in {r.seconds:.1f} s",
        f"  groups: at most {r.max_groups_per_rank} per rank"
        + ("" if any("group" in p for p in r.problems) else
           ", each its plan's TP, DP or PP group of more than one rank"),
        f"  descriptors: a trainer at most {r.max_trainer_descriptors}, a worker "
        f"{r.worker_descriptors or '-'} (this interpreter alone holds {r.base_fds}); "
        f"feed sockets: {feed}",
        f"  rendezvous store: one process holds {r.store_connections} connections (trainer "
        "rank 0; launch.sh raises the open-file limit)",
        f"  telemetry: rank 0 receives {r.max_telemetry_bytes_per_step:.0f} bytes per step "
        f"on average (the timeline every {r.telemetry_every} step(s))",
    ]
    if r.ranks:
        counts = sorted({n for c in r.ranks for n in c.samples_per_step})
        lines.append(f"  data: {counts[0]}..{counts[-1]} samples per rank per step")
        sent = [c for c in r.ranks if c.feed_bytes is not None]
        if sent:
            lines.append(f"  feed: step 0's message to node {sent[0].node}'s ranks "
                         f"{sent[0].rank}..{sent[-1].rank}: "
                         + ", ".join(f"{c.feed_bytes / 2**20:.1f}" for c in sent) + " MiB")
    lines += [f"  problem: {p}" for p in r.problems[:50]]
    if len(r.problems) > 50:
        lines.append(f"  ... and {len(r.problems) - 50} more")
    lines.append("  ok" if r.ok else f"  {len(r.problems)} problem(s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtdsl.train.dryrun",
                                description="bring a bundle's ranks up without training")
    p.add_argument("bundle")
    p.add_argument("--node", type=int, help="check this node's ranks only (default: all)")
    p.add_argument("--steps", type=int, default=1, help="steps of data to route (default 1)")
    p.add_argument("--data", help="the dataset (default: the bundle's)")
    p.add_argument("--max-fds", type=int, default=MAX_FDS,
                   help=f"descriptors a process may hold (default {MAX_FDS})")
    p.add_argument("--device", choices=("cuda", "cpu"), help="what the ranks run on, so "
                   "which backend's connections to count (default: cuda with NCCL, cpu "
                   "with gloo for a cluster of CPUs)")
    p.add_argument("--feed-bytes", action="store_true", help="build and measure step 0's "
                   "batch messages to the first checked node's ranks (decodes their samples)")
    p.add_argument("--json", metavar="FILE", help="also write the full report here")
    args = p.parse_args(argv)
    try:
        report = dry_run(args.bundle, node=args.node, steps=max(1, args.steps),
                         data=args.data, max_fds=args.max_fds, device_type=args.device,
                         feed_bytes=args.feed_bytes)
    except (OSError, ValueError) as err:
        print(f"dry run: {err}", file=sys.stderr)
        return 2
    print(_summary(report), flush=True)
    if args.json:
        body = asdict(report)
        Path(args.json).write_text(json.dumps(body, indent=1) + "\n", "utf-8")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
