"""The peak memory of one rank of a distributed training job, measured on a CPU-only host.

A paper-scale job (e.g. rank 37 of 1170, a 72B backbone stage with TP 8 and DP 4 under
FSDP2) cannot be run here, but one rank of it can be *replayed*: every tensor is a
``FakeTensor`` (shape, dtype and device, no data), every collective goes to torch's fake
process group (it returns at once and moves nothing), and torch's ``MemTracker`` counts the
bytes of every tensor storage alive at each op. The rank runs its real code path — the
same modules, DTensor tensor parallelism, ``fully_shard``, autograd and optimizer — on the
shapes it would see, so what it holds at its peak is what it would hold on the GPU, up to
the caching allocator (fragmentation and reserved-but-free blocks are not modelled; each
storage is rounded up to ``allocation_granularity_bytes`` as the CUDA allocator does).

Usage::

    with fake_world(world_size=1170, rank=37) as world:
        mesh = world.device_mesh(range(32, 96), (2, 4, 8), ("pp", "dp", "tp"))
        with torch.device("meta"):
            stage = build_stage(...)                     # the real runtime modules
        parallelize_module(..., mesh["tp"], plan)         # TP / SP
        fully_shard(block, mesh=mesh["dp"], mp_policy=..., reshard_after_forward=False)
        stage.to_empty(device=world.device)               # fake storage, no bytes
        opt = torch.optim.AdamW(stage.parameters(), fused=True)
        init_optimizer_state(opt)                          # as after the first step

        def step():
            outs = [stage(microbatch()) for _ in range(k)] # k microbatches in flight
            for out in outs: out.backward(grad_like(out))
            del outs
            opt.step(); opt.zero_grad()

        report = measure_peak(step, track=(stage, opt))
    report.peak_bytes, report.by_category

Rules for the measured code:

* **Device "cpu".** The fake world pretends to be on the CPU: with a CPU-only build of
  torch, autograd on fake ``cuda`` tensors aborts the process (its ``AccumulateGrad``
  asks for a CUDA device guard; an uncatchable C++ error), FSDP2 calls ``torch.cuda``
  (streams, events, ``current_device``), and ``torch.autocast("cuda")`` silently turns
  itself off. :func:`fake_world` therefore accepts ``"cuda"`` only where CUDA is really
  available. Memory does not depend on the device type, except: the allocator rounding
  (emulated), the attention kernel (CPU flash attention keeps the output and the
  log-sum-exp, as CUDA flash attention does), and ``torch.autocast("cpu")``'s op lists,
  which differ a little from CUDA's (mixed precision through FSDP's ``param_dtype`` is
  the same on both).
* **Build everything inside the world**, on the meta device, and materialise with
  ``to_empty(device=world.device)`` after ``parallelize_module`` and ``fully_shard`` (or
  build directly on ``world.device``): tensors are then fake. ``.to()`` on a module of
  fake parameters fails ("Couldn't swap Linear.weight"). A real tensor reaching a fake
  op raises (``FakeTensorMode`` without ``allow_non_fake_inputs``), so nothing real is
  allocated by mistake. DeviceMeshes are built with the fake mode switched off (their rank
  tables are real integer tensors; :func:`fake_world` patches ``DeviceMesh.__init__``
  for its duration, which also covers the mesh ``fully_shard`` builds for TP + FSDP).
* **Keep attention on local tensors** (``ColwiseParallel()`` with the default
  ``use_local_output=True`` on q/k/v): DTensor has no sharding rule for the CPU flash
  attention op.
* **Tensors made before** :func:`measure_peak` are invisible to it unless they are the
  parameters or buffers of a module that runs forward inside it, the state of an optimizer
  that steps inside it, or are passed in ``track``. Make the inputs inside ``step_fn``.
* **A steady-state step**: the optimizer state is created in the first step, so a first
  step alone under-states the forward/backward peak. Either run two steps in ``step_fn``
  or (half the cost) :func:`init_optimizer_state` first and ``track`` the optimizer.
* **Cost**: every op goes through Python (DTensor, FakeTensor and the tracker), about
  0.1 s of CPU per transformer layer and microbatch (forward and backward), whatever the
  tensor sizes.

What ``by_category`` means (bytes alive at the moment of the peak; they sum to
``peak_bytes``): ``params`` the module parameters, which under FSDP2 are the sharded fp32
parameters plus the unsharded (all-gathered, ``param_dtype``) ones while they exist;
``buffers``; ``grads`` parameter gradients (sharded ones after the reduce-scatter);
``activations`` what the forward makes (saved activations, outputs, FSDP's all-gather
buffers); ``temporaries`` what the backward makes besides parameter gradients (gradients
of activations, unsharded gradients before the reduce-scatter); ``optimizer_state``
everything the optimizer step makes, its state included; ``other`` tensors passed in
``track``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools import mem_tracker as _mem_tracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_leaves

__all__ = [
    "CATEGORIES",
    "CUDA_ALLOCATION_GRANULARITY_BYTES",
    "FakeWorld",
    "InFlight",
    "MemoryReport",
    "fake_world",
    "init_optimizer_state",
    "measure_held_peaks",
    "measure_peak",
]

CUDA_ALLOCATION_GRANULARITY_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of this."""

