"""The checker reads no file itself; the resolve stage reads what a spec names, so that
``dtc check`` of a spec that names no file never imports torch (issue 33)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dtdsl.cli import main
from dtdsl.frontend.check import check
from dtdsl.frontend.parser import parse
from dtdsl.resolve import SpecFiles
from dtdsl.source import decode_source
from tests.helpers.checks import BASE

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.dt"))
READERS = ("path", "hf_model", "pretrained", "vae", "tokenizer", "empirical")


class _Recording(SpecFiles):
    """SpecFiles that notes which of its readers the checker asked for."""

    def __init__(self, base_dir: Path) -> None:
        super().__init__(base_dir)
        self.asked: list[str] = []

    def __getattribute__(self, name: str):
        if name in READERS:
            object.__getattribute__(self, "asked").append(name)
        return object.__getattribute__(self, name)


def _asked(path: Path) -> list[str]:
    source = decode_source(path.name, path.read_bytes())
    files = _Recording(path.parent)
    result = check(parse(source).spec, source, files=files)
    assert result.program is not None, [d.message for d in result.diagnostics]
    return files.asked


def _file_free() -> list[Path]:
    return [path for path in SPECS if not _asked(path)]


def test_the_checker_asks_the_resolve_stage_for_every_file_a_spec_names():
    assert _asked(ROOT / "specs" / "llava_sd.dt").count("hf_model") == 3
    free = _file_free()
    assert ROOT / "specs" / "tiny_cpu.dt" in free and ROOT / "specs" / "llava_sd.dt" not in free


def test_dtc_check_of_a_spec_naming_no_file_imports_no_torch():
    free = [str(p) for p in _file_free()]
    assert len(free) >= 5
    script = (
        "import json, sys\n"
        "from dtdsl.cli import main\n"
        "synthetic = main(['check', '-q', '--synthetic', *sys.argv[1:]])\n"
        "main(['check', '-q', *sys.argv[1:]])  # the data sources read too\n"
        "print(json.dumps({'rc': synthetic, 'loaded': sorted(m for m in sys.modules\n"
        "    if m.split('.')[0] == 'torch' or m.startswith(('dtdsl.models', 'dtdsl.train')))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, *free], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"rc": 0, "loaded": []}


def test_a_spec_naming_an_hf_folder_still_gets_its_diagnostics(tmp_path, capsys):
    spec = tmp_path / "t.dt"
    spec.write_text(BASE.replace(
        "arch = transformer(layers=8, hidden=128, heads=8, kv_heads=2, vocab=100, swiglu)",
        'arch = hf("no_such_model")'))
    assert main(["check", "--format", "json", str(spec)]) == 1
    found = json.loads(capsys.readouterr().out)["diagnostics"]
    assert [(d["code"], d["line"]) for d in found] == [("DT311", 4)]
    assert found[0]["hint"] == "paths are relative to the spec's folder"


def test_paths_the_system_refuses_are_their_readers_diagnostics(tmp_path, capsys):
    # A 300-character name (ENAMETOOLONG) where a spec names an HF model, pretrained
    # weights, a VAE, a tokenizer or its data; a device as an empirical distribution
    # (it was read without end).
    long = "A" * 300
    tiny = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    cases = {
        "DT311": tiny.replace("arch = transformer(layers=4, hidden=128, heads=4, kv_heads=2, "
                              "ffn=256, vocab=512, swiglu)", f'arch = hf("{long}")'),
        "DT315": tiny.replace('source = "data/tiny"', f'tokenizer = "{long}"'),
        "DT314": tiny.replace('source = "data/tiny"', f'source = "{long}"'),
        "DT309": tiny.replace("image.count     ~ zipf(a=2.0) clamp [0, 3]",
                              'image.count     ~ empirical("/dev/zero")'),
    }
    for code, text in cases.items():
        assert text != tiny, code
        spec = tmp_path / f"{code}.dt"
        spec.write_text(text)
        assert main(["check", str(spec)]) == 1, code
        err = capsys.readouterr().err
        assert f"error[{code}]" in err and "internal" not in err, (code, err)
    assert "/dev/zero is a device, not a regular file" in \
        (main(["check", str(tmp_path / "DT309.dt")]), capsys.readouterr().err)[1]
