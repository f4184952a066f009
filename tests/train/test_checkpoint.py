"""Checkpoints: the canonical layout, one writer per tensor, complete-only loading, bitwise
resume under the same plan and resharded resume under other plans (in-process gloo ranks)."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import (
    CheckpointError,
    Manifest,
    UnitLayout,
    checkpoint_root,
    complete_checkpoints,
    damaged_checkpoints,
    latest_checkpoint,
    program_sha256,
    read_manifest,
)
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import Checkpointer, _commit
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.checkpoints import (
    PLAN_A,
    PROGRAM,
    _close,
    _go,
    _over_the_groups_there_are,
    _reference,
)
from tests.helpers.runs import plan_for, spec

# ---- files: what counts as a checkpoint --------------------------------------------------


def _manifest(step: int) -> Manifest:
    return Manifest(step=step, next_step=step, spec="s", spec_sha256="a" * 64,
                    plan_sha256="b" * 64, world_size=1,
                    units=(UnitLayout(name="u", tp=1, dp=1, pp=1),), mode="sync",
                    num_tensors=0, rng_torch="")


def _fake(run_dir: Path, name: str, *, manifest: Manifest | None = None,
          metadata: bool = True) -> Path:
    path = checkpoint_root(run_dir) / name
    path.mkdir(parents=True)
    if metadata:
        (path / ".metadata").write_bytes(b"x")
    if manifest is not None:
        (path / "manifest.json").write_text(manifest.model_dump_json())
    return path


def test_only_complete_checkpoints_count(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _fake(tmp_path, "ckpt-2", manifest=_manifest(2))
    _fake(tmp_path, "ckpt-4.tmp", manifest=_manifest(4))      # interrupted: never renamed
    _fake(tmp_path, "ckpt-6")                                  # no manifest
    _fake(tmp_path, "ckpt-8", manifest=_manifest(7))           # manifest of another step
    _fake(tmp_path, "ckpt-10", manifest=_manifest(10), metadata=False)   # no DCP metadata
    (checkpoint_root(tmp_path) / "ckpt-12").write_text("a file")
    (checkpoint_root(tmp_path) / "ckpt-14").mkdir()
    (checkpoint_root(tmp_path) / "ckpt-14" / "manifest.json").write_text("{not json")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]
    assert latest_checkpoint(tmp_path) == checkpoint_root(tmp_path) / "ckpt-2"
    with pytest.raises(CheckpointError, match="not a checkpoint manifest"):
        read_manifest(checkpoint_root(tmp_path) / "ckpt-14")
    # Newer than the newest complete one: dtdsl renames only whole saves into place.
    assert [(p.name, why.split(":")[0]) for p, why in damaged_checkpoints(tmp_path)] == [
        ("ckpt-6", f"cannot read {checkpoint_root(tmp_path) / 'ckpt-6' / 'manifest.json'}"),
        ("ckpt-8", "its manifest says step 7"), ("ckpt-10", "it has no DCP .metadata"),
        # a file where a save would rename its folder: the save at step 12 would fail
        ("ckpt-12", "it is not a directory"), ("ckpt-14", "it has no DCP .metadata")]
    # a checkpoint is taken between steps: its data cursor is its step
    with pytest.raises(ValueError, match="step 4 and next_step 1 must be equal"):
        Manifest.model_validate({**_manifest(4).model_dump(), "next_step": 1})


def test_commit_renames_last_and_keeps_the_newest(tmp_path):
    for step in (3, 6, 9, 12):
        tmp = _fake(tmp_path, f"ckpt-{step}.tmp")
        assert latest_checkpoint(tmp_path) != tmp.with_name(f"ckpt-{step}")
        final = _commit(tmp, _manifest(step), keep=2)
        assert final.name == f"ckpt-{step}" and not tmp.exists()
        assert read_manifest(final).step == step
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [9, 12]
    # The same step saved again (a resumed run passing it once more) replaces it.
    tmp = _fake(tmp_path, "ckpt-12.tmp")
    (tmp / "marker").write_text("new")
    final = _commit(tmp, _manifest(12), keep=2)
    assert (final / "marker").read_text() == "new"
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["ckpt-12", "ckpt-9"]


# ---- multi-rank: save, resume, reshard ------------------------------------------------------

# B: the backbone and the generator tensor parallel (5 ranks)
PLAN_B = plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 1, 1),
                  ("gen", "generator", 2, 1, 1))
# C: the encoder tensor parallel, the backbone in two pipeline stages (5 ranks)
PLAN_C = plan_for(PROGRAM, ("vit", "encoder", 2, 1, 1), ("llm", "backbone", 1, 1, 2),
                  ("gen", "generator", 1, 1, 1))














@pytest.fixture(scope="module")
def plan_a_run(tmp_path_factory) -> tuple[Path, dict]:
    """Plan A from scratch: a synchronous save after 2 steps, one in the background after
    4; its run directory and rank 0's output. One run for the module: each test that
    resumes from it, damages or interrupts it, does so in a copy (``_copy_of_a``)."""
    import torch

    folder = tmp_path_factory.mktemp("plan_a")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)    # as ``deterministic``
    try:
        a = _go(PLAN_A, folder / "a", 4, {2: "sync", 4: "thread"}, folder / "a.json",
                want_at=4)
    finally:
        torch.use_deterministic_algorithms(before)
    return folder / "a", a


def _copy_of_a(plan_a_run: tuple[Path, dict], to: Path) -> dict:
    shutil.copytree(plan_a_run[0], to)
    return plan_a_run[1]


@pytest.mark.usefixtures("deterministic")   # compares losses bitwise
def test_save_resume_and_reshard(tmp_path, plan_a_run):
    ref, _ = _reference()
    a_dir = tmp_path / "a"
    # Plan A from scratch: a synchronous save after 2 steps, one in the background after 4.
    a = _copy_of_a(plan_a_run, a_dir)
    assert a["first"] == 0
    _close(a["losses"], ref[:4])
    assert [s for s, _ in complete_checkpoints(a_dir)] == [2, 4]
    m = read_manifest(checkpoint_root(a_dir) / "ckpt-4")
    assert (m.step, m.next_step, m.mode, m.world_size) == (4, 4, "thread", 4)
    assert m.spec_sha256 == PROGRAM.source_sha256
    assert [(u.name, u.tp, u.dp, u.pp) for u in m.units] == [
        ("vit", 1, 1, 1), ("llm", 1, 2, 1), ("gen", 1, 1, 1)]

    # The layout: every parameter of the model (frozen ones too) under its single-process
    # name, with its full shape, and the AdamW state of the trainable ones; each element
    # written once, by the rank whose shard holds it (no rank gathers a full tensor).
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint_root(a_dir) / "ckpt-4")).read_metadata()
    model = build_model(PROGRAM)
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    keys = set(meta.state_dict_metadata)
    assert keys == ({f"model.{n}" for n in params} |
                    {f"optim.{n}.{k}" for n in trainable
                     for k in ("exp_avg", "exp_avg_sq", "step")})
    assert m.num_tensors == len(keys)
    for n, p in params.items():
        assert tuple(meta.state_dict_metadata[f"model.{n}"].size) == tuple(p.shape)
        if n in trainable:
            assert tuple(meta.state_dict_metadata[f"optim.{n}.exp_avg"].size) == tuple(p.shape)
    chunks: dict[str, list] = {}
    files: dict[str, set[str]] = {}
    for index, info in meta.storage_data.items():
        chunks.setdefault(index.fqn, []).append(index.offset)
        files.setdefault(index.fqn, set()).add(info.relative_path)
    for key in keys:
        if key.endswith(".step"):
            continue
        entry = meta.state_dict_metadata[key]
        written = sum(math.prod(c.sizes) for c in entry.chunks)
        assert written == math.prod(entry.size), key     # the shards tile the tensor once
    # llm is on ranks 1 and 2 (DP 2, FSDP2): each writes its own half of each tensor
    assert {f.split("_")[2] for f in files["model.units.llm.layers.0.attn.wq.weight"]} == \
        {"1", "2"}

    # The same plan from ckpt-2, bitwise the same losses:
    # test_an_interrupted_save_is_not_loaded_and_is_removed resumes it there.

    # Plan B (backbone and generator TP 2) from A's background save: resharded by DCP,
    # matches the reference; it saves its TP shards as they are.
    b = _go(PLAN_B, a_dir, 2, {6: "thread"}, tmp_path / "b.json", want_at=6)
    assert b["first"] == 4 and "resharded from" in b["logs"][0]
    _close(b["losses"], ref[4:6])
    assert [u.tp for u in read_manifest(latest_checkpoint(a_dir)).units] == [1, 2, 2]

    # Plan C (encoder TP 2, backbone PP 2, 5 ranks) from B's save, written by TP ranks.
    c = _go(PLAN_C, a_dir, 2, {}, tmp_path / "c.json", want_at=8)
    assert c["first"] == 6
    _close(c["losses"], ref[6:8])


@pytest.mark.usefixtures("deterministic")   # compares losses bitwise
def test_an_interrupted_save_is_not_loaded_and_is_removed(tmp_path, plan_a_run):
    ref, _ = _reference()
    a = _copy_of_a(plan_a_run, tmp_path / "a")
    # Simulate plan A's save of step 4 interrupted before its commit.
    root = checkpoint_root(tmp_path / "a")
    (root / "ckpt-4" / "manifest.json").unlink()
    (root / "ckpt-4").rename(root / "ckpt-4.tmp")
    r = _go(PLAN_A, tmp_path / "a", 2, {}, tmp_path / "r.json")
    assert r["first"] == 2
    _close(r["losses"], ref[2:4])
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-2"]
    # The same plan from ckpt-2: bitwise the run's own losses (test_save_resume_and_reshard's
    # same-plan resume).
    assert r["losses"] == a["losses"][2:4]
    assert "same plan" in r["logs"][0]


def test_a_resume_removes_only_what_an_interrupted_save_left(tmp_path):
    # ckpt-<N>.tmp and ckpt-<N>.old are dtdsl's; a user's folder of another name (even
    # one ending in .old), a file, and a link to a folder outside stay as they were.
    from dtdsl.train.checkpoint import _remove_incomplete

    root = checkpoint_root(tmp_path)
    outside = tmp_path / "outside.old"
    for folder in ("ckpt-2.tmp", "ckpt-3.old", "my-notes.old", "ckpt-x.tmp", "ckpt-4"):
        (root / folder).mkdir(parents=True)
        (root / folder / "f").write_text("x")
    (root / "notes.tmp").write_text("x")
    outside.mkdir()
    (outside / "f").write_text("x")
    (root / "ckpt-5.old").symlink_to(outside, target_is_directory=True)
    _remove_incomplete(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [
        "ckpt-4", "ckpt-5.old", "ckpt-x.tmp", "my-notes.old", "notes.tmp"]
    assert (root / "my-notes.old" / "f").read_text() == "x" and (outside / "f").exists()


def test_another_spec_is_refused(tmp_path, plan_a_run):
    _copy_of_a(plan_a_run, tmp_path / "a")
    path = checkpoint_root(tmp_path / "a") / "ckpt-4" / "manifest.json"
    data = json.loads(path.read_text())
    assert data["program_sha256"] == program_sha256(PROGRAM)
    # Another text of the same program (a comment, dtc fmt): resumed.
    path.write_text(json.dumps({**data, "spec_sha256": "f" * 64}))
    assert _go(PLAN_A, tmp_path / "a", 1, {}, tmp_path / "b.json")["first"] == 4
    # Another program: refused.
    path.write_text(json.dumps({**data, "spec_sha256": "f" * 64, "program_sha256": "e" * 64}))
    with pytest.raises(AssertionError, match="resume only with the same spec"):
        _go(PLAN_A, tmp_path / "a", 1, {}, tmp_path / "c.json")


def test_the_program_digest_leaves_out_the_text_and_the_checkpoint_cadence():
    from tests.specs import program, variant

    base = program_sha256(program())
    same = [variant("# A tiny multimodal", "# A small multimodal"),
            variant("checkpoint_every = 10", "checkpoint_every = 3"),
            variant("checkpoint_every = 10", "checkpoint_every = 10\n  keep_checkpoints = 7")]
    assert [program_sha256(p) for p in same] == [base] * 3
    assert program_sha256(variant("steps            = 20", "steps            = 21")) != base


def test_a_damaged_checkpoint_is_refused_once_not_retried(tmp_path, plan_a_run):
    """Files that fail to load fail again after a restart: CheckpointMismatch, whose message
    ends the launch (feed.faults), naming what to move aside."""
    _copy_of_a(plan_a_run, tmp_path / "a")
    shard = max(checkpoint_root(tmp_path / "a").glob("ckpt-4/*.distcp"),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(bytes(shard.stat().st_size))          # whole, but zeros
    with pytest.raises(AssertionError, match=r"CheckpointMismatch: cannot load \S*ckpt-4: "):
        _go(PLAN_A, tmp_path / "a", 1, {}, tmp_path / "b.json")


def _frozen(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
            out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    ck = Checkpointer(ex, run_dir, mode="sync", log=lambda _: None)
    first = ck.resume()
    losses = []
    for step in range(first, 2):
        losses.append(ex.run_step(step)["loss"])
        if step == 0:
            ck.save(1)
    ck.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"first": first, "losses": losses}))


@pytest.mark.usefixtures("deterministic")
def test_frozen_units_are_saved_without_optimizer_state_and_resume_bitwise(tmp_path):
    # Nothing on the generator's rank trains: it saves its weights (no optimizer state)
    # and takes part in every save and load.
    program = spec(8, frozen=("gen", "llm_to_gen"))
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    run(_frozen, 3, program, plan, str(tmp_path), str(tmp_path / "a.json"), timeout=120)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint_root(tmp_path) / "ckpt-1")).read_metadata()
    units = {k.split(".")[2] for k in meta.state_dict_metadata if k.startswith("model.")}
    assert units == {"vit", "vit_to_llm", "llm", "gen", "llm_to_gen"}
    optimized = {k.split(".")[2] for k in meta.state_dict_metadata if k.startswith("optim.")}
    assert optimized == {"vit", "vit_to_llm", "llm"}
    a = json.loads((tmp_path / "a.json").read_text())
    run(_frozen, 3, program, plan, str(tmp_path), str(tmp_path / "b.json"), timeout=120)
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["first"] == 1 and b["losses"] == a["losses"][1:]


def _late_and_failing(rank: int, world: int, program: ir.Program, plan: Plan,
                      run_dir: str) -> None:
    """Two background saves: in the first rank 1 writes late, in the second rank 2's
    write fails."""
    from torch.distributed.checkpoint import FileSystemWriter

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    ck = Checkpointer(ex, run_dir, mode="thread", log=lambda _: None)
    write = FileSystemWriter.write_data
    saves = []

    def slow_or_broken(self: Any, *args: Any) -> Any:
        if rank == 1 and len(saves) == 1:
            time.sleep(1.5)
        if rank == 2 and len(saves) == 2:
            raise OSError(28, "No space left on device")
        return write(self, *args)

    root = checkpoint_root(run_dir)
    with mock.patch.object(FileSystemWriter, "write_data", slow_or_broken), \
            _over_the_groups_there_are():
        saves.append(1)
        ck.save(1)
        ck.wait()
        if rank == 0:       # committed only once rank 1 had written its part
            assert [s for s, _ in complete_checkpoints(run_dir)] == [1]
            assert any(p.name.startswith("__1_") for p in (root / "ckpt-1").iterdir())
        saves.append(2)
        ck.save(2)
        if rank == 2:
            with pytest.raises(CheckpointError, match="rank 2 could not write.*No space"):
                ck.wait()
        elif rank == 0:
            with pytest.raises(CheckpointError, match=r"rank 2: OSError.*No space"):
                ck.wait()
            assert [s for s, _ in complete_checkpoints(run_dir)] == [1]
            assert (root / "ckpt-2.tmp").is_dir()
        else:               # told by rank 0: no rank goes on believing it is saved
            with pytest.raises(CheckpointError, match=r"ckpt-2 was not committed: rank 0: "
                               r".*rank 2: OSError.*No space"):
                ck.wait()
        assert ck.saved == [1]
    ck.close()


def test_rank_zero_commits_once_every_rank_has_written_and_never_after_a_failure(tmp_path):
    run(_late_and_failing, PLAN_A.gpus_used, PROGRAM, PLAN_A, str(tmp_path), timeout=120)


PLAN_3 = plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                  ("gen", "generator", 1, 1, 1))


class _SlowToFree(dict):
    """A staged state dict whose release takes a while (as a large one's does)."""

    def __del__(self) -> None:
        time.sleep(0.5)


def _late_commit(rank: int, world: int, program: ir.Program, plan: Plan,
                 run_dir: str) -> None:
    """A background save whose commit comes late (rank 0's ``_commit`` sleeps), then one
    whose commit fails; the other ranks reach ``close``/``wait`` at once."""
    import dtdsl.train.checkpoint as checkpoint

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    ck = Checkpointer(ex, run_dir, mode="thread", log=lambda _: None)
    copy, commit = checkpoint._Staging.copy, checkpoint._commit

    def late(tmp: Path, manifest: Manifest, *args: Any) -> Path:
        if manifest.step == 2:
            raise OSError(28, "No space left on device")
        time.sleep(1.0)
        return commit(tmp, manifest, *args)

    def alive() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "dtdsl-checkpoint"]

    with mock.patch.object(checkpoint, "_commit", late), \
            mock.patch.object(checkpoint._Staging, "copy",
                              lambda self, s: _SlowToFree(copy(self, s))):
        ck.save(1)
        ck.wait()
        # Every rank's wait returns once rank 0 has committed, and once the saving thread
        # has ended (nothing of it left running into the interpreter's exit).
        assert [s for s, _ in complete_checkpoints(run_dir)] == [1]
        assert ck.saved == [1] and not alive()
        ck.save(2)
        # rank 0's own error; the others' from rank 0
        with pytest.raises(OSError if rank == 0 else CheckpointError,
                           match="No space left" if rank == 0 else
                           r"ckpt-2 was not committed: rank 0: OSError.*No space left"):
            ck.close()
        assert ck.saved == [1] and not alive()
        assert [s for s, _ in complete_checkpoints(run_dir)] == [1]