# MemTracker's reference types -> our category names, in report order.
_CATEGORY_OF = {
    _mem_tracker._MemRefType.PARAM: "params",
    _mem_tracker._MemRefType.BUFFER: "buffers",
    _mem_tracker._MemRefType.GRAD: "grads",
    _mem_tracker._MemRefType.ACT: "activations",
    _mem_tracker._MemRefType.TEMP: "temporaries",
    _mem_tracker._MemRefType.OPT: "optimizer_state",
    _mem_tracker._MemRefType.OTH: "other",
}
CATEGORIES: tuple[str, ...] = tuple(_CATEGORY_OF.values())
"""The keys of :attr:`MemoryReport.by_category`, in order."""

_PHASES = ("forward", "backward", "optimizer")
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class MemoryReport:
    """What one rank held while ``step_fn`` ran (see the module docstring for categories).

    ``peak_bytes``: the most bytes of tensor storage alive at once; ``by_category``: those
    bytes split by what the tensors were (sums to ``peak_bytes``); ``peak_phase``: where
    the peak happened, ``"forward"`` (also: outside any module and outside backward, e.g.
    the loss), ``"backward"`` or ``"optimizer"``; ``final_bytes`` / ``final_by_category``:
    what was still alive when ``step_fn`` returned (with ``step_fn``'s locals gone: the
    parameters, gradients not set to None, the optimizer state)."""

    peak_bytes: int
    by_category: Mapping[str, int]
    peak_phase: str
    final_bytes: int
    final_by_category: Mapping[str, int]

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**30:.3f}" for k, v in self.by_category.items() if v)
        return f"peak {self.peak_bytes / 2**30:.3f} GiB in {self.peak_phase} ({parts})"


@dataclass(frozen=True)
class FakeWorld:
    """One rank's view of a fake job: ``world_size`` ranks of which this process is
    ``rank``, tensors on ``device`` (fake), collectives to the fake process group."""

    world_size: int
    rank: int
    device: torch.device
    fake_mode: FakeTensorMode

    def device_mesh(
        self,
        ranks: Iterable[int],
        shape: Sequence[int],
        dim_names: Sequence[str],
    ) -> DeviceMesh:
        """A DeviceMesh over the global ``ranks`` (row-major into ``shape``), e.g. one
        unit's ranks ``range(first, first + pp * dp * tp)`` as ``(pp, dp, tp)``. It must
        contain this rank; slice it (``mesh["tp"]``, ``mesh["dp", "tp"]``) for the TP and
        FSDP meshes, so that ``fully_shard`` can combine them."""
        ranks = list(ranks)
        if math.prod(shape) != len(ranks) or len(shape) != len(dim_names):
            raise ValueError(f"{len(ranks)} ranks do not fill a mesh of shape {tuple(shape)} "
                             f"named {tuple(dim_names)}")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"mesh ranks must be distinct ranks of the world of "
                             f"{self.world_size}: {ranks}")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in the mesh's ranks {ranks}")
        with unset_fake_temporarily():
            table = torch.tensor(ranks, dtype=torch.int64).reshape(tuple(shape))
            return DeviceMesh(self.device.type, table, mesh_dim_names=tuple(dim_names))


