"""The zero-bubble schedule's split backward (ZB-H1): a stage's ``B`` computes only the
gradients of its inputs (what ``SEND_B`` sends upstream), its ``W`` later the gradients
of its weights, from what ``B`` left in the autograd graph.

This is torch.distributed.pipelining's split (``_backward.stage_backward_input`` /
``stage_backward_weight``), fitted to the executor:

- **B** walks the graph from the pass's outputs (the loss, the seeded outputs) and
  finds, for each group of weights, the nodes where the weights' part of the graph
  joins the inputs' (``get_param_groups``); a pre-hook on each keeps the gradient that
  reaches it. Then ``torch.autograd.grad`` runs the inputs' part only, the graph
  retained: each node computes only the outputs its edges need (a matmul's input
  gradient, not its weight's).
- **W** runs the weights' part from those nodes with the gradients they kept, and adds
  the weight gradients to ``.grad``, as a whole backward would.

The stage's inputs are the graph's leaves that are not its weights (a received
activation, a ``handoff.Sink``'s anchor, a phased encoder's embeddings): found in the
graph, whatever the pass. A pass with none (a first stage that reads tokens or pixels)
runs nothing in ``B`` and its whole backward in ``W``, as torch's first stage does; one
whose weights the inputs' part does not reach all (a weight on a branch no input
touches) runs its whole backward in ``B`` and nothing in ``W``: correct, not split.

FSDP2: the stage's parameters stay unsharded from ``Stage.begin_step`` to
``Stage.reduce_gradients`` and no group reduces or reshards during the step
(``parallel.fsdp.accumulate_unsharded``), so the weights ``W`` differentiates are the
unsharded ones ``B``'s graph holds, and FSDP2's post-backward hooks, which fire in ``B``
when it reaches a module's inputs, neither reduce nor reshard. ``Stage.reduce_early``
would reduce-scatter a layer in the step's last ``B``, before its ``W``: a stage that
runs ``W`` reduces everything in ``reduce_gradients``, after its last ``W`` (FSDP2's
post-backward per group and its final callback, as torch's ``perform_reduce_grad``).

Recomputation (``torch.utils.checkpoint``, non-reentrant) runs in ``B`` when it first
unpacks a checkpointed block's saved tensors; ``W`` is a new autograd call, which
recomputes the block again (the checkpoint keeps its recomputed tensors per call): the
gradients are right, the recomputation is paid twice. A block under ``torch.compile``
(``train.compiled``) has one backward node for all its gradients: ``W`` runs it again
(right gradients, checked with the aot_eager backend; the block's backward paid about
twice).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from dtdsl.ir.schedule import Action, ActionKind

__all__ = ["SplitBackward"]


class SplitBackward:
    """One stage's backwards: whole in ``backward`` unless its action list has a ``W``;
    then ``backward`` is the ``B`` and ``weights`` the ``W`` of a microbatch (and chunk),
    ``key``. ``stage``: the executor's ``train.stage.Stage``."""

    def __init__(self, stage: Any, actions: Sequence[Action]):
        self.stage = stage
        self.split = any(a.kind is ActionKind.W for a in actions)
        # Per (chunk, microbatch) between its B and its W: what W runs.
        self.pending: dict[tuple[int, int], Any] = {}
        # How each backward ran: "split" (B and W), "in W" (no input wants a gradient:
        # whole in W), "in B" (a weight no input reaches: whole in B), "whole" (no W).
        self.ran: Counter[str] = Counter()
        if self.split:
            stage.early = []    # no layer reduces in the last B: see the module docstring

    def backward(self, key: tuple[int, int], tensors: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        """The backward of ``tensors`` seeded with ``grads``: whole, or its ``B``."""
        with self.stage.backward_context():
            if not self.split:
                torch.autograd.backward(tensors, grads)
                self.ran["whole"] += 1
                return
            work = _backward_input(tensors, grads, self._weights())
            self.ran["in B" if work is None else "in W" if isinstance(work, _Whole)
                     else "split"] += 1
            if work is not None:
                self.pending[key] = work

    def weights(self, key: tuple[int, int]) -> None:
        """Microbatch ``key``'s ``W`` (nothing when its ``B`` had nothing to run)."""
        work = self.pending.pop(key, None)
        if work is None:
            return
        with self.stage.backward_context():
            if isinstance(work, _Whole):
                torch.autograd.backward(work.tensors, work.grads)
            else:
                _backward_weight(work)

    def _weights(self) -> dict[int, torch.Tensor]:
        """The stage's trainable parameters as the graph holds them (FSDP2's unsharded
        ones, registered on the modules until the step's reduction), by id."""
        return {id(p): p for p in self.stage.module.parameters() if p.requires_grad}


class _Whole:
    """A backward left whole for ``W`` (a pass with no input that wants a gradient)."""

    __slots__ = ("grads", "tensors")

    def __init__(self, tensors: list[torch.Tensor], grads: list[torch.Tensor]):
        self.tensors, self.grads = tensors, grads


def _node(t: torch.Tensor) -> Node | None:
    """``t``'s node: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _leaves(roots: list[Node]) -> tuple[dict[Node, list[Node]], list[Node]]:
    """The graph under ``roots``: each node's consumers (the reverse edges torch's
    ``get_param_groups`` walks), and its leaves' gradient accumulators."""
    from torch.distributed.pipelining._backward import construct_reverse_graph

    reverse = construct_reverse_graph(roots)
    seen = set(reverse) | set(roots)
    return reverse, [n for n in seen if hasattr(n, "variable")]


