"""No pickle from anything a job does not own: DCP's plans through the store as
authenticated plain records, ``.metadata`` of a run directory through an allow-list
unpickler, and a store attacker that changes nothing and is reported."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from dtdsl.ir import program as ir
from dtdsl.ir.checkpoint import checkpoint_root, complete_checkpoints
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train import dcp_safe
from dtdsl.train.checkpoint import Checkpointer
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.checkpoints import PLAN_A, PROGRAM


class _Payload:
    """What an attacker plants: unpickling it creates ``path`` (it would run any code)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state() -> dict:
    return {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
                      "i": torch.arange(5)},
            "step": 7, "name": "x"}


def _plans(tmp_path: Path):
    """A real single-rank save: its local plan, global plan, metadata and write results."""
    state = _state()
    writer = FileSystemWriter(str(tmp_path))
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                           is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    part = writer.prepare_global_plan(plans)[0]
    done = writer.write_data(planner.finish_plan(part), planner)
    done.wait()
    return local, part, metadata, done.value()


def test_dcp_values_round_trip_without_pickle(tmp_path):
    local, part, metadata, written = _plans(tmp_path)
    for value in (local, part, metadata, written, ("ok", part), ("error", "text"),
                  ("ok", None), ("ok", 3)):
        data = dcp_safe.encode(value)
        assert b"\x80\x04" not in data[:2]           # not a pickle
        assert dcp_safe.decode(data) == value
    # The decoded plan drives DCP's writer like the original.
    assert dcp_safe.decode(dcp_safe.encode(part)).storage_data == part.storage_data


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen",
                                  "torch.distributed.checkpoint.filesystem.FileSystemWriter",
                                  "pathlib.Path"])
def test_decode_builds_only_dcp_classes(name):
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb([name, [["x", "echo hi"]]])))
    with pytest.raises(dcp_safe.UnsafeMetadata, match="not one of DCP's metadata classes"):
        dcp_safe.decode(forged)
    with pytest.raises(TypeError):
        dcp_safe.encode({"a": Path("x").stat})
    for junk in (b"", b"\xc1", pickle.dumps(("ok", 1)), msgpack.packb({1: 2}),
                 msgpack.packb(msgpack.ExtType(99, b"")),
                 msgpack.packb(msgpack.ExtType(3, msgpack.packb([-1]))),
                 msgpack.packb(msgpack.ExtType(4, b"not_a_dtype")),
                 msgpack.packb(msgpack.ExtType(5, msgpack.packb(
                     ["torch.distributed.checkpoint.planner.WriteItemType", "NOPE"])))):
        with pytest.raises(dcp_safe.UnsafeMetadata):
            dcp_safe.decode(junk)


def test_sealed_records_survive_forgeries_around_them():
    secret, other = b"s" * 32, b"t" * 32
    key = "dtdsl/checkpoint/abc/1/part/0"
    real = dcp_safe.seal(secret, key, ("ok", 42))
    assert dcp_safe.unseal(secret, key, real) == (True, ("ok", 42), False)
    forged_tag = dcp_safe.seal(other, key, ("ok", 666))
    swallowing = dcp_safe.MAGIC + (10 ** 9).to_bytes(8, "little") + b"\0" * 32
    for before in (pickle.dumps(_Payload(Path("/nonexistent/x"))), forged_tag, swallowing,
                   dcp_safe.MAGIC, b"\0" * 100):
        found, value, forged = dcp_safe.unseal(secret, key, before + real + forged_tag)
        assert (found, value, forged) == (True, ("ok", 42), True)
    # Not for another key (no replay across ranks or saves), nor with another secret.
    assert dcp_safe.unseal(secret, key.replace("/0", "/1"), real)[0] is False
    assert dcp_safe.unseal(other, key, real) == (False, None, True)
    assert dcp_safe.unseal(secret, key, b"") == (False, None, False)


