"""``precision = fp16``: fp16 compute under FSDP2 with dynamic loss scaling (``optim.LossScale``),
the skip agreed over every rank of the job, the scale in checkpoints and in the run's
metrics, and a bundle that compiles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.parallel.tp import local_tensor
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import Checkpointer
from dtdsl.train.executor import StageExecutor
from dtdsl.train.lr import lr_at
from dtdsl.train.optim import LossScale, StageOptimizer, optimizer_step
from tests.dist import run
from tests.helpers.fp16 import (
    BF16_RTOL,
    STEPS,
    UNITS,
    _reference,
    _train,
    fp16,
)
from tests.helpers.runs import plan_for, spec

DEFAULT_SCALE = 2.0 ** 16
INJECTED_RANK = 1       # the backbone's first DP replica
INJECTED_STEP = 1       # an inf in one gradient there, after FSDP2's reduction
OVERFLOW_STEP = 3       # every rank's scale made huge: the fp16 backward overflows
SAVED_AT = 3            # a checkpoint after 3 steps (before the overflow step)
HUGE_SCALE = 2.0 ** 60




# ---- the loss scale, one process --------------------------------------------------------


def test_the_loss_scale_is_torch_grad_scalers_rule_and_defaults():
    """Fed the same overflows, ``LossScale`` gives ``torch.amp.GradScaler``'s scales: it
    backs off on each, grows after ``growth_interval`` good steps in a row, and starts
    from GradScaler's defaults."""
    torch_default = torch.amp.GradScaler("cpu")
    ours = LossScale()
    assert (ours.scale, ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        torch_default.get_scale(), torch_default.get_growth_factor(),
        torch_default.get_backoff_factor(), torch_default.get_growth_interval())

    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    ours = LossScale(scale=1024.0, growth_interval=3)
    overflows = [False, False, False, True, False, False, True, True, False, False, False,
                 False, False, False, True]
    for found_inf in overflows:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if found_inf:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        ours.update(found_inf)
        assert ours.scale == scaler.get_scale(), (found_inf, ours, scaler.state_dict())
        assert ours.growth_tracker == scaler.state_dict()["_growth_tracker"]
    assert ours.skipped_steps == sum(overflows)
    with pytest.raises(ValueError, match="positive and finite"):
        LossScale(scale=math.inf)
    with pytest.raises(ValueError, match="tracker"):
        LossScale(growth_tracker=2000)


