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

The events are written with the tensorboard package's own event-file writer and protocol
buffers, the records ``torch.utils.tensorboard.SummaryWriter`` writes, without importing
torch: the rank-0 telemetry process of every run (``dtdsl.train.launch``) needs nothing else
of torch, and importing it took that process about 1.5 CPU-s per launch. The tensorboard
package is imported when a writer is made, not with this module.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from dtdsl.ir.timeline import Timeline
from dtdsl.sim.gantt import render_gantt

__all__ = ["TimelineWriter", "purge_from"]


def purge_from(logdir: str | Path, step: int) -> None:
    """Hide the events at ``step`` and later in ``logdir`` from TensorBoard: a new event
    file whose session-start record at ``step`` makes TensorBoard drop what the older files
    hold from that step on (a run resumed at ``step`` writes those steps again). This is
    what ``SummaryWriter(purge_step=step)`` writes."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(logdir))
    writer.add_event(Event(wall_time=time.time(), step=step, file_version="brain.Event:2"))
    writer.add_event(Event(wall_time=time.time(), step=step,
                           session_log=SessionLog(status=SessionLog.START)))
    writer.close()


class TimelineWriter:
    """An event file in ``logdir`` that takes Timelines, scalars and text."""

    def __init__(self, logdir: str | Path, *, prefix: bool = False, gantt_width: int = 1600,
                 gantt_every: int = 1) -> None:
        if gantt_every < 0:
            raise ValueError(f"gantt_every {gantt_every}: 0 (never) or a step interval")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer: Any = EventFileWriter(str(logdir))
        self._prefix = prefix
        self._gantt_width = gantt_width
        self._gantt_every = gantt_every

    @property
    def logdir(self) -> str:
        return self._writer.get_logdir()

    def _add(self, step: int, value: Any) -> None:
        """One event at ``step`` holding the summary value ``value``."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._writer.add_event(Event(wall_time=time.time(), step=int(step),
                                     summary=Summary(value=[value])))

    def _add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(step, Summary.Value(tag=tag, simple_value=float(value)))

    def _add_image(self, tag: str, image: Any, step: int) -> None:
        """``image``: an ``(H, W, C)`` uint8 array, stored as a PNG."""
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        height, width, channels = image.shape
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG")
        self._add(step, Summary.Value(tag=tag, image=Summary.Image(
            height=height, width=width, colorspace=channels,
            encoded_image_string=png.getvalue())))

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
            self._add_scalar(pre + name, value, step)
        if self._gantt_every and step % self._gantt_every == 0:
            image = render_gantt(timeline, width=self._gantt_width)
            self._add_image(pre + "pipeline/gantt", image, step)

    def add_scalars(self, step: int, scalars: dict[str, float], *,
                    source: str = "measured") -> None:
        """``scalars`` at ``step`` without a timeline (a step whose timeline was not
        gathered), under ``source``'s prefix when the writer prefixes."""
        pre = f"{source}/" if self._prefix else ""
        for name, value in scalars.items():
            self._add_scalar(pre + name, float(value), step)

    def add_text(self, tag: str, markdown: str, step: int = 0) -> None:
        """Write ``markdown`` (e.g. the plan summary) under ``tag``; TensorBoard renders it."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[markdown.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(step, Summary.Value(tag=tag + "/text_summary", metadata=metadata,
                                      tensor=tensor))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flush everything to disk and close the event file."""
        self._writer.close()

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
