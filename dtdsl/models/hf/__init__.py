"""Hugging Face models in and out: configs (``config``), safetensors checkpoints
(``weights``), and the functions people call.

- ``load_hf(DIR)`` returns dtdsl's module for a Hugging Face directory, its weights loaded:
  a ``Backbone`` (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral: called on
  token ids it returns the logits), an
  ``Encoder`` (CLIP or SigLIP vision: called on pixel values it returns what the
  Hugging Face model returns as ``last_hidden_state``; Whisper's encoder: called on
  ``input_features [B, mel_bins, 3000]``, ``WhisperEncoder``'s) or a ``UNet`` (SD 1.x/2.x: called on
  ``(latents, timesteps, context)`` it returns the noise or velocity prediction).
- ``save_hf(module, DIR)`` writes a dtdsl module as a Hugging Face directory (config and
  safetensors) that ``transformers`` / ``diffusers`` ``from_pretrained`` load, with a
  record of its files (``dtdsl-manifest.json``); it replaces only a folder it wrote.
- ``load_weights(module, ...)`` fills a materialised module, or one rank's shards of it
  (DTensors: TP and FSDP2 shards), from a checkpoint: each tensor's block is read from its
  file and nothing else (the runtime's loader, ``train.stage``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtdsl.ir import program as ir
from dtdsl.models.hf.config import (
    HFError,
    HFModel,
    config_for,
    native_family,
    read_hf,
    scheduler_config_for,
)
from dtdsl.models.hf.weights import (
    DECODERS,
    QUANTISED_HINT,
    Checkpoint,
    HFTensor,
    Source,
    WeightsFileError,
    hf_key_prefix,
    hf_tensors,
    source_of,
    write_checkpoint,
)
from dtdsl.outdir import OutputError, replace_folder

__all__ = [
    "Checkpoint", "HFError", "HFModel", "LoadReport", "WeightsFileError", "check_weights",
    "checkpoint_prefixes", "export_module", "load_hf", "load_weights", "pretrained_problems",
    "read_hf", "save_hf",
]

_LIBRARY = {"unet": "diffusers"}


def checkpoint_prefixes(family: str, checkpoint: Checkpoint) -> dict[str, str]:
    """The key prefixes this checkpoint uses for a model of ``family`` (the Hub's when it
    holds nothing to tell by)."""
    default = hf_key_prefix(family)
    if family in DECODERS:
        out = {"body": checkpoint.prefix_for("embed_tokens.weight", default["body"]),
               "head": checkpoint.prefix_for("lm_head.weight", default["head"])}
        # transformers 5's own layout of the experts (save_original_format=False).
        if any(k.endswith(".mlp.experts.gate_up_proj") for k in checkpoint.keys()):
            out["experts"] = "fused"
        return out
    if family in ("clip", "siglip"):
        return {"body": checkpoint.prefix_for("embeddings.patch_embedding.weight",
                                              default["body"])}
    if family == "whisper":
        # Whisper's own (model.encoder.), WhisperModel's (encoder.), WhisperEncoder's ().
        return {"body": checkpoint.prefix_for("conv1.weight", default["body"])}
    return default


def _positions_problem(checkpoint: Checkpoint, arch: ir.TransformerArch,
                       prefixes: Mapping[str, str]) -> str | None:
    """Why a Whisper checkpoint's ``embed_positions`` is not the fixed sinusoids dtdsl's
    stem computes (``models.audio``; None: it is, to its dtype's rounding, or it is not
    stored, and transformers makes the same). One tensor of ``max_source_positions x
    d_model`` is read, a block of rows at a time."""
    from dtdsl.models.audio import whisper_positions

    key = f"{prefixes['body']}embed_positions.weight"
    if key not in checkpoint:
        return None
    want = (arch.max_source_positions or 0, arch.hidden)
    if checkpoint.shape(key) != want:
        return f"tensor {key!r} has shape {list(checkpoint.shape(key))}, not {list(want)}"
    if (problem := checkpoint.dtype_problem(key)) is not None:
        return problem
    off, rows = 0.0, max(1, (1 << 22) // max(1, want[1]))     # 16 MiB of float32 a block
    for start in range(0, want[0], rows):
        n = min(rows, want[0] - start)
        stored = checkpoint.read(Source(key), (start, 0), (n, want[1])).float()
        off = max(off, (stored - whisper_positions(n, want[1], start=start)).abs().max().item())
    if off > max(1e-4, 4 * torch.finfo(checkpoint.dtype(key)).eps):
        return (f"tensor {key!r} is not Whisper's fixed sinusoidal positions (off by "
                f"{off:.3g}); dtdsl computes those and reads no others")
    return None


def _stored_shape(checkpoint: Checkpoint, source: Source) -> tuple[int, ...]:
    """What the dtdsl tensor's full shape is, as the checkpoint stores it."""
    if source.stack:
        shapes = {checkpoint.shape(k) for k in source.stack}
        if len(shapes) > 1:
            raise HFError(f"tensors {source.stack[0]!r} ... {source.stack[-1]!r} have "
                          f"shapes {sorted(list(s) for s in shapes)[:2]}: one block's "
                          "experts differ in shape")
        return (len(source.stack), *shapes.pop())
    shape = checkpoint.shape(source.key)
    if source.rows is not None:
        axis = source.axis
        if len(shape) <= axis or shape[axis] < source.rows[1]:
            raise HFError(f"tensor {source.key!r} has shape {list(shape)}, too small for "
                          f"rows {source.rows[0]}..{source.rows[1]} of dimension {axis}")
        shape = (*shape[:axis], source.rows[1] - source.rows[0], *shape[axis + 1:])
    if source.shape is not None:
        if shape != source.shape:
            raise HFError(f"tensor {source.key!r} has shape {list(shape)}, not "
                          f"{list(source.shape)}")
        shape = (shape[0], int(torch.Size(shape[1:]).numel())) if len(shape) > 1 else shape
    return tuple(shape)


