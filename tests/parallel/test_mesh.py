"""Unit rank grids, rank roles and the TP/DP/PP process groups (pure, then on gloo ranks)."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator
from functools import cache

import pytest
import torch
import torch.distributed as dist

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.ir.schedule import ScheduleUnit
from dtdsl.ir.timeline import TimelineUnit
from dtdsl.parallel.mesh import (
    MESH_DIMS,
    ProcessGroups,
    UnitGrid,
    build_groups,
    data_parallel_mesh,
    dim_groups,
    grids,
    rank_groups,
    role_of,
    unit_mesh_shape,
)
from dtdsl.train.stage import tied_group_ranks, tied_pairs
from tests.dist import ChildFailed, make_plan, run
from tests.helpers.runs import LOSS_RTOL, PARAM_RTOL, plan_for, reference, spec

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


# ---- the groups a rank creates (pure) ------------------------------------------------------------


@pytest.mark.parametrize("zero", [1, 0])
def test_rank_groups_are_the_roles_groups_of_more_than_one_rank(zero):
    for rank in range(PLAN12.gpus_used):
        role = role_of(PLAN12, rank)
        want = {"pp": role.pp_ranks, "dp_shard" if zero else "dp_replicate": role.dp_ranks,
                "tp": role.tp_ranks}
        got = rank_groups(PLAN12, rank, zero)
        assert got == {d: r for d, r in want.items() if len(r) > 1}, rank
        assert list(got) == [d for d in MESH_DIMS if d in got]      # creation order
        # a group is the rank's line of the unit mesh along that dimension
        table = torch.arange(role.grid.first_rank, role.grid.first_rank + role.grid.size)
        table = table.reshape(unit_mesh_shape(role.grid, zero))
        at = [int(i) for i in (table == rank).nonzero()[0]]
        for dim, ranks in got.items():
            index = list(at)
            index[MESH_DIMS.index(dim)] = slice(None)
            assert tuple(table[tuple(index)].tolist()) == ranks, (rank, dim)


@pytest.mark.parametrize("zero", [1, 0])
def test_dim_groups_split_the_job_into_the_ranks_groups(zero):
    for dim in MESH_DIMS:
        family = dim_groups(PLAN12, dim, zero)
        members = [r for g in family for r in g]
        assert len(members) == len(set(members)), dim          # disjoint
        for rank in range(PLAN12.gpus_used):
            mine = rank_groups(PLAN12, rank, zero).get(dim)
            assert mine == next((g for g in family if rank in g), None), (dim, rank)
    assert dim_groups(PLAN12, "dp_replicate" if zero else "dp_shard", zero) == ()
    with pytest.raises(ValueError, match="not a mesh dimension"):
        dim_groups(PLAN12, "dp")


@cache
def _plan_72b() -> tuple[Plan, int]:
    """The 72B spec's plan (1172 ranks) and its ZeRO stage, as ``dtc plan`` makes it:
    disaggregated (its drawn batches choose it; without them the planner's estimate
    prefers a phased ViT, whose extra DP groups the phased tests check)."""
    from pathlib import Path

    from dtdsl.cost.model import build_cost_model
    from dtdsl.driver import run_frontend
    from dtdsl.planner import plan as make_plan

    path = Path(__file__).resolve().parents[2] / "specs" / "mllm_72b.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    return make_plan(build_cost_model(program), compare_baseline=False,
                     placement="disaggregated"), \
        program.train.optimizer.zero


def _sample(plan: Plan) -> list[int]:
    """The first, a middle and the last rank of every stage of every unit."""
    out = set()
    for g in grids(plan):
        for stage in range(g.pp):
            ranks = g.stage_ranks(stage)
            out |= {ranks[0], ranks[len(ranks) // 2], ranks[-1]}
    return sorted(out)


class _Recorder:
    """``dist.new_group`` and ``dist.split_group``, recording every call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.new: list[tuple[tuple[int, ...], str | None]] = []
        self.split: list[list[list[int]]] = []
        new_group, split_group = dist.new_group, dist.split_group

        def new(ranks=None, *args, backend=None, **kwargs):
            self.new.append((tuple(range(dist.get_world_size())) if ranks is None
                             else tuple(ranks), backend))
            return new_group(ranks, *args, backend=backend, **kwargs)

        def split(*args, split_ranks=None, **kwargs):
            self.split.append(split_ranks)
            return split_group(*args, split_ranks=split_ranks, **kwargs)

        monkeypatch.setattr(dist, "new_group", new)
        monkeypatch.setattr(dist, "split_group", split)

    def real(self) -> list[tuple[int, ...]]:
        """The groups with a communicator: all but the fake-backend placeholders."""
        return [ranks for ranks, backend in self.new if backend != "fake"]


