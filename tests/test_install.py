"""A plain (non-editable) install ships the grammar and templates, and dtc works from
any folder with it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_contains_resources_and_dtc_runs_elsewhere(tmp_path: Path):
    # No build isolation: the build must not need the network (setuptools is installed).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "wheels"), str(ROOT)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("dtdsl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "dtdsl/_grammar/dtdsl.lark" in names
    assert any(n.startswith("dtdsl/_templates/") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c", "import dtdsl, dtdsl.resources as r; print(dtdsl.__file__); "
         "print(len(r.grammar_text()))"], cwd=elsewhere, env=env, capture_output=True,
        text=True, check=True)
    assert probe.stdout.splitlines()[0].startswith(str(site)), probe.stdout
    spec = ROOT / "specs" / "tiny_cpu.dt"
    run = subprocess.run([str(site / "bin" / "dtc"), "check", "--synthetic", str(spec)],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for template in (ROOT / "codegen_templates").glob("*.j2"):
        assert f"dtdsl/_templates/{template.name}" in names
    for package in ("data", "feed", "codegen", "models", "models/hf", "parallel", "train"):
        assert f"dtdsl/{package}/__init__.py" in names
    bundle = elsewhere / "bundle"
    run = subprocess.run([str(site / "bin" / "dtc"), "compile", str(spec), "-o", str(bundle),
                          "--synthetic"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (bundle / "launch.sh").is_file() and (bundle / "ranks").is_dir()
