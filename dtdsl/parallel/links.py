"""Point-to-point transfers between the ranks of one host over Unix domain sockets.

gloo's TCP transport costs a CPU-only run about 0.1-0.2 ms of the sender's thread per
``isend`` and as much again on its I/O threads (a rendezvous: the receiver's notice, then
the data, each a wake-up), for messages of a few kilobytes. Between two processes on one
host a Unix stream socket carries the same bytes with one ``sendmsg`` and one
``recv_into``. ``LocalLinks`` offers gloo's point-to-point semantics for CPU tensors:

- ``isend(tensor, dst, tag)`` queues the tensor's bytes for ``dst`` and returns a work
  whose ``wait`` returns once they are written (the caller keeps the tensor unchanged
  until then, as with gloo). The calling thread writes at once what the socket takes;
  the rest goes to one background thread, so a send never blocks the caller on a peer
  that is busy elsewhere (in a collective, say);
- ``irecv(tensor, src, tag)`` posts a receive of at most ``tensor.nbytes`` bytes into
  ``tensor``; its work's ``wait`` blocks until a message from ``src`` with ``tag`` has
  arrived and returns its length (shorter messages are fine, as in gloo). Messages are
  matched by (source, tag): one that arrives before its receive is posted waits in a
  stash, one whose receive is posted is read straight into the receive's tensor.

Frames on a socket: ``int64`` tag, ``int64`` byte count, then the bytes. Each rank
listens on an abstract Unix socket (no file, gone with the process) named by a job token
that every rank of the job agrees on (``LocalLinks.create``: one collective, which also
shares every rank's process id) and its rank; a sender connects on its first message and
introduces itself with its rank. Abstract socket names are visible to every process of
the network namespace, so a connection counts only when the kernel's credentials of its
peer (``SO_PEERCRED``) show the process id of the rank it claims to be; others are
closed unread.
Receiving runs on the calling thread (inside ``wait``), which is where a rank blocks
anyway. A peer that dies closes its sockets: waiting on it raises ``ConnectionError``.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LocalLinks", "host_identity", "shared_local_links"]

_FRAME = struct.Struct("<qq")       # tag, byte count
_HELLO = struct.Struct("<q")        # the connecting rank
_SOCKET_BUFFER = 4 << 20


def host_identity() -> str:
    """What ranks that can reach each other's abstract Unix sockets share: the host (boot
    id) and the network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unlinked-{os.getpid()}"        # no /proc: link nobody
    return f"{socket.gethostname()}/{boot}/{net}"


def _address(token: str, rank: int) -> str:
    return f"\0dtdsl-{token}-{rank}"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("local links carry contiguous CPU tensors only")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and not tensor.requires_grad:
        return memoryview(tensor.numpy())       # the broker's buffers: one op, not four
    return memoryview(tensor.detach().view(-1).view(torch.uint8).numpy()).cast("B")


