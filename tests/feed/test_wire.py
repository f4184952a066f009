"""The preprocessing transport: message format, hostile input, live sockets, secret files."""

from __future__ import annotations

import hmac
import logging
import os
import random
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from dtdsl.feed import wire
from dtdsl.feed.wire import (
    DTYPES,
    PREFIX,
    Message,
    Publisher,
    Reason,
    Receiver,
    Sender,
    Subscriber,
    WireError,
    check_address,
    decode,
    encode,
    new_secret,
    read_secret,
    secret_from_text,
    secret_to_text,
    write_secret,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def raw_socket(kind: int, secret: bytes = SECRET) -> zmq.Socket:
    """A plain zmq socket that connects as a peer holding ``secret`` (it passes the
    receiver's gate), so that what it sends reaches the message checks."""
    sock = zmq.Context.instance().socket(kind)
    sock.plain_username = b"dtdsl"
    sock.plain_password = wire.peer_token(secret)
    return sock


def forge(header: bytes, buffers: list[bytes], secret: bytes = SECRET,
          prefix: bytes = PREFIX) -> list[bytes]:
    """A message with a valid tag around any header and buffers, the tag computed from the
    format's description (not with wire's code): what a buggy or compromised worker that
    holds the secret could send."""
    parts = [header, *buffers]
    lengths = b"".join(struct.pack("<Q", n) for n in (len(parts), *map(len, parts)))
    tag = hmac.new(secret, prefix + lengths + b"".join(parts), digestmod="sha256").digest()
    return [prefix + tag, header, *buffers]


def header(kind: object = "k", meta: object = None, arrays: object = ()) -> bytes:
    return msgpack.packb({"kind": kind, "meta": meta if meta is not None else {},
                          "arrays": list(arrays)}, use_bin_type=True)


def reason(frames: list, **limits: int) -> Reason:
    with pytest.raises(WireError) as info:
        decode(frames, SECRET, **limits)
    return info.value.reason


def sample(i: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 255, (3, 8, 8 + i % 3), dtype=np.uint8),
            "tokens": rng.integers(0, 50_000, 11 + i, dtype=np.int64),
            "latents": rng.standard_normal((4, 2, 2)).astype(np.float32)}


def as_bytes(frames: list) -> list[bytes]:
    return [bytes(frame) for frame in frames]


# --- format and round trips ----------------------------------------------------------------

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3), (2, 1, 3, 1, 2), (1, 1, 1, 1, 1, 1, 1)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_every_dtype_and_shape(dtype: str):
    rng = np.random.default_rng(0)
    arrays = {f"a{i}": (rng.standard_normal(shape) * 100).astype(dtype)
              for i, shape in enumerate(SHAPES)}
    message = decode(as_bytes(encode("batch", {"step": 3}, arrays, SECRET)), SECRET)
    assert message.kind == "batch" and message.meta == {"step": 3}
    assert list(message.arrays) == list(arrays)
    for name, array in arrays.items():
        got = message.arrays[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
        assert not got.flags.writeable


def test_frames_follow_the_documented_format():
    frames = encode("batch", {"step": 1}, sample(), SECRET)
    assert as_bytes(frames) == forge(bytes(frames[1]), as_bytes(frames[2:]))
    assert msgpack.unpackb(frames[1]) == {
        "kind": "batch", "meta": {"step": 1},
        "arrays": [["image", "uint8", [3, 8, 8], 192], ["tokens", "int64", [11], 88],
                   ["latents", "float32", [4, 2, 2], 64]]}


def test_meta_holds_nested_plain_data():
    meta = {"step": 2**63 - 1, "neg": -(2**63), "lr": 1e-4, "ok": True, "none": None,
            "name": "x" * 100, "raw": b"\x00\xff", "sizes": [1, [2, [3]]], "by": {"a": {"b": 1}}}
    assert decode(encode("k", meta, {}, SECRET), SECRET).meta == meta


def test_torch_tensors_round_trip_and_come_back_as_writable_tensors():
    arrays = {"ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
              "t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),   # not contiguous
              "g": torch.ones(2, 2, dtype=torch.float16, requires_grad=True),
              "img": torch.zeros(3, 5, 7, dtype=torch.uint8)}
    message = decode(as_bytes(encode("k", {}, arrays, SECRET)), SECRET)
    for name, tensor in arrays.items():
        got = message.tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor.detach())
        got.add_(1)        # writable, and a copy: the frames were immutable bytes
    assert message.arrays["ids"][0, 0] == 0
    assert set(message.tensors()) == set(arrays)


