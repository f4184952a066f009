"""A spec's ``data.source``, whatever its format: which reader opens it, and whether it can.

- a directory holding a dtdsl dataset (its ``index.json``, as ``dtc data synth`` writes it):
  ``shards.Dataset``;
- a ``.json`` or ``.jsonl`` file: LLaVA-style conversations with an image folder
  (``llava``; the spec's ``image_folder``, by default the file's folder);
- anything else: WebDataset tar shards (``webdataset``: a directory of ``*.tar``, a brace
  pattern, a ``.tar``, or a list of them).

``open_dataset`` opens one for reading (a WebDataset is indexed on first use);
``source_problem`` says, cheaply, why one cannot be read (nothing indexed): the check of
``dtc check`` and ``dtc compile`` and of a launch's preflight.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtdsl.data.shards import FORMAT, INDEX_NAME, Dataset, DatasetError
from dtdsl.ir import program as ir

__all__ = ["data_diagnostics", "image_role", "is_dtdsl_dataset", "is_synthetic",
           "open_dataset", "source_problem"]


def _single(source: str | Path | Sequence[str | Path]) -> str | None:
    if isinstance(source, (str, Path)):
        return str(source)
    return str(source[0]) if len(source) == 1 else None


def is_dtdsl_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a dtdsl dataset index."""
    index = Path(path) / INDEX_NAME
    if not index.is_file():
        return False
    try:
        with open(index, "rb") as f:
            head = f.read(4096)
        return f'"format": "{FORMAT}"'.encode() in head or \
            json.loads(index.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def image_role(program: ir.Program | None) -> str:
    """Whether a WebDataset sample's images are encoder inputs or generation targets: the
    targets of a model with an image generator and no image encoder (text-to-image)."""
    if program is None:
        return "input"
    reads = any(m.modality == "image" for m in program.encoders)
    makes = any(m.modality == "image" for m in program.generators)
    return "target" if makes and not reads else "input"


def _resolve(source: str | Sequence[str], base_dir: Path) -> Path | None:
    one = _single(source)
    if one is None or "{" in one:
        return None
    path = Path(one).expanduser()
    return path if path.is_absolute() else base_dir / path


def open_dataset(source: str | Sequence[str], *, base_dir: str | Path = ".",
                 program: ir.Program | None = None, cache_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 rebuild: bool = False, image_folder: str | Path | None = None) -> Any:
    """The dataset ``source`` names (module docstring), opened: a ``shards.Dataset``, a
    ``llava.LlavaDataset`` or a ``webdataset.WebDataset`` (indexed now if it has no index
    yet, or ``rebuild``). DatasetError when it cannot be read."""
    from dtdsl.data.llava import LlavaDataset, is_llava_source
    from dtdsl.data.webdataset import WebDataset, build_index, resolve_shards

    base = Path(base_dir)
    path = _resolve(source, base)
    if path is not None and path.is_dir() and is_dtdsl_dataset(path):
        return Dataset.open(path)
    if path is not None and is_llava_source(path):
        folder = image_folder if image_folder is not None else (
            program.data.image_folder if program is not None else None)
        return LlavaDataset.open(path, folder, cache_dir=cache_dir, progress=progress)
    shards = resolve_shards(source, base)
    return WebDataset(build_index(shards, cache_dir=cache_dir, progress=progress,
                                  rebuild=rebuild), image_role=image_role(program))


def is_synthetic(source: str | Sequence[str], base_dir: str | Path = ".") -> bool:
    """Whether ``source`` is a dataset ``dtc data synth`` wrote (text of a made-up language,
    which the hashing tokenizer reads)."""
    path = _resolve(source, Path(base_dir))
    return path is not None and path.is_dir() and is_dtdsl_dataset(path)


def source_problem(source: str | Sequence[str], base_dir: str | Path = ".") -> str | None:
    """Why ``source`` cannot be read, or None: it names no file, a dtdsl dataset whose
    index is missing or corrupt, an empty folder, or a first shard that is not a tar.
    Reads the index or the first shard's first header, nothing more."""
    from dtdsl.data.llava import is_llava_source
    from dtdsl.data.webdataset import resolve_shards

    base = Path(base_dir)
    path = _resolve(source, base)
    if path is not None and is_llava_source(path):
        return _json_problem(path)
    try:
        if path is not None and path.is_dir() and is_dtdsl_dataset(path):
            with Dataset.open(path):
                return None
        if path is not None and path.is_dir() and not any(path.glob("*.tar")):
            entries = sorted(p.name for p in path.iterdir())[:3]
            return (f"{path} holds no dataset: no dtdsl index and no .tar shards" +
                    (f" (it has {', '.join(entries)})" if entries else " (it is empty)"))
        shards = resolve_shards(source, base)
    except DatasetError as err:
        return str(err)
    try:
        with tarfile.open(shards[0], mode="r:") as tar:
            if tar.next() is None:
                return f"{shards[0]} is an empty tar"
    except (tarfile.TarError, OSError, EOFError) as err:
        return f"{shards[0]} is not a readable tar: {err}"
    return None


def _json_problem(path: Path) -> str | None:
    """Why a LLaVA-style JSON cannot be read (its first bytes only), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError as err:
        return f"cannot read {path}: {err.strerror or err}"
    if not head:
        return f"{path} is empty"
    if path.suffix == ".json" and not head.startswith(b"["):
        return f"{path} is not a JSON array of records (LLaVA's format)"
    if path.suffix == ".jsonl" and not head.startswith(b"{"):
        return f"{path} does not start with a JSON record"
    return None


def data_diagnostics(program: ir.Program, base_dir: str | Path) -> list[Any]:
    """DT314 at the spec's ``source`` when it names data that cannot be read (``dtc check``
    and ``dtc compile`` report it unless asked for synthetic samples); paths are relative
    to ``base_dir``, the spec's folder."""
    from dtdsl.diagnostics import Diagnostic

    source = program.data.source
    if source is None:
        return []
    problem = source_problem(source, base_dir)
    if problem is None:
        if program.data.tokenizer is None and not is_synthetic(source, base_dir):
            return [Diagnostic.error(
                "DT315", f"data source {source!r} is real text, which needs a tokenizer",
                program.data.source_span or program.data.span,
                notes=["the hashing tokenizer is only for synthetic data (`dtc data synth`)"],
                hint='add `tokenizer = "PATH"` to the data block (a tokenizer.json or a '
                "Hugging Face folder), or give the backbone `pretrained` weights whose "
                "folder has one")]
        return []
    return [Diagnostic.error(
        "DT314", f"data source {source!r} cannot be read: {problem}",
        program.data.source_span or program.data.span,
        notes=["paths are relative to the spec's folder"],
        hint="point source at a dataset (`dtc data synth` writes one) or at WebDataset "
        "shards; to plan or compile without data, pass --synthetic (samples drawn from the "
        "spec's distributions)")]
