"""Compiled blocks: ``torch.compile`` of every transformer layer and U-Net block of a stage.

Eager PyTorch spends host time on every operator: a 9b backbone layer under DTensor TP
costs ~13 ms of Python per microbatch where the GPU needs a few (issue 28). Compiling each
block on its own, as torchtitan's ``apply_compile`` does, turns a block's hundreds of
operators into a few fused kernels and one guarded call. ``build_stage`` applies it after
tensor parallelism (DTensor: dynamo traces the sharded ops and their collectives) and
activation checkpointing (a checkpointed block compiles as torch's checkpoint operator),
and before ``fully_shard``: FSDP2's hooks stay outside the compiled code (its all-gather
and reduce-scatter run between blocks, as eager).

What is compiled is each block's ``forward`` (set on the instance; the module tree, its
parameter names and FSDP2's hooks are unchanged): an encoder's and a backbone's layers, a
DiT's blocks, a U-Net's down, middle and up blocks (each level's resnets, attention and
resampling: its skip connections stay outside, between the blocks). Blocks of one class
share their compiled graphs (dynamo inlines ``nn.Module``s and guards on their structure,
not their identity), so a 40-layer backbone compiles one layer's graph, not forty.

**Varying shapes.** Microbatches differ in sequence length (padded to their longest), the
ViT's groups in image count and patches, a generator's in targets (each target's
conditioning is padded to ``COND_TOKENS`` rows). Before each call the varying dimensions
of a block's inputs are marked dynamic (``Marks``; the rest static), so the first compile
is already symbolic in them and a new length reuses the graph, while the weights' widths
stay static (kernels specialised for the model, not ``dynamic=True``'s symbolic widths):
a transformer block's batch and length (all but the last dimension), a U-Net block's
batch (its feature maps' channels and pixels and its context's rows are fixed). Dynamo
specialises a backed size of 0 or 1 (``maybe_mark_dynamic``): a group of one image, one
generation target, a microbatch of one sequence. An encoder layer's batch is therefore
``mark_unbacked`` (its one input, a group of same-sized images: no broadcasting over it),
so one graph serves groups of one image and of many; a backbone's rotation tables
broadcast over a batch of 1 (``[B or 1, ...]``), and inductor's convolutions assert wrong
strides for an unbacked batch (torch 2.13), so a backbone layer and a U-Net block keep a
graph for a batch of one and one for the rest. On the CPU
(``tests/train/test_compiled.py``, drawn groups of one to several images, generator
batches of 1 to 4): an encoder layer compiles 1 graph, a backbone layer at most 2, a
U-Net block at most 2; on CUDA inductor may also guard on a length's alignment (a
multiple of 8 or not) and on size thresholds of its fusion heuristics (4 graphs over 12
steps of 833..2048 tokens on an H200, ``benchmarks/step_vs_torch.py``).
``torch._dynamo.config.recompile_limit`` is raised to ``GRAPHS_PER_KIND`` (16) per kind
of block sharing a ``forward``. ``CompiledBlocks.graphs`` (and ``by_block``) counts the
graphs dynamo compiled during calls of the stage's blocks, each compile prints one line
on stderr with the block and the input shapes that caused it, and the executor's step
result carries the count as ``compiled_graphs`` (a TensorBoard scalar where the run logs
one).

Whether a rank compiles is ``program.train.compiles(device.type)`` (``ir.Train``): the spec's
``train { compile = ... }``, else on CUDA only.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtdsl.models.rope import Rotation
from dtdsl.models.transformer import Encoder

__all__ = ["GRAPHS_PER_KIND", "CompiledBlocks", "Marks", "apply_compile", "compiled_graphs",
           "compile_blocks"]

# The graphs one kind of block may compile before dynamo gives up on it and runs it eager:
# dynamic shapes leave size 0/1 specialisations (a batch of one), a graph with and without
# gradients (frozen units), and on CUDA inductor's guards on alignment and fusion sizes
# (4 graphs over 12 steps on an H200); 16 leaves room for those combined.
GRAPHS_PER_KIND = 16


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(eq=False)
class CompiledBlocks:
    """What ``apply_compile`` compiled on one stage."""

    blocks: list[str] = field(default_factory=list)   # "<unit>.<path>", forward order
    kinds: int = 0                                    # distinct structures among them
    # Graphs dynamo compiled during calls of these blocks (the first of each kind, then
    # one per new specialisation), whatever else the process compiles; and by block.
    graphs: int = 0
    by_block: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Marks:
    """Which dimensions of a block's tensor inputs vary between calls (``_mark_dynamic``).

    All but the last (the feature width the weights fix) vary, but in a U-Net's blocks
    (``maps``: feature maps ``[B, C, H, W]`` whose channels and pixels the spec fixes, a
    context of ``COND_TOKENS`` rows and its mask) only the batch; ``unbacked_batch``: the
    first (the batch, the same in every input) is an unbacked size sharing one symbol
    across the inputs, so a batch of one compiles no graph of its own (dynamo specialises
    a backed size of 1). Only where no input broadcasts over the batch: a backbone's
    rotation tables are ``[B or 1, ...]``."""

    maps: bool = False
    unbacked_batch: bool = False

    def varying(self, tensor: torch.Tensor) -> int:
        """How many leading dimensions of ``tensor`` vary."""
        return 1 if self.maps else tensor.dim() - 1


def compile_blocks(stage: nn.Module) -> Iterator[tuple[str, nn.Module, Marks]]:
    """``(name, block, marks)`` of every block ``apply_compile`` compiles in a
    ``StageModule`` (module docstring), in forward order; activation checkpointing's
    wrapper, when present, is the block. ``marks``: which dimensions of the block's
    inputs vary (``Marks``)."""
    for unit_name, unit in stage.units.items():
        layers = getattr(unit, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            # An encoder's layers take one tensor, a group of same-sized images: its image
            # count is often one. A backbone's take rotation tables that broadcast.
            marks = Marks(unbacked_batch=isinstance(unit, Encoder))
            for key, layer in layers.items():
                # An MoE layer's routing has data-dependent sizes (tokens per expert) and
                # a recompute guard dynamo cannot trace: it runs eager (not yet compiled).
                if getattr(layer, "moe", False):
                    continue
                yield f"{unit_name}.layers.{key}", layer, marks
        blocks = getattr(unit, "blocks", None)
        if isinstance(blocks, nn.ModuleDict) and not isinstance(layers, nn.ModuleDict):
            for key, block in blocks.items():
                yield f"{unit_name}.blocks.{key}", block, Marks()
        # A U-Net's feature maps have the spec's latent size (one per generator) and its
        # context COND_TOKENS rows (a short document's padded, models.multimodal): only
        # their batch (the microbatch's targets) varies. Symbolic rows and
        # columns would also make inductor trip over the convolutions' size checks, and
        # so does an unbacked batch (inductor's convolution layout asserts the wrong
        # strides, torch 2.13): a batch of one keeps a graph of its own, two per block.
        unet = Marks(maps=True)
        for part in ("down_blocks", "mid_block", "up_blocks"):
            found = getattr(unit, part, None)
            if isinstance(found, nn.ModuleList):
                for i, block in enumerate(found):
                    yield f"{unit_name}.{part}.{i}", block, unet
            elif isinstance(found, nn.Module):
                yield f"{unit_name}.{part}", found, unet


def _kind(block: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks share compiled graphs: their modules' classes and their
    parameters' shapes (local shapes: a TP shard compiles for its own)."""
    return (tuple(type(m).__qualname__ for m in block.modules()),
            tuple((n, tuple(getattr(p, "_local_tensor", p).shape))
                  for n, p in block.named_parameters()))