def _init_mesh_without_fake(orig_init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig_init)
    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            orig_init(self, *args, **kwargs)

    return init


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, device_type: str = "cpu") -> Iterator[FakeWorld]:
    """Be ``rank`` of a fake job of ``world_size`` ranks for the duration of the block.

    Sets up the default process group on torch's fake backend, a ``FakeTensorMode``
    (entered for the block) and the ``DeviceMesh`` patch the module docstring explains,
    and empties DTensor's sharding-propagation caches; on exit undoes all of it
    (``destroy_process_group``), so worlds can follow one another in one process and a
    measurement does not depend on what ran before it. No other process group may exist
    in the process. ``device_type`` is ``"cpu"``, or ``"cuda"`` only where CUDA is
    available (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', not {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device_type 'cuda' needs a CUDA build of torch with a GPU: on a CPU-only "
            "build autograd aborts the process on fake CUDA tensors; use 'cpu' (the "
            "measured memory is the same, see dtdsl.train.memcheck)")
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; fake_world makes its own")
    # Importing fake_pg registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _clear_sharding_caches()
    try:
        with (
            mock.patch.object(DeviceMesh, "__init__", _init_mesh_without_fake(DeviceMesh.__init__)),
            FakeTensorMode() as fake_mode,
        ):
            device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
            yield FakeWorld(world_size, rank, device, fake_mode)
    finally:
        _clear_sharding_caches()
        dist.destroy_process_group()
        gc.collect()


def _clear_sharding_caches() -> None:
    """Empty DTensor's caches of sharding propagation. Their entries hold the meshes (and
    through them the process groups) of the world that filled them, and an entry found
    for an equal mesh of a later world would skip the shape propagation, so a measurement
    would depend on what ran before it in the process."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def _ignoring_propagation(tracker: _StepTracker, inner: Any) -> Any:
    """Wraps ``ShardingPropagator._propagate_tensor_meta_non_cached`` (DTensor's
    output-shape propagation, a method of the same name in every torch this project runs
    on) to tell the tracker to ignore what it allocates: inside an outer
    ``FakeTensorMode`` the propagation reuses that mode and makes fake tensors of the
    *global* shapes, which ``MemTracker`` cannot tell from real ones."""

    @functools.wraps(inner)
    def propagate(self: Any, op_schema: Any) -> Any:
        tracker.propagating += 1
        try:
            return inner(self, op_schema)
        finally:
            tracker.propagating -= 1

    return propagate


