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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VAEConfig", "VAEEncoder", "VAEError", "find_vae", "load_vae"]


class VAEError(ValueError):
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
        folder = Path(folder).expanduser().resolve()
        file = folder / "config.json"
        try:
            cfg = json.loads(file.read_text())
        except FileNotFoundError:
            raise VAEError(f"{folder} has no config.json (a diffusers AutoencoderKL folder "
                           "has one)") from None
        except (OSError, ValueError) as err:
            raise VAEError(f"{file} is not readable JSON: {err}") from None
        if cfg.get("_class_name") not in (None, "AutoencoderKL"):
            raise VAEError(f"{folder} holds a {cfg.get('_class_name')}, not an AutoencoderKL")
        blocks = cfg.get("down_block_types", ["DownEncoderBlock2D"] * 4)
        if any(b != "DownEncoderBlock2D" for b in blocks):
            raise VAEError(f"{folder}: down blocks {blocks} are not DownEncoderBlock2D")
        if cfg.get("act_fn", "silu") != "silu":
            raise VAEError(f"{folder}: activation {cfg.get('act_fn')} is not silu")
        return cls(path=str(folder), in_channels=int(cfg.get("in_channels", 3)),
                   block_out_channels=tuple(cfg.get("block_out_channels", (64,))),
                   layers_per_block=int(cfg.get("layers_per_block", 1)),
                   latent_channels=int(cfg.get("latent_channels", 4)),
                   norm_num_groups=int(cfg.get("norm_num_groups", 32)),
                   scaling_factor=float(cfg.get("scaling_factor", 0.18215)),
                   shift_factor=float(cfg.get("shift_factor") or 0.0),
                   mid_attention=bool(cfg.get("mid_block_add_attention", True)),
                   quant_conv=bool(cfg.get("use_quant_conv", True)))


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


def load_vae(cfg: VAEConfig, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, *, weights: bool = True) -> VAEEncoder:
    """The encoder with its folder's weights (only the encoder's tensors are read), frozen,
    on ``device`` (``weights=False``: materialised, nothing read: shapes for a memory
    check). VAEError for missing or misshapen tensors."""
    from safetensors import safe_open

    if not weights:
        with torch.device("meta"):
            module = VAEEncoder(cfg)
        return module.to_empty(device=device).requires_grad_(False).to(dtype).eval()
    folder = Path(cfg.path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VAEError(f"{folder} has no .safetensors weights")
    # diffusers' own file first; fp16 variants only when nothing else is there
    main = [f for f in files if ".fp16." not in f.name] or files
    with torch.device("meta"):
        module = VAEEncoder(cfg)
    want = dict(module.state_dict())
    state: dict[str, torch.Tensor] = {}
    for file in main:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():        # noqa: SIM118 - safe_open has no __iter__
                name = key
                for old, new in _OLD_NAMES.items():
                    name = name.replace(f".{old}.", f".{new}.")
                if name in want:
                    t = f.get_tensor(key)
                    if t.ndim == 4 and want[name].ndim == 2:      # old 1x1-conv attention
                        t = t[:, :, 0, 0]
                    state[name] = t
    missing = sorted(set(want) - set(state))
    if missing:
        raise VAEError(f"{folder} lacks {len(missing)} encoder tensors, e.g. {missing[0]}")
    bad = [n for n, t in state.items() if tuple(t.shape) != tuple(want[n].shape)]
    if bad:
        raise VAEError(f"{folder}: {bad[0]} is {tuple(state[bad[0]].shape)}, the config says "
                       f"{tuple(want[bad[0]].shape)}")
    module = module.to_empty(device=device)
    module.load_state_dict({n: t.to(dtype) for n, t in state.items()})
    module.requires_grad_(False)
    return module.to(dtype).eval()
