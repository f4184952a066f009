"""Interleaved 1F1B in the executor (a backbone of several model chunks per pipeline
stage, ``Stage.chunks``) against the single-process reference, and its checkpoints
resumed under interleaved and plain 1F1B plans (multi-rank gloo runs)."""

from __future__ import annotations

import shutil

import pytest

from dtdsl.ir.checkpoint import checkpoint_root, read_manifest
from dtdsl.ir.plan import chunk_ranges
from dtdsl.schedule.lower import lower
from tests.helpers.plans import chunked, colocate, interleaved
from tests.helpers.runs import check, check_tp, plan_for, spec

# 4 steps: a chunk that ran out of order shows from the first step, and Adam's moments
# go through several updates.
STEPS = 4
ACCEPTANCE_STEPS = 8    # the acceptance: interleaved with pp 2, 8+ steps


def test_chunk_ranges():
    # Virtual stage c * pp + s runs after virtual stage c * pp + s - 1: stage 0's chunks
    # are layers 0 and 2 of four, stage 1's 1 and 3.
    assert chunk_ranges((2, 2), 2) == (((0, 1), (2, 3)), ((1, 2), (3, 4)))
    assert chunk_ranges((3, 2), 1) == (((0, 3),), ((3, 5),))
    # Uneven: each stage's own layers split over its chunks, the larger first.
    assert chunk_ranges((3, 3, 2), 2) == (((0, 2), (5, 6)), ((2, 4), (6, 7)),
                                          ((4, 5), (7, 8)))


def test_interleaved_backbone_matches_the_reference():
    # The encoder and generator are units of their own: the broker's boundaries sit on
    # the backbone's first virtual stage (stage 0, chunk 0) and its last (stage 1, chunk 1).
    program = interleaved(spec(8))
    plan = chunked(plan_for(program, ("vit", "encoder", 1, 1, 1),
                            ("llm", "backbone", 1, 1, 2), ("gen", "generator", 1, 1, 1)),
                   "llm")
    schedule = lower(plan, program)
    assert {a.chunk for a in schedule.stage("llm", 0).actions} == {0, 1}
    check(program, plan, ACCEPTANCE_STEPS)


@pytest.mark.usefixtures("deterministic")   # compares losses bitwise
def test_checkpoints_resume_interleaved_and_plain(tmp_path):
    # Checkpoint keys are the full model's names whatever the chunks: an interleaved
    # run's checkpoint resumes bitwise under its own plan, and resharded under plain
    # 1F1B and back.
    from tests.helpers.checkpoints import PROGRAM, _close, _go, _reference

    plain = plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2),
                     ("gen", "generator", 1, 1, 1))
    chunks = chunked(plain, "llm")
    ref, _ = _reference()
    a_dir = tmp_path / "a"
    a = _go(chunks, a_dir, 4, {2: "sync", 4: "thread"}, tmp_path / "a.json", want_at=4)
    assert a["first"] == 0
    _close(a["losses"], ref[:4])
    m = read_manifest(checkpoint_root(a_dir) / "ckpt-4")
    assert [u.text for u in m.units] == ["vit:tp1dp1pp1", "llm:tp1dp1pp2vpp2",
                                         "gen:tp1dp1pp1"]

    # From ckpt-2 under the same plan: the uninterrupted run's losses, bitwise.
    same = tmp_path / "same"
    shutil.copytree(checkpoint_root(a_dir) / "ckpt-2", checkpoint_root(same) / "ckpt-2")
    s = _go(chunks, same, 2, {}, tmp_path / "same.json")
    assert s["first"] == 2 and s["losses"] == a["losses"][2:4]
    assert "same plan" in s["logs"][0]

    # Plain 1F1B from the interleaved save, then interleaved again from its save.
    b = _go(plain, a_dir, 2, {6: "sync"}, tmp_path / "b.json", want_at=6)
    assert b["first"] == 4 and "llm:tp1dp1pp2vpp2" in b["logs"][0], b["logs"]
    _close(b["losses"], ref[4:6])
    c = _go(chunks, a_dir, 2, {}, tmp_path / "c.json", want_at=8)
    assert c["first"] == 6 and "llm:tp1dp1pp2 " in c["logs"][0], c["logs"]
    _close(c["losses"], ref[6:8])


