"""Random small .dt specs for comparing the planners: one to three encoders, a backbone
and zero to two generators with random sizes, data, schedules, memory and batch sizes.

``random_spec(rng)`` returns spec text that checks clean; the generated models are
small enough (and the GPUs small enough) that memory binds at some layouts.
"""

from __future__ import annotations

import random

__all__ = ["random_spec"]

_MODALITIES = ("image", "audio", "video")


def _transformer(rng: random.Random, layers: tuple[int, int], heads: int) -> str:
    head_dim = rng.choice((32, 64))
    hidden = heads * head_dim
    return (f"transformer(layers={rng.randint(*layers)}, hidden={hidden}, heads={heads}, "
            f"ffn={hidden * rng.choice((2, 4))}")


def random_spec(rng: random.Random, name: str = "random", max_units: int = 6) -> str:
    """A spec with at most ``max_units`` modules (the exhaustive search's time grows
    steeply with them: five units at 40 GPUs can take minutes)."""
    encoders = rng.sample(_MODALITIES, rng.randint(1, min(3, max_units - 1)))
    generators = ["image"] if rng.random() < 0.6 else []
    if generators and rng.random() < 0.3:
        generators.append("audio")
    generators = generators[:max_units - 1 - len(encoders)]
    lines = [f"spec {name}", "", "model {"]
    for mod in encoders:
        frozen = "\n    frozen = true" if rng.random() < 0.25 else ""
        # An audio encoder's patches tile its 128 mel bins (BEATs: 16); a ViT's 14 px.
        patch = 16 if mod == "audio" else 14
        lines.append(f"  encoder enc_{mod} ({mod}) {{\n    arch = "
                     f"{_transformer(rng, (2, 12), rng.choice((4, 8)))}, patch={patch})"
                     f"{frozen}\n  }}")
        lines.append(f"  projector enc_{mod} -> llm : mlp(depth=2)")
    frozen = "\n    frozen = true" if rng.random() < 0.15 else ""
    lines.append(f"  backbone llm {{\n    arch = {_transformer(rng, (4, 48), rng.choice((8, 16)))}"
                 f", vocab={rng.choice((32000, 64000))}, swiglu){frozen}\n  }}")
    for mod in generators:
        if rng.random() < 0.5:
            arch = (f"unet(channels={rng.choice((64, 128, 192))}, mult=[1, 2, 2], res_blocks=1, "
                    "attn_res=[2, 1], latent=32, head_dim=32, context_dim=256)")
        else:
            arch = (f"dit(layers={rng.randint(2, 12)}, hidden=256, heads=4, ffn=1024, patch=2, "
                    "latent=32, context_dim=256)")
        lines.append(f"  generator gen_{mod} ({mod}) {{\n    arch = {arch}\n  }}")
        lines.append(f"  projector llm -> gen_{mod} : mlp(depth=2)")
    lines += ["}", "", "data d {",
              f"  text.tokens ~ lognormal(median={rng.choice((256, 512, 1024))}, "
              f"sigma={rng.choice((0.5, 1.0))}) clamp [16, 4096]"]
    for mod in sorted(set(encoders) | set(generators)):
        if mod in encoders:
            lines.append(f"  {mod}.count ~ zipf(a={rng.choice((1.5, 2.0))}) clamp [0, 8]")
        if mod not in encoders:
            pass
        elif mod == "image":
            lines.append("  image.patches ~ choice([256, 1024], p=[0.7, 0.3])")
        elif mod == "audio":
            lines.append("  audio.frames ~ uniform(100, 1500)")
        else:
            lines += ["  video.frames ~ uniform(4, 16)", "  video.patches ~ constant(256)"]
        if mod in generators:
            lines.append(f"  {mod}.gen_count ~ choice([0, 1], p=[0.5, 0.5])")
    schedule = rng.choice(("1f1b", "1f1b", "gpipe", "interleaved"))
    micro = rng.choice((1, 2))
    global_batch = micro * rng.choice((8, 16, 24, 32, 48, 64))
    lines += ["}", "", "cluster c {",
              f"  gpu = custom(name=\"g\", memory={rng.choice((8, 16, 24))} GB, peak=100 TFLOPS)",
              "  gpus = 8", "  gpus_per_node = 8", "  intra_node_bw = 100 GB/s",
              "  inter_node_bw = 25 GB/s", "}", "", "train {",
              f"  global_batch = {global_batch}", f"  micro_batch = {micro}",
              "  seq_len = 4096",
              f"  schedule = {'interleaved(2)' if schedule == 'interleaved' else schedule}"]
    lines += [f"  optimizer = adamw(zero={rng.choice((0, 1))})", "}"]
    if rng.random() < 0.5:
        eight = ", 8" if rng.random() < 0.5 else ""
        lines += ["", "constraints {", f"  tp(*) in {{1, 2, 4{eight}}}", "}"]
    return "\n".join(lines) + "\n"
