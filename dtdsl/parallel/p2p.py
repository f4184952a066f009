"""Ordered point-to-point transfers: NCCL's matching rule on every backend.

NCCL matches point-to-point messages between two ranks in the order they were posted, per
direction, with no tags. Every transfer of the runtime goes through :class:`P2P`, which
keeps that rule on gloo too: the k-th message this rank sends to a peer carries the gloo
tag k, and the k-th receive posted for that peer waits for tag k, so a message can only
land in the receive that NCCL would give it. A program that works here in tests is
therefore matched the same way on GPUs.

Receivers know what they receive before they post: every receive names its tensors'
shapes and dtype (from the plan and the step's sample sizes, which every rank has), so a
message is one transfer of its bytes with no header and no round trip. The tensors of a
message travel as one contiguous byte buffer (packed by the sender, viewed by the
receiver); a message of no bytes is not sent at all (both sides know it is empty).

Sends and receives are queued and issued together by :meth:`P2P.flush` in one
``batch_isend_irecv``: consecutive communication actions of a schedule form one NCCL group,
so a send and a receive between the same two ranks in opposite directions progress
together (Megatron's ``send_forward_recv_backward``) instead of deadlocking on a shared
stream.

**Checking** (``check=True``, or ``DTDSL_P2P_CHECK=1``; on in every multi-rank test): each
message is preceded by a fixed-size descriptor (its sequence number, byte count and the
sender's label of what it is, e.g. ``llm.s0->llm.s1 F 3 r0t0``), and the receiver
compares it with the label and size it expects (on gloo before it posts the payload's
receive; on NCCL, where both receives must be in one group, before it reads the payload). A message
that in-order matching would pair with the wrong receive fails the receiver with an
:class:`OrderingError` naming both, instead of silently corrupting activations on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["OrderingError", "P2P", "Received", "TensorSpec", "check_enabled", "pack",
           "spec_of", "unpack"]

_DESC_BYTES = 256             # descriptor: 3 int64 words, then the label (UTF-8)
_DESC_MAGIC = 0x6474_7032_7032  # "dtp2p2"
_LABEL_BYTES = _DESC_BYTES - 24
_TAG_SPACE = 1 << 30


class OrderingError(RuntimeError):
    """A message would be matched with a receive meant for another message."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a receiver expects of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), t.dtype)


def check_enabled() -> bool:
    """Whether ``DTDSL_P2P_CHECK`` turns the ordering check on by default."""
    return os.environ.get("DTDSL_P2P_CHECK", "0") not in ("", "0", "false", "no")


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes, back to back, in one uint8 buffer on ``device``."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors
             if t.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([p.to(device) for p in parts])


