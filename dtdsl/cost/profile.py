"""A profile: measured forward and backward time (and memory) of every module and
projector of a program (``train.profile.profile_program`` measures it), and a table that
interpolates them for the cost model. It is measured at a small grid of sizes ``x``, per
tensor-parallel degree; what ``x`` means depends on the role (see ``docs/profile.md``):

- backbone: tokens of one packed sequence (one microbatch row), up to ``seq_len``;
- encoder: tokens of ONE item (an image's patches, an audio clip's frames): the
  time to encode one item;
- generator: items (images) per forward pass, at the architecture's latent size,
  attending to ``COND_TOKENS`` conditioning tokens;
- projector: tokens through it.

A ``Profile`` is a versioned pydantic model written as JSON (``save_profile``,
``load_profile``); a ``ProfileTable`` answers ``fwd_bwd_time_s(module, tp, x)`` by
linear interpolation between the measured sizes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dtdsl.errors import DtdslError, validation_problems
from dtdsl.ir import program as ir

__all__ = [
    "PROFILE_VERSION", "DeviceInfo", "ModuleProfile", "PartPoint", "Point",
    "Profile", "ProfileError", "ProfileTable", "check_profile", "load_profile", "save_profile",
]

PROFILE_VERSION = 1


class ProfileError(DtdslError, ValueError):
    """A profile that cannot be read or does not cover what was asked of it."""


# Longer than any one measurement of a module at one size (a forward and backward on one
# rank), and than any optimizer step per parameter: a larger value is not a measurement.
MAX_TIME_S = 3600.0
MAX_OPTIMIZER_S_PER_PARAM = 1e-3


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True, allow_inf_nan=False)


class DeviceInfo(_Model):
    """Where a profile was measured."""

    type: Literal["cpu", "cuda"]
    name: str                      # torch.cuda.get_device_name, or the CPU model
    torch_version: str
    dtype: Literal["bf16", "fp32"]  # bf16 on CUDA, fp32 on CPU
    num_threads: int               # torch intra-op threads (CPU timings depend on it)


class PartPoint(_Model):
    """One measured part of a module at one (tp, x): ``count`` identical copies of it
    make up the module (``layer`` x layers; ``embed_head``, ``patch_embed`` or
    ``whole`` x 1). Times and memory are of ONE copy."""

    name: str
    count: int = Field(ge=1)
    fwd_time_s: float = Field(ge=0, le=MAX_TIME_S)
    bwd_time_s: float = Field(ge=0, le=MAX_TIME_S)
    saved_bytes: int = Field(ge=0)        # tensors saved for backward (activation stash)
    peak_memory_bytes: int = Field(ge=0)  # CUDA: peak above what was allocated before


class Point(_Model):
    """A module measured at tensor parallelism ``tp`` and size ``x``: the whole
    module's forward and backward time and activation memory on one TP rank."""

    tp: int = Field(ge=1)
    x: int = Field(ge=1)
    fwd_time_s: float = Field(ge=0, le=MAX_TIME_S)
    bwd_time_s: float = Field(ge=0, le=MAX_TIME_S)
    peak_memory_bytes: int = Field(ge=0)
    parts: tuple[PartPoint, ...]


class ModuleProfile(_Model):
    """The measured points of one module or projector."""

    name: str
    role: Literal["encoder", "backbone", "generator", "projector"]
    kind: Literal["transformer", "unet", "dit", "mlp"]
    method: Literal["per_layer", "whole"]
    arch_sha256: str                 # of the architecture's JSON: warns of a changed model
    backward: bool                   # False: nothing needed gradients, bwd_time_s is 0
    points: tuple[Point, ...]

    @model_validator(mode="after")
    def _unique_points(self) -> ModuleProfile:
        seen = set()
        for p in self.points:
            if (p.tp, p.x) in seen:
                raise ValueError(f"module {self.name!r} has two points at tp={p.tp}, x={p.x}")
            seen.add((p.tp, p.x))
        if self.points and not any(p.fwd_time_s > 0 for p in self.points):
            raise ValueError(f"module {self.name!r} measured no forward time at any point")
        return self


