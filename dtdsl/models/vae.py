"""The encoder half of diffusers' ``AutoencoderKL``: what turns a generator's target
images into the latents its U-Net learns to denoise (SD 1.x/2.x, SDXL, SD3-style
``shift_factor``).

``VAEEncoder(config)`` is built from the folder's ``config.json`` (``VAEConfig.read``) with
diffusers' module names (``encoder.conv_in``, ``encoder.down_blocks.0.resnets.0.norm1``,
``encoder.mid_block.attentions.0.to_q``, ``quant_conv``, ...), so its weights load from
the folder's safetensors one to one (``load``; checkpoints with the old attention names
``query``/``key``/``value``/``proj_attn`` are read too). ``latents(pixels, eps)`` is
diffusers' ``(vae.encode(x).latent_dist.sample() - shift_factor) * scaling_factor`` with the
posterior's noise given: ``pixels`` in ``[-1, 1]``, ``eps`` of the latents' shape. It is
frozen: it runs under ``no_grad`` on the generator's ranks (``train.stage``), one copy per
rank, never in an optimizer or a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.errors import DtdslError

__all__ = ["VAEConfig", "VAEEncoder", "VAEError", "find_vae", "load_vae", "vae_problems"]


class VAEError(DtdslError, ValueError):
    """A VAE folder that cannot be used: the message says why."""


@dataclass(frozen=True)
class VAEConfig:
    path: str                           # the folder (config.json, safetensors)
    in_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    latent_channels: int
    norm_num_groups: int
    scaling_factor: float
    shift_factor: float
    mid_attention: bool
    quant_conv: bool

    @property
    def downscale(self) -> int:
        """Pixels per latent along a side."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def of(cls, arch: Any) -> VAEConfig:
        """The config of an ``ir.VAEArch``."""
        return cls(**{f: getattr(arch, f) for f in cls.__dataclass_fields__})

    def arch(self) -> Any:
        """This config as the ``ir.VAEArch`` a Program keeps."""
        from dtdsl.ir.program import VAEArch

        return VAEArch(**{f: getattr(self, f) for f in self.__dataclass_fields__})

    @classmethod
    def read(cls, folder: str | Path) -> VAEConfig:
        """The config of the AutoencoderKL in ``folder``: every value typed and bounded
        (``models.hf.fields``; diffusers' defaults for what it leaves out), VAEError
        naming the key otherwise."""
        from dtdsl.models.hf.fields import Fields, HFError, named, read_json

        folder = Path(folder).expanduser().resolve()
        file = folder / "config.json"
        if not file.exists():
            raise VAEError(f"{folder} has no config.json (a diffusers AutoencoderKL folder "
                           "has one)")
        try:
            cfg, _ = read_json(file, "VAE config")
        except HFError as err:
            raise VAEError(err.message) from None
        if cfg.get("_class_name") not in (None, "AutoencoderKL"):
            raise VAEError(f"{folder} holds a {named(cfg.get('_class_name'))} (its "
                           "_class_name), not an AutoencoderKL")
        f = Fields(cfg, defaults=_DEFAULTS, error=lambda m, hint=None: VAEError(
            f"{folder}: {m}"))
        channels = f.integers("block_out_channels", high=1 << 16, max_len=8)
        groups = f.integer("norm_num_groups", high=1 << 16)
        f.require(all(c % groups == 0 for c in channels), "norm_num_groups", groups,
                  f"a divisor of every block_out_channels {list(channels)} (GroupNorm)")
        blocks = f.texts("down_block_types", count=len(channels),
                         per=" (one per block_out_channels)") if f.has(
            "down_block_types") else ("DownEncoderBlock2D",) * len(channels)
        if any(b != "DownEncoderBlock2D" for b in blocks):
            raise VAEError(f"{folder}: down_block_types {list(blocks)} are not "
                           "DownEncoderBlock2D")
        if f.text("act_fn") != "silu":
            raise VAEError(f"{folder}: act_fn {named(cfg.get('act_fn'))} is not silu")
        return cls(path=str(folder), in_channels=f.integer("in_channels", high=64),
                   block_out_channels=channels,
                   layers_per_block=f.integer("layers_per_block", high=16),
                   latent_channels=f.integer("latent_channels", high=64),
                   norm_num_groups=groups,
                   scaling_factor=f.number("scaling_factor", gt=0),
                   shift_factor=f.number("shift_factor"),
                   mid_attention=f.flag("mid_block_add_attention"),
                   quant_conv=f.flag("use_quant_conv"))


# diffusers' AutoencoderKL defaults for the keys read here.
_DEFAULTS = {"in_channels": 3, "block_out_channels": [64], "layers_per_block": 1,
             "latent_channels": 4, "norm_num_groups": 32, "scaling_factor": 0.18215,
             "shift_factor": 0.0, "mid_block_add_attention": True, "use_quant_conv": True,
             "act_fn": "silu"}


def find_vae(generator_dir: str | Path) -> Path | None:
    """The ``vae`` folder of the pipeline a U-Net folder sits in, when there is one."""
    here = Path(generator_dir)
    for candidate in (here / "vae", here.parent / "vae"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


class _Resnet(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=1e-6)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=1e-6)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class _Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))      # diffusers' asymmetric padding


