"""The preprocessing transport's message format (``feed.wire``'s module docstring has the
whole of it): the job secret, and one message as authenticated frames, encoded and
decoded with every check in the order the transport documents; no sockets here."""

from __future__ import annotations

import hmac
import math
import os
import secrets
import stat
import struct
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "MAGIC", "PREFIX", "SECRET_BYTES", "VERSION", "Message", "Reason",
           "WireError", "decode", "encode", "new_secret", "read_secret", "secret_from_text",
           "secret_to_text", "write_secret"]

MAGIC = b"DTDW"
VERSION = 1
PREFIX = MAGIC + bytes([VERSION])
_TAG_BYTES = 32                              # HMAC-SHA256
_FRAME0_BYTES = len(PREFIX) + _TAG_BYTES

SECRET_BYTES = 32
_MIN_SECRET_BYTES = 16                       # below this an HMAC key is guessable

MAX_HEADER_BYTES = 64 * 1024                 # msgpack limits every length to this too
DEFAULT_MAX_BYTES = 64 * 1024 * 1024         # payload of one message (all buffers)
DEFAULT_MAX_ARRAYS = 256
_MAX_NAME_CHARS = 128
_MAX_NDIM = 16
_MAX_META_DEPTH = 16

# Wire name -> little-endian numpy dtype; the wire is little-endian on every host.
DTYPES: Mapping[str, np.dtype] = {
    "uint8": np.dtype("<u1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}
_WIRE_NAME = {dtype: name for name, dtype in DTYPES.items()}


class Reason(StrEnum):
    """Why a message was dropped; the keys of ``Receiver.dropped``."""

    FRAME_COUNT = "frame_count"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    TOO_MANY_ARRAYS = "too_many_arrays"
    HEADER_TOO_LARGE = "header_too_large"
    OVERSIZED = "oversized"
    BAD_TAG = "bad_tag"
    BAD_HEADER = "bad_header"
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    SIZE_MISMATCH = "size_mismatch"
    UNEXPECTED = "unexpected"   # decode itself failed: a bug in this module, logged loudly


class WireError(Exception):
    """A received message is malformed, oversized or not authenticated."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, eq=False)
class Message:
    """One valid message. ``arrays`` are read-only numpy views over the received frames."""

    kind: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    _buffers: dict[str, memoryview] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of array payload."""
        return sum(array.nbytes for array in self.arrays.values())

    def tensor(self, name: str) -> torch.Tensor:
        """Array ``name`` as a writable CPU tensor the caller may keep and modify.

        Shares memory with the received frame when that frame is writable and aligned (zmq
        frames are this message's private copy of the bytes, so nobody else sees the
        writes), else copies once. It may alias ``arrays[name]`` and the tensors of other
        calls for the same name: write into one of them only, and read that one.
        """
        import torch

        array = self.arrays[name]
        buffer = self._buffers.get(name)
        if buffer is not None and not buffer.readonly and array.flags.aligned:
            return torch.from_numpy(np.frombuffer(buffer, dtype=array.dtype).reshape(array.shape))
        return torch.from_numpy(array.copy())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every array as ``tensor(name)`` does."""
        return {name: self.tensor(name) for name in self.arrays}


# --- the secret --------------------------------------------------------------------------


def new_secret() -> bytes:
    """A fresh random per-job secret (``SECRET_BYTES`` bytes from ``secrets``)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_to_text(secret: bytes) -> str:
    """The secret as lowercase hex, the form written into a bundle."""
    return _check_secret(secret).hex()


def secret_from_text(text: str) -> bytes:
    """The inverse of ``secret_to_text`` (surrounding whitespace ignored)."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"a job secret is {2 * SECRET_BYTES} hex digits; this text is "
                         "not hex (write one with write_secret(path, new_secret()))") from None
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a job secret is {2 * SECRET_BYTES} hex digits, got "
                         f"{2 * len(secret)}")
    return secret


def write_secret(path: str | os.PathLike[str], secret: bytes) -> Path:
    """Write the secret as hex into ``path`` with mode 0600; returns the path.

    The file is created private (mkstemp) and renamed over ``path``, so the secret is never
    readable through wider permissions, not even those of a file it replaces.
    """
    path = Path(path)
    text = secret_to_text(secret) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a secret written by ``write_secret``.

    Refuses (``PermissionError``) a file that its group or others may read or write, like
    ssh does with private keys: the secret is what keeps other users' processes from
    feeding our trainers.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            raise PermissionError(f"{os.fspath(path)} has mode {mode:04o}: the job secret must "
                                  f"be private to its owner; run: chmod 600 {os.fspath(path)}")
        with os.fdopen(fd, "r", encoding="ascii", closefd=False) as file:
            text = file.read(4 * SECRET_BYTES)
    finally:
        os.close(fd)
    return secret_from_text(text)


def _check_secret(secret: bytes) -> bytes:
    if isinstance(secret, str):
        raise TypeError("the secret is bytes; turn its hex text into bytes with "
                        "secret_from_text(text)")
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"the secret is bytes, got {type(secret).__name__}")
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"the secret has {len(secret)} bytes, at least {_MIN_SECRET_BYTES} "
                         "are needed; make one with new_secret()")
    return bytes(secret)


# --- the message format ------------------------------------------------------------------


def encode(kind: str, meta: Mapping[str, Any] | None, arrays: Mapping[str, Any] | None,
           secret: bytes) -> list[bytes | memoryview]:
    """The frames of one message (see the module docstring), ready for ``send_multipart``.

    ``arrays`` maps names to numpy arrays or CPU torch tensors of a ``DTYPES`` dtype. The
    buffers are memoryviews over the arrays themselves (no copy for contiguous ones).
    Raises ``TypeError``/``ValueError`` for anything every receiver would drop (its own
    ``max_bytes`` and ``max_arrays`` aside), so a sender's mistake shows up at the sender.
    """
    secret = _check_secret(secret)
    _check_name(kind, "kind", ValueError)
    meta = dict(meta or {})
    _check_plain(meta, ValueError)
    specs: list[list[Any]] = []
    buffers: list[memoryview] = []
    for name, value in (arrays or {}).items():
        _check_name(name, "array name", ValueError)
        array, wire_name = _as_wire_array(name, value)
        specs.append([name, wire_name, list(array.shape), array.nbytes])
        # reshape(-1) of a C-contiguous array is a view; the uint8 view makes a flat byte
        # buffer for any shape, including 0-d and zero-size ones.
        buffers.append(memoryview(array.reshape(-1).view(np.uint8)))
    header = msgpack.packb({"kind": kind, "meta": meta, "arrays": specs}, use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"the header is {len(header)} bytes, more than MAX_HEADER_BYTES = "
                         f"{MAX_HEADER_BYTES}: move bulk data out of meta into arrays")
    return [PREFIX + _tag(secret, header, buffers), header, *buffers]


def decode(frames: Sequence[Any], secret: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
           max_arrays: int = DEFAULT_MAX_ARRAYS) -> Message:
    """Check and unpack the frames of one message; ``WireError`` if anything is wrong.

    ``frames`` are bytes-like (bytes, memoryview, ``zmq.Frame``). The arrays of the result
    are read-only views over them, not copies.
    """
    secret = _check_secret(secret)
    if len(frames) < 2:
        raise WireError(Reason.FRAME_COUNT, f"{len(frames)} frames, at least 2 are needed")
    if len(frames) - 2 > max_arrays:
        raise WireError(Reason.TOO_MANY_ARRAYS,
                        f"{len(frames) - 2} array frames, at most {max_arrays}")
    views = [_byte_view(frame) for frame in frames]
    first, header, buffers = views[0], views[1], views[2:]
    if len(first) != _FRAME0_BYTES or bytes(first[:len(MAGIC)]) != MAGIC:
        raise WireError(Reason.BAD_MAGIC, f"frame 0 is not {MAGIC!r} and a tag")
    if first[len(MAGIC)] != VERSION:
        raise WireError(Reason.BAD_VERSION,
                        f"wire format version {first[len(MAGIC)]}, this is {VERSION}")
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(Reason.HEADER_TOO_LARGE,
                        f"{len(header)} header bytes, at most {MAX_HEADER_BYTES}")
    total = sum(len(buffer) for buffer in buffers)
    if total > max_bytes:
        raise WireError(Reason.OVERSIZED, f"{total} payload bytes, at most {max_bytes}")
    # Before any parsing: nothing but the HMAC ever looks at unauthenticated bytes.
    if not hmac.compare_digest(first[len(PREFIX):], _tag(secret, header, buffers)):
        raise WireError(Reason.BAD_TAG, "the HMAC tag does not match (wrong secret or "
                        "altered frames)")
    kind, meta, specs = _parse_header(header)
    if len(specs) != len(buffers):
        raise WireError(Reason.FRAME_COUNT,
                        f"the header lists {len(specs)} arrays, {len(buffers)} buffers came")
    arrays: dict[str, np.ndarray] = {}
    kept: dict[str, memoryview] = {}
    for spec, buffer in zip(specs, buffers, strict=True):
        name, array = _unpack_array(spec, buffer)
        if name in arrays:
            raise WireError(Reason.BAD_HEADER, f"array {name!r} listed twice")
        arrays[name] = array
        kept[name] = buffer
    return Message(kind=kind, meta=meta, arrays=arrays, _buffers=kept)


def _tag(secret: bytes, header: memoryview | bytes, buffers: Sequence[memoryview]) -> bytes:
    # The frame count and every length go into the MAC: moving bytes from one frame to the
    # next, or dropping or adding an empty frame, changes the tag.
    lengths = [len(header), *(len(buffer) for buffer in buffers)]
    mac = hmac.new(secret, digestmod="sha256")
    mac.update(PREFIX + struct.pack(f"<{1 + len(lengths)}Q", len(lengths), *lengths))
    mac.update(header)
    for buffer in buffers:
        mac.update(buffer)
    return mac.digest()


def _byte_view(frame: Any) -> memoryview:
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _as_wire_array(name: str, value: Any) -> tuple[np.ndarray, str]:
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)   # a numpy scalar goes as a 0-d array
    else:
        torch = sys.modules.get("torch")     # no torch import for numpy-only producers
        if torch is None or not isinstance(value, torch.Tensor):
            raise TypeError(f"array {name!r} is a {type(value).__name__}; send numpy arrays "
                            "or CPU torch tensors")
        if value.device.type != "cpu":
            raise ValueError(f"array {name!r} is on {value.device}; workers send CPU tensors "
                             "(move it with .cpu() first)")
        if value.dtype == torch.bfloat16:
            raise TypeError(f"array {name!r} is bfloat16, which the wire does not carry (see "
                            "the module docstring): send float32 and cast on the trainer")
        array = value.detach().resolve_conj().resolve_neg().numpy()
    wire_dtype = array.dtype.newbyteorder("<")
    wire_name = _WIRE_NAME.get(wire_dtype)
    if wire_name is None:
        raise TypeError(f"array {name!r} has dtype {array.dtype}; the wire carries "
                        f"{', '.join(DTYPES)}")
    if array.dtype != wire_dtype or not array.flags.c_contiguous:
        # astype keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
        array = array.astype(wire_dtype, order="C")
    return array, wire_name


def _check_name(name: Any, what: str, error: type[Exception]) -> str:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_CHARS:
        raise error(f"{what} must be a non-empty str of at most {_MAX_NAME_CHARS} "
                    f"characters, got {name!r:.80}")
    return name


def _check_plain(meta: Any, error: type[Exception]) -> None:
    """``meta`` is a str-keyed map of plain msgpack data, nested at most _MAX_META_DEPTH."""
    if not isinstance(meta, dict):
        raise error(f"meta must be a map, got {type(meta).__name__}")
    # An explicit stack: hostile nesting cannot reach Python's recursion limit.
    stack: list[tuple[Any, str, int]] = [(meta, "meta", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > _MAX_META_DEPTH:
            raise error(f"{path} is nested more than {_MAX_META_DEPTH} deep")
        if value is None or isinstance(value, bool | int | float | str | bytes):
            if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
                raise error(f"{path} = {value} does not fit in 64 bits")
            continue
        if isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise error(f"{path} has a {type(key).__name__} key {key!r:.40}; "
                                "meta keys are str")
                stack.append((item, f"{path}[{key!r}]", depth + 1))
        else:
            raise error(f"{path} is a {type(value).__module__}.{type(value).__name__}; meta "
                        "holds plain data only (None, bool, int, float, str, bytes, list, "
                        "dict): convert it, e.g. int(x) or x.tolist()")


def _parse_header(header: memoryview) -> tuple[str, dict[str, Any], list[Any]]:
    try:
        # Every length in the header is limited by its own size (msgpack's unpackb default),
        # so a declared 4 GiB string fails at once; max_ext_len=0 refuses ext types, the
        # timestamp one included; deep nesting hits msgpack's own stack limit.
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True,
                              max_ext_len=0)
    except Exception as err:      # msgpack raises several types for hostile bytes
        raise WireError(Reason.BAD_HEADER, f"not a msgpack header: {err}") from None
    if not isinstance(obj, dict) or set(obj) != {"kind", "meta", "arrays"}:
        raise WireError(Reason.BAD_HEADER, "the header is not a map of kind, meta and arrays")
    kind, meta, specs = obj["kind"], obj["meta"], obj["arrays"]
    _check_name(kind, "kind", _BadHeader)
    _check_plain(meta, _BadHeader)
    if not isinstance(specs, list):
        raise WireError(Reason.BAD_HEADER, "arrays is not a list")
    return kind, meta, specs


class _BadHeader(WireError):
    """A WireError(BAD_HEADER) raised by the checks shared with ``encode``."""

    def __init__(self, detail: str) -> None:
        super().__init__(Reason.BAD_HEADER, detail)


def _unpack_array(spec: Any, buffer: memoryview) -> tuple[str, np.ndarray]:
    if not isinstance(spec, list) or len(spec) != 4:
        raise WireError(Reason.BAD_HEADER, "an array entry is not [name, dtype, shape, nbytes]")
    name, wire_name, shape, nbytes = spec
    _check_name(name, "array name", _BadHeader)
    dtype = DTYPES.get(wire_name) if isinstance(wire_name, str) else None
    if dtype is None:
        raise WireError(Reason.BAD_DTYPE, f"array {name!r} has dtype {wire_name!r:.40}")
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
            or not all(_is_int(dim) and dim >= 0 for dim in shape)):
        raise WireError(Reason.BAD_SHAPE, f"array {name!r} has shape {shape!r:.80}")
    # Python ints: a huge declared shape cannot overflow into a small product.
    expected = math.prod(shape) * dtype.itemsize
    if not _is_int(nbytes) or nbytes != expected or nbytes != len(buffer):
        raise WireError(Reason.SIZE_MISMATCH,
                        f"array {name!r}: shape {shape!r:.80} of {wire_name} is {expected} "
                        f"bytes, declared {nbytes!r:.40}, buffer {len(buffer)}")
    array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    array.flags.writeable = False
    return name, array


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
