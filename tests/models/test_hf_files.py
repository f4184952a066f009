"""Hugging Face weight files that are broken, lying or hostile (issue 25): safetensors cut
short or whose header lies, quantised tensors, the Hub cache's symlinked snapshots, indexes
that name files outside their folder, FIFOs and devices where a file belongs. Each is a
clear diagnostic at ``dtc check`` (DT316, DT312), one line at the launch's preflight, and a
one-line WeightsFileError, never a safetensors traceback, where a rank loads it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dtdsl import cli
from dtdsl.driver import run_frontend
from dtdsl.models.hf import Checkpoint, WeightsFileError, load_hf
from dtdsl.models.hf.weights import Source, read_header
from dtdsl.train.preflight import check_pretrained
from tests.hf_models import make_decoder, quiet

SPEC = """
model {
  backbone llm {
    pretrained = "PATH"
  }
}
data {
  text.tokens ~ 64
}
cluster {
  gpu  = H100
  gpus = 8
}
train {
  global_batch = 8
  seq_len      = 128
}
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    quiet()
    return make_decoder(tmp_path_factory.mktemp("hf") / "llama")


def check(path: Path):
    """``dtc check`` of a spec whose backbone is ``pretrained`` from ``path``."""
    text = SPEC.replace("PATH", str(path))
    return run_frontend(str(path.parent / "spec.dt"), text.encode(), base_dir=path.parent)


def errors(result) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in result.diagnostics if d.severity.name == "ERROR"]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def expire(*_):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---- damaged and lying files ---------------------------------------------------------------