def _backward_input(tensors: list[torch.Tensor], grads: list[torch.Tensor],
                    weights: dict[int, torch.Tensor]) -> Any:
    """``B``: the gradients of the graph's non-weight leaves (``.grad``, a sink's slot),
    the graph retained; returns what ``W`` runs (module docstring)."""
    from torch.distributed.pipelining._backward import get_param_groups

    roots = [n for n in map(_node, tensors) if n is not None]
    reverse, leaves = _leaves(roots)
    inputs = [n for n in leaves if id(n.variable) not in weights]
    params = [n for n in leaves if id(n.variable) in weights]
    if not inputs:
        return _Whole(tensors, grads)
    groups = get_param_groups(inputs, params, reverse)
    if {p for g in groups for p in g["params"]} != set(params):
        torch.autograd.backward(tensors, grads)     # a weight no input reaches: whole
        return None
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def keep(grad_outputs: Any, group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        values = [n.variable for n in inputs]
        got = torch.autograd.grad(tensors, values, grads, retain_graph=True,
                                  allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(values, got, strict=True):
        _accumulate(x, g)
    return groups


def _accumulate(x: torch.Tensor, g: torch.Tensor | None) -> None:
    """Add gradient ``g`` (None: none came) to ``x.grad``, as autograd's own accumulation."""
    if g is not None:
        x.grad = g if x.grad is None else x.grad + g


def _backward_weight(groups: list[dict[str, Any]]) -> None:
    """``W``: the weight gradients from the gradients the groups' nodes kept in ``B``,
    added to the weights' ``.grad`` (torch's ``stage_backward_weight``, in one autograd
    call: groups can share nodes below their own, which one call per group would free
    before the next group reads them)."""
    edges, seeds, handles = [], [], []
    params: dict[Node, None] = {}
    nodes = [(kept, node) for group in groups
             for kept, node in zip(group["grads"], group["intermediates"], strict=True)]
    for kept, node in nodes:
        for i, g in enumerate(kept or ()):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
        if len(nodes) > 1:
            # A node below another would count the gradient twice: each gives what it
            # kept, whatever reaches it from above.
            handles.append(node.register_prehook(lambda _, kept=kept: kept))
    for group in groups:
        params.update(dict.fromkeys(group["params"]))
        group.clear()
    try:
        if not edges:
            return
        order = list(params)
        dws = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in order], seeds,
                                  allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for acc, dw in zip(order, dws, strict=True):
        _accumulate(acc.variable, dw)
