"""``train { async_tp = true }``: the language, DT638, the cost model's price of the
backbone's TP collectives hidden behind its matmuls (``cost.comm``), and the runtime's
refusal where it cannot run (a CPU rank on gloo); a fake-collective world (``dtc
memcheck``) builds the stage without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtdsl.cost.comm import async_tp_exposed_s
from dtdsl.cost.model import build_cost_model
from dtdsl.driver import run_frontend
from dtdsl.frontend.fmt import format_spec
from tests.helpers.checks import BASE

ROOT = Path(__file__).resolve().parent.parent

TRAIN = "train { global_batch = 32  micro_batch = 2  seq_len = 512 }"


def _result(extra: str):
    return run_frontend("t.dt", BASE.replace(TRAIN, TRAIN[:-1] + extra + " }").encode())


def test_async_tp_is_off_by_default_and_round_trips():
    assert _result("").program.train.async_tp is False
    result = _result("  async_tp = true")
    assert result.ok and result.program.train.async_tp is True
    again = run_frontend("t.dt", format_spec(result.spec).encode())
    assert again.ok and again.program.train.async_tp is True


def test_async_tp_with_compile_false_is_dt638():
    result = _result("  async_tp = true  compile = false")
    assert [d.code for d in result.diagnostics if d.severity.value == "error"] == ["DT638"]
    assert _result("  async_tp = true  compile = true").ok
    assert _result("  async_tp = false  compile = false").ok


def test_exposed_time_keeps_one_chunk_and_what_the_matmuls_cannot_cover():
    assert async_tp_exposed_s(8.0, 100.0, 4) == 2.0     # one chunk of four
    assert async_tp_exposed_s(8.0, 3.0, 4) == 5.0       # the matmuls cover 3 of 8
    assert async_tp_exposed_s(8.0, 100.0, 1) == 8.0     # no TP: nothing to pipeline
    assert async_tp_exposed_s(0.0, 1.0, 8) == 0.0


def test_the_cost_model_hides_the_backbones_tp_collectives_only():
    path = ROOT / "specs" / "mllm_9b.dt"
    program = run_frontend(str(path), path.read_bytes()).program
    assert not program.train.async_tp
    fast = program.model_copy(update={"train": program.train.model_copy(
        update={"async_tp": True})})
    plain, overlapped = build_cost_model(program), build_cost_model(fast)
    for name in ("llm", "vit"):
        unit, again = plain.unit(name), overlapped.unit(name)
        for tp in (1, 2, 8):
            fwd, bwd = plain.fwd_bwd_time_s(unit, tp)
            f2, b2 = overlapped.fwd_bwd_time_s(again, tp)
            comm = plain.tp_comm_time_s(unit, tp)
            if name == "vit" or tp == 1:    # all-reduces, or no TP: priced as before
                assert (f2, b2) == (fwd, bwd)
                continue
            # At least one chunk of each pass's collectives stays exposed; at TP 2 a 9b
            # layer's matmuls cover the rest, at TP 8 (an eighth of the matmuls each,
            # the same bytes) not all of it.
            hidden_most = (fwd - comm + comm / tp, bwd - comm + comm / tp)
            if tp == 2:
                assert (f2, b2) == pytest.approx(hidden_most, rel=1e-12)
            else:
                assert hidden_most[0] < f2 < fwd and hidden_most[1] < b2 < bwd


def _refused_on_gloo(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dtdsl.feed.faults import Fatal, fatal_cause
    from dtdsl.parallel.mesh import MESH_DIMS
    from dtdsl.train.stage import _async_tp

    mesh = init_device_mesh("cpu", (1, 1, 1, world), mesh_dim_names=MESH_DIMS)
    for compiling in (True, False):
        with pytest.raises(Fatal) as err:
            _async_tp(mesh, compiling)
        assert "set async_tp = false" in str(err.value)
        assert fatal_cause(err.value) == str(err.value)     # one line, not retried
    assert not torch._inductor.config._micro_pipeline_tp


def test_a_gloo_rank_refuses_async_tp_in_plain_words():
    from tests.dist import run

    run(_refused_on_gloo, 2)


def test_a_fake_worlds_tp_group_is_left_as_it_is():
    """``dtc memcheck``'s world (``_async_tp`` as its stage build calls it): its
    collectives move nothing, so there is nothing to overlap and nothing refused."""
    from dtdsl.parallel.mesh import MESH_DIMS
    from dtdsl.train.memcheck import fake_world
    from dtdsl.train.stage import _async_tp

    with fake_world(world_size=2, rank=0) as world:
        mesh = world.device_mesh(range(2), (1, 1, 1, 2), MESH_DIMS)
        _async_tp(mesh, True)
    assert not torch._inductor.config._micro_pipeline_tp


def test_a_plan_without_tensor_parallelism_warns_that_async_tp_does_nothing(tmp_path, capsys):
    from dtdsl import cli
    from dtdsl.codegen.support import runtime_support
    from tests.helpers.runs import plan_for

    program = _result("  async_tp = true").program
    with_tp = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 2, 1))
    assert runtime_support(program, with_tp) == []
    without = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1))
    (warning,) = runtime_support(program, without)
    assert (warning.code, warning.severity.value) == ("DT501", "warning")
    assert "no unit of the plan runs tensor parallelism" in warning.message
    plain = _result("").program
    assert runtime_support(plain, without) == []
    # dtc compile prints it and writes the bundle all the same.
    spec = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    assert "  seed             = 1234\n" in spec
    path = tmp_path / "tiny.dt"
    path.write_text(spec.replace("  seed             = 1234\n",
                                 "  seed             = 1234\n  async_tp = true\n"))
    capsys.readouterr()
    assert cli.main(["compile", str(path), "-o", str(tmp_path / "out"), "--synthetic"]) == 0
    err = capsys.readouterr().err
    assert "warning[DT501]" in err and "async_tp" in err, err
    assert (tmp_path / "out" / "job.json").is_file()
