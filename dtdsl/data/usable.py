"""Which samples of a dataset a run trains on: one list, made the same way by every process
that forms batches (each node's preprocessing workers, every trainer of the in-process
feed, ``dtc reference``), so that a distributed run reproduces the reference.

A sample in the dataset's index is left out of the run when

- its text does not go with its images under the spec's tokenizer (``data.text``'s
  layouts: more ``<image>`` placeholders than images, a turn from nobody known), or
- a part the spec reads does not decode (``decode.Decoder.check``): an image whose header
  is valid (so the index took it) but whose body is corrupt or cut off, a clip that is not
  a float32 array, a member that fails its CRC.

**Why before any batch is formed.** A step's batch (which samples, their sizes, how they
are packed and routed, the loss denominators) is a function of the seed, the step and
this list, and every process forms it alone: a node's workers decode only the samples
its own ranks read, so a failure one of them meets while decoding could never reach the
other nodes, whose batches would then differ. So the decode check reads every sample once
(threads: Pillow decodes without the GIL), about the cost of one epoch of decoding, and
keeps its findings beside the index like the token layouts (``decodes-*.json``, named by
the dataset's fingerprint and the parts checked): a launch's preflight makes it, the
workers and trainers read it. A sample that fails after that (its file changed since the
check) keeps its place with a stand-in of its sizes (``Decoder.stand_in``), logged once,
so a run never stops or loops on data.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtdsl.data.cache import read_cache, write_cache
from dtdsl.data.shards import DatasetError

__all__ = ["DOES_NOT_DECODE", "NO_LAYOUT", "Usable", "decode_failures", "left_out_text",
           "usable_samples", "where"]

DOES_NOT_DECODE = "does not decode"
NO_LAYOUT = "text does not go with its images"
_FORMAT = "dtdsl-decode-check"
_VERSION = 1
_BLOCK = 4096           # samples handed to the threads at a time


@dataclass(frozen=True)
class Usable:
    """The samples a run trains on and why the others are left out."""

    indices: tuple[int, ...]            # dataset indices, in order
    total: int                          # samples in the dataset's index
    left_out: Mapping[str, int]         # reason -> how many of the index's samples
    undecodable: tuple[tuple[str, str, str], ...]   # (key, file, why) of those that fail


def where(dataset: Any, i: int) -> str:
    """The file(s) sample ``i`` is read from, for messages."""
    from dtdsl.data.llava import LlavaIndex

    index = getattr(dataset, "index", None)
    if isinstance(index, LlavaIndex):
        names = [str(index.folder / e[0]) for e in index.samples[i]["images"]]
        return ", ".join(names) if names else str(index.path)
    shard = Path(dataset.info(i).shard)
    return str(shard if shard.is_absolute() else Path(dataset.path) / shard)


def _check_one(dataset: Any, decoder: Any, i: int) -> str | None:
    """Why sample ``i`` does not read or decode, or None."""
    try:
        decoder.check(dataset.read(i))
    except DatasetError as err:
        return str(err)
    return None


def _scan(dataset: Any, decoder: Any, progress: Callable[[int, int], None] | None
          ) -> dict[str, tuple[str, str]]:
    n = len(dataset)
    failed: dict[str, tuple[str, str]] = {}
    threads = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="dtdsl-decode-check") as pool:
        for start in range(0, n, _BLOCK):
            block = range(start, min(n, start + _BLOCK))
            for i, why in zip(block, pool.map(lambda i: _check_one(dataset, decoder, i),
                                              block), strict=True):
                if why is not None:
                    failed[dataset.key(i)] = (where(dataset, i), why)
            if progress is not None:
                progress(block.stop, n)
    return failed


def decode_failures(dataset: Any, decoder: Any, *,
                    progress: Callable[[int, int], None] | None = None
                    ) -> dict[str, tuple[str, str]]:
    """Per sample of ``dataset`` that does not read or whose parts ``decoder`` reads do
    not decode: its key -> (its file, why). Read from the cache beside the index, or found
    by reading every sample once and cached (module docstring)."""
    from dtdsl.data.text import dataset_identity

    parts = decoder.reads
    if not parts or not len(dataset):
        return {}
    ident, folder = dataset_identity(dataset)
    name = hashlib.sha256(f"{ident}\0{','.join(parts)}".encode()).hexdigest()[:32]
    target = folder / f"decodes-{name}.json" if folder is not None else None
    body = read_cache(target, _FORMAT, _VERSION) if target is not None else None
    if body is not None and body.get("samples") == len(dataset):
        found = body.get("failed")
        if isinstance(found, dict) and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)
                for v in found.values()):
            return {str(k): (v[0], v[1]) for k, v in found.items()}
    failed = _scan(dataset, decoder, progress)
    if target is not None:      # not cached when it cannot be written: checked again
        write_cache(target, {"format": _FORMAT, "version": _VERSION, "parts": list(parts),
                             "samples": len(dataset),
                             "failed": {k: list(v) for k, v in failed.items()}})
    return failed


def usable_samples(dataset: Any, decoder: Any, layouts: Sequence[Any], *,
                   progress: Callable[[int, int], None] | None = None) -> Usable:
    """The samples of ``dataset`` a run trains on: those with a layout (``layouts``:
    ``data.text.token_layouts``) whose parts ``decoder`` reads decode (module
    docstring)."""
    failures = decode_failures(dataset, decoder, progress=progress)
    keep, bad = [], []
    no_layout = 0
    for i, lay in enumerate(layouts):
        if lay is None:
            no_layout += 1
            continue
        key = dataset.key(i)
        if key in failures:
            bad.append((key, *failures[key]))
        else:
            keep.append(i)
    left_out = {NO_LAYOUT: no_layout, DOES_NOT_DECODE: len(bad)}
    return Usable(indices=tuple(keep), total=len(layouts),
                  left_out={k: v for k, v in left_out.items() if v},
                  undecodable=tuple(bad))


def left_out_text(dataset: Any, left_out: Mapping[str, int] | None = None) -> str:
    """Everything a dataset leaves out, in words: the samples its index skipped and why,
    the shards refused or damaged, and ``left_out`` (a run's further reasons); "" when
    nothing is."""
    counts = dict(getattr(dataset, "skipped", {}) or {})
    for why, n in (left_out or {}).items():
        counts[why] = counts.get(why, 0) + n
    parts = [f"{n} ({why})" for why, n in sorted(counts.items()) if n]
    problems = list(getattr(dataset, "problems", ()) or ())
    text = ("skipped " + ", ".join(parts)) if parts else ""
    if problems:
        text += ("; " if text else "") + "; ".join(problems)
    return text
