"""Cost-model tests' shared program and a linear profile to calibrate with."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from dtdsl.cost.profile import (
    DeviceInfo,
    ModuleProfile,
    PartPoint,
    Point,
    Profile,
)
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir


@cache
def program(name: str, replace: tuple[tuple[str, str], ...] = ()) -> ir.Program:
    path = ROOT / "specs" / f"{name}.dt"
    text = path.read_text()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    result = run_frontend(str(path), text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program



ROOT = Path(__file__).resolve().parents[2]


def _linear_profile(prog: ir.Program, slope: dict[str, float], tps=(1, 2)) -> Profile:
    """Every module and projector measured at x = 1, 2 and 1000 with time slope * x / tp
    (backward twice the forward)."""
    roles = {m.name: m.role for m in prog.modules} | {p.name: "projector"
                                                      for p in prog.projectors}
    modules = []
    for name, role in roles.items():
        points = []
        for tp in tps:
            for x in (1, 2, 1000):
                f = slope[name] * x / tp
                points.append(Point(tp=tp, x=x, fwd_time_s=f, bwd_time_s=2 * f,
                                    peak_memory_bytes=x, parts=(PartPoint(
                                        name="whole", count=1, fwd_time_s=f,
                                        bwd_time_s=2 * f, saved_bytes=x,
                                        peak_memory_bytes=x),)))
        modules.append(ModuleProfile(name=name, role=role, kind="mlp", method="whole",
                                     arch_sha256="0" * 64, backward=True,
                                     points=tuple(points)))
    return Profile(device=DeviceInfo(type="cpu", name="test", torch_version="0",
                                     dtype="fp32", num_threads=1),
                   created=datetime(2026, 1, 1, tzinfo=UTC), spec=prog.name,
                   spec_sha256=prog.source_sha256, repeats=1, warmup=0,
                   modules=tuple(modules))

