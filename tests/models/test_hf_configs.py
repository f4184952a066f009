"""Config values a Hugging Face directory can hold (issue 25): any field of a decoder's,
a vision tower's, a U-Net's, its scheduler's or its VAE's config replaced with a value of
the wrong type, negative, NaN or huge is DT311 naming the field, or a model dtdsl builds
(DT312 when the weights then do not fit it); ``dtc check`` never raises, never prints a
C++ stack, and its work stays bounded by the checkpoint (no meta module of 10^9 layers).

DTDSL_PROPERTY_EXAMPLES=5000 for a longer soak than CI's default."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtdsl.driver import run_frontend
from tests.hf_models import make_clip, make_decoder, make_siglip, make_unet, make_vae, quiet

PROPERTY_SETTINGS = settings(max_examples=int(os.environ.get("DTDSL_PROPERTY_EXAMPLES", 150)),
                             deadline=None, suppress_health_check=list(HealthCheck))
# A config that builds but whose weights do not fit is DT312; a window or a rope scaling
# that a valid config makes shorter than seq_len is DT313.
ALLOWED = {"DT311", "DT312", "DT313"}

SPEC = """
model {
  MODULES
}
data {
  text.tokens     ~ 64
  image.count     ~ 1
  image.patches   ~ 16
  image.gen_count ~ 1
}
cluster {
  gpu  = H100
  gpus = 8
}
train {
  global_batch = 8
  seq_len      = 128
}
"""
BACKBONE = 'backbone llm {\n    arch = transformer(layers=2, hidden=64, heads=4, ffn=96, ' \
    'vocab=128, swiglu)\n  }'
MODULES = {
    "decoder": 'backbone llm {\n    pretrained = "DIR"\n  }',
    "vision": 'encoder vit (image) {\n    pretrained = "DIR"\n  }\n  ' + BACKBONE +
              "\n  projector vit -> llm : mlp(depth=2)",
    "generator": BACKBONE + '\n  generator gen (image) {\n    pretrained = "DIR"\n  }\n'
                 "  projector llm -> gen : mlp(depth=2)",
}

# Keys dtdsl reads that a saved config may leave out (then the class default applies).
DECODER_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "hidden_act", "head_dim", "intermediate_size",
                "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
                "use_sliding_window", "max_window_layers", "layer_types", "attention_bias",
                "mlp_bias",
                "partial_rotary_factor", "model_type", "quantization_config",
                "rope_parameters.rope_theta", "rope_parameters.rope_type",
                "rope_parameters.factor", "rope_parameters.low_freq_factor",
                "rope_parameters.high_freq_factor",
                "rope_parameters.original_max_position_embeddings"]
VISION_KEYS = ["hidden_size", "num_attention_heads", "num_hidden_layers", "hidden_act",
               "image_size", "patch_size", "intermediate_size", "num_channels",
               "layer_norm_eps", "model_type"]
UNET_KEYS = ["block_out_channels", "down_block_types", "up_block_types", "layers_per_block",
             "transformer_layers_per_block", "attention_head_dim", "num_attention_heads",
             "cross_attention_dim", "sample_size", "in_channels", "out_channels",
             "norm_num_groups", "norm_eps", "use_linear_projection", "_class_name",
             "center_input_sample", "freq_shift", "mid_block_type", "class_embed_type"]
SCHEDULER_KEYS = ["num_train_timesteps", "beta_start", "beta_end", "beta_schedule",
                  "trained_betas", "prediction_type", "rescale_betas_zero_snr"]
VAE_KEYS = ["in_channels", "block_out_channels", "layers_per_block", "latent_channels",
            "norm_num_groups", "scaling_factor", "shift_factor", "mid_block_add_attention",
            "use_quant_conv", "down_block_types", "act_fn", "_class_name"]

# (the spec's modules, the directory the spec names, the config file, the keys to try)
CONFIGS = {
    "llama": ("decoder", "llama", "llama/config.json", DECODER_KEYS),
    "mistral": ("decoder", "mistral", "mistral/config.json", DECODER_KEYS),
    "qwen2": ("decoder", "qwen2", "qwen2/config.json", DECODER_KEYS),
    "clip_vision_model": ("vision", "clip", "clip/config.json", VISION_KEYS),
    "clip": ("vision", "clipfull", "clipfull/config.json",
             [f"vision_config.{k}" for k in VISION_KEYS] + ["vision_config"]),
    "siglip_vision_model": ("vision", "siglip", "siglip/config.json", VISION_KEYS),
    "unet": ("generator", "sd", "sd/unet/config.json", UNET_KEYS),
    "scheduler": ("generator", "sd", "sd/scheduler/scheduler_config.json", SCHEDULER_KEYS),
    "vae": ("generator", "sd", "sd/vae/config.json", VAE_KEYS),
}

BAD_VALUES = st.one_of(
    st.sampled_from([0, -1, -8, 32.0, 32.5, 1e18, 10**18, 10**9, 1_000, 1024, 1025, 2,
                     float("nan"), float("inf"), -float("inf"), 1e308, "8", "abc", "", [], {},
                     [1, 2], None, True, False, {"rope_type": "linear"}]),
    st.integers(-(10**30), 10**30), st.integers(-3, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.booleans(),
    st.lists(st.one_of(st.integers(-2, 2000), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 8), max_size=2),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    quiet()
    root = tmp_path_factory.mktemp("hf")
    make_decoder(root / "llama")
    make_decoder(root / "mistral", "mistral")
    make_decoder(root / "qwen2", "qwen2")
    make_clip(root / "clip")
    make_clip(root / "clipfull", full=True)
    make_siglip(root / "siglip")
    make_unet(root / "sd", sd=2, prediction="v_prediction")
    make_vae(root / "sd" / "vae", channels=(16, 32))
    # As made, each checks clean: every error below comes from the value replaced.
    for name, (kind, directory, _, _) in sorted(CONFIGS.items()):
        result = check(root, kind, directory)
        assert result.ok, (name, [(d.code, d.message) for d in result.diagnostics])
    return root


def check(root: Path, kind: str, directory: str):
    text = SPEC.replace("MODULES", MODULES[kind].replace("DIR", directory))
    return run_frontend(str(root / "spec.dt"), text.encode(), base_dir=root)


@contextlib.contextmanager
def replaced(file: Path, path: str, value):
    """``file``'s JSON with the key at dotted ``path`` set to ``value`` (restored after)."""
    original = file.read_text()
    config = json.loads(original)
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    file.write_text(json.dumps(config))       # NaN and Infinity as Python writes them
    try:
        yield
    finally:
        file.write_text(original)