def test_encode_and_decode_do_not_copy_payloads():
    big = np.arange(100_000, dtype=np.int64).reshape(100, 1000)
    frames = encode("k", {}, {"big": big}, SECRET)
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), big)
    received = [bytearray(frame) for frame in frames]
    message = decode(received, SECRET)
    assert np.shares_memory(message.arrays["big"], np.frombuffer(received[2], np.uint8))
    # A writable frame is the message's own: the tensor shares it instead of copying.
    tensor = message.tensor("big")
    assert tensor.data_ptr() == message.arrays["big"].ctypes.data


@pytest.mark.parametrize("value, error", [
    (torch.zeros(2, dtype=torch.bfloat16), "bfloat16"),
    (np.zeros(2, dtype=bool), "bool"),
    (np.zeros(2, dtype=np.float64), "float64"),
    (np.array(["a"], dtype=object), "object"),
    ([1, 2, 3], "list"),
])
def test_encode_refuses_what_the_wire_does_not_carry(value, error):
    with pytest.raises(TypeError, match=error):
        encode("k", {}, {"x": value}, SECRET)


@pytest.mark.parametrize("meta, error", [
    ({"step": np.int64(3)}, "numpy.int64"),
    ({1: "a"}, "int key"),
    ({"deep": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}, "nested"),
    ({"big": 2**64}, "64 bits"),
    ({"blob": "x" * (wire.MAX_HEADER_BYTES + 1)}, "MAX_HEADER_BYTES"),
])
def test_encode_refuses_meta_a_receiver_would_drop(meta, error):
    with pytest.raises(ValueError, match=error):
        encode("k", meta, {}, SECRET)


@pytest.mark.parametrize("secret, error", [
    (b"short", ValueError), ("00" * 32, TypeError), (None, TypeError)])
def test_secrets_must_be_long_bytes(secret, error):
    with pytest.raises(error):
        encode("k", {}, {}, secret)


def test_encoded_byte_order_is_little_endian_everywhere():
    big_endian = np.arange(5, dtype=">i8")
    message = decode(as_bytes(encode("k", {}, {"x": big_endian}, SECRET)), SECRET)
    np.testing.assert_array_equal(message.arrays["x"], np.arange(5))


# --- hostile frames --------------------------------------------------------------------------


def valid_frames() -> list[bytes]:
    return as_bytes(encode("k", {"step": 1}, sample(), SECRET))


def test_wrong_secret_is_refused():
    frames = as_bytes(encode("k", {}, sample(), OTHER))
    assert reason(frames) == Reason.BAD_TAG