def test_every_rank_waits_for_the_commit_and_the_saving_thread(tmp_path):
    run(_late_commit, PLAN_3.gpus_used, PROGRAM, PLAN_3, str(tmp_path), timeout=120)


def _abandoned(rank: int, world: int, program: ir.Program, plan: Plan,
               run_dir: str) -> None:
    """A failing job abandons a background save: rank 2 still writes, rank 0 waits for
    it in the store, rank 1 waits there for rank 0's commit. Rank 2's write goes on only
    once ranks 0 and 1 have closed: a close that waited for it would never return (the
    run's timeout fails the test; no timing is asserted)."""
    from torch.distributed.checkpoint import FileSystemWriter

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    ck = Checkpointer(ex, run_dir, mode="thread", log=lambda _: None)
    write = FileSystemWriter.write_data
    closed = [os.path.join(run_dir, f"closed.{r}") for r in (0, 1)]

    def held(self: Any, *args: Any) -> Any:
        while rank == 2 and not all(map(os.path.exists, closed)):
            time.sleep(0.05)
        return write(self, *args)

    with mock.patch.object(FileSystemWriter, "write_data", held):
        ck.save(1)
        time.sleep(0.5)
        ck.close(wait=False)        # no error; the thread released from the store
        if rank != 2:
            open(closed[rank], "w").close()
    assert not [t for t in threading.enumerate() if t.name == "dtdsl-checkpoint"]
    assert complete_checkpoints(run_dir) == []


