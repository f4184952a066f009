"""The on-disk dataset format: WebDataset-style tar shards and an index for random access.

A dataset is a directory::

    DIR/index.json             what is where (written last: no index, no dataset)
    DIR/shard-000000.tar       samples 0 .. S-1
    DIR/shard-000001.tar       samples S .. 2S-1, ...

Every sample has a key, ``"%08d" % i`` for its position ``i`` in the whole dataset, and
these tar members (plain WebDataset convention: ``KEY.SUFFIX``; readers such as
``webdataset`` group them by key):

- ``KEY.txt``: the text, UTF-8;
- ``KEY.json``: the sample's record, ``{"key", "images": [{"w", "h", "format"}, ...],
  "gen_images": [...], "audio": [{"frames", "bins"(, "channels")}, ...], "gen_audio":
  [...]}`` plus any extra fields of ``RawSample.meta``;
- ``KEY.img0.png``, ``KEY.img1.jpg``, ...: the input images (PNG or JPEG, any size);
- ``KEY.gen0.png``, ...: the images an image generator learns to produce;
- ``KEY.aud0.npy``, ...: input audio as log-mel frames, a float32 ``[frames, bins]``
  array in NumPy's ``.npy`` format (one row per frame, ``bins`` mel bins; ``synth``
  writes standardised values, roughly zero mean and unit variance), or ``[frames,
  channels, bins]`` for an encoder of several input channels (the record says
  ``channels``);
- ``KEY.genaud0.npy``, ...: audio an audio generator learns to produce, the same way.

Tars are USTAR, written deterministically: members sorted by name, mtime 0, uid/gid 0,
empty user and group names, mode 0o644. The same samples give byte-identical shards.

``index.json`` (``format`` ``"dtdsl-shards"``, ``version`` 1) lists the shards (name,
sample count, size in bytes, sha256) and, per sample, its key, its shard, its members as
``[name, offset, size, crc32]`` (``offset`` is the member's ``TarInfo.offset_data``,
``name`` the part after ``KEY.``) and its sizes: ``text_bytes``, ``text_tokens``
(``count_text_tokens``), ``images`` and ``gen_images`` as ``[w, h]`` pairs, ``audio`` and
``gen_audio`` as frame counts. ``provenance`` holds what the writer says about the data
(the synthesiser: the spec and the seed).

``Dataset.open`` checks the index and that every shard has the size it records;
``Dataset.read`` seeks to one sample with one read, checks each member's tar header
(name, size, header checksum) and CRC-32; iterating streams the tars in order and
checks the same. Every problem is a ``DatasetError`` naming the file, but for two kinds of
damage that leave the other samples readable: a shard that is not a regular file inside
the dataset's folder (a symlink out of it, a FIFO: ``data.paths``) is refused, and a shard
shorter than the index says (a truncated copy) keeps the samples that lie whole in it.
Both are counted in ``Dataset.skipped`` (samples, by reason) and ``Dataset.problems``
(one line per shard).

``write_dataset`` writes into a new or empty directory, or replaces (``overwrite``) one that
holds a dataset it wrote and nothing else, every shard unchanged (its sha256; a shard of an
index from before the sha256 was recorded must read back as its index says), through a
folder beside it that is swapped in when complete (``dtdsl.outdir``). Anything else in
the directory, a link, a changed shard, is refused, naming it, and nothing is changed.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtdsl.data.shard_format import (
    _BLOCK,
    _EXT_FORMAT,
    _RESERVED,
    DEFAULT_SAMPLES_PER_SHARD,
    FORMAT,
    INDEX_NAME,
    VERSION,
    ClipInfo,
    DatasetError,
    DatasetExists,
    EncodedAudio,
    EncodedClip,
    EncodedImage,
    Member,
    NoSamples,
    RawSample,
    SampleInfo,
    _members,
    _parse_index,
    _Shard,
    _stem,
    count_text_tokens,
    sample_key,
    shard_name,
    text_pieces,
    turn_text,
)
from dtdsl.outdir import (
    Listed,
    OutputError,
    Snapshot,
    Staged,
    file_sha256,
    real_dir,
    stage,
    verify_owned,
)

__all__ = [
    "DEFAULT_SAMPLES_PER_SHARD",
    "FORMAT",
    "INDEX_NAME",
    "VERSION",
    "Dataset",
    "DatasetError",
    "DatasetExists",
    "ClipInfo",
    "EncodedAudio",
    "EncodedClip",
    "EncodedImage",
    "Member",
    "NoSamples",
    "RawSample",
    "SampleInfo",
    "WriteResult",
    "check_writable",
    "count_text_tokens",
    "sample_key",
    "shard_name",
    "text_pieces",
    "turn_text",
    "write_dataset",
]

# ---- writing ----------------------------------------------------------------------------

@dataclass(frozen=True)
class WriteResult:
    path: Path
    num_samples: int
    num_shards: int
    num_bytes: int          # shards and index together


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _listed(directory: Path) -> dict[str, Listed] | None:
    """What the dataset in ``directory`` lists (its index and shards, with what each must
    be), or None when it holds no index of ours. An index written before shards carried
    their sha256 vouches for a shard only when the whole dataset reads back as it says
    (every member's header, offset and CRC-32)."""
    index = directory / INDEX_NAME
    if not index.is_file() or index.is_symlink():
        return None
    try:
        text = index.read_bytes()
        head = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        return None
    # A damaged index of ours: DatasetError, and nothing is removed.
    shards, samples, _ = _parse_index(index, text)
    good = functools.cache(lambda: _read_back(directory, shards, samples))
    listed = {INDEX_NAME: Listed()}
    for s in head["shards"]:
        sha = s.get("sha256")
        if sha is None:
            listed[s["name"]] = Listed(size=s["size_bytes"],
                                       check=lambda path: path.name in good())
        elif isinstance(sha, str) and _SHA256.fullmatch(sha):
            listed[s["name"]] = Listed(sha256=frozenset({sha}), size=s["size_bytes"])
        else:
            raise DatasetError(f"corrupt index {index}: shard {s['name']} has sha256 {sha!r}")
    return listed


def _read_back(directory: Path, shards: list[_Shard], samples: list[SampleInfo]
               ) -> frozenset[str]:
    """The shards that hold exactly what the index says they hold."""
    good = set()
    infos = iter(samples)
    for shard in shards:
        where = directory / shard.name
        mine = [next(infos) for _ in range(shard.num_samples)]
        try:
            with tarfile.open(where, mode="r|") as tar:
                for _ in _stream(tar, mine, where):
                    pass
        except (DatasetError, tarfile.TarError, OSError, EOFError):
            continue
        good.add(shard.name)
    return frozenset(good)


def _verify(directory: Path, overwrite: bool) -> Snapshot:
    """``check_writable``'s checks; the verified state of the directory."""
    if not real_dir(directory) or not any(directory.iterdir()):
        return Snapshot.take(directory, (), lambda rel, st: False)
    listed = _listed(directory)
    if listed is None:
        entries = sorted(e.name for e in directory.iterdir())
        raise DatasetError(f"{directory} holds files dtdsl did not write ({_shown(entries)}); "
                           "write the dataset into a new or empty directory")
    snapshot = verify_owned(directory, listed, record=str(directory / INDEX_NAME),
                            contents=overwrite)
    if not overwrite:
        raise DatasetExists(f"{directory} is not empty: it holds a dataset; overwrite it "
                            "explicitly to replace it")
    return snapshot


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_writable(directory: str | os.PathLike[str], overwrite: bool) -> None:
    """That ``write_dataset`` may write into ``directory``: it is new or empty, or it holds
    a dataset that ``write_dataset`` wrote, unchanged (the sha256 its index records of each
    shard), and nothing else, and ``overwrite`` says to replace it. DatasetExists for a
    dataset without ``overwrite``; DatasetError naming anything else there (a file the
    index does not list, a link, a changed shard, a symbolic link for ``directory``)."""
    _prepare_directory(Path(directory), overwrite)


def _prepare_directory(directory: Path, overwrite: bool) -> Snapshot:
    try:
        return _verify(directory, overwrite)
    except OutputError as err:
        raise DatasetError(str(err)) from None


def _staged(directory: Path, snapshot: Snapshot) -> Staged:
    try:
        return stage(directory, snapshot, last=INDEX_NAME)
    except OSError as err:
        raise DatasetError(f"cannot write beside {directory}: {err.strerror or err}") from None


def write_dataset(directory: str | os.PathLike[str], samples: Iterable[RawSample], *,
                  samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, overwrite: bool = False,
                  provenance: Mapping[str, Any] | None = None,
                  progress: Callable[[int], None] | None = None) -> WriteResult:
    """Write ``samples`` (keys must be ``sample_key(0)``, ``sample_key(1)``, ...) as shards
    of ``samples_per_shard`` and the index, into ``directory`` (created if needed).

    A directory that is not empty is a DatasetError unless it holds a dataset written here
    and nothing else, unchanged, and ``overwrite`` is given (``check_writable``). The new
    dataset is written into a folder beside ``directory`` and swapped in with renames once
    complete, so an error or an interruption leaves the old one whole; then the old index
    and shards are removed. ``provenance`` goes into the index as is (JSON).
    ``progress(n)`` is called after each sample. ValueError for a sample whose parts do not
    say what they are (wrong key, image size or format)."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, not {samples_per_shard}")
    directory = Path(directory)
    staged = _staged(directory, _prepare_directory(directory, overwrite))
    try:
        result = _write_into(staged.path, samples, samples_per_shard, provenance, progress)
        staged.commit()
    except OSError as err:
        staged.discard()
        raise DatasetError(f"cannot write to {directory}: {err.strerror or err}") from None
    except OutputError as err:
        staged.discard()
        raise DatasetError(str(err)) from None
    except BaseException:
        staged.discard()
        raise
    return WriteResult(path=directory, num_samples=result.num_samples,
                       num_shards=result.num_shards, num_bytes=result.num_bytes)


def _write_into(folder: Path, samples: Iterable[RawSample], samples_per_shard: int,
                provenance: Mapping[str, Any] | None,
                progress: Callable[[int], None] | None) -> WriteResult:
    """The shards and the index, into the new, empty ``folder``."""
    shards: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    tar: tarfile.TarFile | None = None
    total = 0

    def close_shard() -> None:
        nonlocal tar
        if tar is None:
            return
        tar.close()
        tar = None
        path = folder / shards[-1]["name"]
        shards[-1]["size_bytes"] = path.stat().st_size
        shards[-1]["sha256"] = file_sha256(path)

    try:
        for i, raw in enumerate(samples):
            if raw.key != sample_key(i):
                raise ValueError(f"sample {i} has key {raw.key!r}; the dataset's keys are "
                                 f"positions, {sample_key(i)!r} here")
            if i % samples_per_shard == 0:
                close_shard()
                name = shard_name(len(shards))
                shards.append({"name": name, "num_samples": 0, "size_bytes": 0})
                tar = tarfile.open(folder / name, mode="x", format=tarfile.USTAR_FORMAT)
            assert tar is not None
            entries.append(_add_sample(tar, raw, len(shards) - 1, shards[-1]["name"]))
            shards[-1]["num_samples"] += 1
            total = i + 1
            if progress is not None:
                progress(total)
        close_shard()
    finally:
        if tar is not None:
            tar.close()
    text = _index_text(total, samples_per_shard, provenance, shards, entries)
    (folder / INDEX_NAME).write_bytes(text)
    return WriteResult(path=folder, num_samples=total, num_shards=len(shards),
                       num_bytes=sum(s["size_bytes"] for s in shards) + len(text))


def _add_sample(tar: tarfile.TarFile, raw: RawSample, shard: int, name: str
                ) -> dict[str, Any]:
    """Append ``raw``'s members to ``tar``; its index entry."""
    members = []
    for member, data in _members(raw):
        tar.addfile(_tar_info(f"{raw.key}.{member}", len(data)), io.BytesIO(data))
        padded = -(-len(data) // _BLOCK) * _BLOCK
        members.append(Member(name=member, offset=tar.offset - padded, size=len(data),
                              crc32=zlib.crc32(data)))
    sample = SampleInfo(
        key=raw.key, shard=name, members=tuple(members),
        text_bytes=len(raw.text.encode("utf-8")), text_tokens=count_text_tokens(raw.text),
        images=tuple((i.width, i.height) for i in raw.images),
        gen_images=tuple((i.width, i.height) for i in raw.gen_images),
        audio=tuple(a.frames for a in raw.audio),
        gen_audio=tuple(a.frames for a in raw.gen_audio))
    return sample._entry(shard)


def _index_text(total: int, samples_per_shard: int, provenance: Mapping[str, Any] | None,
                shards: list[dict[str, Any]], entries: list[dict[str, Any]]) -> bytes:
    head = {"format": FORMAT, "version": VERSION, "num_samples": total,
            "samples_per_shard": samples_per_shard, "provenance": dict(provenance or {}),
            "shards": shards}
    # One sample per line: readable, and diffs of two indexes line up.
    text = json.dumps(head, sort_keys=True, indent=1)[:-2] + ',\n "samples": [\n'
    text += ",\n".join(json.dumps(e, sort_keys=True, separators=(",", ":")) for e in entries)
    text += "\n ]\n}\n"
    return text.encode()


# ---- reading ------------------------------------------------------------------------------

class Dataset:
    """A dataset directory opened for reading: ``len``, ``key``, ``info`` (index only),
    ``read`` (one sample by offset) and iteration (streams the shards in order).

    Shard files stay open until ``close`` (or the end of a ``with`` block); reads use
    ``os.pread``, so one Dataset may be shared by threads and survives ``fork``."""

    def __init__(self, path: Path, shards: list[_Shard], samples: list[SampleInfo],
                 provenance: dict[str, Any], *, skipped: Mapping[str, int] | None = None,
                 problems: tuple[str, ...] = ()) -> None:
        self.path = path
        self.provenance: Mapping[str, Any] = provenance   # what the writer said
        self._shards = shards
        self._samples = samples
        self._files: dict[str, Any] = {}
        self.skipped: Mapping[str, int] = dict(skipped or {})   # samples left out, by reason
        self.problems = problems       # shards refused or truncated, one line each

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Dataset:
        """Open and check a dataset: DatasetError for a missing or corrupt index, or a
        missing shard or one larger than the index records. A shard refused by
        ``data.paths`` or shorter than recorded leaves out the samples it cannot hold
        (``skipped``, ``problems``)."""
        from dtdsl.data.paths import MISSING, Refused, inside, read_regular

        path = Path(directory)
        if not path.is_dir():
            raise DatasetError(f"no dataset at {path}: not a directory")
        try:
            index = inside(path, INDEX_NAME)
            text = read_regular(index)
        except Refused as err:
            if err.reason == MISSING:
                raise DatasetError(f"no dataset index {path / INDEX_NAME} (an unfinished or "
                                   "foreign directory?)") from None
            raise DatasetError(f"cannot read the dataset index: {err}") from None
        except OSError as err:
            raise DatasetError(f"cannot read {path / INDEX_NAME}: "
                               f"{err.strerror or err}") from None
        shards, samples, provenance = _parse_index(path / INDEX_NAME, text)
        problems: list[str] = []
        kept: dict[str, int] = {}           # shard name -> its readable size in bytes
        for shard in shards:
            file = path / shard.name
            try:
                size = inside(path, shard.name).stat().st_size
            except Refused as err:
                if err.reason == MISSING:
                    raise DatasetError(f"missing shard {file} (listed in "
                                       f"{path / INDEX_NAME})") from None
                problems.append(f"refused: {err}")
                continue
            except OSError as err:
                raise DatasetError(f"cannot read {file}: {err.strerror or err}") from None
            if size > shard.size_bytes:
                raise DatasetError(f"corrupt shard {file}: {size} bytes, the index says "
                                   f"{shard.size_bytes}")
            kept[shard.name] = size
        out, skipped, cut = _readable(samples, kept)
        problems += [f"{s.name} is truncated: {kept[s.name]:,} bytes, the index says "
                     f"{s.size_bytes:,}; {cut.get(s.name, 0)} samples cut off"
                     for s in shards if kept.get(s.name, s.size_bytes) < s.size_bytes]
        return cls(path, shards, out, provenance, skipped=skipped, problems=tuple(problems))

    def __len__(self) -> int:
        return len(self._samples)

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._shards)

    @property
    def fingerprint(self) -> str:
        """What the samples are: the index (path, size, modification time) and which of
        them this open reads (a shard refused or cut since changes it)."""
        import hashlib

        st = (self.path / INDEX_NAME).stat()
        h = hashlib.sha256(f"{self.path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        h.update("\0".join(s.key for s in self._samples).encode())
        return h.hexdigest()

    def key(self, i: int) -> str:
        return self._samples[i].key

    def info(self, i: int) -> SampleInfo:
        """Sample ``i``'s place and sizes (no shard is read)."""
        return self._samples[i]

    def _file(self, name: str) -> Any:
        from dtdsl.data.paths import Refused, inside, open_regular

        file = self._files.get(name)
        if file is None:
            try:
                file = self._files[name] = open_regular(inside(self.path, name))
            except Refused as err:
                raise DatasetError(f"corrupt shard {self.path / name}: {err}") from None
            except OSError as err:
                raise DatasetError(f"cannot read {self.path / name}: "
                                   f"{err.strerror or err}") from None
        return file

    def read(self, i: int) -> RawSample:
        """Sample ``i``, read with one seek; headers and CRCs checked."""
        info = self._samples[i]
        file = self._file(info.shard)
        start = min(m.offset for m in info.members) - _BLOCK
        end = max(m.offset + m.size for m in info.members)
        where = self.path / info.shard
        try:
            buf = os.pread(file.fileno(), end - start, start)
        except OSError as err:
            raise DatasetError(f"cannot read {where}: {err.strerror or err}") from None
        if len(buf) != end - start:
            raise DatasetError(f"corrupt shard {where}: sample {info.key} is cut off")
        view = memoryview(buf)
        blobs = {}
        for m in info.members:
            at = m.offset - start
            try:
                header = tarfile.TarInfo.frombuf(bytes(view[at - _BLOCK:at]), "utf-8",
                                                 "surrogateescape")
            except tarfile.HeaderError as err:
                raise DatasetError(f"corrupt shard {where}: sample {info.key}, member "
                                   f"{m.name}: bad tar header ({err})") from None
            if header.name != f"{info.key}.{m.name}" or header.size != m.size:
                raise DatasetError(f"corrupt shard {where}: at offset {m.offset} the index "
                                   f"expects {info.key}.{m.name} of {m.size} bytes, the tar "
                                   f"has {header.name} of {header.size}")
            blobs[m.name] = bytes(view[at:at + m.size])
        return _assemble(info, blobs, where)

    def __iter__(self) -> Iterator[RawSample]:
        """Every sample in order, streaming each tar from start to end (no seeks); a
        truncated shard's readable samples, then nothing more of it."""
        from dtdsl.data.paths import Refused, inside, open_regular

        by_shard: dict[str, list[SampleInfo]] = {}
        for info in self._samples:
            by_shard.setdefault(info.shard, []).append(info)
        for shard in self._shards:
            infos = by_shard.get(shard.name)
            if infos is None:
                continue
            where = self.path / shard.name
            try:
                with open_regular(inside(self.path, shard.name)) as f, \
                        tarfile.open(fileobj=f, mode="r|") as tar:
                    yield from _stream(tar, infos, where,
                                       whole=len(infos) == shard.num_samples)
            except Refused as err:
                raise DatasetError(f"corrupt shard {where}: {err}") from None
            except (tarfile.TarError, OSError, EOFError) as err:
                raise DatasetError(f"corrupt shard {where}: {err}") from None


def _readable(samples: list[SampleInfo], kept: Mapping[str, int]
              ) -> tuple[list[SampleInfo], dict[str, int], dict[str, int]]:
    """The samples that lie whole in the shards ``kept`` (name -> readable bytes), the
    others counted by reason, and per shard how many were cut off."""
    out, skipped, cut = [], {}, {}
    for info in samples:
        size = kept.get(info.shard)
        end = max((m.offset + m.size for m in info.members), default=0)
        if size is not None and end <= size:
            out.append(info)
            continue
        why = "shard refused" if size is None else "cut off (truncated shard)"
        skipped[why] = skipped.get(why, 0) + 1
        if size is not None:
            cut[info.shard] = cut.get(info.shard, 0) + 1
    return out, skipped, cut


def _stream(tar: tarfile.TarFile, infos: list[SampleInfo], where: Path, *,
            whole: bool = True) -> Iterator[RawSample]:
    """The samples ``infos`` from the start of ``tar``, checked against the index; with
    ``whole``, nothing may follow them (a truncated shard's end is not read)."""
    members = iter(tar)
    for info in infos:
        blobs = {}
        for m in info.members:
            found = next(members, None)
            if found is None:
                raise DatasetError(f"corrupt shard {where}: it ends before sample {info.key}'s "
                                   f"member {m.name}")
            if found.name != f"{info.key}.{m.name}" or found.size != m.size or \
                    found.offset_data != m.offset:
                raise DatasetError(f"corrupt shard {where}: expected {info.key}.{m.name} of "
                                   f"{m.size} bytes at {m.offset}, found {found.name} of "
                                   f"{found.size} at {found.offset_data}")
            file = tar.extractfile(found)
            assert file is not None  # a regular file, checked by name and size above
            blobs[m.name] = file.read()
        yield _assemble(info, blobs, where)
    extra = next(members, None) if whole else None
    if extra is not None:
        raise DatasetError(f"corrupt shard {where}: unexpected member {extra.name} after "
                           f"the {len(infos)} samples of the index")


def _assemble(info: SampleInfo, blobs: dict[str, bytes], where: Path) -> RawSample:
    """A RawSample from its members' bytes, checked against the index."""
    def bad(message: str) -> DatasetError:
        return DatasetError(f"corrupt shard {where}: sample {info.key}: {message}")

    for m in info.members:
        if zlib.crc32(blobs[m.name]) != m.crc32:
            raise bad(f"member {m.name} fails its CRC-32 check")
    try:
        text = blobs["txt"].decode("utf-8")
        record = json.loads(blobs["json"])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"unreadable text or record ({err})") from None
    if not isinstance(record, dict) or record.get("key") != info.key:
        raise bad("its JSON record does not carry its key")
    try:
        parts = {}
        for kind, sizes in (("img", info.images), ("gen", info.gen_images)):
            names = {_stem(n): n for n in blobs if n.startswith(kind) and
                     not n.startswith("genaud")}
            entries = record["images" if kind == "img" else "gen_images"]
            items = []
            for k, (w, h) in enumerate(sizes):
                name = names[f"{kind}{k}"]
                fmt = _EXT_FORMAT[name.rsplit(".", 1)[1]]
                if entries[k] != {"w": w, "h": h, "format": fmt}:
                    raise ValueError(f"record {entries[k]} disagrees with {name} {w}x{h}")
                items.append(EncodedImage(format=fmt, data=blobs[name], width=w, height=h))
            parts[kind] = tuple(items)
        for kind, frames in (("aud", info.audio), ("genaud", info.gen_audio)):
            entries = record["audio" if kind == "aud" else "gen_audio"]
            clips = []
            for k, n in enumerate(frames):
                if entries[k]["frames"] != n:
                    raise ValueError(f"record {entries[k]} disagrees with {n} frames")
                clips.append(EncodedAudio(data=blobs[f"{kind}{k}.npy"], frames=n,
                                          bins=int(entries[k]["bins"]),
                                          channels=int(entries[k].get("channels", 1))))
            parts[kind] = tuple(clips)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise bad(f"record and index disagree ({err})") from None
    meta = {k: v for k, v in record.items() if k not in _RESERVED}
    return RawSample(key=info.key, text=text, meta=meta, images=parts["img"],
                     gen_images=parts["gen"], audio=parts["aud"], gen_audio=parts["genaud"])