def test_one_flipped_bit_in_any_frame_is_refused():
    frames = valid_frames()
    for index, frame in enumerate(frames):
        for position in sorted({0, len(MAGIC := wire.MAGIC), len(frame) // 2, len(frame) - 1}):
            if position >= len(frame):
                continue
            for bit in (0, 7):
                bad = list(frames)
                mutated = bytearray(frame)
                mutated[position] ^= 1 << bit
                bad[index] = bytes(mutated)
                expected = Reason.BAD_TAG
                if index == 0 and position < len(MAGIC):
                    expected = Reason.BAD_MAGIC
                elif index == 0 and position == len(MAGIC):
                    expected = Reason.BAD_VERSION
                assert reason(bad) == expected, (index, position, bit)


def test_truncated_and_resplit_frames_are_refused():
    frames = valid_frames()
    assert reason(frames[:-1]) == Reason.BAD_TAG                       # one buffer missing
    assert reason(frames[:1]) == Reason.FRAME_COUNT
    assert reason([*frames[:-1], frames[-1][:-1]]) == Reason.BAD_TAG   # one byte short
    assert reason([frames[0][:-1], *frames[1:]]) == Reason.BAD_MAGIC   # tag cut
    # The same bytes split differently between two frames.
    resplit = [*frames[:2], frames[2][:-1], frames[2][-1:] + frames[3], *frames[4:]]
    assert reason(resplit) == Reason.BAD_TAG
    # Authenticated but inconsistent: a buffer shorter than its declared shape.
    spec = [["x", "int64", [4], 32]]
    assert reason(forge(header(arrays=spec), [bytes(24)])) == Reason.SIZE_MISMATCH
    assert reason(forge(header(arrays=spec), [])) == Reason.FRAME_COUNT


def test_extra_frames_are_refused():
    frames = valid_frames()
    assert reason([*frames, b""]) == Reason.BAD_TAG
    assert reason([*frames, b"x" * 8]) == Reason.BAD_TAG
    assert reason(forge(header(), [b"x" * 8])) == Reason.FRAME_COUNT
    assert reason([*frames, *[b""] * 20], max_arrays=8) == Reason.TOO_MANY_ARRAYS


def test_oversized_messages_are_refused_before_hashing():
    arrays = {"a": np.zeros(600, np.uint8), "b": np.zeros(425, np.uint8)}   # 1025 bytes
    frames = as_bytes(encode("k", {}, arrays, SECRET))
    assert decode(frames, SECRET, max_bytes=1025).nbytes == 1025
    assert reason(frames, max_bytes=1024) == Reason.OVERSIZED
    # Oversized and unauthenticated: the size check comes first, nothing is hashed.
    assert reason(as_bytes(encode("k", {}, arrays, OTHER)), max_bytes=1024) == Reason.OVERSIZED
    # A huge declared shape with a tiny buffer allocates nothing.
    import tracemalloc

    huge = [["x", "float32", [2**40, 2**40, 2**40], 2**63]]
    forged = forge(header(arrays=huge), [bytes(16)])
    tracemalloc.start()
    try:
        assert reason(forged) == Reason.SIZE_MISMATCH
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_garbage_and_empty_messages_are_refused():
    assert reason([]) == Reason.FRAME_COUNT
    assert reason([b""]) == Reason.FRAME_COUNT
    assert reason([os.urandom(100)]) == Reason.FRAME_COUNT
    assert reason([b"", b""]) == Reason.BAD_MAGIC
    assert reason([os.urandom(37), os.urandom(100)]) == Reason.BAD_MAGIC
    assert reason([wire.MAGIC + b"\x02" + bytes(32), b""]) == Reason.BAD_VERSION
    assert reason(forge(header(), [], prefix=wire.MAGIC + b"\x00")) == Reason.BAD_VERSION
    too_big = forge(b"\x00" * (wire.MAX_HEADER_BYTES + 1), [])
    assert reason(too_big) == Reason.HEADER_TOO_LARGE


@pytest.mark.parametrize("bomb", [
    b"\x91" * 60_000 + b"\xc0",                  # nested sixty thousand deep
    b"\xdd\xff\xff\xff\xff",                     # an array declaring 4 billion items
    b"\xdf\xff\xff\xff\xff",                     # a map declaring 4 billion pairs
    b"\xdb\xff\xff\xff\xff" + b"x" * 10,         # a 4 GiB string
    b"\xc6\xff\xff\xff\xff",                     # a 4 GiB bin
    b"\xc7\x01\x05a",                            # an ext type
    b"\xd6\xff\x00\x00\x00\x00",                 # a timestamp (ext -1)
    b"\xc1",                                     # never used
    b"\xa2\xff\xfe",                             # a str that is not UTF-8
    header() + b"\xc0",                          # trailing bytes
], ids=["deep", "array32", "map32", "str32", "bin32", "ext", "timestamp", "c1", "utf8",
        "trailing"])
def test_msgpack_bombs_are_refused(bomb: bytes):
    # The CPU time of this thread, not wall time: a bomb must be cheap to refuse, and a
    # busy machine (other test workers) must not fail the test.
    start = time.thread_time()
    assert reason(forge(bomb, [])) == Reason.BAD_HEADER
    assert time.thread_time() - start < 0.1


@pytest.mark.parametrize("obj", [
    [1, 2, 3],
    {"kind": "k", "meta": {}},
    {"kind": "k", "meta": {}, "arrays": [], "more": 1},
    {"kind": "", "meta": {}, "arrays": []},
    {"kind": 3, "meta": {}, "arrays": []},
    {"kind": "k", "meta": [], "arrays": []},
    {"kind": "k", "meta": {b"raw": 1}, "arrays": []},
    {"kind": "k", "meta": {"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}, "arrays": []},
    {"kind": "k", "meta": {}, "arrays": {}},
    {"kind": "k", "meta": {}, "arrays": [["x", "uint8", [1]]]},
    {"kind": "k", "meta": {}, "arrays": ["x"]},
])
def test_wrong_typed_headers_are_refused(obj):
    arrays = obj.get("arrays") if isinstance(obj, dict) else None
    buffers = [b"\x00"] * len(arrays) if isinstance(arrays, list) else []
    assert reason(forge(msgpack.packb(obj), buffers)) == Reason.BAD_HEADER


@pytest.mark.parametrize("spec, expected", [
    (["x", "float64", [1], 8], Reason.BAD_DTYPE),
    (["x", "bfloat16", [1], 2], Reason.BAD_DTYPE),
    (["x", 5, [1], 8], Reason.BAD_DTYPE),
    (["x", "int64", [-1], 8], Reason.BAD_SHAPE),
    (["x", "int64", [True], 8], Reason.BAD_SHAPE),
    (["x", "int64", [1.0], 8], Reason.BAD_SHAPE),
    (["x", "int64", 1, 8], Reason.BAD_SHAPE),
    (["x", "int64", [1] * 17, 8], Reason.BAD_SHAPE),
    (["x", "int64", [1], 16], Reason.SIZE_MISMATCH),
    (["x", "int64", [2], 8], Reason.SIZE_MISMATCH),
    (["x", "int64", [1], True], Reason.SIZE_MISMATCH),
    (["", "int64", [1], 8], Reason.BAD_HEADER),
])
def test_bad_array_specs_are_refused(spec, expected):
    assert reason(forge(header(arrays=[spec]), [bytes(8)])) == expected


def test_duplicate_array_names_are_refused():
    spec = ["x", "uint8", [1], 1]
    assert reason(forge(header(arrays=[spec, spec]), [b"a", b"b"])) == Reason.BAD_HEADER


def test_fuzzed_authenticated_headers_only_ever_raise_wire_errors():
    rng = random.Random(7)
    base = header("k", {"step": 1, "sizes": [1, 2]},
                  [["x", "int64", [2], 16], ["y", "uint8", [3], 3]])
    buffers = [bytes(16), bytes(3)]
    outcomes: Counter[str] = Counter()
    for _ in range(2000):
        mutated = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            position = rng.randrange(len(mutated))
            if what < 0.6:
                mutated[position] = rng.randrange(256)
            elif what < 0.8:
                del mutated[position]
            else:
                mutated.insert(position, rng.randrange(256))
        try:
            decode(forge(bytes(mutated), buffers), SECRET)
            outcomes["ok"] += 1
        except WireError as err:
            assert err.reason != Reason.UNEXPECTED
            outcomes[err.reason] += 1
    assert outcomes[Reason.BAD_HEADER] > 0 and len(outcomes) >= 4, outcomes


# --- addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5555", "tcp://10.1.2.3:1", "tcp://node-17.cluster:65535",
    "tcp://[::1]:5555", "ipc:///tmp/job/feed0", "ipc://@abstract"])
def test_exact_addresses_are_accepted(address: str):
    assert check_address(address) == address


@pytest.mark.parametrize("address", [
    "tcp://*:5555", "tcp://0.0.0.0:5555", "tcp://[::]:5555", "tcp://[0:0::0]:5555"])
def test_wildcard_hosts_need_allow_wildcard(address: str):
    with pytest.raises(ValueError, match="every interface"):
        check_address(address)
    assert check_address(address, allow_wildcard=True) == address


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:*", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://127.0.0.1",
    "tcp://:5555", "tcp://127.0.0.1:5555;10.0.0.1:5555", "tcp://bad host:1", "ipc://*",
    "ipc://", "udp://127.0.0.1:5555", "inproc://x", "127.0.0.1:5555", "tcp://[::1:5555"])
