"""The preprocessing transport: authenticated tensor messages over pyzmq, no pickle.

A message is one zmq multipart message:

- frame 0: ``PREFIX`` (``b"DTDW"`` and the format version byte) followed by the 32-byte
  HMAC-SHA256 tag, keyed with the job's secret, over: the prefix; the number N of frames
  after frame 0 and their N lengths (N + 1 little-endian uint64); then those frames' bytes
  in order. With every length in it, frames cannot be re-split, dropped or appended
  without breaking the tag;
- frame 1: a msgpack header ``{"kind": str, "meta": {...}, "arrays": [[name, dtype, shape,
  nbytes], ...]}``; ``meta`` holds plain data only (None, bool, int, float, str, bytes,
  lists, maps with str keys);
- frames 2..: one raw little-endian C-order buffer per array, in header order.

Receiving checks, in this order, so that the expensive or risky steps only ever see bytes
that passed the cheap ones: frame count and sizes (no hashing of oversized input), the tag
with ``hmac.compare_digest`` (no msgpack parsing of unauthenticated bytes), the header with
msgpack's length limits and no ext types, then every array's dtype, shape and size. Any
failure is a ``WireError`` with a ``Reason``; ``Receiver`` and ``Subscriber`` count it, log
the first of each reason and drop the message: a hostile or broken peer can never crash a
trainer, and never make ``recv`` wait past its timeout.

Dtypes: ``uint8, int32, int64, float16, float32`` (``DTYPES``). Left out on purpose:

- ``bfloat16``: numpy has no bfloat16, so a decoded array would have to pose as uint16 and
  every reader of ``Message.arrays`` would have to know; workers produce uint8 images, int64
  tokens and float32 latents, and casting to bf16 after the host-to-device copy costs nothing.
  Adding it later is safe: receivers of this version reject it as ``bad_dtype``;
- ``bool``: a raw byte other than 0 or 1 is not a valid numpy/torch bool; send masks as uint8;
- ``float64``/``object`` and the rest: nothing the workers produce needs them.

Zero copy: ``encode`` hands out memoryviews over the arrays' own memory (a non-contiguous
array or tensor is copied once into C order), and zmq sends large frames straight from them,
so **do not write into an array after sending it** (the bytes on the wire would no longer
match the tag, and the receiver drops the message). ``decode`` returns read-only numpy views
over the received frames; ``Message.tensor`` gives a writable torch tensor that shares the
frame's memory when the frame is the message's own (as zmq frames are) and copies once
otherwise.

Sockets: ``Receiver`` (PULL, binds) and ``Sender`` (PUSH, connects) carry samples;
``Publisher`` (PUB, binds) and ``Subscriber`` (SUB, connects) carry small control messages
such as "trainer progress: step k". Binding takes one exact address (``tcp://HOST:PORT``
or ``ipc://PATH``); wildcard hosts and ports are refused unless asked for explicitly.
One socket object belongs to one thread (zmq sockets are not thread-safe).

Peers are authenticated before zmq reads a byte of their messages: a receiving socket
(``Receiver``, ``Subscriber``) is a ZMTP PLAIN server, and its context's ZAP handler
(``WireContext``'s gate, one thread per context) admits only a client whose password is a
token derived from the job secret (HMAC-SHA256 of a fixed label, never the secret
itself); sending sockets present it. zmq buffers a multipart message whole before
``recv`` sees any of it, and counts its frame limit (``zmq.MAXMSGSIZE``) per frame, so
checking message 0's tag first could not stop a peer from making a receiver hold
hundreds of MiB; refusing the connection does. A refused peer is counted
(``refused``) and logged once per receiver. The token travels in clear (PLAIN does not
encrypt), like the payload: over ``ipc://`` in a private directory, as bundles use, only
the job's user can see it; over TCP the network must be the job's.

What this does not do: it does not stop replays (a recorded valid message sent again is
valid again), and does not hide the payload (no encryption). An authenticated peer's
message is bounded per frame by ``zmq.MAXMSGSIZE`` and in total by ``max_bytes``, which
``decode`` checks before hashing anything.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq

from dtdsl.feed.message import (
    DEFAULT_MAX_ARRAYS,
    DEFAULT_MAX_BYTES,
    DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    SECRET_BYTES,
    VERSION,
    Message,
    Reason,
    WireError,
    _check_secret,
    decode,
    encode,
    new_secret,
    read_secret,
    secret_from_text,
    secret_to_text,
    write_secret,
)

__all__ = [
    "BIND_WAIT_S",
    "DEFAULT_HWM",
    "DEFAULT_MAX_ARRAYS",
    "DEFAULT_MAX_BYTES",
    "DTYPES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREFIX",
    "SECRET_BYTES",
    "VERSION",
    "Message",
    "Publisher",
    "Reason",
    "Receiver",
    "Sender",
    "Subscriber",
    "WireContext",
    "WireError",
    "bounded_context",
    "check_address",
    "decode",
    "encode",
    "ephemeral_ports",
    "free_port_base",
    "new_secret",
    "peer_token",
    "read_secret",
    "secret_from_text",
    "secret_to_text",
    "write_secret",
]

_log = logging.getLogger(__name__)

DEFAULT_HWM = 16                             # messages queued per socket before back-pressure
BIND_WAIT_S = 30.0                           # how long a bind waits for a port in use


# --- addresses ---------------------------------------------------------------------------


def check_address(address: str, *, allow_wildcard: bool = False) -> str:
    """``address`` unchanged if it names exactly one endpoint, else ``ValueError``.

    Accepted: ``tcp://HOST:PORT`` (HOST an IP, ``[IPv6]`` or a name; PORT 1..65535) and
    ``ipc://PATH``. Refused: wildcard hosts (``*``, ``0.0.0.0``, ``[::]``) unless
    ``allow_wildcard``, and always wildcard or ephemeral ports (``*``, ``0``), ``ipc://*``,
    zmq's ``source;destination`` form and other schemes.
    """
    scheme, sep, rest = address.partition("://") if isinstance(address, str) else ("", "", "")
    if not sep:
        raise ValueError(f"{address!r} is not an endpoint: write tcp://HOST:PORT or "
                         "ipc://PATH")
    if scheme == "ipc":
        if not rest or rest == "*":
            raise ValueError(f"{address!r}: name the socket file, e.g. ipc:///run/job/feed0")
        return address
    if scheme != "tcp":
        raise ValueError(f"{address!r}: the transport is tcp:// or ipc://, not {scheme}://")
    host, colon, port = rest.rpartition(":")
    if ";" in rest or not colon or not host:
        raise ValueError(f"{address!r} is not tcp://HOST:PORT")
    if not port.isdecimal() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: the port must be one number in 1..65535 (a test "
                         "that needs a free port uses Receiver.on_free_port)")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare == "*":
        wildcard = True
    else:
        try:
            wildcard = ipaddress.ip_address(bare).is_unspecified
        except ValueError:
            if bare != host or not _HOST_NAME.fullmatch(host):
                raise ValueError(f"{address!r}: {host!r} is not an IP address or host "
                                 "name") from None
            wildcard = False
    if wildcard and not allow_wildcard:
        raise ValueError(f"{address!r} listens on every interface; bind the one address "
                         "the plan names (e.g. tcp://10.0.0.5:5555), or pass "
                         "allow_wildcard=True if that is really meant")
    return address


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux; the IANA range
    elsewhere). A listening port inside it may be taken by any connection before it is
    bound, and a peer that keeps connecting to it before it is bound may connect to itself."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port_base(span: int, host: str = "127.0.0.1", *, low: int = 20000) -> int:
    """A port P with P .. P + span - 1 all free on ``host`` now, below the ephemeral range
    (best effort: probed, then released). For tests and benchmarks that launch a job."""
    top = min(ephemeral_ports()[0], 65536) - span
    if top <= low:
        raise RuntimeError(f"no room for {span} ports between {low} and the ephemeral range")
    rng = secrets.SystemRandom()
    for _ in range(100):
        base = rng.randrange(low, top)
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + span):
                probe = socket.socket()
                probes.append(probe)
                probe.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"found no {span} free ports in a row on {host}")


def _needs_ipv6(address: str) -> bool:
    return address.startswith("tcp://[")


# --- sockets -----------------------------------------------------------------------------


def peer_token(secret: bytes) -> bytes:
    """The PLAIN password of a peer that holds ``secret`` (hex of an HMAC of a fixed label:
    seeing it on the wire tells nothing about the secret)."""
    return hmac.new(_check_secret(secret), b"dtdsl-wire-peer-v1", "sha256").hexdigest().encode()



class _Gate:
    """A context's ZAP handler: admits a PLAIN client whose password is the token of the
    receiving socket's domain, refuses (and counts, and logs once per domain) any other
    PLAIN client. A peer that offers no credentials at all never gets this far: libzmq
    closes a connection whose mechanism is not PLAIN at the greeting. One thread; its
    REP socket is one of the context's sockets."""

    ENDPOINT = "inproc://zeromq.zap.01"     # where libzmq asks (ZMQ RFC 27)
    POLL_MS = 200

    def __init__(self, context: zmq.Context) -> None:
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.ENDPOINT)
        self._tokens: dict[bytes, bytes] = {}
        self.refused: Counter[bytes] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dtdsl-zap", daemon=True)
        self._thread.start()

    def allow(self, domain: bytes, token: bytes) -> None:
        self._tokens[domain] = token

    def forget(self, domain: bytes) -> None:
        self._tokens.pop(domain, None)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(self.POLL_MS, zmq.POLLIN):
                    self._socket.send_multipart(self._answer(self._socket.recv_multipart()))
        except zmq.ContextTerminated:
            pass        # the context's term(): it waits for this socket to close
        finally:
            self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id = (request + [b"", b""])[:2]
        ok = (len(request) == 8 and version == b"1.0" and request[5] == b"PLAIN" and
              request[2] in self._tokens and request[6] == b"dtdsl" and
              hmac.compare_digest(request[7], self._tokens[request[2]]))
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"dtdsl", b""]
        domain = request[2] if len(request) > 2 else b""
        self.refused[domain] += 1
        if self.refused[domain] == 1:
            address = request[3].decode(errors="replace") if len(request) > 3 else "?"
            _log.warning("refused a peer (%s) that does not hold the job secret; nothing "
                         "it sends is read (further refusals are counted, not logged)",
                         address or "a local peer")
        return [b"1.0", request_id, b"400", b"not a peer of this job", b"", b""]

    def stop(self) -> None:
        """Stop the thread and wait for it: up to ``POLL_MS`` (the context's ``term``
        does not wait; ``destroy`` does)."""
        self._stop.set()
        self._thread.join()

    def stop_in_term(self, term: Callable[[], None]) -> None:
        """Stop the thread as ``term`` (its context's) terminates the context: the thread's
        poll then returns at once (ETERM), where ``stop`` would wait out ``POLL_MS``
        (a dry run of a thousand-rank job stops a gate per node twice)."""
        self._stop.set()
        term()
        self._thread.join()


