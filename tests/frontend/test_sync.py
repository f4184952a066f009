"""``train { sync = ... }``: synchronous DP by default, EDiT's Local SGD when asked, and
the diagnostics of its bad values (DT630-DT634, DT636, DT637)."""

from __future__ import annotations

import pytest

from dtdsl.driver import run_frontend
from dtdsl.frontend.fmt import format_spec
from dtdsl.ir.program import PENALTY_WARMUP, Program, Sync, Train
from tests.helpers.checks import BASE

TRAIN = "train { global_batch = 32  micro_batch = 2  seq_len = 512 }"


def _spec(sync: str | None) -> str:
    extra = f"  sync = {sync}" if sync is not None else ""
    return BASE.replace(TRAIN, TRAIN[:-1] + extra + " }")


def _result(sync: str | None):
    return run_frontend("t.dt", _spec(sync).encode())


def _program(sync: str | None) -> Program:
    result = _result(sync)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def _errors(sync: str) -> list[str]:
    return [d.code for d in _result(sync).diagnostics if d.severity.value == "error"]


def test_default_and_allreduce_are_synchronous():
    for sync in (None, "allreduce", "allreduce()"):
        s = _program(sync).train.sync
        assert s == Sync() and not s.local


def test_local_sgd_values():
    s = _program("local_sgd(period=3, outer_lr=0.7, outer_momentum=0.9, penalty=true)")\
        .train.sync
    assert (s.kind, s.period, s.interval_s, s.outer_lr, s.outer_momentum, s.penalty) == \
        ("local_sgd", 3, None, 0.7, 0.9, True)
    bare = _program("local_sgd").train.sync
    assert (bare.period, bare.outer_lr, bare.outer_momentum, bare.penalty) == (1, 1.0, 0.0,
                                                                                False)
    assert _program("local_sgd(interval=500 ms)").train.sync.interval_s == 0.5
    assert _program("local_sgd(interval=30)").train.sync.interval_s == 30.0


def test_penalty_warmup_values():
    s = _program("local_sgd(period=1, penalty=true, penalty_warmup=2)").train.sync
    assert (s.penalty, s.penalty_warmup) == (True, 2)
    assert _program("local_sgd(penalty=true, penalty_warmup=0)").train.sync.penalty_warmup == 0
    assert _program("local_sgd(penalty=true)").train.sync.penalty_warmup == PENALTY_WARMUP


def test_penalty_warmup_is_refused_negative_or_without_the_penalty():
    negative = [d for d in _result("local_sgd(penalty=true, penalty_warmup=-1)").diagnostics
                if d.severity.value == "error"]
    assert [d.code for d in negative] == ["DT637"]
    assert "penalty_warmup -1" in negative[0].message and "penalty_warmup=0" in negative[0].hint
    for sync in ("local_sgd(penalty_warmup=2)", "local_sgd(penalty=false, penalty_warmup=2)"):
        off = [d for d in _result(sync).diagnostics if d.severity.value == "error"]
        assert [d.code for d in off] == ["DT637"], sync
        assert "penalty_warmup=2 without penalty=true" in off[0].message
        assert off[0].hint == "write penalty=true, or remove penalty_warmup"
    # A value that is no whole number is that error alone, not also one about the penalty.
    bad = [d for d in _result("local_sgd(penalty_warmup=2.5)").diagnostics
           if d.severity.value == "error"]
    assert [d.code for d in bad] == ["DT206"], [d.message for d in bad]


def test_fmt_keeps_penalty_warmup():
    result = _result("local_sgd(period=1, penalty=true, penalty_warmup=2)")
    once = format_spec(result.spec)
    assert "penalty_warmup=2" in once.replace(" ", "")
    again = run_frontend("t.dt", once.encode())
    assert again.ok and again.program.train.sync == result.program.train.sync
    assert format_spec(again.spec) == once


def test_local_sgd_lays_the_mesh_out_as_whole_replicas():
    p = _program("local_sgd(period=2)")
    assert p.train.optimizer.zero == 1 and p.train.mesh_zero == 0
    assert p.train.replica_dp == 1 and p.train.sync.replica_ranks(8) == 1
    assert _program(None).train.mesh_zero == 1


def test_replica_dp_makes_replicas_of_several_ranks():
    p = _program("local_sgd(period=2, replica_dp=4)")
    assert p.train.replica_dp == 4 and p.train.mesh_zero == 0
    # A unit of dp 8: 2 replicas of 4 ranks; a unit of one rank: one replica of one.
    assert p.train.sync.replica_ranks(8) == 4 and p.train.sync.replica_ranks(1) == 1
    assert _program("allreduce").train.replica_dp == 1


