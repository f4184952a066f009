"""The cost model a bundle's run prices its batches with: the one its plan was made with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.cost.profile import ProfileTable, load_profile
from dtdsl.cost.unit import CostParams, Efficiency

__all__ = ["job_cost_model"]


def job_cost_model(config: Any, program: Any, bundle: str | Path) -> CostModel:
    """The cost model a bundle's plan was made with (its ``ir.job.CostConfig``), for
    ``program``, so the run's predictions (TensorBoard's ``predicted/``) price its batches
    the same way: the analytic model's efficiencies, or the measured profile copied into
    the bundle."""
    given = {kind: getattr(config, kind) for kind in ("matmul", "attention", "conv")}
    params = CostParams(efficiency=Efficiency(
        **{kind: value for kind, value in given.items() if value is not None}))
    table = None
    if config.profile_file is not None:
        table = ProfileTable(load_profile(Path(bundle) / config.profile_file))
    return build_cost_model(program, params, profile=table)
