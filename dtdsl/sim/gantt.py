"""Gantt chart of a Timeline as an RGB image (for TensorBoard and for looking at).

One row per (unit, stage, replica), time left to right. Forward boxes are a light shade of
the unit's colour and backward boxes a dark one, SYNC and OPT are grey, communication is a
thin mark along the bottom of its row (drawn under compute, so it only shows where the row
waits), and idle time is plain background. Microbatch numbers go inside boxes wide enough
to hold them.

When the timeline has more than ``MAX_ROWS`` rows, replicas collapse into one row per stage,
drawing the *slowest* replica: the one whose last forward/backward ends latest (ties: more
compute, then the lowest index). That replica is the one the others wait for at the
gradient sync, so the collapsed chart still shows the critical path and real idle time; a
union of replicas would paint over exactly the gaps the chart exists to show. The row label
then names the replica drawn (``llm.s1/r3``) and the title says replicas were collapsed.

Pillow's bundled default font keeps the output identical across machines with the same
Pillow version (no system fonts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from dtdsl.ir.timeline import Event, Row, Timeline
from dtdsl.report import format_seconds

__all__ = ["MAX_ROWS", "render_gantt"]

MAX_ROWS = 64

# tab10 without its grey, which means SYNC/OPT here.
_PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207),
)
_BACKGROUND = (255, 255, 255)
_INK = (30, 30, 30)
_AXIS = (90, 90, 90)
_SYNC = (170, 170, 170)
_OPT = (115, 115, 115)
_COMM = (60, 60, 60)
_PAD = 8
_FONT_SIZE = 12
_LINE_H = 18
_AXIS_H = 30
_MIN_WIDTH = 240
_COMM_MARK_H = 2

_Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


def render_gantt(timeline: Timeline, *, width: int = 1600, title: str | None = None
                 ) -> np.ndarray:
    """Draw ``timeline`` as a Gantt chart; returns an ``(H, width, 3)`` uint8 array.

    The height follows from the number of rows. ``title`` replaces the default title
    (source, step, iteration time, mean bubble fraction). Same input, same pixels.
    """
    if width < _MIN_WIDTH:
        raise ValueError(f"width {width}: at least {_MIN_WIDTH} pixels")
    font = ImageFont.load_default(size=_FONT_SIZE)
    rows, events_by_row, num_collapsed = _layout_rows(timeline)
    labels = [_row_label(timeline, row) for row in rows]

    if title is None:
        title = _default_title(timeline, num_collapsed)
    n = len(rows)
    # Rows shrink as they multiply, but never below what a label needs.
    row_h = max(11, min(22, 640 // max(n, 1)))
    header_h = _PAD + 2 * _LINE_H
    plot_y0 = header_h + _PAD
    body_h = n * row_h if n else _LINE_H
    height = plot_y0 + body_h + _AXIS_H + _PAD

    img = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.text((_PAD, _PAD), title, fill=_INK, font=font)
    _draw_legend(draw, font, timeline, _PAD, _PAD + _LINE_H)

    # The label column also holds the axis caption, so it never runs into the first tick.
    label_w = max(int(font.getlength(s)) for s in [*labels, "time (ms)"])
    plot_x0 = _PAD + label_w + _PAD
    plot_x1 = max(plot_x0 + 50, width - 3 * _PAD)   # room for the last tick label
    if not n or not timeline.events:
        draw.text((plot_x0, plot_y0), "no events", fill=_AXIS, font=font)
        return np.array(img, dtype=np.uint8)

    t0 = timeline.start_s
    span_s = timeline.iteration_time_s
    # A zero-length iteration still gets an axis; every box then sits at its left end.
    scale = (plot_x1 - plot_x0) / (span_s if span_s > 0 else 1e-3)
    box_font = ImageFont.load_default(size=max(8, min(11, row_h - 6)))
    colours = {u.name: _PALETTE[i % len(_PALETTE)] for i, u in enumerate(timeline.units)}
    text_box: dict[str, tuple[float, float, float, float]] = {}

    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        y0 = plot_y0 + i * row_h + 1
        y1 = y0 + row_h - 3
        _text(draw, (_PAD, (y0 + y1) / 2), label, font, _INK, "lm")
        base = colours.get(row[0], _PALETTE[0])
        light, dark = _mix(base, _BACKGROUND, 0.55), _mix(base, (0, 0, 0), 0.15)
        events = events_by_row.get(row, ())
        # Communication first so compute covers it: the mark only shows while the row waits.
        for e in events:
            if e.kind not in ("F", "B", "W", "SYNC", "OPT"):
                xa, xb = _span_px(e, t0, scale, plot_x0, plot_x1)
                draw.rectangle((xa, y1 - _COMM_MARK_H + 1, xb, y1), fill=_COMM)
        for e in events:
            if e.kind in ("SYNC", "OPT"):
                xa, xb = _span_px(e, t0, scale, plot_x0, plot_x1)
                draw.rectangle((xa, y0, xb, y1), fill=_SYNC if e.kind == "SYNC" else _OPT)
        for e in events:
            if e.kind not in ("F", "B", "W"):
                continue
            xa, xb = _span_px(e, t0, scale, plot_x0, plot_x1)
            if xb - xa >= 3:
                xb -= 1   # a one-pixel gap keeps neighbouring boxes apart
            forward = e.kind == "F"
            draw.rectangle((xa, y0, xb, y1), fill=light if forward else dark)
            if e.microbatch is None or row_h < 13:
                continue
            text = str(e.microbatch) + (f"c{e.chunk}" if e.chunk else "")
            box = text_box.get(text)
            if box is None:
                box = text_box[text] = box_font.getbbox(text)
            if box[2] - box[0] + 2 <= xb - xa + 1:
                _text(draw, ((xa + xb + 1) / 2, (y0 + y1 + 1) / 2), text, box_font,
                      _INK if forward else _BACKGROUND, "mm", box)

    _draw_axis(draw, font, t0, span_s, scale, plot_x0, plot_x1, plot_y0 + body_h)
    return np.array(img, dtype=np.uint8)


# ---- layout ---------------------------------------------------------------------------------


def _layout_rows(timeline: Timeline) -> tuple[list[Row], dict[Row, list[Event]], int]:
    """The rows to draw, their events, and how many rows collapsing removed (0: none)."""
    by_row: dict[Row, list[Event]] = {}
    for e in timeline.events:
        by_row.setdefault(e.row, []).append(e)
    layout = timeline.rows()
    known = set(layout)
    # A measured timeline may hold rows its unit layout does not name; show them too.
    rows = layout + sorted(r for r in by_row if r not in known)
    if len(rows) <= MAX_ROWS:
        return rows, by_row, 0

    stages: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        stages.setdefault(row[:2], []).append(row)

    def cost(row: Row) -> tuple[float, float, int]:
        compute = [e for e in by_row.get(row, ()) if e.kind in ("F", "B", "W")]
        last = max((e.end_s for e in compute), default=-math.inf)
        return last, sum(e.duration_s for e in compute), -row[2]

    drawn = [max(replicas, key=cost) for replicas in stages.values()]
    return drawn, by_row, len(rows) - len(drawn)


def _row_label(timeline: Timeline, row: Row) -> str:
    unit, stage, replica = row
    try:
        single = timeline.unit(unit).dp == 1
    except KeyError:
        single = False
    if single and replica == 0:
        return f"{unit}.s{stage}"
    return f"{unit}.s{stage}/r{replica}"


def _default_title(timeline: Timeline, num_collapsed: int) -> str:
    title = (f"{timeline.source} step {timeline.step}: iteration "
             f"{format_seconds(timeline.iteration_time_s)}, "
             f"bubble {timeline.mean_bubble_fraction():.1%}, "
             f"{timeline.num_microbatches} microbatches")
    if num_collapsed:
        title += "; slowest replica per stage shown"
    return title


def _span_px(e: Event, t0: float, scale: float, x0: int, x1: int) -> tuple[int, int]:
    """Inclusive pixel columns of an event; at least one column so short events show."""
    xa = x0 + int((e.start_s - t0) * scale)
    xb = x0 + int(math.ceil((e.end_s - t0) * scale)) - 1
    xa = min(max(xa, x0), x1 - 1)
    return xa, min(max(xb, xa), x1 - 1)


def _mix(a: Sequence[int], b: Sequence[int], share_b: float) -> tuple[int, int, int]:
    r, g, bl = (round(x * (1 - share_b) + y * share_b) for x, y in zip(a, b, strict=True))
    return r, g, bl


# ---- decorations ----------------------------------------------------------------------------


def _draw_legend(draw: ImageDraw.ImageDraw, font: _Font, timeline: Timeline, x: int,
                 y: int) -> None:
    sw = 10
    cy = y + _LINE_H // 2
    for i, unit in enumerate(timeline.units):
        base = _PALETTE[i % len(_PALETTE)]
        draw.rectangle((x, cy - 5, x + sw - 1, cy + 4), fill=_mix(base, _BACKGROUND, 0.55))
        draw.rectangle((x + sw, cy - 5, x + 2 * sw - 1, cy + 4), fill=_mix(base, (0, 0, 0), 0.15))
        x += 2 * sw + 4
        _text(draw, (x, cy), unit.name, font, _INK, "lm")
        x += int(font.getlength(unit.name)) + 14
    for colour, name in ((_SYNC, "sync"), (_OPT, "optim")):
        draw.rectangle((x, cy - 5, x + sw - 1, cy + 4), fill=colour)
        x += sw + 4
        _text(draw, (x, cy), name, font, _INK, "lm")
        x += int(font.getlength(name)) + 14
    draw.rectangle((x, cy + 3, x + sw - 1, cy + 4), fill=_COMM)
    _text(draw, (x + sw + 4, cy), "comm   (light: forward, dark: backward)", font, _INK, "lm")


def _draw_axis(draw: ImageDraw.ImageDraw, font: _Font, t0: float, span_s: float, scale: float,
               x0: int, x1: int, y: int) -> None:
    """A line under the rows with 2 to 10 ticks at round times, in s, ms or us."""
    draw.line((x0, y + 2, x1, y + 2), fill=_AXIS)
    if span_s >= 5:
        unit, mult = "s", 1.0
    elif span_s >= 5e-3 or span_s == 0:
        unit, mult = "ms", 1e3
    else:
        unit, mult = "us", 1e6
    shown = (span_s if span_s > 0 else 1e-3) * mult
    step = _nice_step(shown / max(2, min(10, (x1 - x0) // 110)))
    decimals = _decimals(step)
    k = math.ceil(t0 * mult / step - 1e-9)
    while (k * step - t0 * mult) <= shown * (1 + 1e-9):
        x = x0 + round((k * step / mult - t0) * scale)
        draw.line((x, y + 2, x, y + 6), fill=_AXIS)
        _text(draw, (x, y + 8), f"{k * step:.{decimals}f}", font, _INK, "mt")
        k += 1
    _text(draw, (_PAD, y + 8), f"time ({unit})", font, _AXIS, "lt")


def _text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, font: _Font,
          fill: tuple[int, int, int], anchor: str,
          box: tuple[float, float, float, float] | None = None) -> None:
    """``draw.text`` with a two-letter anchor (l/m horizontally, t/m vertically) done by
    hand from the text's bounding box: Pillow's anchors need FreeType, and a Pillow built
    without it falls back to a bitmap font."""
    left, top, right, bottom = box if box is not None else font.getbbox(text)
    x, y = xy
    if anchor[0] == "m":
        x -= (left + right) / 2
    y -= (top + bottom) / 2 if anchor[1] == "m" else top
    draw.text((round(x), round(y)), text, fill=fill, font=font)


def _nice_step(raw: float) -> float:
    """The smallest 1-2-2.5-5 times a power of ten that is at least ``raw``."""
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * power >= raw * (1 - 1e-9):
            return m * power
    return 10.0 * power


def _decimals(step: float) -> int:
    for d in range(7):
        if abs(step * 10**d - round(step * 10**d)) < 1e-6:
            return d
    return 6
