"""DistTrain's profiler: the measuring half of ``cost.profile``. ``profile_program`` builds
each module's torch model (``dtdsl.models``) at every tensor-parallel degree it may run
at (one TP rank's shard, timed on one device) and times forward and backward passes at a
small grid of sizes ``x`` (``cost.profile`` says what ``x`` means per role, and holds the
``Profile`` schema and the table the cost model interpolates). Transformers are profiled
per layer: one layer (``build_layer``) is timed and multiplied by the layer count, and
the embedding and head (backbone) or the patch embedding (encoder) are measured as a
separate part and added, so even one layer of a 70B backbone fits on a CPU. U-Nets, DiTs
and projectors are timed whole.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import numpy as np

from dtdsl.cost.flops import input_needs_grad
from dtdsl.cost.profile import (
    DeviceInfo,
    ModuleProfile,
    PartPoint,
    Point,
    Profile,
    _arch_sha256,
)
from dtdsl.cost.samples import draw
from dtdsl.ir import program as ir
from dtdsl.ir.program import COND_TOKENS

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = ["default_points", "default_tps", "profile_program"]

_TIMESTEPS = 1000


def _unit_of(program: ir.Program, proj: ir.Projector) -> ir.Module:
    """The module whose parallelism unit runs a projector: an encoder's projector runs
    on the encoder's ranks, a generator's on the generator's (as in DistTrain)."""
    source = program.module(proj.source)
    return source if source.role != "backbone" else program.module(proj.target)


def _conflicts(program: ir.Program, name: str, tp: int) -> tuple[str, ...]:
    from dtdsl.models import projector_tp_conflicts

    for proj in program.projectors:
        if proj.name == name:
            return projector_tp_conflicts(proj.arch, tp)
    return program.module(name).arch.tp_conflicts(tp)


def default_tps(program: ir.Program, name: str) -> tuple[int, ...]:
    """The TP degrees (up to 8) a module's constraints allow and its architecture can
    split; a projector's are those of the module whose unit runs it."""
    unit = name
    for proj in program.projectors:
        if proj.name == name:
            unit = _unit_of(program, proj).name
    candidates = program.constraints_for(unit).tp.candidates(8)
    return tuple(tp for tp in candidates if not _conflicts(program, name, tp))


