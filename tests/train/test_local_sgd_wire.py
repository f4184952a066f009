"""Local SGD wired into training (``sync = local_sgd``): the executor on gloo ranks
against ``dtc reference``'s single-process semantics, against synchronous DP, the
penalty's test hook, and checkpoints."""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
import torch

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.models.multimodal import build_model
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.local_sgd import CORRUPT_ENV, corruption
from dtdsl.train.reference import train_reference
from tests.dist import run
from tests.helpers.local_sgd import dp2, local, resumed_as_uninterrupted
from tests.helpers.runs import PARAM_RTOL, spec

LOSS_RTOL = 1e-4


def _train(rank: int, world: int, program: ir.Program, plan: Plan, steps: int, out: str,
           sgd_lr: float | None) -> None:
    groups = build_groups(plan, zero=program.train.mesh_zero)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    if sgd_lr is not None:      # plain SGD as the inner optimizer (the language has none)
        for o in ex.optimizers:
            o.optimizer = torch.optim.SGD(o.params, lr=sgd_lr)
            o.lr_at = lambda _step: sgd_lr
    results = ex.train(steps)
    params = {k: v.clone() for k, v in ex.full_parameters().items()}
    weights = ex.local_sgd.last_weights() if ex.local_sgd is not None else []
    torch.save({"losses": [r["loss"] for r in results],
                "bytes": [r["dp_sync_bytes"] for r in results],
                "weights": weights, "params": params}, f"{out}.{rank}")


