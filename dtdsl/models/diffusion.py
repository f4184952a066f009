"""The noise schedule and training objective of a diffusion generator, as diffusers'
``DDPMScheduler`` defines them for the scheduler config a U-Net was trained with.

``alphas_cumprod(arch)``: the cumulative signal fractions over ``arch.timesteps`` steps of
its beta schedule (``linear``: DDPM's; ``scaled_linear``: Stable Diffusion's, linear in
``sqrt(beta)``; ``squaredcos_cap_v2``: the cosine schedule), in float32 as diffusers
computes them. ``noisy_and_target(arch, x0, noise, timesteps)``: the noised latents
(``add_noise``) and what the model learns to predict: the noise (``epsilon``) or the
velocity ``sqrt(abar) noise - sqrt(1 - abar) x0`` (``v_prediction``, ``get_velocity``).
A DiT (``ir.DiTArch``) trains on DDPM's linear schedule and the noise.
"""

from __future__ import annotations

import math

import torch

from dtdsl.ir import program as ir

__all__ = ["DEFAULT_TIMESTEPS", "alphas_cumprod", "noisy_and_target"]

DEFAULT_TIMESTEPS = 1000     # DDPM's discrete timesteps (ir's default)


def _betas(arch: ir.UNetArch | ir.DiTArch, device: torch.device | str) -> torch.Tensor:
    steps = arch.timesteps
    schedule = getattr(arch, "beta_schedule", "linear")
    start, end = getattr(arch, "beta_start", 1e-4), getattr(arch, "beta_end", 0.02)
    if schedule == "linear":
        return torch.linspace(start, end, steps, dtype=torch.float32, device=device)
    if schedule == "scaled_linear":
        return torch.linspace(start ** 0.5, end ** 0.5, steps, dtype=torch.float32,
                              device=device) ** 2
    if schedule == "squaredcos_cap_v2":    # diffusers' betas_for_alpha_bar, max_beta 0.999
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = [min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), 0.999)
                 for i in range(steps)]
        return torch.tensor(betas, dtype=torch.float32, device=device)
    raise ValueError(f"unknown beta schedule {schedule!r}")


def alphas_cumprod(arch: ir.UNetArch | ir.DiTArch,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``[timesteps]`` float32 (made where it is used: a thousand numbers, and no tensor is
    kept between calls, so none outlives the device or fake-tensor mode it was made in)."""
    return torch.cumprod(1.0 - _betas(arch, device), dim=0)


def noisy_and_target(arch: ir.UNetArch | ir.DiTArch, x0: torch.Tensor, noise: torch.Tensor,
                     timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(noisy latents, prediction target)`` for clean latents ``x0`` ``[N, C, H, W]``,
    their ``noise`` and integer ``timesteps`` ``[N]`` (float32 throughout)."""
    abar = alphas_cumprod(arch, x0.device)[timesteps].view(-1, 1, 1, 1)
    signal, sigma = abar.sqrt(), (1 - abar).sqrt()
    noisy = signal * x0 + sigma * noise
    if getattr(arch, "prediction", "epsilon") == "v_prediction":
        return noisy, signal * noise - sigma * x0
    return noisy, noise