class WireContext(zmq.Context):
    """A zmq context whose receiving sockets admit only peers that hold their secret
    (module docstring): ``gate`` starts its ZAP handler with the first one. Every socket
    of this module lives in one (``WireContext.instance()`` by default)."""

    _gate: _Gate | None = None      # a class attribute: pyzmq lets instances set it
    # ``instance()``'s singleton of this class: pyzmq keeps it in class attributes, and
    # without these it would find zmq.Context's own (a plain context) when that exists.
    _instance: WireContext | None = None
    _instance_pid: int | None = None
    _instance_lock = threading.Lock()

    def gate(self) -> _Gate:
        if self._gate is None:
            self._gate = _Gate(self)
        return self._gate

    def _stop_gate(self) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None

    def term(self) -> None:
        gate, self._gate = self._gate, None
        if gate is None:
            super().term()
        else:
            gate.stop_in_term(super().term)

    def destroy(self, linger: int | None = None) -> None:
        self._stop_gate()
        super().destroy(linger)


def bounded_context(max_sockets: int) -> WireContext:
    """A new ``WireContext`` that refuses more than ``max_sockets`` sockets (zmq's default
    is 1023; a context with a receiving socket holds one more, its ZAP handler's): a
    process that should open a handful fails loudly at the first one too many instead of
    running into the descriptor limit somewhere else. Terminate it when done."""
    if max_sockets < 1:
        raise ValueError("max_sockets must be at least 1")
    context = WireContext()
    context.set(zmq.MAX_SOCKETS, max_sockets)
    return context