@contextlib.contextmanager
def _fake_rank(plan: Plan, rank: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.gpus_used)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_rank_of_the_72b_plan_creates_exactly_its_groups(monkeypatch):
    """Every one of the 1172 ranks, on torch's fake backend in this process: the groups
    created are the plan's (``rank_groups``, the role's TP/DP/PP groups of more than one
    rank), no group of one rank has a communicator, and the mesh is the unit's."""
    plan, zero = _plan_72b()
    start = time.perf_counter()
    for rank in range(plan.gpus_used):
        calls = _Recorder(monkeypatch)
        with _fake_rank(plan, rank):
            groups = build_groups(plan, zero=zero)
            role = groups.role
            want = rank_groups(plan, rank, zero)
            assert calls.real() == list(want.values()), rank
            assert all(len(r) > 1 for r in calls.real()), rank
            assert all(r == (rank,) for r, b in calls.new if b == "fake"), rank
            assert len(calls.new) == len(MESH_DIMS) and not calls.split, rank
            assert len(calls.real()) <= 3, rank      # one of the DP dimensions is 1
            assert groups.groups() == want, rank
            roles = {"pp": role.pp_ranks, "dp_shard" if zero else "dp_replicate":
                     role.dp_ranks, "tp": role.tp_ranks}
            assert want == {d: r for d, r in roles.items() if len(r) > 1}, rank
            mesh = groups.mesh
            assert tuple(mesh.shape) == unit_mesh_shape(role.grid, zero)
            assert mesh.get_coordinate() == (role.stage, *((0, role.replica) if zero else
                                                           (role.replica, 0)), role.tp_index)
            assert tuple(mesh.mesh.flatten().tolist()) == tuple(role.grid.ranks)
        monkeypatch.undo()
    took = time.perf_counter() - start
    print(f"build_groups on all {plan.gpus_used} ranks of the 72B plan: {took:.1f} s")


def test_where_groups_are_split_every_rank_makes_the_same_calls(monkeypatch):
    """With the default group bound to a device (NCCL), groups are split from it: every
    sampled rank of the 72B plan calls ``split_group`` with the same splits, once per
    mesh dimension that has groups anywhere, and gets its own group (the fake backend
    stands in for ncclCommSplit, which a CPU build does not have)."""
    from dtdsl.parallel import mesh as mesh_module

    plan, zero = _plan_72b()
    seen = None
    for rank in _sample(plan):
        calls = _Recorder(monkeypatch)
        monkeypatch.setattr(mesh_module, "splits_groups", lambda: True)

        def split(split_ranks, group_desc, rank=rank, calls=calls):
            calls.split.append(split_ranks)
            mine = next((g for g in split_ranks if rank in g), None)
            return None if mine is None else dist.new_group(mine, group_desc=group_desc,
                                                            use_local_synchronization=True)

        monkeypatch.setattr(dist, "split_group", split)
        with _fake_rank(plan, rank):
            groups = build_groups(plan, zero=zero)
            assert groups.groups() == rank_groups(plan, rank, zero)
        want = [list(map(list, dim_groups(plan, d, zero))) for d in MESH_DIMS
                if dim_groups(plan, d, zero)]
        assert calls.split == want, rank
        seen = calls.split if seen is None else seen
        assert calls.split == seen      # the same collective calls on every rank
        monkeypatch.undo()


# ---- on gloo ranks ------------------------------------------------------------------------------


def _groups_on_ranks(rank: int, world: int, zero: int) -> None:
    groups = build_groups(PLAN6, zero=zero)
    role = groups.role
    assert groups.rank == rank and role == role_of(PLAN6, rank)
    mesh = groups.mesh
    assert mesh.mesh_dim_names == MESH_DIMS
    assert tuple(mesh.shape) == unit_mesh_shape(role.grid, zero)
    assert groups.groups() == rank_groups(PLAN6, rank, zero)
    dp_dim = "dp_shard" if zero else "dp_replicate"
    for dim, expected in (("tp", role.tp_ranks), (dp_dim, role.dp_ranks),
                          ("pp", role.pp_ranks),
                          ("dp_replicate" if zero else "dp_shard", (rank,))):
        pg = mesh.get_group(dim)
        assert tuple(dist.get_process_group_ranks(pg)) == expected, dim
        x = torch.tensor([float(rank)])
        if len(expected) == 1:      # a placeholder: nothing may be sent over it
            with pytest.raises(RuntimeError, match="error_on_collective"):
                dist.all_reduce(x, group=pg)
            continue
        dist.all_reduce(x, group=pg)    # a real group of exactly those ranks
        assert x.item() == sum(expected), dim
    assert groups.tp is mesh.get_group("tp")
    expected_roles = {0: ("vit", 0, 0, 0), 1: ("vit", 1, 0, 0), 2: ("llm", 0, 0, 0),
                      3: ("llm", 0, 0, 1), 4: ("llm", 0, 1, 0), 5: ("llm", 0, 1, 1)}
    assert (role.unit, role.stage, role.replica, role.tp_index) == expected_roles[rank]
    _fsdp_over_the_dp_mesh(groups, zero)


