"""The dtc command line: exit codes, JSON output, usage errors, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtdsl import cli

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.dt"))


def dtc(*args: str, stdin: bytes | None = None, cwd: Path | None = None):
    proc = subprocess.run([sys.executable, "-m", "dtdsl.cli", *args], input=stdin,
                          capture_output=True, cwd=cwd or ROOT, timeout=60)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert "Traceback" not in out + err
    return proc.returncode, out, err


def test_shipped_specs_check_clean():
    # tiny_cpu's dataset is written by `dtc data synth` (the README's first command).
    code, out, err = dtc("check", "--synthetic", *map(str, SPECS))
    assert code == 0, err
    assert "warning" not in err


def test_a_source_that_cannot_be_read_is_an_error_at_its_line(tmp_path):
    spec = tmp_path / "tiny.dt"
    spec.write_text((ROOT / "specs" / "tiny_cpu.dt").read_text())
    code, _, err = dtc("check", str(spec))
    assert code == 1
    assert f"tiny.dt:25:12: error[DT314]: data source 'data/tiny' cannot be read: no such " \
        f"file: {tmp_path / 'data' / 'tiny'}" in err
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "notes.txt").write_text("")
    code, _, err = dtc("check", str(spec))
    assert code == 1 and "holds no dataset: no dtdsl index and no .tar shards" in err
    (tmp_path / "data" / "tiny" / "000000.tar").write_bytes(b"garbage" * 100)
    code, _, err = dtc("check", str(spec))
    assert code == 1 and "000000.tar is not a readable tar" in err
    assert dtc("check", "--synthetic", str(spec))[0] == 0


def test_shipped_specs_are_formatted():
    code, _, err = dtc("fmt", "--check", *map(str, SPECS))
    assert code == 0, err


def test_json_format_and_exit_code(tmp_path: Path):
    bad = tmp_path / "bad.dt"
    bad.write_text("train { global_batch = 64\n  globl = 3 }\n")
    code, out, _ = dtc("check", "--format", "json", str(bad))
    assert code == 1
    doc = json.loads(out)
    assert doc["errors"] == len([d for d in doc["diagnostics"] if d["severity"] == "error"])
    first = doc["diagnostics"][0]
    assert set(first) >= {"code", "severity", "message", "file", "line", "column", "end_line",
                          "end_column", "hint"}
    assert any(d["code"] == "DT201" and d["line"] == 2 for d in doc["diagnostics"])


def test_text_format_points_at_the_source(tmp_path: Path):
    bad = tmp_path / "bad.dt"
    bad.write_text("cluster { gpu = H100  gpus = 8 GiB }\n")
    code, _, err = dtc("check", str(bad))
    assert code == 1
    assert f"{bad}:1:30: error[DT207]" in err
    assert "1 | cluster { gpu = H100  gpus = 8 GiB }" in err
    assert "^^^^^" in err


@pytest.mark.parametrize("make", [
    lambda p: p / "missing.dt",
    lambda p: p,  # a directory
])
def test_usage_errors_exit_2(tmp_path: Path, make):
    path = make(tmp_path)
    code, _, err = dtc("check", str(path))
    assert code == 2 and err.startswith("dtc: error:")
    code, out, _ = dtc("check", "--format", "json", str(path))
    assert code == 2 and json.loads(out)["diagnostics"][0]["code"] == "DT000"


def test_bad_arguments_exit_2():
    assert dtc("check")[0] == 2
    assert dtc("frobnicate")[0] == 2
    assert dtc("check", "--emit", "nonsense", str(SPECS[0]))[0] == 2
    assert dtc()[0] == 2


def test_stdin_and_emit():
    code, out, _ = dtc("check", "--emit", "program", "-", stdin=SPECS[0].read_bytes())
    assert code == 0
    assert json.loads(out)["modules"]
    code, out, _ = dtc("check", "--emit", "ast", "-", stdin=b"train { steps = 3 }\n")
    assert code == 0 and "Field key='steps'" in out


def test_fmt_check_diff_and_write(tmp_path: Path):
    spec = tmp_path / "x.dt"
    spec.write_text("train {steps=3   # three\nseed=1}\n")
    assert dtc("fmt", "--check", str(spec))[0] == 1
    code, out, _ = dtc("fmt", "--diff", str(spec))
    assert code == 0 and "+  steps = 3  # three" in out
    assert spec.read_text() == "train {steps=3   # three\nseed=1}\n"
    assert dtc("fmt", str(spec))[0] == 0
    assert spec.read_text() == "train {\n  steps = 3  # three\n  seed  = 1\n}\n"
    assert dtc("fmt", "--check", str(spec))[0] == 0
    code, out, _ = dtc("fmt", "-", stdin=b"train{seed=1}")
    assert out == "train {\n  seed = 1\n}\n"


def test_fmt_writes_through_a_link_keeping_the_mode(tmp_path: Path):
    import os
    import stat

    spec = tmp_path / "real.dt"
    spec.write_text("train {steps=3}\n")
    spec.chmod(0o600)
    (tmp_path / "link.dt").symlink_to(spec)
    assert dtc("fmt", str(tmp_path / "link.dt"))[0] == 0
    assert (tmp_path / "link.dt").is_symlink()
    assert spec.read_text() == "train {\n  steps = 3\n}\n"
    assert stat.S_IMODE(os.stat(spec).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.dt", "real.dt"]


def test_a_spec_that_is_no_regular_file_is_refused_at_once(tmp_path: Path):
    import os

    os.mkfifo(tmp_path / "fifo.dt")
    for command in ("check", "fmt"):
        code, _, err = dtc(command, str(tmp_path / "fifo.dt"))
        assert code == 2 and "fifo.dt is a FIFO, not a regular file" in err, err
        code, _, err = dtc(command, "/dev/zero")
        assert code == 2 and "/dev/zero is a device, not a regular file" in err, err
    code, _, err = dtc("check", str(tmp_path))
    assert code == 2 and "is a directory, not a regular file; give a .dt file" in err, err


def test_fmt_refuses_syntax_errors(tmp_path: Path):
    spec = tmp_path / "x.dt"
    spec.write_text("train { seed = }\n")
    code, _, err = dtc("fmt", str(spec))
    assert code == 1 and "DT101" in err
    assert spec.read_text() == "train { seed = }\n"


def test_explain():
    code, out, _ = dtc("explain", "DT401")
    assert code == 0 and "Tensor parallelism" in out
    code, out, _ = dtc("explain")
    assert code == 0 and "DT305" in out
    assert dtc("explain", "DT999")[0] == 2


def test_internal_errors_exit_3_without_traceback(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(cli.check, "run_frontend", boom)
    assert cli.main(["check", str(SPECS[0])]) == 3
    err = capsys.readouterr().err
    assert "internal compiler error" in err and "simulated bug" in err
    assert "Traceback" not in err and "`dtc --debug check ...`" in err   # a command that works
    assert cli.main(["--debug", "check", str(SPECS[0])]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_runs_from_any_folder(tmp_path: Path):
    code, _, err = dtc("check", str(SPECS[0]), cwd=tmp_path)
    assert code == 0, err


def test_output_files_replace_only_what_dtdsl_wrote(tmp_path, capsys):
    # plan, graph and data stats -o: a new file (0644), or one this command wrote; the
    # spec itself, a user's notes, a link or a folder are refused and left as they are.
    import os
    import stat

    spec = tmp_path / "tiny.dt"
    spec.write_text((ROOT / "specs" / "tiny_cpu.dt").read_text()
                    .replace('  source = "data/tiny"\n', ""))
    plan = tmp_path / "plan.json"
    for _ in range(2):                           # new, then its own earlier plan
        assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(plan)]) == 0
        assert stat.S_IMODE(os.stat(plan).st_mode) == 0o644
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(plan)
    before = plan.read_bytes()
    for target, why in ((spec, "is not a plan dtdsl wrote"),
                        (notes, "is not a plan dtdsl wrote"),
                        (link, "is a symbolic link"), (tmp_path, "is a directory")):
        capsys.readouterr()
        assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(target)]) == 2
        assert why in capsys.readouterr().err, target
    assert notes.read_text() == "mine" and plan.read_bytes() == before
    assert spec.read_text().startswith("# A tiny multimodal")
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["link.json", "notes.txt", "plan.json", "tiny.dt"]          # no temporary left
    graph = tmp_path / "graph.dot"
    for _ in range(2):
        assert cli.main(["graph", str(spec), "--dot", "-o", str(graph)]) == 0
    assert cli.main(["graph", str(spec), "-o", str(graph)]) == 0      # text over DOT
    assert cli.main(["graph", str(spec), "-o", str(plan)]) == 2
    assert "is not a stage graph dtdsl wrote" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["plan", "TINY", "--gpus", "1000000"], "argument --gpus: expected at most 131,072"),
    (["compile", "TINY", "-o", "OUT", "--synthetic", "--max-restarts", "-2"],
     "argument --max-restarts: expected at least 0, not -2"),
    (["compile", "TINY", "-o", "OUT", "--synthetic", "--workers", "-1"],
     "argument --workers: expected at least 0, not -1"),
    (["profile", "TINY", "-o", "OUT", "--device", "tpu"],
     "argument --device: cpu, cuda or cuda:N, not 'tpu'"),
])
def test_bad_option_values_are_argparse_lines(tmp_path, capsys, args, said):
    args = [str(ROOT / "specs" / "tiny_cpu.dt") if a == "TINY" else
            str(tmp_path / "out") if a == "OUT" else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_reading_commands_refuse_another_specs_plan_alike(tmp_path, capsys):
    # graph read a plan by itself: another spec's was an internal error, a broken one
    # pydantic's report; it checks the plan as simulate, memcheck and compile do.
    spec = tmp_path / "other.dt"
    spec.write_text((ROOT / "specs" / "tiny_cpu.dt").read_text()
                    .replace("generator gen", "generator sd").replace("llm -> gen", "llm -> sd")
                    .replace('  source = "data/tiny"\n', ""))
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", str(spec), "--no-baseline", "-o", str(plan)]) == 0
    (tmp_path / "broken.json").write_text('{"version": 1}')
    tiny = str(ROOT / "specs" / "tiny_cpu.dt")
    capsys.readouterr()
    assert cli.main(["graph", tiny, "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "has units gen" not in err and "plan this spec again" in err and \
        "internal" not in err, err
    assert cli.main(["graph", tiny, "--plan", str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read plan" in err, err
    # A FIFO or a device is refused at once (reading it would never end).
    import os

    os.mkfifo(tmp_path / "fifo.json")
    for path, kind in ((tmp_path / "fifo.json", "a FIFO"), ("/dev/zero", "a device")):
        assert cli.main(["graph", tiny, "--plan", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"is {kind}, not a regular file" in err, err


def test_profile_into_a_missing_folder_stops_before_it_measures(tmp_path, capsys):
    assert cli.main(["profile", str(ROOT / "specs" / "tiny_cpu.dt"), "-o",
                     str(tmp_path / "none" / "p.json")]) == 2
    assert f"cannot write {tmp_path / 'none' / 'p.json'}: no folder" in \
        capsys.readouterr().err


def test_a_cluster_larger_than_the_planner_solves_is_dt208(tmp_path, capsys):
    spec = tmp_path / "big.dt"
    spec.write_text((ROOT / "specs" / "tiny_cpu.dt").read_text()
                    .replace("gpus          = 4", "gpus          = 200000")
                    .replace('  source = "data/tiny"\n', ""))
    assert cli.main(["check", str(spec)]) == 1
    assert "error[DT208]" in capsys.readouterr().err


def test_reference_refuses_a_model_this_machine_cannot_hold(capsys, monkeypatch):
    # The reference trains every module in one fp32 process: mllm_9b's 9.55B parameters
    # need 16 bytes each; said at once instead of thrashing until the kernel kills it.
    import os

    pages = 1 << 20                                  # a 4 GiB machine, whatever this one is
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: pages if name == "SC_PHYS_PAGES"
                        else 4096 if name == "SC_PAGE_SIZE" else real(name))
    assert cli.main(["reference", str(ROOT / "specs" / "mllm_9b.dt"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "its 9.55B parameters need at least 142.4 GiB" in err and "has 4.0 GiB" in err, err