def check_weights(module: nn.Module, family: str, arch: ir.TransformerArch | ir.UNetArch,
                  checkpoint: Checkpoint) -> list[str]:
    """What keeps ``checkpoint`` from filling ``module`` (any device, meta included):
    tensors it lacks and shapes that differ, one message each (empty: it fits).
    WeightsFileError when a tensor it would read is not floating point (a quantised
    checkpoint: converted, its numbers would be garbage)."""
    prefixes = checkpoint_prefixes(family, checkpoint)
    problems: list[str] = []
    quantised: list[str] = []
    for name, param in module.named_parameters():
        try:
            source = source_of(family, name, arch, prefixes)
        except KeyError:
            problems.append(f"dtdsl's parameter {name} has no counterpart in a {family} "
                            "checkpoint")
            continue
        missing = [k for k in source.keys if k not in checkpoint]
        if missing:
            problems.append(f"no tensor {missing[0]!r} (for {name})")
            continue
        try:
            stored = _stored_shape(checkpoint, source)
        except HFError as err:
            problems.append(err.message)
            continue
        want = tuple(param.shape)
        if stored != want:
            problems.append(f"tensor {source.key!r} has shape {list(stored)}, but {name} "
                            f"needs {list(want)}")
        else:
            quantised += [p for k in source.keys
                          if (p := checkpoint.dtype_problem(k)) is not None][:1]
    if quantised:
        raise WeightsFileError(quantised[0] + (f" (and {len(quantised) - 1} more tensors)"
                                               if len(quantised) > 1 else ""),
                               hint=QUANTISED_HINT)
    if family == "whisper" and (problem := _positions_problem(checkpoint, arch, prefixes)):
        problems.append(problem)
    return problems


def pretrained_problems(model: HFModel, role: str, arch: ir.TransformerArch | ir.UNetArch
                        ) -> list[str]:
    """What keeps the weights of ``model`` (``read_hf``'s) from filling dtdsl's module
    of ``arch`` (its ``source`` family), from the safetensors headers alone (what ``dtc
    check`` and a launch's preflight run): one message per missing or misshapen tensor
    (empty: they fit). WeightsFileError (DT316) for a quantised model or a damaged or
    lying file; HFError for a directory that cannot be read.

    The work is bounded by the checkpoint, whatever the config claims: a module that
    needs more than twice the numbers the files hold is refused before it is built."""
    from dtdsl.cost.flops import module_params
    from dtdsl.models.build import build_arch
    from dtdsl.source import Span

    if model.quantization is not None:
        raise WeightsFileError(f"{model.weights_dir / 'config.json'} declares a "
                               f"quantization_config ({model.quantization}): its weights "
                               "are quantised", hint=QUANTISED_HINT)
    family = model.source.family
    with Checkpoint(model.weights_dir) as checkpoint:
        checkpoint.verify()
        need = int(module_params(ir.Module(name="m", role=role, modality=None, arch=arch,
                                           span=Span.point(1, 1))))
        have = checkpoint.numel()
        # Far too few numbers (a config that claims 1024 layers over a checkpoint of 4):
        # said without building the module, whose size the config alone sets. Otherwise
        # the module is built (on meta) and each missing tensor named.
        if need > 2 * have:
            return [f"its tensors hold {have} numbers, less than half of the {need} "
                    f"parameters of this {family} architecture"]
        with torch.device("meta"):
            module = build_arch(role, arch)
        return check_weights(module, family, arch, checkpoint)


