"""The tiny spec with audio and video encoders added, and a tiny counterpart of
specs/audio_image.dt, for the tests of several encoders of any modality."""

from __future__ import annotations

from dtdsl.ir import program as ir
from tests.specs import TINY, program

_AUDIO = """  encoder beats (audio) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=4, in_channels=1,
                       mel_bins=16)
  }
"""
# The same encoder without a patch size: a frame stem, a token per fbank frame.
_AUDIO_FRAMES = _AUDIO.replace(" patch=4,", "")
_VIDEO = """  encoder clip (video) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=4, temporal_patch=2)
  }
"""
_AUDIO_DATA = """  audio.count     ~ choice([0, 1, 2], p=[0.4, 0.4, 0.2])
  audio.frames    ~ uniform(6, 40)      # tokens per clip: 4 per row of 4x4 patches
"""
_VIDEO_DATA = """  video.count     ~ choice([0, 1], p=[0.5, 0.5])
  video.frames    ~ uniform(1, 5)       # rounded up to whole temporal patches of 2
  video.patches   ~ choice([4, 9])      # 8x8 and 12x12 frames at patch 4
"""


def tiny_modal(audio: bool = True, video: bool = False, batch: int | None = None,
               frames: bool = False, channels: int = 1) -> ir.Program:
    """tiny_cpu.dt with an audio encoder (BEATs-style, 4x4 patches of a 16-bin fbank;
    ``frames``: no patch, a token per frame; ``channels``: its in_channels, an fbank per
    channel) and/or a video encoder (Qwen2-VL-style, 2-frame patches) added, each with its
    projector into the backbone and its data quantities."""
    text = TINY.read_text()
    ear = (_AUDIO_FRAMES if frames else _AUDIO).replace(
        "in_channels=1", f"in_channels={channels}")
    encoders = (ear if audio else "") + (_VIDEO if video else "")
    projectors = "".join(f"\n  projector {e} -> llm : mlp(depth=2)"
                         for e, on in (("beats", audio), ("clip", video)) if on)
    data = (_AUDIO_DATA if audio else "") + (_VIDEO_DATA if video else "")
    text = text.replace("  backbone llm {", encoders + "  backbone llm {")
    text = text.replace("projector vit -> llm : mlp(depth=2)",
                        "projector vit -> llm : mlp(depth=2)" + projectors)
    text = text.replace("  image.gen_count", data + "  image.gen_count")
    p = program(text)
    if batch is not None:
        p = p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})
    return p


AUDIO_IMAGE = """# specs/audio_image.dt in miniature: images and audio in, images and audio out,
# the image generator frozen, the audio generator a latent DiT.
spec tiny_audio_image

model {
  encoder vit (image) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=8)
  }
  encoder beats (audio) {
    arch = transformer(layers=2, hidden=32, heads=2, ffn=64, patch=4, in_channels=1,
                       mel_bins=16)
  }
  backbone llm {
    arch = transformer(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, swiglu)
  }
  generator sd (image) {
    arch   = unet(channels=16, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8,
                  head_dim=8, context_dim=32, groups=8)
    frozen = true
  }
  generator audiogen (audio) {
    arch = dit(layers=2, hidden=32, heads=2, patch=2, latent=8, latent_channels=4)
  }
  projector vit -> llm      : mlp(depth=2)
  projector beats -> llm    : mlp(depth=2)
  projector llm -> sd       : mlp(depth=2)
  projector llm -> audiogen : mlp(depth=2)
}

data mixed {
  text.tokens     ~ lognormal(median=24, sigma=0.5) clamp [4, 96]
  image.count     ~ zipf(a=1.8) clamp [0, 2]
  image.patches   ~ choice([4, 16], p=[0.7, 0.3])
  image.gen_count ~ choice([0, 1], p=[0.6, 0.4])
  audio.count     ~ choice([0, 1, 2], p=[0.6, 0.3, 0.1])
  audio.frames    ~ uniform(8, 48)
  audio.gen_count ~ choice([0, 1], p=[0.6, 0.4])
}

cluster lab {
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 5
  gpus_per_node = 5
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
  cpu_workers   = 1
}

train {
  global_batch = 8
  micro_batch  = 2
  seq_len      = 256
  schedule     = 1f1b
  optimizer    = adamw(lr=1e-3, zero=1)
  precision    = fp32
  steps        = 8
  seed         = 7
}
"""


def tiny_audio_image() -> ir.Program:
    """``AUDIO_IMAGE`` checked."""
    return program(AUDIO_IMAGE)


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def _modal_text(text: str, frames: bool = False) -> str:
    from tests.train import modal_specs as m

    audio = m._AUDIO_FRAMES if frames else m._AUDIO
    text = text.replace("  backbone llm {", audio + m._VIDEO + "  backbone llm {")
    text = text.replace("projector vit -> llm : mlp(depth=2)",
                        "projector vit -> llm : mlp(depth=2)\n  projector beats -> llm : "
                        "mlp(depth=2)\n  projector clip -> llm : mlp(depth=2)")
    text = text.replace("  image.gen_count", m._AUDIO_DATA + m._VIDEO_DATA + "  image.gen_count")
    return text.replace("gpus          = 4", "gpus          = 6") \
        .replace("gpus_per_node = 4", "gpus_per_node = 6")