def test_the_cost_model_prices_replicas_of_several_ranks():
    from dtdsl.cost.model import build_cost_model

    whole = build_cost_model(_program("local_sgd(period=4)"))
    split = build_cost_model(_program("local_sgd(period=4, replica_dp=4)"))
    unit, tp, pp, dp = "llm", 2, 2, 8
    u = whole.unit(unit)
    trained = u.stage_params(pp) / tp * u.trainable_params / u.params
    # Across the 2 replicas each rank all-reduces its quarter in fp32 every 4 steps;
    # inside a replica FSDP2 reduce-scatters and all-gathers bf16 every step.
    assert split.dp_sync_bytes(split.unit(unit), tp, pp, dp) == pytest.approx(
        trained / 4 * 4 * 2 * (1 / 2) / 4 + trained * 2 * 2 * 3 / 4)
    assert whole.dp_sync_bytes(u, tp, pp, dp) == pytest.approx(trained * 4 * 2 * 7 / 8 / 4)
    # Memory: the optimizer state (12 bytes), anchor and momentum (8) sharded over 4.
    args = dict(tp=tp, pp=pp, dp=dp, vpp=1, depth=1, microbatches=8, share=1.0)
    saved = float(whole.memory_bytes(u, **args)) - float(
        split.memory_bytes(split.unit(unit), **args))
    assert saved == pytest.approx(trained * (12 + 8) * 3 / 4, rel=1e-6)
    # The sync's time: less to all-reduce across fewer replicas, plus FSDP2 inside.
    assert float(split.dp_sync_time_s(split.unit(unit), tp, pp, dp)) != pytest.approx(
        float(whole.dp_sync_time_s(u, tp, pp, dp)))


@pytest.mark.parametrize("sync, code", [
    ("local_sgd(period=0)", "DT630"),
    ("local_sgd(period=-2)", "DT630"),
    ("local_sgd(outer_lr=0)", "DT631"),
    ("local_sgd(outer_lr=-0.5)", "DT631"),
    ("local_sgd(outer_momentum=1)", "DT632"),
    ("local_sgd(outer_momentum=-0.1)", "DT632"),
    ("local_sgd(period=4, interval=30 s)", "DT633"),
    ("local_sgd(interval=0 s)", "DT634"),
    ("local_sgd(replica_dp=0)", "DT636"),
    ("local_sgd(penalty=true, penalty_warmup=-3)", "DT637"),
    ("local_sgd(penalty_warmup=2)", "DT637"),
    ("local_sgd(penalty=true, penalty_warmup=1.5)", "DT206"),
    ("local_sgd(replica_dp=1.5)", "DT206"),
    ("local_sgd(period=2.5)", "DT206"),
    ("local_sgd(interval=3 GiB)", "DT207"),
    ("local_sgd(periods=2)", "DT201"),
    ("locl_sgd(period=2)", "DT205"),
    ("allreduce(period=2)", "DT201"),
])
def test_bad_values(sync, code):
    assert code in _errors(sync)


def test_bad_value_message_names_it():
    d = next(d for d in _result("local_sgd(outer_momentum=1.5)").diagnostics
             if d.code == "DT632")
    assert "1.5" in d.message and d.hint


def test_old_programs_read_without_sync():
    data = _program(None).train.model_dump(mode="json")
    del data["sync"]
    assert Train.model_validate(data).sync == Sync()


def test_the_cost_model_prices_a_sync_every_period():
    from dtdsl.cost.model import build_cost_model

    plain = _program(None)
    costs = {H: build_cost_model(_program(f"local_sgd(period={H})")) for H in (1, 4)}
    sync = build_cost_model(plain)
    unit = "llm"
    tp, pp, dp = 2, 2, 8

    def time_s(cost):
        return float(cost.dp_sync_time_s(cost.unit(unit), tp, pp, dp))

    def bytes_(cost):
        return cost.dp_sync_bytes(cost.unit(unit), tp, pp, dp)

    # fp32 all-reduce every period steps against bf16 reduce-scatter + all-gather each step
    assert bytes_(costs[1]) == pytest.approx(2 * bytes_(sync))
    assert bytes_(costs[4]) == pytest.approx(bytes_(sync) / 2)
    assert bytes_(costs[4]) == pytest.approx(bytes_(costs[1]) / 4)
    assert time_s(costs[4]) == pytest.approx(time_s(costs[1]) / 4)
    assert time_s(costs[4]) < time_s(sync)
    # One replica: nothing crosses.
    assert costs[4].dp_sync_bytes(costs[4].unit(unit), tp, pp, 1) == 0.0
    # Memory: whole optimizer state per replica (ZeRO 0) plus the fp32 anchor and momentum.
    args = dict(tp=tp, pp=pp, dp=dp, vpp=1, depth=1, microbatches=8, share=1.0)
    local_mem = float(costs[4].memory_bytes(costs[4].unit(unit), **args))
    sync_mem = float(sync.memory_bytes(sync.unit(unit), **args))
    u = sync.unit(unit)
    trained = u.stage_params(pp) / tp * u.trainable_params / u.params
    assert local_mem - sync_mem == pytest.approx(trained * (12 - 12 / dp + 8), rel=1e-6)