class LoadReport:
    """What ``load_weights`` read: bytes, the largest single read, tensors filled."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.largest_read = 0
        self.tensors = 0


@torch.no_grad()
def load_weights(module: nn.Module, family: str, arch: ir.TransformerArch | ir.UNetArch,
                 checkpoint: Checkpoint, *, skip: set[int] | None = None,
                 prefix: str = "") -> LoadReport:
    """Fill every parameter of ``module`` (materialised: plain tensors or DTensors whose
    local block is contiguous in the full tensor) with its block of the checkpoint, cast
    to the parameter's dtype; ``prefix``: ``module``'s name inside the unit; parameters
    whose ``id`` is in ``skip`` are left. HFError for a tensor the checkpoint lacks or
    holds in another shape; WeightsFileError (one line, never a safetensors traceback)
    for a damaged file or a tensor that is not floating point."""
    from dtdsl.models.init import local_block

    prefixes = checkpoint_prefixes(family, checkpoint)
    if family == "whisper" and any("patch_embed." in n for n, _ in module.named_parameters()) \
            and (problem := _positions_problem(checkpoint, arch, prefixes)):
        raise HFError(problem)
    report = LoadReport()
    seen: set[int] = set()
    before = checkpoint.bytes_read
    owners = {id(p): (owner, attr) for _, owner in module.named_modules()
              for attr, p in owner.named_parameters(recurse=False)}
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        if id(param) in seen or (skip is not None and id(param) in skip):
            continue
        seen.add(id(param))
        try:
            source = source_of(family, name, arch, prefixes)
        except KeyError:
            raise HFError(f"dtdsl's parameter {name} has no counterpart in a {family} "
                          "checkpoint") from None
        local, full_shape, offsets = local_block(param, *owners[id(param)])
        stored = _stored_shape(checkpoint, source)
        if stored != tuple(full_shape):
            raise HFError(f"tensor {source.key!r} has shape {list(stored)}, but {name} needs "
                          f"{list(full_shape)}")
        for key in source.keys:
            if (problem := checkpoint.dtype_problem(key)) is not None:
                raise WeightsFileError(problem, hint=QUANTISED_HINT)
        if local.numel() == 0:
            continue
        block = checkpoint.read(source, offsets, local.shape)
        local.copy_(block.reshape(local.shape))
        del block
        report.tensors += 1
    report.bytes_read = checkpoint.bytes_read - before
    report.largest_read = checkpoint.largest_read
    return report


def load_hf(path: str | Path, *, feature_layer: int | None = None,
            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
            ) -> nn.Module:
    """dtdsl's module for the Hugging Face model in ``path``, its weights loaded (module
    docstring); ``feature_layer``: read a vision tower up to that ``hidden_states`` index."""
    from dtdsl.models.build import build_arch, tie_weights

    model = read_hf(path, feature_layer=feature_layer)
    with torch.device("meta"):
        module = build_arch(model.role, model.arch)
    module.to_empty(device=device)
    module.to(dtype)
    tie_weights(module)
    if model.quantization is not None:
        raise WeightsFileError(f"{path} holds a quantised model ({model.quantization})",
                               hint=QUANTISED_HINT)
    with Checkpoint(model.weights_dir) as checkpoint:
        checkpoint.verify()
        load_weights(module, model.source.family, model.arch, checkpoint)
    module.hf_source = model.source
    module.hf_weights = str(model.weights_dir)     # save_hf completes a tower from them
    return module


def _write_configs(directory: Path, arch: Any, role: str, source: ir.HFSource | None,
                   layers: int | None = None, extra: Mapping[str, Any] | None = None) -> str:
    """Write ``config.json`` (and a U-Net's ``scheduler_config.json``); the library."""
    config = {**config_for(arch, role, source, layers=layers), **(extra or {})}
    files = {"config.json": config}
    if isinstance(arch, ir.UNetArch):
        files["scheduler_config.json"] = scheduler_config_for(arch, source)
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        with open(directory / name, "x", encoding="utf-8") as f:   # a new folder's
            f.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return "diffusers" if isinstance(arch, ir.UNetArch) else "transformers"


def _family(arch: Any, role: str, source: ir.HFSource | None) -> str:
    if source is not None:
        return source.family
    if isinstance(arch, ir.UNetArch):
        return "unet"
    if getattr(arch, "stem", None) == "whisper_conv":
        return "whisper"
    if role == "backbone":
        return native_family(arch)
    return "clip" if getattr(arch, "cls_token", False) else "siglip"


def _tower_rest(family: str, pretrained: str, have: set[str],
                dtype: torch.dtype | None) -> list[HFTensor]:
    """The tensors of a vision tower's checkpoint that dtdsl's module does not hold (the
    layers above its feature layer, CLIP's pooling norm, SigLIP's pooling head), under the
    key names ``write_checkpoint`` gives the tower, read from ``pretrained`` when written."""
    out = []
    with Checkpoint(pretrained) as ckpt:
        body = checkpoint_prefixes(family, ckpt)["body"]
        for key in ckpt.keys():
            out_key = hf_key_prefix(family)["body"] + key[len(body):]
            if not key.startswith(body) or out_key in have or key.endswith(".position_ids"):
                continue
            shape, stored = ckpt.shape(key), ckpt.dtype(key)

            def make(key: str = key, shape: tuple[int, ...] = shape) -> torch.Tensor:
                with Checkpoint(pretrained) as c:
                    t = c.read(Source(key), (0,) * len(shape), shape)
                return t.to(dtype) if dtype is not None else t

            out.append(HFTensor(out_key, int(torch.Size(shape).numel()) *
                                (dtype or stored).itemsize, make))
    return out


def _whisper_rest(arch: ir.TransformerArch, pretrained: str | None, have: set[str],
                  dtype: torch.dtype | None) -> list[HFTensor]:
    """What a Whisper directory holds besides dtdsl's encoder: the encoder's fixed
    positions, and (from the ``pretrained`` Whisper it started from, untrained) its
    decoder and head, under the Hub's keys (``model.decoder.``, ``proj_out.``)."""
    from dtdsl.models.audio import whisper_positions

    shape = (arch.max_source_positions or 0, arch.hidden)
    item = (dtype or torch.float32).itemsize
    out = [HFTensor("model.encoder.embed_positions.weight", shape[0] * shape[1] * item,
                    lambda: whisper_positions(*shape).to(dtype or torch.float32))]
    if pretrained is None:
        return out
    with Checkpoint(pretrained) as ckpt:
        body = checkpoint_prefixes("whisper", ckpt)["body"]
        if not body.endswith("encoder."):
            return out          # a WhisperEncoder's own checkpoint: nothing else there
        root = body[:-len("encoder.")]
        for key in ckpt.keys():
            out_key = "model." + key[len(root):] if key.startswith(root) else key
            if key.startswith(body) or out_key in have:
                continue
            stored_shape, stored = ckpt.shape(key), ckpt.dtype(key)

            def make(key: str = key, shape: tuple[int, ...] = stored_shape) -> torch.Tensor:
                with Checkpoint(pretrained) as c:
                    t = c.read(Source(key), (0,) * len(shape), shape)
                return t.to(dtype) if dtype is not None and t.is_floating_point() else t

            out.append(HFTensor(out_key, int(torch.Size(stored_shape).numel()) *
                                (dtype or stored).itemsize, make))
    return out


def _identity_norm(key: str, width: int, dtype: torch.dtype) -> list[HFTensor]:
    return [HFTensor(f"{key}.weight", width * dtype.itemsize,
                     lambda: torch.ones(width, dtype=dtype)),
            HFTensor(f"{key}.bias", width * dtype.itemsize,
                     lambda: torch.zeros(width, dtype=dtype))]


def export_module(directory: str | Path, *, arch: ir.TransformerArch | ir.UNetArch, role: str,
                  source: ir.HFSource | None, shapes: Mapping[str, tuple[tuple[int, ...],
                                                                       torch.dtype]],
                  get: Callable[[str], torch.Tensor], pretrained: str | None = None,
                  dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30
                  ) -> list[Path]:
    """Write a module as a Hugging Face directory from its parameters' ``shapes`` and a
    getter of each full tensor (``save_hf`` and ``dtc export`` share this), into
    ``directory``: a new or empty folder (HFError otherwise; ``save_hf`` replaces one).

    A Whisper encoder is written as a Whisper model, with the decoder of the ``pretrained``
    Whisper it started from (untrained; without one, ``from_pretrained`` of a whole Whisper
    initialises its decoder, and ``WhisperModel``'s encoder reads ours).
    A vision tower is written whole, so that ``from_pretrained`` initialises nothing: what
    dtdsl's module does not hold (the layers above a feature layer, CLIP's pooling norm,
    SigLIP's pooling head) comes from the ``pretrained`` weights it started from, untrained,
    and the config keeps their layer count; without them, a tower read below its top is
    written with its own layers, CLIP's pooling norm as the identity and SigLIP without its
    head."""
    directory = Path(directory)
    if directory.is_symlink() or (directory.exists() and any(directory.iterdir())):
        raise HFError(f"{directory} is not a new or empty folder; export_module never "
                      "writes over files (save_hf replaces a folder it wrote)")
    family = _family(arch, role, source)
    tensors = hf_tensors(family, arch, shapes, get, dtype=dtype)
    layers = None
    config_extra: dict[str, Any] = {}
    if role == "encoder" and family in ("clip", "siglip"):
        have = {t.key for t in tensors}
        body = hf_key_prefix(family)["body"]
        if pretrained is not None:
            tensors += _tower_rest(family, pretrained, have, dtype)
            if source is not None and source.feature_layer is not None:
                layers = source.source_layers
        keys = {t.key for t in tensors}
        if family == "clip" and f"{body}post_layernorm.weight" not in keys:
            width = arch.hidden
            tensors += _identity_norm(f"{body}post_layernorm", width, dtype or torch.float32)
        if family == "siglip" and not any(k.startswith(f"{body}head.") for k in keys):
            config_extra["vision_use_head"] = False
    if role == "encoder" and family == "whisper":
        tensors += _whisper_rest(arch, pretrained, {t.key for t in tensors}, dtype)
    library = _write_configs(directory, arch, role, source, layers=layers, extra=config_extra)
    return write_checkpoint(directory, tensors, library=library,
                            max_shard_bytes=max_shard_bytes)


def save_hf(module: nn.Module, path: str | Path, *, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Write ``module`` (built by ``dtdsl.models``, e.g. ``load_hf``) as a Hugging Face
    directory; ``dtype``: cast the weights (default: as they are). A vision tower from
    ``load_hf`` is completed from the weights it was loaded from (``export_module``).
    HFError when no Hugging Face model computes what the module computes.

    ``path`` is new or empty, or one ``save_hf`` wrote: it records its files with their
    sha256 (``dtdsl-manifest.json``) and replaces the folder only when everything there is
    listed and unchanged; anything else (someone's model, a file added, a symbolic link) is
    an HFError naming it, and nothing changes. The new folder is written beside ``path``
    and swapped in whole."""
    arch, role = getattr(module, "arch", None), getattr(module, "role", None)
    if arch is None or role is None:
        raise HFError(f"{type(module).__name__} was not built by dtdsl.models (it has no "
                      "architecture to write)")
    params = dict(module.named_parameters())
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
    path = Path(path)
    written: list[Path] = []

    def write(folder: Path) -> None:
        written.extend(export_module(
            folder, arch=arch, role=role, source=getattr(module, "hf_source", None),
            shapes=shapes, get=lambda n: params[n].detach().cpu(), dtype=dtype,
            pretrained=getattr(module, "hf_weights", None), max_shard_bytes=max_shard_bytes))

    try:
        replace_folder(path, write)
    except OutputError as err:
        raise HFError(str(err)) from None
    return [path / p.name for p in written]
