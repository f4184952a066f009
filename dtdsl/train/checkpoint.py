"""Sharded checkpoints in a plan-independent layout, resume, and the files that make a
checkpoint complete.

**Layout.** A checkpoint is one ``torch.distributed.checkpoint`` (DCP) state dict of
DTensors, from torch's ``get_state_dict`` over each rank's stage module and optimizer::

    {"model": {"units.<unit>.<param>": DTensor, ...},     # every parameter, frozen too
     "optim": {"units.<unit>.<param>": {"exp_avg", "exp_avg_sq", "step"}, ...},
     "loss_scale": {"scale", "growth_tracker", "skipped_steps"}}      # fp16 only

(the optimizer's param groups are not saved: the learning rate comes from the spec's
schedule each step, behind by the steps fp16 skipped). The names are the single-process
model's (a stage module keeps the global names of the layers it holds, and FSDP2 and
activation checkpointing do not rename parameters), and the values are DTensors: each
rank writes only its own shards (FSDP2's DP shard of its TP shard), with their offsets in
the full tensor. So nothing in the layout depends on the plan, and DCP reshards on load:
a checkpoint written under one plan loads under any other plan of the same spec, each
rank reading exactly the pieces of the full tensors its shards cover. No rank ever
gathers a full tensor. Frozen modules' weights are saved too and loaded with the rest.
Under expert parallelism an EP rank's stacked expert weights (and their Adam moments)
are saved as DTensors of the full ``[experts, ...]`` tensor on the ``(ep, ep_dp)`` mesh
(``parallel.ep.global_experts``), so each expert is written once under its
single-process name and a run resumes at any EP degree, ep 1 included. Under Local SGD
the layout is per replica (every replica holds all the experts), and the anchor, outer
momentum and each replica's own copies of the experts are saved the same way.
The loss scale of an fp16 run (``optim.LossScale``) is the same on every rank: plain
scalar tensors, written once (DCP keeps one copy of a replicated tensor) and read by
every rank, so a resumed run goes on with the scale, its growth counter and its count of
skipped steps.

**Files.** Under ``RUN_DIR/checkpoints/``, a checkpoint is written into ``ckpt-<N>.tmp/``
(``N``: the steps done, i.e. the next step to run, the data cursor), then rank 0 writes
DCP's ``.metadata``, ``program.json`` (the checked spec: ``dtc export`` reads the
checkpoint with it) and ``manifest.json`` into it and renames the directory to
``ckpt-<N>/``. Rank 0 does so only once every rank has posted its write results (what
DCP's finish step gathers) to the default group's store, which a rank does after its
files are on disk (``fsync``ed): that is the barrier. A rank whose planning or write
failed posts its error instead, and rank 0 commits nothing. Rank 0 then posts the
outcome (committed, or why not) to every other rank, and a save ends on no rank before
it has that word: a rank that goes on past a save, or leaves the job, knows the
checkpoint complete, and a failed commit raises on every rank. So a directory without the
``.tmp`` suffix is complete; ``latest_checkpoint`` also requires a readable manifest and
DCP's ``.metadata``. An interrupted save leaves a ``.tmp`` directory that is never loaded
and is removed when the job resumes. After each commit only the newest ``keep`` complete
checkpoints are kept.

**Manifest** (``Manifest``): format and version, the steps done and the next step, the spec's
and the plan's sha256 (a checkpoint of another spec is refused; another plan is resharded),
the world size and each unit's layout when it was written, how it was saved, and the torch
generator states. The runtime draws nothing from the global generators (batches, noise and
timesteps are functions of the seed, the step and the sample; initialisation forks its own
generator), so restoring them changes nothing today; they are kept for code that will.

**Coordination without a group of its own.** ``dcp.save`` is two collective steps around
the writes: planning (every rank's local plan gathered on rank 0, which gives each
replicated tensor one writer and makes the metadata, and scatters the plans back) and
finishing (the write results gathered on rank 0). A background save running them over the
default group would interleave its collectives with the training thread's on the same
group (sequence numbers cross and the ranks hang), and a second world-size gloo group for
it costs every rank a socket to every other rank (1169 descriptors at 1170 ranks). So a
save runs DCP's own planner and writer with its two steps carried by the default group's
store instead (``_Exchange``: a key per message and rank, under a prefix unique to the
save, deleted by its reader; anyone who reaches the store can write it, so messages are
plain records authenticated with a secret the ranks share over the process group,
``dcp_safe``): no collective at all, safe from any thread, and nothing on
the training thread but the staging. Rank 0's store (the torchrun or rank-0 TCPStore)
carries the local plans once; DCP's plan caching then reduces a rank whose plan did not
change to a flag. Two rejected alternatives: planning on the training thread over the
default group (measured: every rank's save call then waits for the slowest rank's staging,
0.07 s -> 0.39 s per save on the development machine), and ``use_collectives=False``
(rank-local metadata, no planning across ranks: every replica of a replicated tensor is
written, under ZeRO 0 the whole model per DP replica, and a load under another plan needs
the global metadata anyway). ``resume`` (rank 0's choice of step, broadcast) and
``dcp.load`` run on the training thread over the default group.

**Saving modes** (``Checkpointer``): ``sync`` saves and commits on the training thread;
``thread`` copies the rank's shards to CPU memory (DCP's staging, into buffers kept from
save to save, pinned on CUDA: ``_Staging``) on the training thread, then a background
thread saves that copy and (rank 0) commits, at a lower CPU priority than the training
(nice +10 for the thread, Linux). This is what ``dcp.async_save``'s thread mode does,
with the commit in the same thread. At most one save is in flight: the
next save, and ``wait``/``close``/``resume``, first wait for it: for rank 0's commit, and
for its thread to end (joined, not only its result: a daemon thread still freeing the
staged copy when the interpreter exits is killed inside torch's tensor deallocation,
which aborts the process, "terminate called without an active exception"). ``close``
then holds rank 0 until every rank has closed, since rank 0's process may host the
store the others read the commit from. A failing job's ``close(wait=False)`` abandons
the save in flight: it posts an error under every key its thread may wait for, so that
the thread ends, and joins it for a bounded time. (DCP's process-based
``async_save``, a checkpoint daemon per rank as DistTrain saves from a dedicated process,
is not offered: its daemon outlives a SIGKILLed trainer, and it re-imports torch and joins
a new gloo group at the first save, which is what a restarted job cannot afford.)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from dtdsl.ir.checkpoint import (
    MANIFEST,
    MODES,
    PROGRAM,
    CheckpointError,
    CheckpointMismatch,
    Manifest,
    UnitLayout,
    checkpoint_root,
    complete_checkpoints,
    program_sha256,
    read_manifest,
    same_spec,
)

__all__ = [
    "Checkpointer",
    "load_state_dict",
    "plan_sha256",
    "state_dict",
]

def plan_sha256(plan: Any) -> str:
    """The sha256 of a Plan's JSON (its text form)."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: Path, manifest: Manifest, keep: int, program: str | None = None) -> Path:
    """Rank 0, once every rank's data is written: the program and the manifest, then the
    rename that makes the checkpoint complete, then pruning to the newest ``keep``."""
    if program is not None:
        with open(tmp / PROGRAM, "w", encoding="utf-8") as f:
            f.write(program)
            f.flush()
            os.fsync(f.fileno())
    file = tmp / MANIFEST
    with open(file, "w", encoding="utf-8") as f:
        f.write(manifest.model_dump_json(indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    final = tmp.with_name(f"ckpt-{manifest.step}")
    if final.exists():      # the same step saved again after a resume: replace it
        old = tmp.with_name(f"ckpt-{manifest.step}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)
    done = complete_checkpoints(final.parent.parent)
    for _, path in done[:max(0, len(done) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    return final


_LEFT_BEHIND = re.compile(r"ckpt-\d+\.(tmp|old)\Z")    # an interrupted save's, or a replaced one


def _unloadable(run_dir: Path, path: Path, why: str) -> str:
    """Why the checkpoint at ``path`` cannot be loaded, and what to do about it."""
    older = [p for _, p in complete_checkpoints(run_dir) if p != path]
    hint = (f"; move it out of {path.parent} to resume from {older[-1].name}" if older
            else "")
    return f"cannot load {path}: {why}{hint}"


def _first_failure(err: BaseException) -> str:
    """The first rank's error of DCP's CheckpointException, in one line."""
    for rank, (exc, _) in sorted(getattr(err, "failures", {}).items()):
        line = (str(exc).strip().splitlines() or [""])[-1][:300]
        return f"rank {rank}: {type(exc).__name__}: {line}"
    return str(err).strip().splitlines()[0]


def _remove_incomplete(run_dir: Path) -> None:
    """The folders an interrupted save left (``ckpt-<N>.tmp``, ``ckpt-<N>.old``); nothing
    else in the folder, and no link (``rmtree`` of a link removes nothing)."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for path in root.iterdir():
            if _LEFT_BEHIND.match(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


# ---- the state dict ------------------------------------------------------------------------

def _parts(ex: Any) -> list[tuple[Any, Any]]:
    """Each FSDP2 root of the rank (its stage, each phased encoder) with its torch
    optimizer, or None where it trains nothing (``StageExecutor.checkpoint_parts``)."""
    return [(module, None if opt is None else opt.optimizer)
            for module, opt in ex.checkpoint_parts()]


def state_dict(ex: Any) -> dict[str, Any]:
    """This rank's part of the checkpoint (module docstring): DTensor shards keyed by the
    plan-independent names of the stage's parameters and their optimizer state (a
    phased encoder's under its own names, as a unit of its own saves them). The tensors
    are the live ones: stage a copy before training goes on."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    local = getattr(ex, "local_sgd", None)
    if local is not None:     # a layer-wise synchronisation in flight ends first
        local.settle()
    out: dict[str, Any] = {"model": {}}
    for module, opt in _parts(ex):
        if opt is None:
            out["model"].update(get_model_state_dict(module))
            continue
        model, optim = get_state_dict(module, [opt])
        out["model"].update(model)
        out.setdefault("optim", {}).update(optim["state"])
    if ex.loss_scale is not None:
        out["loss_scale"] = _scale_tensors(ex.loss_scale.state())
    if local is not None and local.syncs:
        # Local SGD's anchor, outer momentum, statistics and each replica's parameters
        # (``local_sgd.StageSync.state_dict``).
        out["local_sgd"] = local.state_dict()
    ep = getattr(getattr(ex, "groups", None), "ep", None)
    if ep is not None:
        # Expert parallelism: each expert once (per Local SGD replica), under its
        # single-process name and shape.
        from dtdsl.parallel.ep import expert_layout, global_experts

        global_experts(out, ex.stage.module, expert_layout(ep, ex.role.dp_ranks))
    return out


def _scale_tensors(state: dict[str, float | int]) -> dict[str, Any]:
    """The loss scale's state as scalar tensors (DCP saves and loads tensors in place)."""
    import torch

    return {k: torch.tensor(v, dtype=torch.float64 if k == "scale" else torch.int64)
            for k, v in state.items()}


def _load_scale(ex: Any, state: dict[str, Any]) -> None:
    """Restore the loss scale from a checkpoint's scalars, checked as a new one is."""
    from dtdsl.train.optim import LossScale

    values = {k: t.item() for k, t in state["loss_scale"].items()}
    try:
        ex.loss_scale = LossScale(scale=float(values["scale"]),
                                  growth_tracker=int(values["growth_tracker"]),
                                  skipped_steps=int(values["skipped_steps"]))
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"the checkpoint's loss scale {values} cannot be used: "
                              f"{err}") from None


def load_state_dict(ex: Any, state: dict[str, Any]) -> None:
    """Set the stage's parameters and optimizer state from ``state`` (``state_dict``'s
    keys, loaded in place by DCP: each rank's shards, resharded from any plan)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if getattr(getattr(ex, "groups", None), "ep", None) is not None:
        from dtdsl.parallel.ep import local_experts

        local_experts(state, ex.stage.module)
    for module, opt in _parts(ex):
        keys = get_model_state_dict(module).keys()
        model = {k: v for k, v in state["model"].items() if k in keys}
        if opt is None:
            set_model_state_dict(module, model)
            continue
        _, current = get_state_dict(module, [opt])
        optim = {k: v for k, v in state["optim"].items() if k in keys}
        set_state_dict(module, [opt], model_state_dict=model,
                       optim_state_dict={"state": optim,
                                         "param_groups": current["param_groups"]})
    if ex.loss_scale is not None:
        _load_scale(ex, state)
    if "local_sgd" in state:
        # After the model's: each replica's own parameters replace the one saved there.
        ex.local_sgd.load_state_dict(state["local_sgd"])


# ---- saving and resuming ----------------------------------------------------------------------

def _rng_b64(state: Any) -> str:
    return base64.b64encode(bytes(state.numpy().tobytes())).decode()


def _rng_state(text: str, like: Any) -> Any:
    """A generator's state from its base64 ``text`` (the manifest's), or None where it is
    not one of the size ``like`` (the generator's own state) has."""
    import torch

    raw = base64.b64decode(text)
    if len(raw) != like.numel():
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _layout(state: Any) -> Any:
    """What a staged copy of ``state`` must match to be reused: its nesting, keys and each
    tensor's (local) shape, dtype and, for a DTensor, placements."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return tuple((k, _layout(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return (type(state).__name__, *(_layout(v) for v in state))
    if isinstance(state, DTensor):
        return ("dtensor", tuple(state._local_tensor.shape), state.dtype, state.placements)
    if isinstance(state, torch.Tensor):
        return ("tensor", tuple(state.shape), state.dtype)
    return type(state).__name__


class _Staging:
    """The CPU copy of a state dict that a ``thread``-mode save writes while training
    goes on (DTensors: their local shards), in buffers kept from save to save, pinned
    where the tensors are on CUDA (a fast device-to-host copy), as DCP's ``DefaultStager``
    caches its staged state dict: one copy into them per save, not an allocation of the
    whole state (and, for a DTensor, a deep copy of it first)."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: Any = None
        self._layout: Any = None

    def copy(self, state: Any) -> Any:
        from torch.distributed._state_dict_utils import (
            _copy_state_dict,
            _create_cpu_state_dict,
        )

        layout = _layout(state)
        if layout != self._layout:
            self._buffers = _create_cpu_state_dict(state, pin_memory=self._pin)
            self._layout = layout
        return _copy_state_dict(state, self._buffers)


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` so that it yields the CPU to the
    training threads (Linux: a thread's nice value is its own); elsewhere nothing."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        pass


class _Exchange:
    """One save's messages between the ranks, through the default group's store (a key
    per message and rank under ``key``, unique to the save), never a collective: safe
    from any thread while the training thread runs its collectives. A message is an
    outcome, ``("ok", value)`` or ``("error", text)``; its reader deletes it.

    The store is open to anyone who reaches its port, so a message is a record of plain
    data (``dcp_safe.seal``: msgpack, DCP's classes by name, an HMAC with the
    Checkpointer's secret over key and payload) appended to its key. A reader takes the
    first authentic record and ignores, and reports once through ``log``, whatever else
    it finds there; a value someone else wrote first does not hide the real one."""

    POLL_S = 0.05       # how often a reader looks again when a key holds no real record

    def __init__(self, key: str, rank: int, world: int, secret: bytes,
                 log: Callable[[str], None]) -> None:
        import torch.distributed.distributed_c10d as c10d

        self.store = c10d._get_default_store()
        self.key, self.rank, self.world = key, rank, world
        self._secret, self._log = secret, log
        self._reported = False

    def _keys(self, what: str) -> list[str]:
        return [f"{self.key}/{what}/{r}" for r in range(self.world)]

    def _put(self, keys: list[str], outcomes: list[tuple[str, Any]]) -> None:
        from dtdsl.train import dcp_safe

        for key, outcome in zip(keys, outcomes, strict=True):
            self.store.append(key, dcp_safe.seal(self._secret, key, outcome))

    def _take(self, key: str) -> tuple[str, Any]:
        """The authentic outcome under ``key`` (waiting for it up to the store's timeout);
        its key is deleted."""
        from dtdsl.train import dcp_safe

        timeout_s = self.store.timeout.total_seconds()
        deadline = time.monotonic() + timeout_s
        while True:
            data = self.store.get(key)          # waits for the key, up to the timeout
            try:
                found, outcome, forged = dcp_safe.unseal(self._secret, key, data)
            except dcp_safe.UnsafeMetadata as err:   # authentic but not ours: a bug
                raise CheckpointError(f"{key}: {err}") from None
            if forged:
                self._report(key)
            if found:
                if not (isinstance(outcome, tuple) and len(outcome) == 2 and
                        outcome[0] in ("ok", "error")):
                    raise CheckpointError(f"{key}: not an outcome")
                self.store.delete_key(key)
                return outcome
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"no message from this job under {key} within {timeout_s:g} s: "
                    "its key holds only values someone else wrote")
            time.sleep(self.POLL_S)

    def _report(self, key: str) -> None:
        if not self._reported:
            self._reported = True
            self._log(f"checkpoint: ignored a value under {key} that this job did not "
                      "write: something else can reach the rendezvous store (keep it on "
                      "a network only the job's hosts reach)")

    def post(self, what: str, outcome: tuple[str, Any]) -> None:
        self._put(self._keys(what)[self.rank:self.rank + 1], [outcome])

    def receive(self, what: str) -> Any:
        """This rank's message ``what`` (waiting for it, up to the store's timeout)."""
        status, value = self._take(self._keys(what)[self.rank])
        if status != "ok":
            raise CheckpointError(value)
        return value

    def gather(self, what: str) -> list[Any]:
        """Rank 0: every rank's message ``what``; CheckpointError naming the ranks that
        posted an error."""
        outcomes = [self._take(key) for key in self._keys(what)]
        failed = [f"rank {r}: {value}" for r, (status, value) in enumerate(outcomes)
                  if status != "ok"]
        if failed:
            raise CheckpointError(f"{what}: " + "; ".join(failed))
        return [value for _, value in outcomes]

    def scatter(self, what: str, outcomes: list[tuple[str, Any]]) -> None:
        """Rank 0: message ``what`` to each rank, ``outcomes[r]`` to rank ``r``."""
        self._put(self._keys(what), outcomes)

    def announce(self, what: str, outcome: tuple[str, Any]) -> None:
        """Rank 0: the same message ``what`` to every other rank."""
        self._put(self._keys(what)[1:], [outcome] * (self.world - 1))

    def cancel(self, text: str) -> None:
        """Release this rank's saving thread from any wait of its exchange: an error
        outcome ``text`` under every key it may be waiting for (this rank's plan part
        and commit; on rank 0 also every rank's plan and write results). Best effort (a
        store that is gone already failed the wait)."""
        keys = self._keys("part")[self.rank:self.rank + 1] + \
            self._keys("committed")[self.rank:self.rank + 1]
        if self.rank == 0:
            keys += self._keys("plan") + self._keys("written")
        with contextlib.suppress(Exception):
            self._put(keys, [("error", text)] * len(keys))


def _broadcast_bytes(data: bytes | None, nbytes: int) -> bytes:
    """Rank 0's ``data`` (``nbytes`` long) on every rank, as a tensor over the default
    group (no pickle, and nothing through the store)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if data is not None:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().tolist())


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as err:
        return ("error", f"{type(err).__name__}: {err}")


def _dcp_save(state: dict[str, Any], path: Path, ex: _Exchange) -> Any:
    """``dcp.save`` (its planner, writer and steps) with the exchange in place of its
    collectives: every rank's local plan to rank 0, which makes the global plan (each
    replicated tensor given one writer) and the metadata and sends each rank its part;
    each rank writes its files (``fsync``ed) and posts what it wrote; rank 0, once all
    have, writes DCP's ``.metadata``. A rank's failure reaches rank 0 (and, while
    planning, every rank) as CheckpointError. Returns the metadata on rank 0, else None.
    Plans are cached (DCP's ``enable_plan_caching``): from the second save of the same
    state on, a rank whose local plan did not change sends a flag instead."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FileSystemWriter(str(path))
    planner = DefaultSavePlanner(enable_plan_caching=True)
    coordinator = ex.rank == 0

    def local() -> Any:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                               is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=ex.rank)
        return writer.prepare_local_plan(planner.create_local_plan())

    ex.post("plan", _outcome(local))
    metadata = None
    if coordinator:
        try:
            plans, metadata = planner.create_global_plan(ex.gather("plan"))
            parts = [("ok", part) for part in writer.prepare_global_plan(plans)]
        except Exception as err:
            parts = [("error", f"planning failed: {err}")] * ex.world
        ex.scatter("part", parts)
    part = ex.receive("part")       # raises when planning failed (rank 0 knows)

    def write() -> Any:
        done = writer.write_data(planner.finish_plan(part), planner)
        done.wait()
        return done.value()

    written = _outcome(write)
    ex.post("written", written)
    if coordinator:     # raises naming every rank that failed, this one included
        writer.finish(metadata=metadata, results=ex.gather("written"))
    elif written[0] != "ok":
        raise CheckpointError(f"rank {ex.rank} could not write its part: {written[1]}")
    return metadata


class Checkpointer:
    """Saves and loads one executor's part of the job's checkpoints (module docstring).

    Every rank constructs it at the same point (a broadcast over the default group) and
    calls ``save``/``resume``/``close`` at the same steps. It creates no process group.

    Args:
        ex: this rank's ``StageExecutor``.
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        keep: how many complete checkpoints to keep (the newest).
        mode: ``sync`` or ``thread``.
        spec_sha256: the spec's hash (default: the program's ``source_sha256``).
        log: where rank 0 reports saves and loads (default: print to stdout).
        nice: how much lower the background thread's CPU priority is than the training
            thread's (``thread`` mode; 0: the same). On a CPU-bound node the write otherwise
            slows the next step by more than a synchronous save costs
            (``benchmarks/checkpoint_save.py``).
    """

    def __init__(self, ex: Any, run_dir: str | Path, *, keep: int = 3,
                 mode: str = "thread", spec_sha256: str | None = None,
                 log: Callable[[str], None] | None = None, nice: int = 10) -> None:
        import torch.distributed as dist

        if mode not in MODES:
            raise ValueError(f"checkpoint mode {mode!r}: write one of {', '.join(MODES)}")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint")
        self.ex, self.run_dir, self.keep, self.mode = ex, Path(run_dir), keep, mode
        self.nice = nice
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec_sha256 = spec_sha256 or ex.program.source_sha256
        self.program_sha256 = program_sha256(ex.program)
        self.plan_sha256 = plan_sha256(ex.plan)
        self.log = log or (lambda text: print(text, flush=True))
        # The saves' keys in the store: unique to this Checkpointer (a restarted job may
        # share the store with the attempt before it) and to each save. The secret that
        # authenticates their messages travels over the process group, never the store.
        shared = _broadcast_bytes(secrets.token_bytes(16 + 32) if self.rank == 0 else None,
                                  16 + 32)
        self._nonce, self._secret, self._count = shared[:16].hex(), shared[16:], 0
        self._closed_at = 0                 # the saves counted at the last close
        self._pending: Future | None = None
        self._thread: threading.Thread | None = None     # the save in flight's (thread)
        self._exchange: _Exchange | None = None           # and its exchange
        # thread mode: the CPU copy a save writes (pinned for a CUDA rank's tensors)
        self._staging = _Staging(pin=ex.device.type == "cuda")
        self.saved: list[int] = []          # steps committed (every rank: rank 0's commit)
        self.loaded: int | None = None      # the checkpoint ``resume`` loaded, if any

    def _new_exchange(self, name: str) -> _Exchange:
        return _Exchange(f"dtdsl/checkpoint/{self._nonce}/{name}", self.rank, self.world,
                         self._secret, self.log)

    # -- saving ---------------------------------------------------------------------------

    def _manifest(self, step: int) -> dict[str, Any]:
        """The manifest's fields known when the save starts (all but the tensor count)."""
        import torch

        cuda = None
        if torch.cuda.is_available():
            cuda = _rng_b64(torch.cuda.get_rng_state())
        plan, program = self.ex.plan, self.ex.program
        return dict(step=step, next_step=step, spec=program.name,
                    spec_sha256=self.spec_sha256, program_sha256=self.program_sha256,
                    plan_sha256=self.plan_sha256,
                    world_size=plan.gpus_used,
                    units=tuple(UnitLayout(name=u.name, tp=u.tp, dp=u.dp, pp=u.pp, cp=u.cp,
                                           vpp=u.vpp, colocated=u.colocated,
                                           phased=u.phased)
                                for u in plan.units),
                    mode=self.mode, rng_torch=_rng_b64(torch.get_rng_state()), rng_cuda=cuda)

    def save(self, step: int) -> float:
        """Checkpoint the state after ``step`` steps (the next step to run is ``step``).
        Every rank calls it at the same step. Returns the seconds it took on this (the
        training) thread: all of the save in ``sync`` mode (on every rank up to rank 0's
        commit); in ``thread`` mode the wait for the previous save and staging the
        shards' CPU copy."""
        start = time.perf_counter()
        self.wait()
        tmp = checkpoint_root(self.run_dir) / f"ckpt-{step}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(step) if self.rank == 0 else None
        self._count += 1
        exchange = self._new_exchange(str(self._count))
        state = state_dict(self.ex)
        if self.mode == "sync":
            self._write(step, tmp, manifest, state, exchange)
            return time.perf_counter() - start
        # The CPU copy here (training changes the tensors next), the rest in a thread of
        # our own at a lower CPU priority: it issues no collective (module docstring).
        staged = self._staging.copy(state)
        done: Future = Future()

        def write() -> None:
            _lower_priority(self.nice)
            try:
                self._write(step, tmp, manifest, staged, exchange)
                done.set_result(step)
            except BaseException as err:   # re-raised on the training thread by wait()
                done.set_exception(err)

        # A daemon (a hung store must not keep a failing process alive), but joined by
        # wait/close: it must never run into the interpreter's exit.
        thread = threading.Thread(target=write, name="dtdsl-checkpoint", daemon=True)
        thread.start()
        self._pending, self._thread, self._exchange = done, thread, exchange
        return time.perf_counter() - start

    def _write(self, step: int, tmp: Path, fields: dict[str, Any] | None,
               state: dict[str, Any], exchange: _Exchange) -> None:
        """DCP's save of ``state`` over the exchange; then rank 0 commits and tells every
        other rank the outcome, which they wait for: the save is done on no rank before
        the checkpoint is complete, and its failure reaches every rank."""
        if fields is None:
            try:
                _dcp_save(state, tmp, exchange)
            except CheckpointError:
                # Rank 0 learns of this rank's failure and commits nothing: wait for its
                # word all the same (its key is read and removed), then raise our own.
                with contextlib.suppress(Exception):
                    exchange.receive("committed")
                raise
            try:
                exchange.receive("committed")
            except CheckpointError as err:
                raise CheckpointError(f"ckpt-{step} was not committed: {err}") from None
            self.saved.append(step)
            return
        try:
            metadata = _dcp_save(state, tmp, exchange)
            manifest = Manifest(**fields, num_tensors=len(metadata.state_dict_metadata))
            final = _commit(tmp, manifest, self.keep, self.ex.program.model_dump_json())
        except BaseException as err:
            with contextlib.suppress(Exception):
                exchange.announce("committed", ("error", f"rank 0: {type(err).__name__}: "
                                                         f"{err}"))
            raise
        exchange.announce("committed", ("ok", step))
        self.log(f"checkpoint: saved {final} ({self.mode})")
        self.saved.append(step)

    def poll(self) -> None:
        """Raise at once the error of a background save that failed (a full disk, a lost
        peer): the run must not go on believing it is checkpointed. Local; call it every
        step."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self._pending = None
            raise CheckpointError(f"a background checkpoint save failed: "
                                  f"{pending.exception()}") from pending.exception()

    def wait(self) -> None:
        """Wait for the save in flight, if any: on every rank up to rank 0's commit, and
        until its thread has ended; re-raise its error."""
        thread, self._thread, self._exchange = self._thread, None, None
        if thread is not None:
            thread.join()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # How long ``close(wait=False)`` waits for an abandoned save's thread to end.
    ABANDON_S = 10.0

    def close(self, *, wait: bool = True) -> None:
        """Wait for the save in flight (``wait``), so that every rank leaves with the last
        checkpoint committed; then, after any save, rank 0 waits until every rank has
        closed (its process may host the store the others read the commit from).

        With ``wait=False`` (a job already failing) the save in flight is abandoned: its
        ``.tmp`` directory is never loaded and its error is not raised. Its thread is
        released from any wait on the store (``_Exchange.cancel``) and joined for up to
        ``ABANDON_S`` seconds, so that it does not run on into the interpreter's exit."""
        if not wait:
            thread, exchange = self._thread, self._exchange
            self._pending = self._thread = self._exchange = None
            if thread is not None and thread.is_alive():
                if exchange is not None:
                    exchange.cancel("abandoned: the job is failing")
                thread.join(self.ABANDON_S)
            return
        self.wait()
        if self._count > self._closed_at and self.world > 1:
            self._closed_at = self._count
            closing = self._new_exchange(f"close/{self._count}")
            closing.post("closed", ("ok", None))
            if self.rank == 0:
                closing.gather("closed")

    # -- resuming ---------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest complete checkpoint of the run directory (rank 0 picks it, every
        rank loads its part, resharded to this plan) and return the step to continue
        from; 0 when there is none. Collective. Removes interrupted saves first."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from dtdsl.train import dcp_safe

        self.wait()
        found = -1
        if self.rank == 0:
            _remove_incomplete(self.run_dir)
            done = complete_checkpoints(self.run_dir)
            found = done[-1][0] if done else -1
        step = int.from_bytes(_broadcast_bytes(found.to_bytes(8, "little", signed=True),
                                               8), "little", signed=True)
        if step < 0:
            if self.rank == 0:
                self.log(f"checkpoint: none in {checkpoint_root(self.run_dir)}; "
                         "starting at step 0")
            return 0
        path = checkpoint_root(self.run_dir) / f"ckpt-{step}"
        manifest = read_manifest(path)
        if not same_spec(manifest, self.spec_sha256, self.program_sha256):
            raise CheckpointMismatch(
                f"{path} was written for spec {manifest.spec} (sha256 "
                f"{manifest.spec_sha256[:12]}...), this job runs sha256 "
                f"{self.spec_sha256[:12]}...; resume only with the same spec")
        start = time.perf_counter()
        state = state_dict(self.ex)
        try:
            saved = dcp_safe.read_metadata(path).state_dict_metadata
            if "local_sgd" in state:
                # Written under fewer Local SGD replicas: what it lacks starts from the
                # saved model (``local_sgd.StageSync.load_state_dict``).
                state["local_sgd"] = {k: v for k, v in state["local_sgd"].items()
                                      if f"local_sgd.{k}" in saved}
            dcp.load(state, checkpoint_id=str(path), storage_reader=dcp_safe.SafeReader(path),
                     planner=dcp_safe.SafeLoadPlanner())
        except dcp_safe.UnsafeMetadata as err:
            raise CheckpointMismatch(_unloadable(self.run_dir, path, str(err))) from None
        except CheckpointException as err:
            # A rank's own reading failed (the collectives around it worked): the files
            # are what they are, and a restart would read them again.
            raise CheckpointMismatch(_unloadable(self.run_dir, path, _first_failure(err))
                                     ) from None
        except Exception as err:
            raise CheckpointError(f"cannot load {path}: {err}") from err
        rng = _rng_state(manifest.rng_torch, torch.get_rng_state())
        cuda = manifest.rng_cuda is not None and torch.cuda.is_available()
        rng_cuda = _rng_state(manifest.rng_cuda, torch.cuda.get_rng_state()) if cuda else None
        if rng is None or (cuda and rng_cuda is None):
            raise CheckpointMismatch(_unloadable(
                self.run_dir, path, "its manifest's random number generator state is not "
                "one torch wrote"))
        load_state_dict(self.ex, state)
        self.loaded = step
        torch.set_rng_state(rng)
        if rng_cuda is not None:
            torch.cuda.set_rng_state(rng_cuda)
        if self.rank == 0:
            layout = " ".join(u.text for u in manifest.units)
            how = ("same plan" if manifest.plan_sha256 == self.plan_sha256 else
                   f"resharded from {layout}")
            self.log(f"checkpoint: resumed from {path} at step {manifest.next_step} ({how}, "
                     f"{time.perf_counter() - start:.2f} s)")
        return manifest.next_step

