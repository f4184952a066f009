"""Hugging Face safetensors checkpoints: dtdsl's parameter names mapped to theirs, blocks of
tensors read without reading the rest, and checkpoints written back.

**Names.** ``source_of(family, name, arch)`` says where the dtdsl parameter ``name`` (a
unit-level name such as ``layers.3.attn.wq.weight``) lives in a Hugging Face checkpoint of
``family``: a ``Source`` (the checkpoint key, a row range of it, and the tensor's shape
there when it differs from dtdsl's). Everything maps one to one, but for three kept forms
of the same numbers: a diffusers GEGLU's fused ``ff.net.0.proj`` holds dtdsl's ``value``
(its first half of rows) and ``gate`` (its second half); an SD 1.x transformer's 1x1
``proj_in``/``proj_out`` convolutions ``[o, i, 1, 1]`` are dtdsl's linear ``[o, i]``; a
vision tower's patch convolution ``[h, c, p, p]`` is dtdsl's linear map ``[h, c p^2]`` of
flattened patches; an MoE block's stacked experts ``w1``/``w3``/``w2`` ``[E, ...]`` are the
Hub's one tensor per expert (``Source.stack``), or rows of transformers 5's stacked
``gate_up_proj``/``down_proj`` when a checkpoint holds those. Key prefixes (``model.``,
``vision_model.``, a LLaVA's ``language_model.``, a Whisper's ``model.encoder.``) are
found in the checkpoint (``Checkpoint.prefix_for``). Whisper's stem
(``patch_embed.conv1``/``conv2``) is its ``conv1``/``conv2``, one to one; its
``embed_positions`` is no dtdsl parameter (the fixed sinusoids, ``models.audio``).

**Reading** (``Checkpoint``): a directory's ``*.safetensors`` (one file, or shards with
their ``*.safetensors.index.json``), through ``safe_open``: ``read(key, offsets, shape)``
returns just that block of the stored tensor (``get_slice``), so a rank reads the rows and
columns its shards cover and nothing else. Nothing in a file is trusted: each header is
checked against its file before any tensor is read (``read_header``: a file cut short, or
whose header lies about its tensors, is a ``WeightsFileError``, DT316), a parameter is
read only from floating-point tensors (``Checkpoint.dtype_problem``: integer, bool and FP8
tensors are quantised weights), and an index names its shards inside its directory (the
shards themselves may be symlinks, as in the Hub cache).

**Writing** (``write_checkpoint``): tensors into shards of at most ``max_shard_bytes`` with
the index Hugging Face's ``from_pretrained`` reads (``model.safetensors`` /
``diffusion_pytorch_model.safetensors``, ``...-00001-of-0000N.safetensors`` when sharded),
into a new folder that is then swapped in whole (``save_hf``, ``dtc export``).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from dtdsl.ir import program as ir
from dtdsl.models.hf.config import HFError
from dtdsl.models.hf.fields import open_regular, read_json, shown

__all__ = ["DECODERS", "Checkpoint", "FLOAT_DTYPES", "HFTensor", "QUANTISED_HINT", "Source",
           "TensorInfo", "WEIGHT_FILES", "WeightsFileError", "hf_key_prefix", "hf_tensors",
           "read_header", "source_of", "write_checkpoint"]

# The file names transformers and diffusers write.
WEIGHT_FILES = {"transformers": "model.safetensors",
                "diffusers": "diffusion_pytorch_model.safetensors"}
_MAX_HEADER_KEYS = 1_000_000


@dataclass(frozen=True)
class Source:
    """Where a dtdsl tensor is stored: ``key``, rows ``[rows[0], rows[1])`` of it along
    dimension ``axis`` (all when None), and its stored ``shape`` when that differs from
    dtdsl's (a view: only the dimensions after the first are regrouped). With ``stack``,
    the dtdsl tensor's dimension 0 runs over those keys, one stored tensor each (an MoE
    block's experts in the Hub's layout); ``key`` is the first of them."""

    key: str
    rows: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None
    axis: int = 0
    stack: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """Every stored tensor the dtdsl tensor is made of."""
        return self.stack or (self.key,)


# ---- names ---------------------------------------------------------------------------------

_DECODER_LAYER = {
    "attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
}
_VISION_LAYER = {
    "attn_norm": "layer_norm1", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj", "mlp_norm": "layer_norm2",
    "mlp.w1": "mlp.fc1", "mlp.w2": "mlp.fc2",
}
_VISION_ENDS = {
    "patch_embed": "embeddings.patch_embedding", "cls_embedding": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding", "pre_norm": "pre_layrnorm",
    "post_norm": "post_layernorm",
}
_WHISPER_LAYER = {
    "attn_norm": "self_attn_layer_norm", "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.out_proj", "mlp_norm": "final_layer_norm", "mlp.w1": "fc1",
    "mlp.w2": "fc2",
}
_WHISPER_ENDS = {"patch_embed.conv1": "conv1", "patch_embed.conv2": "conv2",
                 "post_norm": "layer_norm"}
_QK_NORM = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
_MOE_PARAM = re.compile(r"layers\.(\d+)\.mlp\.(.+)$")
_UNET_ATTN = {"wq": "to_q", "wk": "to_k", "wv": "to_v", "wo": "to_out.0"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_key_prefix(family: str) -> dict[str, str]:
    """The key prefixes ``write_checkpoint`` gives a model of ``family`` (the Hub's layout:
    what ``from_pretrained`` of ``transformers`` 4 and 5 and ``diffusers`` load)."""
    if family in DECODERS:
        return {"body": "model.", "head": ""}
    if family in ("clip", "siglip"):
        return {"body": "vision_model."}
    if family == "whisper":
        return {"body": "model.encoder."}       # WhisperForConditionalGeneration's
    return {"body": ""}


def source_of(family: str, name: str, arch: ir.TransformerArch | ir.UNetArch,
              prefixes: Mapping[str, str] | None = None) -> Source:
    """Where dtdsl's parameter ``name`` of a ``family`` module is stored (module
    docstring); ``prefixes``: the checkpoint's key prefixes (default: the Hub's).
    KeyError for a name the family has no tensor for."""
    pre = dict(hf_key_prefix(family))
    pre.update(prefixes or {})
    body = pre["body"]
    if family in DECODERS:
        if name == "tok_embeddings.weight":
            return Source(f"{body}embed_tokens.weight")
        if name == "norm.weight":
            return Source(f"{body}norm.weight")
        if name == "output.weight":
            if arch.tie_embeddings:
                return Source(f"{body}embed_tokens.weight")
            return Source(f"{pre.get('head', '')}lm_head.weight")
        m = _LAYER.fullmatch(name)
        table = {**_DECODER_LAYER, **_QK_NORM}
        # An MoE layer's feed-forward is its experts (``_moe_source``), not an MLP.
        experts = m is not None and arch.moe is not None and \
            arch.moe.is_moe_layer(int(m.group(1))) and m.group(2).startswith("mlp.")
        if m and m.group(2) in table and not experts:
            return Source(f"{body}layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}")
        return _moe_source(family, name, arch, body, fused=pre.get("experts") == "fused")
    if family in ("clip", "siglip"):
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in _VISION_LAYER:
            return Source(f"{body}encoder.layers.{m.group(1)}.{_VISION_LAYER[m.group(2)]}."
                          f"{m.group(3)}")
        head, _, attr = name.partition(".")
        if head in _VISION_ENDS:
            key = f"{body}{_VISION_ENDS[head]}" + (f".{attr}" if attr else "")
            if name == "patch_embed.weight":
                c, p = arch.in_channels or 3, arch.patch or 1
                return Source(key, shape=(arch.hidden, c, p, p))
            return Source(key)
        raise KeyError(name)
    if family == "whisper":
        return _whisper_source(name, body)
    return _unet_source(name, arch, body)


def _moe_source(family: str, name: str, arch: ir.TransformerArch, body: str, *,
                fused: bool) -> Source:
    """Where an MoE layer's parameter ``name`` is stored: the Hub's per-expert tensors
    (``models.moe.hf_moe_keys``; ``stack``), or with ``fused`` transformers 5's stacked
    ``mlp.experts.gate_up_proj [E, 2 ffn, hidden]`` (gate rows, then up) and
    ``mlp.experts.down_proj`` (``save_pretrained(save_original_format=False)``)."""
    from dtdsl.models.moe import HF_MOE_FAMILIES, hf_moe_keys, moe_config

    m = _MOE_PARAM.fullmatch(name)
    if m is None or family not in HF_MOE_FAMILIES or arch.moe is None or \
            not arch.moe.is_moe_layer(int(m.group(1))):
        raise KeyError(name)
    layer, mine = f"{body}layers.{m.group(1)}.", m.group(2)
    keys = hf_moe_keys(family, moe_config(arch))
    if mine not in keys:
        raise KeyError(name)
    theirs = keys[mine]
    if fused:
        # transformers 5 names every family's block ``mlp`` (Mixtral's Hub name differs).
        block = HF_MOE_FAMILIES[family][0]
        if mine in ("w1", "w3"):
            f = arch.moe.ffn
            return Source(f"{layer}mlp.experts.gate_up_proj",
                          rows=(0, f) if mine == "w1" else (f, 2 * f), axis=1)
        if mine == "w2":
            return Source(f"{layer}mlp.experts.down_proj")
        return Source(f"{layer}mlp.{theirs[0][len(block):]}")
    if mine in ("w1", "w3", "w2"):
        return Source(layer + theirs[0], stack=tuple(layer + k for k in theirs))
    return Source(layer + theirs[0])


def _whisper_source(name: str, body: str) -> Source:
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _WHISPER_LAYER:
        return Source(f"{body}layers.{m.group(1)}.{_WHISPER_LAYER[m.group(2)]}.{m.group(3)}")
    owner, _, attr = name.rpartition(".")
    if owner in _WHISPER_ENDS and attr in ("weight", "bias"):
        return Source(f"{body}{_WHISPER_ENDS[owner]}.{attr}")
    raise KeyError(name)


def _unet_source(name: str, arch: ir.UNetArch, body: str) -> Source:
    parts = name.split(".")
    if "ff" in parts:
        i = parts.index("ff")
        stem = ".".join(parts[:i])
        which, attr = parts[i + 1], parts[-1]
        if which == "out":
            return Source(f"{body}{stem}.ff.net.2.{attr}")
        # value: the fused projection's first half of rows, gate: its second half.
        ch = _unet_channels(arch, parts)
        inner = 4 * ch
        rows = (0, inner) if which == "value" else (inner, 2 * inner)
        return Source(f"{body}{stem}.ff.net.0.proj.{attr}", rows=rows)
    for i, part in enumerate(parts):
        if part in ("attn1", "attn2") and i + 1 < len(parts) and parts[i + 1] in _UNET_ATTN:
            parts = parts[:i + 1] + _UNET_ATTN[parts[i + 1]].split(".") + parts[i + 2:]
            return Source(body + ".".join(parts))
    if len(parts) >= 2 and parts[-2] in ("proj_in", "proj_out") and parts[-1] == "weight" \
            and not arch.linear_proj:
        ch = _unet_channels(arch, parts)
        return Source(body + name, shape=(ch, ch, 1, 1))
    return Source(body + name)


def _unet_channels(arch: ir.UNetArch, parts: Sequence[str]) -> int:
    """The channels of the U-Net block a parameter name sits in."""
    levels = len(arch.mult)
    if parts[0] == "down_blocks":
        return arch.level_channels[int(parts[1])]
    if parts[0] == "up_blocks":
        return arch.level_channels[levels - 1 - int(parts[1])]
    return arch.level_channels[-1]       # the middle block


# ---- reading ---------------------------------------------------------------------------

# safetensors' element types and their widths in bits (the format's own list).
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
               "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
               "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
               "U64": 64}
# What a parameter may be read from: floating point, converted to the parameter's dtype.
# Anything else holds numbers that mean something only with what the file does not say
# (an integer's or FP8's scale, a packing): converted, they would train garbage.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER_BYTES = 100_000_000       # safetensors' own limit
_MAX_INDEX_BYTES = 64 << 20           # an index lists each key once: ~100 bytes a tensor
_MAX_DIMS = 64
QUANTISED_HINT = ("dtdsl trains floating-point weights (F32, F16, BF16, F64): dequantise "
                  "the model and save it in bf16 or fp16 with transformers "
                  "(from_pretrained, then .to(torch.bfloat16).save_pretrained(DIR)), and "
                  "point pretrained at that")


class WeightsFileError(HFError):
    """A safetensors file (or its index) that cannot be read as it claims: damaged, its
    header lying about what it holds, or a parameter stored in a type dtdsl cannot train
    (DT316). Never retried: the file says the same next time."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header, checked against its file: ``dtype`` (the
    format's name, F32 ...), ``shape``, and its bytes ``[begin, end)`` of the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:80]!r} twice")
        out[key] = value
    return out


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of safetensors ``file``, its header checked against the file (only
    the header is read): a JSON object of tensors, each a known dtype, a shape and
    ``data_offsets`` whose span is the shape's bytes, the spans tiling the data that
    follows the header exactly (no overlap, no gap, nothing past the end: what
    ``safe_open`` demands, checked here so that no rank meets it). WeightsFileError
    naming the file and what is wrong."""
    with open_regular(file, error=WeightsFileError) as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if size < 8:
            raise WeightsFileError(f"{file} is truncated: {size} bytes, not even the 8 "
                                   "that give its header's length")
        if length > _MAX_HEADER_BYTES:
            raise WeightsFileError(f"{file} is not a safetensors file: it starts with a "
                                   f"header length of {length} bytes (the format's limit "
                                   f"is {_MAX_HEADER_BYTES})")
        if length > size - 8:
            raise WeightsFileError(f"{file} is truncated: its header is {length} bytes and "
                                   f"only {size - 8} follow")
        raw = f.read(length)
    if len(raw) != length:
        raise WeightsFileError(f"{file} changed while it was read")
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise WeightsFileError(f"{file} is not a safetensors file: its header is not a JSON "
                               f"object ({str(err)[:100]})") from None
    if not isinstance(header, dict):
        raise WeightsFileError(f"{file} is not a safetensors file: its header is a JSON "
                               f"{type(header).__name__}, not an object of tensors")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WeightsFileError(f"{file}: its header's __metadata__ is not an object of "
                               "strings")
    if len(header) > _MAX_HEADER_KEYS:
        raise WeightsFileError(f"{file} lists {len(header)} tensors")
    tensors = {key: _tensor_info(file, key, entry) for key, entry in header.items()}
    _check_layout(file, tensors, size - 8 - length)
    return tensors


def _tensor_info(file: Path, key: str, entry: Any) -> TensorInfo:
    where = f"{file}: tensor {key[:120]!r}"
    if not isinstance(entry, dict):
        raise WeightsFileError(f"{where} is described by {shown(entry)}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise WeightsFileError(f"{where} has dtype {shown(dtype)}, which safetensors does not "
                               "define")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(map(count, shape)):
        raise WeightsFileError(f"{where} has shape {shown(shape)}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(count, offsets)) \
            or offsets[0] > offsets[1]:
        raise WeightsFileError(f"{where} has data_offsets {shown(offsets)}, not [begin, end]")
    info = TensorInfo(dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])
    bits = info.numel * _DTYPE_BITS[dtype]
    if bits != 8 * (info.end - info.begin):
        size = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits"
        raise WeightsFileError(
            f"{where}: its header lies: shape {shown(shape, 80, typed=False)} of {dtype} is "
            f"{size}, and its data_offsets [{info.begin}, {info.end}] span "
            f"{info.end - info.begin} bytes")
    return info


def _check_layout(file: Path, tensors: Mapping[str, TensorInfo], data_bytes: int) -> None:
    """The tensors' spans tile the ``data_bytes`` after the header, as safetensors
    requires: each begins where the one before it ends, the last at the file's end."""
    spans = sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end))
    last = max(spans, key=lambda kv: kv[1].end, default=None)
    if last is not None and last[1].end > data_bytes:
        raise WeightsFileError(
            f"{file} is truncated, or its header lies: tensor {last[0][:120]!r} ends at "
            f"byte {last[1].end} of the data, and the file holds {data_bytes} bytes of data")
    at, before = 0, None
    for key, info in spans:
        if info.begin < at:
            raise WeightsFileError(f"{file}: its header lies: tensors {before!r} and "
                                   f"{key[:120]!r} overlap (bytes {info.begin}..{at} of the "
                                   "data)")
        if info.begin > at:
            raise WeightsFileError(f"{file}: its header lies: bytes {at}..{info.begin} of the "
                                   f"data, before tensor {key[:120]!r}, belong to no tensor")
        at, before = info.end, key[:120]
    if at != data_bytes:
        raise WeightsFileError(f"{file}: {data_bytes - at} bytes after its last tensor "
                               "belong to none (not a safetensors file as written)")


