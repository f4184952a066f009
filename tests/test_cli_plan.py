"""dtc plan, dtc profile and dtc graph: output, files, errors (in-process, for speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.ir.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny_cpu.dt")
M72 = str(ROOT / "specs" / "mllm_72b.dt")
M9 = str(ROOT / "specs" / "mllm_9b.dt")


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_plan_json_has_the_promised_fields(capsys):
    code, out, err = run(capsys, "plan", M72, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {"search", "iteration_time_s", "mfu", "solve_time_s", "units", "simulated",
            "baselines"} <= set(doc)
    assert doc["search"] == "convex" and doc["num_gpus"] == 1172
    for unit in doc["units"]:
        assert {"name", "gpus", "tp", "dp", "pp"} <= set(unit)
    assert sum(u["gpus"] for u in doc["units"]) <= 1172
    assert 0.3 < doc["mfu"] < 0.6
    assert set(doc["baselines"]) == {"megatron", "megatron_packed"}
    for name, base in doc["baselines"].items():
        assert {"simulated_s", "planned_s", "layout", "speedup", "simulated_speedup"} <= \
            set(base)
        assert base["packing"] == (name == "megatron_packed")
        assert base["layout"]["search"] == "baseline" and base["layout"]["units"]
        assert base["simulated_s"] > 0 and base["planned_s"] > 0
    megatron = doc["baselines"]["megatron"]
    assert megatron["speedup"] == pytest.approx(megatron["planned_s"] /
                                                doc["iteration_time_s"])
    assert megatron["simulated_speedup"] == pytest.approx(
        megatron["simulated_s"] / doc["simulated"]["iteration_time_s"])
    assert Plan.model_validate(doc).speedup() == pytest.approx(megatron["speedup"])


def test_plan_table_shows_units_time_mfu_speedup_and_search(capsys):
    code, out, _ = run(capsys, "plan", TINY)
    assert code == 0
    for unit in ("vit + vit_to_llm", "llm", "gen + llm_to_gen"):
        assert unit in out
    for word in ("iteration time", "MFU", "speedup", "over megatron", "over megatron_packed",
                 "memory/GPU", "layers/stage", "convex solves"):
        assert word in out


def test_searches_agree_and_report_the_faithful_baseline(capsys, tmp_path):
    from dtdsl.cost.model import build_cost_model
    from dtdsl.driver import run_frontend
    from dtdsl.planner import plan_baseline

    times, docs = {}, {}
    for search in ("convex", "exhaustive", "baseline"):
        code, out, err = run(capsys, "plan", TINY, "--gpus", "6", "--search", search, "--json")
        assert code == 0, err
        doc = docs[search] = json.loads(out)
        assert doc["search"] == search and doc["num_gpus"] == 6
        times[search] = doc["iteration_time_s"]
    assert times["convex"] == pytest.approx(times["exhaustive"], rel=1e-3)
    assert docs["convex"]["baselines"]["megatron"]["speedup"] == pytest.approx(
        times["baseline"] / times["convex"])
    # Megatron-LM co-locates this tiny encoder with the backbone, which the disaggregated
    # search cannot; against its own-stage placement the disaggregated plan wins.
    assert any(u["colocated"] for u in docs["baseline"]["units"])
    program = run_frontend(TINY, Path(TINY).read_bytes()).program
    own = plan_baseline(build_cost_model(program), 6, placements=("stages",))
    assert own.iteration_time_s > times["convex"]


def test_plan_writes_the_plan_file(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", TINY, "-o", str(target), "--no-baseline")
    assert code == 0 and "baselines       not compared" in out
    plan = Plan.model_validate_json(target.read_text())
    assert plan.baselines is None and plan.speedup() is None and plan.spec == "tiny_cpu"


def test_infeasible_plan_is_a_diagnostic_at_the_gpus_line(capsys):
    code, out, err = run(capsys, "plan", M72, "--gpus", "16")
    assert code == 1 and out == ""
    assert "error[DT410]: llm needs at least" in err
    assert "gpus          = 1172" in err           # the source line, with a caret below
    assert "planned for 16 GPUs" in err


@pytest.mark.parametrize(("args", "message"), [
    (("--search", "exhaustive"), "stops at 128 GPUs"),
    (("--efficiency", "matmul=1.5"), "--efficiency takes"),
    (("--efficiency", "tensor=0.5"), "--efficiency takes"),
    (("--profile", "/nonexistent/profile.json"), "cannot use profile"),
    (("--search", "baseline", "--placement", "disaggregated"), "use one or the other"),
])
def test_plan_usage_errors(capsys, args, message):
    code, _, err = run(capsys, "plan", M72, *args)
    assert code == 2 and message in err


def test_efficiency_calibrates_the_analytic_model(capsys):
    plans = {}
    for eff in ("1.0", "0.35"):
        code, out, _ = run(capsys, "plan", M9, "--efficiency", eff, "--json", "--no-baseline")
        assert code == 0
        plans[eff] = json.loads(out)
    assert plans["0.35"]["iteration_time_s"] > 1.5 * plans["1.0"]["iteration_time_s"]


def test_spec_errors_stop_before_planning(capsys, tmp_path):
    bad = tmp_path / "bad.dt"
    bad.write_text("train { global_batch = 64\n  globl = 3 }\n")
    code, out, err = run(capsys, "plan", str(bad))
    assert code == 1 and out == "" and "DT201" in err


def test_profile_then_plan_with_it(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    code, _, err = run(capsys, "profile", TINY, "-o", str(profile), "--tp", "1",
                       "--repeats", "1", "--warmup", "0")
    assert code == 0, err
    assert "wrote" in err and "llm" in err
    doc = json.loads(profile.read_text())
    assert doc["version"] == 1 and doc["device"]["type"] in ("cpu", "cuda")
    code, out, err = run(capsys, "plan", TINY, "--profile", str(profile), "--json")
    assert code == 0, err
    plan = json.loads(out)
    # Only TP 1 was measured, so only TP 1 can be planned.
    assert all(u["tp"] == 1 for u in plan["units"])
    # The measured plan is another plan than the analytic one (a CPU, not the spec's GPU).
    _, analytic, _ = run(capsys, "plan", TINY, "--json", "--no-baseline")
    assert plan["iteration_time_s"] != json.loads(analytic)["iteration_time_s"]
    # A profile of another spec does not cover this one.
    code, _, err = run(capsys, "plan", M72, "--profile", str(profile))
    assert code == 2 and "no measurements for" in err


def test_profile_bad_tp_is_a_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "profile", TINY, "-o", str(tmp_path / "p.json"), "--tp", "x")
    assert code == 2 and "--tp takes" in err


def test_graph_text_dot_and_emit(capsys, tmp_path):
    code, text, _ = run(capsys, "graph", TINY)
    assert code == 0 and text.startswith("graph tiny_cpu:")
    code, emitted, _ = run(capsys, "check", "--emit", "graph", TINY)
    assert code == 0 and emitted == text
    plan = tmp_path / "plan.json"
    assert run(capsys, "plan", TINY, "-o", str(plan), "--no-baseline")[0] == 0
    dot = tmp_path / "g.dot"
    code, out, _ = run(capsys, "graph", TINY, "--dot", "--plan", str(plan), "-o", str(dot))
    assert code == 0 and out == ""
    body = dot.read_text()
    assert body.startswith('digraph "tiny_cpu" {') and body.rstrip().endswith("}")
    assert "cluster_llm" in body and '"llm.s0"' in body


def test_check_emit_keeps_warnings_off_stdout(capsys, tmp_path):
    spec = tmp_path / "warn.dt"
    text = Path(TINY).read_text().replace('  source = "data/tiny"\n',
                                          '  source = "data/tiny"\n  audio.frames ~ constant(10)\n')
    spec.write_text(text)
    code, out, err = run(capsys, "check", "--emit", "program", str(spec))
    assert code == 0 and "warning" in err
    json.loads(out)   # stdout is the program and nothing else


@pytest.fixture(scope="module")
def wide_plans(shipped_plan, planned_compile) -> list[tuple[str, Plan]]:
    """The plans the width test renders, each planned once for every width (the
    planner's answer does not depend on the terminal): each spec's own plan as the run's
    other tests made it (`dtc plan --no-baseline`'s for 72b, `dtc compile`'s bundle's
    for audio_image: planning them takes most of a minute of CPU), and its Megatron-LM
    baseline."""
    from dtdsl.cost.model import build_cost_model
    from dtdsl.driver import run_frontend
    from dtdsl.planner import plan_baseline

    out = []
    for name, planned in (("mllm_72b", shipped_plan("mllm_72b")),
                          ("audio_image", planned_compile("audio_image") / "plan.json")):
        path = Path(TINY).parent / f"{name}.dt"
        cost = build_cost_model(run_frontend(str(path), path.read_bytes()).program)
        own = Plan.model_validate_json(planned.read_text())
        out += [(name, own), (name, plan_baseline(cost))]
    return out


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_the_plan_stays_readable_at_every_width(width, wide_plans):
    """Narrow terminals get the layout and the costs stacked: every unit's GPUs, TP, DP
    and PP are printed, no line is wider than the terminal (issue 19)."""
    import io

    from rich.console import Console

    from dtdsl.report import render_plan

    for name, the_plan in wide_plans:
        buf = io.StringIO()
        render_plan(the_plan, Console(file=buf, width=width, color_system=None))
        lines = buf.getvalue().splitlines()
        assert max(len(line) for line in lines) <= width
        rows = []
        for line in lines:
            cells = [c.strip() for c in line.split("│")[1:-1]]
            if len(cells) >= 8 and cells[2]:
                rows.append(tuple(cells[2:6]))
        assert rows == [(str(u.gpus), str(u.tp), str(u.dp), str(u.pp))
                        for u in the_plan.units], (name, width, buf.getvalue())
        for word in ("fwd", "sync + opt", "memory/GPU", "iteration time"):
            assert word in buf.getvalue()


def test_plan_compares_the_drawn_steps_packed_and_unpacked(capsys):
    """dtc plan simulates its layout on the same drawn steps with train.packing toggled
    and says which trains more positions a second (in --json under simulated.packing)."""
    code, out, err = run(capsys, "plan", TINY, "--json", "--no-baseline")
    assert code == 0, err
    packing = json.loads(out)["simulated"]["packing"]
    assert packing["spec_packs"] is False
    assert packing["packed_s"] > 0 and packing["unpacked_s"] > 0
    # tiny_cpu's samples are far shorter than seq_len: a packed step trains more of them
    assert packing["packed_positions"] > 2 * packing["unpacked_positions"]
    code, out, _ = run(capsys, "plan", TINY, "--no-baseline")
    line = next(line for line in out.splitlines() if line.startswith("packing"))
    plan = Plan.model_validate(json.loads(run(capsys, "plan", TINY, "--json",
                                              "--no-baseline")[1]))
    verdict = ("set train.packing = true" if plan.simulated.packing.packing_faster
               else "(train.packing = false is the faster)")
    assert verdict in out.replace("\n", " "), line


def test_packing_verdict_compares_time_per_position():
    from dtdsl.ir.plan import Packing

    # twice the time for three times the positions: packing is faster
    assert Packing(spec_packs=False, packed_s=2.0, unpacked_s=1.0, packed_positions=3e6,
                   unpacked_positions=1e6).packing_faster
    assert not Packing(spec_packs=True, packed_s=4.0, unpacked_s=1.0, packed_positions=3e6,
                       unpacked_positions=1e6).packing_faster


def test_a_plan_repriced_for_packing_keeps_its_layout(wide_plans):
    """The same layout under another cost model: unit times scaled by the ratio of the
    unit's times under the two at its TP degree; layout, memory and sync unchanged."""
    from dtdsl.cost.model import build_cost_model
    from dtdsl.driver import run_frontend
    from dtdsl.planner.simulated import repriced

    path = Path(M72)
    program = run_frontend(str(path), path.read_bytes()).program
    cost = build_cost_model(program)
    packed = build_cost_model(program.model_copy(update={"train": program.train.model_copy(
        update={"packing": True})}))
    # plan(cost, compare_baseline=False) of 72b, planned once for this module
    the_plan = next(p for name, p in wide_plans
                    if name == "mllm_72b" and p.search != "baseline")
    assert repriced(the_plan, cost, cost) == the_plan
    other = repriced(the_plan, cost, packed)
    for u, v in zip(the_plan.units, other.units, strict=True):
        assert (u.gpus, u.tp, u.dp, u.pp, u.memory_bytes, u.dp_sync_time_s) == \
            (v.gpus, v.tp, v.dp, v.pp, v.memory_bytes, v.dp_sync_time_s)
        old = cost.fwd_bwd_time_s(cost.unit(u.name), u.tp)
        new = packed.fwd_bwd_time_s(packed.unit(u.name), u.tp)
        assert v.fwd_time_s == pytest.approx(u.fwd_time_s * new[0] / old[0])
    # a packed backbone microbatch is a whole seq_len of documents: more work than a sample
    llm = [u for u in the_plan.units if u.role == "backbone"][0]
    assert other.units[the_plan.units.index(llm)].fwd_time_s > llm.fwd_time_s


def test_the_packing_comparison_routes_both_sides_as_a_run_does(capsys):
    """Both settings under the spec's reorder policy: the spec's own side is the plan's
    simulated time under that policy, not the time without reordering."""
    code, out, err = run(capsys, "plan", TINY, "--json", "--no-baseline")
    assert code == 0, err
    sim = json.loads(out)["simulated"]
    assert sim["packing"]["policy"] == sim["policy"] == ["inter", "intra"]
    assert sim["packing"]["unpacked_s"] == sim["iteration_time_s"]
    code, out, _ = run(capsys, "plan", TINY, "--no-baseline")
    line = next(line for line in out.splitlines() if line.startswith("packing"))
    assert "reorder inter+intra" in line and "no reordering" not in line


def test_one_progress_callback_hears_every_phase_of_planning():
    """dtc plan draws one bar: the baselines, the search and the drawn batches each report
    through it, named in the note."""
    from dtdsl.cost.model import build_cost_model
    from dtdsl.driver import run_frontend
    from dtdsl.planner import plan

    program = run_frontend(TINY, Path(TINY).read_bytes()).program
    notes = []
    plan(build_cost_model(program), 4, simulate_steps=1,
         progress=lambda done, total, note: notes.append(note))
    for phase in ("megatron:", "megatron_packed:", "convex search:", "drawn batches:"):
        assert any(n.startswith(phase) for n in notes), (phase, sorted(set(notes)))
    assert any("simulating" in n for n in notes if n.startswith("drawn batches:"))


def test_the_progress_bar_appears_only_after_its_delay(monkeypatch):
    import dtdsl.report as report

    started = []

    class FakeProgress:
        def __init__(self, *args, **kwargs):
            pass

        def add_task(self, *args, **kwargs):
            return 0

        def update(self, *args, **kwargs):
            pass

        def start(self):
            started.append(True)

        def stop(self):
            started.append(False)

    clock = iter([0.0, 1.0, 2.5, 3.0])
    monkeypatch.setattr(report, "Progress", FakeProgress)
    monkeypatch.setattr(report.time, "monotonic", lambda: next(clock))
    with report.progress_bar("planning", enabled=True, delay_s=2.0) as progress:
        progress(1, 3, "early")            # at 1.0 s: nothing drawn yet
        assert started == []
        progress(2, 3, "late")             # at 2.5 s: the bar appears
        assert started == [True]
        progress(3, 3, "later")
    assert started == [True, False]        # and is erased at the end


def test_an_infeasible_memory_limit_is_written_in_its_own_units(capsys, tmp_path):
    # 15 MiB a GPU: the message says 15.0 MiB and 0.37% of the GPU, not "0.0 GB" and "0%".
    spec = tmp_path / "small.dt"
    text = Path(TINY).read_text()
    assert "  tp(*) in {1, 2}" in text
    spec.write_text(text.replace("  tp(*) in {1, 2}", "  tp(*) in {1, 2}\n  memory(*) <= 15 MiB")
                    .replace('  source = "data/tiny"\n', ""))      # synthetic samples
    code, _, err = run(capsys, "plan", str(spec))
    assert code == 1 and "error[DT410]" in err
    assert "to fit in 15.0 MiB per GPU (0.37% of 4.0 GiB)" in err, err
