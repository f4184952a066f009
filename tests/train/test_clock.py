"""The step clocks (issue 28, item 4): on CUDA each action is timed by a pair of events
recorded on the device's stream and read once per step, after the last action; on the CPU
by the host. The CUDA clock's logic runs here with fake events; on a GPU, a pass with a
large matmul shows the matmul's GPU time."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ActionKind
from dtdsl.parallel.device import init_distributed
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.clock import DeviceClock, HostClock, step_clock
from dtdsl.train.executor import StageExecutor
from tests.dist import run
from tests.helpers.plans import colocate
from tests.helpers.runs import plan_for, spec

TICK_MS = 7.0       # the fake device's time between two recorded events
STREAM = "the stream"


class _Device:
    """A fake device: events take the next tick when recorded; every call is logged, with
    whether it happened inside an action."""

    def __init__(self):
        self.ticks = 0
        self.log: list[tuple[str, bool]] = []
        self.in_action = False
        self.made = 0

    def event(self) -> _Event:
        self.made += 1
        return _Event(self)


class _Event:
    def __init__(self, device: _Device):
        self.device, self.at_ms = device, None

    def record(self, stream):
        assert stream == STREAM
        self.device.ticks += 1
        self.at_ms = self.device.ticks * TICK_MS
        self.device.log.append(("record", self.device.in_action))

    def synchronize(self):
        self.device.log.append(("sync", self.device.in_action))

    def elapsed_time(self, end: _Event) -> float:
        assert self.at_ms is not None and end.at_ms is not None
        self.device.log.append(("read", self.device.in_action))
        return end.at_ms - self.at_ms


def _fake_clock() -> tuple[_Device, DeviceClock]:
    device = _Device()
    return device, DeviceClock(new_event=device.event, current_stream=lambda: STREAM)


def test_the_device_clock_reads_its_pairs_once_in_seconds_from_the_step_start():
    device, clock = _fake_clock()
    for _ in range(2):
        device.log.clear()
        device.ticks = 10       # the device's clock is not the step's origin
        clock.start()
        a = clock.begin()
        b = clock.begin()       # nested marks are fine: each is its own pair
        clock.end(b)
        clock.end(a)
        assert [k for k, _ in device.log] == ["record"] * 5
        spans = clock.read()
        assert spans == [(TICK_MS / 1e3, 4 * TICK_MS / 1e3),
                         (2 * TICK_MS / 1e3, 3 * TICK_MS / 1e3)]
        # One synchronisation, then the reads; nothing read before the last record.
        assert [k for k, _ in device.log] == ["record"] * 5 + ["sync"] + ["read"] * 4
    assert device.made == 5, "the second step reuses the first step's events"
    clock.start()
    clock.begin()
    with pytest.raises(RuntimeError, match="never ended"):
        clock.read()


def test_the_host_clock_and_the_choice_by_device():
    now = iter([100.0, 100.5, 101.0])
    clock = HostClock(now=lambda: next(now))
    clock.start()
    clock.end(clock.begin())
    assert clock.read() == [(0.5, 1.0)]
    assert isinstance(step_clock("cpu"), HostClock)
    assert isinstance(step_clock(torch.device("cuda", 0)), DeviceClock)


def _executor_with_fake_events(rank: int, world: int, program: ir.Program,
                               plan: Plan) -> None:
    device, clock = _fake_clock()
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan), clock=clock)
    run_action = ex._run

    def logged_run(index, action):
        device.in_action = True
        try:
            return run_action(index, action)
        finally:
            device.in_action = False

    ex._run = logged_run
    timed = [a for a in ex.actions if a.kind not in (ActionKind.SYNC, ActionKind.OPT)]
    for step in range(2):
        device.log.clear()
        device.ticks = 1000 * step + 3
        events = ex.run_step(step)["events"]
        kinds = [k for k, _ in device.log]
        marks = len(timed) + 1          # the actions and the optimizer step
        # A start event and a pair per mark, then one sync and the reads; no read of the
        # device inside an action.
        assert kinds == ["record"] * (1 + 2 * marks) + ["sync"] + ["read"] * (2 * marks)
        assert not any(inside for k, inside in device.log if k != "record")
        # The events' times are the device's: the i-th action from tick 2i+1 to 2i+2 of
        # the step's start event.
        assert [(e.kind, e.microbatch) for e in events[:len(timed)]] == \
            [(a.kind.value, a.microbatch) for a in timed]
        for i, e in enumerate(events[:len(timed)]):
            assert (e.start_s, e.end_s) == ((2 * i + 1) * TICK_MS / 1e3,
                                            (2 * i + 2) * TICK_MS / 1e3)
        last = (2 * marks - 1) * TICK_MS / 1e3, 2 * marks * TICK_MS / 1e3
        assert [(e.kind, e.start_s, e.end_s) for e in events[len(timed):]] == \
            ([("SYNC", *last), ("OPT", *last)] if ex.trains_in_schedule else [])


def test_the_executor_builds_its_events_from_the_device_clock_read_once_per_step():
    program = spec(8)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2),
                    ("gen", "generator", 1, 1, 1))
    run(_executor_with_fake_events, plan.gpus_used, program, plan, timeout=180)


# ---- on a GPU ------------------------------------------------------------------------------

MATMUL = 8192
REPEATS = 8


def _matmuls(a: torch.Tensor) -> torch.Tensor:
    out = a
    for _ in range(REPEATS):
        out = (a @ out) * (1.0 / MATMUL)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pass_on_cuda_shows_its_gpu_time_not_its_launch_time():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    a = torch.randn(MATMUL, MATMUL, device=device)
    _matmuls(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _matmuls(a)
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - start     # the matmuls' time on the GPU, synchronised
    base = spec(8)     # eager: the test times a pass, not torch.compile's first calls
    program = base.model_copy(update={"train": base.train.model_copy(update={"compile": False})})
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 1, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(device, timeout_s=120, rank=0, world_size=1,
                         init_method=f"file://{os.path.join(tmp, 'store')}")
        try:
            ex = StageExecutor(program, plan, lower(plan, program), rank=0,
                               groups=build_groups(plan, device_type="cuda"), device=device)
            assert isinstance(ex.clock, DeviceClock)
            forward = ex._forward

            def heavy_forward(j, mb):
                _matmuls(a)         # queued, never waited for by the host
                return forward(j, mb)

            ex._forward = heavy_forward
            ex.run_step(0)
            launch = time.perf_counter()
            events = ex.run_step(1)["events"]
            step_s = time.perf_counter() - launch
        finally:
            dist.destroy_process_group()
    passes = [e for e in events if e.kind == "F"]
    assert passes and all(e.end_s > e.start_s for e in events)
    # Each forward holds the matmuls' GPU time (host clocks would show their launch).
    for e in passes:
        assert e.end_s - e.start_s >= 0.8 * gpu_s, (e, gpu_s)
    assert max(e.end_s for e in events) <= step_s * 1.05