def _split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(file: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _cut_mid_data(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def _cut_mid_header(file: Path) -> None:
    raw = file.read_bytes()
    file.write_bytes(raw[:8 + int.from_bytes(raw[:8], "little") // 2])


def _past_the_end(file: Path) -> None:
    header, data = _split(file)
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"] = [o + 4096 for o in header[last]["data_offsets"]]
    _join(file, header, data)


def _overlapping(file: Path) -> None:
    header, data = _split(file)
    header.pop("__metadata__", None)
    by_size: dict[int, list[str]] = {}
    for key, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        by_size.setdefault(t["data_offsets"][1] - t["data_offsets"][0], []).append(key)
    first, second = next(keys for keys in by_size.values() if len(keys) > 1)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    _join(file, header, data)


def _wrong_shape(file: Path) -> None:
    header, data = _split(file)
    header["model.norm.weight"]["shape"] = [65]
    _join(file, header, data)


def _header_a_list(file: Path) -> None:
    header, data = _split(file)
    _join(file, [header], data)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut mid-data": (_cut_mid_data, "is truncated"),
    "cut mid-header": (_cut_mid_header, "is truncated: its header is"),
    "offsets past the end": (_past_the_end, "is truncated, or its header lies"),
    "overlapping": (_overlapping, "overlap"),
    "shape x dtype is not the span": (_wrong_shape, "its header lies: shape [65] of F32 is "
                                                   "260 bytes"),
    "header a list": (_header_a_list, "its header is a JSON list, not an object"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_files_are_dt316_at_check_and_one_line_everywhere(llama, tmp_path, case):
    damage, message = DAMAGE[case]
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    program = check(path).program          # compiled while the file was whole
    assert program is not None
    damage(path / "model.safetensors")
    got = errors(check(path))
    assert [c for c, _ in got] == ["DT316"], got
    assert str(path / "model.safetensors") in got[0][1] and message in got[0][1], got
    # The launch's preflight: one line, the same words.
    lines = check_pretrained(program)
    assert len(lines) == 1 and "\n" not in lines[0] and message in lines[0], lines
    # A rank's loader: a one-line WeightsFileError, not safetensors' own error.
    with pytest.raises(WeightsFileError, match="is truncated|lies|not a safetensors|overlap"):
        load_hf(path)


def test_a_file_that_changes_after_its_check_is_one_line_on_the_rank(llama, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    with Checkpoint(path) as ckpt:
        ckpt.verify()
        _cut_mid_data(path / "model.safetensors")
        with pytest.raises(WeightsFileError, match="cannot be read") as err:
            ckpt.read(Source("model.norm.weight"), (0,), (64,))
        assert "\n" not in err.value.message


def test_dtc_check_of_a_damaged_file_exits_1_not_3(llama, tmp_path, capsys):
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    _header_a_list(path / "model.safetensors")
    spec = tmp_path / "spec.dt"
    spec.write_text(SPEC.replace("PATH", str(path)))
    assert cli.main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "error[DT316]" in err and "Traceback" not in err


def test_headers_are_bounded_and_read_without_the_data(tmp_path):
    """Only the header is read; a header length past the format's limit, or a header of
    nested arrays too deep for a JSON parser, is refused without a traceback."""
    big = tmp_path / "big.safetensors"
    big.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(WeightsFileError, match="header length of 1099511627776 bytes"):
        read_header(big)
    deep = tmp_path / "deep.safetensors"
    text = b"[" * 100_000 + b"]" * 100_000
    deep.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(WeightsFileError, match="not a JSON object"):
        read_header(deep)


# ---- quantised tensors ---------------------------------------------------------------------

_DOWN = "model.layers.1.mlp.down_proj.weight"


def _retype(path: Path, dtype: torch.dtype, *, scale: bool = False) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[_DOWN] = (tensors[_DOWN] * 100).to(dtype)
    if scale:
        tensors[f"{_DOWN}_scale_inv"] = torch.ones(1)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("dtype,words", [
    (torch.int8, "I8 (an integer"), (torch.int32, "I32 (an integer"),
    (torch.uint8, "U8 (an integer"), (torch.bool, "BOOL (a bool"),
    (torch.float8_e4m3fn, "F8_E4M3 (an 8-bit float (FP8)"),
])
def test_quantised_tensors_of_the_right_shape_are_refused(llama, tmp_path, dtype, words):
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    program = check(path).program
    _retype(path, dtype)
    got = errors(check(path))
    assert [c for c, _ in got] == ["DT316"], got
    assert f"tensor {_DOWN!r} is stored as {words}" in got[0][1]
    result = check(path)
    assert "dequantise" in result.diagnostics[0].hint and "bf16" in result.diagnostics[0].hint
    lines = check_pretrained(program)
    assert len(lines) == 1 and words in lines[0] and "dequantise" in lines[0], lines
    with pytest.raises(WeightsFileError, match=r"is stored as"):
        load_hf(path)            # not silently cast to float


def test_fp8_with_its_scale_and_a_quantization_config_say_so_floats_are_read(llama, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    _retype(path, torch.float8_e4m3fn, scale=True)
    got = errors(check(path))
    assert got[0][0] == "DT316" and f"scale tensor '{_DOWN}_scale_inv'" in got[0][1], got
    shutil.rmtree(path)
    shutil.copytree(llama, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    got = errors(check(path))
    assert got == [("DT316", f"{path / 'config.json'} declares a quantization_config "
                             "(gptq): its weights are quantised")], got
    # Floating point of any width is read, and converted to the parameter's dtype.
    from safetensors.torch import load_file

    shutil.rmtree(path)
    shutil.copytree(llama, path)
    _retype(path, torch.bfloat16)
    assert errors(check(path)) == []
    got = dict(load_hf(path).named_parameters())["layers.1.mlp.w2.weight"]
    stored = load_file(str(path / "model.safetensors"))[_DOWN]
    assert stored.dtype == torch.bfloat16 and torch.equal(got, stored.float())


# ---- the Hub cache, indexes, files that are not files --------------------------------------

def _sharded(src: Path, dst: Path) -> Path:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(dst, max_shard_size="60KB")
    assert (dst / "model.safetensors.index.json").is_file()
    return dst


def _hub_cache(src: Path, cache: Path, *, absolute: bool) -> Path:
    """``src`` as huggingface_hub stores a download: every file of
    ``snapshots/<rev>/`` a symlink to ``../../blobs/<sha256>``."""
    repo = cache / "models--tiny--llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "5f1c0ffee"
    snapshot.mkdir(parents=True)
    for file in sorted(src.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(blob if absolute else
                                          Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("5f1c0ffee")
    return snapshot


@pytest.mark.parametrize("absolute", [False, True])
def test_a_hub_cache_snapshot_is_read_as_it_is(llama, tmp_path, absolute):
    sharded = _sharded(llama, tmp_path / "sharded")
    snapshot = _hub_cache(sharded, tmp_path / "hub", absolute=absolute)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    result = check(snapshot)
    assert errors(result) == [], errors(result)
    assert check_pretrained(result.program) == []
    with Checkpoint(snapshot) as ckpt:
        assert len({ckpt._files[k] for k in ckpt.keys()}) > 2        # sharded
    # The repository's folder instead of its snapshot: the hint names the snapshot.
    got = check(snapshot.parent.parent)
    assert got.diagnostics[0].hint == ("a Hugging Face hub cache folder: point at "
                                       f"{snapshot}"), got.diagnostics
    ours, want = load_hf(snapshot), load_hf(llama)
    for (name, a), (_, b) in zip(ours.named_parameters(), want.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_an_index_names_files_inside_its_directory(llama, tmp_path):
    snapshot = _hub_cache(_sharded(llama, tmp_path / "sharded"), tmp_path / "hub",
                          absolute=False)
    assert errors(check(snapshot)) == []          # its files are symlinks out of it
    index = snapshot / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = sorted(data["weight_map"])[0]
    shard = snapshot / data["weight_map"][key]
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(shard, outside)
    for name in ("../../../../outside.safetensors", str(outside),
                 f"../../blobs/{os.readlink(shard).rsplit('/', 1)[-1]}"):
        data["weight_map"][key] = name
        index.unlink()
        index.write_text(json.dumps(data))
        got = errors(check(snapshot))
        assert got == [("DT312", f"{index} points outside its directory: {name!r}")], got


def test_fifos_and_devices_are_refused_without_blocking(llama, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(llama, path)
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    with deadline(30):
        got = errors(check(path))
    assert got == [("DT316", f"{path / 'model.safetensors'} is a FIFO, not a regular file")]
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("/dev/zero")
    with deadline(30):
        got = errors(check(path))
    assert got == [("DT316", f"{path / 'model.safetensors'} is a device, not a regular file")]
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(tmp_path / "gone" / "blob")
    got = errors(check(path))
    assert got[0][0] == "DT316" and "which is missing" in got[0][1], got
