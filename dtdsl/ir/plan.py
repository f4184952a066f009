"""The Plan: how many GPUs each unit gets, its TP/DP/PP, and what that is predicted to cost.

A versioned pydantic model; ``Plan.model_dump_json()`` is its text form and the
``plan.json`` of a launch bundle. Ranks are laid out unit by unit in the order of
``units``, each unit's ranks as a (pp, dp, tp) grid with TP innermost.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field, model_validator

__all__ = ["PLAN_VERSION", "Packing", "Plan", "Simulated", "UnitPlan", "split_layers"]

PLAN_VERSION = 1


class UnitPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    name: str
    role: Literal["encoder", "backbone", "generator"]
    projectors: tuple[str, ...]          # projectors that run on this unit's ranks
    gpus: int
    tp: int
    dp: int
    pp: int
    vpp: int = 1
    tp_replicated: bool = False           # the baseline's encoders: every TP rank computes it all
    # The baseline's other placement (Megatron-LM's encoder_pipeline_model_parallel_size
    # = 0): an encoder (generator) runs on the GPUs of the backbone's first (last) stage,
    # with the backbone's TP, and holds no GPU of its own (gpus 0).
    colocated: bool = False
    # Activation recomputation of every layer: the spec's setting, or the baseline's to
    # make a layout fit (Megatron-LM's --recompute-granularity full).
    recompute: bool = False
    first_rank: int
    layers_per_stage: tuple[int, ...]
    microbatch_share: float               # backbone microbatches per unit microbatch (dp_lm / dp)
    fwd_time_s: float                     # one unit microbatch on the slowest stage
    bwd_time_s: float
    dp_sync_time_s: float                 # end of step: exposed DP sync and optimizer step
    memory_bytes: float                   # peak per GPU, first stage
    memory_limit_bytes: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.gpus)


class Packing(BaseModel):
    """The plan's layout on the same drawn steps with ``train.packing`` on and off, each
    priced and simulated for its setting, without reordering. A packed step's
    global batch counts sequences of several samples, an unpacked one's single samples:
    ``*_positions`` are the positions a step trains on average (text and encoder tokens,
    padding left out), so the time per position says which trains faster."""

    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    spec_packs: bool                # the spec's own train.packing
    packed_s: float                 # mean iteration time, packed (no reordering)
    unpacked_s: float               # the same, one sample per sequence
    packed_positions: float         # mean positions per step, packed
    unpacked_positions: float       # mean positions per step, unpacked

    @property
    def packing_faster(self) -> bool:
        """Whether packing trains more positions per second."""
        return self.packed_s * self.unpacked_positions < \
            self.unpacked_s * self.packed_positions


class Simulated(BaseModel):
    """A plan's iteration time on drawn batches (``dtdsl.sim``): the mean over ``steps``
    global batches drawn from the spec's data, each routed under the spec's reorder
    policy and without, and the baseline's on the same batches (Megatron-LM does not
    reorder)."""

    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    steps: int
    policy: tuple[str, ...]               # the spec's train.reorder
    iteration_time_s: float
    no_reorder_iteration_time_s: float
    baseline_iteration_time_s: float | None = None
    candidates: int = 1                   # layouts the planner scored on these batches
    packing: Packing | None = None        # the same layout with train.packing on and off

    @property
    def speedup(self) -> float | None:
        if self.baseline_iteration_time_s is None:
            return None
        return self.baseline_iteration_time_s / self.iteration_time_s

    @property
    def no_reorder_speedup(self) -> float | None:
        if self.baseline_iteration_time_s is None:
            return None
        return self.baseline_iteration_time_s / self.no_reorder_iteration_time_s


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", kw_only=True)

    version: Literal[1] = PLAN_VERSION
    spec: str
    spec_sha256: str
    search: Literal["convex", "exhaustive", "baseline"]
    num_gpus: int                         # in the cluster
    gpus_used: int
    global_batch: int
    micro_batch: int
    num_microbatches: int                 # per backbone replica and iteration
    schedule: Literal["gpipe", "1f1b", "interleaved"]
    iteration_time_s: float
    warmup_time_s: float
    steady_time_s: float
    dp_sync_time_s: float
    model_flops_per_iteration: float
    mfu: float                            # causal attention counted as the half it computes
    # MFU with causal attention counted whole (the paper-era convention of Megatron-LM's
    # 2021 formula and DistTrain); None in plans written before it existed.
    mfu_full_attention: float | None = None
    solve_time_s: float
    candidates: int                       # TP/DP combinations considered
    convex_solves: int                    # cvxpy problems solved (convex search)
    evaluated: int                        # integer layouts evaluated exactly
    baseline_iteration_time_s: float | None = None
    simulated: Simulated | None = None    # on drawn batches (dtc plan --simulate-steps)
    units: tuple[UnitPlan, ...]

    @property
    def rigid(self) -> bool:
        """Megatron-LM's layout (the baseline): one chain of stages per DP replica, every
        unit with the backbone's DP, so a sample stays on its replica's pipeline."""
        return self.search == "baseline"

    @model_validator(mode="before")
    @classmethod
    def _drop_derived(cls, data: Any) -> Any:
        # ``speedup`` is written for readers of the JSON and derived again on reading.
        if isinstance(data, dict) and "speedup" in data:
            data = {k: v for k, v in data.items() if k != "speedup"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def speedup(self) -> float | None:
        """Throughput over the Megatron-style baseline on the same cluster."""
        if self.baseline_iteration_time_s is None:
            return None
        return self.baseline_iteration_time_s / self.iteration_time_s

    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as even as possible, the larger stages first."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))
