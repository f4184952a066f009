"""dtc export --overwrite: an export replaces only unit folders an export wrote, unchanged;
someone's model, a file no record lists, a changed file, a link, a record naming a path
outside are refused and nothing changes. (Loading the exports in transformers and
diffusers: test_pretrained.)"""

from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.outdir import RECORD

ROOT = Path(__file__).resolve().parents[2]
UNITS = ["gen", "llm", "llm_to_gen", "vit", "vit_to_llm"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint of tiny_cpu's freshly initialised model (as a run writes one)."""
    import torch.distributed.checkpoint as dcp

    from dtdsl.driver import run_frontend
    from dtdsl.ir.checkpoint import MANIFEST, PROGRAM, Manifest
    from dtdsl.models.multimodal import build_model

    spec = ROOT / "specs" / "tiny_cpu.dt"
    prog = run_frontend(str(spec), spec.read_bytes()).program
    state = {f"model.{n}": p.detach() for n, p in build_model(prog).named_parameters()}
    path = tmp_path_factory.mktemp("ckpt") / "ckpt-1"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / MANIFEST).write_text(Manifest(
        step=1, next_step=1, spec=prog.name, spec_sha256=prog.source_sha256,
        plan_sha256="0" * 64, world_size=1, units=(), mode="sync", num_tensors=len(state),
        rng_torch="").model_dump_json())
    (path / PROGRAM).write_text(prog.model_dump_json())
    return path


def export(ckpt: Path, out: Path, *extra: str) -> int:
    return cli.main(["export", str(ckpt), "-o", str(out), *extra])


