"""Specs and a synthesised tiny_cpu dataset shared by the dataset tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtdsl.data.shards import write_dataset
from dtdsl.data.synth import provenance, synthesize
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "specs" / "tiny_cpu.dt"
NUM_SAMPLES = 2000
SHARD_SIZE = 600     # 4 shards, the last one short

# Every modality the synthesiser makes: an image and an audio encoder, an image and an
# audio generator; image.patches clamped below the largest draw.
AUDIO_SPEC = """\
spec tiny_av

model {
  encoder vit (image) {
    arch = transformer(layers=1, hidden=32, heads=2, ffn=64, patch=8)
  }
  encoder ear (audio) {
    arch = transformer(layers=1, hidden=32, heads=2, ffn=64, patch=16)
  }
  backbone llm {
    arch = transformer(layers=2, hidden=64, heads=2, ffn=128, vocab=300)
  }
  generator gen (image) {
    arch = unet(channels=16, mult=[1, 2], res_blocks=1, attn_res=[2], latent=8, head_dim=8,
                context_dim=32, groups=8)
  }
  generator voice (audio) {
    arch = dit(layers=1, hidden=32, heads=2, ffn=64, patch=2, latent=8, latent_channels=6)
  }
  projector vit -> llm   : mlp(depth=2)
  projector ear -> llm   : mlp(depth=2)
  projector llm -> gen   : mlp(depth=2)
  projector llm -> voice : mlp(depth=2)
}

data av {
  text.tokens     ~ lognormal(median=20, sigma=0.5) clamp [4, 64]
  image.count     ~ choice([0, 1, 2], p=[0.3, 0.4, 0.3])
  image.patches   ~ choice([16, 64], p=[0.5, 0.5]) clamp [1, 40]
  image.gen_count ~ choice([0, 1], p=[0.5, 0.5])
  audio.count     ~ choice([0, 1, 2], p=[0.4, 0.3, 0.3])
  audio.frames    ~ uniform(16, 64) clamp [16, 48]
  audio.gen_count ~ choice([0, 1], p=[0.5, 0.5])
}

cluster local {
  gpu  = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 8
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}

train {
  global_batch = 8
  seq_len      = 128
  steps        = 2
}
"""


def check_spec(text: str, name: str = "spec.dt", base_dir: Path | None = None) -> ir.Program:
    result = run_frontend(name, text.encode(), base_dir=base_dir)
    assert result.ok and result.program is not None, \
        [d.message for d in result.diagnostics]
    return result.program


@pytest.fixture(scope="session")
def tiny() -> ir.Program:
    return check_spec(TINY.read_text(), str(TINY))


@pytest.fixture(scope="session")
def av() -> ir.Program:
    return check_spec(AUDIO_SPEC)


@pytest.fixture(scope="session")
def tiny_dataset(tiny: ir.Program, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 synthesised tiny_cpu samples (seed 5) in shards of 600."""
    path = tmp_path_factory.mktemp("tiny") / "data"
    write_dataset(path, synthesize(tiny, NUM_SAMPLES, seed=5), samples_per_shard=SHARD_SIZE,
                  provenance=provenance(tiny, 5))
    return path