def unpack(buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Views of ``buf`` (uint8) as the tensors ``specs`` describe, in order."""
    want = sum(s.nbytes for s in specs)
    if want != buf.numel():
        raise OrderingError(f"a buffer of {buf.numel()} bytes for tensors of {want} bytes")
    out, at = [], 0
    for s in specs:
        n = s.nbytes
        if n == 0:
            out.append(torch.empty(s.shape, dtype=s.dtype, device=buf.device))
        else:
            out.append(buf[at:at + n].view(s.dtype).view(s.shape))
        at += n
    return out


def _descriptor(seq: int, nbytes: int, label: str, device: torch.device) -> torch.Tensor:
    words = torch.tensor([_DESC_MAGIC, seq, nbytes], dtype=torch.int64)
    text = label.encode()[:_LABEL_BYTES]
    raw = torch.zeros(_DESC_BYTES, dtype=torch.uint8)
    raw[:24] = words.view(torch.uint8)
    raw[24:24 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return raw.to(device)


def _read_descriptor(raw: torch.Tensor) -> tuple[int, int, int, str]:
    data = raw.cpu()
    magic, seq, nbytes = data[:24].view(torch.int64).tolist()
    label = bytes(data[24:].tolist()).rstrip(b"\0").decode(errors="replace")
    return magic, seq, nbytes, label


@dataclass(eq=False)
class Received:
    """A posted receive: ``wait()`` gives its tensors once the batch it went out in has
    completed (after ``P2P.flush``)."""

    peer: int
    label: str
    specs: tuple[TensorSpec, ...]
    seq: int
    buf: torch.Tensor | None
    desc: torch.Tensor | None = None
    group: dist.ProcessGroup | None = None
    tag: int = 0
    device: torch.device | None = None
    deferred: bool = False      # the payload's receive waits for the checked descriptor
    works: list = field(default_factory=list)
    _tensors: list[torch.Tensor] | None = None
    _flushed: bool = False

    def _distinct_works(self) -> list[Any]:
        """The Works to wait for, each once (NCCL gives one Work for a whole batch)."""
        return list({id(w): w for w in self.works}.values())

    def wait(self) -> list[torch.Tensor]:
        if self._tensors is not None:
            return self._tensors
        if not self._flushed:
            raise RuntimeError(f"receive of {self.label!r} waited before its batch was "
                               "flushed (P2P.flush)")
        if self.desc is not None:
            self._distinct_works()[0].wait()
            magic, seq, nbytes, label = _read_descriptor(self.desc)
            want = sum(s.nbytes for s in self.specs)
            if magic != _DESC_MAGIC or seq != self.seq or nbytes != want \
                    or label != self.label[:_LABEL_BYTES]:
                raise OrderingError(
                    f"message #{self.seq} from rank {self.peer}: expected {self.label!r} "
                    f"({want} bytes) but in-order matching pairs it with the peer's #{seq} "
                    f"{label!r} ({nbytes} bytes)")
            if self.deferred:
                dist.irecv(self.buf, self.peer, group=self.group, tag=self.tag).wait()
            else:
                for w in self._distinct_works()[1:]:
                    w.wait()
        else:
            for w in self._distinct_works():
                w.wait()
        self._tensors = unpack(self.buf, self.specs) if self.buf is not None else \
            [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in self.specs]
        return self._tensors


class P2P:
    """This rank's ordered point-to-point channel to every other global rank (module
    docstring). ``group``: the process group the ranks are global ranks of (None: the
    default group)."""

    def __init__(self, device: torch.device, *, check: bool | None = None,
                 group: dist.ProcessGroup | None = None):
        self.device = torch.device(device)
        self.check = check_enabled() if check is None else check
        self.group = group
        self._defer_payload = self.check and (
            not dist.is_initialized() or dist.get_backend(group) == "gloo")
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._ops: list[dist.P2POp] = []
        self._posted: list[Received] = []
        # Sends in flight with their buffers (freed once the send has completed).
        self._send_works: list[tuple[dist.Work, torch.Tensor]] = []

    def _tag(self, seq: int, part: int) -> int:
        # One tag per message (two when checking): gloo then matches by order, as NCCL.
        return ((seq * 2 + part) if self.check else seq) % _TAG_SPACE

    def send(self, peer: int, tensors: Sequence[torch.Tensor], label: str) -> None:
        """Queue a message of ``tensors`` to global rank ``peer`` (sent at the next
        ``flush``; the tensors are copied into the send buffer now)."""
        seq = self._sent.get(peer, 0)
        self._sent[peer] = seq + 1
        buf = pack(tensors, self.device)
        if self.check:
            desc = _descriptor(seq, buf.numel(), label, self.device)
            self._ops.append(dist.P2POp(dist.isend, desc, peer, self.group, self._tag(seq, 0)))
        if buf.numel():
            self._ops.append(dist.P2POp(dist.isend, buf, peer, self.group, self._tag(seq, 1)))

    def recv(self, peer: int, specs: Sequence[TensorSpec], label: str) -> Received:
        """Queue the receive of the message from ``peer`` whose tensors ``specs``
        describe; ``label`` is what the sender calls it (checked when checking)."""
        seq = self._received.get(peer, 0)
        self._received[peer] = seq + 1
        specs = tuple(specs)
        nbytes = sum(s.nbytes for s in specs)
        r = Received(peer=peer, label=label, specs=specs, seq=seq, buf=None, group=self.group,
                     device=self.device)
        if nbytes:
            r.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.check:
            r.desc = torch.empty(_DESC_BYTES, dtype=torch.uint8, device=self.device)
            r.tag = self._tag(seq, 1)
            self._ops.append(dist.P2POp(dist.irecv, r.desc, peer, self.group,
                                        self._tag(seq, 0)))
            # On gloo the payload's receive is posted once its descriptor has been
            # checked (a payload of the wrong size must never reach a posted buffer: gloo
            # aborts). NCCL must have it in the same group as the descriptor's (its
            # senders send both in one group, and a later receive would wait on them).
            r.deferred = self._defer_payload and nbytes > 0
        if nbytes and not r.deferred:
            self._ops.append(dist.P2POp(dist.irecv, r.buf, peer, self.group,
                                        self._tag(seq, 1)))
        self._posted.append(r)
        return r

    def flush(self) -> None:
        """Issue every queued send and receive as one batch."""
        if not self._ops:
            for r in self._posted:
                r._flushed = True
            self._posted.clear()
            return
        works = dist.batch_isend_irecv(self._ops)
        if len(works) == 1 < len(self._ops):
            # NCCL runs a batch as one group and returns one Work for all of it (gloo
            # returns one per operation).
            works = works * len(self._ops)
        by_tensor = {id(op.tensor): w for op, w in zip(self._ops, works, strict=True)}
        # Sends that completed free their buffers now, not at the end of the step.
        done = [i for i, (w, _) in enumerate(self._send_works) if w.is_completed()]
        for i in reversed(done):
            del self._send_works[i]
        for op, w in zip(self._ops, works, strict=True):
            if op.op is dist.isend:
                self._send_works.append((w, op.tensor))
        for r in self._posted:
            r.works = [by_tensor[id(t)] for t in (r.desc, r.buf)
                       if t is not None and id(t) in by_tensor]
            r._flushed = True
        self._ops.clear()
        self._posted.clear()

    def wait_sends(self) -> None:
        """Wait until every send issued so far has completed; its buffers are freed."""
        self.flush()
        for w, _ in self._send_works:
            w.wait()
        self._send_works.clear()
