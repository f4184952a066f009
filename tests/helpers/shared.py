"""A folder of the test run shared by its pytest-xdist workers (``tests/conftest.py`` points
``ROOT`` at the run's temporary directory): what one worker computes there, such as a
reference run, the others read back instead of computing it again."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT: Path | None = None


@contextlib.contextmanager
def locked(name: str) -> Iterator[Path]:
    """``name``'s path in the shared folder, held locked against the other workers in the
    ``with``: the one that finds it unmade makes it while the others wait."""
    assert ROOT is not None, "tests/conftest.py sets the shared folder"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # released when the file closes
        yield ROOT / name


def digest(*parts: object) -> str:
    """A short name for what ``parts`` (their ``repr``s, pydantic models as JSON) make."""
    text = "\0".join(p.model_dump_json() if hasattr(p, "model_dump_json") else repr(p)
                     for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def tensors_and_json(name: str, make: Callable[[], tuple[dict[str, torch.Tensor], object]]
                     ) -> tuple[dict[str, torch.Tensor], object]:
    """``make()``'s (tensors, JSON-able value), made once a test run in the shared folder
    (``name``: a ``digest`` of what makes it) and read back by the other workers; made
    here alone where no shared folder is set (a process outside pytest)."""
    from safetensors.torch import load_file, save_file

    if ROOT is None:
        return make()
    with locked(name) as path:
        if path.exists():
            with open(path.with_suffix(".json")) as f:
                return load_file(path), json.load(f)
        tensors, value = make()
        tmp = path.with_suffix(".tmp")
        save_file({k: t.contiguous() for k, t in tensors.items()}, tmp)
        path.with_suffix(".json").write_text(json.dumps(value))
        tmp.replace(path)       # last: its presence says both files are whole
        return tensors, value


def json_value(name: str, make: Callable[[], object]) -> object:
    """``make()``'s JSON-able value, made once a test run (``tensors_and_json``)."""
    if ROOT is None:
        return make()
    with locked(name) as path:
        if path.exists():
            with open(path) as f:
                return json.load(f)
        value = make()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
        return value
