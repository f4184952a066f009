"""DCP's plans and metadata without trusting pickle.

``torch.distributed.checkpoint`` moves Python objects around with pickle: its collectives
pickle the save plans, and ``FileSystemReader.read_metadata`` unpickles ``.metadata``. Two
of those places are open to someone the job does not trust:

- **The store.** A background save carries DCP's planning through the default group's
  c10d store (``checkpoint._Exchange``), and a TCPStore has no authentication: whoever
  reaches its port can list, read and write keys. So messages there are ``encode``\\ d
  here: msgpack of plain data in which DCP's dataclasses travel as (class name, fields),
  decoded by building only the classes of ``ALLOWED`` (never an import, never a call of
  anything else), and each record authenticated with an HMAC keyed by a secret the ranks
  share over their process group (``seal``/``unseal``).
- **A run directory.** ``dtc export RUN_DIR`` and ``--resume`` read ``.metadata`` from a
  directory someone else may have written. ``SafeReader`` reads it with an unpickler that
  resolves only DCP's metadata classes and the torch types in them (``_Allowed``), and
  checks that every storage entry names a regular file inside the checkpoint directory
  (not a link, not a pipe) that holds the bytes the entry claims. Its non-tensor entries,
  which DCP's default planner reads with a full unpickler, are read by ``SafeLoadPlanner``
  with torch's ``weights_only`` one (plain data, no code).

What stays trusted, and is documented as such (``docs/codegen.md``, "Trust
boundaries"): the process group's own connections (``dcp.load`` runs its planning over
them with torch's object collectives, as NCCL and gloo carry the tensors), which is why a
job's rendezvous must be on a network only the job's hosts reach.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import io
import math
import pathlib
import pickle
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import planner as _pl
from torch.distributed.checkpoint import storage as _st

__all__ = ["ALLOWED", "MAGIC", "SafeLoadPlanner", "SafeReader", "UnsafeMetadata", "decode",
           "encode", "read_metadata", "seal", "unseal"]

# Every class a DCP save plan, write result or metadata is made of; nothing else is built.
ALLOWED: dict[str, type] = {
    f"{cls.__module__}.{cls.__qualname__}": cls for cls in (
        _md.ChunkStorageMetadata, _md.TensorProperties, _md.TensorStorageMetadata,
        _md.BytesStorageMetadata, _md.StorageMeta, _md.Metadata, _md.MetadataIndex,
        _md._MEM_FORMAT_ENCODING,
        _pl.WriteItemType, _pl.LoadItemType, _pl.BytesIOWriteData, _pl.TensorWriteData,
        _pl.WriteItem, _pl.SavePlan,
        _st.WriteResult,
        _fs._StorageInfo, _fs._StoragePrefix,
    )
}

# msgpack extension codes of the non-plain values
_OBJ, _TUPLE, _SIZE, _DTYPE, _ENUM, _DICT, _LAYOUT, _MEMFMT, _PATH = range(1, 10)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMFMTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_DTYPES = {name: value for name, value in vars(torch).items()
           if isinstance(value, torch.dtype)}


class UnsafeMetadata(ValueError):
    """A ``.metadata`` file or a store message that is not what DCP writes."""


# ---- the msgpack codec -----------------------------------------------------------------

def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, strict_types=True)


def _ext(code: int, value: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, _pack(value))


def _plain(value: Any) -> Any:
    """``value`` as msgpack's own types, every other type an extension naming it."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if type(value) is list:
        return [_plain(item) for item in value]
    if isinstance(value, torch.Size):
        return _ext(_SIZE, list(value))
    if type(value) is tuple:
        return _ext(_TUPLE, [_plain(item) for item in value])
    if type(value) is dict:
        return _ext(_DICT, [[_plain(k), _plain(v)] for k, v in value.items()])
    if isinstance(value, torch.dtype):
        return msgpack.ExtType(_DTYPE, str(value).removeprefix("torch.").encode())
    if isinstance(value, torch.layout):
        return msgpack.ExtType(_LAYOUT, str(value).encode())
    if isinstance(value, torch.memory_format):
        return msgpack.ExtType(_MEMFMT, str(value).encode())
    if isinstance(value, pathlib.PurePath):
        return msgpack.ExtType(_PATH, str(value).encode())
    cls = type(value)
    if _name(cls) not in ALLOWED:
        raise TypeError(f"{_name(cls)} is not one of the classes a DCP plan is made of")
    if isinstance(value, enum.Enum):
        return _ext(_ENUM, [_name(cls), value.name])
    return _ext(_OBJ, [_name(cls), [[f.name, _plain(getattr(value, f.name))]
                                    for f in dataclasses.fields(value)]])


