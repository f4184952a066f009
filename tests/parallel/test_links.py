"""Local links (``dtdsl.parallel.links``): gloo's point-to-point semantics over Unix
sockets between the ranks of one host."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from dtdsl.parallel.links import LocalLinks
from tests.dist import run


@contextmanager
def linked(rank: int, world: int) -> Iterator[LocalLinks]:
    """This rank's links to every other (all on this host), closed after."""
    links = LocalLinks.create(rank, world)
    assert links is not None and links.peers == frozenset(range(world)) - {rank}
    try:
        yield links
    finally:
        links.close()


def _exchange(rank: int, world: int) -> None:
    peer = 1 - rank
    with linked(rank, world) as links:
        # Out of order: receives posted in one order, messages sent in another; one
        # message arrives before its receive is posted (stashed), one is empty, one is
        # larger than the socket buffers (the writer thread finishes it), and both ranks
        # send to each other before either receives.
        big = torch.arange(3 << 20, dtype=torch.int32) * (rank + 1)
        small = torch.full((5,), float(rank))
        empty = torch.empty(0, dtype=torch.int64)
        sends = [links.isend(big, peer, 7), links.isend(small, peer, 3),
                 links.isend(empty, peer, 9), links.isend(small + 10, peer, 3)]
        got_small = torch.empty(64)                 # a receive larger than the message
        got_small2 = torch.empty(5)
        got_empty = torch.empty(0, dtype=torch.int64)
        got_big = torch.empty(3 << 20, dtype=torch.int32)
        r_small = links.irecv(got_small, peer, 3)
        r_big = links.irecv(got_big, peer, 7)
        r_big.wait()                                # reads tag 3 and 9 on the way: stashed
        r_empty = links.irecv(got_empty, peer, 9)   # completes from the stash
        r_small2 = links.irecv(got_small2, peer, 3)
        for w in (r_small, r_empty, r_small2, *sends):
            w.wait()
        assert torch.equal(got_big, torch.arange(3 << 20, dtype=torch.int32) * (peer + 1))
        assert r_small.nbytes == 20 and torch.equal(got_small[:5], torch.full((5,), peer))
        assert torch.equal(got_small2, torch.full((5,), peer + 10.0))     # in send order
        assert r_empty.nbytes == 0
        dist.barrier()


def test_local_links_match_by_source_and_tag_in_order():
    run(_exchange, 2, timeout=60)


def _dies(rank: int, world: int) -> None:
    with linked(rank, world) as links:
        if rank == 1:       # sends one message and closes its links
            links.isend(torch.ones(2), 0, 1).wait()
            return
        links.irecv(torch.empty(2), 1, 1).wait()
        with pytest.raises(ConnectionError, match="rank 1 closed its local link"):
            links.irecv(torch.empty(2), 1, 2).wait()


def test_a_peer_that_closes_its_links_fails_the_wait():
    run(_dies, 2, timeout=60)


_IMPOSTOR = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1].replace("@", "\\0", 1))
s.sendall(struct.pack("<q", 0) + struct.pack("<qq", 5, 8) + b"IMPOSTOR")
"""


def _impostor(rank: int, world: int) -> None:
    import subprocess
    import sys

    with linked(rank, world) as links:
        if rank == 0:       # another process claims to be rank 0, before rank 0 connects
            address = f"@dtdsl-{links.token}-1"
            subprocess.run([sys.executable, "-c", _IMPOSTOR, address], check=True)
        dist.barrier()
        if rank == 0:
            links.isend(torch.tensor([1.5], dtype=torch.float64), 1, 5).wait()
        else:
            got = torch.zeros(1, dtype=torch.float64)
            work = links.irecv(got, 0, 5)
            work.wait()
            assert work.nbytes == 8 and got.item() == 1.5     # the real rank 0's bytes
        dist.barrier()


def test_a_connection_from_another_process_is_ignored():
    run(_impostor, 2, timeout=60)


def _silent(rank: int, world: int) -> None:
    import time

    with linked(rank, world) as links:
        assert links.timeout_s == 60     # the default group's timeout
        links.timeout_s = 0.5
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=r"no message from rank 1 \(tag 4\) in 0.5 s"):
                links.irecv(torch.empty(1), 1, 4).wait()
            assert 0.5 <= time.monotonic() - start < 5
        dist.barrier()


def test_a_receive_times_out_like_the_process_group():
    run(_silent, 2, timeout=60)
