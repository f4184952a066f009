"""One rank's pipeline stage of one unit, built as torch's production parts build it.

``build_stage(program, plan, role, mesh, device)`` returns a :class:`Stage`: the torch
module of this rank's stage (``StageModule``: the unit's layers this stage runs, its first
stage's embedding, its last stage's head or the projector that follows it, a generator's
projector), built so that memory matches the plan:

0. **Co-located units.** A backbone stage also holds the units the plan co-locates on it
   (``parallel.mesh.hosted_units``: encoders on its first stage, generators on its
   last), each whole with its projector (an encoder's into the backbone, the backbone's
   into the generator) and a generator's VAE, under their own names: they go through
   every step below with the stage's own unit, on its TP group and DP mesh, so their
   parameters, checkpoint keys and initial values are those of a unit of their own. A
   unit the plan marks ``tp_replicated`` runs whole on every TP rank instead.

0b. **Phased encoders.** Every backbone stage also holds the plan's phased encoders
   (``parallel.mesh.phased_units``), each with its projector into the backbone, as a
   ``Stage`` of its own (``build_phased``, ``Stage.phased``): the same steps below, but
   TP over the backbone's TP group and FSDP2 over the encoder's own DP mesh (every
   backbone rank with this TP index: ``parallel.mesh.phased_grid``), so it is an FSDP2
   root of its own, gathered at ``begin_step`` with the stage and reduced by the
   executor after its backward phase.

1. **Meta first.** The whole unit is built on the meta device (no memory), and the layers
   other stages run are deleted; the stage keeps the global names of what it holds
   (``units.<unit>.layers.<i>...``), so checkpoint keys do not depend on the plan.
1b. **Expert parallelism** (a backbone with ep > 1): each MoE block becomes
   ``parallel.ep.ExpertParallelMoE`` over the rank's EP group (``parallel.mesh``:
   ``ProcessGroups.ep``), still on meta; in step 4 its stacked experts make an FSDP2 unit
   of their own over the expert DP group (``parallel.fsdp.apply_fsdp``).
2. **Tensor parallelism** (``parallel.tp.parallelize_unit``) over the unit's TP mesh: still
   on meta, DTensor shards.
3. **Activation checkpointing** of every layer of each module whose spec says ``recompute
   = true`` or whose plan recomputes it (``UnitPlan.recompute``; ``checkpoint_wrapper``:
   the layer's activations are recomputed in backward).
4. **Shard, then materialise.** Every layer becomes an FSDP2 unit (``fully_shard`` over
   the unit's DP mesh; on a mesh of one rank only the stage: ``parallel.fsdp``), the stage its
   root, all still on meta; then ``to_empty`` allocates
   this rank's DP shards of its TP shards and nothing else, and each element is
   initialised: read from the unit's ``pretrained`` checkpoint (the block of each tensor
   the rank's shard covers, ``models.hf``), or by ``models.init``'s layout-independent
   rules from the spec seed and its position in the full tensor (the very values the
   single-process reference holds there). No rank ever holds or reads a tensor, or a
   shard, it does not own.

``build_stage`` composes these as named steps: ``_stage_units`` (0, 1),
``_apply_parallelisms`` (1b to 4's sharding, with compilation: torchtitan's
``parallelize.py``), ``_materialise`` (4's allocation), ``_assemble`` (the ``Stage``,
its ``StageState`` and the generators' VAEs), then tied embeddings, phased encoders and
initialisation.

**FSDP2** (``fully_shard``) is the data parallelism and ZeRO of every stage, with the spec's
``MixedPrecisionPolicy``: ``precision = bf16`` computes in bf16 parameters and activations,
keeps fp32 master weights (the sharded parameters) and optimizer state, and reduces
gradients in fp32; ``fp32`` is exact. ZeRO stages map as follows:

* ``zero = 1`` (the default, DistTrain's): parameters sharded over DP, kept unsharded from
  the first forward of a step to its last backward (``reshard_after_forward=False``, no
  reshard after backward until the last microbatch), gradients accumulated unsharded in
  fp32 over the microbatches and reduce-scattered once, after the last backward, the
  optimizer stepping its shard: ZeRO-1's memory for optimizer state and communication;
* ``zero = 0``: FSDP2 over a (replicate, shard) mesh with a shard dimension of one (HSDP):
  every DP rank holds everything and gradients are all-reduced.

FSDP2 cannot keep fp32 gradients *unsharded between steps* only for the optimizer's shard
(true ZeRO-1 keeps the full gradient buffer, which FSDP2 frees after the reduce-scatter):
here the gradient memory after the step is one shard, less than ZeRO-1's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan, chunk_ranges
from dtdsl.models.multimodal import build_unit, init_unit, unit_spec
from dtdsl.parallel.fsdp import (
    accumulate_unsharded,
    apply_fsdp,
    has_grad,
    param_groups,
    reduce_alone,
    replica_mesh,
    tp_unreduced,
    zero_unused_in_reduce_dtype,
)
from dtdsl.parallel.mesh import RankRole, hosted_units, phased_role, phased_units
from dtdsl.parallel.recompute import apply_ac
from dtdsl.parallel.tp import local_tensor

__all__ = ["COMPUTE_DTYPES", "Stage", "StageModule", "StageState", "build_phased",
           "build_stage", "projector_between", "tied_group_ranks", "tied_pairs"]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def projector_between(program: ir.Program, source: str, target: str) -> str:
    """The name of the projector ``source -> target``; ValueError when there is none."""
    for p in program.projectors:
        if p.source == source and p.target == target:
            return p.name
    raise ValueError(f"the spec has no projector {source} -> {target}, which the runtime "
                     "needs")


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` with activation checkpointing's wrappers taken out of its parameters'
    names (a copy of the module tree's view, sharing the parameters): initialisation
    names parameters as the single-process model does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
    )

    if not any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        return module
    view = nn.Module()
    for name, child in module.named_children():
        inner = child._checkpoint_wrapped_module if isinstance(child, CheckpointWrapper) \
            else child
        view.add_module(name, _unwrapped(inner))
    for name, param in module.named_parameters(recurse=False):
        view.register_parameter(name, param)
    return view


@dataclass(frozen=True)
class StageState:
    """What a stage's forward reads besides its arguments."""

    program: ir.Program
    role: RankRole
    start: int          # [start, stop) of the unit's layers on this stage
    stop: int
    dtype: torch.dtype  # the compute dtype
    # The frozen VAE encoders (models.vae) of the generators the stage runs, its own or
    # co-located ones, by generator name; outside FSDP.
    vaes: dict[str, Any] = field(default_factory=dict)
    hosted: tuple[str, ...] = ()    # co-located modules the stage runs (hosted_units)
    # Context parallelism (``parallel.cp.CPGroup``): the executor sets it on a backbone
    # or encoder unit's stage with cp > 1; None otherwise.
    cp: Any = None
    # Per model chunk (an interleaved unit's, ``ir.plan.chunk_ranges``), its [start, stop)
    # of the unit's layers; empty for one chunk, [start, stop).
    chunks: tuple[tuple[int, int], ...] = ()

    @property
    def seq_len(self) -> int:
        return self.program.train.seq_len

    def layers_of(self, chunk: int) -> tuple[int, int]:
        """The [start, stop) of the unit's layers model chunk ``chunk`` runs."""
        return self.chunks[chunk] if self.chunks else (self.start, self.stop)

    def first_of(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` is the unit's first virtual stage (its embedding)."""
        return self.role.is_first_stage and chunk == 0

    def last_of(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` is the unit's last virtual stage (its head, loss or
        projector out)."""
        return self.role.is_last_stage and chunk == max(0, len(self.chunks) - 1)


class StageModule(nn.Module):
    """The modules of one rank's stage under ``units`` (by unit name: the module, and the
    projector the stage runs). Its ``forward`` is the stage's work for one microbatch
    (``run(module, ...)``, reading ``module.stage_state``); ``train.executor`` gives it the
    stage's inputs. FSDP2's root is this module."""

    def __init__(self, units: dict[str, nn.Module], run: Any):
        super().__init__()
        self.units = nn.ModuleDict(units)
        self._run = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self, *args, **kwargs)


@dataclass(eq=False)
class Stage:
    """What ``build_stage`` built for one rank."""

    module: StageModule
    role: RankRole
    start: int                      # [start, stop) of the unit's layers on this stage
    stop: int                       # (of its first chunk's first, last chunk's last)
    compute_dtype: torch.dtype
    # Per model chunk of an interleaved unit (vpp > 1), its [start, stop): the stage holds
    # those layers only, under one FSDP2 root. Empty for one chunk.
    chunks: tuple[tuple[int, int], ...] = ()
    tp_sharded: set[str] = field(default_factory=set)   # names sharded over TP
    hosted: tuple[str, ...] = ()    # co-located modules it runs besides its unit
    layers: list[nn.Module] = field(default_factory=list)  # FSDP2 units, forward order
    # A backbone with tied embeddings over several pipeline stages holds the embedding on
    # its first stage and again, as the LM head, on its last: the two copies' gradients
    # are summed over this group of the pair (same replica and TP index; the PP group
    # with two stages), as Megatron's embedding group does, so both take the same step.
    tied_group: Any = None
    tied_name: str | None = None      # the copy's name, "<unit>.tok_embeddings.weight"
    compiled: Any = None    # train.compiled.CompiledBlocks when the blocks are compiled
    # The unit's TP process group (tp > 1): the gradients of parameters replicated over
    # it are averaged over it at the end of every step (``reduce_gradients``).
    tp_group: Any = None
    # The parameters whose gradients the last ``reduce_gradients`` averaged over TP
    # (``"<unit>.<param>"``, in the order they travelled).
    tp_synced: tuple[str, ...] = ()
    # The phased encoders this (backbone) rank runs before and after the pipeline, each
    # with its projector: a Stage of its own (``build_phased``), its own FSDP2 root over
    # its DP mesh (``parallel.mesh.phased_grid``), by unit name.
    phased: dict[str, Stage] = field(default_factory=dict)
    # Whether ``begin_step`` has waited once for every group's all-gather (below).
    gathered: bool = False
    # The layers whose gradients reduce-scatter during the step's last backward, each
    # from its own post-backward hook (``reduce_early``), and those of their parameters
    # whose gradients are averaged over TP: learnt at the first step's reduction (None
    # until then), which runs every group after the last backward.
    early: list[nn.Module] | None = None
    early_tp: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # by id(state)
    reducing_early: bool = False

    @property
    def held_layers(self) -> int:
        """How many of the unit's layers the stage holds, over all its chunks."""
        return sum(b - a for a, b in self.chunks) if self.chunks else self.stop - self.start

    @cached_property
    def fsdp_modules(self) -> list[nn.Module]:
        """The FSDP2 modules of the stage's module, the root first: found once, not by a
        walk of the module tree in every step (``accumulate_unsharded``)."""
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """``{"<unit>.<param>": parameter}`` for every parameter the stage holds, its
        phased encoders' too."""
        out = {_strip(n): p for n, p in self.module.named_parameters()}
        for part in self.phased.values():
            out.update(part.named_parameters())
        return out

    def backward_context(self) -> Any:
        """What a backward of this stage runs in: ``loss_parallel`` on a backbone's last
        stage with a vocabulary-parallel head (torch's rule: its cross-entropy's backward
        too), nothing elsewhere."""
        import contextlib

        role = self.role
        if role.role == "backbone" and role.grid.tp > 1 and role.is_last_stage:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def initialize(self, program: ir.Program, seed: int) -> None:
        """Give every parameter the stage holds its first value: its block of the unit's
        pretrained checkpoint, or the layout-independent initialisation from ``seed``
        (``models.multimodal.init_unit``). No rank reads or computes more than its
        shards. A run resuming from a checkpoint skips this: the checkpoint holds every
        parameter, frozen ones too."""
        with torch.no_grad():
            for unit_name, unit in self.module.units.items():
                init_unit(program, unit_name, _unwrapped(unit), seed)
        for part in self.phased.values():
            part.initialize(program, seed)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad] + \
            [p for part in self.phased.values() for p in part.trainable()]

    def begin_step(self, skip: Any = ()) -> None:
        """Before the step's first action: all-gather every FSDP2 group's parameters, in
        forward order, on every DP rank alike (ZeRO-1: the parameters stay whole for the
        step), and accumulate gradients unsharded (in fp32, FSDP2's reduce dtype) until
        ``reduce_gradients``. Gathering here, not lazily at each module's first call,
        keeps the DP ranks' collectives in step even when a replica's microbatch leaves a
        module idle (an encoder replica with no images in it). ``skip``: modules whose
        Local SGD outer step is still to land (``train.layerwise``): gathered by their
        own pre-forward, after it (every rank of the replica runs them, in order)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.module, FSDPModule):
            return
        accumulate_unsharded(self.fsdp_modules, last=False)
        self.reducing_early = False
        held = {id(m) for m in skip}
        handles = [m.unshard(async_op=True)     # FSDP2's pre-forward waits for each
                   for m in [self.module, *self.layers] if id(m) not in held]
        if not self.gathered:
            # FSDP2 makes a group's unsharded parameters at its first wait. A backward's
            # final callback visits every group, under mixed precision reading those
            # parameters (``to_accumulated_grad_if_needed``): one whose module no forward
            # has run yet (a co-located encoder idle in the first microbatch) would fail.
            # Waiting at the first step makes them all; later steps keep them.
            for handle in handles:
                if handle is not None:
                    handle.wait()
            self.gathered = True
        for part in self.phased.values():
            part.begin_step()

    def reduce_early(self) -> None:
        """Before the step's last backward on this stage: let each of its ``early``
        layers reduce-scatter its gradients over DP as soon as its own backward ends
        (FSDP2's post-backward hook, on its reduce-scatter stream), so that the reduction
        runs behind the backward of the layers before it rather than after the last one,
        as torchtitan's pipeline stages do. Only a backbone's transformer layers are
        early (``_learn_early``): every microbatch of every DP replica runs all of them,
        so the DP ranks issue these reduce-scatters in one order, layer by layer from the
        last; the rest (embeddings, head, co-located modules a replica may leave idle)
        waits for ``reduce_gradients``."""
        if self.early:
            for layer in self.early:
                layer.set_requires_gradient_sync(True, recurse=False)
                layer.set_reshard_after_backward(True, recurse=False)
            self.reducing_early = True

    def reduce_gradients(self) -> None:
        """After the step's last backward: reduce-scatter every FSDP2 group's accumulated
        gradients over DP, in the same order on every DP rank (the reverse of forward, as
        autograd would), then reshard, whatever each rank's last microbatch held (one
        without generation targets runs no backward at all). torch's pipelining stages
        reduce this way too. The groups ``reduce_early`` let reduce during the last
        backward are done already."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        if not isinstance(self.module, FSDPModule):
            return
        done = self.early if self.reducing_early else []
        done_states = {id(m._get_fsdp_state()) for m in done}
        # A module this rank never ran this step (a co-located encoder whose replica drew
        # no images, a generator with no targets) still has begin_step's all-gather
        # pending: finish it (no new collective), or FSDP2 would leave its parameters out
        # of the reduce-scatter that every other DP rank sends them in.
        for m in [self.module, *self.layers]:
            if id(m._get_fsdp_state()) not in done_states:
                m.unshard()
        accumulate_unsharded(self.fsdp_modules, last=True)
        state = self.module._get_fsdp_state()
        members = [m for m in state._state_ctx.all_states if id(m) not in done_states]
        # Which gradients FSDP2 leaves unequal over TP, read before it frees them (the
        # early layers' were read at the first step: the same every step).
        replicated = [] if self.tp_group is None else [
            p for m in state._state_ctx.all_states
            for p in (self.early_tp[id(m)] if id(m) in done_states else tp_unreduced([m]))]
        if self.early is None:
            self._learn_early()
        for member in reversed(members):
            for group in reversed(param_groups(member)):
                zero_unused_in_reduce_dtype(group)
                if not reduce_alone(group):
                    group.post_backward()
        for member in state._state_ctx.all_states:
            if id(member) in done_states:
                # Reduced in the backward; the final callback must not reduce them again.
                for group in param_groups(member):
                    group._training_state = TrainingState.POST_BACKWARD
        state._root_post_backward_final_callback()
        self._sum_tied_gradients()
        self._average_over_tp(replicated)

    def _learn_early(self) -> None:
        """At the first step's reduction, before it: which layers reduce early from the
        next step on (``reduce_early``): the backbone's own transformer layers (not a
        co-located module's, which a replica may leave idle), each its own FSDP2 module
        whose trainable parameters all have a gradient (a layer some microbatch can
        leave unused must wait for the end of the step with the rest), and which of
        their parameters are averaged over TP (``tp_unreduced``, read now from this
        step's gradients: their placements are structural)."""
        self.early = []
        if self.role.role != "backbone":
            return
        unit = self.module.units[self.role.unit]
        own = {id(m) for m in unit.modules()}
        if self.chunks:
            # Interleaved: the step's last backward is chunk 0's; the other chunks' layers
            # ran their last backward before it, and reduce with the rest.
            start, stop = self.chunks[0]
            own = {id(m) for k, layer in unit.layers.items() if start <= int(k) < stop
                   for m in layer.modules()}
        for layer in self.layers:
            member = layer._get_fsdp_state()
            params = [fp for g in param_groups(member) for fp in g.fsdp_params
                      if fp.sharded_param.requires_grad]
            if id(layer) not in own or not params or not all(has_grad(fp) for fp in params):
                continue
            self.early.append(layer)
            self.early_tp[id(member)] = tp_unreduced([member])

    def _average_over_tp(self, params: list[nn.Parameter]) -> None:
        """Average the gradients of ``params`` (replicated over the TP group, each rank's
        the same DP shard) over the TP group: one all-reduce per dtype and bucket of at
        most ``TP_SYNC_BUCKET_BYTES``, not one per parameter. Mathematically the TP ranks'
        gradients are equal already; on a GPU nondeterministic kernels (atomics in
        convolution and norm backward, split-K matmuls) make them differ in the last
        bits, and the copies would drift apart step after step."""
        if not params:
            self.tp_synced = ()
            return
        names = {id(p): n for n, p in self.named_parameters().items()}
        grads = [(names[id(p)], local_tensor(p.grad)) for p in params if p.grad is not None]
        self.tp_synced = tuple(n for n, _ in grads)
        if grads:
            _all_reduce_mean([g for _, g in grads], self.tp_group)

    def _sum_tied_gradients(self) -> None:
        if self.tied_group is None:
            return
        import torch.distributed as dist

        param = self.named_parameters()[self.tied_name]
        if param.grad is None:      # FSDP2 reduces unused parameters too: never None here
            raise RuntimeError(f"{self.tied_name} has no gradient to sum with its tied copy")
        grad = param.grad
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad,
                        group=self.tied_group)