class _Socket:
    """A zmq socket with the job secret; closes once, works as a context manager."""

    def __init__(self, socket_type: int, secret: bytes, context: zmq.Context | None,
                 linger_s: float) -> None:
        self._secret = _check_secret(secret)
        self._linger_s = linger_s
        context = WireContext.instance() if context is None else context
        if not isinstance(context, WireContext):
            raise TypeError("a wire socket needs a WireContext (wire.bounded_context(n)), "
                            f"not a {type(context).__name__}: its receivers authenticate "
                            "peers through the context's ZAP handler")
        self._context = context
        self._socket = context.socket(socket_type)
        if socket_type in (zmq.PULL, zmq.SUB):      # receives: authenticates its peers
            # A ZAP domain of its own: receivers of other secrets may share the context,
            # and refusals are counted per receiver.
            self._domain = f"dtdsl-{secrets.token_hex(8)}".encode()
            context.gate().allow(self._domain, peer_token(self._secret))
            self._socket.setsockopt(zmq.PLAIN_SERVER, 1)
            self._socket.setsockopt(zmq.ZAP_DOMAIN, self._domain)
        else:                                       # sends: shows it holds the secret
            self._socket.setsockopt(zmq.PLAIN_USERNAME, b"dtdsl")
            self._socket.setsockopt(zmq.PLAIN_PASSWORD, peer_token(self._secret))
        self.address = ""

    def _bind(self, address: str, allow_wildcard: bool) -> None:
        check_address(address, allow_wildcard=allow_wildcard)
        if _needs_ipv6(address):
            self._socket.setsockopt(zmq.IPV6, 1)
        self._bind_checked(address)

    def _bind_checked(self, address: str) -> None:
        # A port in use may be free a moment later: a restarted trainer's port can be held
        # briefly by the sockets of its dead predecessor, or by a peer's connection attempt
        # that the kernel gave that very port as its source (a TCP self-connect, possible
        # when the port lies in the ephemeral range). Wait for it, up to BIND_WAIT_S.
        deadline = time.monotonic() + BIND_WAIT_S
        warned = False
        while True:
            try:
                self._socket.bind(address)
                break
            except zmq.ZMQError as err:
                if err.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                    if not warned:
                        _log.warning("%s is in use; retrying for up to %g s", address,
                                     BIND_WAIT_S)
                        warned = True
                    time.sleep(0.2)
                    continue
                self._socket.close(linger=0)
                hint = (" (another job on this address?)"
                        if err.errno == zmq.EADDRINUSE else "")
                raise OSError(f"cannot bind {address}: {err}{hint}") from err
        self.address = address

    def _bind_free_port(self, host: str) -> None:
        check_address(f"tcp://{host}:1")
        if _needs_ipv6(f"tcp://{host}"):
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as err:
            self._socket.close(linger=0)
            raise OSError(f"cannot bind a free port on {host}: {err}") from err
        self.address = f"tcp://{host}:{port}"

    def _connect(self, address: str) -> None:
        check_address(address)
        if _needs_ipv6(address):
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(address)
        self.address = address

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run."""
        return self._socket.closed

    def close(self, linger_s: float | None = None) -> None:
        """Close the socket; unsent messages get ``linger_s`` seconds to leave."""
        if not self._socket.closed:
            linger = self._linger_s if linger_s is None else linger_s
            self._socket.close(linger=round(linger * 1000))
            gate = self._context._gate
            if gate is not None and getattr(self, "_domain", None):
                gate.forget(self._domain)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Inbox(_Socket):
    """Receiving half: validates, counts and drops; never raises for bad input."""

    def __init__(self, socket_type: int, secret: bytes, *, max_bytes: int, max_arrays: int,
                 hwm: int, context: zmq.Context | None) -> None:
        if max_bytes < 0 or max_arrays < 0 or hwm < 1:
            raise ValueError("max_bytes and max_arrays must be >= 0 and hwm >= 1")
        super().__init__(socket_type, secret, context, linger_s=0.0)
        self.max_bytes = max_bytes
        self.max_arrays = max_arrays
        self.hwm = hwm
        self.received = 0
        self.dropped: Counter[str] = Counter()
        # First defence: zmq itself cuts off a peer that sends a frame larger than any
        # valid frame (it counts per frame, so total size is checked again in decode).
        self._socket.setsockopt(zmq.MAXMSGSIZE, max(max_bytes, MAX_HEADER_BYTES))
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)

    @property
    def refused(self) -> int:
        """Connections of peers with credentials that are not the secret's, refused so far
        (a peer without any is closed by libzmq before it is asked, and not counted)."""
        gate = self._context._gate
        return gate.refused[self._domain] if gate is not None else 0

    def recv(self, timeout_s: float | None = 0.0) -> Message | None:
        """The next valid message, or None if none came within ``timeout_s`` (None: wait
        for ever; 0: do not wait).

        Invalid messages are dropped and counted in ``dropped``; they never extend the wait
        past ``timeout_s``, so a None does not promise that nothing is queued (under a flood
        of bad messages, a call with timeout 0 looks at one message).
        """
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            if deadline is None:
                ready = self._socket.poll(None, zmq.POLLIN)
            else:
                remaining = deadline - time.monotonic()
                ready = self._socket.poll(max(0, math.ceil(remaining * 1000)), zmq.POLLIN)
            if not ready:
                return None
            frames = self._recv_frames()
            if frames:
                try:
                    message = decode(frames, self._secret, max_bytes=self.max_bytes,
                                     max_arrays=self.max_arrays)
                except WireError as err:
                    self._drop(err, frames[0])
                except Exception as err:  # a decode bug must not take the trainer down either
                    if not self.dropped[Reason.UNEXPECTED]:
                        _log.error("decoding a message failed unexpectedly", exc_info=True)
                    self._drop(WireError(Reason.UNEXPECTED, repr(err)), frames[0])
                else:
                    self.received += 1
                    return message
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _recv_frames(self) -> list[zmq.Frame]:
        try:
            first = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return []
        frames = [first]
        more = first.more
        keep = self.max_arrays + 3   # one frame beyond the limit: decode reports it
        while more:
            # zmq delivers a multipart message whole: the rest is here, these never block.
            frame = self._socket.recv(copy=False)
            more = frame.more
            if len(frames) < keep:
                frames.append(frame)
        return frames

    def _drop(self, err: WireError, first: zmq.Frame) -> None:
        self.dropped[str(err.reason)] += 1
        try:
            peer = first.get("Peer-Address")   # tcp only
        except zmq.ZMQError:
            peer = None
        level = logging.WARNING if self.dropped[str(err.reason)] == 1 else logging.DEBUG
        _log.log(level, "%s dropped a message from %s: %s%s", self.address, peer or "a peer",
                 err, " (more drops for this reason are logged at debug level)"
                 if level == logging.WARNING else "")


class Receiver(_Inbox):
    """A PULL socket bound to one exact address: a trainer rank's sample inbox."""

    def __init__(self, address: str, secret: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_arrays: int = DEFAULT_MAX_ARRAYS, hwm: int = DEFAULT_HWM,
                 allow_wildcard: bool = False, context: zmq.Context | None = None) -> None:
        super().__init__(zmq.PULL, secret, max_bytes=max_bytes, max_arrays=max_arrays,
                         hwm=hwm, context=context)
        self._bind(address, allow_wildcard)

    @classmethod
    def on_free_port(cls, secret: bytes, *, host: str = "127.0.0.1",
                     max_bytes: int = DEFAULT_MAX_BYTES, max_arrays: int = DEFAULT_MAX_ARRAYS,
                     hwm: int = DEFAULT_HWM, context: zmq.Context | None = None) -> Receiver:
        """A Receiver on a free TCP port of ``host`` (zmq picks it, no race); the
        address is in ``.address``. For tests and benchmarks: a job binds the plan's."""
        self = cls.__new__(cls)
        _Inbox.__init__(self, zmq.PULL, secret, max_bytes=max_bytes, max_arrays=max_arrays,
                        hwm=hwm, context=context)
        self._bind_free_port(host)
        return self