def test_inexact_addresses_are_refused(address: str):
    with pytest.raises(ValueError):
        check_address(address, allow_wildcard=True)


def test_receiver_refuses_a_wildcard_bind():
    with pytest.raises(ValueError, match="allow_wildcard"):
        Receiver("tcp://*:5555", SECRET)
    with pytest.raises(ValueError, match="allow_wildcard"):
        Receiver("tcp://0.0.0.0:5555", SECRET)
    with pytest.raises(ValueError, match="allow_wildcard"):
        Publisher("tcp://0.0.0.0:5555", SECRET)


def test_receiver_binds_a_wildcard_when_asked():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Receiver(f"tcp://0.0.0.0:{port}", SECRET, allow_wildcard=True) as receiver:
        with Sender(f"tcp://127.0.0.1:{port}", SECRET) as sender:
            assert sender.send("k", {"i": 1})
            assert receiver.recv(5.0).meta == {"i": 1}


def test_a_bind_waits_for_a_port_in_use_to_be_released(monkeypatch):
    base = wire.free_port_base(2)
    assert base + 2 <= wire.ephemeral_ports()[0]
    holder = socket.socket()
    holder.bind(("127.0.0.1", base))
    holder.listen()
    threading.Timer(0.6, holder.close).start()
    start = time.monotonic()
    with Receiver(f"tcp://127.0.0.1:{base}", SECRET) as receiver:   # waits, then binds
        assert time.monotonic() - start >= 0.5
        with Sender(receiver.address, SECRET) as sender:
            assert sender.send("k", {"i": 1})
            assert receiver.recv(5.0).meta == {"i": 1}
    monkeypatch.setattr(wire, "BIND_WAIT_S", 0.3)
    with socket.socket() as holder:                 # held for good: a clear error
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        with pytest.raises(OSError, match="another job on this address"):
            Receiver(f"tcp://127.0.0.1:{base + 1}", SECRET)


