"""The clocks that time a training step's actions (issue 28, item 4).

The executor marks the start and the end of each action (``begin`` / ``end``) and reads
every mark once, after the step's last action (``read``): seconds from the step's start.

* ``HostClock`` (CPU): CPU ops run synchronously, so the host's time is the action's.
* ``DeviceClock`` (CUDA): kernels run after the host has queued them, and on NCCL a
  receive's ``wait`` only orders streams, so host times would be launch times. Each mark
  records a ``torch.cuda.Event(enable_timing=True)`` on the device's current stream (the
  stream the actions run on and that waits for their receives), next to one recorded at
  the step's start. Nothing is read while the step runs: ``read`` synchronises once on the
  last event recorded, then takes every event's ``elapsed_time`` from the start event.

``step_clock`` picks one by the device: one code path in the executor whatever the clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceClock", "HostClock", "StepClock", "step_clock"]


class HostClock:
    """Host time (``time.perf_counter``, or ``now``) of each mark from ``start``."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._t0 = 0.0
        self._spans: list[list[float]] = []

    def start(self) -> None:
        """The step's origin; forgets the previous step's marks."""
        self._spans = []
        self._t0 = self._now()

    def begin(self) -> int:
        """Marks an action's start; the handle ``end`` and ``read`` refer to it by."""
        self._spans.append([self._now() - self._t0, 0.0])
        return len(self._spans) - 1

    def end(self, mark: int) -> None:
        """Marks the end of the action ``mark`` began."""
        self._spans[mark][1] = self._now() - self._t0

    def read(self) -> list[tuple[float, float]]:
        """(start_s, end_s) of every mark, in ``begin`` order."""
        return [(a, b) for a, b in self._spans]


class DeviceClock:
    """CUDA events of each mark, read once per step (see the module docstring).

    ``new_event`` makes a timing event (``torch.cuda.Event(enable_timing=True)``) and
    ``current_stream`` gives the stream to record on; both are parameters so that the
    logic can be checked without a GPU. Events are reused from step to step (a step
    records the same number of them)."""

    def __init__(self, device: torch.device | str | None = None, *,
                 new_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[], Any] | None = None):
        if new_event is None:
            new_event = _cuda_event
        if current_stream is None:
            dev = torch.device("cuda" if device is None else device)
            current_stream = lambda: torch.cuda.current_stream(dev)   # noqa: E731
        self._new_event, self._stream = new_event, current_stream
        self._free: list[Any] = []      # events of earlier steps, read already
        self._origin: Any = None
        self._pairs: list[list[Any]] = []
        self._last: Any = None          # the event recorded last this step

    def _record(self) -> Any:
        event = self._free.pop() if self._free else self._new_event()
        event.record(self._stream())
        self._last = event
        return event

    def start(self) -> None:
        """Records the step's start event; forgets the previous step's marks."""
        self._recycle()
        self._origin = self._record()

    def begin(self) -> int:
        self._pairs.append([self._record(), None])
        return len(self._pairs) - 1

    def end(self, mark: int) -> None:
        self._pairs[mark][1] = self._record()

    def read(self) -> list[tuple[float, float]]:
        """(start_s, end_s) of every mark from the start event, in ``begin`` order: one
        synchronisation, on the last event recorded (the stream ran every earlier one
        before it)."""
        if self._origin is None:
            return []
        self._last.synchronize()
        origin = self._origin
        out = []
        for first, last in self._pairs:
            if last is None:
                raise RuntimeError("an action began and never ended: its clock mark is "
                                   "still open at the end of the step")
            out.append((origin.elapsed_time(first) / 1e3, origin.elapsed_time(last) / 1e3))
        return out

    def _recycle(self) -> None:
        if self._origin is not None:
            self._free.append(self._origin)
        self._free.extend(e for pair in self._pairs for e in pair if e is not None)
        self._origin, self._pairs, self._last = None, [], None


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


StepClock = HostClock | DeviceClock


def step_clock(device: torch.device | str) -> StepClock:
    """The clock of a step on ``device``: CUDA events on a CUDA device, host time
    elsewhere (CPU ops are synchronous)."""
    dev = torch.device(device)
    return DeviceClock(dev) if dev.type == "cuda" else HostClock()