class Sender(_Socket):
    """A PUSH socket connected to one Receiver: a worker's sample outbox.

    Messages queue (up to ``hwm``) while the receiver is not up yet; ``send`` waits at most
    ``timeout_s`` for room and returns False when there is none, so a worker never hangs on
    a dead trainer. On close, queued messages get ``linger_s`` to leave.
    """

    def __init__(self, address: str, secret: bytes, *, hwm: int = DEFAULT_HWM,
                 linger_s: float = 1.0, context: zmq.Context | None = None) -> None:
        if hwm < 1:
            raise ValueError("hwm must be >= 1")
        super().__init__(zmq.PUSH, secret, context, linger_s)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._timeout_ms: int | None = None
        self._connect(address)

    def send(self, kind: str, meta: Mapping[str, Any] | None = None,
             arrays: Mapping[str, Any] | None = None, *,
             timeout_s: float | None = 10.0) -> bool:
        """Send one message; False if the receiver did not take it within ``timeout_s``
        (None: wait for ever). Do not write into the arrays afterwards (see the module
        docstring). Raises ``TypeError``/``ValueError`` for a message a receiver would drop.
        """
        frames = encode(kind, meta, arrays, self._secret)
        timeout_ms = -1 if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        if timeout_ms != self._timeout_ms:
            self._socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            # copy=False: pyzmq sends large frames from the arrays' memory, small ones copied.
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:
            return False
        return True