# --- live sockets --------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # ipc paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="dtw", dir="/tmp") as path:
        yield Path(path)


def open_receiver(transport: str, short_dir: Path, **options) -> Receiver:
    if transport == "ipc":
        return Receiver(f"ipc://{short_dir}/feed", SECRET, **options)
    return Receiver.on_free_port(SECRET, **options)


def hostile_stream(max_bytes: int, max_arrays: int) -> tuple[list[tuple[list, Reason | None]],
                                                              Counter[str]]:
    """Valid messages (meta i = 0, 1, ...) interleaved with hostile ones, ending valid."""
    good = iter(range(1000))

    def valid() -> tuple[list, None]:
        i = next(good)
        return encode("sample", {"i": i}, sample(i), SECRET), None

    flipped = valid_frames()
    flipped[3] = bytes([flipped[3][0] ^ 1]) + flipped[3][1:]
    frames = valid_frames()
    hostile = [
        (encode("sample", {"i": -1}, sample(), OTHER), Reason.BAD_TAG),
        (flipped, Reason.BAD_TAG),
        (frames[:-1], Reason.BAD_TAG),
        ([*frames, b"extra"], Reason.BAD_TAG),
        (encode("big", {}, {"x": np.zeros(max_bytes + 1, np.uint8)}, SECRET), Reason.OVERSIZED),
        (forge(header(arrays=[["x", "uint8", [2**40, 2**40], 2**63]]), [b"x"]),
         Reason.SIZE_MISMATCH),
        ([os.urandom(64)], Reason.FRAME_COUNT),
        ([b""], Reason.FRAME_COUNT),
        ([os.urandom(37), os.urandom(500)], Reason.BAD_MAGIC),
        ([wire.MAGIC + b"\x07" + bytes(32), b""], Reason.BAD_VERSION),
        (forge(b"\x91" * 50_000 + b"\xc0", []), Reason.BAD_HEADER),
        (forge(b"\xdd\xff\xff\xff\xff", []), Reason.BAD_HEADER),
        ([*frames, *[b""] * (max_arrays * 3)], Reason.TOO_MANY_ARRAYS),
        (forge(header(arrays=[["x", "float64", [1], 8]]), [bytes(8)]), Reason.BAD_DTYPE),
        (forge(header(arrays=[["x", "int64", [-1], 8]]), [bytes(8)]), Reason.BAD_SHAPE),
    ]
    stream: list[tuple[list, Reason | None]] = []
    for message in hostile:
        stream += [valid(), message]
    stream.append(valid())
    return stream, Counter(str(expected) for _, expected in hostile)