def test_the_step_unscales_clips_skips_and_holds_the_learning_rate_schedule():
    """A step on gradients of the loss times the scale is the fp32 step of the loss
    itself (unscaled before the norm and the clipping); a non-finite gradient skips the
    step (parameters and Adam's state untouched), halves the scale, and the learning-rate
    schedule does not advance (Megatron-LM's rule)."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 4))

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    rates: list[int] = []
    hyper = dict(name="adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    plain, scaled = model(), model()
    opt_plain = StageOptimizer(list(plain.parameters()), **hyper)
    opt_scaled = StageOptimizer(list(scaled.parameters()), **hyper,
                                lr_at=lambda step: rates.append(step) or 1e-2)
    scale = LossScale(scale=2.0 ** 12)
    plain(x).square().sum().backward()
    (scaled(x).square().sum() * scale.scale).backward()
    want = optimizer_step([opt_plain], step=0, max_norm=0.5)
    got = optimizer_step([opt_scaled], step=0, max_norm=0.5, loss_scale=scale)
    assert want.grad_norm > 0.5     # the step clips
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert (scale.scale, scale.growth_tracker, scale.skipped_steps) == (2.0 ** 12, 1, 0)

    before = [p.detach().clone() for p in scaled.parameters()]
    (scaled(x).square().sum() * scale.scale).backward()
    next(scaled.parameters()).grad[0, 0] = math.nan
    skipped = optimizer_step([opt_scaled], step=1, max_norm=0.5, loss_scale=scale)
    assert skipped.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters(), strict=True))
    assert all(s["step"].item() == 1 for s in opt_scaled.optimizer.state.values())
    assert all(p.grad is None for p in scaled.parameters())
    assert (scale.scale, scale.growth_tracker, scale.skipped_steps) == (2.0 ** 11, 0, 1)

    (scaled(x).square().sum() * scale.scale).backward()
    assert not optimizer_step([opt_scaled], step=2, max_norm=0.5, loss_scale=scale).skipped
    assert rates == [0, 1]      # training step 2 took the schedule's second rate


# ---- fp16 training against the fp32 reference (gloo ranks) --------------------------------






# The acceptance: the tiny spec in fp16, 8+ steps within the bf16 tolerance.
RUN_STEPS = STEPS


def test_fp16_trains_within_the_bf16_tolerance_of_the_fp32_reference(tmp_path):
    program = spec(8)
    plan = plan_for(fp16(program), *UNITS)
    want = _reference(program, RUN_STEPS)
    run(_train, plan.gpus_used, fp16(program), plan, str(tmp_path), RUN_STEPS, timeout=300)
    records = [json.loads((tmp_path / f"{rank}.json").read_text())
               for rank in range(plan.gpus_used)]
    (gen,) = [r for r in records if r["role"] == "generator"]
    # Unscaled, all but a few of these elements would underflow to zero.
    nonzero, total = gen["elements"]
    assert total > 0 and nonzero >= 0.99 * total, gen["elements"]
    for rank, record in enumerate(records):
        got = record["steps"]
        assert len(got) == RUN_STEPS
        # Every rank ran every step at the initial scale, none skipped (2**16 does not
        # overflow this model's fp16 backward).
        assert [(g["loss_scale"], g["skipped"], g["skipped_steps"]) for g in got] == \
            [(DEFAULT_SCALE, False, 0)] * RUN_STEPS, rank
        for step, (g, (loss, norm)) in enumerate(zip(got, want, strict=True)):
            assert abs(g["loss"] - loss) <= BF16_RTOL * abs(loss), (rank, step, g, loss)
            # The norm is of the unscaled gradients (it would be 2**16 times larger).
            assert abs(g["grad_norm"] - norm) <= BF16_RTOL * norm, (rank, step, g, norm)
    losses = [g["loss"] for g in records[0]["steps"]]
    assert losses != [loss for loss, _ in want], "fp16 computed exactly the fp32 losses"


# ---- an overflow skips the step on every rank; the scale is checkpointed ------------------


def _program() -> ir.Program:
    # A warmup schedule: each step has its own learning rate.
    return fp16(spec(8), lr_schedule=ir.LRSchedule(name="linear", warmup=6, min_lr=0.0),
                steps=8)


def _local(ex: StageExecutor) -> dict[str, torch.Tensor]:
    return {k: local_tensor(p).detach().clone() for k, p in ex.named_parameters().items()}


def _inject_inf(ex: StageExecutor) -> None:
    """At ``INJECTED_STEP``, an inf in this rank's shard of one gradient, after FSDP2's
    reduction: no other rank sees it."""
    reduce = ex.stage.reduce_gradients

    def reduce_then_spoil() -> None:
        reduce()
        if ex.step == INJECTED_STEP:
            grad = ex.optimizers[0].params[0].grad
            with torch.no_grad():
                local_tensor(grad).view(-1)[0] = math.inf

    ex.stage.reduce_gradients = reduce_then_spoil


def _overflow(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
              out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    if rank == INJECTED_RANK:
        _inject_inf(ex)
    ckpt = Checkpointer(ex, run_dir, mode="sync", log=lambda _: None)
    record: dict = {"steps": [], "unchanged": [], "lr": []}
    for step in range(OVERFLOW_STEP + 1):
        if step == OVERFLOW_STEP:
            ex.loss_scale.scale = HUGE_SCALE
        before = _local(ex)
        r = ex.run_step(step)
        record["steps"].append({k: r[k] for k in ("loss", "skipped", "loss_scale",
                                                  "skipped_steps")})
        record["unchanged"].append(all(torch.equal(before[k], v)
                                       for k, v in _local(ex).items()))
        record["lr"].append([g["lr"] for opt in ex.optimizers
                             for g in opt.optimizer.param_groups])
        if step + 1 == SAVED_AT:
            record["saved"] = ex.loss_scale.state()
            ckpt.save(SAVED_AT)
    ckpt.close()
    record["after"] = ex.loss_scale.state()
    record["adam_steps"] = sorted({int(s["step"].item()) for opt in ex.optimizers
                                   for s in opt.optimizer.state.values()})
    Path(out, f"{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory) -> tuple[Path, Path, Plan]:
    """Four steps on four ranks: an inf injected on one rank at step 1, every rank's
    scale made huge at step 3, a checkpoint after step 3 (the run directory, the ranks'
    records)."""
    tmp = tmp_path_factory.mktemp("overflow")
    plan = plan_for(_program(), *UNITS)
    (tmp / "out").mkdir()
    run(_overflow, plan.gpus_used, _program(), plan, str(tmp / "run"), str(tmp / "out"),
        timeout=300)
    return tmp / "run", tmp / "out", plan


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(overflow_run):
    _, out, plan = overflow_run
    train = _program().train
    for rank in range(plan.gpus_used):
        rec = json.loads((out / f"{rank}.json").read_text())
        steps = rec["steps"]
        assert [s["skipped"] for s in steps] == [False, True, False, True], rank
        # Nobody stepped on a skipped step: every rank's parameters are as they were.
        assert rec["unchanged"] == [False, True, False, True], rank
        # The scale each step ran with: halved after each skip, on every rank; the
        # skips counted.
        assert [s["loss_scale"] for s in steps] == \
            [DEFAULT_SCALE, DEFAULT_SCALE, DEFAULT_SCALE / 2, HUGE_SCALE], rank
        assert [s["skipped_steps"] for s in steps] == [0, 1, 1, 2], rank
        assert rec["after"] == {"scale": HUGE_SCALE / 2, "growth_tracker": 0,
                                "skipped_steps": 2}
        assert all(math.isfinite(s["loss"]) for s in steps)
        # The optimizer stepped twice; step 2 ran at the schedule's second rate.
        assert rec["adam_steps"] in ([], [2]), rank       # [] where nothing trains
        want = [lr_at(train.lr_schedule, train.optimizer.lr, train.steps, s)
                for s in (0, 0, 1, 1)]
        for lrs, lr in zip(rec["lr"], want, strict=True):
            assert all(x == pytest.approx(lr) for x in lrs), (rank, rec["lr"], want)


def _resumed(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
             out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan), initialize=False)
    ckpt = Checkpointer(ex, run_dir, mode="sync", log=lambda _: None)
    first = ckpt.resume()
    state = ex.loss_scale.state()
    r = ex.run_step(first)
    ckpt.close()
    Path(out, f"resumed-{rank}.json").write_text(json.dumps(
        {"first": first, "state": state, "loss": r["loss"], "skipped": r["skipped"],
         "loss_scale": r["loss_scale"], "after": ex.loss_scale.state()}))


def test_a_resumed_run_goes_on_with_the_saved_scale(overflow_run):
    run_dir, out, plan = overflow_run
    run(_resumed, plan.gpus_used, _program(), plan, str(run_dir), str(out), timeout=300)
    for rank in range(plan.gpus_used):
        before = json.loads((out / f"{rank}.json").read_text())
        got = json.loads((out / f"resumed-{rank}.json").read_text())
        assert got["first"] == SAVED_AT
        # The scale, its growth counter and the skips as they were when saved.
        assert got["state"] == before["saved"] == {
            "scale": DEFAULT_SCALE / 2, "growth_tracker": 1, "skipped_steps": 1}
        # Step 3 again, at the saved scale (not the huge one the first run forced on it):
        # the same forward, and this time the step is taken.
        assert got["loss_scale"] == DEFAULT_SCALE / 2 and not got["skipped"]
        assert got["loss"] == pytest.approx(before["steps"][SAVED_AT]["loss"], rel=1e-6)
        assert got["after"] == {"scale": DEFAULT_SCALE / 2, "growth_tracker": 2,
                                "skipped_steps": 1}


# ---- compile and the run's log --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_an_fp16_bundle_compiles_and_its_run_log_counts_the_skips(tmp_path, capsys):
    from dtdsl import cli
    from dtdsl.cost.job import job_cost_model
    from dtdsl.data.batch import LocalBatches, SyntheticSource
    from dtdsl.ir.job import load_job
    from dtdsl.ir.program import Program
    from dtdsl.ir.schedule import parse_schedule
    from dtdsl.parallel.mesh import role_of
    from dtdsl.train import launch

    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    old = "precision        = fp32"
    assert old in text
    spec_path = tmp_path / "fp16.dt"
    spec_path.write_text(text.replace(old, "precision        = fp16"))
    bundle = tmp_path / "bundle"
    capsys.readouterr()
    assert cli.main(["compile", str(spec_path), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    assert "DT601" not in capsys.readouterr().err
    job = load_job(bundle)
    program = Program.model_validate_json((bundle / job.program_file).read_bytes())
    assert program.train.precision == "fp16"

    plan = Plan.model_validate_json((bundle / job.plan_file).read_bytes())
    schedule = parse_schedule((bundle / job.schedule_file).read_text("utf-8"))
    source = SyntheticSource(program)
    (tmp_path / "run").mkdir()
    log = launch._RunLog(tmp_path / "run", plan, program, schedule, source, 0,
                         job_cost_model(job.cost, program, bundle))
    scalars: list[dict] = []
    log.telemetry.put = lambda step, s, timeline, batch: scalars.append(s)
    feed = LocalBatches(program, plan, role_of(plan, 0), source=source,
                        policy=frozenset(job.reorder))
    for step, (skipped, scale, count) in enumerate([(False, 2.0 ** 16, 0),
                                                    (True, 2.0 ** 16, 1),
                                                    (False, 2.0 ** 15, 1)]):
        log.step({"step": step, "loss": 1.0, "lm_loss": 0.5, "gen_loss": 0.5,
                  "grad_norm": math.nan if skipped else 1.0, "skipped": skipped,
                  "loss_scale": scale, "skipped_steps": count, "time_s": 0.01,
                  "data_wait_s": 0.0}, None, feed.batch(step), plan)
    log.close()
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [(m["skipped"], m["loss_scale"], m["skipped_steps"]) for m in metrics] == \
        [(False, 2.0 ** 16, 0), (True, 2.0 ** 16, 1), (False, 2.0 ** 15, 1)]
    assert [(s["loss_scale"], s["skipped_steps"]) for s in scalars] == \
        [(2.0 ** 16, 0), (2.0 ** 16, 1), (2.0 ** 15, 1)]
    # The step line of a skipped step says so, with the scale it goes on with.
    note = launch._skip_note(LossScale(scale=2.0 ** 15, skipped_steps=1))
    assert "skipped" in note and "loss scale now 32768" in note and "1 skipped" in note


# ---- co-located units under mixed precision ------------------------------------------------


def _train_colocated(rank: int, world: int, program: ir.Program, plan: Plan, steps: int,
                     out: str) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    losses = [r["loss"] for r in ex.train(steps)]
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def test_fp16_trains_a_plan_with_co_located_units(tmp_path):
    """The planner's plan of the tiny spec: the encoder and the generator on the
    backbone's ranks, DP 4. A replica whose first microbatch has no images leaves the
    encoder idle while the backbone's backward runs, and one that draws none all step
    has gradients for some of its stage's parameters (in fp32, accumulated) and none for
    others: both once broke FSDP2's mixed precision (bf16 as well) at the first step."""
    from tests.helpers.plans import colocate

    steps = 2       # both failures were at the first step; the second runs with Adam's state
    program = spec(8)
    plan = colocate(fp16(program), plan_for(fp16(program), ("vit", "encoder", 1, 1, 1),
                                            ("llm", "backbone", 1, 4, 1),
                                            ("gen", "generator", 1, 1, 1)), "vit", "gen")
    out = tmp_path / "losses.json"
    run(_train_colocated, plan.gpus_used, fp16(program), plan, steps, str(out), timeout=300)
    got = json.loads(out.read_text())
    want = [loss for loss, _ in _reference(program, RUN_STEPS)][:steps]
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= BF16_RTOL * abs(w), (step, g, w)
