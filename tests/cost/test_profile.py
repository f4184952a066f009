"""The profiler: profiling the tiny spec, the JSON format, interpolation, errors."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from dtdsl.cost.profile import (
    PROFILE_VERSION,
    DeviceInfo,
    ModuleProfile,
    PartPoint,
    Point,
    Profile,
    ProfileError,
    ProfileTable,
    check_profile,
    load_profile,
    save_profile,
)
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.train.profile import default_points, profile_program

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> ir.Program:
    path = ROOT / "specs" / "tiny_cpu.dt"
    result = run_frontend(str(path), path.read_bytes())
    assert result.ok
    return result.program


@pytest.fixture(scope="module")
def measured(tiny) -> tuple[Profile, list[tuple[int, int, str]]]:
    calls: list[tuple[int, int, str]] = []
    profile = profile_program(tiny, progress=lambda *args: calls.append(args))
    return profile, calls


def smallest(program: ir.Program) -> dict:
    """tps and points arguments for the quickest possible profile."""
    names = [m.name for m in program.modules] + [p.name for p in program.projectors]
    return {"tps": {n: [1] for n in names}, "points": {n: [1] for n in names}}


def synthetic(points: dict[int, list[tuple[int, float, float]]], name: str = "llm") -> Profile:
    """A profile of one module with (x, fwd_s, bwd_s) points per tp."""
    return Profile(
        device=DeviceInfo(type="cpu", name="test", torch_version="0", dtype="fp32",
                          num_threads=1),
        created=datetime(2025, 1, 1, tzinfo=UTC), spec="t", spec_sha256="0" * 64,
        repeats=1, warmup=0,
        modules=(ModuleProfile(
            name=name, role="backbone", kind="transformer", method="whole",
            arch_sha256="0" * 64, backward=True,
            points=tuple(
                Point(tp=tp, x=x, fwd_time_s=f, bwd_time_s=b, peak_memory_bytes=100 * x,
                      parts=(PartPoint(name="whole", count=1, fwd_time_s=f, bwd_time_s=b,
                                       saved_bytes=100 * x, peak_memory_bytes=100 * x),))
                for tp, pts in points.items() for x, f, b in pts)),))


# ---- profiling the tiny spec ---------------------------------------------------------------------

def test_profile_covers_every_module_at_its_tps_and_points(tiny, measured):
    profile, _ = measured
    assert profile.version == PROFILE_VERSION
    assert profile.spec == "tiny_cpu" and profile.spec_sha256 == tiny.source_sha256
    assert profile.device.type == "cpu" and profile.device.dtype == "fp32"
    assert check_profile(profile, tiny) == ()
    table = ProfileTable(profile)
    assert set(table.modules) == {"vit", "llm", "gen", "vit_to_llm", "llm_to_gen"}
    assert table.xs("llm", 1) == (64, 128, 256, 512)      # seq_len 512 / 8 ... 512
    assert table.xs("vit", 2) == (16, 64)                 # the data spec's patch counts
    assert table.xs("gen", 1) == (1, 2, 4)
    for name in table.modules:
        assert table.tps(name) == (1, 2)
        module = profile.module(name)
        assert module.backward
        for p in module.points:
            assert p.fwd_time_s > 0 and p.bwd_time_s > 0 and p.peak_memory_bytes > 0
    assert profile.module("llm").method == "per_layer"
    assert profile.module("gen").method == "whole"


def test_per_layer_parts_add_up(measured):
    profile, _ = measured
    for point in profile.module("llm").points:
        layer, ends = point.parts
        assert (layer.name, layer.count, ends.name) == ("layer", 4, "embed_head")
        assert point.fwd_time_s == pytest.approx(4 * layer.fwd_time_s + ends.fwd_time_s)
        assert point.peak_memory_bytes == 4 * layer.saved_bytes + ends.saved_bytes
    table = ProfileTable(profile)
    assert table.part_fwd_bwd_time_s("llm", 1, 64) == (
        profile.module("llm").points[0].parts[0].fwd_time_s,
        profile.module("llm").points[0].parts[0].bwd_time_s)
    with pytest.raises(ProfileError, match="no part 'layer'.*whole"):
        table.part_fwd_bwd_time_s("gen", 1, 2)


def test_time_and_memory_grow_with_x(measured):
    profile, _ = measured
    for name in ("llm", "vit", "gen"):
        points = [p for p in profile.module(name).points if p.tp == 1]
        memory = [p.peak_memory_bytes for p in points]
        assert memory == sorted(memory) and memory[-1] > memory[0], name
        # Times are measured, not compared: on a loaded machine a larger x can time
        # faster (timings belong in benchmarks/, not in the suite's assertions).
        assert all(0 < p.fwd_time_s < math.inf and 0 < p.bwd_time_s < math.inf
                   for p in points), name


def test_tp2_shard_keeps_less_activation_memory(measured):
    profile, _ = measured
    by_tp = {p.tp: p for p in profile.module("llm").points if p.x == 512}
    assert by_tp[2].peak_memory_bytes < by_tp[1].peak_memory_bytes


def test_progress_reports_every_point(measured):
    profile, calls = measured
    total = sum(len(m.points) for m in profile.modules)
    assert [c[0] for c in calls] == list(range(1, total + 1))
    assert {c[1] for c in calls} == {total}
    assert calls[0][2] == "vit tp=1 x=16"


def test_profile_round_trips_through_json(measured, tmp_path):
    profile, _ = measured
    assert Profile.model_validate_json(profile.model_dump_json()) == profile
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["version"] == 1


def test_explicit_tps_and_points(tiny):
    profile = profile_program(tiny, tps={"llm": [2]}, points={"llm": [16, 32], "gen": [1]},
                              repeats=1, warmup=0)
    table = ProfileTable(profile)
    assert table.tps("llm") == (2,) and table.xs("llm", 2) == (16, 32)
    assert table.xs("gen", 2) == (1,)
    with pytest.raises(ValueError, match="'nope', which the spec does not define"):
        profile_program(tiny, points={"nope": [1]})
    with pytest.raises(ValueError, match="'llm' cannot be split 3 ways: 4 attention heads"):
        profile_program(tiny, tps={"llm": [3]})


def test_frozen_encoder_has_no_backward(tiny):
    modules = tuple(m.model_copy(update={"frozen": True}) if m.role == "encoder" else m
                    for m in tiny.modules)
    program = tiny.model_copy(update={"modules": modules})
    profile = profile_program(program, **smallest(program), repeats=1, warmup=0)
    vit = profile.module("vit")
    assert not vit.backward and vit.points[0].bwd_time_s == 0
    assert vit.points[0].peak_memory_bytes == 0   # nothing saved for a backward
    assert profile.module("llm").backward


def test_profiling_leaves_threads_and_random_state_alone(tiny):
    threads = torch.get_num_threads()
    state = torch.get_rng_state()
    profile_program(tiny, **smallest(tiny), repeats=1, warmup=0)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), state)


def test_default_points_of_encoder_follow_the_data(tiny):
    assert default_points(tiny, "vit") == (16, 64)
    assert default_points(tiny, "gen") == (1, 2, 4)
    assert default_points(tiny, "vit_to_llm") == (64, 128, 256, 512)


# ---- interpolation ----------------------------------------------------------------------

def test_interpolation_is_exact_at_points_and_linear_between():
    table = ProfileTable(synthetic({1: [(10, 1.0, 2.0), (20, 2.0, 4.0), (40, 5.0, 8.0)]}))
    assert table.fwd_bwd_time_s("llm", 1, 10) == (1.0, 2.0)
    assert table.fwd_bwd_time_s("llm", 1, 40) == (5.0, 8.0)
    assert table.fwd_bwd_time_s("llm", 1, 15) == pytest.approx((1.5, 3.0))
    assert table.fwd_bwd_time_s("llm", 1, 30) == pytest.approx((3.5, 6.0))
    assert table.peak_memory_bytes("llm", 1, 25) == pytest.approx(2500)


def test_extrapolation_uses_the_nearest_two_points_and_stops_at_zero():
    table = ProfileTable(synthetic({1: [(10, 1.0, 2.0), (20, 2.0, 4.0), (40, 5.0, 6.0)]}))
    assert table.fwd_bwd_time_s("llm", 1, 50) == pytest.approx((6.5, 7.0))
    assert table.fwd_bwd_time_s("llm", 1, 5) == pytest.approx((0.5, 1.0))
    steep = ProfileTable(synthetic({1: [(10, 1.0, 1.0), (20, 5.0, 5.0)]}))
    assert steep.fwd_bwd_time_s("llm", 1, 1) == (0.0, 0.0)
    single = ProfileTable(synthetic({1: [(10, 1.0, 3.0)]}))
    assert single.fwd_bwd_time_s("llm", 1, 20) == pytest.approx((2.0, 6.0))


def test_interpolation_stays_at_its_tp():
    table = ProfileTable(synthetic({1: [(10, 1.0, 2.0), (20, 2.0, 4.0)],
                                    2: [(10, 0.6, 1.2), (20, 1.1, 2.2)]}))
    assert table.fwd_bwd_time_s("llm", 2, 15) == pytest.approx((0.85, 1.7))


# ---- errors -----------------------------------------------------------------------------

def test_missing_module_or_tp_is_a_clear_error():
    table = ProfileTable(synthetic({1: [(10, 1.0, 2.0)], 2: [(10, 0.5, 1.0), (20, 1.0, 2.0)]}))
    with pytest.raises(ProfileError, match=r"no module 'vit' \(it has: llm\)"):
        table.fwd_bwd_time_s("vit", 1, 10)
    with pytest.raises(ProfileError, match=r"not profiled at tp=4 \(measured: tp=1 at x=10, "
                                           r"tp=2 at x=10, 20\)"):
        table.fwd_bwd_time_s("llm", 4, 10)
    assert issubclass(ProfileError, ValueError)


def test_duplicate_points_are_rejected():
    with pytest.raises(ValueError, match="two points at tp=1, x=10"):
        synthetic({1: [(10, 1.0, 2.0), (10, 1.5, 2.0)]})


def test_load_rejects_bad_files(tmp_path):
    path = tmp_path / "p.json"
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON: .* line 1 column 2"):
        load_profile(path)
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="'version' field"):
        load_profile(path)
    data = json.loads(synthetic({1: [(10, 1.0, 2.0)]}).model_dump_json())
    path.write_text(json.dumps(data | {"version": 2}))
    with pytest.raises(ProfileError, match="version 2 profile; this dtc reads version 1"):
        load_profile(path)
    del data["modules"][0]["points"][0]["fwd_time_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="modules.0.points.0.fwd_time_s: Field required"):
        load_profile(path)


def test_load_for_a_program_checks_coverage_and_warns_on_another_revision(tiny, tmp_path):
    path = tmp_path / "p.json"
    save_profile(synthetic({1: [(10, 1.0, 2.0)]}), path)
    with pytest.raises(ProfileError, match="no measurements for vit, gen, vit_to_llm"):
        load_profile(path, program=tiny)
    profile = synthetic({1: [(10, 1.0, 2.0)]})
    full = profile.model_copy(update={"modules": tuple(
        profile.modules[0].model_copy(update={"name": n})
        for n in ("vit", "llm", "gen", "vit_to_llm", "llm_to_gen"))})
    save_profile(full, path)
    loaded = load_profile(path, program=tiny)      # another spec revision: loads
    assert loaded.spec_sha256 != tiny.source_sha256
    warnings = check_profile(loaded, tiny)
    assert "another revision of spec 't'" in warnings[0]
    assert any("'llm' was profiled with another architecture" in w for w in warnings)


def test_the_profile_times_the_optimizer_step(measured):
    """The spec's optimizer step per parameter, a few nanoseconds on a CPU core (Adam
    reads and writes four fp32 tensors per parameter)."""
    profile, _ = measured
    assert profile.optimizer_s_per_param is not None
    assert 1e-11 < profile.optimizer_s_per_param < 1e-6


def test_load_refuses_values_no_measurement_gives(tmp_path):
    # Each would otherwise reach the planner as a solver failure or a wrong infeasibility.
    path = tmp_path / "p.json"
    good = json.loads(synthetic({1: [(10, 1.0, 2.0)]}).model_dump_json())
    point = ("modules", 0, "points", 0)

    def edited(where, key, value):
        data = json.loads(json.dumps(good))
        node = data
        for k in where:
            node = node[k]
        node[key] = value
        return json.dumps(data)

    for text, words in (
            (edited(point, "fwd_time_s", 0.0), "measured no forward time"),
            (edited(point, "fwd_time_s", 1e9), "less than or equal to 3600"),
            (edited(point, "bwd_time_s", float("inf")).replace("Infinity", "1e999"),
             "finite number"),
            (edited((), "optimizer_s_per_param", 1e300), "less than or equal to 0.001"),
            ("[" * 100_000, "nested too deep"),
            ("[1" + "0" * 5000 + "]", "a number too long")):
        path.write_text(text)
        with pytest.raises(ProfileError, match=words):
            load_profile(path)