@contextmanager
def pushing(address: str, messages: list[list]) -> Iterator[None]:
    """A raw zmq PUSH socket in a thread sends ``messages`` in order while the block runs.

    It stays open until the block ends: over ipc, libzmq 4.3 drops what a closed socket
    still queues, linger or not (zeromq/libzmq#4660).
    """
    done = threading.Event()

    def run() -> None:
        push = raw_socket(zmq.PUSH)
        try:
            push.connect(address)
            for frames in messages:
                push.send_multipart(frames, copy=False)
            done.wait(10.0)
        finally:
            push.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10.0)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_live_receiver_delivers_valid_messages_in_order_and_drops_hostile_ones(
        transport: str, short_dir: Path, caplog):
    caplog.set_level(logging.DEBUG, logger="dtdsl.feed.wire")
    with open_receiver(transport, short_dir, max_bytes=4096, max_arrays=8) as receiver:
        stream, expected_drops = hostile_stream(receiver.max_bytes, receiver.max_arrays)
        num_valid = sum(expected is None for _, expected in stream)
        got = []
        with pushing(receiver.address, [frames for frames, _ in stream]):
            while len(got) < num_valid:
                message = receiver.recv(timeout_s=5.0)
                assert message is not None, f"stalled after {len(got)}: {receiver.dropped}"
                got.append(message)
        assert [m.meta["i"] for m in got] == list(range(num_valid))
        for message in got:
            for name, array in sample(message.meta["i"]).items():
                np.testing.assert_array_equal(message.arrays[name], array)
        assert receiver.dropped == expected_drops
        assert receiver.received == num_valid
        # The queue is empty now: recv keeps its timeout.
        start = time.monotonic()
        assert receiver.recv(timeout_s=0.2) is None
        assert 0.15 <= time.monotonic() - start < 1.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(expected_drops)        # once per reason