def _fsdp_over_the_dp_mesh(groups: ProcessGroups, zero: int) -> None:
    """FSDP2 over the rank's DP mesh (as ``train.stage`` slices it) sums each replica's
    gradient over the DP group, whatever placeholders the mesh holds."""
    from torch.distributed.fsdp import fully_shard

    role = groups.role
    dp_mesh = data_parallel_mesh(groups.mesh)
    hsdp = zero == 0 and role.grid.dp > 1
    assert dp_mesh.mesh_dim_names == (("dp_replicate", "dp_shard") if hsdp else ("dp_shard",))
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4, bias=False)
    start = layer.weight.detach().clone()
    fully_shard(layer, mesh=dp_mesh)
    layer.set_gradient_divide_factor(1.0)
    layer.set_force_sum_reduction_for_comms(True)     # gloo has no PREMUL_SUM
    layer(torch.full((1, 4), float(role.replica + 1))).sum().backward()
    grad = layer.weight.grad.full_tensor()
    # d/dW sum(W x) = ones x^T for each replica's x = (replica + 1) * ones
    total = sum(range(1, role.grid.dp + 1))
    assert torch.equal(grad, torch.full_like(start, float(total))), (role.rank, grad)


@pytest.mark.parametrize("zero", [1, 0])
def test_build_groups_on_six_ranks(zero):
    run(_groups_on_ranks, 6, zero)


# ---- training over the groups ------------------------------------------------------------------

TRAIN_STEPS = 4


def _tied(program: ir.Program) -> ir.Program:
    """``program`` with the backbone's LM head tied to its token embedding."""
    llm = program.backbone
    tied = llm.model_copy(update={"arch": llm.arch.model_copy(update={"tie_embeddings": True})})
    return program.model_copy(update={"modules": tuple(tied if m.name == llm.name else m
                                                       for m in program.modules)})


def _zero0(program: ir.Program) -> ir.Program:
    train = program.train
    return program.model_copy(update={"train": train.model_copy(update={
        "optimizer": train.optimizer.model_copy(update={"zero": 0})})})