def tree_of(folder: Path) -> dict[str, bytes]:
    """Every file and link under ``folder``, links as the path they hold."""
    return {p.relative_to(folder).as_posix(): (b"-> " + os.fsencode(p.readlink())
                                                if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def test_an_export_records_its_files_and_overwrite_replaces_it(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(ckpt, out) == 0
    assert f"dtc: exported {len(UNITS)} units to {out}" in capsys.readouterr().err
    first = tree_of(out)
    # Readable by whoever may read config.json (safetensors writes 0600 by itself).
    modes = {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert modes == {0o644}, modes
    assert sorted(p.name for p in out.iterdir()) == UNITS
    for unit in UNITS:
        record = json.loads((out / unit / RECORD).read_text())
        assert sorted(record["files"]) == sorted(p.name for p in (out / unit).iterdir()
                                                 if p.name != RECORD)
    assert export(ckpt, out) == 2                          # not empty
    assert export(ckpt, out, "--overwrite") == 0
    assert tree_of(out) == first
    # One unit again: the others stay as they were.
    (out / "llm" / "model.safetensors").unlink()           # one of its files gone: fine
    assert export(ckpt, out, "--overwrite", "--units", "llm") == 0
    assert tree_of(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # nothing staged is left


def _theirs(out: Path) -> None:
    """Someone's sharded model where the export puts llm: no record of ours."""
    (out / "llm").mkdir()
    (out / "llm" / "config.json").write_text('{"model_type": "llama"}')
    for i in (1, 2):
        (out / "llm" / f"model-0000{i}-of-00002.safetensors").write_bytes(b"their weights")


def _listing(out: Path, name: str) -> None:
    record = json.loads((out / "llm" / RECORD).read_text())
    record["files"][name] = {"size": 8, "sha256": "0" * 64}
    (out / "llm" / RECORD).write_text(json.dumps(record))


FOREIGN = {
    "someone's model": lambda out: (_remove(out / "llm"), _theirs(out)),
    "an unlisted file": lambda out: (out / "llm" / "model-00001-of-00002.safetensors")
    .write_bytes(b"x"),
    "an unlisted folder": lambda out: (out / "llm" / "sub").mkdir(),
    "a changed file": lambda out: (out / "llm" / "config.json").write_text("{}"),
    "a file beside the units": lambda out: (out / "notes.txt").write_text("mine"),
    "a folder of someone's beside them": lambda out: _theirs_beside(out),
    "an export without a record": lambda out: (out / "vit" / RECORD).unlink(),
    "a record naming ../victim.txt": lambda out: _listing(out, "../victim.txt"),
    "a record naming an absolute path": lambda out: _listing(out, str(out.parent / "v")),
}


def _remove(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def _theirs_beside(out: Path) -> None:
    (out / "other").mkdir()
    (out / "other" / "config.json").write_text("{}")


@pytest.mark.parametrize("case", FOREIGN)
def test_overwrite_refuses_what_no_export_wrote_and_changes_nothing(ckpt, tmp_path, capsys,
                                                                     case):
    out = tmp_path / "out"
    assert export(ckpt, out) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    FOREIGN[case](out)
    before = tree_of(out)
    capsys.readouterr()
    for units in ((), ("--units", "llm,vit")):
        assert export(ckpt, out, "--overwrite", *units) == 2
        err = capsys.readouterr().err
        assert "nothing was changed" in err and "Traceback" not in err, err
        assert tree_of(out) == before
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim.txt"]


def test_links_are_refused_and_their_targets_untouched(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(ckpt, out) == 0
    # The unit folder a link: to someone's model, and to an export of ours.
    elsewhere = tmp_path / "elsewhere"
    (out / "llm").rename(elsewhere)
    (out / "llm").symlink_to(elsewhere)
    before, theirs = tree_of(out), tree_of(elsewhere)
    assert export(ckpt, out, "--overwrite") == 2
    assert f"{out / 'llm'} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before and tree_of(elsewhere) == theirs
    (out / "llm").unlink()
    elsewhere.rename(out / "llm")
    # A file in a unit folder a link to someone's file.
    victim = tmp_path / "victim.json"
    victim.write_bytes((out / "llm" / "config.json").read_bytes())
    (out / "llm" / "config.json").unlink()
    (out / "llm" / "config.json").symlink_to(victim)
    before, theirs = tree_of(out), victim.read_bytes()
    assert export(ckpt, out, "--overwrite") == 2
    assert f"{out / 'llm' / 'config.json'} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before and victim.read_bytes() == theirs
    (out / "llm" / "config.json").unlink()
    victim.rename(out / "llm" / "config.json")
    # The output folder a link.
    link = tmp_path / "link"
    link.symlink_to(out)
    before = tree_of(out)
    for extra in (("--overwrite",), ()):       # not "pass --overwrite", then refused
        assert export(ckpt, link, *extra) == 2
        assert f"{link} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link2").symlink_to(empty)
    assert export(ckpt, tmp_path / "link2") == 2
    assert not any(empty.iterdir())


def test_a_file_is_not_an_output_folder(ckpt, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for extra in ((), ("--overwrite",)):
        assert export(ckpt, tmp_path / "file", *extra) == 2
        assert f"{tmp_path / 'file'} exists and is not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_a_damaged_checkpoint_is_one_line_and_leaves_no_folder(ckpt, tmp_path, capsys):
    import shutil

    from dtdsl.ir.checkpoint import checkpoint_root

    run = tmp_path / "run"
    good = checkpoint_root(run) / "ckpt-1"
    shutil.copytree(ckpt, good)
    assert export(run, tmp_path / "ok", "--units", "vit") == 0
    assert f"reading {good} (after step 1)" in capsys.readouterr().err
    # A newer ckpt-N that is not whole: not skipped in silence for an older one.
    newer = checkpoint_root(run) / "ckpt-3"
    shutil.copytree(ckpt, newer)
    (newer / "manifest.json").write_text("{")
    assert export(run, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"the newest checkpoint, {newer}, is not complete ({newer}/manifest.json is " \
           "not a checkpoint manifest: Invalid JSON: EOF while parsing an object at line 1 " \
           "column 1); name an older one with --step (the newest complete: --step 1)" in err
    assert export(run, tmp_path / "out", "--step", "1", "--units", "vit") == 0
    capsys.readouterr()
    # A shard whole in size but not a torch file: one line, and no folder made for it.
    shard = max(good.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(bytes(shard.stat().st_size))
    out = tmp_path / "never"
    assert export(good, out) == 2
    err = capsys.readouterr().err
    assert f"cannot read {good}: " in err and "Traceback" not in err
    assert not out.exists()
    # What an interrupted export leaves beside its units is named as such.
    (tmp_path / "ok" / ".llm.dtdsl-new-0a1b2c").mkdir()
    assert export(ckpt, tmp_path / "ok", "--overwrite", "--units", "vit") == 2
    assert "holds .llm.dtdsl-new-0a1b2c, left by an export that was interrupted" in \
        capsys.readouterr().err


def test_units_that_name_none_are_refused(ckpt, tmp_path, capsys):
    for units in (",,", ""):
        assert export(ckpt, tmp_path / "out", "--units", units) == 2
        assert f"--units {units!r} names no unit" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_failed_export_removes_the_folders_it_made(ckpt, tmp_path, capsys):
    import shutil

    bad = tmp_path / "ckpt-1"
    shutil.copytree(ckpt, bad)
    shard = max(bad.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(bytes(shard.stat().st_size))
    (tmp_path / "kept").mkdir()
    assert export(bad, tmp_path / "kept" / "new" / "deeper" / "out") == 2
    assert f"cannot read {bad}: " in capsys.readouterr().err
    assert list((tmp_path / "kept").iterdir()) == []       # its own parent stays


def test_a_program_that_is_not_one_is_one_line(ckpt, tmp_path, capsys):
    import shutil

    from dtdsl.ir.checkpoint import PROGRAM

    bad = tmp_path / "ckpt-1"
    shutil.copytree(ckpt, bad)
    program = json.loads((bad / PROGRAM).read_text())
    del program["modules"]
    program["name"] = 7
    (bad / PROGRAM).write_text(json.dumps(program))
    assert export(bad, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{bad / PROGRAM} is not a program: " in err and "(and 1 more)" in err
    assert not (tmp_path / "out").exists()
