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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def computed(name: str, make: Callable[[], Any], write: Callable[[Any, Path], None],
             read: Callable[[Path], Any]) -> Any:
    """``make()``'s value, made once a test run in the shared folder (``name``: a ``digest``
    of what makes it; ``write`` puts it at a path, ``read`` reads it back) and read back by
    the other workers; made here alone where no shared folder is set (outside pytest)."""
    if ROOT is None:
        return make()
    with locked(name) as path:
        if path.exists():
            return read(path)
        value = make()
        tmp = path.with_suffix(".tmp")
        write(value, tmp)
        tmp.replace(path)       # last: its presence says the value is whole
        return value


def json_value(name: str, make: Callable[[], object]) -> object:
    """``make()``'s JSON-able value, made once a test run (``computed``)."""
    return computed(name, make, lambda value, path: path.write_text(json.dumps(value)),
                    lambda path: json.loads(path.read_text()))


def tensors_and_json(name: str, make: Callable[[], tuple[dict[str, torch.Tensor], object]]
                     ) -> tuple[dict[str, torch.Tensor], object]:
    """``make()``'s (tensors, JSON-able value), made once a test run (``computed``): the
    tensors in a safetensors file, the value in the JSON of its metadata."""
    from safetensors.torch import load_file, safe_open, save_file

    def write(value: tuple[dict[str, torch.Tensor], object], path: Path) -> None:
        tensors, doc = value
        save_file({k: t.contiguous() for k, t in tensors.items()}, path,
                  metadata={"value": json.dumps(doc)})

    def read(path: Path) -> tuple[dict[str, torch.Tensor], object]:
        with safe_open(path, framework="pt") as f:
            doc = json.loads(f.metadata()["value"])
        return load_file(path), doc

    return computed(name, make, write, read)