def encode(value: Any) -> bytes:
    """``value`` (plain data and the classes of ``ALLOWED``, nested) as msgpack bytes."""
    return _pack(_plain(value))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_from_ext, raw=False, strict_map_key=True,
                           use_list=True)


def _from_ext(code: int, data: bytes) -> Any:
    try:
        return _EXT[code](data)
    except KeyError:
        raise UnsafeMetadata(f"unknown value type {code}") from None


def _obj(data: bytes) -> Any:
    name, fields = _unpack(data)
    cls = _allowed(name)
    if not dataclasses.is_dataclass(cls) or not isinstance(fields, list):
        raise UnsafeMetadata(f"{name} is not a dataclass")
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in fields:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in known):
            raise UnsafeMetadata(f"{name} has no field {item!r:.80}")
        kwargs[item[0]] = item[1]
    return cls(**kwargs)


def _enum(data: bytes) -> Any:
    name, member = _unpack(data)
    cls = _allowed(name)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and
            isinstance(member, str) and member in cls.__members__):
        raise UnsafeMetadata(f"{name} has no member {member!r:.80}")
    return cls[member]


def _allowed(name: Any) -> type:
    if not isinstance(name, str) or name not in ALLOWED:
        raise UnsafeMetadata(f"{name!r:.120} is not one of DCP's metadata classes")
    return ALLOWED[name]


def _lookup(table: dict[str, Any], what: str) -> Callable[[bytes], Any]:
    def get(data: bytes) -> Any:
        try:
            return table[data.decode()]
        except (KeyError, UnicodeDecodeError):
            raise UnsafeMetadata(f"unknown {what} {data[:80]!r}") from None
    return get


def _size(data: bytes) -> torch.Size:
    dims = _unpack(data)
    if not (isinstance(dims, list) and all(type(d) is int and d >= 0 for d in dims)):
        raise UnsafeMetadata("a size that is not a list of non-negative integers")
    return torch.Size(dims)


def _dict(data: bytes) -> dict[Any, Any]:
    pairs = _unpack(data)
    if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2
                                            for p in pairs)):
        raise UnsafeMetadata("a mapping that is not a list of pairs")
    try:
        return {k: v for k, v in pairs}
    except TypeError as err:     # an unhashable key
        raise UnsafeMetadata(f"a mapping key: {err}") from None


_EXT: dict[int, Callable[[bytes], Any]] = {
    _OBJ: _obj, _ENUM: _enum, _SIZE: _size, _DICT: _dict,
    _TUPLE: lambda data: tuple(_unpack(data)),
    _DTYPE: _lookup(_DTYPES, "dtype"), _LAYOUT: _lookup(_LAYOUTS, "layout"),
    _MEMFMT: _lookup(_MEMFMTS, "memory format"),
    _PATH: lambda data: pathlib.Path(data.decode()),
}


def decode(data: bytes) -> Any:
    """The value ``encode`` made; ``UnsafeMetadata`` for anything else (no class outside
    ``ALLOWED`` is ever built)."""
    try:
        return _unpack(data)
    except UnsafeMetadata:
        raise
    except Exception as err:    # msgpack's errors, a class's own refusal of its fields
        raise UnsafeMetadata(f"not a DCP message: {type(err).__name__}: {err}") from None


