"""Optimizer CPU offload (``adamw(..., offload=F)``): the fraction ``F`` of a rank's
optimizer state and update on the CPU, as Pai-Megatron-Patch's hybrid distributed optimizer
and DeepSpeed's partial offload do.

**Which parameters.** Whole parameters, by bytes: lay the optimizer's parameters end to end
in their order, sized by their *global* bytes (a DTensor's ``numel`` is the full tensor's),
and offload each one whose midpoint lies in the first ``F`` of the total
(:func:`offloaded`). Global sizes are the same on every rank of a stage (FSDP2's shards
along dim 0 are uneven, local sizes are not), so every TP rank makes the same choice for a
parameter they all update (their updates stay bitwise equal on a GPU too), and a resume
makes the same choice again.

**Where things live.** An offloaded parameter keeps, in pinned host memory, an fp32 copy
of its local shard (the value the CPU updates), its gradient buffer and its Adam moments;
FSDP2's fp32 shard stays on the device (it is what FSDP2 all-gathers), so the device saves
the moments (8 bytes per parameter, ``cost.model.OFFLOADED_BYTES_PER_PARAM``: ``F`` of the
optimizer's moment bytes). The host copy is refreshed from the device every step, with
the gradient: others write parameters too (a checkpoint load through DCP, Local SGD's
outer step through ``.data``), and neither a version counter nor a storage pointer sees
every such write.

**The step** (:class:`OffloadAdamW`'s ``step``, after ``optim.optimizer_step`` has taken
the job-wide norm, clipped, unscaled and decided not to skip): on a side stream, each
offloaded parameter and gradient is copied device->host (``non_blocking`` into pinned memory); their
gradients hidden, torch's own step updates the rest on the device (launched asynchronously
on a GPU); meanwhile the CPU waits for its copies and runs torch's fused CPU AdamW on the
masters; the new values go host->device on the side stream, which the main stream then
waits for. On a CPU "device" (the tests) the side stream is absent and the copies are
plain copies: the same code, in the same order.

**One optimizer object.** The offloading optimizer is a subclass of torch's ``AdamW``
(``Adam``) over *all* the stage's parameters, so DCP's ``get_state_dict`` names every
parameter's state as today: an offloaded parameter's ``exp_avg`` and ``exp_avg_sq`` are
DTensors (the parameter's mesh and placements) over the pinned host tensors the CPU step
updates in place, and its ``step`` the host step counter. ``load_state_dict`` copies an
offloaded parameter's loaded state into its host tensors instead of onto the device, so a
checkpoint saved with any ``F`` resumes with any other.

**Equality.** On a CPU the device and host steps are the same fused CPU kernel,
elementwise: ``F = 0.5`` is bitwise ``F = 0``. On a GPU the host's fused CPU AdamW and the
device's fused CUDA AdamW may round differently in the last bits (division, square root,
fused multiply-adds): expect agreement to float32 rounding per update, about 1e-6
relative, not bitwise (not measured here: the tests run on CPUs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

__all__ = ["OffloadAdam", "OffloadAdamW", "offloaded", "offloaded_bytes"]


# The settings of a param group the host's groups copy (the learning rate changes per step).
_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def offloaded(sizes: Sequence[int], fraction: float) -> list[bool]:
    """Which of the parameters of global byte sizes ``sizes`` (in the optimizer's order)
    live on the CPU for an offload ``fraction``: those whose midpoint lies in the first
    ``fraction`` of the total (module docstring). 0 offloads none, 1 all."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload {fraction}: a fraction between 0 and 1")
    total = float(sum(sizes))
    limit = fraction * total
    flags, start = [], 0
    for size in sizes:
        flags.append(fraction >= 1.0 or (fraction > 0.0 and start + size / 2 < limit))
        start += size
    return flags


def offloaded_bytes(sizes: Sequence[int], fraction: float) -> int:
    """The bytes of ``sizes`` that :func:`offloaded` puts on the CPU."""
    return sum(s for s, on in zip(sizes, offloaded(sizes, fraction), strict=True) if on)


def _local(t: Any) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _global_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class _Lane:
    """A side stream of the device for the host copies; on a CPU none (each ``with``,
    wait and event is a no-op and the copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mod = None if device.type == "cpu" else torch.get_device_module(device)
        self.stream = None if self._mod is None else self._mod.Stream(device)

    @property
    def pinned(self) -> bool:
        return self._mod is not None

    def use(self) -> Any:
        return contextlib.nullcontext() if self._mod is None else self._mod.stream(self.stream)

    def after_main(self) -> None:
        """The side stream starts after what the main stream queued (the gradients)."""
        if self._mod is not None:
            self.stream.wait_stream(self._mod.current_stream(self.device))

    def main_after(self) -> None:
        """The main stream continues after the side stream's copies (the parameters)."""
        if self._mod is not None:
            self._mod.current_stream(self.device).wait_stream(self.stream)

    def mark(self) -> Any:
        if self._mod is None:
            return None
        event = self._mod.Event()
        event.record(self.stream)
        return event


@dataclass
class _Slot:
    """The host side of one offloaded parameter."""

    master: torch.Tensor                       # fp32 copy of the local shard, pinned
    grad_buffer: torch.Tensor | None = None    # pinned, reused every step