def distributed(program: ir.Program, plan: Plan, steps: int, *, sgd_lr: float | None = None
                ) -> tuple[dict, dict]:
    """Rank 0's results, and every rank's parameters merged by name."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        run(_train, plan.gpus_used, program, plan, steps, out, sgd_lr, timeout=240)
        ranks = [torch.load(f"{out}.{r}") for r in range(plan.gpus_used)]
    params = {}
    for r in ranks:
        params.update(r["params"])
    return ranks, params


def test_local_sgd_matches_the_reference_at_dp2():
    program = local(spec(8), period=3, outer_lr=0.7, outer_momentum=0.9)
    plan = dp2(program)
    steps = 9
    torch.set_num_threads(1)
    model = build_model(program)
    init = {n.removeprefix("units."): p.detach().clone() for n, p in model.named_parameters()}
    want = [r["loss"] for r in train_reference(program, steps, model=model, plan=plan)]
    ranks, params = distributed(program, plan, steps)
    got = ranks[0]["losses"]
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (step, g, w)
    # The backbone's replicas are equal after the last synchronisation (step 8) and equal
    # to the reference's.
    ref = {n.removeprefix("units."): p for n, p in model.named_parameters()}
    for name, p in params.items():
        # As tests/train/test_executor.py compares them: Adam amplifies float summation
        # order where a gradient is near zero, so the error is measured against the update.
        err = (p - ref[name]).norm().item()
        assert err <= PARAM_RTOL * (ref[name] - init[name]).norm().item() + 1e-7, (name, err)
    # Synchronous DP would have moved different numbers: the check can fail.
    sync = [r["loss"] for r in train_reference(spec(8), steps)]
    assert max(abs(a - b) for a, b in zip(sync, want, strict=True)) > 1e-3
    # Bytes: the backbone's two ranks all-reduce their fp32 parameters every third step.
    llm_bytes = 4 * sum(p.numel() for n, p in params.items() if n.startswith("llm."))
    assert ranks[0]["bytes"] == [0, 0, 2 * llm_bytes] * 3


def test_period_one_plain_average_and_sgd_is_synchronous_dp():
    # No clipping: synchronous DP clips by the norm of the summed gradient, Local SGD by
    # the replicas' root mean square (docs/language.md).
    base = spec(8)
    base = base.model_copy(update={"train": base.train.model_copy(update={"grad_clip": 0.0})})
    plan = dp2(base)
    steps = 4
    _, want = distributed(base, plan, steps, sgd_lr=0.05)
    _, got = distributed(local(base, period=1, outer_lr=1.0), plan, steps, sgd_lr=0.05)
    init = build_model(base).state_dict()
    for name, p in want.items():
        moved = (p - init[f"units.{name}"]).norm().item()
        err = (got[name] - p).norm().item()
        # The one difference is fp32 rounding: each replica's parameters are rounded
        # after its own step, then averaged (a few ulps of the parameter per step).
        assert err <= 1e-5 * moved + 1e-6 * p.norm().item(), (name, err, moved)
    # ... and Local SGD with a period of 2 would not be: the check can fail.
    _, apart = distributed(local(base, period=2, outer_lr=1.0), plan, steps, sgd_lr=0.05)
    assert max((apart[n] - p).norm().item() for n, p in want.items()) > 1e-4


def test_the_penalty_drops_a_corrupted_replica(monkeypatch):
    # The z-test applies from sync 2 (step 2 at period 1); replica 1 is corrupted at the
    # last step, 3, which drops it.
    program = local(spec(4), period=1, penalty=True, penalty_warmup=2)
    plan = dp2(program)
    monkeypatch.setenv(CORRUPT_ENV, "replica=1,scale=30,from_step=3")
    ranks, _ = distributed(program, plan, 4)
    llm = [r for r in ranks if r["weights"]]
    assert llm and all(r["weights"] == [[1.0, 0.0]] for r in llm)


def test_the_corruption_hook_is_checked():
    assert corruption({}) is None
    assert corruption({CORRUPT_ENV: "replica=1,scale=30,from_step=2"}).scale == 30.0
    for bad in ("replica=1", "replica=x,scale=1,from_step=0", "replica=-1,scale=1,from_step=0"):
        with pytest.raises(ValueError, match=CORRUPT_ENV):
            corruption({CORRUPT_ENV: bad})


@pytest.mark.usefixtures("deterministic")
def test_resume_mid_period_equals_an_uninterrupted_run(tmp_path):
    # A save after step 3 of period 2: the replicas differ there, and the anchor, the
    # outer momentum and the penalty's statistics are all in play.
    program = local(spec(4), period=2, outer_lr=0.7, outer_momentum=0.9, penalty=True)
    whole = resumed_as_uninterrupted(tmp_path, program, dp2(program), steps=6, save_at=3)
    llm = [r for r in whole if r["stats"]]
    assert llm and llm[0]["stats"][0][3] == 3      # three synchronisations


@pytest.mark.slow
def test_a_bundle_run_drops_the_corrupted_replica(tmp_path):
    """A compiled bundle launched with launch.sh: the tiny spec with its backbone (and the
    units the plan co-locates with it) at DP 2, the penalty on with a warm-up of 2; the
    test hook corrupts replica 1 from step 2, the first synchronisation the z-test applies
    to (steps 0 and 1 at period 1 feed it): 3 steps, the last the one it drops."""
    from dtdsl import cli
    from tests.helpers.bundle import SPEC, launch_ok, read_jsonl

    text = SPEC.read_text()
    for old, new in (("global_batch     = 16", "global_batch     = 4"),
                     ("  seed ", "  sync             = local_sgd(period=1, penalty=true, "
                      "penalty_warmup=2)\n"
                      "  seed "),
                     ("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  dp(llm) == 2")):
        assert old in text
        text = text.replace(old, new, 1)
    spec = tmp_path / "tiny_lsgd.dt"
    spec.write_text(text)
    bundle = tmp_path / "bundle"
    # Synthetic batches made in the ranks (no preprocessing workers): the claim is the
    # replicas' synchronisation; test_bundle_run's in-process test runs this feed too.
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    run_dir = tmp_path / "run"
    proc = launch_ok(bundle, run_dir, "--steps", "3",
                     env={CORRUPT_ENV: "replica=1,scale=30,from_step=2"})
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("local_sgd:")]
    assert said == ["local_sgd: llm.s0 step 2: dropped replica(s) [1] (pseudo-gradient "
                    "norm anomalous)"], proc.stdout[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 3 and all(m["dp_sync_bytes"] > 0 for m in metrics)


def test_dtc_reference_follows_the_plan(tmp_path):
    from dtdsl import cli
    from tests.specs import TINY

    text = TINY.read_text().replace("global_batch     = 16", "global_batch     = 4")
    text = text.replace("  seed ", "  sync             = local_sgd(period=1)\n  seed ", 1)
    text = text.replace("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  dp(llm) == 2", 1)
    spec = tmp_path / "tiny_lsgd.dt"
    spec.write_text(text)
    program = run_frontend(str(spec), text.encode()).program
    assert cli.main(["plan", str(spec), "-o", str(tmp_path / "plan.json")]) == 0
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert plan.unit("llm").dp == 2
    out = tmp_path / "ref.jsonl"
    assert cli.main(["reference", str(spec), "--steps", "2", "--plan",
                     str(tmp_path / "plan.json"), "--out", str(out), "-q"]) == 0
    got = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert got == [r["loss"] for r in train_reference(program, 2, plan=plan)]
    # Not the synchronous reference's second step: the replicas' Adam steps differ.
    sync = program.model_copy(update={"train": program.train.model_copy(
        update={"sync": ir.Sync()})})
    assert abs(got[1] - [r["loss"] for r in train_reference(sync, 2)][1]) > 1e-4


def test_an_interval_shorter_than_a_step_syncs_every_step():
    # A-EDiT: every rank of the replica group agrees (a MAX all-reduce) and syncs when
    # the interval has passed: here at every step, as period=1 does.
    base = spec(4)
    plan = dp2(base)
    every, _ = distributed(local(base, period=1, outer_lr=0.7), plan, 3)
    timed, _ = distributed(local(base, interval_s=1e-9, outer_lr=0.7), plan, 3)
    assert timed[0]["losses"] == every[0]["losses"]
    assert timed[0]["bytes"] == every[0]["bytes"] and timed[0]["bytes"][0] > 0
