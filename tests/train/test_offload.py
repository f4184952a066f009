"""Optimizer CPU offload at run time (``adamw(..., offload=F)``, ``train.offload``): the
choice of parameters, multi-rank runs with ``F = 0.5`` bitwise equal to ``F = 0`` (CPU:
the device's and the host's AdamW are the same fused CPU kernel), and checkpoints that
resume under another ``F``."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.checkpoint import Checkpointer
from dtdsl.train.executor import StageExecutor
from dtdsl.train.offload import OffloadAdamW, offloaded, offloaded_bytes
from dtdsl.train.optim import StageOptimizer
from tests.dist import run
from tests.helpers.plans import phase
from tests.helpers.runs import plan_for, spec

# Bitwise claims (offload or not, resumed or not): a difference shows from the first
# update of an offloaded parameter on; 4 steps take Adam's moments through a few updates.
STEPS = 4


def offload(program: ir.Program, fraction: float, **train: object) -> ir.Program:
    opt = program.train.optimizer.model_copy(update={"offload": fraction})
    return program.model_copy(update={"train": program.train.model_copy(
        update={"optimizer": opt, **train})})


# ---- the choice, one process -------------------------------------------------------------

def test_whole_parameters_by_their_midpoints():
    sizes = [400, 100, 300, 200]             # 1000 bytes end to end
    assert offloaded(sizes, 0.0) == [False] * 4
    assert offloaded(sizes, 1.0) == [True] * 4
    assert offloaded(sizes, 0.5) == [True, True, False, False]   # midpoints 200, 450
    assert offloaded(sizes, 0.25) == [True, False, False, False]
    assert offloaded(sizes, 0.7) == [True, True, True, False]    # 650 < 700
    assert offloaded_bytes(sizes, 0.5) == 500
    with pytest.raises(ValueError, match="offload 1.5"):
        offloaded(sizes, 1.5)


def _train_alone(fraction: float, steps: int = 5) -> tuple[torch.nn.Module, StageOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = StageOptimizer(list(model.parameters()), name="adamw", lr=1e-2, betas=(0.9, 0.95),
                         eps=1e-8, weight_decay=0.01, offload=fraction)
    for step in range(steps):
        model(torch.randn(3, 8)).square().mean().backward()
        opt.step(step, 0.5)
        opt.zero_grad()
    return model, opt


def test_one_process_offload_is_bitwise_and_keeps_torchs_state_layout():
    want, plain = _train_alone(0.0)
    got, opt = _train_alone(0.5)
    assert isinstance(opt.optimizer, OffloadAdamW)
    on_host = [p for p in opt.params if p in opt.optimizer._slots]
    assert 0 < len(on_host) < len(opt.params)
    for p, q in zip(want.parameters(), got.parameters(), strict=True):
        assert torch.equal(p, q)
    # The same state, per parameter, as torch's own optimizer keeps it.
    a, b = plain.optimizer.state_dict()["state"], opt.optimizer.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[k][name], b[k][name]), (k, name)


def _more_steps(model: torch.nn.Module, opt: StageOptimizer, first: int, steps: int) -> None:
    torch.manual_seed(100 + first)
    for step in range(first, first + steps):
        model(torch.randn(3, 8)).square().mean().backward()
        opt.step(step, 1.0)
        opt.zero_grad()


def test_loaded_state_goes_to_the_host_and_stays_linked():
    """A state dict of torch's own optimizer (no tensor shared with ours, as a GPU's
    ``load_state_dict`` gets after moving it) loads into the host tensors: training goes
    on bitwise, and the optimizer's state keeps naming the host tensors the CPU updates."""
    want, plain = _train_alone(0.0)
    saved = copy.deepcopy(plain.optimizer.state_dict())
    got, opt = _train_alone(0.5, steps=1)
    assert opt.optimizer._slots
    with torch.no_grad():
        for p, q in zip(got.parameters(), want.parameters(), strict=True):
            p.copy_(q)
    opt.optimizer.load_state_dict(saved)
    _more_steps(want, plain, 5, 3)
    _more_steps(got, opt, 5, 3)
    for p, q in zip(want.parameters(), got.parameters(), strict=True):
        assert torch.equal(p, q)
    inner = opt.optimizer
    for p, slot in inner._slots.items():
        host = inner._host.state[slot.master]
        for name in ("exp_avg", "exp_avg_sq"):
            assert inner.state[p][name].data_ptr() == host[name].data_ptr(), name
        assert inner.state[p]["step"] is host["step"] and host["step"].item() == 8


def test_someone_elses_write_reaches_the_host_master():
    """A parameter written outside the optimizer (a checkpoint load, an outer Local SGD
    step) is read back before its next host step."""
    model, opt = _train_alone(1.0, steps=2)
    ref, ref_opt = _train_alone(0.0, steps=2)
    for m in (model, ref):
        with torch.no_grad():
            m[0].weight.data.mul_(0.5)      # as Local SGD writes: no version bump
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.manual_seed(7)
        m(torch.randn(3, 8)).square().mean().backward()
        o.step(2, 1.0)
        o.zero_grad()
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


# ---- multi-rank runs ---------------------------------------------------------------------