def _raise_limits(kinds_per_code: dict[Any, int], total_kinds: int) -> None:
    """Let each compiled function keep ``GRAPHS_PER_KIND`` graphs per kind of block that
    runs it (dynamo's limit is per code object, and an encoder's and a backbone's layers
    share ``TransformerLayer.forward``), never lowering a limit set before."""
    config = torch._dynamo.config
    per_code = GRAPHS_PER_KIND * max(kinds_per_code.values(), default=1)
    config.recompile_limit = max(config.recompile_limit, per_code)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                             GRAPHS_PER_KIND * total_kinds)


def _shapes(args: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]


def _mark_dynamic(value: Any, marks: Marks, batch: str = "batch") -> None:
    """Mark the varying dimensions (``marks``) of each tensor in a block's argument
    dynamic, and the others static (no automatic dynamic shape later: blocks of one class
    at different sizes, a U-Net's levels, compile apart rather than symbolic in their
    widths). ``maybe_mark_dynamic``, so a dimension the graph needs fixed is specialised
    without an error; the batch ``mark_unbacked`` where ``marks`` says so, one symbol
    (``batch``, its ``shape_id``) for every input. Looks into lists and tuples (a U-Net's
    skips) and a backbone's ``Rotation``."""
    if isinstance(value, torch.Tensor):
        varying = marks.varying(value)
        for dim in range(value.dim()):
            if dim == 0 and varying > 0 and marks.unbacked_batch:
                # The runtime's real size, not 8192, where inductor asks for a hint.
                torch._dynamo.decorators.mark_unbacked(value, 0, shape_id=batch,
                                                       hint_override=value.shape[0])
            elif dim < varying:
                torch._dynamo.maybe_mark_dynamic(value, dim)
            else:
                torch._dynamo.mark_static(value, dim)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark_dynamic(item, marks, batch)
    elif isinstance(value, Rotation):
        _mark_dynamic((value.cos, value.sin), marks, batch)