class _OffloadMixin:
    """The offloading step for a torch Adam-family optimizer (module docstring)."""

    _base: type[torch.optim.Optimizer]       # torch's class, which the host runs too

    def _setup_offload(self, fraction: float, host_kernel: dict[str, bool]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        flags = iter(offloaded([_global_bytes(p) for p in params], fraction))
        self.offload_fraction = fraction
        self._lane = _Lane(_local(params[0]).device)
        self._slots: dict[torch.Tensor, _Slot] = {}
        masters_of_group = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                if next(flags):
                    local = _local(p)
                    master = torch.empty(local.shape, dtype=torch.float32, device="cpu",
                                         pin_memory=self._lane.pinned)
                    self._slots[p] = _Slot(master=master)
                    masters.append(master)
            masters_of_group.append(masters)
        hyper = {k: self.defaults[k] for k in _SETTINGS}
        host_groups = [{"params": m} for m in masters_of_group if m]
        self._host = self._base(host_groups, **hyper, **host_kernel) if host_groups else None
        # For each device group, the host group of its offloaded parameters (or None).
        found = iter(self._host.param_groups if self._host is not None else ())
        self._host_group_of = [next(found) if m else None for m in masters_of_group]

    # ---- state -------------------------------------------------------------------------

    def _host_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The host Adam state of offloaded ``p``, created as torch creates it (zeros, step
        0) the first time, and mirrored into this optimizer's state as DTensors."""
        slot = self._slots[p]
        state = self._host.state[slot.master]
        if not state:
            pin = self._lane.pinned
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros(slot.master.shape, pin_memory=pin)
            state["exp_avg_sq"] = torch.zeros(slot.master.shape, pin_memory=pin)
            self._mirror(p)
        return state

    def _mirror(self, p: torch.Tensor) -> None:
        host = self._host.state[self._slots[p].master]
        self.state[p] = {"step": host["step"], "exp_avg": _like(p, host["exp_avg"]),
                         "exp_avg_sq": _like(p, host["exp_avg_sq"])}

    def host_state_tensors(self) -> list[torch.Tensor]:
        """The host tensors of the state this optimizer names (each offloaded parameter's
        moments, once created): what ``dtc memcheck`` takes off the device's count."""
        if self._host is None:
            return []
        return [t for slot in self._slots.values()
                for name, t in self._host.state[slot.master].items() if name != "step"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that an offloaded parameter's state is copied into its host
        tensors (never through the device) and stays there."""
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        rest = dict(state_dict["state"])
        loaded = {}
        for key, p in zip(ids, params, strict=True):
            if p in self._slots and key in rest:
                loaded[p] = rest.pop(key)
        super().load_state_dict({**state_dict, "state": rest})
        for p, values in loaded.items():
            host = self._host_state(p)
            for name in ("exp_avg", "exp_avg_sq"):
                host[name].copy_(_local(values[name]).to(torch.float32))
            host["step"].copy_(torch.as_tensor(_local(values["step"])).float().cpu())
            self._mirror(p)
        for p in self._slots:
            if p in self.state and self._host.state[self._slots[p].master]:
                self._mirror(p)      # torch's load rebuilt self.state

    # ---- the step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """The hybrid step (module docstring)."""
        if closure is not None:
            raise ValueError("the offloading optimizer takes no closure")
        moving = [p for p in self._slots if p.grad is not None]
        if not moving:
            super().step()
            return
        lane = self._lane
        lane.after_main()
        with lane.use():
            for p in moving:
                self._to_host(p)
        copied = lane.mark()
        hidden = {p: p.grad for p in moving}
        for p in moving:
            p.grad = None
        try:
            super().step()                  # the device's part, asynchronous on a GPU
        finally:
            for p, g in hidden.items():
                p.grad = g
        if copied is not None:
            copied.synchronize()
        self._host_step(moving)
        with lane.use():
            for p in moving:
                self._from_host(p)
        lane.main_after()
        for p in moving:
            self._slots[p].master.grad = None

    def _to_host(self, p: torch.Tensor) -> None:
        """Queue ``p``'s value and gradient to the host (module docstring)."""
        slot = self._slots[p]
        slot.master.copy_(_local(p).detach(), non_blocking=True)
        if slot.grad_buffer is None:
            slot.grad_buffer = torch.empty(slot.master.shape, pin_memory=self._lane.pinned)
        slot.grad_buffer.copy_(_local(p.grad), non_blocking=True)
        slot.master.grad = slot.grad_buffer

    def _host_step(self, moving: list[torch.Tensor]) -> None:
        """torch's CPU step on the masters, at each device group's current settings (the
        learning rate changes every step)."""
        for p in moving:
            self._host_state(p)
        for group, host_group in zip(self.param_groups, self._host_group_of, strict=True):
            if host_group is not None:
                host_group.update({k: group[k] for k in _SETTINGS})
        self._host.step()

    def _from_host(self, p: torch.Tensor) -> None:
        _local(p).copy_(self._slots[p].master, non_blocking=True)


def _like(p: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (a local block) as a tensor like parameter ``p``: a DTensor on its mesh and
    placements when ``p`` is one (sharing ``host``'s storage), else ``host`` itself."""
    if not hasattr(p, "device_mesh"):
        return host
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False,
                              shape=p.size(), stride=p.stride())


class OffloadAdamW(_OffloadMixin, torch.optim.AdamW):
    """torch's AdamW with the fraction ``offload`` of its parameters stepped on the CPU."""

    _base = torch.optim.AdamW

    def __init__(self, params: Any, *, offload: float, host_kernel: dict[str, bool],
                 **kwargs: Any) -> None:
        torch.optim.AdamW.__init__(self, params, **kwargs)
        self._setup_offload(offload, host_kernel)


class OffloadAdam(_OffloadMixin, torch.optim.Adam):
    """torch's Adam with the fraction ``offload`` of its parameters stepped on the CPU."""

    _base = torch.optim.Adam

    def __init__(self, params: Any, *, offload: float, host_kernel: dict[str, bool],
                 **kwargs: Any) -> None:
        torch.optim.Adam.__init__(self, params, **kwargs)
        self._setup_offload(offload, host_kernel)