@contextlib.contextmanager
def deadline(seconds: int):
    def expire(*_):
        raise TimeoutError(f"dtc check ran for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def assert_named_or_fitting(result, path: str) -> None:
    """Only diagnostics (no exception reached here); errors are DT311 naming the field,
    or what a valid config gives (DT312, DT313)."""
    leaf = path.rsplit(".", 1)[-1]
    errors = [d for d in result.diagnostics if d.severity.name == "ERROR"]
    # Any quantization_config says the weights are not plain floating point: DT316.
    allowed = ALLOWED | ({"DT316"} if leaf == "quantization_config" else set())
    assert all(d.code in allowed for d in errors), [(d.code, d.message) for d in errors]
    for d in errors:
        if d.code in ("DT311", "DT316"):
            assert leaf in d.message, (path, d.message)
            assert "\n" not in d.message and len(d.message) < 400, d.message


@PROPERTY_SETTINGS
@given(data=st.data())
def test_any_field_replaced_is_dt311_naming_it_or_a_model(models, data):
    name = data.draw(st.sampled_from(sorted(CONFIGS)), label="config")
    kind, directory, file, keys = CONFIGS[name]
    key = data.draw(st.sampled_from(keys), label="key")
    value = data.draw(BAD_VALUES, label="value")
    with replaced(models / file, key, value), deadline(120):
        result = check(models, kind, directory)
    assert_named_or_fitting(result, key)


# The issue's cases, each with the words of its diagnostic.
ISSUE = [
    ("llama", "num_key_value_heads", "8", "config key 'num_key_value_heads' is \"8\" "
     "(a string), not an integer from 1 to 4_096"),
    ("llama", "num_key_value_heads", 3, "config key 'num_key_value_heads' is 3, not a "
     "divisor of num_attention_heads 4"),
    ("llama", "num_key_value_heads", -2, "config key 'num_key_value_heads' is -2"),
    ("llama", "head_dim", 32.5, "config key 'head_dim' is 32.5, not an integer"),
    ("llama", "head_dim", 16.0, "(written without a decimal point)"),
    ("llama", "rope_parameters.rope_theta", "abc",
     "config key 'rope_parameters.rope_theta' is \"abc\" (a string), not a number above 0"),
    ("llama", "rope_theta", "abc", "config key 'rope_theta' is \"abc\""),
    ("llama", "num_attention_heads", 10**18, "config key 'num_attention_heads' is "
     "1000000000000000000, not an integer from 1 to 4_096"),
    ("llama", "num_attention_heads", 128, "config key 'num_attention_heads' is 128, not at "
     "most hidden_size 64"),
    ("llama", "num_hidden_layers", 10**9, "config key 'num_hidden_layers' is 1000000000, not "
     "an integer from 1 to 1_024"),
    ("llama", "rms_norm_eps", -1, "config key 'rms_norm_eps' is -1, not a number above 0 "
     "and below 1"),
    ("llama", "rms_norm_eps", float("nan"), "config key 'rms_norm_eps' is NaN"),
    ("llama", "tie_word_embeddings", "false", "config key 'tie_word_embeddings' is \"false\" "
     "(a string), not true or false"),
    ("llama", "rope_parameters", [1], "config key 'rope_parameters' is [1] (a list), not an "
     "object"),
    ("llama", "rope_parameters.high_freq_factor", 0.5, "config key "
     "'rope_parameters.high_freq_factor' is 0.5, not above low_freq_factor 1"),
    ("clip", "vision_config.patch_size", 0, "config key 'vision_config.patch_size' is 0"),
    ("siglip_vision_model", "image_size", 1 << 20, "config key 'image_size' is 1048576"),
    ("unet", "block_out_channels", [32, "64"], "config key 'block_out_channels' is "
     "[32, \"64\"] (a list), not a list of 1 to 8 integers"),
    ("unet", "block_out_channels", [32] * 100, "config key 'block_out_channels'"),
    ("unet", "transformer_layers_per_block", 10**6, "config key "
     "'transformer_layers_per_block' is 1000000"),
    ("unet", "norm_eps", float("inf"), "config key 'norm_eps' is Infinity"),
    ("unet", "flip_sin_to_cos", False, "flip_sin_to_cos = false (a flag) is not supported "
     "(dtdsl's U-Net is SD 1.x/2.x's: flip_sin_to_cos = true)"),
    ("scheduler", "beta_end", 2, "scheduler config key 'beta_end' is 2, not a number at "
     "least 0 and below 1"),
    ("scheduler", "num_train_timesteps", 10**12, "scheduler config key "
     "'num_train_timesteps' is 1000000000000"),
    ("vae", "norm_num_groups", 5, "config key 'norm_num_groups' is 5, not a divisor of "
     "every block_out_channels [16, 32]"),
    ("vae", "scaling_factor", "0.18", "config key 'scaling_factor' is \"0.18\" (a string)"),
    ("vae", "block_out_channels", 64, "config key 'block_out_channels' is 64"),
]


@pytest.mark.parametrize("name,key,value,words", ISSUE,
                         ids=[f"{n}-{k}-{v!r}"[:60] for n, k, v, _ in ISSUE])
def test_the_issues_values_are_dt311_naming_the_field(models, name, key, value, words):
    kind, directory, file, _ = CONFIGS[name]
    with replaced(models / file, key, value), deadline(120):
        result = check(models, kind, directory)
    got = [(d.code, d.message) for d in result.diagnostics if d.severity.name == "ERROR"]
    assert [c for c, _ in got] == ["DT311"], got
    assert words in got[0][1], got


def test_a_config_that_claims_more_than_its_checkpoint_holds_is_not_built(models, tmp_path,
                                                                          monkeypatch):
    """1024 layers (the bound) over a checkpoint of 4: refused from the headers' sizes,
    before a meta module of 1024 layers is built."""
    import dtdsl.models

    path = tmp_path / "llama"
    shutil.copytree(models / "llama", path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1024
    (path / "config.json").write_text(json.dumps(config))

    def no_build(*args, **kwargs):
        raise AssertionError("a module was built")

    monkeypatch.setattr(dtdsl.models, "build_arch", no_build)
    got = [(d.code, d.message) for d in check(tmp_path, "decoder", "llama").diagnostics
           if d.severity.name == "ERROR"]
    assert [c for c, _ in got] == ["DT312"], got
    assert "less than half of the" in got[0][1], got