class Profile(_Model):
    """A profile of every module and projector of one spec on one device (version 1)."""

    version: Literal[1] = PROFILE_VERSION
    device: DeviceInfo
    created: datetime
    spec: str
    spec_sha256: str
    repeats: int = Field(ge=1)
    warmup: int = Field(ge=0)
    modules: tuple[ModuleProfile, ...]
    # The spec's optimizer step (the runtime's kernel: fused or foreach) per fp32
    # parameter it updates; None in profiles written before it was measured.
    optimizer_s_per_param: float | None = Field(default=None, ge=0,
                                                le=MAX_OPTIMIZER_S_PER_PARAM)

    def module(self, name: str) -> ModuleProfile:
        """The profile of module or projector ``name`` (ProfileError if absent)."""
        for m in self.modules:
            if m.name == name:
                return m
        have = ", ".join(m.name for m in self.modules) or "none"
        raise ProfileError(f"the profile of spec '{self.spec}' has no module '{name}' "
                           f"(it has: {have}); profile the spec that defines it")


# ---- reading and writing ---------------------------------------------------------------------

def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` as indented JSON, atomically (a crash leaves the old file)."""
    path = Path(path)
    text = profile.model_dump_json(indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_profile(path: str | os.PathLike, *, program: ir.Program | None = None) -> Profile:
    """Read a profile written by ``save_profile``.

    Raises ProfileError if the file cannot be read, is not JSON, has another format
    version or does not match the schema; with ``program``, also if the profile lacks
    any of its modules or projectors. A profile of a different spec revision is
    accepted: compare ``profile.spec_sha256`` (or call ``check_profile``) to warn."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ProfileError(f"cannot read profile {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not a profile: it is not UTF-8 text") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path} is not valid JSON: {err.msg} at line {err.lineno} "
                           f"column {err.colno}") from None
    except (ValueError, RecursionError):    # an integer over 4300 digits, deep nesting
        raise ProfileError(f"{path} is not valid JSON: a number too long, or nested too "
                           "deep") from None
    if not isinstance(raw, dict) or "version" not in raw:
        raise ProfileError(f"{path} is not a dtc profile: expected a JSON object with a "
                           "'version' field")
    if raw["version"] != PROFILE_VERSION:
        raise ProfileError(f"{path} is a version {raw['version']!r} profile; this dtc reads "
                           f"version {PROFILE_VERSION}: profile the spec again")
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as err:
        raise ProfileError(f"{path} is not a valid version {PROFILE_VERSION} profile: "
                           f"{validation_problems(err, limit=3)}") from None
    if program is not None:
        check_profile(profile, program)
    return profile


def _arch_sha256(arch: BaseModel) -> str:
    return hashlib.sha256(arch.model_dump_json().encode()).hexdigest()


def check_profile(profile: Profile, program: ir.Program) -> tuple[str, ...]:
    """Does ``profile`` cover ``program``? Raises ProfileError naming the modules and
    projectors it lacks; returns warnings (another spec revision, a changed
    architecture) for the caller to show."""
    have = {m.name for m in profile.modules}
    wanted = [m.name for m in program.modules] + [p.name for p in program.projectors]
    missing = [n for n in wanted if n not in have]
    if missing:
        raise ProfileError(
            f"the profile (of spec '{profile.spec}') has no measurements for "
            f"{', '.join(missing)}; it has {', '.join(sorted(have)) or 'none'}. "
            "Profile this spec again")
    warnings = []
    if profile.spec_sha256 != program.source_sha256:
        warnings.append(f"the profile was measured for another revision of spec "
                        f"'{profile.spec}' (sha256 {profile.spec_sha256[:12]}, this one "
                        f"{program.source_sha256[:12]})")
    archs = {m.name: m.arch for m in program.modules} | \
        {p.name: p.arch for p in program.projectors}
    for m in profile.modules:
        if m.name in archs and m.arch_sha256 != _arch_sha256(archs[m.name]):
            warnings.append(f"'{m.name}' was profiled with another architecture; its "
                            "measurements do not describe this spec's model")
    return tuple(warnings)


# ---- interpolation ---------------------------------------------------------------------------

def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), extended by the line through
    the two nearest points outside the range, never below zero. One point: y
    proportional to x."""
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return float(ys[i])
    a = min(max(i - 1, 0), len(xs) - 2)
    slope = (ys[a + 1] - ys[a]) / (xs[a + 1] - xs[a])
    return max(0.0, ys[a] + slope * (x - xs[a]))


class ProfileTable:
    """Measured times of a ``Profile``, interpolated in ``x`` at a measured ``tp``."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._points: dict[str, dict[int, tuple[Point, ...]]] = {}
        for m in profile.modules:
            by_tp: dict[int, list[Point]] = {}
            for p in m.points:
                by_tp.setdefault(p.tp, []).append(p)
            self._points[m.name] = {tp: tuple(sorted(ps, key=lambda p: p.x))
                                    for tp, ps in sorted(by_tp.items())}

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self._points)

    def tps(self, module: str) -> tuple[int, ...]:
        """The TP degrees ``module`` was measured at."""
        return tuple(self._module(module))

    def xs(self, module: str, tp: int) -> tuple[int, ...]:
        """The sizes ``module`` was measured at, at ``tp``."""
        return tuple(p.x for p in self._curve(module, tp))

    def fwd_bwd_time_s(self, module: str, tp: int, x: float) -> tuple[float, float]:
        """Forward and backward time of the whole module on one TP rank at size ``x``
        (see the module docstring for what ``x`` means per role)."""
        curve = self._curve(module, tp, x)
        xs = [p.x for p in curve]
        return (_interpolate(xs, [p.fwd_time_s for p in curve], x),
                _interpolate(xs, [p.bwd_time_s for p in curve], x))

    def part_fwd_bwd_time_s(self, module: str, tp: int, x: float,
                            part: str = "layer") -> tuple[float, float]:
        """Forward and backward time of ONE copy of a part (one layer, the embedding
        and head): what a pipeline stage holding some of the layers adds up."""
        curve = self._curve(module, tp, x)
        parts = [next((q for q in p.parts if q.name == part), None) for p in curve]
        if any(q is None for q in parts):
            names = sorted({q.name for p in curve for q in p.parts})
            raise ProfileError(f"module '{module}' has no part '{part}' in its profile "
                               f"(parts: {', '.join(names)})")
        xs = [p.x for p in curve]
        return (_interpolate(xs, [q.fwd_time_s for q in parts], x),
                _interpolate(xs, [q.bwd_time_s for q in parts], x))

    def peak_memory_bytes(self, module: str, tp: int, x: float) -> float:
        """Activation memory of one forward+backward of the whole module at size ``x``."""
        curve = self._curve(module, tp, x)
        return _interpolate([p.x for p in curve], [p.peak_memory_bytes for p in curve], x)

    def _module(self, module: str) -> dict[int, tuple[Point, ...]]:
        if module not in self._points:
            self.profile.module(module)   # raises the ProfileError naming what exists
        return self._points[module]

    def _curve(self, module: str, tp: int, x: float | None = None) -> tuple[Point, ...]:
        by_tp = self._module(module)
        if tp not in by_tp or not by_tp[tp]:
            measured = ", ".join(
                f"tp={t} at x={', '.join(str(p.x) for p in ps)}" for t, ps in by_tp.items())
            raise ProfileError(f"module '{module}' was not profiled at tp={tp} (measured: "
                               f"{measured or 'nothing'}); profile again with tp={tp}")
        if x is not None and not x >= 0:
            raise ValueError(f"size x must be a non-negative number, not {x!r}")
        return by_tp[tp]


# ---- what to measure -------------------------------------------------------------------------
