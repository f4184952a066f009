"""The dry run: a bundle's every rank brought up with the fake backend on one machine,
its groups, descriptors, feed connections and telemetry checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import grids, role_of
from dtdsl.train import dryrun
from dtdsl.train.timelines import TELEMETRY_BYTES

ROOT = Path(__file__).resolve().parents[2]


def _compile(spec: str, out: Path, *extra: str) -> Path:
    assert cli.main(["compile", str(ROOT / "specs" / spec), "-o", str(out), "--synthetic",
                     *extra]) == 0
    return out


@pytest.fixture(scope="module")
def bundle_72b(shipped_bundle) -> Path:
    """``dtc compile specs/mllm_72b.dt --synthetic`` (the dry run writes nothing into it)."""
    return shipped_bundle("mllm_72b")


def test_the_72b_bundle_comes_up_on_every_rank_and_node(bundle_72b):
    report = dryrun.dry_run(bundle_72b)
    assert report.ok, report.problems[:20]
    plan = Plan.model_validate_json((bundle_72b / "plan.json").read_bytes())
    world = plan.gpus_used
    assert report.world_size == world > 1000 and report.checked_ranks == world
    assert report.checked_nodes == list(range(report.nodes))
    # Every unit and stage is there, and every rank's groups are its plan's, no others.
    assert {(c.unit, c.stage) for c in report.ranks} == \
        {(g.name, s) for g in grids(plan) for s in range(g.pp)}
    for c in report.ranks:
        role = role_of(plan, c.rank)
        want = {name: sorted(members) for name, members in
                (("tp", role.tp_ranks), ("dp", role.dp_ranks), ("pp", role.pp_ranks))
                if len(members) > 1}
        assert c.groups == want, c.rank
        assert c.descriptors <= dryrun.MAX_FDS, c
    assert 0 < report.max_groups_per_rank <= 3
    assert report.backend == "nccl" and report.worker_descriptors <= dryrun.MAX_FDS
    # A worker's sockets follow its node, not the job: one per local trainer and one more.
    assert report.feed["worker"] < 4 * (report.gpus_per_node + 1)
    assert report.max_telemetry_bytes_per_step < TELEMETRY_BYTES
    assert report.telemetry_every > 1
    assert all(sum(c.samples_per_step) > 0 for c in report.ranks
               if c.stage == 0 and c.tp_index == 0)


def test_one_node_of_the_bundle_and_the_command_line(bundle_72b, tmp_path, capsys):
    out = tmp_path / "report.json"
    last = dryrun.dry_run(bundle_72b, node=146)
    assert [c.node for c in last.ranks] == [146] * len(last.ranks)
    assert dryrun.main([str(bundle_72b), "--node", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "8 of " in printed and "ok" in printed.splitlines()[-1]
    body = json.loads(out.read_text())
    assert [r["rank"] for r in body["ranks"]] == list(range(8))
    assert dryrun.main([str(bundle_72b), "--node", "999"]) == 2


def test_a_wrong_group_or_too_many_descriptors_are_reported(tmp_path, monkeypatch):
    """The checks can fail: a rank that also makes a world group, and a descriptor limit
    the job cannot meet."""
    import torch.distributed as dist

    from dtdsl.parallel import mesh

    bundle = _compile("tiny_cpu.dt", tmp_path / "tiny")
    fine = dryrun.dry_run(bundle, steps=2, feed_bytes=True)
    assert fine.ok and fine.backend == "gloo"
    # Every rank's share of step 0 arrives in one message, measured as a worker encodes it.
    assert all(c.feed_bytes > 0 for c in fine.ranks)
    assert len({c.feed_bytes for c in fine.ranks}) > 1
    real = mesh.build_groups

    def with_a_world_group(plan, **kwargs):
        groups = real(plan, **kwargs)
        dist.new_group(list(range(plan.gpus_used)))
        return groups

    monkeypatch.setattr(mesh, "build_groups", with_a_world_group)
    report = dryrun.dry_run(bundle)
    assert not report.ok
    assert any("a world-size group" in p for p in report.problems), report.problems
    monkeypatch.setattr(mesh, "build_groups", real)
    tight = dryrun.dry_run(bundle, max_fds=20)
    assert any("descriptors (over 20)" in p for p in tight.problems), tight.problems