class _Written:
    """The work of a send the calling thread wrote whole: nothing to wait for."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


_WRITTEN = _Written()


class _SendWork:
    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise ConnectionError(f"local link send failed: {self._error}") from self._error
        return True


class _RecvWork:
    __slots__ = ("_links", "nbytes", "src", "tag", "target")

    def __init__(self, links: LocalLinks, src: int, tag: int, target: memoryview) -> None:
        self._links, self.src, self.tag, self.target = links, src, tag, target
        self.nbytes: int | None = None

    def is_completed(self) -> bool:
        return self.nbytes is not None

    def wait(self, timeout: Any = None) -> bool:
        if self.nbytes is None:
            self._links._progress(self)
        return True


class _Outbound:
    """One connection to a peer: frames waiting to be written, in order."""

    __slots__ = ("lock", "queue", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.queue: collections.deque[list[Any]] = collections.deque()  # [views, work]


class _Inbound:
    """One connection from a peer and the frame being read from it."""

    __slots__ = ("body", "got", "head", "head_got", "sock", "src", "tag", "work")

    def __init__(self, sock: socket.socket, src: int) -> None:
        self.sock, self.src = sock, src
        self.head = bytearray(_FRAME.size)
        self.head_got = 0
        self.body: memoryview | None = None     # where the current frame's bytes go
        self.got = 0
        self.tag = 0
        self.work: _RecvWork | None = None      # the receive it completes, if posted


class LocalLinks:
    """Point-to-point transfers to and from the ranks in ``peers`` (module docstring)."""

    def __init__(self, rank: int, pids: Mapping[int, int], token: str, *,
                 timeout_s: float = 1800.0) -> None:
        """``pids``: the process id of every rank to link, this one's included;
        ``timeout_s``: how long a receive waits before it raises ``TimeoutError``."""
        self.rank = rank
        self.timeout_s = timeout_s
        self.peers = frozenset(pids) - {rank}
        self._pids = dict(pids)
        self.token = token
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_address(token, rank))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._out: dict[int, _Outbound] = {}
        self._in: dict[int, _Inbound] = {}
        self._unknown: list[tuple[socket.socket, bytearray]] = []    # accepted, no hello yet
        self._gone: set[int] = set()            # peers whose connection closed
        self._posted: dict[tuple[int, int], collections.deque[_RecvWork]] = {}
        self._stash: dict[tuple[int, int], collections.deque[bytearray]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="dtdsl-links",
                                        daemon=True)
        self._writer.start()

    @classmethod
    def create(cls, rank: int, world: int) -> LocalLinks | None:
        """Links to the ranks on this host, agreed on by every rank (a collective over the
        default group: every rank calls it at the same point); None when no other rank
        shares the host."""
        import secrets

        import torch.distributed as dist

        mine = (host_identity(), os.getpid(), secrets.token_hex(8) if rank == 0 else "")
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        pids = {r: pid for r, (host, pid, _) in enumerate(every) if host == mine[0]}
        try:    # the default group's timeout, as gloo's own transfers would wait
            backend = dist.distributed_c10d._get_default_group()._get_backend(
                torch.device("cpu"))
            timeout_s = backend.options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            timeout_s = 1800.0
        links = (cls(rank, pids, every[0][2], timeout_s=timeout_s) if len(pids) > 1
                 else None)
        dist.barrier()      # every rank listens before any connects
        return links

    def links(self, peer: int) -> bool:
        """Whether transfers with ``peer`` go over these links."""
        return peer in self.peers

    # ---- sending ----------------------------------------------------------------------------

    def _connect(self, dst: int) -> _Outbound:
        out = self._out.get(dst)
        if out is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            sock.connect(_address(self.token, dst))
            sock.sendall(_HELLO.pack(self.rank))
            sock.setblocking(False)
            out = self._out[dst] = _Outbound(sock)
        return out

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _SendWork | _Written:
        """Send ``tensor``'s bytes to ``dst`` with ``tag`` (module docstring)."""
        if dst not in self.peers:
            raise ValueError(f"rank {dst} is not linked to rank {self.rank}")
        data = _bytes_of(tensor)
        views = [memoryview(_FRAME.pack(tag, len(data))), data]
        out = self._connect(dst)
        with out.lock:
            if not out.queue:
                views = _write(out.sock, views)
                if not views:
                    return _WRITTEN
            work = _SendWork()
            out.queue.append([views, work])
        with self._cond:
            self._cond.notify()
        return work

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not any(o.queue for o in list(self._out.values())):
                    self._cond.wait()
                if self._closed:
                    return
                busy = [o for o in list(self._out.values()) if o.queue]
            try:
                _, ready, _ = select.select([], [o.sock for o in busy], [], 0.5)
            except (OSError, ValueError):
                if self._closed:
                    return
                raise
            for out in busy:
                if out.sock not in ready:
                    continue
                with out.lock:
                    while out.queue:
                        item = out.queue[0]
                        try:
                            item[0] = _write(out.sock, item[0])
                        except OSError as err:
                            for _, work in out.queue:
                                work._finish(err)
                            out.queue.clear()
                            break
                        if item[0]:
                            break
                        out.queue.popleft()[1]._finish()

    # ---- receiving --------------------------------------------------------------------------

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _RecvWork:
        """Post a receive into ``tensor`` from ``src`` with ``tag`` (module docstring)."""
        if src not in self.peers:
            raise ValueError(f"rank {src} is not linked to rank {self.rank}")
        work = _RecvWork(self, src, tag, _bytes_of(tensor))
        data = _take(self._stash, (src, tag))
        if data is not None:
            _deliver(work, data)
        else:
            self._posted.setdefault((src, tag), collections.deque()).append(work)
        return work

    def _progress(self, want: _RecvWork) -> None:
        """Read from every inbound connection until ``want`` is complete."""
        deadline = time.monotonic() + self.timeout_s
        while want.nbytes is None:
            if want.src in self._gone:
                raise ConnectionError(f"rank {want.src} closed its local link (did it "
                                      "exit?)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no message from rank {want.src} "
                                   f"(tag {want.tag}) in {self.timeout_s:g} s")
            socks = [self._listener, *(i.sock for i in self._in.values()),
                     *(s for s, _ in self._unknown)]
            readable, _, _ = select.select(socks, [], [], left)
            for sock in readable:
                if sock is self._listener:
                    self._accept()
                else:
                    self._read(sock)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        sock.setblocking(False)
        self._unknown.append((sock, bytearray()))

    def _read(self, sock: socket.socket) -> None:
        for k, (s, hello) in enumerate(self._unknown):
            if s is sock:
                chunk = sock.recv(_HELLO.size - len(hello))
                if not chunk:
                    del self._unknown[k]
                    sock.close()
                    return
                hello += chunk
                if len(hello) == _HELLO.size:
                    del self._unknown[k]
                    (src,) = _HELLO.unpack(hello)
                    if (src not in self.peers or src in self._in
                            or _peer_pid(sock) != self._pids[src]):
                        sock.close()        # not the rank it claims to be: ignore it
                        return
                    self._in[src] = _Inbound(sock, src)
                return
        inbound = next(i for i in self._in.values() if i.sock is sock)
        self._pump(inbound)

    def _pump(self, i: _Inbound) -> None:
        """Read what ``i``'s socket holds now into the current frame, completing frames."""
        while True:
            try:    # a body being read is never complete here: completion clears it below
                n = i.sock.recv_into(memoryview(i.head)[i.head_got:] if i.body is None
                                     else i.body[i.got:])
            except BlockingIOError:
                return
            if i.body is None:
                if n == 0:
                    if i.head_got:
                        raise ConnectionError(f"rank {i.src} closed its local link "
                                              "mid-message")
                    # Between messages: what it sent is all here; a wait for more fails.
                    del self._in[i.src]
                    self._gone.add(i.src)
                    i.sock.close()
                    return
                i.head_got += n
                if i.head_got < _FRAME.size:
                    continue
                i.tag, size = _FRAME.unpack(i.head)
                i.head_got = 0
                i.work = _take(self._posted, (i.src, i.tag))
                if i.work is not None:      # straight into the posted receive's tensor
                    _check_fits(i.work, size)
                    i.body = i.work.target[:size]
                else:
                    i.body = memoryview(bytearray(size))
                i.got = 0
            elif n == 0:
                raise ConnectionError(f"rank {i.src} closed its local link mid-message")
            else:
                i.got += n
            if i.body is not None and i.got == len(i.body):
                if i.work is not None:
                    i.work.nbytes = len(i.body)
                else:
                    self._arrived(i.src, i.tag, i.body.obj)  # type: ignore[arg-type]
                i.body, i.work = None, None

    def _arrived(self, src: int, tag: int, data: bytearray) -> None:
        """A whole message read before its receive was known: to a receive posted since,
        or to the stash."""
        work = _take(self._posted, (src, tag))
        if work is not None:
            _deliver(work, data)
        else:
            self._stash.setdefault((src, tag), collections.deque()).append(data)

    def close(self) -> None:
        """Stop the writer and close every socket."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._writer.join(timeout=5)
        for sock in [self._listener, *(o.sock for o in self._out.values()),
                     *(i.sock for i in self._in.values()), *(s for s, _ in self._unknown)]:
            sock.close()


def _take(queues: dict[tuple[int, int], collections.deque[Any]], key: tuple[int, int]
          ) -> Any:
    """The first item queued under ``key`` (removed; an emptied queue is dropped), or None."""
    queue = queues.get(key)
    if not queue:
        return None
    item = queue.popleft()
    if not queue:
        del queues[key]
    return item


def _check_fits(work: _RecvWork, size: int) -> None:
    if size > len(work.target):
        raise ValueError(f"a message of {size} bytes from rank {work.src} (tag {work.tag}) "
                         f"does not fit the {len(work.target)}-byte receive")


def _deliver(work: _RecvWork, data: bytearray) -> None:
    """Complete ``work`` with a message read before it was posted."""
    _check_fits(work, len(data))
    work.target[:len(data)] = data
    work.nbytes = len(data)


def _peer_pid(sock: socket.socket) -> int:
    """The process id of the other end of a Unix socket, from the kernel."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", cred)[0]


def _write(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Write what the socket takes of ``views`` now; the views left."""
    views = [v for v in views if len(v)]
    while views:
        try:
            n = sock.sendmsg(views)
        except BlockingIOError:
            return views
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return views


_shared: tuple[Any, LocalLinks | None] | None = None


def shared_local_links() -> LocalLinks | None:
    """The process's links for the current default process group, created on first use
    (``LocalLinks.create``: a collective, so every rank calls this at the same point);
    None when this rank shares its host with no other. ``DTDSL_LOCAL_LINKS=0`` turns them
    off (None)."""
    global _shared
    import torch.distributed as dist

    if os.environ.get("DTDSL_LOCAL_LINKS", "1") == "0":
        return None
    world = dist.group.WORLD
    if _shared is None or _shared[0] is not world:
        if _shared is not None and _shared[1] is not None:
            _shared[1].close()
        _shared = (world, LocalLinks.create(dist.get_rank(), dist.get_world_size()))
    return _shared[1]