class _DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, groups: int, down: bool):
        super().__init__()
        self.resnets = nn.ModuleList([_Resnet(cin if i == 0 else cout, cout, groups)
                                      for i in range(layers)])
        self.downsamplers = nn.ModuleList([_Downsample(cout)]) if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in self.resnets:
            x = r(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class _Attention(nn.Module):
    """One head over all positions, group-normed, residual (the VAE's mid attention)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        q, k, v = self.to_q(t)[:, None], self.to_k(t)[:, None], self.to_v(t)[:, None]
        out = F.scaled_dot_product_attention(q, k, v)[:, 0]
        out = self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)
        return x + out


class _Mid(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([_Resnet(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([_Attention(channels, groups)]) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class _Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([
            _DownBlock(ch[max(i - 1, 0)], c, cfg.layers_per_block, g, i < len(ch) - 1)
            for i, c in enumerate(ch)])
        self.mid_block = _Mid(ch[-1], g, cfg.mid_attention)
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class VAEEncoder(nn.Module):
    """diffusers' ``AutoencoderKL`` encoder and ``quant_conv`` (module docstring)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = _Encoder(cfg)
        c = 2 * cfg.latent_channels
        self.quant_conv = nn.Conv2d(c, c, 1) if cfg.quant_conv else None

    def moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior's mean and log-variance of ``[B, 3, H, W]`` pixels in [-1, 1]."""
        h = self.encoder(pixels)
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    @torch.no_grad()
    def latents(self, pixels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """The diffusion model's latents: a posterior sample (noise ``eps``), shifted and
        scaled as the config says."""
        mean, logvar = self.moments(pixels.to(next(self.parameters()).dtype))
        z = mean + torch.exp(0.5 * logvar) * eps.to(mean.dtype)
        return ((z - self.cfg.shift_factor) * self.cfg.scaling_factor).float()


_OLD_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _keys(checkpoint: Any, want: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """The encoder's names (diffusers') -> the checkpoint's keys: the same, or the old
    attention names (``query``, ..., ``proj_attn``)."""
    out = {}
    for key in checkpoint.keys():
        name = key
        for old, new in _OLD_NAMES.items():
            name = name.replace(f".{old}.", f".{new}.")
        if name in want:
            out[name] = key
    return out


def _fits(stored: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A stored shape that fills ``want``: equal, or an old 1x1-conv attention kernel
    ``[o, i, 1, 1]`` for a linear ``[o, i]``."""
    return stored == want or (len(stored) == 4 and len(want) == 2 and stored[2:] == (1, 1)
                              and stored[:2] == want)


def _match(cfg: VAEConfig, checkpoint: Any) -> tuple[dict[str, str], list[str]]:
    """Which key fills each encoder tensor, and what does not fit (headers only);
    WeightsFileError for a tensor that is not floating point."""
    from dtdsl.models.hf.weights import QUANTISED_HINT, WeightsFileError

    with torch.device("meta"):
        module = VAEEncoder(cfg)
    want = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    keys = _keys(checkpoint, want)
    missing = sorted(set(want) - set(keys))
    problems = [f"it lacks {len(missing)} encoder tensors, e.g. {missing[0]}"] if missing \
        else []
    for name, key in keys.items():
        stored = checkpoint.shape(key)
        if not _fits(stored, want[name]):
            problems.append(f"{name} is {stored}, the config says {want[name]}")
        elif (problem := checkpoint.dtype_problem(key)) is not None:
            raise WeightsFileError(problem, hint=QUANTISED_HINT)
    return keys, problems


def vae_problems(cfg: VAEConfig) -> list[str]:
    """What keeps the folder's safetensors from filling the encoder, from their headers
    alone (every file's checked against the file): one message each, empty when they
    fit. WeightsFileError for a damaged file or a quantised tensor, HFError for a folder
    without safetensors."""
    from dtdsl.models.hf.weights import Checkpoint

    with Checkpoint(cfg.path) as checkpoint:
        checkpoint.verify()
        return _match(cfg, checkpoint)[1]


def load_vae(cfg: VAEConfig, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, *, weights: bool = True) -> VAEEncoder:
    """The encoder with its folder's weights (only the encoder's tensors are read, through
    ``models.hf.Checkpoint``: headers checked, one line for a damaged file), frozen, on
    ``device`` (``weights=False``: materialised, nothing read: shapes for a memory
    check). VAEError for missing or misshapen tensors."""
    from dtdsl.models.hf.fields import HFError
    from dtdsl.models.hf.weights import Checkpoint, Source, WeightsFileError

    with torch.device("meta"):
        module = VAEEncoder(cfg)
    if not weights:
        return module.to_empty(device=device).requires_grad_(False).to(dtype).eval()
    folder = Path(cfg.path)
    dims = {n: t.ndim for n, t in module.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    try:
        with Checkpoint(folder) as checkpoint:
            keys, problems = _match(cfg, checkpoint)
            if problems:
                raise VAEError(f"{folder}: {problems[0]}")
            for name, key in keys.items():
                shape = checkpoint.shape(key)
                t = checkpoint.read(Source(key), (0,) * len(shape), shape)
                state[name] = t[:, :, 0, 0] if t.ndim == 4 and dims[name] == 2 else t
    except WeightsFileError:
        raise
    except HFError as err:
        raise VAEError(err.message) from None
    module = module.to_empty(device=device)
    module.load_state_dict({n: t.to(dtype) for n, t in state.items()})
    module.requires_grad_(False)
    return module.to(dtype).eval()