class _StepTracker(_mem_tracker.MemTracker):
    """``MemTracker`` for a training step: ignores DTensor's shape propagation, allows a
    root module to run forward more than once (microbatches, steps), keeps only the
    global peak and notes the phase of the peak.

    Its accounting is MemTracker's (the same storages, categories and peak); what it
    leaves out is MemTracker's per-module statistics (a snapshot copied at every module
    call, a pass over every module at every op), which no report here reads, and the
    per-op overheads of its dispatch (a pytree map that builds a fresh wrapper per op, a
    second dynamo-disabled frame): every op of every layer and microbatch goes through
    ``__torch_dispatch__``, and with MemTracker's own the tracker took some 40% of a
    replay's CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.propagating = 0
        self._saved_propagate: Any = None
        # Bytes per device and category held by work the step stands for but does not
        # run (``InFlight.hold``): counted in every peak while set.
        self.virtual: dict[Any, dict[Any, int]] = {}
        # ``measure_held_peaks``: the counts of held work, and per count its own peak
        # (per device: total, snapshot) and phase; ``virtual`` is then what one held
        # piece of work holds, counted ``n`` times in count ``n``'s peak. None
        # (``measure_peak``): one peak, ``virtual`` counted once.
        self.holds: tuple[int, ...] | None = None
        self.held_peaks: list[dict[Any, tuple[int, dict[Any, int]]]] = []
        self.held_phases: list[str] = []

    def __enter__(self) -> _StepTracker:
        if self._depth == 0:
            # None in eager, the replay's FakeTensorMode under it: ops that run under
            # another mode are DTensor's propagation (torch 2.13's MemTracker keeps this
            # too; set here for the torch of GPU hosts, whose tracker does not).
            self._fake_mode_on_entry = active_fake_mode()
            self._saved_propagate = ShardingPropagator._propagate_tensor_meta_non_cached
            ShardingPropagator._propagate_tensor_meta_non_cached = _ignoring_propagation(
                self, self._saved_propagate)
        first = self._depth == 0
        try:
            super().__enter__()
        except BaseException:
            if self._depth == 0:
                ShardingPropagator._propagate_tensor_meta_non_cached = self._saved_propagate
            raise
        if first:
            # Every count starts where MemTracker starts its peak: what is alive now.
            start = {dev: (total, dict(self._peak_mem_snap[dev]))
                     for dev, total in self._peak_mem.items()}
            self.held_peaks = [dict(start) for _ in self._counts]
            self.held_phases = ["forward"] * len(self._counts)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._depth == 0:
                ShardingPropagator._propagate_tensor_meta_non_cached = self._saved_propagate

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # MemTracker.__torch_dispatch__, step for step (see its comments).
        kwargs = kwargs or {}
        if self.propagating:
            return func(*args, **kwargs)
        if DTensor in types:
            return NotImplemented       # DTensor runs first, then its local ops come here
        fake = active_fake_mode()       # the same after ``func``: modes nest
        if func is _WAIT_TENSOR and fake:
            res = args[0]
        else:
            res = func(*args, **kwargs)
        if fake is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _mem_tracker._MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _mem_tracker._MemRefType.TEMP
            else:
                reftype = _mem_tracker._MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            else:
                for t in tree_leaves(res):
                    if isinstance(t, torch.Tensor):
                        self._track(reftype, t)
            self._update_peak_stats(None)
        return res

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # MemTracker's, less the per-module snapshots. A root module's next forward (the
        # next microbatch) starts afresh, as after ``reset_mod_stats`` (MemTracker would
        # refuse it): every module's parameters and gradients are tracked again.
        is_bw = self._mod_tracker.is_bw
        if module in self.memory_tracking and not is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.memory_tracking.clear()
        if module not in self.memory_tracking:
            name = self._mod_tracker.get_known_fqn(module)
            if name is None:
                raise AssertionError("a module the ModTracker does not know")
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self.memory_tracking[module] = _mem_tracker._ModMemStats(name)
        elif is_bw and self._ac_mod is None:
            # The outermost module recomputed in backward (activation checkpointing):
            # what it makes are activations again.
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        pass

    def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                         install_grad_hooks: bool = True) -> Any:
        # MemTracker hooks every parameter's gradient, and a frozen one (no grad) cannot
        # take a hook: a module holding any has its gradients counted by the ops that
        # make them (as temporaries) instead of by the hooks.
        hooks = install_grad_hooks and all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks=hooks)

    @property
    def _counts(self) -> tuple[int, ...]:
        return (1,) if self.holds is None else self.holds

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Each count ``n``'s peak with ``n`` times the held bytes (``virtual``): integer
        for integer what a tracker holding ``n`` of them finds (the held total summed
        once an op, not once a count)."""
        for dev, snap in self._curr_mem_snap.items():
            held = self.virtual.get(dev, {})
            held_total = sum(held.values()) if held else 0
            base = snap[_mem_tracker._TOTAL_KEY]
            for j, n in enumerate(self._counts):
                total = base + n * held_total
                peaks = self.held_peaks[j]
                if peaks.get(dev, (0, {}))[0] < total:
                    peaks[dev] = (total, {key: b + n * held.get(key, 0)
                                          for key, b in snap.items()}
                                  | {_mem_tracker._TOTAL_KEY: total})
                    self.held_phases[j] = _PHASES[
                        2 if self._in_opt else 1 if self._mod_tracker.is_bw else 0]