def _both(rank: int, world: int, programs: list[ir.Program], plan: Plan, out: str) -> None:
    """Train each program in turn from the same start; rank 0 writes each run's losses
    and every rank checks the parameters of the two runs are the same, bitwise."""
    runs = []
    for program in programs:
        ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                           groups=build_groups(plan))
        losses = [r["loss"] for r in ex.train(STEPS)]
        hosted = [len(o.optimizer._slots) if hasattr(o.optimizer, "_slots") else 0
                  for o in ex.optimizers]
        runs.append((losses, ex.full_parameters(), hosted,
                     sum(len(o.params) for o in ex.optimizers)))
    (want, want_params, none, _), (got, got_params, hosted, count) = runs
    assert sum(none) == 0
    if count > 1:       # a trained stage of several parameters offloads some, not all
        assert 0 < sum(hosted) < count, (hosted, count)
    assert want_params.keys() == got_params.keys()
    for name, p in want_params.items():
        assert torch.equal(p, got_params[name]), name
    if rank == 0:
        Path(out).write_text(json.dumps({"want": want, "got": got}))


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("case", ["dp2-frozen-generator", "fp16-phased"])
def test_offload_half_is_bitwise_no_offload(tmp_path, case):
    if case == "dp2-frozen-generator":
        program = spec(8, frozen=("gen", "llm_to_gen"))
        plan = plan_for(program, ("vit", "encoder", 1, 2, 1), ("llm", "backbone", 1, 2, 1),
                        ("gen", "generator", 1, 1, 1))
    else:
        program = spec(8)
        program = program.model_copy(update={"train": program.train.model_copy(
            update={"precision": "fp16"})})
        plan = phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                       ("llm", "backbone", 1, 2, 1),
                                       ("gen", "generator", 1, 1, 1)))
    out = tmp_path / "losses.json"
    run(_both, plan.gpus_used, [offload(program, 0.0), offload(program, 0.5)], plan,
        str(out), timeout=300)
    losses = json.loads(out.read_text())
    assert len(losses["want"]) == STEPS and losses["got"] == losses["want"]


def _resume(rank: int, world: int, program: ir.Program, plan: Plan, run_dir: str,
            steps: int, save_at: int | None, out: str) -> None:
    """Resume from ``run_dir`` (or start), train ``steps`` steps, save after ``save_at``;
    rank 0 writes the losses and the full parameters at the end."""
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    ck = Checkpointer(ex, run_dir, keep=3, mode="sync", log=lambda _: None)
    first = ck.resume()
    losses = []
    for step in range(first, first + steps):
        losses.append(ex.run_step(step)["loss"])
        if step + 1 == save_at:
            ck.save(step + 1)
    ck.close()
    full = ex.full_parameters()
    if rank == 0:
        torch.save({"first": first, "losses": losses, "params": full}, out)


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic")
def test_a_checkpoint_resumes_under_another_offload(tmp_path):
    """Saved at F = 0.5, resumed at F = 1 (the device's part of the state moves to the
    host) and at F = 0 (the host's part to the device): both continue bitwise as a run
    that never offloaded nor stopped."""
    program = spec(8)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                    ("gen", "generator", 1, 1, 1))
    half = STEPS // 2

    def go(fraction: float, run_dir: Path, steps: int, save_at: int | None) -> dict:
        out = tmp_path / f"out-{fraction}-{run_dir.name}.pt"
        run(_resume, plan.gpus_used, offload(program, fraction), plan, str(run_dir), steps,
            save_at, str(out), timeout=300)
        return torch.load(out)

    straight = go(0.0, tmp_path / "straight", STEPS, None)
    saved = go(0.5, tmp_path / "a", half, half)
    assert saved["losses"] == straight["losses"][:half]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for fraction, run_dir in ((1.0, tmp_path / "a"), (0.0, tmp_path / "b")):
        resumed = go(fraction, run_dir, STEPS - half, None)
        assert resumed["first"] == half
        assert resumed["losses"] == straight["losses"][half:], fraction
        for name, p in straight["params"].items():
            assert torch.equal(p, resumed["params"][name]), (fraction, name)


# ---- dtc memcheck ------------------------------------------------------------------------

def _memcheck(tmp_path: Path, fraction: float, capsys: pytest.CaptureFixture) -> dict:
    from dtdsl import cli
    from tests.specs import TINY

    old = "optimizer        = adamw(lr=1e-3, weight_decay=0.01, zero=1)"
    text = TINY.read_text()
    assert old in text
    spec_path = tmp_path / f"tiny_{fraction}.dt"
    spec_path.write_text(text.replace(
        old, f"optimizer = adamw(lr=1e-3, weight_decay=0.01, zero=1, offload={fraction})"))
    code = cli.main(["memcheck", str(spec_path), "--json", "--jobs", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return {(s["unit"], s["stage"]): s for s in json.loads(out)["stages"]}


@pytest.mark.slow
def test_memcheck_shows_the_saving(tmp_path, capsys):
    """``dtc memcheck`` of the tiny spec with half the optimizer offloaded: every trained
    stage's measured device peak drops by the moments it keeps on the host, and the
    prediction drops by about as much (the cost model's 8 bytes per offloaded parameter
    at F = 0.5 of them; the runtime takes whole parameters)."""
    none = _memcheck(tmp_path, 0.0, capsys)
    half = _memcheck(tmp_path, 0.5, capsys)
    assert none.keys() == half.keys()
    for key, s in half.items():
        base = none[key]
        assert base["host_bytes"] == 0
        assert s["host_bytes"] > 0, key
        saved = base["measured_bytes"] - s["measured_bytes"]
        assert saved == s["host_bytes"], (key, saved, s["host_bytes"])
        predicted = base["predicted_bytes"] - s["predicted_bytes"]
        assert predicted > 0 and abs(saved - predicted) <= 0.25 * predicted, \
            (key, saved, predicted)