def _sequence_points(seq_len: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, seq_len // d) for d in (8, 4, 2, 1)}))


def _item_points(data: ir.Data, modality: str) -> tuple[int, ...]:
    """Item sizes (tokens) the spec's data produces: its distinct values if few, else
    the smallest, median and largest of a fixed draw."""
    rng = np.random.default_rng(0)
    n = 4096
    if modality == "image":
        keys = [("image", "patches")]
    elif modality == "audio":
        keys = [("audio", "frames")]
    else:
        keys = [(modality, "frames"), (modality, "patches")]
    quantities = [data.get(m, q) for m, q in keys]
    if any(q is None for q in quantities):
        return (64, 256, 1024)
    sizes = np.ones(n, dtype=np.int64)
    for q in quantities:
        sizes = sizes * draw(q, n, rng)
    sizes = np.maximum(sizes, 1)
    distinct = np.unique(sizes)
    if len(distinct) > 4:
        distinct = np.unique(np.rint(np.quantile(sizes, [0.0, 0.5, 1.0])).astype(np.int64))
    values = tuple(int(v) for v in distinct)
    if len(values) == 1:   # a second point gives the slope for other sizes
        values = tuple(sorted({max(1, values[0] // 2), values[0]}))
    return values


def default_points(program: ir.Program, name: str) -> tuple[int, ...]:
    """The sizes ``x`` a module or projector is measured at by default: backbone and
    projectors seq_len / 8, / 4, / 2 and seq_len tokens; encoders the item sizes of
    the data spec; generators 1, 2 and 4 items."""
    if any(p.name == name for p in program.projectors):
        return _sequence_points(program.train.seq_len)
    module = program.module(name)
    if module.role == "backbone":
        return _sequence_points(program.train.seq_len)
    if module.role == "encoder":
        return _item_points(program.data, module.modality)
    return (1, 2, 4)


# ---- measuring -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Env:
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def prepare(self, model: nn.Module, trainable: bool) -> nn.Module:
        model = model.to(device=self.device, dtype=self.dtype).train()
        for p in model.parameters():
            p.requires_grad_(trainable)
        return model

    def randn(self, *shape: int, grad: bool = False) -> torch.Tensor:
        import torch

        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=grad)


@dataclass(frozen=True)
class _Part:
    """A part to time: ``case(x)`` makes its inputs and returns a function that runs
    its forward and returns the outputs to backpropagate from."""

    name: str
    count: int
    models: tuple[nn.Module, ...]
    case: Callable[[int], Callable[[], list[torch.Tensor]]]
    grad: bool   # does its forward need autograd (any parameter or input wants gradients)


@dataclass(frozen=True)
class _Job:
    name: str
    role: str
    kind: str
    method: str
    arch_sha256: str
    tps: tuple[int, ...]
    xs: tuple[int, ...]
    build: Callable[[int, _Env], list[_Part]]


def _transformer_parts(module: ir.Module, needs_grad: bool, tp: int, env: _Env) -> list[_Part]:
    import torch

    from dtdsl.models import Backbone, Encoder, build_layer

    arch = module.arch
    trainable = not module.frozen
    # Inside the stack a layer's input comes from the layer before it, which trains
    # whenever the module does.
    layer_grad = trainable or needs_grad
    layer = env.prepare(build_layer(module, tp), trainable)

    def layer_case(x: int):
        h = env.randn(1, x, arch.hidden, grad=layer_grad)
        return lambda: [layer(h)]

    parts = [_Part("layer", arch.layers, (layer,), layer_case, layer_grad)]
    ends_arch = arch.model_copy(update={"layers": 0})
    if module.role == "backbone":
        ends = env.prepare(Backbone(ends_arch, tp=tp), trainable)

        def ends_case(x: int):
            tokens = torch.randint(0, arch.vocab, (1, x), device=env.device)
            h = env.randn(1, x, arch.hidden, grad=layer_grad)   # the last layer's output

            def run():
                outs = [ends.output(ends.norm(h))]
                embeds = ends.embed(tokens)
                if embeds.requires_grad:
                    outs.append(embeds)
                return outs
            return run

        parts.append(_Part("embed_head", 1, (ends,), ends_case, layer_grad))
    else:
        ends = env.prepare(Encoder(ends_arch, tp=tp), trainable)

        def patch_case(x: int):
            if ends.whisper:
                # Whisper's stem on x tokens' 2x frames (the module takes 30 s clips
                # only; its convolutions take any length, at the same cost per frame).
                import torch.nn.functional as F

                stem = ends.patch_embed
                frames = env.randn(1, ends.in_channels, 2 * x)
                return lambda: [ends.finish(F.gelu(stem.conv2(F.gelu(stem.conv1(frames))))
                                            .transpose(1, 2))]
            patches = env.randn(1, x, ends.patch_dim)   # raw data: no gradient
            return lambda: [ends.finish(ends.embed(patches))]

        parts.append(_Part("patch_embed", 1, (ends,), patch_case, trainable))
    return parts


def _generator_parts(module: ir.Module, needs_grad: bool, tp: int, env: _Env) -> list[_Part]:
    import torch

    from dtdsl.models import build_module

    arch = module.arch
    trainable = not module.frozen
    model = env.prepare(build_module(module, tp), trainable)

    def case(x: int):
        latent = env.randn(x, arch.latent_channels, arch.latent, arch.latent)
        timesteps = torch.randint(0, _TIMESTEPS, (x,), device=env.device)
        context = env.randn(x, COND_TOKENS, arch.context_dim, grad=needs_grad)
        return lambda: [model(latent, timesteps, context)]

    return [_Part("whole", 1, (model,), case, trainable or needs_grad)]


def _projector_parts(proj: ir.Projector, needs_grad: bool, tp: int, env: _Env) -> list[_Part]:
    from dtdsl.models import build_projector

    trainable = not proj.frozen
    model = env.prepare(build_projector(proj, tp), trainable)

    def case(x: int):
        # x: the tokens its MLP runs on (a compressing projector's output tokens, as the
        # cost model queries it). A resampler's own cross-attention is not measured: the
        # analytic model prices it, a profile does not yet.
        inputs = env.randn(1, x, proj.arch.in_dim, grad=needs_grad)
        return lambda: [model.mlp(inputs)]

    return [_Part("whole", 1, (model,), case, trainable or needs_grad)]


def _check_requests(program: ir.Program, names: list[str], request: Mapping | None,
                    what: str) -> None:
    if request is None:
        return
    unknown = [n for n in request if n not in names]
    if unknown:
        raise ValueError(f"{what} given for {', '.join(map(repr, unknown))}, which the spec "
                         f"does not define (modules and projectors: {', '.join(names)})")
    for name, values in request.items():
        if not values or any(int(v) != v or v < 1 for v in values):
            raise ValueError(f"{what} for '{name}' must be positive integers, not {values!r}")


def _jobs(program: ir.Program, tps: Mapping[str, Sequence[int]] | None,
          points: Mapping[str, Sequence[int]] | None) -> list[_Job]:
    names = [m.name for m in program.modules] + [p.name for p in program.projectors]
    _check_requests(program, names, tps, "TP degrees")
    _check_requests(program, names, points, "points")
    jobs = []
    for name in names:
        job_tps = tuple(sorted(set(tps[name]))) if tps and name in tps else \
            default_tps(program, name)
        for tp in job_tps:
            conflicts = _conflicts(program, name, tp)
            if conflicts:
                raise ValueError(f"'{name}' cannot be split {tp} ways: "
                                 f"{', '.join(conflicts)}")
        xs = tuple(sorted(set(points[name]))) if points and name in points else \
            default_points(program, name)
        proj = next((p for p in program.projectors if p.name == name), None)
        if proj is not None:
            source = program.module(proj.source)
            grad = not source.frozen or input_needs_grad(program, source)
            jobs.append(_Job(name, "projector", "mlp", "whole", _arch_sha256(proj.arch),
                             job_tps, xs,
                             lambda tp, env, p=proj, g=grad: _projector_parts(p, g, tp, env)))
            continue
        module = program.module(name)
        grad = input_needs_grad(program, module)
        if isinstance(module.arch, ir.TransformerArch):
            build, method = _transformer_parts, "per_layer"
        else:
            build, method = _generator_parts, "whole"
        jobs.append(_Job(name, module.role, module.arch.kind, method,
                         _arch_sha256(module.arch), job_tps, xs,
                         lambda tp, env, m=module, g=grad, b=build: b(m, g, tp, env)))
    return jobs


def _measure(part: _Part, x: int, env: _Env, repeats: int,
             warmup: int) -> tuple[float, float, int, int]:
    """Median forward and backward time of ``repeats`` timed passes after ``warmup``
    untimed ones (at least one, so that gradient buffers exist), then the saved
    bytes and peak memory of one more pass."""
    import torch

    run = part.case(x)
    grads: list[torch.Tensor] = []

    def once() -> tuple[float, float]:
        with torch.set_grad_enabled(part.grad):
            env.sync()
            start = time.perf_counter()
            outs = run()
            env.sync()
            mid = time.perf_counter()
        if not part.grad:
            return mid - start, 0.0
        if not grads:
            grads.extend(torch.randn_like(o) for o in outs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        env.sync()
        return mid - start, time.perf_counter() - mid

    for _ in range(max(warmup, 1)):
        once()
    fwd, bwd = zip(*(once() for _ in range(repeats)), strict=True)

    # Weights are saved for backward too; they are not activations.
    weights = {p.untyped_storage().data_ptr() for m in part.models for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    if env.cuda:
        env.sync()
        torch.cuda.reset_peak_memory_stats(env.device)
        before = torch.cuda.memory_allocated(env.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        once()
    saved_bytes = sum(saved.values())
    peak = torch.cuda.max_memory_allocated(env.device) - before if env.cuda else saved_bytes
    return statistics.median(fwd), statistics.median(bwd), saved_bytes, max(peak, saved_bytes)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def profile_program(program: ir.Program, *,
                    tps: Mapping[str, Sequence[int]] | None = None,
                    points: Mapping[str, Sequence[int]] | None = None,
                    repeats: int = 3, warmup: int = 1,
                    device: str | torch.device | None = None,
                    num_threads: int | None = 1,
                    progress: Callable[[int, int, str], None] | None = None) -> Profile:
    """Measure every module and projector of ``program``.

    ``tps`` and ``points`` map module or projector names to the TP degrees and sizes
    to measure; names left out get ``default_tps`` and ``default_points``. Each point
    is the median of ``repeats`` timed passes after ``warmup`` untimed ones.
    ``device`` defaults to CUDA when available (bf16), else the CPU (fp32).
    ``num_threads``: torch's intra-op threads while profiling on a CPU (restored
    afterwards; None keeps the current setting). One by default: a CPU run puts one
    gloo rank on each core, and multi-threaded timings of small operators swing by
    10x or more when another process shares the cores.
    ``progress(done, total, label)`` is called after each point. Raises ValueError
    for names the spec does not define or TP degrees an architecture cannot split.
    The caller's random state is left as it was."""
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, not {repeats} and {warmup}")
    dev = torch.device(device if device is not None else
                       "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"can profile on a CPU or a CUDA device, not {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("cannot profile on CUDA: torch sees no CUDA device here")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    env = _Env(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, not {num_threads}")
    jobs = _jobs(program, tps, points)
    previous_threads = torch.get_num_threads()
    try:
        if num_threads is not None and not env.cuda:
            torch.set_num_threads(num_threads)
        with torch.random.fork_rng(devices=[dev.index] if env.cuda else []):
            torch.manual_seed(0)
            modules = _run_jobs(jobs, env, repeats, warmup, progress)
            optimizer = _optimizer_s_per_param(program, env, repeats, warmup)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    device_info = DeviceInfo(
        type=dev.type,
        name=torch.cuda.get_device_name(dev) if env.cuda else _cpu_name(),
        torch_version=torch.__version__,
        dtype="bf16" if env.cuda else "fp32",
        num_threads=threads)
    return Profile(device=device_info, created=datetime.now(UTC),
                   spec=program.name, spec_sha256=program.source_sha256,
                   repeats=repeats, warmup=warmup, modules=modules,
                   optimizer_s_per_param=optimizer)


def _optimizer_s_per_param(program: ir.Program, env: _Env, repeats: int,
                           warmup: int) -> float:
    """The spec's optimizer step per parameter, as the runtime takes it
    (``train.optim.StageOptimizer``: fp32 parameters, fused or foreach kernel), timed on
    a few tensors of 4M (CPU) or 64M (CUDA) parameters in all: the median of
    ``repeats`` steps after ``warmup`` (at least one: the first step allocates the
    moments)."""
    import torch

    from dtdsl.train.optim import _kernel

    total = (1 << 26) if env.cuda else (1 << 22)
    params = [torch.zeros(total // 4, dtype=torch.float32, device=env.device,
                          requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = program.train.optimizer
    cls = torch.optim.AdamW if opt.name == "adamw" else torch.optim.Adam
    optimizer = cls(params, lr=1e-4, **_kernel(env.device))
    times = []
    for k in range(max(warmup, 1) + repeats):
        env.sync()
        start = time.perf_counter()
        optimizer.step()
        env.sync()
        if k >= max(warmup, 1):
            times.append(time.perf_counter() - start)
    return statistics.median(times) / total


def _point(tp: int, x: int, stats: list[tuple[_Part, float, float, int, int]]) -> Point:
    return Point(
        tp=tp, x=x,
        fwd_time_s=sum(p.count * fwd for p, fwd, _, _, _ in stats),
        bwd_time_s=sum(p.count * bwd for p, _, bwd, _, _ in stats),
        # Every copy's stash is held at once (the backward runs after all forwards);
        # on top of them, the largest transient working set of any one part.
        peak_memory_bytes=sum(p.count * saved for p, _, _, saved, _ in stats) +
        max(peak - saved for _, _, _, saved, peak in stats),
        parts=tuple(PartPoint(name=p.name, count=p.count, fwd_time_s=fwd, bwd_time_s=bwd,
                              saved_bytes=saved, peak_memory_bytes=peak)
                    for p, fwd, bwd, saved, peak in stats))


def _run_jobs(jobs: list[_Job], env: _Env, repeats: int, warmup: int,
              progress: Callable[[int, int, str], None] | None) -> tuple[ModuleProfile, ...]:
    import torch

    total = sum(len(j.tps) * len(j.xs) for j in jobs)
    done = 0
    results = []
    for job in jobs:
        points = []
        backward = False
        for tp in job.tps:
            # Built once per tp, reused for every x: building dominates for small models.
            parts = job.build(tp, env)
            backward = backward or any(p.grad for p in parts)
            for x in job.xs:
                stats = [(part, *_measure(part, x, env, repeats, warmup)) for part in parts]
                points.append(_point(tp, x, stats))
                done += 1
                if progress is not None:
                    progress(done, total, f"{job.name} tp={tp} x={x}")
            del parts
            if env.cuda:
                torch.cuda.empty_cache()
        results.append(ModuleProfile(
            name=job.name, role=job.role, kind=job.kind, method=job.method,
            arch_sha256=job.arch_sha256, backward=backward, points=tuple(points)))
    return tuple(results)
