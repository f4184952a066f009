"""What a run reads from its bundle and its run directory, handed over by whoever could
write them: a manifest that is a FIFO, a generator state that is not one, a job's file
names out of the bundle, a run directory that is the root or whose records' folders are
links (hostile-input probe)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dtdsl.ir.checkpoint import MANIFEST, CheckpointError, Manifest, read_manifest


def _manifest(**changed) -> Manifest:
    fields = dict(step=1, next_step=1, spec="s", spec_sha256="a" * 64, plan_sha256="b" * 64,
                  world_size=1, units=(), mode="sync", num_tensors=0, rng_torch="")
    return Manifest(**{**fields, **changed})


def test_a_manifest_that_is_no_regular_file_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / MANIFEST)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        read_manifest(tmp_path)
    assert time.monotonic() - start < 60           # it never waited for a writer
    (tmp_path / MANIFEST).unlink()
    (tmp_path / MANIFEST).symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="is a device, not a regular file"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).unlink()
    (tmp_path / MANIFEST).write_text(" " * (2 << 20))
    with pytest.raises(CheckpointError, match="more than 1 MiB"):
        read_manifest(tmp_path)


def test_a_generator_state_that_is_not_base64_is_no_manifest(tmp_path):
    text = json.loads(_manifest().model_dump_json())
    for bad in ("!!!notbase64", "AAA"):
        (tmp_path / MANIFEST).write_text(json.dumps({**text, "rng_torch": bad}))
        with pytest.raises(CheckpointError, match="rng_torch: Value error, not base64"):
            read_manifest(tmp_path)


def test_a_manifests_world_and_layouts_are_counts(tmp_path):
    text = json.loads(_manifest().model_dump_json())
    unit = {"name": "llm", "tp": 1, "dp": 1, "pp": 1}
    for changed, where in (({"world_size": -5}, "world_size"),
                           ({"world_size": 10**9}, "world_size"),
                           ({"units": [{**unit, "tp": -1}]}, "units.0.tp")):
        (tmp_path / MANIFEST).write_text(json.dumps({**text, **changed}))
        with pytest.raises(CheckpointError, match=f"manifest: {where}: Input should be"):
            read_manifest(tmp_path)


def test_a_generator_state_of_another_size_is_not_loaded():
    import base64

    import torch

    from dtdsl.train.checkpoint import _rng_state

    state = torch.get_rng_state()
    text = base64.b64encode(bytes(state.numpy())).decode()
    assert torch.equal(_rng_state(text, state), state)
    assert _rng_state("AAAA", state) is None


def test_a_jobs_files_stay_inside_its_bundle(tmp_path):
    from dtdsl.ir.job import load_job

    job = {"version": 2, "spec": "s", "spec_sha256": "a" * 64, "world_size": 1, "nodes": 1,
           "gpus_per_node": 1, "steps": 1, "reorder": [], "data": {"kind": "synthetic"},
           "feed": {"workers": 0, "workers_per_node": 0, "prefetch": 1,
                    "max_message_bytes": 1},
           "checkpoint": {"every": 0, "keep": 1}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert load_job(tmp_path).plan_file == "plan.json"
    for field, name in (("plan_file", "../../../../etc/passwd"), ("secret_file", "/etc/x"),
                        ("program_file", "")):
        (tmp_path / "job.json").write_text(json.dumps({**job, field: name}))
        with pytest.raises(ValueError) as err:
            load_job(tmp_path)
        assert f"{field}: Value error, {name!r} is not a file inside the bundle" in \
            str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_run_directory_is_no_root_and_its_records_no_links(tmp_path):
    from dtdsl.train.supervise import unusable_run_dir

    assert "filesystem's root" in unusable_run_dir(Path("/"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert "which does not exist" in unusable_run_dir(tmp_path / "dangling")
    assert unusable_run_dir(tmp_path / "new") is None
    (tmp_path / "elsewhere").mkdir()
    for name in ("logs", "tb"):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / name).symlink_to(tmp_path / "elsewhere")
        assert f"{run / name} is a symbolic link" in unusable_run_dir(run)


def test_a_newer_ckpt_that_is_no_folder_is_damaged_not_ignored(tmp_path):
    from dtdsl.ir.checkpoint import checkpoint_root, damaged_checkpoints

    root = checkpoint_root(tmp_path)
    root.mkdir()
    os.mkfifo(root / "ckpt-9")
    (root / "ckpt-10").write_text("")
    assert damaged_checkpoints(tmp_path) == [(root / "ckpt-9", "it is not a directory"),
                                              (root / "ckpt-10", "it is not a directory")]