def test_live_receiver_keeps_its_timeout_under_a_flood_of_bad_messages():
    with Receiver.on_free_port(SECRET, max_bytes=1 << 20) as receiver:
        stop = threading.Event()

        def flood() -> None:
            push = raw_socket(zmq.PUSH)
            push.connect(receiver.address)
            bad = as_bytes(encode("k", {}, {"x": np.zeros(100_000, np.uint8)}, OTHER))
            while not stop.is_set():
                try:
                    push.send_multipart(bad, flags=zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            push.close(linger=0)

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        try:
            for timeout_s in (0.0, 0.3):
                start = time.monotonic()
                assert receiver.recv(timeout_s) is None
                assert time.monotonic() - start < timeout_s + 0.5   # slack: shared cores
            assert receiver.dropped[Reason.BAD_TAG] >= 1
        finally:
            stop.set()
            thread.join(5.0)


def test_live_receiver_survives_a_frame_over_maxmsgsize():
    with Receiver.on_free_port(SECRET, max_bytes=4096) as receiver:
        # Over MAXMSGSIZE zmq itself cuts the peer off: nothing reaches recv.
        with pushing(receiver.address, [[os.urandom(4 * wire.MAX_HEADER_BYTES)]]):
            assert receiver.recv(0.3) is None
        with Sender(receiver.address, SECRET) as sender:
            assert sender.send("k", {"after": True}, sample())
            message = receiver.recv(5.0)
        assert message is not None and message.meta == {"after": True}


def test_sender_to_receiver_is_zero_copy_on_receipt():
    with Receiver.on_free_port(SECRET) as receiver, Sender(receiver.address, SECRET) as sender:
        image = np.random.default_rng(0).integers(0, 255, (3, 256, 256), dtype=np.uint8)
        assert sender.send("k", {}, {"image": image, "ids": torch.arange(100)})
        message = receiver.recv(5.0)
        assert isinstance(message, Message)
        np.testing.assert_array_equal(message.arrays["image"], image)
        assert not message.arrays["image"].flags.owndata
        assert not message.arrays["image"].flags.writeable
        tensor = message.tensor("image")
        assert tensor.data_ptr() == message.arrays["image"].ctypes.data    # no copy
        tensor[0, 0, 0] = 7                                                # and writable
        assert torch.equal(message.tensor("ids"), torch.arange(100))


def test_sender_gives_up_when_nobody_takes_the_message(short_dir: Path):
    with Sender(f"ipc://{short_dir}/nobody", SECRET, hwm=1, linger_s=0.0) as sender:
        for i in range(50):          # a few may queue before the high-water mark is reached
            start = time.monotonic()
            if not sender.send("k", {"i": i}, sample(), timeout_s=0.05):
                assert 0.04 <= time.monotonic() - start < 1.0
                break
        else:
            pytest.fail("send never timed out")
    assert sender.closed


def test_publisher_announces_the_latest_step():
    with Publisher.on_free_port(SECRET) as publisher, \
            Subscriber(publisher.address, SECRET) as subscriber:
        assert subscriber.latest() is None
        deadline = time.monotonic() + 5.0
        while subscriber.latest(timeout_s=0.01) is None:     # zmq's slow joiner
            publisher.publish("progress", {"step": 0})
            assert time.monotonic() < deadline
        for step in range(1, 6):
            publisher.publish("progress", {"step": step})
        deadline = time.monotonic() + 5.0
        while subscriber.latest().meta["step"] != 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert subscriber.latest().meta["step"] == 5          # stays the answer
        assert subscriber.dropped == Counter()


def test_subscriber_drops_hostile_announcements():
    pub = raw_socket(zmq.PUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        with Subscriber(f"tcp://127.0.0.1:{port}", SECRET) as subscriber:
            deadline = time.monotonic() + 5.0
            while subscriber.latest(timeout_s=0.01) is None:
                pub.send_multipart(encode("progress", {"step": 0}, {}, SECRET))
                assert time.monotonic() < deadline
            pub.send_multipart([b"garbage"])
            pub.send_multipart(encode("progress", {"step": 99}, {}, OTHER))
            pub.send_multipart(encode("progress", {"step": 1}, {}, SECRET))
            pub.send_multipart(forge(b"\xc1", []))
            deadline = time.monotonic() + 5.0
            while sum(subscriber.dropped.values()) < 3:
                assert time.monotonic() < deadline
                subscriber.latest()
                time.sleep(0.01)
            assert subscriber.latest().meta["step"] == 1
            assert subscriber.dropped == Counter({"frame_count": 1, "bad_tag": 1,
                                                  "bad_header": 1})
    finally:
        pub.close(linger=0)


# --- the secret file -----------------------------------------------------------------------


def test_new_secrets_are_random_and_round_trip_as_text():
    first, second = new_secret(), new_secret()
    assert len(first) == wire.SECRET_BYTES and first != second
    assert secret_from_text(secret_to_text(first) + "\n") == first
    with pytest.raises(ValueError, match="not hex"):
        secret_from_text("zz" * 32)
    with pytest.raises(ValueError, match="64 hex digits"):
        secret_from_text("ab" * 16)


def test_secret_files_are_private(tmp_path: Path):
    path = tmp_path / "job.secret"
    path.write_text("old")
    path.chmod(0o644)
    secret = new_secret()
    assert write_secret(path, secret) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600       # even over a readable file
    assert read_secret(path) == secret
    assert [p.name for p in tmp_path.iterdir()] == ["job.secret"]
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_secret(path)
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="0640"):
        read_secret(path)


def test_a_bug_in_decode_drops_the_message_instead_of_raising(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    with Receiver.on_free_port(SECRET) as receiver, Sender(receiver.address, SECRET) as sender:
        monkeypatch.setattr(wire, "decode", broken)
        assert sender.send("k", {}, sample())
        assert receiver.recv(0.3) is None
        assert receiver.dropped == Counter({"unexpected": 1})
    assert "failed unexpectedly" in caplog.text and "a bug" in caplog.text


_ATTACK = """
import sys, time, zmq
address, password = sys.argv[1], sys.argv[2]
push = zmq.Context.instance().socket(zmq.PUSH)
if password:
    push.plain_username, push.plain_password = b"dtdsl", password.encode()
push.connect(address)
frame = bytes(8 << 20)
push.send_multipart([frame] * 60, copy=False)   # 480 MiB in one message
time.sleep(3.0)
"""


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("password", ["", "wrong", "token of another job"])
def test_a_peer_without_the_secret_gets_nothing_buffered(transport, password, short_dir,
                                                         caplog):
    import subprocess
    import sys

    caplog.set_level(logging.WARNING, logger="dtdsl.feed.wire")
    if password == "token of another job":
        password = wire.peer_token(OTHER).decode()
    with open_receiver(transport, short_dir, max_bytes=1 << 30,
                       max_arrays=64) as receiver:
        before = _rss_mib()
        attack = subprocess.Popen([sys.executable, "-c", _ATTACK, receiver.address, password])
        try:
            # A peer with credentials is refused by the gate (counted); one without any by
            # libzmq at the greeting (not counted): give it the time to send.
            deadline = time.monotonic() + (20.0 if password else 2.0)
            while time.monotonic() < deadline and not (password and receiver.refused):
                assert receiver.recv(timeout_s=0.1) is None
            assert (receiver.refused >= 1) == bool(password)
            assert receiver.recv(timeout_s=1.0) is None
            # zmq read nothing of the 480 MiB message: the connection was refused first.
            assert _rss_mib() - before < 64
        finally:
            attack.kill()
            attack.wait()
        assert receiver.dropped == Counter()
        refusals = [r for r in caplog.records if "does not hold the job secret" in r.message]
        assert len(refusals) == (1 if password else 0)
        # The job's own peers still get through.
        with Sender(receiver.address, SECRET) as sender:
            assert sender.send("k", {"after": True}, sample())
            message = receiver.recv(5.0)
        assert message is not None and message.meta == {"after": True}


def test_wire_sockets_need_a_wire_context():
    zmq.Context.instance()      # a plain context's singleton first (pyzmq keeps it per class)
    assert isinstance(wire.WireContext.instance(), wire.WireContext)
    with Receiver.on_free_port(SECRET) as receiver:
        assert receiver.refused == 0
    with pytest.raises(TypeError, match="WireContext"):
        Receiver.on_free_port(SECRET, context=zmq.Context.instance())
    context = wire.bounded_context(4)
    try:
        with Receiver.on_free_port(SECRET, context=context) as receiver:
            assert receiver.refused == 0
    finally:
        context.term()      # stops the gate's thread first; does not hang


def test_term_stops_the_gate_without_waiting_out_its_poll(monkeypatch):
    # The gate's thread polls in intervals; term() interrupts its poll rather than waiting
    # for the interval to end (a dry run stops two gates per node). An interval of ten
    # minutes: a term() that waited for it would still be waiting.
    monkeypatch.setattr(wire._Gate, "POLL_MS", 600_000)
    context = wire.bounded_context(4)
    with Receiver.on_free_port(SECRET, context=context) as receiver:
        assert receiver.refused == 0
    gate = context.gate()._thread
    done = threading.Thread(target=context.term, daemon=True)
    done.start()
    done.join(60)
    assert not done.is_alive() and not gate.is_alive()
