"""Ordered point-to-point transfers (dtdsl.parallel.p2p) on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from dtdsl.parallel.p2p import P2P, OrderingError, TensorSpec, pack, spec_of, unpack
from tests.dist import ChildFailed, run


def test_pack_and_unpack_round_trip_mixed_dtypes():
    ts = [torch.randn(3, 4), torch.arange(5), torch.randn(2, 2).bfloat16(), torch.empty(0, 7)]
    back = unpack(pack(ts, torch.device("cpu")), [spec_of(t) for t in ts])
    for a, b in zip(ts, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(OrderingError):
        unpack(torch.zeros(3, dtype=torch.uint8), [TensorSpec((1,), torch.float32)])


def _exchange(rank: int, world: int, misorder: bool) -> None:
    p2p = P2P(torch.device("cpu"))
    assert p2p.check   # the test helper turns the check on
    peer = 1 - rank
    a, b = torch.full((4,), 1.0 + rank), torch.full((4,), 10.0 + rank)
    # Both directions in one batch (send and receive between the same pair), twice.
    first, second = ("a", "b") if not (misorder and rank == 0) else ("b", "a")
    p2p.send(peer, [a if first == "a" else b], f"{first} from {rank}")
    p2p.send(peer, [b if second == "b" else a], f"{second} from {rank}")
    ra = p2p.recv(peer, [TensorSpec((4,), torch.float32)], f"a from {peer}")
    rb = p2p.recv(peer, [TensorSpec((4,), torch.float32)], f"b from {peer}")
    empty = p2p.recv(peer, [TensorSpec((0, 3), torch.float32)], f"empty from {peer}")
    p2p.send(peer, [torch.empty(0, 3)], f"empty from {rank}")
    p2p.flush()
    (got_a,) = ra.wait()
    (got_b,) = rb.wait()
    assert empty.wait()[0].shape == (0, 3)
    assert torch.equal(got_a, torch.full((4,), 1.0 + peer))
    assert torch.equal(got_b, torch.full((4,), 10.0 + peer))
    p2p.wait_sends()


def test_messages_match_in_order_in_both_directions():
    run(_exchange, 2, False)


def test_a_misordered_transfer_fails_the_check():
    # Rank 0 sends b before a: same sizes, so a transport matching by order would hand
    # rank 1 the wrong tensors without any error. The check names both messages.
    with pytest.raises(ChildFailed, match=r"OrderingError: message #0 from rank 0: "
                                          r"expected 'a from 0'.*'b from 0'"):
        run(_exchange, 2, True)


class _OneWork:
    """What NCCL's batch_isend_irecv returns: one Work for the whole group."""

    def __init__(self, works):
        self.works = works
        self.done = False

    def wait(self):     # as NCCL's, waiting again returns at once
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def _exchange_as_nccl(rank: int, world: int) -> None:
    import torch.distributed as dist

    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_OneWork(batch(ops))]
    try:
        p2p = P2P(torch.device("cpu"))
        p2p._defer_payload = False      # NCCL: descriptor and payload in one group
        peer = 1 - rank
        for step in range(3):
            p2p.send(peer, [torch.full((5,), 10.0 * step + rank)], f"x{step} from {rank}")
            got = p2p.recv(peer, [TensorSpec((5,), torch.float32)], f"x{step} from {peer}")
            p2p.flush()
            assert torch.equal(got.wait()[0], torch.full((5,), 10.0 * step + peer))
        p2p.wait_sends()
        assert not p2p._send_works
    finally:
        dist.batch_isend_irecv = batch


def test_one_work_per_batch_and_payloads_received_with_their_descriptors():
    # NCCL returns one Work per batch and needs a message's receives in one group: the
    # same program runs on that path too.
    run(_exchange_as_nccl, 2)
