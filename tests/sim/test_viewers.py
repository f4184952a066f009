"""The timeline viewers: Gantt image, Chrome trace, TensorBoard writer."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import numpy as np
import pytest

from dtdsl.ir.timeline import Event, Timeline, TimelineUnit
from dtdsl.sim.gantt import MAX_ROWS, render_gantt
from dtdsl.sim.trace import trace_events, write_trace

WHITE = (255, 255, 255)


def one_f_one_b(*, pp: int = 4, num_microbatches: int = 8, dp: int = 1, fwd_s: float = 0.01,
                bwd_s: float = 0.02, comm_s: float = 0.001, source: str = "predicted",
                step: int = 0, comm: bool = True) -> Timeline:
    """A hand-simulated 1F1B iteration of one unit ``llm``: per stage, warm-up forwards,
    one-forward-one-backward, cool-down backwards; activations and gradients take
    ``comm_s`` between stages; then a gradient SYNC and the OPT step. Replica r runs
    ``r`` percent slower so the replicas differ."""
    unit = TimelineUnit(name="llm", role="backbone", pp=pp, dp=dp, tp=2)
    events: list[Event] = []
    for r in range(dp):
        slow = 1 + 0.01 * r
        f_end: dict[tuple[int, int], float] = {}
        b_end: dict[tuple[int, int], float] = {}
        orders = []
        for s in range(pp):
            warm = min(pp - s - 1, num_microbatches)
            order = [("F", j) for j in range(warm)]
            for j in range(warm, num_microbatches):
                order += [("F", j), ("B", j - warm)]
            order += [("B", j) for j in range(num_microbatches - warm, num_microbatches)]
            orders.append(order)
        cursor = [0] * pp
        free = [0.0] * pp
        # Run whichever stage's next action is ready until every stage is done.
        while any(cursor[s] < len(orders[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                if cursor[s] == len(orders[s]):
                    continue
                kind, j = orders[s][cursor[s]]
                if kind == "F":
                    dep, hop = (0.0, 0.0) if s == 0 else (f_end.get((s - 1, j)), comm_s)
                elif s == pp - 1:
                    dep, hop = f_end.get((s, j)), 0.0
                else:
                    dep, hop = b_end.get((s + 1, j)), comm_s
                if dep is None:
                    continue
                start = max(free[s], dep + hop)
                end = start + (fwd_s if kind == "F" else bwd_s) * slow
                (f_end if kind == "F" else b_end)[s, j] = end
                rank = unit.rank(s, r)
                events.append(Event(unit="llm", stage=s, replica=r, rank=rank, kind=kind,
                                    microbatch=j, start_s=start, end_s=end))
                if comm and kind == "F" and s < pp - 1:
                    events.append(Event(unit="llm", stage=s, replica=r, rank=rank,
                                        kind="SEND_F", microbatch=j, start_s=end,
                                        end_s=end + comm_s))
                if comm and kind == "B" and s > 0:
                    events.append(Event(unit="llm", stage=s, replica=r, rank=rank,
                                        kind="SEND_B", microbatch=j, start_s=end,
                                        end_s=end + comm_s))
                free[s] = end
                cursor[s] += 1
                progressed = True
            assert progressed
    sync_start = max(e.end_s for e in events)
    for r in range(dp):
        for s in range(pp):
            rank = unit.rank(s, r)
            events.append(Event(unit="llm", stage=s, replica=r, rank=rank, kind="SYNC",
                                microbatch=None, start_s=sync_start, end_s=sync_start + 0.004))
            events.append(Event(unit="llm", stage=s, replica=r, rank=rank, kind="OPT",
                                microbatch=None, start_s=sync_start + 0.004,
                                end_s=sync_start + 0.006))
    return Timeline(source=source, step=step, num_microbatches=num_microbatches,
                    units=(unit,), events=tuple(events))


def two_units() -> Timeline:
    """vit (1 stage, 2 replicas) then llm (2 stages): a few hand-placed events."""
    vit = TimelineUnit(name="vit", role="encoder", pp=1, dp=2, tp=1, first_rank=0)
    llm = TimelineUnit(name="llm", role="backbone", pp=2, dp=1, tp=2, first_rank=2)

    def ev(unit, stage, replica, kind, mb, t0, t1, chunk=0):
        u = vit if unit == "vit" else llm
        return Event(unit=unit, stage=stage, replica=replica, rank=u.rank(stage, replica),
                     kind=kind, microbatch=mb, chunk=chunk, start_s=t0, end_s=t1)

    events = (
        ev("vit", 0, 0, "F", 0, 0.000, 0.010), ev("vit", 0, 1, "F", 1, 0.000, 0.010),
        ev("vit", 0, 0, "SEND_F", 0, 0.010, 0.012),
        ev("llm", 0, 0, "F", 0, 0.012, 0.030), ev("llm", 0, 0, "RECV_F", 0, 0.010, 0.012),
        ev("llm", 1, 0, "F", 0, 0.030, 0.048, chunk=1),
        ev("llm", 1, 0, "B", 0, 0.048, 0.084, chunk=1),
        ev("llm", 0, 0, "B", 0, 0.084, 0.120),
        ev("vit", 0, 0, "B", 0, 0.120, 0.140), ev("vit", 0, 1, "B", 1, 0.120, 0.140),
        ev("vit", 0, 0, "SYNC", None, 0.140, 0.150), ev("vit", 0, 1, "SYNC", None, 0.140, 0.150),
        ev("llm", 0, 0, "OPT", None, 0.140, 0.150),
    )
    return Timeline(source="predicted", num_microbatches=2, units=(vit, llm), events=events)


# ---- gantt ----------------------------------------------------------------------------------


def _is_background(pixel) -> bool:
    return tuple(int(c) for c in pixel) == WHITE


def _geometry(image: np.ndarray) -> tuple[list[int], int, int]:
    """Read the chart's geometry off the image, not off the renderer's constants: the
    centres of the rows (bands holding coloured, i.e. compute, pixels in the right two
    thirds, clear of the legend) and the time axis line's first and last column."""
    width = image.shape[1]
    rgb = image[:, width // 3 :].astype(int)
    coloured = ((rgb.max(axis=2) - rgb.min(axis=2)) > 0).any(axis=1)
    ys = np.flatnonzero(coloured)
    runs = np.split(ys, np.flatnonzero(np.diff(ys) > 1) + 1)
    centres = [int(run[0] + run[-1]) // 2 for run in runs]
    for y in range(int(runs[-1][-1]) + 1, image.shape[0]):
        cols = np.flatnonzero((image[y] != 255).any(axis=1))
        if len(cols) > width // 2:
            return centres, int(cols[0]), int(cols[-1])
    raise AssertionError("no time axis")


def test_gantt_shape_dtype_and_determinism():
    tl = one_f_one_b()
    a = render_gantt(tl, width=900)
    b = render_gantt(tl, width=900)
    assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[1:] == (900, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, render_gantt(tl, width=900, title="other title"))


def test_gantt_boxes_and_idle_time_at_computed_positions():
    tl = one_f_one_b(pp=4, num_microbatches=4, comm=False)
    image = render_gantt(tl, width=1000)
    ys, x0, x1 = _geometry(image)
    assert len(ys) == 4
    by_row = tl.by_row()
    t0 = tl.start_s
    scale = (x1 - x0) / tl.iteration_time_s

    def x_at(t: float) -> int:
        return x0 + int((t - t0) * scale)

    # Stage 3 idles until the first forward reaches it, and is busy in the middle of it.
    first_f3 = by_row["llm", 3, 0][0]
    assert first_f3.kind == "F" and first_f3.start_s > t0
    assert _is_background(image[ys[3], x_at((t0 + first_f3.start_s) / 2)])
    assert not _is_background(image[ys[3], x_at((first_f3.start_s + first_f3.end_s) / 2)])
    # Stage 0 is busy from the first instant.
    assert not _is_background(image[ys[0], x0 + 1])
    # Forward is lighter than backward in the same unit colour.
    back = next(e for e in by_row["llm", 3, 0] if e.kind == "B")
    f_px = image[ys[3], x_at((first_f3.start_s + first_f3.end_s) / 2)]
    b_px = image[ys[3], x_at((back.start_s + back.end_s) / 2)]
    assert int(f_px.sum()) > int(b_px.sum())
    # The gap stage 0 leaves between its last forward and the cool-down backwards is idle.
    s0 = [e for e in by_row["llm", 0, 0] if e.kind in ("F", "B")]
    gaps = [(a.end_s, b.start_s) for a, b in zip(s0, s0[1:], strict=False)
            if b.start_s - a.end_s > 0.01]
    assert gaps
    assert _is_background(image[ys[0], x_at(sum(gaps[0]) / 2)])
    # SYNC and OPT at the end are grey.
    sync = next(e for e in by_row["llm", 0, 0] if e.kind == "SYNC")
    r, g, b = (int(c) for c in image[ys[0], x_at((sync.start_s + sync.end_s) / 2)])
    assert r == g == b and r < 255
    r, g, b = (int(c) for c in image[ys[0], x1 - 2])
    assert r == g == b and r < 255


def test_gantt_comm_marks_show_where_a_row_waits():
    tl = two_units()
    image = render_gantt(tl, width=700)
    ys, x0, x1 = _geometry(image)
    assert len(ys) == 4   # vit.s0/r0, vit.s0/r1, llm.s0, llm.s1
    x = x0 + int((0.011 - tl.start_s) * (x1 - x0) / tl.iteration_time_s)
    # llm.s0 waits on RECV_F from 10 to 12 ms: the middle of its row is idle, its bottom
    # edge carries the mark; llm.s1 has nothing then.
    column = image[ys[2] : ys[3], x]
    assert _is_background(image[ys[2], x])
    assert any(int(p.max()) < 128 for p in column)
    assert all(_is_background(p) for p in image[ys[3] - 4 : ys[3] + 4, x])


def test_gantt_empty_and_zero_length():
    empty = Timeline(source="measured", num_microbatches=0, units=(), events=())
    image = render_gantt(empty, width=400)
    assert image.shape[1:] == (400, 3) and image.dtype == np.uint8
    unit = TimelineUnit(name="llm", role="backbone", pp=1, dp=1, tp=1)
    no_events = Timeline(source="measured", num_microbatches=1, units=(unit,), events=())
    assert render_gantt(no_events, width=400).shape[1] == 400
    zero = Timeline(source="measured", num_microbatches=1, units=(unit,), events=(
        Event(unit="llm", stage=0, replica=0, rank=0, kind="F", microbatch=0,
              start_s=1.0, end_s=1.0),))
    assert render_gantt(zero, width=400).shape[1] == 400
    with pytest.raises(ValueError, match="width"):
        render_gantt(zero, width=10)


def test_gantt_collapses_many_replicas():
    tl = one_f_one_b(pp=2, num_microbatches=4, dp=40, comm=False)
    assert len(tl.rows()) > MAX_ROWS
    collapsed = render_gantt(tl, width=600)
    small = render_gantt(one_f_one_b(pp=2, num_microbatches=4, dp=2, comm=False), width=600)
    # Two drawn rows when collapsed against four: the collapsed chart is shorter.
    assert collapsed.shape[0] < small.shape[0]


def test_gantt_draws_a_big_timeline():
    """32 stages x 256 microbatches (how long it takes: benchmarks/tool_times.py)."""
    pp, m = 32, 256
    unit = TimelineUnit(name="llm", role="backbone", pp=pp, dp=1, tp=1)
    events = []
    for s in range(pp):
        for j in range(m):
            t = (s + 3 * j) * 1e-3
            events.append(Event(unit="llm", stage=s, replica=0, rank=s, kind="F",
                                microbatch=j, start_s=t, end_s=t + 1e-3))
            events.append(Event(unit="llm", stage=s, replica=0, rank=s, kind="B",
                                microbatch=j, start_s=t + 1e-3, end_s=t + 3e-3))
    tl = Timeline(source="predicted", num_microbatches=m, units=(unit,), events=tuple(events))
    image = render_gantt(tl)
    assert image.shape[1] == 1600 and image.shape[0] >= pp * 11


# ---- trace ----------------------------------------------------------------------------------


def _check_trace(trace: dict) -> list[dict]:
    assert trace["displayTimeUnit"] == "ms"
    names = {(e["pid"], e["tid"]) for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in slices:
        assert isinstance(e["name"], str) and e["cat"] in ("compute", "comm", "optimizer",
                                                             "step")
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in names and e["pid"] in procs
    # Perfetto needs the slices of one thread to nest; ours never overlap at all.
    by_thread: dict[tuple[int, int], list[dict]] = {}
    for e in slices:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
    return slices


def test_trace_round_trip_and_fields(tmp_path):
    tl = two_units()
    path = write_trace(tmp_path / "trace.json", tl)
    trace = json.loads(path.read_text())
    assert trace == trace_events(tl)
    slices = _check_trace(trace)
    counts = Counter(e["cat"] for e in slices)
    kinds = Counter(e.kind for e in tl.events)
    assert counts["compute"] == kinds["F"] + kinds["B"]
    assert counts["optimizer"] == kinds["OPT"]
    assert counts["comm"] == kinds["SYNC"] + kinds["SEND_F"] + kinds["RECV_F"]
    assert counts["step"] == 2   # one per unit process
    meta = {(e["name"], e["args"].get("name")) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert ("process_name", "vit (predicted)") in meta
    assert ("process_name", "llm (predicted)") in meta
    assert ("thread_name", "s0 r1 (rank 1)") in meta     # vit replica 1
    assert ("thread_name", "s1 r0 (rank 4)") in meta     # llm stage 1, tp=2 from rank 2
    b = next(e for e in slices if e["name"] == "B0c1")
    assert b["args"] == {"microbatch": 0, "chunk": 1, "rank": 4, "replica": 0,
                         "stage": "llm.s1", "step": 0}
    assert b["ts"] == pytest.approx(48_000) and b["dur"] == pytest.approx(36_000)


def test_trace_steps_and_sources(tmp_path):
    steps = [one_f_one_b(step=k, fwd_s=0.01 + 0.001 * k) for k in range(3)]
    measured = one_f_one_b(source="measured", fwd_s=0.012)
    timelines = [*steps, measured]
    trace = trace_events(timelines)
    slices = _check_trace(trace)
    assert len([e for e in slices if e["cat"] != "step"]) == sum(len(t.events) for t in timelines)
    # Steps of one source follow each other; the measured step sits in its own process.
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["llm (measured)", "llm (predicted)"]
    step_slices = sorted((e for e in slices if e["cat"] == "step"), key=lambda e: e["ts"])
    predicted = [e for e in step_slices if procs[e["pid"]] == "llm (predicted)"]
    assert [e["name"] for e in predicted] == ["step 0", "step 1", "step 2"]
    for a, b in zip(predicted, predicted[1:], strict=False):
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"])
    gz = write_trace(tmp_path / "trace.json.gz", timelines)
    assert json.loads(gzip.decompress(gz.read_bytes())) == trace
    assert write_trace(tmp_path / "again.json.gz", timelines).read_bytes() == gz.read_bytes()


# ---- tensorboard ----------------------------------------------------------------------------


def test_tensorboard_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtdsl.sim.tensorboard import TimelineWriter

    steps = [one_f_one_b(pp=2, num_microbatches=3, step=k, fwd_s=0.01 * (k + 1))
             for k in range(2)]
    with TimelineWriter(tmp_path, gantt_width=500) as writer:
        for k, tl in enumerate(steps):
            writer.add_step(k, tl, {"mfu": 0.4 + 0.1 * k, "data/imbalance": 1.5})
        writer.add_text("plan", "# plan\n\n| unit | gpus |\n|---|---|\n| llm | 8 |")
    with TimelineWriter(tmp_path / "both", prefix=True, gantt_width=400,
                        gantt_every=2) as writer:
        writer.add_step(0, steps[0])
        writer.add_step(0, one_f_one_b(pp=2, num_microbatches=3, source="measured"))
        writer.add_step(1, steps[1])

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "images": 0,
                                                         "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"time/iteration_s", "pipeline/bubble_fraction", "pipeline/bubble/llm.s0",
            "pipeline/bubble/llm.s1", "mfu", "data/imbalance"} <= set(tags["scalars"])
    iteration = acc.Scalars("time/iteration_s")
    assert [s.step for s in iteration] == [0, 1]
    for s, tl in zip(iteration, steps, strict=True):
        assert s.value == pytest.approx(tl.iteration_time_s, rel=1e-6)
    bubble = acc.Scalars("pipeline/bubble/llm.s1")
    assert bubble[1].value == pytest.approx(steps[1].bubble_fraction()["llm.s1"], rel=1e-6)
    assert [s.value for s in acc.Scalars("mfu")] == pytest.approx([0.4, 0.5])
    images = acc.Images("pipeline/gantt")
    assert [i.step for i in images] == [0, 1]
    expected = render_gantt(steps[0], width=500)
    assert (images[0].width, images[0].height) == (500, expected.shape[0])
    import io

    from PIL import Image

    assert (np.asarray(Image.open(io.BytesIO(images[0].encoded_image_string))) ==
            expected).all()     # the chart's very pixels (a PNG: lossless)
    text_tag = next(t for t in tags["tensors"] if t.startswith("plan"))
    text = acc.Tensors(text_tag)[0].tensor_proto.string_val[0].decode()
    assert "| llm | 8 |" in text

    acc = EventAccumulator(str(tmp_path / "both"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"predicted/time/iteration_s", "measured/time/iteration_s",
            "measured/pipeline/bubble/llm.s0"} <= set(tags["scalars"])
    assert [i.step for i in acc.Images("predicted/pipeline/gantt")] == [0]   # gantt_every=2
    assert [i.width for i in acc.Images("measured/pipeline/gantt")] == [400]


def test_a_purge_hides_the_steps_a_resumed_run_writes_again(tmp_path):
    """``purge_from``: what ``train.launch`` writes before a run resumed at a step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtdsl.sim.tensorboard import TimelineWriter, purge_from

    with TimelineWriter(tmp_path) as writer:
        for step in range(4):
            writer.add_scalars(step, {"loss": float(step)})
    purge_from(tmp_path, 2)
    with TimelineWriter(tmp_path) as writer:
        writer.add_scalars(2, {"loss": 20.0})
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("loss")] == [(0, 0.0), (1, 1.0),
                                                                (2, 20.0)]


def test_trace_overlapping_events_spill_into_lanes():
    unit = TimelineUnit(name="llm", role="backbone", pp=2, dp=1, tp=1)

    def ev(kind, mb, t0, t1):
        return Event(unit="llm", stage=0, replica=0, rank=0, kind=kind, microbatch=mb,
                     start_s=t0, end_s=t1)

    tl = Timeline(source="measured", num_microbatches=2, units=(unit,), events=(
        ev("F", 1, 0.0, 1.0), ev("SEND_F", 0, 0.0, 0.5), ev("RECV_B", 0, 0.2, 0.7),
        ev("SEND_F", 1, 0.5, 0.6)))
    trace = trace_events(tl)
    slices = _check_trace(trace)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
               if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["s0 r0 (rank 0)", "s0 r0 comm", "s0 r0 comm #2",
                                        "steps"]
    lane = {e["name"]: threads[e["tid"]] for e in slices}
    assert lane == {"F1": "s0 r0 (rank 0)", "SEND_F0": "s0 r0 comm",
                    "RECV_B0": "s0 r0 comm #2", "SEND_F1": "s0 r0 comm", "step 0": "steps"}
    assert not set(threads) & {e["pid"] for e in slices}   # tids and pids are disjoint
