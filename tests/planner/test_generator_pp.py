"""A generator's pipeline depth: a U-Net never takes more than one stage (its skip
connections cross every cut), refused in the spec (DT407) when a constraint rules pp 1 out,
and the planner keeps it on one stage, the only depth the runtime runs it at (DT601); a
DiT's blocks split over stages as a transformer's (``train.generator``)."""

from __future__ import annotations

import pytest

from dtdsl.cost.model import build_cost_model
from dtdsl.planner import Infeasible, plan
from dtdsl.planner.evaluate import Evaluator
from dtdsl.planner.space import Space
from tests.helpers.checks import GENERATOR, diagnostics
from tests.helpers.planning import ROOT, from_text

_UNET = GENERATOR.replace("MULT", "[1, 2]")
_DIT = _UNET.replace("arch = unet(channels=320, mult=[1, 2], res_blocks=1, latent=32)",
                     "arch = dit(layers=4, hidden=64, heads=4, patch=2, latent=32, "
                     "latent_channels=4)")


def _errors(text: str) -> list:
    return [d for d in diagnostics(text) if d.severity.value == "error"]


def test_a_unet_pinned_to_two_stages_is_refused_in_the_spec():
    found = _errors(_UNET + "constraints { pp(sd) == 2 }\n")
    assert [d.code for d in found] == ["DT407"]
    assert "U-Net" in found[0].message and "pp(sd) == 1" in (found[0].hint or "")


def test_a_unet_may_be_allowed_more_stages_beside_one():
    assert not _errors(_UNET + "constraints { pp(sd) in {1, 2} }\n")


def test_a_dit_pinned_to_two_stages_is_a_valid_spec():
    assert _DIT != _UNET
    assert not _errors(_DIT + "constraints { pp(sd) == 2 }\n")


def _space(text: str) -> tuple[Space, int]:
    cost = build_cost_model(from_text(text))
    space = Space(Evaluator(cost, cost.program.cluster.num_gpus))
    (gen,) = [i for i, u in enumerate(space.units) if u.role == "generator"]
    return space, gen


def test_the_space_offers_a_unet_one_stage_and_a_dit_more():
    space, gen = _space(_UNET + "constraints { pp(sd) in {1, 2, 4} }\n")
    assert space.units[gen].layers > 1    # it could be split: the rule is what keeps it
    assert space.pps(gen) == (1,)
    # The backbone's depths are untouched.
    assert len(space.pps(space.backbone)) > 1
    space, gen = _space(_DIT + "constraints { pp(sd) in {1, 2, 4} }\n")
    assert space.pps(gen) == (1, 2, 4)


def test_a_dit_pinned_to_two_stages_keeps_its_constraint():
    space, gen = _space(_DIT + "constraints { pp(sd) == 2 }\n")
    assert space.pps(gen) == (2,)


def _large_unet(memory: str) -> str:
    """tiny_cpu with a 640-channel U-Net at tp 1 on 8 GPUs of ``memory``."""
    text = (ROOT / "specs" / "tiny_cpu.dt").read_text()
    for old, new in (("unet(channels=32", "unet(channels=640"),
                     ("memory=4 GiB", f"memory={memory}"),
                     ("gpus          = 4", "gpus          = 8"),
                     ("gpus_per_node = 4", "gpus_per_node = 8"),
                     ("tp(*) in {1, 2}", "tp(*) in {1, 2}\n  tp(gen) == 1")):
        assert old in text
        text = text.replace(old, new)
    return text


def test_the_planner_never_splits_a_unet_to_fit():
    # In 2 GiB the U-Net fits only over 3 stages (what the planner chose before it kept
    # generators on one): now no layout fits, and the message says so at pp 1.
    cost = build_cost_model(from_text(_large_unet("2 GiB")))
    with pytest.raises(Infeasible, match="gen does not fit.*pp 1"):
        plan(cost, placement="disaggregated", compare_baseline=False)


def test_the_planner_puts_a_unet_that_fits_on_one_stage():
    result = plan(build_cost_model(from_text(_large_unet("4 GiB"))),
                  placement="disaggregated", compare_baseline=False)
    (gen,) = [u for u in result.units if u.role == "generator"]
    assert gen.pp == 1


def test_the_planner_splits_a_large_dit_and_the_runtime_takes_the_plan():
    # A DiT of 8 wide blocks, the slowest unit by far: the planner gives it several
    # stages (the fastest layout on 8 GPUs), a plan `dtc compile` accepts.
    from dtdsl.codegen.support import runtime_support

    text = _large_unet("1 GiB").replace(
        "arch = unet(channels=640, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, "
        "head_dim=16,\n                context_dim=64, groups=8)",
        "arch = dit(layers=8, hidden=1024, heads=8, patch=2, latent=8, latent_channels=4)")
    assert "dit(" in text
    program = from_text(text)
    result = plan(build_cost_model(program), placement="disaggregated",
                  compare_baseline=False)
    (gen,) = [u for u in result.units if u.role == "generator"]
    assert gen.pp > 1 and sum(gen.layers_per_stage) == 8
    assert runtime_support(program, result) == []
