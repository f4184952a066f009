"""A compiled tiny bundle, launched with its launch.sh (torchrun, gloo), trains like the
single-process reference and writes its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.driver import run_frontend
from tests.helpers.bundle import (
    DATASET_SAMPLES,
    FEED_STEPS,
    RTOL,
    SPEC,
    STEPS,
    consumed,
    launch_ok,
    on_two_ranks,
    read_jsonl,
    reference_losses,
    worker_log,
)


@pytest.fixture(scope="module")
def fed_run(tiny_run) -> Path:
    """The tiny bundle (2 workers, on its dataset) launched: the shared run
    (``tests/conftest.py``'s ``tiny_run``: 8 steps, a checkpoint every 2, which changes
    no step's numbers); its first ``FEED_STEPS`` steps checked here."""
    assert tiny_run.returncode == 0, tiny_run.out.read_text()[-3000:]
    return tiny_run.run_dir


@pytest.mark.slow
def test_fed_bundle_matches_the_reference_and_consumes_an_epoch_once(fed_run, tiny_run):
    # (Three workers, one killed at step 3 and restarted: tests/data/test_webdataset.py's
    # bundle test. A killed worker of this bundle: tests/codegen/test_fault.py.)
    metrics = read_jsonl(fed_run / "metrics.jsonl")[:FEED_STEPS]
    for m, ref in zip(metrics, reference_losses(FEED_STEPS, tiny_run.dataset), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
    keys = sorted(f"{i:08d}" for i in range(DATASET_SAMPLES))
    for unit in ("vit", "llm", "gen"):
        per_step = consumed(fed_run, unit)
        epoch = [k for step in range(3) for k in per_step[step]]
        assert sorted(epoch) == keys, unit          # every sample once in epoch 0
        assert len(set(per_step[3])) == 16          # the next epoch has begun
    log = worker_log(fed_run)
    assert "worker 0: step 0 sent" in log and "worker 1: step 1 sent" in log


@pytest.mark.slow
def test_in_process_bundle_matches_the_reference(tmp_path):
    # On 2 ranks (tiny_cpu's layout at DP 2): its claims (the reference's losses, every
    # sample once, the predicted and measured timelines) hold for any number of replicas.
    spec = tmp_path / "tiny_cpu.dt"
    spec.write_text(on_two_ranks(SPEC.read_text()))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", str(STEPS))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
        assert m["iteration_time_s"] > 0 and m["data_wait_s"] >= 0
    # every sample of a step consumed once by every unit
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for step in range(STEPS):
        for unit in ("vit", "llm", "gen"):
            keys = [k for r in records if r["step"] == step and r["unit"] == unit
                    for k in r["keys"]]
            assert sorted(keys) == sorted(f"synthetic/{step}/{i}" for i in range(16))
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"measured/pipeline/gantt", "predicted/pipeline/gantt"} <= set(tags["images"])
    assert {"measured/loss/total", "measured/data/wait_s",
            "measured/throughput/samples_per_s", "predicted/time/iteration_s"} <= \
        set(tags["scalars"])
    # The prediction of each step is the simulator's for that step's own batch and routing.
    got = [(e.step, e.value) for e in acc.Scalars("predicted/time/iteration_s")]
    assert [s for s, _ in got] == list(range(STEPS))
    assert [v for _, v in got] == pytest.approx(predicted_times(bundle, STEPS, spec), rel=1e-6)
    # timelines.jsonl: both timelines of every step; a pass's measured time starts when
    # its inputs are there, so it is compute: within the step, never longer than it.
    from dtdsl.ir.timeline import Timeline

    lines = read_jsonl(run_dir / "timelines.jsonl")
    assert [line["step"] for line in lines] == list(range(STEPS))
    for line, (_, predicted) in zip(lines, got, strict=True):
        measured = Timeline.from_json(line["measured"])
        assert Timeline.from_json(line["predicted"]).iteration_time_s == \
            pytest.approx(predicted, rel=1e-6)
        plan = json.loads((bundle / "plan.json").read_text())
        # A stage of every unit with GPUs (co-located units' passes are their host's).
        assert set(measured.compute_s()) == {f"{u['name']}.s{s}" for u in plan["units"]
                                             if u["gpus"] for s in range(u["pp"])}
        assert all(0 < v <= measured.iteration_time_s
                   for v in measured.compute_s().values())
    assert {"measured/pipeline/compute_s/llm.s0", "predicted/pipeline/compute_s/llm.s0"} <= \
        set(tags["scalars"])


def predicted_times(bundle: Path, steps: int, spec: Path = SPEC) -> list[float]:
    from dtdsl.cost.model import build_cost_model
    from dtdsl.data.batch import SyntheticSource, route_batch, routing_of, sample_set
    from dtdsl.ir.plan import Plan
    from dtdsl.reorder.workload import WorkModel
    from dtdsl.schedule.lower import lower
    from dtdsl.sim.run import simulate_routed
    from dtdsl.sim.simulate import Simulator

    program = run_frontend(str(spec), spec.read_bytes()).program
    plan = Plan.model_validate_json((bundle / "plan.json").read_bytes())
    cost = build_cost_model(program)
    work_model, simulator = WorkModel(cost), Simulator(lower(plan, program))
    source = SyntheticSource(program)
    out = []
    for step in range(steps):
        sizes = source.sizes(step)
        routing = route_batch(plan, program, sizes, frozenset(program.train.reorder),
                              work_model)
        out.append(simulate_routed(cost, plan, simulator, work_model, step,
                                   sample_set(program, sizes),
                                   routing_of(plan, routing)).iteration_time_s)
    return out


def test_a_co_located_pipelined_bundle_compiles_and_dry_runs(tmp_path):
    """A bundle of a co-located plan (the encoder on the backbone's first stage, the
    generator on its last, the backbone's layers split 1/3 over 2 stages of 2 replicas):
    its rank programs host the co-located units, and its dry run builds every rank and
    feeds each its share. Its layout trains as the reference in
    test_colocated.test_co_located_encoder_on_a_pipelined_data_parallel_backbone; a
    co-located bundle launches, resumes and exports in the shared tiny run (both units on
    the backbone's stage) and the phased bundle below (the generator on the last of 2)."""
    from tests.helpers.plans import colocate
    from tests.helpers.runs import plan_for

    program = run_frontend(str(SPEC), SPEC.read_bytes()).program
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 2, 2),
                                      ("gen", "generator", 1, 1, 1)),
                    "vit", "gen", split=(1, 3))
    plan = plan.model_copy(update={"spec": program.name,
                                   "spec_sha256": program.source_sha256})
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(SPEC), "--plan", str(tmp_path / "plan.json"), "-o",
                     str(bundle), "--synthetic", "--workers", "1"]) == 0
    readme = (bundle / "README.md").read_text()
    assert "Encoder vit and its projector vit_to_llm run on the GPUs of llm's stage 0" in \
        " ".join(readme.split())
    assert sorted(p.name for p in (bundle / "ranks").iterdir()) == ["llm_s0.py", "llm_s1.py"]
    assert "co-located gen" in (bundle / "ranks" / "llm_s1.py").read_text()
    from dtdsl.train import dryrun

    report = dryrun.dry_run(bundle, feed_bytes=True)
    assert report.ok, report.problems
    assert [c.unit for c in report.ranks] == ["llm"] * 4
    assert all(c.feed_bytes for c in report.ranks)