# ---- authenticated records (the store) -----------------------------------------------------

MAGIC = b"DTCK"
_HEAD = struct.Struct("<4sQ32s")       # magic, payload length, HMAC-SHA256 tag


def _tag(secret: bytes, key: str, payload: bytes) -> bytes:
    # The key is in the MAC: a record cannot be replayed under another key (another rank's
    # part, another save).
    return hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).digest()


def seal(secret: bytes, key: str, value: Any) -> bytes:
    """One authenticated record of ``value`` for store key ``key`` (records are appended:
    a value someone else wrote first does not hide this one)."""
    payload = encode(value)
    return _HEAD.pack(MAGIC, len(payload), _tag(secret, key, payload)) + payload


def _records(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    # Every position where a record could start: forged bytes before a real record (or a
    # forged length that would swallow it) cannot hide it.
    start = data.find(MAGIC)
    while start >= 0:
        if start + _HEAD.size <= len(data):
            _, length, tag = _HEAD.unpack_from(data, start)
            end = start + _HEAD.size + length
            if end <= len(data):
                yield start, tag, data[start + _HEAD.size:end]
        start = data.find(MAGIC, start + 1)


def unseal(secret: bytes, key: str, data: bytes) -> tuple[bool, Any, bool]:
    """``(found, value, forged)``: the first authentic record of ``key`` in the store value
    ``data``, and whether bytes that no holder of ``secret`` wrote came before it (or
    make up all of ``data``)."""
    for start, tag, payload in _records(data):
        if hmac.compare_digest(tag, _tag(secret, key, payload)):
            return True, decode(payload), start > 0
    return False, None, bool(data)


# ---- .metadata from a directory someone else may have written -------------------------------

class _Allowed(pickle.Unpickler):
    """Resolves DCP's metadata classes and the torch values in them, nothing else."""

    _CALLABLE = {("torch", "Size"): torch.Size,
                 ("torch.serialization", "_get_layout"): _LAYOUTS.__getitem__,
                 ("pathlib", "PosixPath"): pathlib.Path,      # a path object; opens nothing
                 ("pathlib", "PurePosixPath"): pathlib.PurePosixPath}

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get(f"{module}.{name}") or self._CALLABLE.get((module, name))
        if found is None and module == "torch" and name in _DTYPES:
            found = _DTYPES[name]
        if found is None and module == "torch" and f"torch.{name}" in _MEMFMTS:
            found = _MEMFMTS[f"torch.{name}"]
        if found is None:
            raise UnsafeMetadata(f"it refers to {module}.{name}, which DCP's metadata "
                                 "never holds")
        return found


def read_metadata(path: str | pathlib.Path) -> _md.Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path``, unpickled with only DCP's
    own classes allowed and its storage entries checked: ``UnsafeMetadata`` for anything
    else."""
    directory = pathlib.Path(path)
    file = directory / ".metadata"
    try:
        data = file.read_bytes()
    except OSError as err:
        raise UnsafeMetadata(f"cannot read {file}: {err.strerror or err}") from None
    try:
        metadata = _Allowed(io.BytesIO(data)).load()
    except UnsafeMetadata as err:
        raise UnsafeMetadata(f"{file} is not DCP metadata: {err}") from None
    except Exception as err:
        raise UnsafeMetadata(f"{file} is not DCP metadata: {type(err).__name__}: "
                             f"{err}") from None
    _check_metadata(metadata, directory, file)
    return metadata


def _check_metadata(metadata: Any, directory: pathlib.Path, file: pathlib.Path) -> None:
    if not isinstance(metadata, _md.Metadata) or \
            not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeMetadata(f"{file} is not DCP metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeMetadata(f"{file} has no storage table")
    for index, info in storage.items():
        if not isinstance(info, _fs._StorageInfo):
            raise UnsafeMetadata(f"{file}: the entry of {index} is not a file location")
        rel = info.relative_path
        if not (isinstance(rel, str) and rel and "/" not in rel and "\\" not in rel
                and rel not in (".", "..") and "\0" not in rel):
            raise UnsafeMetadata(f"{file}: {rel!r:.120} is not a file name inside "
                                 f"{directory}")
        if not (type(info.offset) is int and type(info.length) is int and
                info.offset >= 0 and info.length >= 0):
            raise UnsafeMetadata(f"{file}: the entry of {index} has a bad offset or length")
        if getattr(info, "transform_descriptors", None):    # dtdsl writes none
            raise UnsafeMetadata(f"{file}: the entry of {index} asks for transforms "
                                 f"{info.transform_descriptors!r:.120}")
    _check_entries(metadata.state_dict_metadata, storage, file)
    _check_files(storage, directory)


def _check_entries(entries: dict[Any, Any], storage: dict[Any, Any],
                   file: pathlib.Path) -> None:
    """Every tensor entry a dtype and a shape of sizes >= 0 whose bytes its files can
    hold (a reader allocates it whole), and chunks inside it: what a reader builds
    tensors from."""
    held = sum(info.length for info in storage.values())
    for key, entry in entries.items():
        if isinstance(entry, _md.BytesStorageMetadata):
            continue
        where = f"{file}: the entry {key!r:.80}"
        if not isinstance(entry, _md.TensorStorageMetadata):
            raise UnsafeMetadata(f"{where} is neither a tensor nor bytes")
        props, size = entry.properties, entry.size
        if not (isinstance(props, _md.TensorProperties) and isinstance(props.dtype,
                                                                        torch.dtype)):
            raise UnsafeMetadata(f"{where} has no dtype")
        if not (isinstance(size, torch.Size) and _sizes(size)):
            raise UnsafeMetadata(f"{where} has a shape of other than sizes >= 0")
        nbytes = math.prod(size) * props.dtype.itemsize
        if nbytes > held:
            raise UnsafeMetadata(f"{where} claims {nbytes} bytes, more than its files hold "
                                 f"({held})")
        for chunk in entry.chunks:
            if not (isinstance(chunk, _md.ChunkStorageMetadata) and
                    _sizes(chunk.offsets) and _sizes(chunk.sizes) and
                    len(chunk.offsets) == len(chunk.sizes) == len(size) and
                    all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, size,
                                                      strict=True))):
                raise UnsafeMetadata(f"{where} has a chunk outside its shape")


def _sizes(values: Any) -> bool:
    """Whether ``values`` is a sequence of ints >= 0."""
    return isinstance(values, (tuple, list, torch.Size)) and \
        all(type(v) is int and v >= 0 for v in values)


def _check_files(storage: dict[Any, Any], directory: pathlib.Path) -> None:
    """Every file the storage table names is a regular file (``lstat``: a link is not
    followed, a pipe would block a read) holding the bytes its entries claim."""
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            raise UnsafeMetadata(f"{path} is missing") from None
        except OSError as err:
            raise UnsafeMetadata(f"cannot read {path}: {err.strerror or err}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeMetadata(f"{path} is not a regular file (a link, a pipe?)")
        if st.st_size < end:
            raise UnsafeMetadata(f"{path} holds {st.st_size:,} bytes, its entries reach "
                                 f"byte {end:,}: it was cut short")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner but for non-tensor entries, which it reads with
    ``torch.load(weights_only=False)``: each is first read by torch's restricted unpickler
    (plain Python data and tensors; no other global, so no code), and only then, those same
    bytes, by the default; anything else is ``UnsafeMetadata``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        start = value.tell()
        try:
            torch.load(value, weights_only=True)
        except Exception as err:
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise UnsafeMetadata(f"the entry {read_item.dest_index.fqn} is not plain data: "
                                 f"{first[:200]}") from None
        value.seek(start)
        super().load_bytes(read_item, value)


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_metadata`` (no code from
    the file runs, and no entry reaches outside the checkpoint directory)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeMetadata("rank-local DCP metadata is not read by dtdsl")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