def _shard_path(directory: Path, index: Path, name: Any) -> Path:
    """The file an index names, by a name that stays inside its directory: relative, no
    ``..`` (HFError, DT312, otherwise). The file may be a symlink to anywhere (a Hub
    cache's ``snapshots/<rev>/`` links every file into ``../../blobs``): the directory's
    owner made it; a name in a downloaded index is not theirs."""
    if not isinstance(name, str) or not name or len(name) > 4096 or "\0" in name:
        raise WeightsFileError(f"{index} names a file as {shown(name)}, not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise HFError(f"{index} points outside its directory: {name!r}",
                      hint="an index names its shards by their names in its folder")
    return directory / pure


def _regular(path: Path, index: Path) -> None:
    """``path`` (through symlinks) is a regular file: HFError when missing, a
    WeightsFileError when it is a FIFO, a device or a folder."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        link = f" (a symlink to {os.readlink(path)}, which is missing)" \
            if os.path.islink(path) else ""
        raise HFError(f"{index.name} lists {path.name}, which is missing{link}",
                      hint="copy every shard of the checkpoint") from None
    except OSError as err:
        raise WeightsFileError(f"cannot read {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        raise WeightsFileError(f"{path} is not a regular file")


class Checkpoint:
    """The safetensors tensors of a Hugging Face directory (module docstring): headers are
    read once (and checked: ``read_header``), each block with its file opened for that
    read. A context manager too."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files: dict[str, Path] = {}          # key -> file
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._index_file: Path | None = None
        self.bytes_read = 0
        self.largest_read = 0
        self._index()

    def _index(self) -> None:
        """Which file holds each tensor. The libraries' own names win (``model.safetensors``
        and ``diffusion_pytorch_model.safetensors``, and their ``.index.json``), as their
        ``from_pretrained`` picks them: a Hub directory often holds a variant beside them
        (``...fp16.safetensors``) or another format's file (Mistral's
        ``consolidated.safetensors``). Otherwise the one index, or the one file, there is."""
        # from_pretrained's order: transformers takes the single file before the sharded
        # index, diffusers the index before the single file.
        model, unet = WEIGHT_FILES["transformers"], WEIGHT_FILES["diffusers"]
        standard = [self.path / model, self.path / f"{model}.index.json",
                    self.path / f"{unet}.index.json", self.path / unet]
        chosen = next((p for p in standard if p.is_file()), None)
        if chosen is None:
            indexes = sorted(self.path.glob("*.safetensors.index.json"))
            files = sorted(self.path.glob("*.safetensors"))
            candidates = indexes or files
            if len(candidates) > 1 and not indexes:
                # Unindexed shards of one checkpoint: every key in exactly one file.
                for file in files:
                    self._add_file(file)
                return
            if len(candidates) > 1:
                raise HFError(f"{self.path} holds {len(candidates)} safetensors indexes "
                              f"({', '.join(p.name for p in candidates[:3])}); which "
                              "checkpoint to read is ambiguous",
                              hint="keep one, or name it model.safetensors.index.json")
            if not candidates:
                others = sorted(p.name for p in self.path.iterdir()
                                if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5",
                                                ".msgpack"))
                raise HFError(f"{self.path} has no safetensors weights" +
                              (f" (it has {', '.join(others[:3])})" if others else ""),
                              hint="dtdsl reads *.safetensors; save the model with "
                              "save_pretrained(..., safe_serialization=True)")
            chosen = candidates[0]
        if chosen.name.endswith(".index.json"):
            self._add_index(chosen)
        else:
            self._add_file(chosen)

    def _add_index(self, index: Path) -> None:
        data, _ = read_json(index, "safetensors index", limit=_MAX_INDEX_BYTES,
                            error=WeightsFileError)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsFileError(f"{index} is not a safetensors index: its weight_map is "
                                   f"{shown(weight_map)}, not an object")
        if len(weight_map) > _MAX_HEADER_KEYS:
            raise WeightsFileError(f"{index} lists {len(weight_map)} tensors")
        self._index_file = index
        files: dict[str, Path] = {}
        for key, name in weight_map.items():
            path = files.get(name) if isinstance(name, str) else None
            if path is None:
                path = files[name] = _shard_path(self.path, index, name)
            self._files[key] = path
        for file in sorted(set(files.values())):
            _regular(file, index)

    def _add_file(self, file: Path) -> None:
        for key in self._header(file):
            if key in self._files:
                raise HFError(f"tensor {key!r} is in both {self._files[key].name} and "
                              f"{file.name}")
            self._files[key] = file

    def _header(self, file: Path) -> dict[str, TensorInfo]:
        """The file's tensors, its header checked (``read_header``), read once."""
        if file not in self._headers:
            self._headers[file] = read_header(file)
        return self._headers[file]

    def verify(self) -> None:
        """Read and check every file's header (nothing else is read), and that each file
        holds the tensors the index puts there: what ``dtc check`` and a launch's
        preflight do, so that a run never meets a damaged file. WeightsFileError."""
        for file in sorted(set(self._files.values())):
            self._header(file)
        for key, file in self._files.items():
            if key not in self._headers[file]:
                raise WeightsFileError(f"{self._index_file or file} puts tensor {key!r} in "
                                       f"{file.name}, which does not hold it")

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads; here for symmetry with ``with``."""

    def keys(self) -> list[str]:
        return sorted(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def tensor(self, key: str) -> TensorInfo:
        """What the header says of tensor ``key`` (its file's header checked)."""
        try:
            file = self._files[key]
        except KeyError:
            raise HFError(f"the checkpoint in {self.path} has no tensor {key!r}") from None
        info = self._header(file).get(key)
        if info is None:
            raise WeightsFileError(f"{file.name} does not hold {key!r}, which its index puts "
                                   "there")
        return info

    def numel(self) -> int:
        """The numbers every file holds, together (after ``verify``)."""
        return sum(t.numel for header in self._headers.values() for t in header.values())

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensor(key).shape

    def dtype(self, key: str) -> torch.dtype:
        name = self.tensor(key).dtype
        if name not in _DTYPES:
            raise WeightsFileError(f"tensor {key!r} is stored as {name}, which dtdsl does "
                                   "not read", hint=QUANTISED_HINT)
        return _DTYPES[name]

    def dtype_problem(self, key: str) -> str | None:
        """Why tensor ``key`` cannot fill a parameter (None: it can, as floating point
        converted to the parameter's dtype)."""
        name = self.tensor(key).dtype
        if name in FLOAT_DTYPES:
            return None
        kind = ("an 8-bit float (FP8)" if name.startswith("F8") else
                "a 4- or 6-bit float" if name.startswith(("F4", "F6")) else
                "a bool" if name == "BOOL" else "a complex number" if name == "C64" else
                "an integer")
        scale = next((k for k in (f"{key}_scale_inv", f"{key}_scale") if k in self), None)
        scaled = f", with the scale tensor {scale!r} that dtdsl does not apply" if scale \
            else ""
        return f"tensor {key!r} is stored as {name} ({kind}{scaled}): a quantised checkpoint"

    def prefix_for(self, suffix: str, default: str) -> str:
        """The prefix before ``suffix`` of the one key that ends in it (``model.`` for
        ``embed_tokens.weight``); ``default`` when no key does. HFError when several do."""
        found = sorted({k[:-len(suffix)] for k in self._files if k.endswith(suffix)
                        and (len(k) == len(suffix) or k[-len(suffix) - 1] == ".")})
        if not found:
            return default
        if len(found) > 1:
            raise HFError(f"the checkpoint has {len(found)} tensors named *{suffix} "
                          f"({', '.join(p + suffix for p in found[:3])}); which model to read "
                          "is ambiguous")
        return found[0]

    def read(self, source: Source, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The block of dtdsl shape ``shape`` at ``offsets`` (one per dimension of the dtdsl
        tensor) of the tensor ``source`` names, as stored (its dtype). A file that cannot
        be read (changed since its header was checked) is a WeightsFileError, one line."""
        if source.stack:
            first = int(offsets[0])
            keys = source.stack[first:first + int(shape[0])]
            return torch.stack([self.read(Source(k), offsets[1:], shape[1:]) for k in keys])
        stored = self.shape(source.key)
        rows = source.rows
        view = source.shape
        if view is not None and tuple(stored) != tuple(view):
            raise HFError(f"tensor {source.key!r} has shape {list(stored)}, not "
                          f"{list(view)}")
        base = rows[0] if rows else 0
        from safetensors import SafetensorError, safe_open

        file = self._files[source.key]
        # Opened for this read only: the file's pages the slice touched leave the process
        # with the mapping, so a rank never holds more of a checkpoint than one block.
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                block = self._slice(source.key, handle.get_slice(source.key), stored, view,
                                    base, source.axis, offsets, shape)
        except (SafetensorError, OSError) as err:
            raise WeightsFileError(f"{file} cannot be read: {str(err)[:200]}",
                                   hint="it changed since it was checked; compile again, "
                                   "or restore it") from None
        nbytes = block.numel() * block.element_size()
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)
        return block

    @staticmethod
    def _slice(key: str, piece: Any, stored: Sequence[int], view: Sequence[int] | None,
               base: int, axis: int, offsets: Sequence[int], shape: Sequence[int]
               ) -> torch.Tensor:
        if not shape:                                  # a scalar
            block = piece[:] if stored else piece[...]
        elif view is not None:
            # Regrouped trailing dimensions: read whole rows, then cut the rest.
            r0 = base + int(offsets[0])
            block = piece[r0:r0 + int(shape[0])]
            block = block.reshape(int(shape[0]), -1)
            tail = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets[1:], shape[1:],
                                                                      strict=True))
            block = block[(slice(None), *tail)]
        else:
            if len(stored) != len(shape):
                raise HFError(f"tensor {key!r} has {len(stored)} dimensions, not "
                              f"{len(shape)}")
            index = [slice(int(o) + (base if d == axis else 0),
                           int(o) + (base if d == axis else 0) + int(n))
                     for d, (o, n) in enumerate(zip(offsets, shape, strict=True))]
            block = piece[tuple(index)]
        return block


# ---- writing ---------------------------------------------------------------------------

def _shard_name(stem: str, i: int, n: int) -> str:
    base, ext = stem.rsplit(".", 1)
    return f"{base}-{i:05d}-of-{n:05d}.{ext}"


def write_checkpoint(directory: str | Path, tensors: Iterable[HFTensor], *, library: str,
                     max_shard_bytes: int = 5 << 30,
                     metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Write ``tensors`` (each made when its shard is written, so at most one shard is in
    memory) into ``directory`` as ``library``
    (``transformers`` or ``diffusers``) names its safetensors, sharded at
    ``max_shard_bytes`` with an index when there is more than one shard. Returns the
    files written.

    ``directory`` is a new folder being filled (``save_hf`` and ``dtc export`` write into
    one and swap it in whole, ``dtdsl.outdir``): FileExistsError for a file that is
    already there, which is never written over."""
    from safetensors.torch import save_file

    stem = WEIGHT_FILES[library]
    items = list(tensors)
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [stem] if len(shards) == 1 else \
        [_shard_name(stem, i, len(shards)) for i in range(1, len(shards) + 1)]
    if len(shards) > 1:
        names.append(f"{stem}.index.json")
    there = [n for n in names if os.path.lexists(directory / n)]
    if there:
        raise FileExistsError(f"{directory / there[0]} exists; write_checkpoint fills a new "
                              "folder and never writes over a file")
    weight_map = {}
    meta = {"format": "pt", **(metadata or {})}
    for name, shard in zip(names, shards, strict=False):
        data = {t.key: t.make().contiguous() for t in shard}
        save_file(data, str(directory / name), metadata=meta)
        os.chmod(directory / name, 0o644)       # safetensors writes 0600; config.json is 0644
        del data
        weight_map.update({t.key: name for t in shard})
    if len(shards) > 1:
        with open(directory / names[-1], "x", encoding="utf-8") as f:
            f.write(json.dumps({"metadata": {"total_size": sum(i.nbytes for i in items)},
                                "weight_map": weight_map}, indent=2, sort_keys=True))
    return [directory / name for name in names]


@dataclass(frozen=True)
class HFTensor:
    """One tensor to write: its key, size, and how to make it from dtdsl's tensors."""

    key: str
    nbytes: int
    make: Callable[[], torch.Tensor]


def _stacked(name: str, src: Source, shape: tuple[tuple[int, ...], torch.dtype],
             get: Callable[[str], torch.Tensor], dtype: torch.dtype | None
             ) -> list[HFTensor]:
    """One tensor per key of a stacked ``src``: slice ``i`` of dtdsl's ``name``. The full
    tensor is fetched once for all its slices (they are written one after another)."""
    dims, stored = shape
    each = int(torch.Size(dims[1:]).numel()) * (dtype or stored).itemsize
    held: dict[str, torch.Tensor] = {}

    def make(i: int) -> torch.Tensor:
        if name not in held:
            held.clear()
            full = get(name)
            held[name] = full.to(dtype) if dtype is not None else full
        return held[name][i].clone()

    return [HFTensor(key=key, nbytes=each, make=lambda i=i: make(i))
            for i, key in enumerate(src.stack)]


def hf_tensors(family: str, arch: ir.TransformerArch | ir.UNetArch,
               shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
               get: Callable[[str], torch.Tensor], *, dtype: torch.dtype | None = None
               ) -> list[HFTensor]:
    """The Hugging Face tensors of a module whose parameters are ``shapes`` (``{name:
    (shape, dtype)}``), each made on demand from ``get(name)`` (the full dtdsl tensor): the
    GEGLU halves joined, kernels given their stored shape, cast to ``dtype`` if given."""
    groups: dict[str, list[tuple[str, Source]]] = {}
    out = []
    for name in shapes:
        src = source_of(family, name, arch)
        if src.stack:
            out += _stacked(name, src, shapes[name], get, dtype)
        else:
            groups.setdefault(src.key, []).append((name, src))
    for key, members in groups.items():
        members.sort(key=lambda m: m[1].rows or (0, 0))
        if len(members) > 1 and all(m[1].rows is None for m in members):
            members = members[:1]       # tied copies of one tensor (an LM head): write one
        numel = sum(int(torch.Size(shapes[name][0]).numel()) for name, _ in members)
        item = (dtype or shapes[members[0][0]][1]).itemsize

        def make(members=members) -> torch.Tensor:
            parts = []
            for name, src in members:
                t = get(name)
                if dtype is not None:
                    t = t.to(dtype)
                parts.append(t.reshape(src.shape) if src.shape is not None else t)
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

        if len(members) > 1:
            ranges = [m[1].rows for m in members]
            if any(r is None for r in ranges) or ranges[0][0] != 0 or any(
                    a[1] != b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
                raise AssertionError(f"{key}: dtdsl tensors {[m[0] for m in members]} do not "
                                     "tile it")
        out.append(HFTensor(key=key, nbytes=numel * item, make=make))
    return out
