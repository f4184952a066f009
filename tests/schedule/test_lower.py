"""Lowering Plan -> Schedule: 1F1B, GPipe and interleaved orders against their textbook
and Megatron-LM definitions, a DAG of units, frozen modules, the lowering's errors, every
shipped spec, golden text forms and the time a large pipeline takes."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from dtdsl.cost.model import CostParams, build_cost_model
from dtdsl.driver import read_spec, run_frontend
from dtdsl.ir.plan import Plan
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import ActionKind, Schedule, parse_schedule, schedule_text
from dtdsl.planner import plan
from dtdsl.schedule.lower import (
    GradientFlow,
    LoweringError,
    add_communication,
    add_optimizer,
    gradient_flow,
    group_sizes,
    interleaved_order,
    lower,
    lower_compute,
    lower_units,
)
from dtdsl.schedule.validate import validate
from tests.helpers.schedules import FLAGS, frozen_program, lowered, passes, unit

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.dt"))
GOLDEN = ROOT / "tests" / "golden" / "schedule"


def kinds(schedule: Schedule, unit_name: str, stage: int) -> set[ActionKind]:
    return {a.kind for a in schedule.stage(unit_name, stage).actions}


def before_first_backward(schedule: Schedule, unit_name: str, stage: int) -> int:
    """Forwards before the stage's first backward (all of them when it runs none): the
    warm-up and the first forward of the steady state."""
    order = passes(schedule, unit_name, stage)
    return next((k for k, p in enumerate(order) if p.startswith("B")), len(order))


def check_golden(name: str, text: str, update: bool) -> None:
    path = GOLDEN / f"{name}.txt"
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"run pytest --update-golden to create {path.name}"
    assert text == path.read_text()


# ---- the orders of one unit ------------------------------------------------------------------

def textbook_1f1b(p: int, m: int, i: int) -> list[str]:
    """Stage i of p: p - 1 - i forwards, then one forward and one backward, then the
    remaining backwards."""
    w = min(m, p - 1 - i)
    order = [f"F{j}" for j in range(w)]
    for j in range(m - w):
        order += [f"F{w + j}", f"B{j}"]
    return order + [f"B{j}" for j in range(m - w, m)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_1f1b_is_the_textbook_order(p: int, m: int):
    schedule = lowered("1f1b", m, unit("llm", "backbone", p))
    for i in range(p):
        assert passes(schedule, "llm", i) == textbook_1f1b(p, m, i)
        assert before_first_backward(schedule, "llm", i) == min(m, p - i)


def test_1f1b_spelled_out():
    schedule = lowered("1f1b", 5, unit("llm", "backbone", 3))
    assert [" ".join(passes(schedule, "llm", i)) for i in range(3)] == [
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",
    ]


@pytest.mark.parametrize("p,m", [(1, 1), (3, 2), (4, 6)])
def test_gpipe_runs_all_forwards_then_all_backwards(p: int, m: int):
    schedule = lowered("gpipe", m, unit("vit", "encoder", 2), unit("llm", "backbone", p),
                       unit("sd", "generator"))
    for st in schedule.stages:
        assert passes(schedule, st.unit, st.stage) == \
            [f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)]


def megatron_interleaved(pp: int, v: int, m: int, rank: int) -> list[str]:
    """Megatron-LM's forward_backward_pipelining_with_interleaving, written out from its
    definition (microbatch group size pp): the k-th forward runs chunk (k // pp) % v of
    microbatch (k // (pp v)) pp + k % pp, the k-th backward the chunks reversed;
    (pp - rank - 1) 2 + (v - 1) pp warm-up forwards, then one forward and one backward."""
    def name(kind: str, k: int, backward: bool) -> str:
        c = (k // pp) % v
        c = v - 1 - c if backward else c
        j = (k // (pp * v)) * pp + k % pp
        return f"{kind}{j}" + (f"c{c}" if c else "")

    total = m * v
    w = min(total, (pp - rank - 1) * 2 + (v - 1) * pp)
    order = [name("F", k, False) for k in range(w)]
    for k in range(total - w):
        order += [name("F", w + k, False), name("B", k, True)]
    return order + [name("B", k, True) for k in range(total - w, total)]


def test_interleaved_by_hand():
    # pp 2, vpp 2, M 4: groups of 2 microbatches per chunk. Stage 0 warms up with
    # (2 - 1) 2 + 2 (2 - 1 - 0) = 4 forwards, stage 1 with 2.
    schedule = lowered("interleaved", 4, unit("llm", "backbone", 2, vpp=2))
    assert " ".join(passes(schedule, "llm", 0)) == \
        "F0 F1 F0c1 F1c1 F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 B2c1 B3c1 B2 B3"
    assert " ".join(passes(schedule, "llm", 1)) == \
        "F0 F1 F0c1 B0c1 F1c1 B1c1 F2 B0 F3 B1 F2c1 B2c1 F3c1 B3c1 B2 B3"
    assert interleaved_order(4, 2, 2) == (
        [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)],
        [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)])


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_is_megatrons_where_megatron_applies(pp: int, v: int, groups: int):
    m = pp * groups            # Megatron-LM: M a multiple of the group size, at least pp
    schedule = lowered("interleaved", m, unit("llm", "backbone", pp, vpp=v))
    for rank in range(pp):
        assert passes(schedule, "llm", rank) == megatron_interleaved(pp, v, m, rank)


def forwards_before_each_backward(order: list[str]) -> list[int]:
    counts, forwards = [], 0
    for p in order:
        if p.startswith("F"):
            forwards += 1
        else:
            counts.append(forwards)
    return counts


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 2), (4, 3), (5, 2), (6, 4)])
@pytest.mark.parametrize("m", [1, 2, 5, 7, 9, 13])
def test_interleaved_outside_megatrons_rules(pp: int, v: int, m: int):
    # Megatron's groups of pp would leave a short last group (or, below pp microbatches,
    # one short group), which can deadlock its fixed alternation and is slow. The groups
    # are max(1, M // pp) of at least pp microbatches, as equal as possible, the larger
    # first (torch's ScheduleInterleaved1F1B where M divides into them; see
    # test_interleaved_torch.py for its order and times); lower_units validates. Each
    # backward comes no earlier than the alternation after (v - 1) G + 2 (pp - 1 - rank)
    # warm-up forwards would run it (G the first group).
    schedule = lowered("interleaved", m, unit("llm", "backbone", pp, vpp=v))
    sizes = group_sizes(m, pp)
    assert len(sizes) == max(1, m // pp) and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True) and min(sizes) >= min(m, pp)
    fwd, bwd = interleaved_order(m, v, sizes)
    name = {True: "F", False: "B"}
    for rank in range(pp):
        order = passes(schedule, "llm", rank)
        for forward, table in ((True, fwd), (False, bwd)):
            assert [p for p in order if p.startswith(name[forward])] == \
                [f"{name[forward]}{j}" + (f"c{c}" if c else "") for j, c in table]
        w = (v - 1) * sizes[0] + 2 * (pp - 1 - rank)
        counts = forwards_before_each_backward(order)
        assert all(n >= min(w + i + 1, m * v) for i, n in enumerate(counts))


@pytest.mark.parametrize("gen_pp", [1, 2, 3])
@pytest.mark.parametrize("enc_pp", [1, 3])
@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 3, 6), (3, 2, 7), (4, 2, 8)])
def test_interleaved_backbone_between_pipelined_units(gen_pp, enc_pp, pp, v, m):
    # The generator waits for forward j + depth - 1 of the last chunk before it sends
    # gradient j back: a group later than Megatron's alternation runs it. lower_units
    # validates: no deadlock.
    schedule = lowered("interleaved", m, unit("vit", "encoder", enc_pp),
                       unit("llm", "backbone", pp, vpp=v), unit("sd", "generator", gen_pp))
    assert before_first_backward(schedule, "sd", gen_pp - 1) == 1
    # Before gradient j comes back, the backbone's first stage has run chunk 0 of some
    # microbatches; the encoder has run at least those, and one more where there is one.
    llm, vit = passes(schedule, "llm", 0), passes(schedule, "vit", enc_pp - 1)
    for j in range(m):
        taken = {p for p in llm[:llm.index(f"B{j}")] if p.startswith("F") and "c" not in p}
        sent = {p for p in vit[:vit.index(f"B{j}")] if p.startswith("F")}
        assert taken <= sent and len(sent) >= min(m, len(taken) + 1)


def test_interleaved_group_size_follows_a_deeper_generator():
    # A 3-stage generator behind a 2-stage backbone: groups of max(pp, D) = 3.
    schedule = lowered("interleaved", 6, unit("llm", "backbone", 2, vpp=2),
                       unit("sd", "generator", 3))
    assert passes(schedule, "llm", 1)[:6] == ["F0", "F1", "F2", "F0c1", "F1c1", "F2c1"]


# ---- a DAG of units --------------------------------------------------------------------------

DAG = (unit("vit", "encoder", 2, dp=3, microbatch_share=2 / 3),
       unit("aud", "encoder", 1, tp=2, first_rank=6),
       unit("llm", "backbone", 3, dp=2, first_rank=8),
       unit("sd", "generator", 2, dp=1, first_rank=14, microbatch_share=2.0),
       unit("gen", "generator", 1, dp=4, first_rank=16, microbatch_share=0.5))


def depth(schedule: Schedule, unit_name: str, stage: int) -> int:
    """Stages on the longest path from (unit, stage) to a sink, itself included."""
    u = schedule.unit(unit_name)
    after = max((depth(schedule, c[0], c[1]) for c in schedule.consumers(unit_name, stage)),
                default=0)
    return after + 1 if stage == u.pp - 1 else depth(schedule, unit_name, stage + 1) + 1


@pytest.mark.parametrize("m", [1, 3, 8])
def test_dag_lowering_validates_and_warms_up_by_depth(m: int):
    schedule = lowered("1f1b", m, *DAG)
    for st in schedule.stages:
        assert before_first_backward(schedule, st.unit, st.stage) == \
            min(m, depth(schedule, st.unit, st.stage)), st.where
    # the encoders wait for the longest path: 3 backbone stages + 2 of sd
    assert depth(schedule, "aud", 0) == 6 and depth(schedule, "vit", 0) == 7


def test_dag_communication():
    m = 4
    schedule = lowered("1f1b", m, *DAG)
    first = [a.format_local() for a in schedule.stage("llm", 0).actions]
    last = [a.format_local() for a in schedule.stage("llm", 2).actions]
    for j in range(m):
        # the backbone reads both encoders before each forward, and sends both gradients
        k = first.index(f"F{j}")
        assert set(first[k - 2:k]) == {f"RECV_F{j}<vit.s1", f"RECV_F{j}<aud.s0"}
        k = first.index(f"B{j}")
        assert set(first[k + 1:k + 3]) == {f"SEND_B{j}>vit.s1", f"SEND_B{j}>aud.s0"}
        # its last stage feeds both generators and hears back from both
        k = last.index(f"F{j}")
        assert set(last[k + 1:k + 3]) == {f"SEND_F{j}>sd.s0", f"SEND_F{j}>gen.s0"}
        k = last.index(f"B{j}")
        assert set(last[k - 2:k]) == {f"RECV_B{j}<sd.s0", f"RECV_B{j}<gen.s0"}
    for name in ("vit", "aud", "llm", "sd", "gen"):
        for s in range(schedule.unit(name).pp):
            assert [a.format_local() for a in schedule.stage(name, s).actions][-2:] == \
                ["SYNC", "OPT"]


def test_data_parallel_sizes_do_not_change_the_orders():
    # Per-unit DP is the runtime broker's business: the same rows with dp 1 everywhere.
    plain = tuple(unit(u.name, u.role, u.pp) for u in DAG)
    a, b = lowered("1f1b", 5, *DAG), lowered("1f1b", 5, *plain)
    assert a.stages == b.stages and a.units != b.units


def test_lowering_in_steps():
    base = Schedule.skeleton("1f1b", 3, DAG)
    flow = GradientFlow.everywhere(base)
    compute = lower_compute(base, flow)
    assert {a.kind for st in compute.stages for a in st.actions} == {ActionKind.F, ActionKind.B}
    comm = add_communication(compute)
    for before, after in zip(compute.stages, comm.stages, strict=True):
        assert [a for a in after.actions if a.kind.is_compute] == list(before.actions)
        assert all(a.kind.is_compute or a.kind.is_comm for a in after.actions)
    done = add_optimizer(comm, flow)
    for before, after in zip(comm.stages, done.stages, strict=True):
        assert after.actions[:-2] == before.actions
    validate(done)
    assert done == lower_units(base, flow)
    assert base.num_actions == 0          # the passes do not mutate their input


# ---- frozen modules --------------------------------------------------------------------------

def lower_frozen(*frozen: str, name: str = "1f1b", m: int = 4, llm_vpp: int = 1) -> Schedule:
    """vit 2 stages, beats 1, llm 2 (interleaved when ``llm_vpp`` > 1), sd 2, audiogen 1."""
    units = (unit("vit", "encoder", 2), unit("beats", "encoder", 1),
             unit("llm", "backbone", 2, vpp=llm_vpp), unit("sd", "generator", 2),
             unit("audiogen", "generator", 1))
    base = Schedule.skeleton(name, m, units)
    return lower_units(base, gradient_flow(base, frozen_program(*frozen)))


def peers(schedule: Schedule, unit_name: str, stage: int, kind: ActionKind) -> set[str]:
    """The other units the stage's ``kind`` actions talk to."""
    return {a.peer_unit for a in schedule.stage(unit_name, stage).actions
            if a.kind is kind and a.peer_unit != unit_name}


BACKWARD = {ActionKind.B, ActionKind.RECV_B, ActionKind.SEND_B}
STEP = {ActionKind.SYNC, ActionKind.OPT}


@pytest.mark.parametrize("name,llm_vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_frozen_encoder_gets_no_backward(name: str, llm_vpp: int):
    schedule = lower_frozen("vit", "vit_to_llm", name=name, llm_vpp=llm_vpp)
    for s in range(2):
        assert not kinds(schedule, "vit", s) & (BACKWARD | STEP)
    assert peers(schedule, "llm", 0, ActionKind.SEND_B) == {"beats"}
    assert ActionKind.SYNC in kinds(schedule, "beats", 0)
    # nothing waits for the encoder's gradients: it runs all its forwards at once
    assert before_first_backward(schedule, "vit", 1) == 4


def test_frozen_encoder_with_a_trainable_projector():
    # The projector sits on the encoder's last stage: only that stage runs B and steps.
    schedule = lower_frozen("vit")
    assert not kinds(schedule, "vit", 0) & (BACKWARD | STEP)
    assert {ActionKind.B, ActionKind.RECV_B, ActionKind.SYNC, ActionKind.OPT} <= \
        kinds(schedule, "vit", 1)
    assert ActionKind.SEND_B not in kinds(schedule, "vit", 1)
    assert peers(schedule, "llm", 0, ActionKind.SEND_B) == {"vit", "beats"}


@pytest.mark.parametrize("llm_vpp,name", [(1, "1f1b"), (2, "interleaved")])
def test_frozen_backbone_passes_gradients_without_stepping(llm_vpp: int, name: str):
    schedule = lower_frozen("llm", name=name, llm_vpp=llm_vpp)
    for s in range(2):
        assert ActionKind.B in kinds(schedule, "llm", s)
        assert not kinds(schedule, "llm", s) & STEP
    assert peers(schedule, "llm", 0, ActionKind.SEND_B) == {"vit", "beats"}
    assert peers(schedule, "llm", 1, ActionKind.RECV_B) >= {"sd", "audiogen"}
    for name_, pp in (("vit", 2), ("beats", 1), ("sd", 2), ("audiogen", 1)):
        for s in range(pp):
            assert STEP <= kinds(schedule, name_, s)


def test_frozen_backbone_with_nothing_trainable_before_it_runs_no_backward():
    schedule = lower_frozen("vit", "beats", "vit_to_llm", "beats_to_llm", "llm")
    for name, pp in (("vit", 2), ("beats", 1), ("llm", 2)):
        for s in range(pp):
            assert not kinds(schedule, name, s) & (BACKWARD | STEP)
    # the generators still train, on their own losses, and send nothing back
    assert ActionKind.SEND_B not in kinds(schedule, "sd", 0)
    assert ActionKind.SEND_B not in kinds(schedule, "audiogen", 0)
    assert STEP <= kinds(schedule, "sd", 1) and STEP <= kinds(schedule, "audiogen", 0)


def test_frozen_generator_whose_input_needs_gradients():
    schedule = lower_frozen("sd", "llm_to_sd")
    for s in range(2):
        assert ActionKind.B in kinds(schedule, "sd", s)
        assert not kinds(schedule, "sd", s) & STEP
    assert peers(schedule, "sd", 0, ActionKind.SEND_B) == {"llm"}
    assert peers(schedule, "llm", 1, ActionKind.RECV_B) == {"sd", "audiogen"}


def test_frozen_generator_with_a_trainable_projector_steps_on_its_first_stage():
    schedule = lower_frozen("sd")
    assert STEP <= kinds(schedule, "sd", 0)
    assert not kinds(schedule, "sd", 1) & STEP
    assert ActionKind.B in kinds(schedule, "sd", 1)


def test_frozen_generator_behind_a_frozen_model_runs_no_backward():
    everything_but_audiogen = [f for f in FLAGS if f != "audiogen"]
    schedule = lower_frozen(*everything_but_audiogen)
    for s in range(2):
        assert not kinds(schedule, "sd", s) & (BACKWARD | STEP)
    assert STEP <= kinds(schedule, "audiogen", 0)
    assert ActionKind.SEND_B not in kinds(schedule, "audiogen", 0)


def test_gradient_flow_of_a_frozen_mix():
    base = Schedule.skeleton("interleaved", 2, (
        unit("vit", "encoder", 2), unit("beats", "encoder", 1),
        unit("llm", "backbone", 2, vpp=2), unit("sd", "generator", 2),
        unit("audiogen", "generator", 1)))
    flow = gradient_flow(base, frozen_program("vit", "sd", "beats_to_llm"))
    assert ("vit", 0, 0) not in flow.trains and ("vit", 1, 0) in flow.trains
    assert ("vit", 0, 0) not in flow.backward and ("vit", 1, 0) in flow.backward
    assert ("beats", 0, 0) in flow.trains and ("beats", 0, 0) in flow.backward
    assert {("llm", s, c) for s in range(2) for c in range(2)} <= flow.trains & flow.backward
    assert ("sd", 0, 0) in flow.trains and ("sd", 1, 0) not in flow.trains
    assert ("sd", 1, 0) in flow.backward
    assert flow.stage_trains("llm", 1, 2) and not flow.stage_trains("sd", 1, 1)


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,units,message", [
    ("interleaved", (unit("llm", "backbone", 1, vpp=2),),
     r"llm: interleaving \(vpp 2\) needs at least two pipeline stages, the plan gives pp 1"),
    ("interleaved", (unit("vit", "encoder", 1, vpp=3), unit("llm", "backbone", 2, vpp=2)),
     r"vit: interleaving \(vpp 3\) needs at least two pipeline stages"),
    ("gpipe", (unit("llm", "backbone", 4, vpp=2),),
     "llm: vpp 2 under the gpipe schedule; only the interleaved schedule has model chunks"),
    ("1f1b", (unit("llm", "backbone", 4, vpp=2),),
     "llm: vpp 2 under the 1f1b schedule"),
])
def test_lowering_errors(name: str, units: tuple, message: str):
    base = Schedule.skeleton(name, 4, units)
    with pytest.raises(LoweringError, match=message):
        lower_units(base, GradientFlow.everywhere(base))


# ---- shipped specs ---------------------------------------------------------------------------

@cache
def planned(path: Path) -> tuple[Plan, Program]:
    name, data = read_spec(str(path))
    result = run_frontend(name, data)
    assert result.ok, [d.message for d in result.diagnostics]
    cost = build_cost_model(result.program, CostParams())
    # Disaggregated: every unit has stages of its own to lower (a co-located unit has none).
    return plan(cost, compare_baseline=False, placement="disaggregated"), result.program


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_specs_lower_and_round_trip(path: Path):
    the_plan, program = planned(path)
    schedule = lower(the_plan, program)          # validates
    assert schedule.name == the_plan.schedule
    assert schedule.num_microbatches == the_plan.num_microbatches
    assert [u.name for u in schedule.units] == [u.name for u in the_plan.units]
    text = schedule_text(schedule)
    assert parse_schedule(text) == schedule
    assert schedule_text(parse_schedule(text)) == text
    # a stage steps its optimizer exactly when it holds trainable parameters
    flow = gradient_flow(schedule, program)
    for st in schedule.stages:
        trains = flow.stage_trains(st.unit, st.stage, schedule.unit(st.unit).vpp)
        assert (ActionKind.SYNC in kinds(schedule, st.unit, st.stage)) == trains, st.where


def test_lowering_a_plan_with_chunks_where_the_schedule_has_none():
    the_plan, program = planned(ROOT / "specs" / "tiny_cpu.dt")
    llm = the_plan.unit("llm")
    units = tuple(u.model_copy(update={"vpp": 2, "pp": 2, "layers_per_stage": (2, 2)})
                  if u is llm else u for u in the_plan.units)
    with pytest.raises(LoweringError, match="llm: vpp 2 under the 1f1b schedule"):
        lower(the_plan.model_copy(update={"units": units}), program)
    interleaved = the_plan.model_copy(update={"units": units, "schedule": "interleaved"})
    schedule = lower(interleaved, program)
    assert any(a.chunk == 1 for a in schedule.stage("llm", 0).actions)


# ---- golden text forms -----------------------------------------------------------------------

GOLDEN_CASES = {
    "1f1b_p4_m8": ("1f1b", 8, (unit("llm", "backbone", 4, layers_per_stage=(8, 8, 8, 8)),)),
    "gpipe_p3_m4": ("gpipe", 4, (unit("vit", "encoder", 1),
                                 unit("llm", "backbone", 3, first_rank=1))),
    "interleaved_p2_v2_m4": ("interleaved", 4, (unit("llm", "backbone", 2, vpp=2),)),
    "interleaved_p2_v2_m5_gen2": ("interleaved", 5, (unit("llm", "backbone", 2, vpp=2),
                                                     unit("sd", "generator", 2, first_rank=2))),
    "dag_2enc_2gen": ("1f1b", 4, DAG),
    "zero_bubble_p3_m5_gen1": ("zero_bubble", 5, (unit("vit", "encoder", 1),
                                                  unit("llm", "backbone", 3, first_rank=1),
                                                  unit("sd", "generator", 1, first_rank=4))),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_synthetic(case: str, update_golden: bool):
    name, m, units = GOLDEN_CASES[case]
    check_golden(case, schedule_text(lowered(name, m, *units)), update_golden)


def test_golden_tiny_cpu(update_golden: bool):
    the_plan, program = planned(ROOT / "specs" / "tiny_cpu.dt")
    check_golden("tiny_cpu", schedule_text(lower(the_plan, program)), update_golden)


# ---- size ------------------------------------------------------------------------------------

def test_a_large_pipeline_lowers():
    # 32 stages x 256 microbatches of 1F1B: about 48,000 actions (how long it takes:
    # benchmarks/tool_times.py).
    base = Schedule.skeleton("1f1b", 256, (unit("llm", "backbone", 32),))
    schedule = lower_units(base, GradientFlow.everywhere(base))
    assert schedule.num_actions == 32 * 256 * 6 - 2 * 256 * 2 + 32 * 2