def _rounded_size(granularity_bytes: int) -> Callable[[Any], int]:
    def mem_consumed(winfo: Any) -> int:
        nbytes = winfo.size * winfo.element_size
        return -(-nbytes // granularity_bytes) * granularity_bytes

    return mem_consumed


def _by_category(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    totals = dict.fromkeys(CATEGORIES, 0)
    for dev_snap in snapshot.values():
        for key, nbytes in dev_snap.items():
            if key in _CATEGORY_OF:
                totals[_CATEGORY_OF[key]] += nbytes
    return totals


def init_optimizer_state(optimizer: torch.optim.Optimizer, *, chunk: int = 32) -> None:
    """Create ``optimizer``'s state as its first step does, without a forward or backward:
    a step on zero gradients, then the gradients set back to None. (On fake tensors the
    values do not matter.) Then measure one training step with ``track=(model,
    optimizer)`` instead of two steps: about the same peak at half the cost (what the
    first step leaves behind besides the optimizer state, e.g. FSDP2's last
    reduce-scatter buffer, is not counted). Only for ``torch.optim`` optimizers that keep
    their state in ``optimizer.state``, per parameter.

    The parameters step ``chunk`` at a time (a step passes over those with a gradient
    only), each once: the same state as one step over all of them, and much quicker over
    DTensors, whose multi-tensor ops propagate shardings in time quadratic in the
    number of tensors (a U-Net's 700 parameters: seconds)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for first in range(0, len(params), chunk):
        part = params[first:first + chunk]
        for p in part:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p in part:
            p.grad = None


class InFlight:
    """What a step run under ``measure_peak(..., in_flight=True)`` is handed: marks of
    the bytes alive now, and bytes held by work the step stands for without running it
    (``train.memplan``: microbatches in flight like one it ran), counted in every peak
    until released."""

    def __init__(self, tracker: _StepTracker):
        self._tracker = tracker

    def mark(self) -> dict[Any, dict[Any, int]]:
        """The bytes alive now, per device and category."""
        return {dev: dict(snap) for dev, snap in self._tracker._curr_mem_snap.items()}

    def hold(self, before: dict[Any, dict[Any, int]], after: dict[Any, dict[Any, int]],
             times: int | None = None) -> None:
        """Hold ``times`` more of what was made between marks ``before`` and ``after``.
        Under ``measure_held_peaks`` leave ``times`` out: each of its counts holds that
        many (one step, one report per count)."""
        if (times is None) != (self._tracker.holds is not None):
            raise ValueError("InFlight.hold takes times under measure_peak, not under "
                             "measure_held_peaks (whose holds are the counts)")
        times = 1 if times is None else times
        total = _mem_tracker._TOTAL_KEY
        self._tracker.virtual = {
            dev: {key: times * (n - before.get(dev, {}).get(key, 0))
                  for key, n in snap.items() if key != total}
            for dev, snap in after.items()}
        self._tracker._update_peak_stats(None)

    def release(self) -> None:
        """Hold nothing more from now on."""
        self._tracker.virtual = {}


def measure_peak(
    step_fn: Callable[..., None],
    *,
    track: Iterable[torch.nn.Module | torch.optim.Optimizer | torch.Tensor] = (),
    allocation_granularity_bytes: int = CUDA_ALLOCATION_GRANULARITY_BYTES,
    in_flight: bool = False,
) -> MemoryReport:
    """Run ``step_fn`` once under a memory tracker and report this rank's peak.

    Meant for a :func:`fake_world` (it works on real tensors too). ``track``: modules,
    optimizers and tensors that exist before the call and should count from the start
    (a module's parameters otherwise count from its first forward, an optimizer's state
    from its first step inside ``step_fn``). Every storage counts
    ``allocation_granularity_bytes``-rounded (1: exact bytes). ``in_flight``: ``step_fn``
    is called with an ``InFlight``."""
    return _measure(step_fn, track, allocation_granularity_bytes, in_flight, None)[0]


def measure_held_peaks(
    step_fn: Callable[[InFlight], None],
    holds: Sequence[int],
    *,
    track: Iterable[torch.nn.Module | torch.optim.Optimizer | torch.Tensor] = (),
    allocation_granularity_bytes: int = CUDA_ALLOCATION_GRANULARITY_BYTES,
) -> tuple[MemoryReport, ...]:
    """``measure_peak(step_fn, in_flight=True)`` for several counts of held work at once:
    one ``MemoryReport`` per count ``n >= 0`` of ``holds``, that of the same step whose
    ``InFlight.hold`` (given no ``times``) holds ``n`` (its own peak, categories and
    phase; the final bytes are the same in all). One replay for several stages that
    differ only in how many microbatches they hold (``train.memgroups``)."""
    if not holds or min(holds) < 0:
        raise ValueError(f"holds must be counts of zero or more, not {tuple(holds)}")
    return _measure(step_fn, track, allocation_granularity_bytes, True, tuple(holds))


def _measure(step_fn: Callable[..., None], track: Iterable[Any], granularity: int,
             in_flight: bool, holds: tuple[int, ...] | None) -> tuple[MemoryReport, ...]:
    if granularity < 1:
        raise ValueError("allocation_granularity_bytes must be positive")
    gc.collect()
    tracker = _StepTracker()
    tracker.holds = holds
    with mock.patch.object(_mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
                           _rounded_size(granularity)):
        tracker.track_external(*track)
        with tracker:
            step_fn(InFlight(tracker)) if in_flight else step_fn()
        gc.collect()
        final = _by_category(tracker.get_tracker_snapshot("current"))
        return tuple(_report({dev: snap for dev, (_, snap) in peaks.items()}, phase, final)
                     for peaks, phase in zip(tracker.held_peaks, tracker.held_phases,
                                             strict=True))


def _report(peak_snapshot: dict[Any, dict[Any, int]], phase: str,
            final: dict[str, int]) -> MemoryReport:
    peak = _by_category(peak_snapshot)
    return MemoryReport(
        peak_bytes=sum(peak.values()),
        by_category=MappingProxyType(peak),
        peak_phase=phase,
        final_bytes=sum(final.values()),
        final_by_category=MappingProxyType(dict(final)),
    )
