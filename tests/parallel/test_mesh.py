"""Unit rank grids, rank roles and the TP/DP/PP process groups (pure, then on gloo ranks)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist

from dtdsl.ir.schedule import ScheduleUnit
from dtdsl.parallel.mesh import MESH_DIMS, UnitGrid, build_groups, grids, role_of, unit_mesh_shape
from dtdsl.sim.timeline import TimelineUnit
from tests.dist import ChildFailed, make_plan, run

# vit: 2 stages x 1 replica x tp 1 (ranks 0-1); llm: 1 stage x 2 replicas x tp 2 (ranks 2-5)
PLAN6 = make_plan(("vit", "encoder", 1, 1, 2), ("llm", "backbone", 2, 2, 1))
# every dimension above 1 somewhere: 3 units, 12 ranks (pure tests only)
PLAN12 = make_plan(("vit", "encoder", 2, 1, 2), ("llm", "backbone", 2, 2, 1),
                   ("sd", "generator", 1, 2, 2))
SHAPES = [(1, 1, 1), (2, 1, 1), (1, 3, 1), (1, 1, 4), (2, 3, 2), (3, 2, 2)]


@pytest.mark.parametrize(("tp", "dp", "pp"), SHAPES)
def test_rank_and_coords_are_inverse_and_match_schedule_and_timeline(tp, dp, pp):
    g = UnitGrid(name="u", role="backbone", tp=tp, dp=dp, pp=pp, first_rank=5)
    su = ScheduleUnit(name="u", role="backbone", tp=tp, dp=dp, pp=pp, first_rank=5)
    tu = TimelineUnit(name="u", role="backbone", pp=pp, dp=dp, tp=tp, first_rank=5)
    seen = []
    for s, r, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = g.rank(s, r, t)
        assert g.coords(rank) == (s, r, t)
        assert rank in su.ranks(s)
        assert g.leader(s, r) == tu.rank(s, r) == g.rank(s, r, 0)
        seen.append(rank)
    assert sorted(seen) == list(g.ranks) == list(range(5, 5 + tp * dp * pp))
    for s in range(pp):
        assert g.stage_ranks(s) == su.ranks(s)
    with pytest.raises(IndexError):
        g.coords(4)
    with pytest.raises(IndexError):
        g.rank(pp, 0, 0)


@pytest.mark.parametrize(("tp", "dp", "pp"), SHAPES)
def test_every_rank_is_in_exactly_one_group_of_each_kind(tp, dp, pp):
    g = UnitGrid(name="u", role="encoder", tp=tp, dp=dp, pp=pp, first_rank=3)
    for kind, groups, size in (("tp", g.tp_groups(), tp), ("dp", g.dp_groups(), dp),
                               ("pp", g.pp_groups(), pp)):
        members = sorted(r for grp in groups for r in grp)
        assert members == list(g.ranks), kind
        assert all(len(grp) == size for grp in groups), kind
        assert len(groups) == g.size // size
    for grp in g.tp_groups():        # TP innermost: a TP group is a run of consecutive ranks
        assert list(grp) == list(range(grp[0], grp[0] + tp))
    for rank in g.ranks:
        s, r, t = g.coords(rank)
        assert g.tp_group_ranks(s, r) in g.tp_groups() and rank in g.tp_group_ranks(s, r)
        assert g.dp_group_ranks(s, t) in g.dp_groups() and rank in g.dp_group_ranks(s, t)
        assert g.pp_group_ranks(r, t) in g.pp_groups() and rank in g.pp_group_ranks(r, t)
        # a DP group holds the same (stage, tp shard); a PP group the same (replica, shard)
        assert {g.coords(x)[0::2] for x in g.dp_group_ranks(s, t)} == {(s, t)}
        assert {g.coords(x)[1:] for x in g.pp_group_ranks(r, t)} == {(r, t)}


def test_plan_grids_tile_the_ranks_and_roles_agree():
    gs = grids(PLAN12)
    assert [g.name for g in gs] == ["vit", "llm", "sd"]
    assert [list(g.ranks) for g in gs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for u in PLAN12.units:
        su = ScheduleUnit.of(u)
        for rank in u.ranks:
            role = role_of(PLAN12, rank)
            assert role.unit == u.name and role.role == u.role
            assert rank in su.ranks(role.stage)
            assert role.grid.rank(role.stage, role.replica, role.tp_index) == rank
            assert role.is_first_stage == (role.stage == 0)
            assert role.is_last_stage == (role.stage == u.pp - 1)
            assert role.is_leader == (rank == role.tp_ranks[0])
    with pytest.raises(IndexError, match="no unit"):
        role_of(PLAN12, 12)


def test_grids_reject_gaps_and_bad_sizes():
    gap = PLAN6.model_copy(update={"units": (PLAN6.units[0],
                                             PLAN6.units[1].model_copy(update={"first_rank": 3}))})
    with pytest.raises(ValueError, match="tile"):
        grids(gap)
    bad = PLAN6.model_copy(update={"units": (PLAN6.units[0].model_copy(update={"gpus": 3}),
                                             PLAN6.units[1])})
    with pytest.raises(ValueError, match="gpus=3"):
        grids(bad)
    with pytest.raises(ValueError, match="at least 1"):
        UnitGrid(name="u", role="encoder", tp=0, dp=1, pp=1)


def _groups_on_ranks(rank: int, world: int, zero: int) -> None:
    groups = build_groups(PLAN6, zero=zero)
    role = groups.role
    assert groups.rank == rank and role == role_of(PLAN6, rank)
    mesh = groups.mesh
    assert mesh.mesh_dim_names == MESH_DIMS
    assert tuple(mesh.shape) == unit_mesh_shape(role.grid, zero)
    dp = mesh["dp_shard"] if zero else mesh["dp_replicate"]
    assert mesh["dp_replicate" if zero else "dp_shard"].size() == 1
    for kind, pg, expected in (("tp", groups.tp, role.tp_ranks),
                               ("tp mesh", mesh.get_group("tp"), role.tp_ranks),
                               ("dp", dp.get_group(), role.dp_ranks),
                               ("pp", mesh.get_group("pp"), role.pp_ranks)):
        assert tuple(dist.get_process_group_ranks(pg)) == expected, kind
        # the group works and holds exactly those ranks
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=pg)
        assert x.item() == sum(expected), kind
    expected_roles = {0: ("vit", 0, 0, 0), 1: ("vit", 1, 0, 0), 2: ("llm", 0, 0, 0),
                      3: ("llm", 0, 0, 1), 4: ("llm", 0, 1, 0), 5: ("llm", 0, 1, 1)}
    assert (role.unit, role.stage, role.replica, role.tp_index) == expected_roles[rank]


@pytest.mark.parametrize("zero", [1, 0])
def test_build_groups_on_six_ranks(zero):
    run(_groups_on_ranks, 6, zero)


def _wrong_world(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="world size is 2"):
        build_groups(PLAN6)


def test_build_groups_checks_the_world_size():
    run(_wrong_world, 2)


# ---- the test helper itself ---------------------------------------------------------------------

def _fails_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _hangs(rank: int, world: int) -> None:
    time.sleep(60)


def test_run_reports_the_failing_rank_with_its_traceback():
    pattern = (r"(?s)^_fails_on_rank_one on 2 ranks:\n--- rank 1 failed first:"
               r".*line \d+, in _fails_on_rank_one.*ValueError: boom")
    with pytest.raises(ChildFailed, match=pattern):
        run(_fails_on_rank_one, 2)


def test_run_gives_up_on_a_hang():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_hangs on 2 ranks did not finish in 1 s"):
        run(_hangs, 2, timeout=1.0)
    assert time.monotonic() - start < 10
