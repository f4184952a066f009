"""dtc simulate, dtc reorder and --emit schedule: outputs, files read back, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtdsl import cli
from dtdsl.ir.schedule import parse_schedule

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny_cpu.dt")
M9 = str(ROOT / "specs" / "mllm_9b.dt")


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _events(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0,
                                                      "tensors": 0})
    acc.Reload()
    return acc


def test_simulate_writes_scalars_gantt_text_and_trace(capsys, tmp_path):
    logdir = tmp_path / "tb"
    code, out, err = run(capsys, "simulate", M9, "--steps", "3", "--reorder", "both",
                         "--logdir", str(logdir), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2]
    assert doc["reorder"] == ["inter", "intra"]
    assert doc["speedup"] > 1.0   # reordering helps on this spec's skewed images
    acc = _events(logdir)
    tags = acc.Tags()
    for tag in ("time/iteration_s", "pipeline/bubble_fraction", "mfu", "data/imbalance"):
        assert tag in tags["scalars"], tag
        assert [e.step for e in acc.Scalars(tag)] == [0, 1, 2]
    times = [e.value for e in acc.Scalars("time/iteration_s")]
    assert times == pytest.approx([s["iteration_time_s"] for s in doc["steps"]], rel=1e-6)
    # The printed bubble fraction is the one TensorBoard shows (every stage replica).
    bubbles = [e.value for e in acc.Scalars("pipeline/bubble_fraction")]
    assert bubbles == pytest.approx([s["bubble_fraction"] for s in doc["steps"]], rel=1e-5)
    assert any(t.startswith("pipeline/bubble/") for t in tags["scalars"])
    gantt = [t for t in tags["images"] if "gantt" in t]
    assert gantt and len(acc.Images(gantt[0])) == 3
    assert acc.Images(gantt[0])[0].width > 100
    text_tags = [t for t in tags["tensors"] if "plan" in t]
    assert text_tags
    trace = json.loads((logdir / "trace.json").read_text())
    assert any(e.get("ph") == "X" and e["name"].startswith("F") for e in trace["traceEvents"])


def test_simulate_table_and_plan_file(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    assert run(capsys, "plan", TINY, "-o", str(plan_path), "--no-baseline")[0] == 0
    # A trace.json dtdsl did not write stops it before it simulates; its own is replaced.
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "trace.json").write_text("precious")
    code, _, err = run(capsys, "simulate", TINY, "--plan", str(plan_path), "--steps", "2",
                       "--logdir", str(tmp_path / "tb"))
    assert code == 2 and "trace.json exists and is not a trace dtdsl wrote" in err, err
    assert (tmp_path / "tb" / "trace.json").read_text() == "precious"
    (tmp_path / "tb" / "trace.json").unlink()
    code, out, err = run(capsys, "simulate", TINY, "--plan", str(plan_path), "--steps", "2",
                         "--logdir", str(tmp_path / "tb"), "--overwrite")
    assert code == 0, err
    code, out, err = run(capsys, "simulate", TINY, "--plan", str(plan_path), "--steps", "2",
                         "--logdir", str(tmp_path / "tb"), "--overwrite")
    assert code == 0, err
    for word in ("simulated steps", "iteration", "MFU", "planned", "tensorboard --logdir",
                 "trace"):
        assert word in out


def test_simulate_errors(capsys, tmp_path):
    code, _, err = run(capsys, "simulate", TINY, "--plan", str(tmp_path / "nope.json"),
                       "--logdir", str(tmp_path / "tb"))
    assert code == 2 and "cannot read plan" in err
    m9_plan = tmp_path / "m9.json"
    other = run(capsys, "plan", M9, "-o", str(m9_plan), "--no-baseline")
    assert other[0] == 0
    code, _, err = run(capsys, "simulate", TINY, "--plan", str(m9_plan),
                       "--logdir", str(tmp_path / "tb"))
    assert code == 2 and "plan this spec again" in err
    for argv in (["--steps", "0", "--logdir", str(tmp_path)], []):   # --logdir is required
        with pytest.raises(SystemExit) as exc:
            cli.main(["simulate", TINY, *argv])
        assert exc.value.code == 2
    capsys.readouterr()


def test_simulate_refuses_plans_that_do_not_fit_the_spec(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    assert run(capsys, "plan", TINY, "-o", str(plan_path), "--no-baseline")[0] == 0
    good = json.loads(plan_path.read_text())
    llm = next(i for i, u in enumerate(good["units"]) if u["role"] == "backbone")
    vit = next(i for i, u in enumerate(good["units"]) if u["name"] == "vit")
    edits = {   # what a plan from another spec with the same module names, or a hand edit,
                # would otherwise crash on or silently simulate wrongly
        "global_batch is 32": lambda p: p.update(global_batch=32),
        "micro_batch is 1": lambda p: p.update(micro_batch=1),
        "not the global batch": lambda p: p.update(num_microbatches=p["num_microbatches"] + 1),
        "role generator in the plan": lambda p: p["units"][vit].update(role="generator"),
        "does not split": lambda p: p["units"][llm].update(layers_per_stage=[1, 1, 1]),
        "at least 1": lambda p: p["units"][llm].update(pp=0),
        "finite": lambda p: p["units"][llm].update(fwd_time_s=-1.0),
        # a job of another size or schedule than the spec's, launched as the plan says
        "gpus_used is 9999, its units hold": lambda p: p.update(gpus_used=9999),
        "more than num_gpus": lambda p: p.update(num_gpus=1),
        "not 0 (the units hold ranks back to back": lambda p: [
            u.update(first_rank=u["first_rank"] + 1) for u in p["units"] if u["gpus"]],
        "schedule is gpipe, the spec's is 1f1b": lambda p: p.update(schedule="gpipe"),
        # degrees that would hang the lowering or the rank files, or fail only at launch
        "vpp 1000000000 is more than its 4 layers": lambda p: p["units"][llm].update(
            vpp=10**9),
        "a cluster has at most 131072 GPUs": lambda p: p.update(num_gpus=4_000_000),
        "cp 1000000: more than the 131072 GPUs": lambda p: p["units"][llm].update(cp=10**6),
        "tp 8 cannot split its 4 attention heads and 2 KV heads": lambda p: p["units"][
            llm].update(tp=8),
        "tp 4 is not one the spec's constraints allow": lambda p: p["units"][llm].update(
            tp=4),
        "llm: ep 2, but it has no experts": lambda p: p["units"][llm].update(ep=2),
    }
    for words, edit in edits.items():
        bad = json.loads(json.dumps(good))
        edit(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        code, _, err = run(capsys, "simulate", TINY, "--plan", str(path), "--steps", "1",
                           "--logdir", str(tmp_path / "tb"))
        assert code == 2 and "does not fit the spec" in err and words in err, (words, err)
    # A value of the wrong type: one line naming the field, no validation report.
    bad = json.loads(json.dumps(good))
    bad["units"][llm]["recompute"] = "rm -rf"
    path.write_text(json.dumps(bad))
    code, _, err = run(capsys, "simulate", TINY, "--plan", str(path), "--steps", "1",
                       "--logdir", str(tmp_path / "tb"))
    assert code == 2 and f"units.{llm}.recompute: Value error, 'rm -rf'" in err, err
    assert len(err.strip().splitlines()) == 1 and "pydantic" not in err, err


def test_simulate_logdir_errors(capsys, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:   # an unwritable log dir (root writes anywhere)
        patch.setattr(cli.simulate.tempfile, "TemporaryFile", refuse)
        code, _, err = run(capsys, "simulate", TINY, "--logdir", str(tmp_path / "ro"),
                           "--steps", "1")
    assert code == 2 and "cannot write to" in err and "Permission denied" in err
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = run(capsys, "simulate", TINY, "--logdir", str(afile), "--steps", "1")
    assert code == 2 and "is a file" in err
    logdir = tmp_path / "tb"
    (logdir / "trace.json").mkdir(parents=True)
    code, _, err = run(capsys, "simulate", TINY, "--logdir", str(logdir), "--steps", "1",
                       "--reorder", "none")
    assert code == 2 and "trace.json is a directory" in err   # said before simulating


def test_simulate_refuses_to_mix_runs_in_one_logdir(capsys, tmp_path, monkeypatch):
    logdir = tmp_path / "tb"
    args = ("simulate", TINY, "--logdir", str(logdir), "--reorder", "none", "--json")
    assert run(capsys, *args, "--steps", "1")[0] == 0
    code, _, err = run(capsys, *args, "--steps", "2")
    assert code == 2 and "earlier run" in err and "--overwrite" in err
    monkeypatch.setattr(cli.simulate, "TRACE_STEPS", 1)
    code, out, err = run(capsys, *args, "--steps", "2", "--overwrite")
    assert code == 0, err
    assert json.loads(out)["trace_steps"] == 1
    assert [e.step for e in _events(logdir).Scalars("time/iteration_s")] == [0, 1]
    trace = json.loads((logdir / "trace.json").read_text())
    steps = {e["args"].get("step") for e in trace["traceEvents"]
             if e.get("ph") == "X" and "args" in e}
    assert steps == {0}


def test_emit_schedule_round_trips(capsys):
    code, out, err = run(capsys, "check", TINY, "--emit", "schedule")
    assert code == 0, err
    schedule = parse_schedule(out)
    # dtc plan's layout (the tiny spec co-locates its ViT and U-Net on the backbone's
    # GPUs: their passes are the backbone stage's, and they have no stages of their own).
    code, plan_out, err = run(capsys, "check", TINY, "--emit", "plan")
    assert code == 0, err
    own = {u["name"] for u in json.loads(plan_out)["units"] if not u["colocated"]}
    assert {u.name for u in schedule.units} == own
    assert "llm.s0:" in out


def test_reorder_intra_json(capsys, tmp_path):
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 1.2, 256).tolist()
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    code, out, err = run(capsys, "reorder", "intra", "--costs", str(path), "--groups", "16",
                         "--json")
    assert code == 0, err
    doc = json.loads(out)
    assignment = doc["assignment"]
    assert len(assignment) == 256 and set(assignment) == set(range(16))
    loads = np.bincount(assignment, weights=costs, minlength=16)
    assert np.bincount(assignment).tolist() == [16] * 16
    assert doc["loads"] == pytest.approx(loads.tolist())
    largest_plus_smallest = max(costs) + sum(sorted(costs)[:15])
    bound = max(sum(costs) / 16, largest_plus_smallest)
    assert doc["lower_bound"] == pytest.approx(bound)
    assert doc["ratio"] == pytest.approx(loads.max() / bound)
    assert doc["ratio"] < 1.01


def test_reorder_inter_json(capsys, tmp_path):
    rng = np.random.default_rng(1)
    fwd = rng.lognormal(0, 0.6, 16)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": fwd.tolist(), "backward": (2 * fwd).tolist(),
                                "stage_forward": 1.0, "stage_backward": 2.0}))
    code, out, err = run(capsys, "reorder", "inter", "--costs", str(path), "--stages", "4",
                         "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert sorted(doc["order"]) == list(range(16))
    assert doc["iteration_time"] > 0
    code, out, _ = run(capsys, "reorder", "inter", "--costs", str(path), "--stages", "4")
    assert code == 0 and "iteration time" in out


@pytest.mark.parametrize("content,words", [
    ("[1, 2,", "not JSON"),
    ('{"a": 1}', "list of per-sample costs"),
    ("[1, -2, 3]", "costs"),
])
def test_reorder_intra_bad_input(capsys, tmp_path, content, words):
    path = tmp_path / "c.json"
    path.write_text(content)
    code, _, err = run(capsys, "reorder", "intra", "--costs", str(path), "--groups", "2")
    assert code == 2 and words in err


def test_reorder_inter_bad_input(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"forward": [1, 2], "backward": [1]}))
    code, _, err = run(capsys, "reorder", "inter", "--costs", str(path), "--stages", "2")
    assert code == 2 and "stage_forward" in err
    path.write_text(json.dumps({"forward": [1, 2], "backward": [1], "stage_forward": 1,
                                "stage_backward": 1}))
    code, _, err = run(capsys, "reorder", "inter", "--costs", str(path), "--stages", "2")
    assert code == 2 and "backward" in err
    code, _, err = run(capsys, "reorder", "inter", "--costs", str(tmp_path / "none.json"),
                       "--stages", "2")
    assert code == 2 and "cannot read costs" in err


def test_a_plans_expert_parallelism_splits_the_experts_and_the_data_parallel_ranks(
        shipped_plan):
    from dtdsl.driver import run_frontend
    from dtdsl.ir.plan import Plan
    from dtdsl.ir.plan_check import plan_problems

    spec = ROOT / "specs" / "moe_vl_30b.dt"
    program = run_frontend(str(spec), spec.read_bytes()).program
    plan = Plan.model_validate_json(shipped_plan("moe_vl_30b").read_text())
    assert plan_problems(plan, program) == []
    (llm,) = [u for u in plan.units if u.role == "backbone"]

    def problems(**update):
        return plan_problems(plan.model_copy(update={"units": tuple(
            u.model_copy(update=update) if u is llm else u for u in plan.units)}), program)

    assert any("ep 3 cannot split its 128 experts" in p for p in problems(ep=3))
    odd = llm.dp * 2      # 128 experts split, but not the dp ranks (a power of two above dp)
    assert any(f"ep {odd} must divide dp {llm.dp}" in p for p in problems(ep=odd))
    assert any("ep 0" not in p and "at least 1" in p for p in problems(ep=0))