def test_an_abandoned_save_releases_its_thread(tmp_path):
    run(_abandoned, PLAN_3.gpus_used, PROGRAM, PLAN_3, str(tmp_path), timeout=120)


def test_a_failed_background_save_stops_the_run_at_once():
    from concurrent.futures import Future

    from dtdsl.ir.checkpoint import CheckpointError

    ck = Checkpointer.__new__(Checkpointer)     # the save's bookkeeping alone
    done: Future = Future()
    ck._pending = done
    ck.poll()                                  # still writing: nothing to say
    done.set_exception(OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match="background checkpoint save failed.*No space"):
        ck.poll()
    ck.poll()                                  # said once


def test_a_thread_saves_staged_copy_reuses_its_buffers_while_the_state_keeps_its_layout():
    import torch

    from dtdsl.train.checkpoint import _Staging

    staging = _Staging(pin=False)
    state = {"model": {"w": torch.arange(6.0).view(2, 3)},
             "optim": {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, 3)}},
                       "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    first = staging.copy(state)
    assert torch.equal(first["model"]["w"], state["model"]["w"])
    assert first["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    buffer = first["model"]["w"].data_ptr()
    # The next save's values in the same buffers, the plain values the state's own.
    state["model"]["w"].mul_(-1)
    state["optim"]["param_groups"][0]["lr"] = 0.05
    second = staging.copy(state)
    assert second["model"]["w"].data_ptr() == buffer
    assert torch.equal(second["model"]["w"], -torch.arange(6.0).view(2, 3))
    assert second["optim"]["param_groups"][0]["lr"] == 0.05
    # Another layout (a tensor reshaped, an entry added): buffers of its own.
    state["model"]["w"] = torch.zeros(3, 2)
    state["model"]["b"] = torch.ones(2)
    third = staging.copy(state)
    assert set(third["model"]) == {"w", "b"} and third["model"]["w"].shape == (3, 2)
    assert third["model"]["w"].data_ptr() != buffer
