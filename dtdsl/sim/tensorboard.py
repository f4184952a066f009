"""Timelines into TensorBoard: per-step scalars, a Gantt image per step, and text.

Tags written by ``TimelineWriter.add_step``:

- ``time/iteration_s``: the timeline's iteration time;
- ``pipeline/bubble_fraction``: the mean bubble fraction over all stage replicas;
- ``pipeline/bubble/<unit>.s<N>``: each stage's bubble fraction (mean over its replicas);
- ``pipeline/compute_s/<unit>.s<N>``: each stage's seconds of forward and backward
  compute (mean over its replicas);
- the caller's extra scalars under their own tags (``mfu``, ``data/imbalance``);
- ``pipeline/gantt``: the Gantt chart (``dtdsl.sim.gantt``), every ``gantt_every`` steps.

With ``prefix=True`` every one of these tags starts with the timeline's source
(``predicted/time/iteration_s``, ``measured/pipeline/gantt``), so one writer can take both
the predicted and the measured timeline of a step and TensorBoard shows them as two sections
side by side. To overlay the two curves in one chart instead, use two writers without a
prefix on sibling log dirs (``run/predicted``, ``run/measured``): TensorBoard overlays runs
that share a tag. ``add_text`` tags are never prefixed.

torch is imported when a writer is made, not with this module: it takes seconds.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from dtdsl.ir.timeline import Timeline
from dtdsl.sim.gantt import render_gantt

__all__ = ["TimelineWriter"]


class TimelineWriter:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``logdir`` that writes Timelines."""

    def __init__(self, logdir: str | Path, *, prefix: bool = False, gantt_width: int = 1600,
                 gantt_every: int = 1) -> None:
        if gantt_every < 0:
            raise ValueError(f"gantt_every {gantt_every}: 0 (never) or a step interval")
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(logdir))
        self._prefix = prefix
        self._gantt_width = gantt_width
        self._gantt_every = gantt_every

    @property
    def logdir(self) -> str:
        return self._writer.get_logdir()

    def add_step(self, step: int, timeline: Timeline,
                 scalars: dict[str, float] | None = None) -> None:
        """Write ``timeline``'s scalars, ``scalars``, and (every ``gantt_every`` steps) its
        Gantt chart, all at ``step``."""
        pre = f"{timeline.source}/" if self._prefix else ""
        values = {"time/iteration_s": timeline.iteration_time_s,
                  "pipeline/bubble_fraction": timeline.mean_bubble_fraction()}
        values.update((f"pipeline/bubble/{stage}", bubble)
                      for stage, bubble in sorted(timeline.bubble_fraction().items()))
        values.update((f"pipeline/compute_s/{stage}", busy)
                      for stage, busy in sorted(timeline.compute_s().items()))
        for name, value in (scalars or {}).items():
            values[name] = float(value)
        for name, value in values.items():
            self._writer.add_scalar(pre + name, value, global_step=step)
        if self._gantt_every and step % self._gantt_every == 0:
            image = render_gantt(timeline, width=self._gantt_width)
            self._writer.add_image(pre + "pipeline/gantt", image, global_step=step,
                                   dataformats="HWC")

    def add_scalars(self, step: int, scalars: dict[str, float], *,
                    source: str = "measured") -> None:
        """``scalars`` at ``step`` without a timeline (a step whose timeline was not
        gathered), under ``source``'s prefix when the writer prefixes."""
        pre = f"{source}/" if self._prefix else ""
        for name, value in scalars.items():
            self._writer.add_scalar(pre + name, float(value), global_step=step)

    def add_text(self, tag: str, markdown: str, step: int = 0) -> None:
        """Write ``markdown`` (e.g. the plan summary) under ``tag``; TensorBoard renders it."""
        self._writer.add_text(tag, markdown, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flush everything to disk and close the event file."""
        self._writer.flush()
        self._writer.close()

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