# The largest flat buffer the TP gradient average allocates at once (a U-Net at tp > 1
# replicates most of its parameters: one buffer of all of them would double its gradient
# shard's memory at the end of the step).
TP_SYNC_BUCKET_BYTES = 256 * 2**20


def _all_reduce_mean(grads: list[torch.Tensor], group: Any) -> None:
    """Replace every tensor of ``grads`` with its mean over ``group``: the tensors of one
    dtype flattened into buckets of at most ``TP_SYNC_BUCKET_BYTES``, one all-reduce
    (SUM, then a division: gloo has no AVG) per bucket. The same order on every rank."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket: list[torch.Tensor] = []
        used = 0
        for g in same:
            if bucket and used + g.numel() * g.element_size() > TP_SYNC_BUCKET_BYTES:
                _reduce_bucket(bucket, size, group)
                bucket, used = [], 0
            bucket.append(g)
            used += g.numel() * g.element_size()
        _reduce_bucket(bucket, size, group)


def _reduce_bucket(bucket: list[torch.Tensor], size: int, group: Any) -> None:
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _strip(name: str) -> str:
    """``units.<unit>.<param>`` (FSDP and checkpoint wrappers' prefixes removed) to
    ``<unit>.<param>``."""
    name = name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
    return name.removeprefix("units.")


def _owned_layers(module: nn.Module, ranges: tuple[tuple[int, int], ...]) -> None:
    """Delete the layers (a DiT's blocks) that no range of ``ranges`` holds; the rest keep
    their keys, the whole model's indices."""
    layers = module.layers if hasattr(module, "layers") else module.blocks
    for key in list(layers.keys()):
        if not any(start <= int(key) < stop for start, stop in ranges):
            del layers[key]


def _owned_ends(module: nn.Module, role: RankRole) -> None:
    """Drop what only the unit's first stage runs (an encoder's embeddings and pre-norm, a
    backbone's token embedding) from later stages, and what only its last stage runs (an
    encoder's post-norm, a backbone's final norm and head) from earlier ones. A backbone
    with tied embeddings keeps the embedding on its last stage too: it is the head."""
    if role.role == "encoder":
        if not role.is_first_stage:
            module.patch_embed = module.cls_embedding = module.pos_embed = None
            module.pre_norm = None
        if not role.is_last_stage:
            module.post_norm = None
    elif role.role == "backbone":
        if not role.is_last_stage:
            module.norm = module.output = None
        if not role.is_first_stage and not (module.tied and role.is_last_stage):
            module.tok_embeddings = None
    else:   # a DiT generator over several stages: the patches in first, out last
        if not role.is_first_stage:
            module.patch_embed = None
        if not role.is_last_stage:
            module.proj_out = None


def tied_pairs(program: ir.Program, plan: Plan) -> tuple[tuple[int, int], ...]:
    """Every pair of ranks holding the two copies of a tied embedding: the backbone's
    first and last stage, same replica and TP index, when its embeddings are tied, trained
    and split over several pipeline stages; none otherwise. Pure (a dry run's too)."""
    from dtdsl.parallel.mesh import grids

    backbone = program.backbone
    if not getattr(backbone.arch, "tie_embeddings", False) or backbone.frozen:
        return ()
    grid = next(g for g in grids(plan) if g.name == backbone.name)
    if grid.pp < 2:
        return ()
    return tuple((grid.rank(0, r, t), grid.rank(grid.pp - 1, r, t))
                 for r in range(grid.dp) for t in range(grid.tp))


def tied_group_ranks(program: ir.Program, plan: Plan, rank: int) -> tuple[int, int] | None:
    """The group ``build_stage`` creates on ``rank`` for a tied embedding, besides
    ``mesh.rank_groups``: its pair (``tied_pairs``) when the backbone has more than two
    pipeline stages; None for a rank in no pair, and with two stages, where the pair is
    the PP group ``build_groups`` made."""
    pairs = tied_pairs(program, plan)
    if not pairs or plan.unit(program.backbone.name).pp == 2:
        return None
    return next((p for p in pairs if rank in p), None)


def _tie_across_stages(stage: Stage, program: ir.Program, plan: Plan, mesh: Any) -> None:
    """The group of a tied embedding's two copies (``Stage.tied_group``) on the ranks of
    a pair (``tied_pairs``). With two pipeline stages the pair is the PP group; with more
    it is a group of its own, created by the pair alone (``mesh.new_subgroup``: where
    groups are split from the default group, every rank of the job takes part, so every
    rank comes here)."""
    import torch.distributed as dist

    from dtdsl.parallel.mesh import new_subgroup

    pairs = tied_pairs(program, plan)
    if not pairs or not dist.is_initialized():
        return
    role = stage.role
    pair = next((p for p in pairs if role.rank in p), None)
    if plan.unit(program.backbone.name).pp == 2:
        group = mesh.get_group("pp") if pair is not None else None
    else:
        group = new_subgroup(pair, lambda: pairs, desc="tied_embedding")
    if pair is not None:
        stage.tied_group = group
        stage.tied_name = f"{role.unit}.tok_embeddings.weight"


def _recomputes(program: ir.Program, plan: Plan, name: str) -> ir.Recompute:
    """What unit ``name``'s layers recompute in backward (``ir.Recompute``): the more of
    its spec's ``recompute`` and its plan's (a planner may recompute to make a layout
    fit, ``UnitPlan.recompute``). Projectors have no layers of their own."""
    spec = ir.Recompute.of(getattr(unit_spec(program, name), "recompute", False))
    planned = [ir.Recompute.of(u.recompute) for u in plan.units if u.name == name]
    return max([spec, *planned], key=lambda mode: mode.rank)


def _projector_of(program: ir.Program, name: str, role: str) -> str:
    """The projector that runs with a co-located module: an encoder's into the backbone,
    the backbone's into a generator."""
    backbone = program.backbone.name
    return projector_between(program, name, backbone) if role == "encoder" else \
        projector_between(program, backbone, name)


def _parallelize(module: nn.Module, name: str, tp_mesh: Any) -> set[str]:
    """``parallelize_unit`` of unit ``name``, its errors naming the unit."""
    from dtdsl.parallel.tp import parallelize_unit

    try:
        return parallelize_unit(module, tp_mesh)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _vaes(program: ir.Program, generators: list[str], device: torch.device) -> dict[str, Any]:
    """The VAE encoder of each of ``generators`` that has one. Frozen and small (SD's
    encoder: 34M parameters): one whole copy per rank that runs the generator, in fp32
    (as diffusers' SD VAE runs), never sharded, trained or saved."""
    out: dict[str, Any] = {}
    for name in generators:
        spec = program.module(name)
        if spec.vae is None:
            continue
        from torch._guards import detect_fake_mode

        from dtdsl.models.vae import VAEConfig, load_vae

        out[name] = load_vae(VAEConfig.of(spec.vae), device=device,
                             weights=detect_fake_mode() is None)   # memcheck: shapes only
    return out


def _compile(stage: StageModule, program: ir.Program, role: RankRole, mesh: Any,
             device: torch.device, compile: bool | None) -> Any:
    """The stage's blocks compiled (``train.compiled``) when ``compile`` says so, or when
    unset, the spec's rule for this device, with async TP first where the spec asks for it
    (``_async_tp``); None when not compiled."""
    compiling = program.train.compiles(torch.device(device).type) if compile is None \
        else compile
    if program.train.async_tp:
        _async_tp(mesh, compiling)
    if not compiling:
        return None
    from dtdsl.train.compiled import apply_compile

    return apply_compile(stage, rank=role.rank)


def _async_tp(mesh: Any, compiling: bool) -> None:
    """``train.async_tp`` on this rank's TP group (``parallel.tp.enable_async_tp``), or a
    ``Fatal`` error where it cannot run: a rank on a CPU or gloo, or one that does not
    compile its blocks. Nothing on a TP group of one rank, or in a fake-collective world
    (``dtc memcheck``, ``benchmarks/host_overhead.py``), whose collectives move nothing."""
    import torch.distributed as dist

    tp = mesh["tp"]
    if tp.size() == 1:
        return
    backend = dist.get_backend(tp.get_group())
    if backend == "fake":
        return
    if tp.device_type != "cuda" or backend != "nccl" or not compiling:
        from dtdsl.feed.faults import Fatal

        raise Fatal(f"train.async_tp = true runs TP's collectives in compiled blocks on CUDA "
                    f"GPUs with NCCL; this rank's TP group of {tp.size()} runs on "
                    f"{tp.device_type} ({backend})"
                    + ("" if compiling else ", its blocks not compiled")
                    + ": set async_tp = false to run here")
    from dtdsl.parallel.tp import enable_async_tp

    enable_async_tp()


def build_phased(program: ir.Program, plan: Plan, name: str, role: RankRole, mesh: Any,
                 device: torch.device, *, seed: int, run: Any = None) -> Stage:
    """Phased encoder ``name`` and its projector into the backbone on this backbone
    rank, as a stage of their own: ``role`` is the rank's place in the encoder's grid
    (``parallel.mesh.phased_role``), ``mesh`` its DeviceMesh (``ProcessGroups.phased``),
    ``run`` its forward (an encoder stage's, ``run(stage_module, ...)``).
    The same steps as ``build_stage`` (meta, TP over the backbone's TP group unless the
    plan marks it ``tp_replicated``, FSDP2 over its DP group of every backbone rank with
    this TP index, then materialised), not initialised. Its layers recompute in
    backward only where the spec says so: the backward phase's forward is already the
    recomputation the plan's ``recompute`` of a phased unit stands for. Never compiled."""
    compute_dtype = COMPUTE_DTYPES[program.train.precision]
    proj = projector_between(program, name, program.backbone.name)
    units = {name: build_unit(program, name, seed, device="meta"),
             proj: build_unit(program, proj, seed, device="meta")}
    tp_sharded = _apply_tp(units, [name] if not plan.unit(name).tp_replicated else [],
                           role, mesh)
    stage = StageModule(units, run)
    apply_ac(stage.units, lambda unit: ir.Recompute.of(getattr(unit_spec(program, unit),
                                                               "recompute", False)))
    layers = apply_fsdp(stage, stage.units, _replica_mesh(mesh, program), compute_dtype)
    _materialise(stage, program, device)
    # FSDP2 sets a root up at its first forward; a rank whose share of a step has no
    # images runs none, yet reduces with the others (``Stage.reduce_gradients``).
    stage._get_fsdp_state()._lazy_init()
    return _assemble(_Parallel(stage, tp_sharded, None, layers), program, role, [],
                     ((0, program.module(name).arch.layers),), mesh, device)


def _apply_tp(units: dict[str, nn.Module], names: list[str], role: RankRole,
              mesh: Any) -> set[str]:
    """Tensor parallelism of units ``names`` over ``mesh``'s TP dimension (none at tp 1):
    the names of the parameters it sharded, ``<unit>.<param>``."""
    if role.grid.tp == 1:
        return set()
    return {f"{unit_name}.{n}" for unit_name in names
            for n in _parallelize(units[unit_name], unit_name, mesh["tp"])}


def _replica_mesh(mesh: Any, program: ir.Program) -> Any:
    """What FSDP2 shards and reduces over (``parallel.fsdp.replica_mesh``): one replica's
    ranks under Local SGD (``train.sync``), else the DP mesh."""
    return replica_mesh(mesh, local_sgd=program.train.sync.local)


def _materialise(stage: StageModule, program: ir.Program, device: torch.device) -> None:
    """Allocate this rank's shards (``to_empty``), check every buffer has an initialiser,
    freeze what the spec freezes, and put the modules in training mode."""
    stage.to_empty(device=device)
    for unit_name, unit in stage.units.items():
        for bname, b in unit.named_buffers():
            if b.is_meta:
                raise RuntimeError(f"{unit_name}: buffer {bname} has no initialiser")
    for unit_name in stage.units:
        frozen = (program.module(unit_name).frozen
                  if unit_name in {m.name for m in program.modules}
                  else next(p for p in program.projectors if p.name == unit_name).frozen)
        if frozen:
            stage.units[unit_name].requires_grad_(False)
    stage.train()


def build_stage(program: ir.Program, plan: Plan, role: RankRole, mesh: Any,
                device: torch.device, *, seed: int | None = None, run: Any = None,
                initialize: bool = True, compile: bool | None = None,
                phased: dict[str, Any] | None = None, phased_run: Any = None,
                ep: Any = None) -> Stage:
    """This rank's stage (module docstring). ``mesh``: the unit's DeviceMesh with
    dimensions ``("pp", "dp_replicate", "dp_shard", "tp")`` (``parallel.mesh``); ``run``:
    the stage's forward, ``run(stage_module, ...)``; ``initialize=False`` leaves the
    materialised values as they are (``dtc memcheck``'s fake tensors have none; a resumed
    run loads them from its checkpoint, or calls ``Stage.initialize`` when it has none);
    ``compile``: whether to compile the blocks (``train.compiled``; None: the spec's rule
    for ``device``, ``program.train.compiles``); ``phased``: on a backbone rank of a plan
    with phased encoders, their DeviceMeshes (``ProcessGroups.phased``): the stage holds
    each (``build_phased``, ``Stage.phased``), run by ``phased_run``; ``ep``: on a
    backbone rank of a unit with ep > 1, its ``parallel.mesh.ExpertGroups``
    (``ProcessGroups.ep``; ``_expert_parallel``)."""
    # FSDP2 warns of any view a root module returns (an in-place op on it would skip its
    # pre-backward hook); the stage's views (a DTensor's local tensor) are never written.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStageModule\) "
                            r"returned a view tensor")
    seed = program.train.seed if seed is None else seed
    hosted = hosted_units(plan, role)
    units, chunks = _stage_units(program, plan, role, hosted, seed)
    parts = _apply_parallelisms(units, program, plan, role, mesh, device, hosted=hosted,
                                run=run, compile=compile, ep=ep)
    # Only now is anything allocated: this rank's DP shards of its TP shards, each
    # element initialised from its position in the full tensor.
    _materialise(parts.module, program, device)
    built = _assemble(parts, program, role, hosted, chunks, mesh, device)
    _tie_across_stages(built, program, plan, mesh)
    _attach_phased(built, program, plan, device, seed=seed, meshes=phased, run=phased_run)
    if initialize:
        built.initialize(program, seed)
    return built


class _Parallel(NamedTuple):
    """A stage's units parallelised (``_apply_parallelisms``), still on meta."""

    module: StageModule
    tp_sharded: set[str]    # parameters sharded over TP, "<unit>.<param>"
    compiled: Any           # train.compiled.CompiledBlocks, or None
    layers: list[nn.Module]  # FSDP2 units, forward order


def _apply_parallelisms(units: dict[str, nn.Module], program: ir.Program, plan: Plan,
                        role: RankRole, mesh: Any, device: torch.device, *, hosted: list[Any],
                        run: Any, compile: bool | None, ep: Any) -> _Parallel:
    """Expert, tensor parallelism, recomputation, compilation and FSDP2, in that order
    (as torchtitan's ``parallelize.py``), over the meta ``units`` of a stage."""
    experts = _expert_parallel(units, plan, role, ep)
    tp_sharded = _apply_tp(units, [role.unit] + [h.name for h in hosted if not h.tp_replicated],
                           role, mesh)
    stage = StageModule(units, run)
    apply_ac(stage.units, lambda unit: _recomputes(program, plan, unit))
    compiled = _compile(stage, program, role, mesh, device, compile)
    # ZeRO-1: shard over DP; ZeRO-0: replicate over DP (HSDP with shards of one rank).
    experts = None if experts is None else _replica_mesh(experts, program)
    layers = apply_fsdp(stage, stage.units, _replica_mesh(mesh, program),
                        COMPUTE_DTYPES[program.train.precision], experts=experts)
    return _Parallel(stage, tp_sharded, compiled, layers)


def _assemble(parts: _Parallel, program: ir.Program, role: RankRole, hosted: list[Any],
              chunks: tuple[tuple[int, int], ...], mesh: Any, device: torch.device) -> Stage:
    """The ``Stage`` around a materialised stage module and its ``StageState``: its
    layers (``chunks``, per model chunk, as ``_stage_units`` gives them), the units it
    hosts, the VAEs of the generators whose latents it makes, and its TP group."""
    stage = parts.module
    start, stop = chunks[0][0], chunks[-1][1]
    chunks = chunks if len(chunks) > 1 else ()
    dtype = COMPUTE_DTYPES[program.train.precision]
    # A generator's VAE makes its latents where they enter it: its first stage.
    generators = ([role.unit] if role.role == "generator" and role.is_first_stage else []) + \
        [h.name for h in hosted if h.role == "generator"]
    names = tuple(h.name for h in hosted)
    stage.stage_state = StageState(program=program, role=role, start=start, stop=stop,
                                   dtype=dtype, vaes=_vaes(program, generators, device),
                                   hosted=names, chunks=chunks)
    return Stage(module=stage, role=role, start=start, stop=stop, chunks=chunks,
                 compute_dtype=dtype, tp_sharded=parts.tp_sharded, layers=parts.layers,
                 hosted=names, compiled=parts.compiled,
                 tp_group=mesh["tp"].get_group() if role.grid.tp > 1 else None)


def _expert_parallel(units: dict[str, nn.Module], plan: Plan, role: RankRole,
                     ep: Any) -> Any:
    """Expert parallelism on a backbone stage of a unit with ep > 1: each MoE block of
    the unit becomes ``parallel.ep.ExpertParallelMoE`` over ``ep.group`` (its EP group of
    ep consecutive DP replicas, ``parallel.mesh``), still on meta; its experts' FSDP2 mesh
    (``ep.mesh``, the expert DP group) is returned for ``apply_fsdp``. None at ep 1.
    ValueError when the unit has ep > 1 but ``ep`` was not given."""
    if role.role != "backbone" or plan.unit(role.unit).ep == 1:
        return None
    if ep is None:
        raise ValueError(f"{role.unit} has expert parallelism {plan.unit(role.unit).ep} but "
                         "the stage was given no EP groups (build_groups makes them: "
                         "ProcessGroups.ep)")
    from dtdsl.parallel.ep import apply_ep

    for block in apply_ep(units[role.unit], ep.group):
        block.experts_tp_mesh = ep.mesh["tp"]      # their TP split's (parallel.tp)
    return ep.mesh


def _stage_units(program: ir.Program, plan: Plan, role: RankRole, hosted: list[Any],
                 seed: int) -> tuple[dict[str, nn.Module], tuple[tuple[int, int], ...]]:
    """The units of ``role``'s stage on the meta device, in forward order (FSDP2 gathers
    and hooks follow it: co-located encoders and their projectors, the stage's own unit
    with only its layers and ends, its projector, co-located generators and theirs), and
    per model chunk its first and last-plus-one layer (``ir.plan.chunk_ranges``: one
    chunk but for an interleaved unit; (0, 0) for a generator on one stage, which runs
    whole: a U-Net, or a DiT at pp 1). A DiT over several stages holds its share of the
    blocks, its patch embedding and the projector into it on its first stage, its final
    projection on its last."""
    name = role.unit
    units: dict[str, nn.Module] = {name: build_unit(program, name, seed, device="meta")}
    chunks: tuple[tuple[int, int], ...] = ((0, 0),)
    if role.role == "generator" and role.grid.pp == 1:
        proj = projector_between(program, program.backbone.name, name)
        units[proj] = build_unit(program, proj, seed, device="meta")
    else:
        split = tuple(plan.unit(name).layers_per_stage)
        total = program.module(name).arch.layers
        if len(split) != role.grid.pp or sum(split) != total:
            raise ValueError(f"unit {name}: layers_per_stage {split} does not split its "
                             f"{total} layers over pp={role.grid.pp} stages")
        chunks = chunk_ranges(split, plan.unit(name).vpp)[role.stage]
        _owned_layers(units[name], chunks)
        _owned_ends(units[name], role)
        if role.is_last_stage and role.role == "encoder":
            proj = projector_between(program, name, program.backbone.name)
            units[proj] = build_unit(program, proj, seed, device="meta")
        if role.is_first_stage and role.role == "generator":
            proj = projector_between(program, program.backbone.name, name)
            units[proj] = build_unit(program, proj, seed, device="meta")
    for h in hosted:
        units[h.name] = build_unit(program, h.name, seed, device="meta")
        proj = _projector_of(program, h.name, h.role)
        units[proj] = build_unit(program, proj, seed, device="meta")
    order = [h.name for h in hosted if h.role == "encoder"]
    order = order + [_projector_of(program, n, "encoder") for n in order]
    order += [n for n in units if n not in order]
    return {n: units[n] for n in order}, chunks


def _attach_phased(built: Stage, program: ir.Program, plan: Plan, device: torch.device, *,
                   seed: int, meshes: dict[str, Any] | None, run: Any) -> None:
    """Build each phased encoder this backbone rank runs (``build_phased``) into
    ``built.phased``, on its DeviceMesh from ``meshes`` (``ProcessGroups.phased``)."""
    role = built.role
    for u in phased_units(plan, role):
        if meshes is None or u.name not in meshes:
            raise ValueError(f"rank {role.rank} runs phased encoder {u.name} but was given "
                             "no mesh for it (build_groups makes it: ProcessGroups.phased)")
        part = build_phased(program, plan, u.name, phased_role(plan, u, role.rank),
                            meshes[u.name], device, seed=seed, run=run)
        built.phased[u.name] = part
        built.tp_sharded |= part.tp_sharded