def _logged(name: str, compiled: Callable[..., Any], marks: Marks, rank: int,
            stats: CompiledBlocks) -> Callable[..., Any]:
    """``compiled``, its arguments' varying dimensions marked dynamic (``_mark_dynamic``),
    with one line on stderr for each graph dynamo compiles during one of its calls (rare
    and bounded; a counter read per call costs nothing)."""

    from torch._dynamo.utils import counters

    # Dynamo's counter read in place (``compiled_graphs``'s import and call cost a few
    # microseconds a block, on the host's critical path every microbatch).
    stats_of = counters.__getitem__

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        _mark_dynamic(args, marks)
        if kwargs:
            _mark_dynamic(tuple(kwargs.values()), marks)
        before = stats_of("stats")["unique_graphs"]
        out = compiled(*args, **kwargs)
        after = stats_of("stats")["unique_graphs"]
        if after != before:
            stats.graphs += after - before
            stats.by_block[name] = stats.by_block.get(name, 0) + after - before
            print(f"rank {rank}: {name} compiled {after - before} graph(s) for inputs "
                  f"{_shapes(args)} ({after} in this process)", file=sys.stderr, flush=True)
        return out

    return call


def _cacheable_attention() -> None:
    """Let AOTAutograd's cache keep graphs with attention: dynamo writes
    ``dense_attention``'s ``sdpa_kernel`` into the graph as calls of
    ``torch.nn.attention``'s ``_backend_from_string`` (a name to an enum) and
    ``_sdpa_kernel`` (sets the backends, as the context does), functions of torch the cache
    does not know, so it bypassed every such graph: each rank and each restart traced and
    partitioned it anew. Keyed by torch's version, as they are torch's; named as the cache
    names a graph's function (a renamed one fails here, not silently)."""
    from torch._inductor import config
    from torch.nn import attention

    for fn in (attention._backend_from_string, attention._sdpa_kernel):
        config.unsafe_marked_cacheable_functions.setdefault(
            f"{fn.__module__}.{fn.__name__}", torch.__version__)


def apply_compile(stage: nn.Module, *, rank: int = 0) -> CompiledBlocks:
    """Compile every block of ``stage`` (a ``StageModule``) in place (module docstring):
    after tensor parallelism and activation checkpointing, before ``fully_shard``."""
    out = CompiledBlocks()
    _cacheable_attention()
    kinds: dict[Any, set[tuple[Any, ...]]] = {}
    for name, block, marks in list(compile_blocks(stage)):
        code = type(block).forward.__code__
        kinds.setdefault(code, set()).add(_kind(block))
        # The bound forward compiled: hooks (FSDP2's, added later) run around it, and the
        # parameters keep their names.
        block.forward = _logged(name, torch.compile(block.forward), marks, rank, out)
        out.blocks.append(name)
    out.kinds = sum(len(k) for k in kinds.values())
    _raise_limits({c: len(k) for c, k in kinds.items()}, out.kinds)
    return out
