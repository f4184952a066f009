"""dtc compile: bundle contents, determinism, safety against hostile specs, scale."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.codegen.emit import SECRET_FILE, py_literal
from dtdsl.ir.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"


def compile_spec(spec: Path, out: Path, *extra: str) -> int:
    """``dtc compile``; with samples drawn from the spec unless ``extra`` names data (the
    shipped specs' datasets are not in a fresh checkout)."""
    if "--data" not in extra and "--synthetic" not in extra and "--real-data" not in extra:
        extra = (*extra, "--synthetic")
    extra = tuple(e for e in extra if e != "--real-data")
    return cli.main(["compile", str(spec), "-o", str(out), *extra])


def test_a_bundle_never_falls_back_to_drawn_samples(tmp_path, capsys):
    spec = tmp_path / "tiny.dt"
    spec.write_text((SPECS / "tiny_cpu.dt").read_text())
    assert compile_spec(spec, tmp_path / "a", "--real-data") == 1
    assert "error[DT314]: data source 'data/tiny' cannot be read" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    spec.write_text(spec.read_text().replace('  source = "data/tiny"\n', ""))
    assert compile_spec(spec, tmp_path / "b", "--real-data") == 2
    assert "names no source: give --data SOURCE" in capsys.readouterr().err
    assert compile_spec(spec, tmp_path / "c", "--data", str(tmp_path / "none")) == 2
    assert f"--data {tmp_path / 'none'}: no such file" in capsys.readouterr().err
    assert compile_spec(spec, tmp_path / "d") == 0       # --synthetic: asked for


def files_of(bundle: Path) -> dict[str, bytes]:
    return {p.relative_to(bundle).as_posix(): p.read_bytes()
            for p in sorted(bundle.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["tiny_cpu", "mllm_72b"])
def test_two_compiles_are_byte_identical_but_for_the_key(tmp_path, name, shipped_bundle):
    # A compile that plans, and one of the plan `dtc plan -o` wrote, planned apart (once
    # a test process: tests/conftest.py): the same files, the key aside.
    a = tmp_path / "a"
    assert compile_spec(SPECS / f"{name}.dt", a) == 0
    b = shipped_bundle(name)
    fa, fb = files_of(a), files_of(b)
    assert fa.keys() == fb.keys()
    differ = [p for p in fa if fa[p] != fb[p]]
    assert differ == [SECRET_FILE]


def test_bundle_layout_headers_manifest_and_key(tmp_path):
    out = tmp_path / "bundle"
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--synthetic") == 0
    files = files_of(out)
    for path in ("spec.dt", "program.json", "plan.json", "schedule.txt", "job.json",
                 "train.py", "workers/worker.py", "launch.sh", "slurm.sbatch", "README.md",
                 "manifest.json", SECRET_FILE):
        assert path in files, path
    sha = json.loads(files["plan.json"])["spec_sha256"]
    for path, data in files.items():
        if path.endswith((".py", ".sh", ".sbatch", ".md")) or path == "schedule.txt":
            head = data.decode().splitlines()[:3]
            assert any("@generated" in line and sha in line for line in head), path
        if path.endswith(".py"):
            ast.parse(data.decode(), path)
    manifest = json.loads(files["manifest.json"])
    assert set(manifest["files"]) == set(files) - {"manifest.json", SECRET_FILE}
    for path, digest in manifest["files"].items():
        assert hashlib.sha256(files[path]).hexdigest() == digest
    assert stat.S_IMODE(os.stat(out / SECRET_FILE).st_mode) == 0o600
    assert len(bytes.fromhex(files[SECRET_FILE].decode().strip())) == 32
    assert os.access(out / "launch.sh", os.X_OK)
    # every rank of the plan has exactly one program, which names it
    table = ast.literal_eval(_assignment(files["train.py"].decode(), "RANK_TABLE"))
    assert sorted(table) == list(range(json.loads(files["job.json"])["world_size"]))
    for rank, path in table.items():
        assert f"        {rank}: RankEntry(" in files[path].decode()


def _assignment(text: str, name: str) -> str:
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == name:  # type: ignore[attr-defined]
            return ast.unparse(node.value)
    raise AssertionError(f"no {name}")


def test_refuses_a_non_bundle_directory_and_overwrites_a_bundle(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert compile_spec(SPECS / "tiny_cpu.dt", out) == 2
    assert "holds no bundle" in capsys.readouterr().err
    out2 = tmp_path / "b2"
    assert compile_spec(SPECS / "tiny_cpu.dt", out2) == 0
    (out2 / "run").mkdir()
    (out2 / "run" / "metrics.jsonl").write_text("{}\n")
    assert compile_spec(SPECS / "tiny_cpu.dt", out2) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert compile_spec(SPECS / "tiny_cpu.dt", out2, "--overwrite", "--steps", "3") == 0
    assert (out2 / "run" / "metrics.jsonl").read_text() == "{}\n"
    assert json.loads((out2 / "job.json").read_text())["steps"] == 3


def test_the_bundle_checkpoints_as_the_spec_says(tmp_path):
    # checkpoint_every and keep_checkpoints reach job.json, which the ranks' Checkpointer
    # reads (keep_checkpoints was once a constant 3 whatever the spec said).
    text = (SPECS / "tiny_cpu.dt").read_text()
    assert "checkpoint_every = 10" in text
    spec = tmp_path / "tiny_keep.dt"
    spec.write_text(text.replace("checkpoint_every = 10",
                                 "checkpoint_every = 4\n  keep_checkpoints = 5"))
    assert compile_spec(spec, tmp_path / "b") == 0
    job = json.loads((tmp_path / "b" / "job.json").read_text())
    assert (job["checkpoint"]["every"], job["checkpoint"]["keep"]) == (4, 5)


def tree_of(folder: Path) -> dict[str, bytes]:
    """Every file and link under ``folder``, links as the path they hold."""
    return {p.relative_to(folder).as_posix(): (b"-> " + os.fsencode(p.readlink())
                                                if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def _unlist(out: Path, name: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["files"][name]
    (out / "manifest.json").write_text(json.dumps(manifest))


FOREIGN = {
    "an unlisted file": lambda out: (out / "notes.txt").write_text("mine"),
    "an unlisted file in ranks/": lambda out: (out / "ranks" / "extra.py").write_text("x"),
    # One with the name of a file the bundle writes, which the manifest does not list.
    "a file named as the bundle's": lambda out: _unlist(out, "README.md"),
    "a changed file": lambda out: (out / "launch.sh").write_text("echo mine\n"),
    "a changed key": lambda out: (out / SECRET_FILE).write_text("not a key\n"),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_overwrite_refuses_files_it_did_not_write_and_changes_nothing(tmp_path, capsys, case):
    out = tmp_path / "b"
    assert compile_spec(SPECS / "tiny_cpu.dt", out) == 0
    (out / "run").mkdir()
    (out / "run" / "metrics.jsonl").write_text("{}\n")
    FOREIGN[case](out)
    before = tree_of(out)
    capsys.readouterr()
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite", "--steps", "3") == 2
    err = capsys.readouterr().err
    assert "dtdsl did not write" in err or "was changed after dtdsl wrote it" in err, err
    assert "Traceback" not in err
    assert tree_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.parametrize("name", ["../victim.txt", "ABSOLUTE", "ranks/../../victim.txt",
                                  "./launch.sh", ""])
def test_a_manifest_naming_a_path_outside_is_refused_before_anything_goes(
        tmp_path, capsys, name):
    out = tmp_path / "b"
    assert compile_spec(SPECS / "tiny_cpu.dt", out) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    name = name.replace("ABSOLUTE", str(victim))
    manifest = json.loads((out / "manifest.json").read_text())
    # Listed after the bundle's own files, with the victim's true digest.
    manifest["files"] = {**manifest["files"],
                         name: hashlib.sha256(victim.read_bytes()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = tree_of(out)
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite") == 2
    assert "not a plain file name inside its folder" in capsys.readouterr().err
    assert victim.read_text() == "precious"
    assert tree_of(out) == before


@pytest.mark.parametrize("text", ["[" * 100_000, "[]", '{"files": 3}'])
def test_a_manifest_that_is_not_one_is_refused_in_one_line(tmp_path, capsys, text):
    out = tmp_path / "b"
    assert compile_spec(SPECS / "tiny_cpu.dt", out) == 0
    (out / "manifest.json").write_text(text)
    before = tree_of(out)
    capsys.readouterr()
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "is not a bundle manifest dtdsl wrote" in err and "Traceback" not in err, err
    assert tree_of(out) == before


def test_links_are_refused_and_what_they_point_to_untouched(tmp_path, capsys):
    out = tmp_path / "b"
    assert compile_spec(SPECS / "tiny_cpu.dt", out) == 0
    elsewhere = tmp_path / "elsewhere"
    (out / "ranks").rename(elsewhere)
    (out / "ranks").symlink_to(elsewhere)
    before, theirs = tree_of(out), tree_of(elsewhere)
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite") == 2
    assert f"{out / 'ranks'} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before and tree_of(elsewhere) == theirs
    # A link in a file's place, and the bundle's folder itself a link.
    (out / "ranks").unlink()
    elsewhere.rename(out / "ranks")
    victim = tmp_path / "victim.sh"
    victim.write_bytes((out / "launch.sh").read_bytes())
    (out / "launch.sh").unlink()
    (out / "launch.sh").symlink_to(victim)
    before, theirs = tree_of(out), victim.read_bytes()
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite") == 2
    assert f"{out / 'launch.sh'} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before and victim.read_bytes() == theirs
    (out / "launch.sh").unlink()
    victim.rename(out / "launch.sh")
    link = tmp_path / "link"
    link.symlink_to(out)
    before = tree_of(out)
    for extra in ((), ("--overwrite",)):
        assert compile_spec(SPECS / "tiny_cpu.dt", link, *extra) == 2
        assert f"{link} is a symbolic link" in capsys.readouterr().err
    assert tree_of(out) == before


def test_overwrite_replaces_its_bundle_and_keeps_what_runs_left(tmp_path):
    out, fresh = tmp_path / "b", tmp_path / "fresh"
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--steps", "5") == 0
    mine = {"run/metrics.jsonl": b"{}\n", "slurm-17.out": b"log\n",
            "ranks/__pycache__/x.pyc": b"cache"}
    for name, data in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    (out / "runs").symlink_to(tmp_path)
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite", "--steps", "3") == 0
    assert compile_spec(SPECS / "tiny_cpu.dt", fresh, "--steps", "3") == 0
    got, want = tree_of(out), files_of(fresh)
    assert {k: v for k, v in got.items() if k in mine} == mine
    assert got.pop("runs") == b"-> " + os.fsencode(tmp_path)
    rest = {k: v for k, v in got.items() if k not in mine}
    assert rest.keys() == want.keys()
    assert [k for k in rest if rest[k] != want[k]] == [SECRET_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "fresh"]


def test_an_interrupted_overwrite_leaves_a_bundle_overwrite_recognises(tmp_path, monkeypatch):
    out, fresh = tmp_path / "b", tmp_path / "fresh"
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--steps", "5") == 0
    (out / "run").mkdir()
    replace, calls = os.replace, []

    def dies(src, dst):
        calls.append(dst)
        if len(calls) == 6:
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", dies)
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite", "--steps", "3") == 130
    monkeypatch.setattr(os, "replace", replace)
    # Caught between the two bundles: some files moved, the manifest lists both digests.
    assert "replacing" in json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--overwrite", "--steps", "3") == 0
    assert compile_spec(SPECS / "tiny_cpu.dt", fresh, "--steps", "3") == 0
    got, want = files_of(out), files_of(fresh)
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == [SECRET_FILE]


HOSTILE = [
    '\\"); __import__(\'os\').system(\'touch PWNED\') #',
    "line\\nbreak\\\\ and '''triple''' $(touch PWNED) `touch PWNED`",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_strings_stay_inert_data(tmp_path, text):
    spec = (SPECS / "tiny_cpu.dt").read_text().replace('source = "data/tiny"',
                                                       f'source = "{text}"')
    path = tmp_path / "hostile.dt"
    path.write_text(spec)
    out = tmp_path / "bundle"
    assert compile_spec(path, out, "--steps", "1") == 0
    files = files_of(out)
    for rel, data in files.items():
        body = data.decode()
        if rel.endswith((".sh", ".sbatch")):
            assert "PWNED" not in body, rel
        elif rel.endswith(".py"):
            # the text may appear as a string literal (the dataset path of worker.py), never
            # as code: no name, attribute or comment of the program holds it
            tree = ast.parse(body)
            for node in ast.walk(tree):
                if isinstance(node, ast.Name | ast.Attribute):
                    assert "system" not in ast.unparse(node), rel
            code = "\n".join(line for line in body.splitlines()
                             if not line.lstrip().startswith("#"))
            literals = [n.value for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            assert code.count("PWNED") == sum(v.count("PWNED") for v in literals), rel
            assert "PWNED" not in "\n".join(line for line in body.splitlines()
                                             if line.lstrip().startswith("#")), rel
    bash = subprocess.run(["bash", "-n", str(out / "launch.sh")], capture_output=True)
    assert bash.returncode == 0
    # the text survives as data, exactly
    program = json.loads(files["program.json"])
    assert "PWNED" in program["data"]["source"]
    assert not list(tmp_path.rglob("PWNED"))


def test_bad_options_are_usage_errors(tmp_path, capsys):
    out = tmp_path / "b"
    with pytest.raises(SystemExit) as exit_:     # argparse's line, not pydantic's report
        compile_spec(SPECS / "tiny_cpu.dt", out, "--workers", "-1")
    assert exit_.value.code == 2
    assert "argument --workers: expected at least 0, not -1" in capsys.readouterr().err
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--data", "x", "--synthetic") == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:     # gone: the feed names no host
        cli.main(["compile", str(SPECS / "tiny_cpu.dt"), "-o", str(out), "--synthetic",
                  "--hosts", "h1"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --hosts" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_launch_script_refuses_bad_arguments_before_starting_anything(tmp_path):
    out = tmp_path / "b"
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--synthetic") == 0
    env = {**os.environ, "PYTHON": "/nonexistent/python"}   # nothing may start

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(out / "launch.sh"), *args], capture_output=True,
                              text=True, env=env, timeout=30, check=False)

    for args, said in [(("--steps", "0"), "--steps wants a positive integer"),
                       (("--steps", "x"), "--steps wants a positive integer"),
                       (("--max-restarts", "-1"), "--max-restarts wants a count"),
                       (("--checkpoint-mode", "async"), "--checkpoint-mode is thread or sync"),
                       (("--nnodes", "2"), "not --nnodes 2"),
                       (("--node-rank", "1"), "--node-rank wants 0..0, not '1'"),
                       (("--node-rank", "x"), "--node-rank wants 0..0, not 'x'"),
                       (("--port-base", "29600"), "unknown argument: --port-base"),
                       (("--bogus",), "unknown argument: --bogus")]:
        proc = launch(*args)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)
        assert not (out / "run").exists(), args


def test_py_literal_round_trips():
    for value in [None, True, 0, -3, 1.5, 1e-300, "a'\"\\\n\x00é", (), (1,), (1, "x"),
                  [1, [2]], {"k": (1, 2), 3: None}]:
        assert ast.literal_eval(py_literal(value)) == value
    with pytest.raises(TypeError):
        py_literal(float("nan"))
    with pytest.raises(TypeError):
        py_literal(object())


def test_paper_scale_compile(shipped_bundle):
    # how long it takes: benchmarks/tool_times.py; a compile of 72b that plans:
    # test_two_compiles_are_byte_identical_but_for_the_key, the same files as this one
    job = json.loads((shipped_bundle("mllm_72b") / "job.json").read_text())
    assert job["world_size"] > 1000 and job["nodes"] == -(-job["world_size"] // 8)


# ---- what the runtime cannot train yet: DT601 at compile time, nothing written ------------

TINY = (SPECS / "tiny_cpu.dt").read_text()


def _tiny(*edits: tuple[str, str]) -> str:
    text = TINY
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


_SECOND_IMAGE_ENCODER = _tiny(
    ("  backbone llm {", "  encoder vit2 (image) {\n"
     "    arch = transformer(layers=2, hidden=64, heads=4, ffn=128, patch=8)\n  }\n"
     "  backbone llm {"),
    ("  projector vit -> llm : mlp(depth=2)",
     "  projector vit -> llm : mlp(depth=2)\n  projector vit2 -> llm : mlp(depth=2)"),
    ("gpus          = 4", "gpus          = 5"))
_GENERATOR_PP = _tiny(("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  pp(gen) == 2"))
# A DiT generator pinned to two stages: the planner keeps it, the runtime trains it.
_UNET_ARCH = ("    arch = unet(channels=32, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, "
              "head_dim=16,\n                context_dim=64, groups=8)")
_DIT_PP = _tiny((_UNET_ARCH, "    arch = dit(layers=2, hidden=64, heads=4, ffn=128, patch=2, "
                 "latent=8)"), ("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  pp(gen) == 2"))
_INTERLEAVED = _tiny(("= 1f1b", "= interleaved(virtual_stages=2)"),
                     ("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  pp(llm) == 2"))
_ZERO_BUBBLE = _tiny(("= 1f1b", "= zero_bubble"))


def _unsupported(tmp_path: Path, capsys, text: str | None, spec: Path | None = None
                 ) -> tuple[str, list[int]]:
    """Compile a spec the runtime cannot train: exit 1, DT601 errors (their lines), no
    bundle; the rendered diagnostics."""
    if spec is None:
        spec = tmp_path / "spec.dt"
        spec.write_text(text)
    out = tmp_path / "bundle"
    capsys.readouterr()
    assert compile_spec(spec, out) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [int(line.split(":")[1]) for line in err.splitlines()
             if line.startswith(f"{spec}:") and "error[" in line]
    assert lines and all(f"{spec}:{n}:" in err for n in lines)
    assert err.count("error[DT601]") == len(lines), err
    assert not out.exists(), "nothing may be written"
    return err, lines


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_an_audio_encoder_without_a_patch_compiles_to_a_frame_stem(tmp_path, capsys):
    # No patch, no Whisper stem: the encoder reads its fbank a frame a token (once DT601,
    # "no patch size"); the bundle's program says so, and its model's stem takes a frame.
    # (The tiny counterpart of specs/audio_image.dt, its beats without a patch.)
    from dtdsl.ir.program import Program
    from tests.train.modal_specs import AUDIO_IMAGE

    beats = "ffn=64, patch=4, in_channels=1"
    assert beats in AUDIO_IMAGE
    spec = tmp_path / "spec.dt"
    spec.write_text(AUDIO_IMAGE.replace(beats, "ffn=64, in_channels=1"))
    capsys.readouterr()
    assert compile_spec(spec, tmp_path / "bundle", "--synthetic") == 0
    assert "DT601" not in capsys.readouterr().err
    program = Program.model_validate_json((tmp_path / "bundle" / "program.json").read_text())
    arch = program.module("beats").arch
    assert (arch.stem, arch.patch, arch.patch_dim) == ("frames", None, 16)


def test_audio_image_and_a_second_image_encoder_compile(tmp_path, capsys, planned_compile):
    # Several encoders of any modality train (issue 29): specs/audio_image.dt (its plan
    # puts the backbone on one stage, so `interleaved` interleaves nothing) and the tiny
    # spec with a second image encoder. The shipped spec's compile (`dtc compile
    # specs/audio_image.dt --synthetic`, planning included) is run once per test run and
    # shared with tests/train/test_modal.py: planning it is most of a minute of CPU.
    assert (planned_compile("audio_image") / "launch.sh").exists()
    spec = tmp_path / "spec.dt"
    spec.write_text(_SECOND_IMAGE_ENCODER)
    assert compile_spec(spec, tmp_path / "b") == 0


def test_a_dit_on_two_pipeline_stages_compiles(tmp_path, capsys):
    spec = tmp_path / "spec.dt"
    spec.write_text(_DIT_PP)
    capsys.readouterr()
    assert compile_spec(spec, tmp_path / "bundle") == 0
    assert "DT601" not in capsys.readouterr().err
    plan = Plan.model_validate_json((tmp_path / "bundle" / "plan.json").read_text())
    assert plan.unit("gen").pp == 2 and plan.unit("gen").layers_per_stage == (1, 1)


def test_a_unet_planned_on_two_pipeline_stages_is_refused():
    # A hand-edited plan can put a U-Net on two stages, which the planner never does.
    from dtdsl.codegen.support import runtime_support
    from dtdsl.driver import run_frontend
    from tests.helpers.runs import plan_for

    program = run_frontend("tiny_cpu.dt", TINY.encode()).program
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 2))
    (found,) = runtime_support(program, plan)
    assert found.code == "DT601" and "2 pipeline stages" in found.message
    assert "U-Net" in found.message and "pp(gen) == 1" in (found.hint or "")


def test_a_unet_on_two_pipeline_stages_is_refused_when_checked(tmp_path, capsys):
    """A U-Net's skip connections cross every cut: its constraint is DT407 at check
    time, before planning; no bundle."""
    spec = tmp_path / "spec.dt"
    spec.write_text(_GENERATOR_PP)
    capsys.readouterr()
    assert compile_spec(spec, tmp_path / "bundle") == 1
    err = capsys.readouterr().err
    assert f"{spec}:{_line_of(_GENERATOR_PP, 'pp(gen) == 2')}:" in err
    assert "error[DT407]" in err and "DT601" not in err
    assert not (tmp_path / "bundle").exists()


def test_a_zero_bubble_plan_compiles(tmp_path, capsys):
    """The runtime runs zero_bubble (``train.zerobubble``): no DT601, and the bundle's
    schedule splits each backbone backward into its B and W
    (tests/codegen/test_slurm.py's three-node job launches one)."""
    from dtdsl.ir.schedule import ActionKind, parse_schedule

    spec = tmp_path / "spec.dt"
    spec.write_text(_ZERO_BUBBLE)
    capsys.readouterr()
    assert compile_spec(spec, tmp_path / "bundle") == 0
    assert "DT601" not in capsys.readouterr().err
    text = (tmp_path / "bundle" / "schedule.txt").read_text()
    schedule = parse_schedule("\n".join(line for line in text.splitlines()
                                        if not line.startswith("#")))
    assert schedule.name == "zero_bubble"
    kinds = [a.kind for st in schedule.stages if st.unit == "llm" for a in st.actions]
    assert kinds.count(ActionKind.W) == kinds.count(ActionKind.B) > 0


def test_an_interleaved_plan_compiles(tmp_path, capsys):
    """The runtime runs interleaved plans (no DT601), and their lowering keeps NCCL's
    rules (``schedule.place``): the bundle is written, its schedule interleaved
    (tests/codegen/test_bundle_reorder.py launches one)."""
    from dtdsl.ir.schedule import parse_schedule

    spec = tmp_path / "spec.dt"
    spec.write_text(_INTERLEAVED)
    capsys.readouterr()
    assert compile_spec(spec, tmp_path / "bundle") == 0
    err = capsys.readouterr().err
    assert "DT601" not in err and "would hang on GPUs" not in err
    text = (tmp_path / "bundle" / "schedule.txt").read_text()
    schedule = parse_schedule("\n".join(line for line in text.splitlines()
                                        if not line.startswith("#")))
    assert schedule.unit("llm").vpp == 2


def test_an_interleaved_plan_beside_a_phased_encoder_compiles(tmp_path):
    """A plan may interleave the backbone beside a phased encoder (its hand-offs have a
    channel of their own, ``train.phases``): no DT601."""
    from dtdsl.codegen.support import runtime_support
    from dtdsl.driver import run_frontend
    from dtdsl.ir.plan import Plan

    assert cli.main(["plan", str(SPECS / "tiny_cpu.dt"), "-o", str(tmp_path / "p.json")]) == 0
    plan = Plan.model_validate_json((tmp_path / "p.json").read_bytes())
    program = run_frontend("tiny_cpu.dt", TINY.encode()).program
    units = tuple(u.model_copy(update={"vpp": 2}) if u.role == "backbone" else u
                  for u in plan.units)
    units = tuple(u.model_copy(update={"phased": True, "colocated": False})
                  if u.name == "vit" else u for u in units)
    assert runtime_support(program, plan.model_copy(update={"units": units})) == []


def test_the_baseline_plan_is_refused_by_compile_and_simulated(tmp_path, capsys):
    """The Megatron-LM baseline is a layout to compare with: compile refuses it with
    DT601, simulate runs it (its co-located units inside the backbone's stages)."""
    spec = str(SPECS / "tiny_cpu.dt")
    out = str(tmp_path / "base.json")
    assert cli.main(["plan", spec, "--search", "baseline", "-o", out]) == 0
    assert "on the backbone's first stage" in capsys.readouterr().out
    assert cli.main(["compile", spec, "--plan", out, "--synthetic", "-o",
                     str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err
    assert "DT601" in err and "Megatron-LM baseline" in err
    assert cli.main(["simulate", spec, "--plan", out, "--steps", "1", "--logdir",
                     str(tmp_path / "tb"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mean"]["iteration_time_s"] > 0


@pytest.mark.parametrize("text", [_SECOND_IMAGE_ENCODER, _DIT_PP])
def test_plan_and_simulate_accept_more_than_one_stage_per_unit(tmp_path, capsys, text):
    spec = tmp_path / "spec.dt"
    spec.write_text(text)
    assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(tmp_path / "p.json")]) == 0
    assert cli.main(["simulate", str(spec), "--plan", str(tmp_path / "p.json"), "--steps",
                     "1", "--logdir", str(tmp_path / "tb")]) == 0


def test_compile_bundle_refuses_what_the_runtime_cannot_train(tmp_path):
    from dtdsl.codegen.compile import BundleOptions, compile_bundle
    from dtdsl.driver import run_frontend
    from dtdsl.ir.plan import Plan
    from dtdsl.schedule.lower import lower

    # The Megatron-LM baseline's plan: a layout to compare with, not to train.
    assert cli.main(["plan", str(SPECS / "tiny_cpu.dt"), "--search", "baseline", "-o",
                     str(tmp_path / "p.json")]) == 0
    plan = Plan.model_validate_json((tmp_path / "p.json").read_bytes())
    program = run_frontend("tiny_cpu.dt", TINY.encode()).program
    with pytest.raises(ValueError, match="Megatron-LM baseline"):
        compile_bundle(tmp_path / "b", source=TINY.encode(), spec_path="tiny_cpu.dt",
                       program=program, plan=plan, schedule=lower(plan, program),
                       options=BundleOptions())
    assert not (tmp_path / "b").exists()


def test_compile_bundle_refuses_a_schedule_that_would_hang_under_nccl(tmp_path):
    """Every bundle's schedule is held to NCCL's rules (``validate_nccl``) before anything
    is written: here the interleaved plan's orders with every send and receive next to
    its pass (the lowering's step 2 alone, without ``schedule.place``), whose sends wait
    behind each other's (tests/schedule/test_validate.py)."""
    from dtdsl.codegen.compile import BundleOptions, compile_bundle
    from dtdsl.driver import run_frontend
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.schedule import Schedule
    from dtdsl.schedule.lower import (
        add_communication,
        add_optimizer,
        gradient_flow,
        lower_compute,
    )

    spec = tmp_path / "spec.dt"
    spec.write_text(_INTERLEAVED)
    assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(tmp_path / "p.json")]) == 0
    plan = Plan.model_validate_json((tmp_path / "p.json").read_bytes())
    assert any(u.vpp > 1 for u in plan.units)
    program = run_frontend("spec.dt", _INTERLEAVED.encode()).program
    base = Schedule.empty(plan)
    flow = gradient_flow(base, program)
    unplaced = add_optimizer(add_communication(lower_compute(base, flow)), flow)
    with pytest.raises(ValueError, match="would hang on GPUs"):
        compile_bundle(tmp_path / "b", source=_INTERLEAVED.encode(), spec_path=str(spec),
                       program=program, plan=plan, schedule=unplaced,
                       options=BundleOptions(synthetic=True))
    assert not (tmp_path / "b").exists()


def test_the_bundle_predicts_with_the_plans_cost_model(tmp_path):
    """A bundle carries the cost model its plan was made with (efficiencies, or the
    measured profile copied in), so the run's predictions price batches the same way."""
    from dtdsl.cost.job import job_cost_model
    from dtdsl.cost.profile import save_profile
    from dtdsl.driver import run_frontend
    from dtdsl.ir.job import load_job
    from tests.helpers.costs import _linear_profile

    spec = str(SPECS / "tiny_cpu.dt")
    program = run_frontend(spec, TINY.encode()).program
    calibrated = tmp_path / "calibrated"
    assert cli.main(["compile", spec, "--synthetic", "--efficiency", "matmul=0.4",
                     "-o", str(calibrated)]) == 0
    job = load_job(calibrated)
    assert (job.cost.matmul, job.cost.profile_file) == (0.4, None)
    cost = job_cost_model(job.cost, program, calibrated)
    assert cost.params.efficiency.matmul == 0.4 and cost.profile is None

    profile = tmp_path / "profile.json"
    slope = {"vit": 1e-3, "llm": 2e-4, "gen": 5e-2, "vit_to_llm": 1e-5, "llm_to_gen": 2e-5}
    save_profile(_linear_profile(program, slope), profile)
    measured = tmp_path / "measured"
    assert cli.main(["compile", spec, "--synthetic", "--profile", str(profile),
                     "-o", str(measured)]) == 0
    job = load_job(measured)
    assert job.cost.profile_file == "profile.json"
    assert json.loads((measured / "profile.json").read_text()) == \
        json.loads(profile.read_text())
    cost = job_cost_model(job.cost, program, measured)
    assert cost.profile is not None
    plan = json.loads((measured / "plan.json").read_text())
    llm = next(u for u in plan["units"] if u["name"] == "llm")
    fwd, _ = cost.fwd_bwd_time_s(cost.unit("llm"), llm["tp"])
    assert llm["fwd_time_s"] == pytest.approx(
        fwd * llm["microbatch_share"] * max(llm["layers_per_stage"]) /
        sum(llm["layers_per_stage"]), rel=1e-9)


# Nodes of two GPUs and a TP-2 backbone: rank 1 and rank 2 are on different nodes.
_PAIRS = _tiny(("gpus_per_node = 4", "gpus_per_node = 2"),
               ("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  tp(llm) == 2"))


def test_a_plan_with_a_tp_group_across_nodes_priced_within_one_is_refused(tmp_path, capsys):
    """A hand-edited plan.json that starts the TP-2 backbone at an odd rank on nodes of
    two GPUs, its times still NVLink's: DT411 at the module, naming the unit and the
    ranks, and nothing written. Priced across nodes, the same placement compiles."""
    spec = tmp_path / "spec.dt"
    spec.write_text(_PAIRS)
    planned = tmp_path / "plan.json"
    assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(planned),
                     "--placement", "disaggregated"]) == 0
    assert compile_spec(spec, tmp_path / "ok", "--plan", str(planned)) == 0
    plan = json.loads(planned.read_text())
    units = {u["name"]: u for u in plan["units"]}
    assert [units[n]["gpus"] for n in ("vit", "llm", "gen")] == [1, 2, 1]
    assert units["llm"]["tp"] == 2 and units["llm"]["first_rank"] % 2 == 0
    for name, first in (("vit", 0), ("llm", 1), ("gen", 3)):
        units[name]["first_rank"] = first
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    capsys.readouterr()
    out = tmp_path / "bundle"
    assert compile_spec(spec, out, "--plan", str(edited)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{spec}:{_line_of(_PAIRS, 'backbone llm')}:" in err
    assert "error[DT411]: llm: its TP group of ranks 1..2 spans nodes 0 and 1 (2 GPUs a " \
        "node), but the plan priced its TP collectives at NVLink bandwidth" in err, err
    assert "1 of llm's 1 TP groups (tp 2, from rank 1) span two nodes: 1..2" in err
    assert not out.exists()
    units["llm"]["tp_across_nodes"] = True
    edited.write_text(json.dumps(plan))
    assert compile_spec(spec, out, "--plan", str(edited)) == 0


def test_compile_builds_the_layout_dtc_plan_shows(tmp_path):
    """Without --plan, compile plans as dtc plan does by default (drawn batches): the
    bundle's plan is the one the user was shown."""
    assert cli.main(["plan", str(SPECS / "tiny_cpu.dt"), "--no-baseline",
                     "-o", str(tmp_path / "shown.json")]) == 0
    assert cli.main(["compile", str(SPECS / "tiny_cpu.dt"), "-o", str(tmp_path / "b"),
                     "--synthetic", "--workers", "0"]) == 0
    shown = json.loads((tmp_path / "shown.json").read_text())
    built = json.loads((tmp_path / "b" / "plan.json").read_text())

    def layout(plan):
        return [(u["name"], u["tp"], u["dp"], u["pp"], u["layers_per_stage"], u["first_rank"])
                for u in plan["units"]]

    assert layout(built) == layout(shown)


def test_co_located_plans_compile_unless_misplaced_or_split_where_tp_cannot():
    """A co-located plan is admitted; one a hand edit moved off the backbone's ranks, or
    whose co-located module the backbone's TP degree cannot split (the planner replicates
    such a module instead, ``tp_replicated``), is DT601 at that module."""
    from dtdsl.codegen.support import runtime_support
    from tests.helpers.plans import colocate
    from tests.helpers.runs import plan_for, spec

    program = spec(8)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 2, 1, 2),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    assert runtime_support(program, plan) == []
    moved = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"first_rank": 2}) if u.name == "vit" else u for u in plan.units)})
    (diag,) = runtime_support(program, moved)
    assert diag.code == "DT601" and diag.span == program.module("vit").span
    assert "vit: first_rank 2" in diag.message and "(llm: 0)" in diag.message
    wide = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 8, 1, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit")
    (diag,) = [d for d in runtime_support(program, wide) if d.code == "DT601"]
    assert diag.span == program.module("vit").span
    assert "TP groups of 8, which cannot split its 4 attention heads" in diag.message
    replicated = wide.model_copy(update={"units": tuple(
        u.model_copy(update={"tp_replicated": True}) if u.name == "vit" else u
        for u in wide.units)})
    assert not [d for d in runtime_support(program, replicated) if d.code == "DT601"]


def test_phased_plans_compile_unless_a_generator_or_misplaced():
    """A phased encoder is admitted; a phased generator (it needs the backbone's outputs,
    inside the pipeline) or a phased unit a hand edit gave another DP degree is DT601 at
    that module, saying what a phased unit is."""
    from dtdsl.codegen.support import runtime_support
    from tests.helpers.plans import phase
    from tests.helpers.runs import plan_for, spec

    program = spec(8)
    own = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 1, 2),
                   ("gen", "generator", 1, 1, 1))
    plan = phase(program, own)
    assert runtime_support(program, plan) == []
    narrow = plan.model_copy(update={"units": tuple(
        u.model_copy(update={"dp": 1}) if u.name == "vit" else u for u in plan.units)})
    (diag,) = runtime_support(program, narrow)
    assert diag.code == "DT601" and diag.span == program.module("vit").span
    assert "vit: dp 1, but a phased unit runs on all the backbone's ranks with dp 2" \
        in diag.message
    gen = phase(program, own, "gen")
    (diag,) = [d for d in runtime_support(program, gen) if d.code == "DT601"]
    assert diag.span == program.module("gen").span
    assert "only an encoder can run phased" in diag.message and "not a generator" \
        in diag.message


@pytest.mark.parametrize("placement", ["colocated", "phased"])
def test_the_planners_placements_compile(tmp_path, placement):
    """Whatever placement ``dtc plan`` chooses, ``dtc compile`` writes its bundle: the
    runtime runs every placement the planner can produce (issue 27)."""
    out = tmp_path / "bundle"
    assert compile_spec(SPECS / "tiny_cpu.dt", out, "--placement", placement) == 0
    written = Plan.model_validate_json((out / "plan.json").read_text())
    assert written.placement == placement


@pytest.mark.parametrize("channels", [1, 4])
def test_an_image_encoder_over_other_than_three_channels_is_refused(tmp_path, capsys,
                                                                    channels):
    # The data path decodes RGB: a ViT (or a Hugging Face tower's num_channels) over 1 or 4
    # channels is DT601 where the runtime would build it, `dtc reference` included.
    text = _tiny(("ffn=128, patch=8)", f"ffn=128, patch=8, in_channels={channels})"))
    err, lines = _unsupported(tmp_path, capsys, text)
    assert lines == [_line_of(text, "encoder vit (image)")]
    assert f"reads {channels} channels" in err and "3 RGB channels" in err
    assert cli.main(["reference", str(tmp_path / "spec.dt"), "--steps", "1", "-q"]) == 1
    err = capsys.readouterr().err
    assert "error[DT601]" in err and "Traceback" not in err


def test_an_output_folder_reached_through_a_link_finds_its_data(tmp_path):
    # The bundle's relative data path is taken between the real folders: `..` climbs from
    # where a link in the output path leads, not from the path as written.
    spec = tmp_path / "tiny.dt"
    spec.write_text((SPECS / "tiny_cpu.dt").read_text())
    data = tmp_path / "data" / "tiny"
    assert cli.main(["data", "synth", str(spec), "-q", "--samples", "8"]) == 0
    (tmp_path / "x" / "y" / "z").mkdir(parents=True)
    (tmp_path / "deep").symlink_to(tmp_path / "x" / "y" / "z")
    out = tmp_path / "deep" / "bundle"
    assert compile_spec(spec, out, "--real-data") == 0
    path = json.loads((out / "job.json").read_text())["data"]["path"]
    assert (out / path).resolve() == data.resolve()
    assert (Path(os.path.realpath(out)) / path).resolve() == data.resolve()


@pytest.mark.parametrize("case", ["parent is a file", "name too long"])
def test_an_output_path_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, case):
    if case == "parent is a file":
        (tmp_path / "afile").write_text("mine")
        out, want = tmp_path / "afile" / "sub", "one of its parents is a file"
    else:
        # 240 bytes is a valid name; the temporary folder beside it must be one too.
        out, want = tmp_path / ("a" * 240), None
    code = compile_spec(SPECS / "tiny_cpu.dt", out)
    err = capsys.readouterr().err
    assert "internal" not in err and "Traceback" not in err, err
    if want is None:
        assert code == 0 and (out / "launch.sh").is_file()
        assert [p.name for p in tmp_path.iterdir()] == [out.name]
    else:
        assert code == 2 and want in err, err
        assert (tmp_path / "afile").read_text() == "mine"
