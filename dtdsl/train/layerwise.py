"""EDiT's layer-wise synchronisation, overlapped with the next step's forward.

A Local SGD synchronisation (``train.local_sgd``) blocks nothing it need not: at the end of
a synchronising step ``StageSync.after_step`` computes the global norms and the penalty's
decision (``LocalSGD.begin_sync``: small collectives, needed before any layer moves), then
issues the replica all-reduce of the first ``AHEAD`` layer groups' pseudo-gradients
without waiting (``async_op=True``) and returns: the optimizer step is over, the next step
begins. Each group has a forward pre-hook on the module that first uses it in the step;
the hook issues the all-reduces of the groups up to ``AHEAD`` past its own (always in group
order: every rank of the replica group issues the same collectives in the same order,
whichever hook fires first), waits for its own group, applies the outer step
(``LocalSGD.end_layer``) and removes itself: layer ``l``'s outer step lands just before
layer ``l``'s first forward, while the all-reduce of layer ``l+1`` runs behind layer
``l``'s compute. A step that ends with groups left (a module no microbatch ran) finishes
them before its optimizer step (``settle``, from ``StageSync.decide``), as does a
checkpoint or the end of training: nobody outside the forward ever sees a
half-synchronised model.

**The groups** of an FSDP2 root (``layer_groups``): group 0 is everything outside the
root's own unit's layers (its embedding, final norm and head, its projector, the units the
plan co-locates on the stage, whole), hooked on the root module itself: it runs first;
then each of the unit's layers (``parallel.fsdp.stage_layers``) in forward order, hooked on
the layer. Co-located units go whole into group 0 because a replica may leave one idle in
a microbatch (an encoder with no images in it): their hooks would fire at different
points on different replicas. Only the order in which ranks *issue* collectives must
agree, and that is the group order; waiting follows the pipeline's own order, in which a
rank never waits for a rank of a later stage (no cycle).

**FSDP2.** The hooks are registered with ``prepend=True`` after ``fully_shard``, so each
runs before FSDP2's own pre-forward of that module. On a replica of one rank (the
default) FSDP2 does not shard: the stage is one FSDP2 group, whose unsharded parameters
are copied from the sharded ones (cast to the compute dtype) once, at the root's first
forward of the step, before any layer hook runs. A layer's outer step, written into the
sharded parameter (the fp32 master that the optimizer and a checkpoint see), is then
also written into the unsharded one (``_write_through``: the same cast copy FSDP2 does, so
the forward computes with the very values the blocking path gives). On a replica of
several ranks each layer is an FSDP2 unit of its own, gathered by its own pre-forward
after the hook (``Stage.begin_step`` leaves a layer with an outer step to come
ungathered: ``pending_modules``); a co-located unit's layers, FSDP2 units in group 0, are
gathered by the root's hook once group 0's outer step has landed, in module order on every
rank of the replica (a microbatch may leave them idle on one rank and not another).

**Same numbers.** Every block's arithmetic is ``LocalSGD.sync_layer``'s: the same weighted
pseudo-gradient, the same all-reduce (asynchronous on gloo and NCCL computes what the
blocking call does), the same outer step, on parameters the optimizer has not touched
since. Tests compare the two paths bitwise (tests/train/test_local_sgd_overlap.py).

**Clipping** (``penalty=True`` with ``clip_norm``) keeps the blocking path. The clip
scales every layer's outer step by the norm of the *averaged* pseudo-gradient over all
layers, which exists only once the last layer's all-reduce is done: the first layer could
move only after every all-reduce and one more norm all-reduce, so at best they would hide
behind the gap between two steps (the data wait), at the price of every layer's averaged
pseudo-gradient held through the next step's first forward. A penalised run synchronises
every few steps; the blocking synchronisation is the simpler, smaller one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["AHEAD", "Overlap", "layer_groups"]

AHEAD = 2
"""How many groups' all-reduces are in flight ahead of the one a hook waits for."""


def layer_groups(root: nn.Module, unit: str | None, params: Sequence[torch.Tensor]
                 ) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """``params`` (an FSDP2 root's trainable parameters) in groups, each with the module
    whose forward first uses it (module docstring): the root with what is outside
    ``unit``'s layers, then each layer of ``unit`` with its own, in forward order."""
    from dtdsl.parallel.fsdp import stage_layers

    mine = {id(p) for p in params}
    units = getattr(root, "units", None)
    layers = [layer for name, _, layer in stage_layers(units)
              if name == unit] if isinstance(units, nn.ModuleDict) else []
    taken: set[int] = set()
    groups: list[tuple[nn.Module, list[torch.Tensor]]] = []
    for layer in layers:
        own = [p for p in layer.parameters() if id(p) in mine and id(p) not in taken]
        taken.update(id(p) for p in own)
        if own:
            groups.append((layer, own))
    rest = [p for p in params if id(p) not in taken]
    return ([(root, rest)] if rest else []) + groups


