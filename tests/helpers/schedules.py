"""Schedule test helpers: units, a lowered schedule, a stage's passes in text form, and a
five-module spec with chosen modules frozen (``frozen_program``)."""

from __future__ import annotations

from dtdsl.driver import run_frontend
from dtdsl.ir.program import Program
from dtdsl.ir.schedule import Schedule, ScheduleUnit
from dtdsl.schedule.lower import GradientFlow, lower_units


def unit(name: str, role: str, pp: int = 1, **kw) -> ScheduleUnit:
    return ScheduleUnit(name=name, role=role, tp=kw.pop("tp", 1), dp=kw.pop("dp", 1), pp=pp,
                        **kw)


def lowered(name: str, m: int, *units: ScheduleUnit) -> Schedule:
    base = Schedule.skeleton(name, m, units)
    return lower_units(base, GradientFlow.everywhere(base))


def passes(schedule: Schedule, unit_name: str, stage: int) -> list[str]:
    """The stage's forwards and backwards in order, in their text form."""
    return [a.format_local() for a in schedule.stage(unit_name, stage).actions
            if a.kind.is_compute]


SPEC = """
spec frozen_mix
model {{
  encoder vit (image) {{
    arch = transformer(layers=4, hidden=64, heads=4, ffn=128, patch=8)
    frozen = {vit}
  }}
  encoder beats (audio) {{
    arch = transformer(layers=4, hidden=64, heads=4, ffn=128, patch=16, in_channels=1)
    frozen = {beats}
  }}
  backbone llm {{
    arch = transformer(layers=8, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, swiglu)
    frozen = {llm}
  }}
  generator sd (image) {{
    arch = unet(channels=32, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, head_dim=16,
                context_dim=64, groups=8)
    frozen = {sd}
  }}
  generator audiogen (audio) {{
    arch = dit(layers=4, hidden=64, heads=4, patch=2, latent=8, latent_channels=4)
    frozen = {audiogen}
  }}
  projector vit -> llm {{ arch = mlp(depth=2)  frozen = {vit_to_llm} }}
  projector beats -> llm {{ arch = mlp(depth=2)  frozen = {beats_to_llm} }}
  projector llm -> sd {{ arch = mlp(depth=2)  frozen = {llm_to_sd} }}
  projector llm -> audiogen {{ arch = mlp(depth=2)  frozen = {llm_to_audiogen} }}
}}
data mixed {{
  text.tokens     ~ constant(64)
  image.count     ~ 1
  image.patches   ~ 16
  image.gen_count ~ 1
  audio.count     ~ 1
  audio.frames    ~ 64
  audio.gen_count ~ 1
}}
cluster {{ gpu = H100  gpus = 16 }}
train {{ global_batch = 16  micro_batch = 1  seq_len = 512 }}
"""
FLAGS = ("vit", "beats", "llm", "sd", "audiogen", "vit_to_llm", "beats_to_llm", "llm_to_sd",
         "llm_to_audiogen")


def frozen_program(*frozen: str) -> Program:
    assert set(frozen) <= set(FLAGS)
    text = SPEC.format(**{f: "true" if f in frozen else "false" for f in FLAGS})
    result = run_frontend("frozen_mix.dt", text.encode())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program
