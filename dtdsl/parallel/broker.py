"""The cross-unit broker: per-sample activations forward, their gradients backward.

The schedule IR's communication is unit level (``vit.s0:SEND_F3>llm.s0``); which replica
of the receiver gets which sample is decided here, at sample granularity, so DP sizes need
not divide (an encoder with dp 2 can feed a backbone with dp 3).

**Routing.** At step j every unit's replicas together process the samples of the step;
each unit has an *assignment* (the replica index per sample, in step order) that every
rank computes alike from the per-sample costs (``dtdsl.reorder.intra.balance``), so no
message is needed to agree on it. ``route`` turns the producer's and the consumer's
assignment into the ordered sample list each (producer replica, consumer replica) pair
carries; ``reverse`` gives the gradient direction.

**Leaders** (Megatron MIMO bridge style). Only the first TP rank of the producer's last
stage of each replica sends, and only the first TP rank of the consumer's first stage of
each replica receives; the receiving leader then broadcasts the samples to its TP group,
in its replica's step order. Gradients travel the same way backwards: consumer first-stage
leaders send, producer last-stage leaders receive and broadcast to their TP group. A pair
that carries no sample exchanges no message; both sides know this from the routes.

**Matching.** gloo matches point-to-point messages by (source, tag); a message's tag is
``((step mod 2**28) * 2 + direction) * 3 + part`` (direction 0 forward, 1 backward; parts
below), so concurrent steps and both directions between the same two ranks cannot be
confused. NCCL ignores tags and matches in program order per peer; every sender posts its
messages in (step, direction, consumer replica) order and every receiver receives its
sources in increasing replica order within a step, so the same program also matches there
as long as the executor calls the broker in the schedule's order.

**Wire format** (no pickle). One message is up to three point-to-point transfers:

1. a fixed-size header, ``int64[HEADER_LEN]``: ``MAGIC``, tensor count, payload bytes,
   ``MAX_NDIM``, then one row per tensor for the first ``INLINE_TENSORS`` tensors (dtype
   code, ndim, shape padded with zeros to ``MAX_NDIM``), zero-filled;
2. only if count > ``INLINE_TENSORS``: the remaining rows, ``int64[count - INLINE, 2 +
   MAX_NDIM]``;
3. if payload bytes > 0, the payload, ``uint8[payload bytes]``: every tensor's bytes,
   contiguous, each starting at a multiple of ``ALIGN`` bytes.

So a message of up to ``INLINE_TENSORS`` tensors costs two transfers, and the receiver
cannot post the payload's receive before the header has arrived (a dependent round trip).

**Eager messages** (``eager=True`` on both sides; gloo/CPU only): a message of at most
``INLINE_TENSORS`` tensors and ``EAGER_BYTES`` payload bytes travels as ONE transfer on
the header's tag, ``uint8[HEADER_BYTES + payload bytes]``: the header (with
``MAGIC_EAGER``) then the payload. An eager receiver posts one receive of the upper bound
``HEADER_BYTES + EAGER_BYTES`` (gloo accepts a message shorter than the buffer), reads the
header and takes the payload from the same buffer; a message that is not eager (too large,
too many tensors) arrives as the normal parts with ``MAGIC``, and the eager receiver goes on
to receive them. A receiver that is not eager must not get eager messages (the first part
would not fit its header buffer). The receiver checks
each part against limits (``MAX_TENSORS``, ``MAX_NDIM``, known dtype codes, ``max_bytes``,
a payload size that matches the shapes) before it allocates anything, and raises
``WireError`` with the reason. Received tensors are views into one payload buffer. An
eager message is built straight in its one send buffer (no separate payload copy).

**Posting ahead.** gloo's TCP transport is a rendezvous: a message's data leaves the
sender only once the receiver has posted a receive for its (source, tag), so a receive
posted when the data is needed costs a round trip (receiver's notice, sender's data) and
a wake-up of the sender's I/O thread. ``post_recv`` posts a message's first part early
and ``recv_posted`` completes it; ``Broker.post_forward`` / ``post_backward`` do so for
the broker's receives (``recv_forward`` / ``recv_backward`` take what they posted). The
executor keeps its next RECV actions posted.

**Local links.** With ``use_local_links(links)`` (the executor does so on CPU), every
point-to-point transfer here between two ranks of one host goes over
``links.LocalLinks`` (Unix sockets: one system call a side, no rendezvous, none of gloo's
I/O-thread wake-ups) instead of gloo; the same parts, tags and matching. Both ranks of a
pair decide alike (the links are agreed on collectively), so a message and its receive
always take the same path; transfers on a group other than the default one, and
non-CPU buffers, stay on ``torch.distributed``.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtdsl.parallel.mesh import ProcessGroups, RankRole, UnitGrid, grids, role_of

if TYPE_CHECKING:
    from dtdsl.ir.plan import Plan
    from dtdsl.parallel.links import LocalLinks

_links: LocalLinks | None = None


def use_local_links(links: LocalLinks | None) -> LocalLinks | None:
    """Send this process's point-to-point transfers to same-host ranks over ``links``
    (None: all over torch.distributed again); the links used before."""
    global _links
    before, _links = _links, links
    return before


def local_links() -> LocalLinks | None:
    """The links ``use_local_links`` set, if any."""
    return _links


def _linked(peer: int, group: dist.ProcessGroup | None, buf: torch.Tensor) -> bool:
    return (_links is not None and group is None and buf.device.type == "cpu"
            and _links.links(peer))


def _isend(buf: torch.Tensor, dst: int, group: dist.ProcessGroup | None, tag: int) -> Any:
    if _linked(dst, group, buf):
        assert _links is not None
        return _links.isend(buf, dst, tag)
    return dist.isend(buf, dst, group=group, tag=tag)


def _irecv(buf: torch.Tensor, src: int, group: dist.ProcessGroup | None, tag: int) -> Any:
    if _linked(src, group, buf):
        assert _links is not None
        return _links.irecv(buf, src, tag)
    return dist.irecv(buf, src, group=group, tag=tag)

__all__ = [
    "ALIGN",
    "DEFAULT_MAX_BYTES",
    "HEADER_LEN",
    "INLINE_TENSORS",
    "EAGER_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "MAGIC_EAGER",
    "MAX_NDIM",
    "MAX_TENSORS",
    "Broker",
    "PostedRecv",
    "StepSamples",
    "WireError",
    "broadcast_tensors",
    "local_links",
    "message_tag",
    "post_recv",
    "recv_posted",
    "recv_tensors",
    "recv_tensors_many",
    "reverse",
    "route",
    "send_tensors",
    "use_local_links",
]

SampleId = Hashable
Routes = dict[tuple[int, int], tuple[SampleId, ...]]

# ---------------------------------------------------------------------------- routing


def route(sample_ids: Sequence[SampleId], producer: Sequence[int], consumer: Sequence[int], *,
          producer_dp: int | None = None, consumer_dp: int | None = None) -> Routes:
    """For each (producer replica, consumer replica) pair that carries at least one sample,
    the sample ids it carries, in step order. ``producer[i]`` / ``consumer[i]`` is the
    replica of ``sample_ids[i]`` in each unit. Keys are sorted; pairs with no sample are
    absent."""
    ids = tuple(sample_ids)
    if len(producer) != len(ids) or len(consumer) != len(ids):
        raise ValueError(f"{len(ids)} samples but assignments of length {len(producer)} "
                         f"(producer) and {len(consumer)} (consumer)")
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids of a step must be distinct")
    for name, assignment, dp in (("producer", producer, producer_dp),
                                 ("consumer", consumer, consumer_dp)):
        for r in assignment:
            if operator.index(r) < 0 or (dp is not None and r >= dp):
                top = "" if dp is None else dp - 1
                raise ValueError(f"{name} replica {r!r} is outside 0..{top}")
    out: dict[tuple[int, int], list[SampleId]] = {}
    for sid, p, c in zip(ids, producer, consumer, strict=True):
        out.setdefault((p, c), []).append(sid)
    return {k: tuple(out[k]) for k in sorted(out)}


def reverse(routes: Routes) -> Routes:
    """The same routes seen from the other side: (consumer replica, producer replica)."""
    return {k: routes[(k[1], k[0])] for k in sorted((c, p) for p, c in routes)}


@dataclass(frozen=True, eq=False)
class StepSamples:
    """The samples of one step and each unit's assignment (replica per sample)."""

    sample_ids: tuple[SampleId, ...]
    assignment: Mapping[str, Sequence[int]]

    def replicas(self, unit: str) -> Sequence[int]:
        try:
            a = self.assignment[unit]
        except KeyError:
            raise KeyError(f"no assignment for unit {unit!r} in this step") from None
        if len(a) != len(self.sample_ids):
            raise ValueError(f"unit {unit!r}: assignment of length {len(a)} for "
                             f"{len(self.sample_ids)} samples")
        return a

    def samples_of(self, unit: str, replica: int) -> tuple[SampleId, ...]:
        """The samples ``replica`` of ``unit`` processes, in step order."""
        return tuple(s for s, r in zip(self.sample_ids, self.replicas(unit), strict=True)
                     if r == replica)