def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Train over ``build_groups`` at the program's ZeRO stage: the reference's losses and
    parameters; a tied pair sums over the group ``tied_group_ranks`` names (or its PP
    group)."""
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor

    groups = build_groups(plan, zero=program.train.optimizer.zero)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    pair = next((p for p in tied_pairs(program, plan) if rank in p), None)
    assert (ex.stage.tied_group is None) == (pair is None)
    if pair is not None:
        assert tuple(dist.get_process_group_ranks(ex.stage.tied_group)) == pair
        assert (ex.stage.tied_group is groups.mesh.get_group("pp")) == \
            (tied_group_ranks(program, plan, rank) is None)
    for r, want in zip(ex.train(TRAIN_STEPS), losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    for name, p in ex.full_parameters().items():
        init, want = params[name]
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)


def _check(program: ir.Program, plan: Plan) -> None:
    losses, params = reference(program, TRAIN_STEPS)
    run(_train, plan.gpus_used, program, plan, losses, params, timeout=240)


def test_zero0_replicates_over_data_parallel_tensor_parallel_ranks():
    # HSDP (replicate 2 x shard 1) next to TP 2 on the backbone, a placeholder shard
    # dimension under it; the encoder's two replicas too.
    # One microbatch a replica: the claim is where ZeRO-0 replicates, not accumulation.
    program = _zero0(spec(4))
    _check(program, plan_for(program, ("vit", "encoder", 1, 2, 1),
                             ("llm", "backbone", 2, 2, 1), ("gen", "generator", 1, 1, 1)))


def test_tied_pairs_and_the_group_they_add():
    program = _tied(spec(8))
    three = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 3),
                     ("gen", "generator", 1, 1, 1))
    # llm: ranks 1 + (stage * 2 + replica); first stage 1, 2; last stage 5, 6
    assert tied_pairs(program, three) == ((1, 5), (2, 6))
    assert [tied_group_ranks(program, three, r) for r in range(8)] == \
        [None, (1, 5), (2, 6), None, None, (1, 5), (2, 6), None]
    two = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 2),
                   ("gen", "generator", 1, 1, 1))
    assert tied_pairs(program, two) == ((1, 3), (2, 4))
    assert tuple(rank_groups(two, 1)["pp"]) == (1, 3)       # the pair is the PP group
    assert all(tied_group_ranks(program, two, r) is None for r in range(6))
    one = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
                   ("gen", "generator", 1, 1, 1))
    assert tied_pairs(program, one) == ()
    frozen = program.model_copy(update={"modules": tuple(
        m.model_copy(update={"frozen": True}) if m.role == "backbone" else m
        for m in program.modules)})
    assert tied_pairs(frozen, three) == () and tied_pairs(spec(8), three) == ()


def test_a_tied_embedding_over_three_stages_sums_over_its_own_pair():
    program = _tied(spec(6))     # three microbatches, one per stage: enough for 1F1B
    _check(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                             ("llm", "backbone", 1, 1, 3), ("gen", "generator", 1, 1, 1)))


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


# ---- phased encoders --------------------------------------------------------------------------

def _phased_plan(tp: int, dp: int, pp: int) -> Plan:
    from tests.helpers.plans import phase

    program = spec(8 if dp != 3 else 12)
    return phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                   ("llm", "backbone", tp, dp, pp),
                                   ("gen", "generator", 1, 1, 1)))


@pytest.mark.parametrize("zero", [1, 0])
def test_a_phased_encoders_groups_span_the_backbones_stages(zero):
    """Over a (pp 2, dp 2, tp 2) backbone the phased ViT's DP group through a rank is
    every backbone rank with its TP index, a group of its own made after the unit's;
    its TP group is the backbone's. Where it has the ranks of a backbone group (dp 1:
    the PP group; pp 1: the DP group) that group serves and none is added."""
    from dtdsl.parallel.mesh import phased_grid, phased_groups, phased_role

    plan = _phased_plan(2, 2, 2)
    vit = plan.unit("vit")
    grid = phased_grid(plan, vit)
    assert (grid.pp, grid.dp, grid.tp, grid.ranks) == (1, 4, 2, range(0, 8))
    dim = "dp_shard" if zero else "dp_replicate"
    for rank in range(8):
        got = rank_groups(plan, rank, zero)
        assert list(got)[-1] == f"vit.{dim}"        # created last
        assert got[f"vit.{dim}"] == tuple(r for r in range(8) if r % 2 == rank % 2)
        role = phased_role(plan, vit, rank)
        assert (role.replica, role.tp_index) == divmod(rank, 2)
        assert role.tp_ranks == role_of(plan, rank).tp_ranks
    assert "vit.dp_shard" not in rank_groups(plan, 8)       # the generator's rank
    assert phased_groups(plan, "vit", zero) == ((0, 2, 4, 6), (1, 3, 5, 7))
    for tp, dp, pp in ((2, 1, 2), (1, 2, 1), (1, 1, 2)):
        plan = _phased_plan(tp, dp, pp)
        assert phased_groups(plan, "vit", zero) == ()
        for rank in range(tp * dp * pp):
            assert not [k for k in rank_groups(plan, rank, zero) if k.startswith("vit.")]


def test_where_groups_are_split_a_phased_encoders_are_split_by_every_rank(monkeypatch):
    """With the default group bound to a device every rank of the job, the generator's
    too, splits the phased encoder's DP groups after the mesh dimensions' (the same
    calls everywhere), and a backbone rank's mesh for it has its groups."""
    from dtdsl.parallel import mesh as mesh_module

    plan = _phased_plan(2, 2, 2)
    seen = None
    for rank in range(plan.gpus_used):
        calls = _Recorder(monkeypatch)
        monkeypatch.setattr(mesh_module, "splits_groups", lambda: True)

        def split(split_ranks, group_desc, rank=rank, calls=calls):
            calls.split.append(split_ranks)
            mine = next((g for g in split_ranks if rank in g), None)
            return None if mine is None else dist.new_group(mine, group_desc=group_desc,
                                                            use_local_synchronization=True)

        monkeypatch.setattr(dist, "split_group", split)
        with _fake_rank(plan, rank):
            groups = build_groups(plan)
            assert groups.groups() == rank_groups(plan, rank)
            assert bool(groups.phased) == (rank < 8)
        assert calls.split[-1] == [[0, 2, 4, 6], [1, 3, 5, 7]], rank
        seen = calls.split if seen is None else seen
        assert calls.split == seen
        monkeypatch.undo()