def _fsdp_params(root: nn.Module) -> dict[int, tuple[Any, nn.Module]]:
    """FSDP2's ``FSDPParam`` of each sharded parameter under ``root`` and the FSDP2
    module whose group holds it, by the parameter's id (the registered ``nn.Parameter``
    is its ``sharded_param`` between steps)."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for m in root.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = (fp, m)
    return out


def _write_through(fp: Any) -> None:
    """Copy an FSDP2 parameter's sharded value into its unsharded one if the unsharded
    one is live (gathered before the hook: a replica of one rank), as FSDP2's copy-in
    does (a cast to the compute dtype)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if fp.sharded_state is not ShardedState.UNSHARDED:
        return
    src = fp.sharded_param._local_tensor
    dst = fp.unsharded_param
    dst = dst.to_local() if hasattr(dst, "to_local") else dst
    if dst.shape != src.shape:
        # Gathered over several ranks before the outer step landed: its values are stale.
        raise RuntimeError(f"local_sgd: {fp._module_info.param_name} was gathered before "
                           "its outer step (Stage.begin_step must leave a pending layer "
                           "to its own pre-forward)")
    with torch.no_grad():
        dst.copy_(src)


class Overlap:
    """One ``LocalSGD``'s layer-wise synchronisation over the groups of ``layer_groups``
    (module docstring): ``start`` after ``begin_sync``, hooks on the groups' modules,
    ``settle`` to finish what the forward did not."""

    def __init__(self, sync: Any, root: nn.Module,
                 groups: Sequence[tuple[nn.Module, Sequence[torch.Tensor]]]) -> None:
        self.sync, self.root = sync, root
        self.groups = [(m, list(ps)) for m, ps in groups]
        self._fsdp: dict[int, tuple[Any, nn.Module]] = {}
        # Per group, the FSDP2 modules that hold its parameters, in module order; per
        # such module (by id), the groups it holds parameters of.
        self._owners: list[list[nn.Module]] = []
        self._holds: dict[int, set[int]] = {}
        self._flights: list[Any] = []       # per group issued so far, in order
        self._applied: set[int] = set()
        self._hooks: list[Any] = []
        self.active = False
        # Groups applied by their forward pre-hook and by ``settle``, over the run (what
        # was overlapped and what was not; tests and benchmarks read them).
        self.by_hook = 0
        self.by_settle = 0

    @property
    def pending_modules(self) -> list[nn.Module]:
        """The modules whose group's outer step is still to come (``Stage.begin_step``
        must not gather them)."""
        if not self.active:
            return []
        out: dict[int, nn.Module] = {}
        for i, owners in enumerate(self._owners):
            if i not in self._applied:
                out.update((id(m), m) for m in owners)
        return list(out.values())

    def start(self) -> None:
        """After ``LocalSGD.begin_sync``: issue the first groups' all-reduces and hook
        every group's module."""
        if self.active:
            raise RuntimeError("local_sgd: a layer-wise synchronisation is already running")
        self.active = True
        if not self._owners:        # FSDP2's parameters exist once its lazy init ran
            self._fsdp = _fsdp_params(self.root)
            self._owners = [list({id(self._fsdp[id(p)][1]): self._fsdp[id(p)][1]
                                  for p in ps if id(p) in self._fsdp}.values())
                            for _, ps in self.groups]
            for i, owners in enumerate(self._owners):
                for m in owners:
                    self._holds.setdefault(id(m), set()).add(i)
        self._flights, self._applied = [], set()
        self._issue(AHEAD - 1)
        self._hooks = [module.register_forward_pre_hook(self._hook_for(i), prepend=True)
                       for i, (module, _) in enumerate(self.groups)]

    def _issue(self, last: int) -> None:
        """Issue every group up to ``last`` not issued yet, in group order."""
        while len(self._flights) <= min(last, len(self.groups) - 1):
            _, params = self.groups[len(self._flights)]
            self._flights.append(self.sync.start_layer(params, async_op=True))

    def _hook_for(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            if index not in self._applied:
                self.by_hook += 1
            self._finish_group(index, gather=True)
        return hook

    @torch.no_grad()
    def _finish_group(self, index: int, *, gather: bool = False) -> None:
        if index in self._applied:
            return
        self._issue(index + AHEAD)
        self.sync.end_layer(self._flights[index])
        for p in self.groups[index][1]:
            if id(p) in self._fsdp:
                _write_through(self._fsdp[id(p)][0])
        self._applied.add(index)
        self._hooks[index].remove()
        hooked = self.groups[index][0]
        for m in self._owners[index]:
            # An FSDP2 module of the group other than the hooked one (a co-located unit's
            # layer in group 0), now whole: gathered here, in module order on every rank
            # of the replica, as ``Stage.begin_step`` would have (it may sit idle in a
            # microbatch on one rank and not another). A no-op where already gathered.
            # Not from ``settle``: between steps every group stays sharded.
            if gather and m is not hooked and self._holds[id(m)] <= self._applied:
                m.unshard(async_op=True)

    @torch.no_grad()
    def settle(self) -> None:
        """Finish the groups no forward reached, in order, and end the synchronisation
        (``LocalSGD.finish_sync``); nothing if none is running."""
        if not self.active:
            return
        self._issue(len(self.groups) - 1)
        for index in range(len(self.groups)):
            if index not in self._applied:
                self.by_settle += 1
                self._finish_group(index)
        self.sync.finish_sync()
        self.active, self._flights, self._hooks = False, [], []
