"""``compress = ...`` on a projector: what the checker makes of it, and DT318 for a grid a
pixel shuffle does not divide (golden/diagnostics/compress.dt has the other misuses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from tests.hf_models import make_clip
from tests.specs import TINY

SHORT = "projector vit -> llm : mlp(depth=2)"


def _check(text: str, name: str = "spec.dt", base: Path | None = None):
    return run_frontend(name, text.encode(), base_dir=base)


def _tiny(compress: str) -> str:
    return TINY.read_text().replace(
        SHORT, f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")


@pytest.mark.parametrize(("compress", "want", "in_dim", "tokens"), [
    ("pixel_shuffle(2)", ir.PixelShuffle(factor=2), 256, 16),
    ("pixel_shuffle(factor=4)", ir.PixelShuffle(factor=4), 1024, 4),
    ("avg_pool(3)", ir.AvgPool(factor=3), 64, 9),
    ("resampler(queries=32)", ir.Resampler(queries=32, heads=4), 64, 32),
    ("resampler(queries=7, heads=8)", ir.Resampler(queries=7, heads=8), 64, 7),
])
def test_each_compression_checks(compress, want, in_dim, tokens):
    result = _check(_tiny(compress))
    assert result.ok, [d.message for d in result.diagnostics]
    program = result.program
    proj = program.projectors[0]
    assert proj.compress == want and proj.arch.in_dim == in_dim
    # The other projector does not compress; the rule counts an 8 x 8 grid's tokens.
    assert program.projectors[1].compress is None
    assert program.image_tokens() == ir.ImageTokens(patch=8, compress=want)
    assert program.image_tokens().of_grid(8, 8) == tokens
    # The Program's text form keeps it.
    assert ir.Program.model_validate_json(program.model_dump_json()) == program


def test_without_compression_an_image_is_its_patches():
    program = _check(TINY.read_text()).program
    assert program.projectors[0].compress is None
    rule = program.image_tokens()
    assert rule == ir.ImageTokens(patch=8) and rule(32, 48) == 24 and rule.block == 1


def test_an_unknown_compression_suggests_the_known_ones():
    result = _check(_tiny("pixel_shufle(2)"))
    (d,) = result.diagnostics
    assert d.code == "DT205" and "pixel_shufle" in d.message
    assert d.hint == "did you mean 'pixel_shuffle'?"


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_clip(root / "clip40", image=40, patch=8)      # a 5 x 5 grid
    make_clip(root / "clip32", image=32, patch=8)      # a 4 x 4 grid
    return root


def _clip_spec(folder: str, compress: str) -> str:
    return TINY.read_text().replace(
        "arch = transformer(layers=2, hidden=64, heads=4, ffn=128, patch=8)",
        f'arch = hf("{folder}")').replace(
        SHORT, f"projector vit -> llm {{ arch = mlp(depth=2)  compress = {compress} }}")


def test_a_fixed_grid_that_pixel_shuffle_does_not_divide_is_DT318(clip):
    result = _check(_clip_spec("clip40", "pixel_shuffle(2)"), base=clip)
    (d,) = [d for d in result.diagnostics if d.severity.value == "error"]
    assert d.code == "DT318"
    assert d.message == ("pixel_shuffle(2) needs a patch grid divisible by 2, but encoder vit "
                         "reads 40 x 40 images in patches of 8: a 5 x 5 grid")
    assert d.hint == "use pixel_shuffle(5), or avg_pool(2), which pools the edge blocks " \
        "(ceil mode)"
    # Pooling takes the grid as it is (ceil mode), and a grid that divides is fine.
    pooled = _check(_clip_spec("clip40", "avg_pool(2)"), base=clip)
    assert pooled.ok and pooled.program.image_tokens()(40, 40) == 9
    shuffled = _check(_clip_spec("clip32", "pixel_shuffle(2)"), base=clip)
    assert shuffled.ok and shuffled.program.image_tokens()(32, 32) == 4