class Publisher(_Socket):
    """A PUB socket bound to one exact address: trainer rank 0's control announcements.

    ``publish`` never blocks: a subscriber that falls ``hwm`` messages behind misses some,
    and one that connects late misses earlier ones (zmq's slow joiner), so announce state
    ("step k"), not events, and announce it again every step.
    """

    def __init__(self, address: str, secret: bytes, *, hwm: int = DEFAULT_HWM,
                 allow_wildcard: bool = False, context: zmq.Context | None = None) -> None:
        super().__init__(zmq.PUB, secret, context, linger_s=0.0)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._bind(address, allow_wildcard)

    @classmethod
    def on_free_port(cls, secret: bytes, *, host: str = "127.0.0.1",
                     hwm: int = DEFAULT_HWM) -> Publisher:
        """A Publisher on a free TCP port of ``host`` (see ``Receiver.on_free_port``)."""
        self = cls.__new__(cls)
        _Socket.__init__(self, zmq.PUB, secret, None, linger_s=0.0)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._bind_free_port(host)
        return self

    def publish(self, kind: str, meta: Mapping[str, Any] | None = None,
                arrays: Mapping[str, Any] | None = None) -> None:
        """Announce one message to every connected subscriber."""
        self._socket.send_multipart(encode(kind, meta, arrays, self._secret), copy=False)