@pytest.mark.slow
def test_a_phased_plan_bundle_dry_runs_trains_and_exports(tmp_path):
    """A compiled bundle of a hand-made phased plan (the ViT before and after a two-stage
    backbone's pipeline, over both its replicas; the generator co-located on its last
    stage: 4 ranks, one node): it dry-runs (the encoder's DP group over the backbone's
    stages is one its ranks make), trains as the reference, and its checkpoint exports
    every module. (A phased plan's checkpoint resumes, resharded, in
    test_colocated.test_checkpoints_reshard_between_co_located_phased_and_disaggregated_plans;
    launch.sh --resume in the shared tiny run's tests, test_fault's and test_launch_lock's.)"""
    from dtdsl.ir.checkpoint import latest_checkpoint
    from tests.helpers.plans import colocate, phase
    from tests.helpers.runs import plan_for

    spec = tmp_path / "tiny_ckpt.dt"
    spec.write_text(SPEC.read_text().replace("checkpoint_every = 10", "checkpoint_every = 2"))
    program = run_frontend(str(spec), spec.read_bytes()).program
    plan = phase(program, colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                                     ("llm", "backbone", 1, 2, 2),
                                                     ("gen", "generator", 1, 1, 1)),
                                   "gen", split=(3, 1)))
    plan = plan.model_copy(update={"spec": program.name,
                                   "spec_sha256": program.source_sha256})
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "--plan", str(tmp_path / "plan.json"), "-o",
                     str(bundle), "--synthetic", "--workers", "1"]) == 0
    readme = " ".join((bundle / "README.md").read_text().split())
    assert "Encoder vit and its projector vit_to_llm run phased on the GPUs of all 2 of " \
        "llm's stages" in readme
    assert sorted(p.name for p in (bundle / "ranks").iterdir()) == ["llm_s0.py", "llm_s1.py"]
    assert "phased vit" in (bundle / "ranks" / "llm_s1.py").read_text()
    from dtdsl.train import dryrun

    report = dryrun.dry_run(bundle, feed_bytes=True)
    assert report.ok, report.problems
    assert [c.unit for c in report.ranks] == ["llm"] * 4
    assert all(c.feed_bytes for c in report.ranks)     # every rank reads its share
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "3")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m, ref in zip(metrics, reference_losses(3, spec=spec), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
    # The measured timelines have the backbone's rows only, as the predicted ones: the
    # phases are events there (F and B without a microbatch).
    from dtdsl.ir.timeline import Timeline

    line = read_jsonl(run_dir / "timelines.jsonl")[-1]
    measured = Timeline.from_json(line["measured"])
    assert set(measured.compute_s()) == {"llm.s0", "llm.s1"}
    assert {e.kind for e in measured.events if e.microbatch is None} >= {"F", "B"}
    out = tmp_path / "export"
    assert cli.main(["export", str(latest_checkpoint(run_dir)), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gen", "llm", "llm_to_gen", "vit",
                                                     "vit_to_llm"]
