"""Checking spec texts in tests: a base spec, its variants, and the diagnostics or
program the checker gives."""

from __future__ import annotations

from dtdsl.driver import run_frontend
from dtdsl.ir.program import Program

BASE = """
model {
  encoder vit (image) { arch = transformer(layers=4, hidden=64, heads=4, patch=8) }
  backbone llm { arch = transformer(layers=8, hidden=128, heads=8, kv_heads=2, vocab=100, swiglu) }
  projector vit -> llm : mlp()
}
data {
  text.tokens   ~ lognormal(median=64, sigma=0.5) clamp [8, 256]
  image.count   ~ zipf(1.5) clamp [0, 4]
  image.patches ~ 64
}
cluster { gpu = H100(memory = 94 GB)  gpus = 64  inter_node_bw = 200 Gb/s }
train { global_batch = 32  micro_batch = 2  seq_len = 512 }
"""



def program(text: str, **kwargs) -> Program:
    result = run_frontend("t.dt", text.encode(), **kwargs)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program



def errors(text: str) -> list[str]:
    result = run_frontend("t.dt", text.encode())
    return [d.code for d in result.diagnostics if d.severity.value == "error"]



def diagnostics(text: str, **kwargs) -> list:
    return list(run_frontend("t.dt", text.encode(), **kwargs).diagnostics)



GENERATOR = BASE.replace("projector vit -> llm : mlp()", """projector vit -> llm : mlp()
  generator sd (image) { arch = unet(channels=320, mult=MULT, res_blocks=1, latent=32) }
  projector llm -> sd : mlp()""").replace("image.patches ~ 64", "image.patches ~ 64\n"
                                        "  image.gen_count ~ 1")