@pytest.mark.parametrize("split", [(2, 2), (3, 1)], ids=["even", "empty-last-chunk"])
def test_co_located_units_on_an_interleaved_data_parallel_backbone(split):
    # The encoder runs inside stage 0's chunk 0, the generator inside stage 1's last
    # chunk; DP 2 reduces chunk 0's layers early (the step's last backward is chunk 0's)
    # and the rest after it. (3, 1) leaves stage 1's chunk 1 without layers: the head.
    program = interleaved(spec(8))
    plan = chunked(colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                              ("llm", "backbone", 1, 2, 2),
                                              ("gen", "generator", 1, 1, 1)),
                            "vit", "gen", split=split), "llm")
    assert [u.name for u in lower(plan, program).units] == ["llm"]
    check(program, plan, STEPS)


def test_memcheck_measures_every_chunk_of_an_interleaved_stage():
    from dtdsl.train.memplan import check_memory, in_flight_of

    program = interleaved(spec(8))
    plain = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2),
                     ("gen", "generator", 1, 1, 1))
    plan = chunked(plain, "llm")
    # Passes of either chunk in flight: more than plain 1F1B holds (each of half the
    # layers).
    assert [in_flight_of(lower(plan, program), "llm", s) for s in (0, 1)] == [6, 4]
    assert [in_flight_of(lower(plain, program), "llm", s) for s in (0, 1)] == [3, 2]
    got = {(s.unit, s.stage): s for s in check_memory(program, plan, jobs=2)}
    # Plain 1F1B: the backbone's stages only (the encoder's and generator's units are
    # the same in both plans).
    want = {(s.unit, s.stage): s for s in check_memory(
        program, plain, jobs=2, stages={("llm", 0), ("llm", 1)})}
    assert list(got) == [("vit", 0), ("llm", 0), ("llm", 1), ("gen", 0)]
    for key in [("llm", 0), ("llm", 1)]:
        # Two layers each, as at vpp 1 (layers 0 and 2 on stage 0, 1 and 3 on stage 1).
        for what in ("params", "optimizer_state"):
            assert got[key].by_category[what] == want[key].by_category[what], (key, what)
        assert got[key].in_flight > want[key].in_flight
        assert got[key].measured_bytes > 0 and got[key].predicted_bytes > 0


def test_the_dry_run_counts_the_wrap_around_peer():
    # Interleaved over 3 stages, stage 2's chunk 0 feeds stage 0's chunk 1: one more
    # peer each for the first and last stage, none for the middle one.
    from dtdsl.parallel.mesh import role_of
    from dtdsl.train.dryrun import _p2p_peers

    program = interleaved(spec(8))
    plain = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 3),
                     ("gen", "generator", 1, 1, 1))
    plan = chunked(plain, "llm")
    extra = [_p2p_peers(plan, role_of(plan, r)) - _p2p_peers(plain, role_of(plain, r))
             for r in range(plan.gpus_used)]
    assert extra == [0, 1, 0, 1, 0]


def test_an_interleaved_encoder_into_an_interleaved_backbone():
    # The encoder's chunks pass its packed image groups over PP (its stage 1's chunk 1
    # holds no layer: the post-norm and the projector into the backbone).
    program = interleaved(spec(8))
    plan = chunked(chunked(plan_for(program, ("vit", "encoder", 1, 1, 2),
                                    ("llm", "backbone", 1, 1, 2),
                                    ("gen", "generator", 1, 1, 1)), "llm"), "vit")
    assert {a.chunk for a in lower(plan, program).stage("vit", 1).actions} == {0, 1}
    check(program, plan, 4)


def test_interleaved_tensor_parallel_backbone():
    # Sequence parallelism's pieces travel between the chunks; the vocabulary-parallel
    # head and its loss are on the last chunk only. (STEPS, not TP_STEPS: TP matches
    # from its first step.)
    program = interleaved(spec(8))
    check_tp(program, chunked(plan_for(program, ("vit", "encoder", 1, 1, 1),
                                       ("llm", "backbone", 2, 1, 2),
                                       ("gen", "generator", 1, 1, 1)), "llm"), STEPS)