class Subscriber(_Inbox):
    """A SUB socket connected to one Publisher: a worker's view of the trainer's progress."""

    def __init__(self, address: str, secret: bytes, *, max_bytes: int = 1024 * 1024,
                 max_arrays: int = 16, hwm: int = DEFAULT_HWM,
                 context: zmq.Context | None = None) -> None:
        super().__init__(zmq.SUB, secret, max_bytes=max_bytes, max_arrays=max_arrays,
                         hwm=hwm, context=context)
        self._latest: Message | None = None
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._connect(address)

    def recv(self, timeout_s: float | None = 0.0) -> Message | None:
        """The next valid announcement (as ``Receiver.recv``); it also becomes ``latest``."""
        message = super().recv(timeout_s)
        if message is not None:
            self._latest = message
        return message

    def latest(self, timeout_s: float = 0.0) -> Message | None:
        """The newest valid announcement so far; it stays the answer until a newer one.

        Reads what is queued without waiting (at most ``2 * hwm`` messages, so a flood
        cannot hold the caller); waits up to ``timeout_s`` only if nothing valid has ever
        arrived.
        """
        for _ in range(2 * self.hwm):
            if not self._socket.poll(0, zmq.POLLIN):
                break
            self.recv(0.0)
        if self._latest is None and timeout_s > 0:
            self.recv(timeout_s)
        return self._latest
