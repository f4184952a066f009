"""``train.handoff``: a sent tensor and a received one keep their place in the graph without
the graph holding their values, and their gradients are the held tensors' own."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dtdsl.ir.schedule import Action, ActionKind
from dtdsl.train.handoff import Handed, Sink, grad_of, last_sends


def _projector() -> tuple[torch.nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    proj = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 5))
    with torch.no_grad():
        for p in proj.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return proj, torch.randn(4, 6, generator=gen)


def test_a_handed_output_is_freed_and_differentiates_as_the_held_one():
    proj, x = _projector()
    g = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    proj(x).backward(g)
    want = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()

    y = proj(x)
    sent = y.detach()               # what SEND_F sends
    handed = Handed(y)
    alive = weakref.ref(y)
    del y, sent
    gc.collect()
    assert alive() is None          # nothing in the graph holds the output's values
    proxy, seed = handed.seed(g)
    torch.autograd.backward([proxy], [seed])
    for p, w in zip(proj.parameters(), want, strict=True):
        assert torch.equal(p.grad, w)
    with pytest.raises(ValueError, match="shape"):
        handed.seed(torch.zeros(3, 5))


def test_a_sunk_input_is_freed_and_its_gradient_lands_in_its_slot():
    proj, x = _projector()
    g = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    leaf = x.clone().requires_grad_(True)
    proj(leaf).backward(g)

    received = x.clone()
    sink = Sink(received)
    alive = weakref.ref(received)
    out = proj(sink.tensor * 1.0)
    slot = sink.slot
    del received, sink
    gc.collect()
    assert alive() is None          # the forward is done with the received rows
    out.backward(g)
    assert torch.equal(grad_of(slot), leaf.grad)


def test_a_slot_the_backward_never_reached_gives_zeros():
    sink = Sink(torch.ones(2, 3))
    assert torch.equal(grad_of(sink.slot), torch.zeros(2, 3))


def test_each_microbatchs_last_send_is_found():
    def send(j: int, peer: str) -> Action:
        return Action(unit="vit", stage=0, kind=ActionKind.SEND_F, microbatch=j,
                      peer_unit=peer, peer_stage=0)

    actions = [send(0, "a"), send(0, "b"),
               Action(unit="vit", stage=0, kind=ActionKind.F, microbatch=1), send(1, "a")]
    assert last_sends(actions) == {1, 3}