# ------------------------------------------------------------------------- wire format

MAGIC = 0x6474_646C_7769_7231          # "dtdlwir1"
MAGIC_EAGER = 0x6474_646C_7769_7232    # "dtdlwir2": header and payload in one transfer
MAX_NDIM = 8
MAX_TENSORS = 1 << 16
DEFAULT_MAX_BYTES = 1 << 34            # 16 GiB per message
ALIGN = 16
INLINE_TENSORS = 16
_PREAMBLE = 4
_WIDTH = 2 + MAX_NDIM
HEADER_LEN = _PREAMBLE + INLINE_TENSORS * _WIDTH
HEADER_BYTES = HEADER_LEN * 8
EAGER_BYTES = 1 << 20                  # largest payload an eager message carries inline
assert HEADER_BYTES % ALIGN == 0
_TAG_STEPS = 1 << 28

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class WireError(ValueError):
    """A message (or a tensor list to send) breaks the wire format or its limits."""


@dataclass(frozen=True, slots=True)
class _Spec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[_Spec], int]:
    out, offset = [], 0
    for dtype, shape in specs:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        offset = _align(offset)
        out.append(_Spec(dtype, shape, offset, nbytes))
        offset += nbytes
    return out, offset


Signature = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


@lru_cache(maxsize=1024)
def _plan(signature: Signature, max_bytes: int
          ) -> tuple[tuple[_Spec, ...], int, torch.Tensor, torch.Tensor | None]:
    """The layout, payload bytes, header (``int64[HEADER_LEN]``, CPU) and overflow rows of
    a message of tensors of these (dtype, shape)s, checked against the limits. Memoised: a
    run sends the same few signatures over and over. The tensors returned are shared, so
    never written."""
    for i, (dtype, shape) in enumerate(signature):
        if dtype not in _CODE:
            raise WireError(f"tensor {i}: dtype {dtype} is not supported on the wire")
        if len(shape) > MAX_NDIM:
            raise WireError(f"tensor {i}: {len(shape)} dimensions; the limit is {MAX_NDIM}")
    specs, total = _layout(list(signature))
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    meta = [[_CODE[dtype], len(shape), *shape, *([0] * (MAX_NDIM - len(shape)))]
            for dtype, shape in signature]
    head = [MAGIC, len(signature), total, MAX_NDIM]
    for row in meta[:INLINE_TENSORS]:
        head += row
    head += [0] * (HEADER_LEN - len(head))
    overflow = meta[INLINE_TENSORS:]
    return (tuple(specs), total, torch.tensor(head, dtype=torch.int64),
            torch.tensor(overflow, dtype=torch.int64) if overflow else None)


