"""A stand-in for a received feed message (its meta and arrays), for decoding tests."""

from __future__ import annotations

from dtdsl.feed import wire
from dtdsl.feed.protocol import BATCH


class _Message:
    """What Receiver.recv gives, from encode/decode without sockets."""

    def __new__(cls, meta, arrays, secret=b"k" * 32):
        return wire.decode(wire.encode(BATCH, meta, arrays, secret), secret)

