"""Which device a rank computes on and which backend its collectives use.

One code path for GPUs and CPUs: a rank runs on ``<accelerator>:LOCAL_RANK`` (``cuda`` with
NCCL on NVIDIA GPUs, whatever ``torch.accelerator`` finds) when an accelerator is present,
on the CPU with gloo otherwise. ``DTDSL_DEVICE=cpu`` forces the CPU on a machine with GPUs
(a bundle's tests on a GPU host); nothing in a bundle names a device.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["backend_for", "init_distributed", "rank_device", "to_device"]


def rank_device(local_rank: int | None = None) -> torch.device:
    """This rank's device: the accelerator ``LOCAL_RANK`` (or ``local_rank``) when one is
    available and ``DTDSL_DEVICE`` does not say ``cpu``, else the CPU. Raises ValueError
    when ``DTDSL_DEVICE`` names a device type that is not here."""
    wanted = os.environ.get("DTDSL_DEVICE", "").strip().lower()
    if wanted == "cpu":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if \
        torch.accelerator.is_available() else None
    if wanted and (accelerator is None or accelerator.type != wanted):
        raise ValueError(f"DTDSL_DEVICE={wanted}, but this machine has "
                         f"{accelerator.type if accelerator else 'no accelerator'}")
    if accelerator is None:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    count = torch.accelerator.device_count()
    if count == 1:      # one device visible to this process (e.g. Slurm's --gpus-per-task=1)
        index = 0
    if index >= count:
        raise ValueError(f"local rank {index} but this node has {count} "
                         f"{accelerator.type} devices: start at most {count} ranks per node")
    return torch.device(accelerator.type, index)


def backend_for(device: torch.device) -> str:
    """The process-group backend of a device type (nccl for cuda, gloo for cpu, ...)."""
    from torch.distributed import Backend

    backend = Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise ValueError(f"torch.distributed has no backend for {device.type} devices")
    return backend


def init_distributed(device: torch.device, *, timeout_s: float | None = None,
                     **kwargs: Any) -> None:
    """Initialise the default process group for ``device`` (from the torchrun
    environment): the accelerator set as this process's current device first (NCCL's
    rule), the backend of the device type, ``device_id`` bound eagerly on accelerators."""
    import torch.distributed as dist

    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
        kwargs.setdefault("device_id", device)
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend_for(device), **kwargs)


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or lists, tuples and dicts of them) on ``device``. Host tensors
    bound for an accelerator are pinned and copied without blocking (the copy overlaps
    the host's work; the stream orders it before any kernel that reads it)."""
    if isinstance(x, torch.Tensor):
        if x.device == device:
            return x
        if device.type != "cpu" and x.device.type == "cpu":
            return x.pin_memory().to(device, non_blocking=True)
        return x.to(device)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: to_device(getattr(x, f.name), device)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, Mapping):
        return type(x)({k: to_device(v, device) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, Sequence) and not isinstance(x, str | bytes):
        return type(x)(to_device(v, device) for v in x)
    return x