def _describe(tensors: Sequence[torch.Tensor], max_bytes: int,
              device: torch.device | str | None
              ) -> tuple[torch.device | str, tuple[_Spec, ...], int, torch.Tensor,
                         torch.Tensor | None]:
    """A message's device, then ``_plan`` of its tensors, after checking them."""
    device, signature = _signature(tensors, device)
    return (device, *_plan(signature, max_bytes))


def _signature(tensors: Sequence[torch.Tensor], device: torch.device | str | None
               ) -> tuple[torch.device | str, Signature]:
    """A message's device and its tensors' (dtype, shape)s, after checking them."""
    if len(tensors) > MAX_TENSORS:
        raise WireError(f"{len(tensors)} tensors in one message; the limit is {MAX_TENSORS}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise WireError(f"item {i} is a {type(t).__name__}, not a tensor")
    if device is None:
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise WireError("tensors of one message must share a device (or name one), got "
                            f"{sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
    return device, tuple((t.dtype, tuple(t.shape)) for t in tensors)


@lru_cache(maxsize=1024)
def _eager_plan(signature: Signature, max_bytes: int
                ) -> tuple[torch.Tensor | None, ...] | None:
    """The parts of an eager message of tensors of these (dtype, shape)s, in order, with
    ``None`` where a tensor's bytes go: the header (``MAGIC_EAGER``) as bytes, then each
    tensor that has bytes after the zeros that align it, then the zeros that end the
    payload where ``_layout`` does. None when the message is not eager (too many tensors
    or bytes). Memoised, and the tensors in it shared: never written."""
    specs, total, head, overflow = _plan(signature, max_bytes)
    if overflow is not None or total > EAGER_BYTES:
        return None
    words = head.clone()
    words[0] = MAGIC_EAGER
    zeros = torch.zeros(ALIGN, dtype=torch.uint8)
    parts: list[torch.Tensor | None] = [words.view(torch.uint8)]
    end = 0
    for s in specs:
        if s.nbytes:
            if s.offset > end:
                parts.append(zeros[:s.offset - end])
            parts.append(None)
            end = s.offset + s.nbytes
    if total > end:
        parts.append(zeros[:total - end])
    return tuple(parts)


def _fill(payload: torch.Tensor, tensors: Sequence[torch.Tensor],
          specs: Sequence[_Spec]) -> None:
    """Copy ``tensors`` into their places in ``payload`` (uint8): each through a view of its
    own dtype and shape, so a strided tensor needs no contiguous copy of its own first."""
    for t, s in zip(tensors, specs, strict=True):
        if s.nbytes:
            payload[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape).copy_(t.detach())


def _encode(tensors: Sequence[torch.Tensor], max_bytes: int,
            device: torch.device | str | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(header, overflow rows or None, payload or None), on ``device`` (default: the
    tensors' own device)."""
    device, specs, total, head, overflow = _describe(tensors, max_bytes, device)
    header = head.to(device, copy=True)
    extra = None if overflow is None else overflow.to(device, copy=True)
    payload = None
    if total:
        payload = torch.empty(total, dtype=torch.uint8, device=device)
        _fill(payload, tensors, specs)
    return header, extra, payload


def _encode_eager(tensors: Sequence[torch.Tensor], max_bytes: int,
                  device: torch.device | str | None = None) -> torch.Tensor | None:
    """The eager message (header with ``MAGIC_EAGER``, then the payload, in one CPU buffer)
    of ``tensors``, or None when they do not fit one (too many tensors, too many bytes,
    not on the CPU): then the normal parts are sent. One ``cat`` of the memoised header
    and padding with the tensors' bytes: a handful of ops whatever the message."""
    device, signature = _signature(tensors, device)
    if torch.device(device).type != "cpu":
        return None
    template = _eager_plan(signature, max_bytes)
    if template is None:
        return None
    data = iter([t.detach().cpu().reshape(-1).view(torch.uint8) for t in tensors
                 if t.numel()])
    return torch.cat([next(data) if part is None else part for part in template])


def _check_header(header: torch.Tensor, max_bytes: int, *, eager: bool = False
                  ) -> tuple[int, int]:
    """(tensor count, payload bytes) of a received header, checked against the limits;
    ``eager``: an eager message's header (``MAGIC_EAGER``) is accepted too."""
    magic, count, total, ndim = (int(x) for x in header[:_PREAMBLE].tolist())
    if magic == MAGIC_EAGER and eager:
        if count > INLINE_TENSORS or total > EAGER_BYTES:
            raise WireError(f"eager message of {count} tensors and {total} bytes; the limits "
                            f"are {INLINE_TENSORS} and {EAGER_BYTES}")
    elif magic != MAGIC:
        raise WireError(f"bad magic {magic:#x}: not a dtdsl tensor message")
    if ndim != MAX_NDIM:
        raise WireError(f"peer pads shapes to {ndim} dimensions, we to {MAX_NDIM}")
    if not 0 <= count <= MAX_TENSORS:
        raise WireError(f"message announces {count} tensors; the limit is {MAX_TENSORS}")
    if not 0 <= total <= max_bytes:
        raise WireError(f"message announces {total} bytes; the limit is {max_bytes} bytes")
    return count, total


@lru_cache(maxsize=1024)
def _read_header(raw: bytes, max_bytes: int, eager: bool
                 ) -> tuple[int, int, bool, tuple[_Spec, ...] | None]:
    """(tensor count, payload bytes, eager message?, layout or None when overflow rows
    follow) of a received CPU header given as its bytes, checked (``_check_header``,
    ``_check_specs``). Memoised: a run receives the same few headers over and over."""
    header = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    count, total = _check_header(header, max_bytes, eager=eager)
    done = eager and int(header[0]) == MAGIC_EAGER
    if _overflow(count) and not done:
        return count, total, done, None
    return count, total, done, tuple(_check_specs(header, None, count, total))


def _overflow(count: int) -> int:
    """Rows of the overflow part for a message of ``count`` tensors."""
    return max(0, count - INLINE_TENSORS)


def _check_specs(header: torch.Tensor, extra: torch.Tensor | None, count: int,
                 total: int) -> list[_Spec]:
    """The tensors' layout from the header's inline rows and the overflow rows."""
    inline = header[_PREAMBLE:].reshape(INLINE_TENSORS, _WIDTH).tolist()
    if any(any(row) for row in inline[count:]):
        raise WireError("header rows beyond the tensor count are not zero")
    meta = inline[:count] + (extra.tolist() if extra is not None else [])
    assert len(meta) == count
    rows = []
    for i, row in enumerate(meta):
        code, ndim, dims = row[0], row[1], row[2:]
        if not 0 <= code < len(_DTYPES):
            raise WireError(f"tensor {i}: unknown dtype code {code}")
        if not 0 <= ndim <= MAX_NDIM:
            raise WireError(f"tensor {i}: ndim {ndim} is outside 0..{MAX_NDIM}")
        if any(d < 0 for d in dims[:ndim]) or any(dims[ndim:]):
            raise WireError(f"tensor {i}: bad shape {dims} for ndim {ndim}")
        rows.append((_DTYPES[code], tuple(dims[:ndim])))
    specs, size = _layout(rows)
    if size != total:
        raise WireError(f"shapes need {size} payload bytes but the message announces {total}")
    return specs


def _unpack(payload: torch.Tensor | None, specs: list[_Spec],
            device: torch.device | str) -> list[torch.Tensor]:
    out = []
    for s in specs:
        if s.nbytes == 0:
            out.append(torch.empty(s.shape, dtype=s.dtype, device=device))
        else:
            assert payload is not None
            out.append(payload[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))
    return out


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None = None,
                 *, tag: int = 0, device: torch.device | str | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, eager: bool = False) -> list[dist.Work]:
    """Post a message of ``tensors`` to global rank ``dst`` (non-blocking) and return its
    handles; wait on them all before the step ends. The tensors are copied into the send
    buffers, so the caller may change or free them at once. ``tag``: 0..2**29-1. The
    buffers live on ``device`` (the backend's device; default: the tensors' device).
    ``eager``: send a small message as one transfer (module docstring; the receiver must
    be eager too; CPU buffers only, else the normal parts are sent)."""
    if eager:
        buf = _encode_eager(tensors, max_bytes, device)
        if buf is not None:
            return [_isend(buf, dst, group, _part(tag, 0))]
    header, extra, payload = _encode(tensors, max_bytes, device)
    works = [_isend(header, dst, group, _part(tag, 0))]
    if extra is not None:
        works.append(_isend(extra, dst, group, _part(tag, 1)))
    if payload is not None:
        works.append(_isend(payload, dst, group, _part(tag, 2)))
    return works


def recv_tensors(src: int, group: dist.ProcessGroup | None = None, *, tag: int = 0,
                 device: torch.device | str = "cpu",
                 max_bytes: int = DEFAULT_MAX_BYTES, eager: bool = False) -> list[torch.Tensor]:
    """Receive one message sent by ``send_tensors`` from global rank ``src`` (blocking).
    ``eager``: accept eager messages (module docstring; CPU only)."""
    return recv_tensors_many([(src, tag)], group, device=device, max_bytes=max_bytes,
                             eager=eager)[0]


@dataclass(eq=False, slots=True)
class PostedRecv:
    """A message whose first transfer is posted (``post_recv``); ``recv_posted`` waits for
    it and receives the rest."""

    src: int
    tag: int
    group: dist.ProcessGroup | None
    eager: bool
    first: torch.Tensor         # the first part's buffer
    work: dist.Work


def post_recv(src: int, group: dist.ProcessGroup | None = None, *, tag: int = 0,
              device: torch.device | str = "cpu", eager: bool = False) -> PostedRecv:
    """Post the receive of the first part of the message from global rank ``src`` with
    ``tag`` (non-blocking): the header, or with ``eager`` the whole of an eager message
    (a buffer of ``HEADER_BYTES + EAGER_BYTES``, CPU only). Posting early pays: gloo
    sends a message's data only once the receiver has posted for it, so a message whose
    receive is already posted travels as soon as it is sent, with no round trip at the
    receive. Complete it with ``recv_posted``."""
    if eager and torch.device(device).type != "cpu":
        raise ValueError("eager messages are for CPU (gloo) buffers only")
    if eager:
        first = torch.empty(HEADER_BYTES + EAGER_BYTES, dtype=torch.uint8)
    else:
        first = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    return PostedRecv(src=src, tag=tag, group=group, eager=eager, first=first,
                      work=_irecv(first, src, group, _part(tag, 0)))


def recv_tensors_many(sources: Sequence[tuple[int, int]], group: dist.ProcessGroup | None = None,
                      *, device: torch.device | str = "cpu",
                      max_bytes: int = DEFAULT_MAX_BYTES,
                      eager: bool = False) -> list[list[torch.Tensor]]:
    """Receive one message from each (source rank, tag), all in flight together; the
    messages in the order of ``sources``. ``eager``: accept eager messages (module
    docstring): the first receive of each is the upper bound ``HEADER_BYTES +
    EAGER_BYTES`` (CPU only)."""
    return recv_posted([post_recv(src, group, tag=tag, device=device, eager=eager)
                        for src, tag in sources], device=device, max_bytes=max_bytes)


def recv_posted(posted: Sequence[PostedRecv], *, device: torch.device | str = "cpu",
                max_bytes: int = DEFAULT_MAX_BYTES) -> list[list[torch.Tensor]]:
    """Complete receives posted with ``post_recv`` (blocking): the messages, in order."""
    for p in posted:
        p.work.wait()
    def header(p: PostedRecv) -> torch.Tensor:
        return p.first[:HEADER_BYTES].view(torch.int64) if p.eager else p.first

    known: list[tuple[int, int, bool, tuple[_Spec, ...] | None]] = []
    for p in posted:
        if p.first.device.type == "cpu":    # its bytes straight from numpy: no torch op
            raw = p.first.numpy()
            known.append(_read_header((raw[:HEADER_BYTES] if p.eager else raw).tobytes(),
                                      max_bytes, p.eager))
        else:
            h = header(p)
            known.append((*_check_header(h, max_bytes, eager=p.eager),
                          p.eager and int(h[0]) == MAGIC_EAGER, None))
    heads = [(count, total) for count, total, _, _ in known]
    inline = [done for _, _, done, _ in known]
    extras: list[torch.Tensor | None] = []
    works = []
    for p, (count, _), done in zip(posted, heads, inline, strict=True):
        if _overflow(count) and not done:
            e = torch.empty((_overflow(count), _WIDTH), dtype=torch.int64, device=device)
            works.append(_irecv(e, p.src, p.group, _part(p.tag, 1)))
            extras.append(e)
        else:
            extras.append(None)
    for w in works:
        w.wait()
    specs = [k[3] if k[3] is not None else _check_specs(header(p), e, k[0], k[1])
             for p, e, k in zip(posted, extras, known, strict=True)]
    payloads: list[torch.Tensor | None] = []
    works = []
    for p, (_, total), done in zip(posted, heads, inline, strict=True):
        if done:
            payloads.append(p.first[HEADER_BYTES:HEADER_BYTES + total] if total else None)
        elif total:
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            works.append(_irecv(buf, p.src, p.group, _part(p.tag, 2)))
            payloads.append(buf)
        else:
            payloads.append(None)
    for w in works:
        w.wait()
    return [_unpack(p, s, device) for p, s in zip(payloads, specs, strict=True)]


def broadcast_tensors(tensors: Sequence[torch.Tensor] | None, src: int,
                      group: dist.ProcessGroup | None = None, *,
                      device: torch.device | str = "cpu",
                      max_bytes: int = DEFAULT_MAX_BYTES) -> list[torch.Tensor]:
    """Broadcast a list of tensors of any shapes from global rank ``src`` to ``group``, in
    the wire format; ``tensors`` is read on ``src`` only (pass ``None`` elsewhere). Returns
    the list on every rank (``src`` gets its own tensors back)."""
    if dist.get_rank() == src:
        if tensors is None:
            raise ValueError("the broadcasting rank must pass its tensors")
        header, extra, payload = _encode(tensors, max_bytes, device)
        for part in (header, extra, payload):
            if part is not None:
                dist.broadcast(part, src, group=group)
        return list(tensors)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    count, total = _check_header(header, max_bytes)
    extra = None
    if _overflow(count):
        extra = torch.empty((_overflow(count), _WIDTH), dtype=torch.int64, device=device)
        dist.broadcast(extra, src, group=group)
    specs = _check_specs(header, extra, count, total)
    payload = None
    if total:
        payload = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(payload, src, group=group)
    return _unpack(payload, specs, device)


def _part(tag: int, part: int) -> int:
    if not 0 <= tag < (1 << 29):
        raise ValueError(f"message tag {tag} is outside 0..2**29-1")
    return tag * 3 + part


def message_tag(step: int, direction: int) -> int:
    """The tag of the broker's messages for ``step`` (direction 0 forward, 1 backward)."""
    if step < 0:
        raise ValueError(f"step {step} is negative")
    return (step % _TAG_STEPS) * 2 + direction


# ------------------------------------------------------------------------------ broker

_EDGES = {("encoder", "backbone"), ("backbone", "generator")}
_ROUTES_KEPT = 4096     # cached routes before the cache starts over


class Broker:
    """Moves per-sample tensors between units for one rank (see the module docstring).

    Every method is called by every rank of the relevant stage: ``send_forward`` and
    ``recv_backward`` by the producer's last stage, ``recv_forward`` and ``send_backward``
    by the consumer's first stage. Non-leaders' sends are no-ops (they return no handles);
    receives broadcast within the receiving stage's TP group, so ``groups`` is needed
    wherever the receiving side has tp > 1. Received tensors do not require grad: the
    consumer marks its inputs ``requires_grad_()`` itself (they are leaves).
    """

    def __init__(self, plan: Plan, rank: int, groups: ProcessGroups | None = None, *,
                 p2p_group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", max_bytes: int = DEFAULT_MAX_BYTES,
                 eager: bool = False):
        self.plan = plan
        # Small point-to-point messages in one transfer (wire format); both sides of a
        # pair must agree, so every rank of a job builds its broker alike. CPU only.
        self.eager = eager and torch.device(device).type == "cpu"
        self.grids: dict[str, UnitGrid] = {g.name: g for g in grids(plan)}
        self.role: RankRole = role_of(plan, rank)
        if groups is not None and groups.rank != rank:
            raise ValueError(f"groups belong to rank {groups.rank}, not {rank}")
        self.groups = groups
        self.p2p_group = p2p_group
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        # Routes by (producer, consumer, StepSamples): a rank asks for the same microbatch
        # step's routes up to three times (post, receive, send), and a feed without a
        # reorder policy hands out the same StepSamples every step. The StepSamples is
        # kept with its routes, so its id cannot be reused while the entry lives.
        self._routes: dict[tuple[str, str, int], tuple[StepSamples, Routes, Routes]] = {}

    @property
    def rank(self) -> int:
        return self.role.rank

    def routes(self, producer: str, consumer: str, samples: StepSamples) -> Routes:
        """(producer replica, consumer replica) -> samples, for this step."""
        return self._cached_routes(producer, consumer, samples)[1]

    def _cached_routes(self, producer: str, consumer: str, samples: StepSamples
                       ) -> tuple[StepSamples, Routes, Routes]:
        """(samples, routes, reversed routes), computed once per StepSamples."""
        key = (producer, consumer, id(samples))
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        pg, cg = self._edge(producer, consumer)
        out = route(samples.sample_ids, samples.replicas(producer), samples.replicas(consumer),
                    producer_dp=pg.dp, consumer_dp=cg.dp)
        if len(self._routes) >= _ROUTES_KEPT:
            self._routes.clear()
        self._routes[key] = hit = (samples, out, reverse(out))
        return hit

    # -- forward: producer last stage -> consumer first stage

    def send_forward(self, step: int, producer: str, consumer: str,
                     tensors_by_sample: Mapping[SampleId, torch.Tensor],
                     samples: StepSamples) -> list[dist.Work]:
        pg, cg = self._edge(producer, consumer)
        return self._send(message_tag(step, 0), pg, pg.last_stage, samples.replicas(producer),
                          cg, 0, self.routes(producer, consumer, samples), tensors_by_sample,
                          samples)

    def recv_forward(self, step: int, producer: str, consumer: str, samples: StepSamples,
                     posted: Sequence[PostedRecv] | None = None
                     ) -> dict[SampleId, torch.Tensor]:
        """``posted``: what ``post_forward`` posted for this step, if it was called."""
        pg, cg = self._edge(producer, consumer)
        return self._recv(message_tag(step, 0), pg, pg.last_stage, cg, 0,
                          self._cached_routes(producer, consumer, samples)[2],
                          samples.replicas(consumer), samples, posted)

    def post_forward(self, step: int, producer: str, consumer: str,
                     samples: StepSamples) -> list[PostedRecv]:
        """Post ``recv_forward``'s receives ahead (``post_recv``); pass them to it."""
        pg, cg = self._edge(producer, consumer)
        return self._post(message_tag(step, 0), pg, pg.last_stage, cg, 0,
                          self._cached_routes(producer, consumer, samples)[2],
                          samples.replicas(consumer))

    # -- backward: consumer first stage -> producer last stage

    def send_backward(self, step: int, producer: str, consumer: str,
                      grads_by_sample: Mapping[SampleId, torch.Tensor],
                      samples: StepSamples) -> list[dist.Work]:
        pg, cg = self._edge(producer, consumer)
        return self._send(message_tag(step, 1), cg, 0, samples.replicas(consumer),
                          pg, pg.last_stage, self._cached_routes(producer, consumer, samples)[2],
                          grads_by_sample, samples)

    def recv_backward(self, step: int, producer: str, consumer: str, samples: StepSamples,
                      posted: Sequence[PostedRecv] | None = None
                      ) -> dict[SampleId, torch.Tensor]:
        """``posted``: what ``post_backward`` posted for this step, if it was called."""
        pg, cg = self._edge(producer, consumer)
        return self._recv(message_tag(step, 1), cg, 0, pg, pg.last_stage,
                          self.routes(producer, consumer, samples),
                          samples.replicas(producer), samples, posted)

    def post_backward(self, step: int, producer: str, consumer: str,
                      samples: StepSamples) -> list[PostedRecv]:
        """Post ``recv_backward``'s receives ahead (``post_recv``); pass them to it."""
        pg, cg = self._edge(producer, consumer)
        return self._post(message_tag(step, 1), cg, 0, pg, pg.last_stage,
                          self.routes(producer, consumer, samples),
                          samples.replicas(producer))

    # -- internals

    def _edge(self, producer: str, consumer: str) -> tuple[UnitGrid, UnitGrid]:
        try:
            pg, cg = self.grids[producer], self.grids[consumer]
        except KeyError as exc:
            raise KeyError(f"no unit {exc.args[0]!r} in the plan") from None
        if (pg.role, cg.role) not in _EDGES:
            raise ValueError(f"{producer} ({pg.role}) does not feed {consumer} ({cg.role}); "
                             "the broker links encoder -> backbone and backbone -> generator")
        return pg, cg

    def _where(self, grid: UnitGrid, stage: int, what: str) -> RankRole:
        r = self.role
        if r.unit != grid.name or r.stage != stage:
            raise RuntimeError(f"rank {r.rank} ({r.unit}.s{r.stage}) cannot {what}: only "
                               f"{grid.name}.s{stage} does")
        return r

    def _send(self, tag: int, src: UnitGrid, src_stage: int, src_assignment: Sequence[int],
              dst: UnitGrid, dst_stage: int, routes: Routes,
              tensors: Mapping[SampleId, torch.Tensor], samples: StepSamples) -> list[dist.Work]:
        me = self._where(src, src_stage, "send these tensors")
        mine = [s for s, r in zip(samples.sample_ids, src_assignment, strict=True)
                if r == me.replica]
        own = set(mine)
        if set(tensors) != own:
            missing = [s for s in mine if s not in tensors]
            extra = [s for s in tensors if s not in own]
            raise ValueError(f"{src.name} replica {me.replica} must send samples {mine}; "
                             f"missing {missing}, not its own {extra}")
        if not me.is_leader:
            return []
        works: list[dist.Work] = []
        for (s, d), ids in routes.items():
            if s == me.replica:
                works += send_tensors([tensors[i] for i in ids], dst.leader(dst_stage, d),
                                      self.p2p_group, tag=tag, device=self.device,
                                      max_bytes=self.max_bytes, eager=self.eager)
        return works

    def _post(self, tag: int, src: UnitGrid, src_stage: int, dst: UnitGrid, dst_stage: int,
              routes: Routes, dst_assignment: Sequence[int]) -> list[PostedRecv]:
        """The leader's receives of ``_recv``, posted; nothing elsewhere."""
        me = self._where(dst, dst_stage, "receive these tensors")
        if not me.is_leader or me.replica not in dst_assignment:
            return []
        return [post_recv(src.leader(src_stage, s), self.p2p_group, tag=tag,
                          device=self.device, eager=self.eager)
                for (d, s) in routes if d == me.replica]

    def _recv(self, tag: int, src: UnitGrid, src_stage: int, dst: UnitGrid, dst_stage: int,
              routes: Routes, dst_assignment: Sequence[int], samples: StepSamples,
              posted: Sequence[PostedRecv] | None = None) -> dict[SampleId, torch.Tensor]:
        """``routes`` keyed (receiving replica, sending replica); ``posted``: ``_post``'s
        receives for the same message, or None to post them here."""
        me = self._where(dst, dst_stage, "receive these tensors")
        order = [s for s, r in zip(samples.sample_ids, dst_assignment, strict=True)
                 if r == me.replica]
        if not order:
            return {}
        leader = dst.leader(dst_stage, me.replica)
        if me.is_leader:
            incoming = [(s, ids) for (d, s), ids in routes.items() if d == me.replica]
            sources = [(src.leader(src_stage, s), tag) for s, _ in incoming]
            if posted is None:
                posted = [post_recv(r, self.p2p_group, tag=t, device=self.device,
                                    eager=self.eager) for r, t in sources]
            elif [(p.src, p.tag) for p in posted] != sources:
                raise RuntimeError(f"receives posted for {[(p.src, p.tag) for p in posted]}, "
                                   f"but this message comes from {sources}")
            msgs = recv_posted(posted, device=self.device, max_bytes=self.max_bytes)
            got: dict[SampleId, torch.Tensor] = {}
            for (s, ids), tensors in zip(incoming, msgs, strict=True):
                if len(tensors) != len(ids):
                    raise WireError(f"{src.name} replica {s} sent {len(tensors)} tensors for "
                                    f"{len(ids)} samples")
                got.update(zip(ids, tensors, strict=True))
            ordered = [got[s] for s in order]
            if dst.tp > 1:
                broadcast_tensors(ordered, leader, self._tp_group(), device=self.device,
                                  max_bytes=self.max_bytes)
        else:
            ordered = broadcast_tensors(None, leader, self._tp_group(), device=self.device,
                                        max_bytes=self.max_bytes)
            if len(ordered) != len(order):
                raise WireError(f"TP leader {leader} broadcast {len(ordered)} tensors for "
                                f"{len(order)} samples")
        return dict(zip(order, ordered, strict=True))

    def _tp_group(self) -> dist.ProcessGroup:
        if self.groups is None:
            raise RuntimeError(f"unit {self.role.unit} has tp={self.role.grid.tp}: the broker "
                               "needs this rank's ProcessGroups to broadcast within TP")
        return self.groups.tp