def test_metadata_reader_refuses_code_and_escapes(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    safe = dcp_safe.read_metadata(tmp_path / "ok")
    unsafe = FileSystemReader(str(tmp_path / "ok")).read_metadata()
    assert safe.state_dict_metadata == unsafe.state_dict_metadata
    assert safe.storage_data == unsafe.storage_data
    assert safe.planner_data == unsafe.planner_data
    # A planted .metadata that would run code when unpickled.
    bad = tmp_path / "bad"
    bad.mkdir()
    marker = tmp_path / "pwned"
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(dcp_safe.UnsafeMetadata, match=r"refers to .*open, which DCP"):
        dcp_safe.read_metadata(bad)
    assert not marker.exists()
    # A real metadata whose storage entries reach outside the checkpoint directory.
    for rel in ("../victim.txt", "/etc/passwd", "a/../../b", "", ".."):
        meta = FileSystemReader(str(tmp_path / "ok")).read_metadata()
        for info in meta.storage_data.values():
            info.relative_path = rel
        (bad / ".metadata").write_bytes(pickle.dumps(meta))
        with pytest.raises(dcp_safe.UnsafeMetadata, match="not a file name inside"):
            dcp_safe.read_metadata(bad)
    (bad / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(dcp_safe.UnsafeMetadata, match="is not DCP metadata"):
        dcp_safe.read_metadata(bad)
    # The reader DCP loads through gives the same tensors.
    state = {"model": {k: torch.empty_like(v) for k, v in _state()["model"].items()},
             "step": 0, "name": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp_safe.SafeReader(tmp_path / "ok"), no_dist=True)
    assert state["step"] == 7 and state["name"] == "x"


def test_a_non_tensor_entry_is_read_as_plain_data_or_refused(tmp_path):
    """DCP's default planner reads a non-tensor entry with a full unpickler: a .metadata of
    allowed classes could point one at a planted file. ``SafeLoadPlanner`` reads plain data
    and refuses the rest; nothing runs."""
    import io

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ok = tmp_path / "ok"
    dcp.save(_state(), checkpoint_id=str(ok), no_dist=True)

    def load(path):
        state = {"model": {k: torch.empty_like(v) for k, v in _state()["model"].items()},
                 "step": 0, "name": ""}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=dcp_safe.SafeReader(path),
                     planner=dcp_safe.SafeLoadPlanner(), no_dist=True)
        return state

    got = load(ok)
    assert (got["step"], got["name"]) == (7, "x")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    (ok / "__9_0.distcp").write_bytes(buf.getvalue())
    meta = FileSystemReader(str(ok)).read_metadata()
    (key,) = [k for k in meta.storage_data if k.fqn == "name"]
    meta.storage_data[key] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    (ok / ".metadata").write_bytes(pickle.dumps(meta))
    dcp_safe.read_metadata(ok)          # every class allowed, every file there
    with pytest.raises((dcp_safe.UnsafeMetadata, CheckpointException),
                       match="name is not plain data"):
        load(ok)
    assert not marker.exists()


def test_the_files_a_metadata_names_are_whole_regular_files(tmp_path):
    import os
    import shutil

    ok = tmp_path / "ok"
    dcp.save(_state(), checkpoint_id=str(ok), no_dist=True)
    (shard,) = sorted(p.name for p in ok.iterdir() if p.suffix == ".distcp")
    size = (ok / shard).stat().st_size

    def damaged(name, how):
        folder = tmp_path / name
        shutil.copytree(ok, folder)
        how(folder / shard)
        return folder

    cases = {
        "missing": (lambda p: p.unlink(), "is missing"),
        "cut": (lambda p: os.truncate(p, size // 2), "it was cut short"),
        "pipe": (lambda p: (p.unlink(), os.mkfifo(p)), "not a regular file"),
        "link": (lambda p: (p.rename(tmp_path / "elsewhere"), p.symlink_to(tmp_path /
                                                                          "elsewhere")),
                 "not a regular file"),
    }
    for name, (how, words) in cases.items():
        with pytest.raises(dcp_safe.UnsafeMetadata, match=words):
            dcp_safe.read_metadata(damaged(name, how))
    meta = FileSystemReader(str(ok)).read_metadata()
    for info in meta.storage_data.values():
        info.transform_descriptors = ["zstd"]
    (ok / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(dcp_safe.UnsafeMetadata, match="asks for transforms"):
        dcp_safe.read_metadata(ok)


def test_export_of_a_run_with_a_planted_metadata_runs_nothing(tmp_path, capsys):
    from dtdsl import cli

    # A run directory with a complete-looking checkpoint whose .metadata is a payload.
    ckpt = checkpoint_root(tmp_path / "run") / "ckpt-1"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (ckpt / "program.json").write_text(PROGRAM.model_dump_json())
    manifest = {"step": 1, "next_step": 1, "spec": PROGRAM.name,
                "spec_sha256": PROGRAM.source_sha256, "plan_sha256": "b" * 64,
                "world_size": 1, "units": [{"name": "u", "tp": 1, "dp": 1, "pp": 1}],
                "mode": "sync", "num_tensors": 1, "rng_torch": ""}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert complete_checkpoints(tmp_path / "run")
    status = cli.main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status not in (0, 3) and not marker.exists()
    assert "not DCP metadata" in err and "Traceback" not in err


def _attacked(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
              marker: str) -> None:
    """Rank 0 plays an attacker on the store too: before each save it plants a pickle and
    a record sealed with another secret under every key of that save's exchange."""
    import torch.distributed.distributed_c10d as c10d

    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    logs: list[str] = []
    ck = Checkpointer(ex, run_dir, mode="thread", log=logs.append)
    store = c10d._get_default_store()
    for step in range(2):
        ex.run_step(step)
        if rank == 0:
            prefix = f"dtdsl/checkpoint/{ck._nonce}/{ck._count + 1}"
            for what in ("plan", "part", "written", "committed"):
                for r in range(world):
                    key = f"{prefix}/{what}/{r}"
                    store.append(key, pickle.dumps(("ok", _Payload(Path(marker)))))
                    store.append(key, dcp_safe.seal(b"x" * 32, key, ("error", "forged")))
        ck.save(step + 1)
    ck.close()
    assert ck.saved == [1, 2]
    assert any("did not write" in line for line in logs), logs
    assert not Path(marker).exists()


def test_a_store_attacker_changes_nothing_and_is_reported(tmp_path):
    marker = tmp_path / "pwned"
    run(_attacked, PLAN_A.gpus_used, PROGRAM, PLAN_A, str(tmp_path), str(marker),
        timeout=180)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2]
    assert not marker.exists()
    # What was committed loads (through the safe reader) like any checkpoint.
    meta = dcp_safe.read_metadata(checkpoint_root(tmp_path) / "ckpt-2")
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)


def test_a_metadata_whose_tensor_entries_no_reader_can_build_is_refused(tmp_path):
    import shutil

    ok = tmp_path / "ok"
    dcp.save(_state(), checkpoint_id=str(ok), no_dist=True)
    dcp_safe.read_metadata(ok)

    def entry(meta):
        return meta.state_dict_metadata["model.w"]

    def no_dtype(meta):
        entry(meta).properties = None

    def text_shape(meta):
        entry(meta).size = ("3", "4")

    def negative(meta):
        entry(meta).size = torch.Size([3, -5])

    def huge(meta):
        entry(meta).size = torch.Size([1 << 20, 1 << 22])

    def chunk_outside(meta):
        entry(meta).chunks[0].sizes = torch.Size([30, 4])

    cases = {no_dtype: "has no dtype", text_shape: "a shape of other than sizes",
             negative: "a shape of other than sizes", huge: "more than its files hold",
             chunk_outside: "a chunk outside its shape"}
    for edit, words in cases.items():
        folder = tmp_path / edit.__name__
        shutil.copytree(ok, folder)
        meta = FileSystemReader(str(ok)).read_metadata()
        edit(meta)
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
        with pytest.raises(dcp_safe.UnsafeMetadata, match=words):
            dcp_safe.read_metadata(folder)
