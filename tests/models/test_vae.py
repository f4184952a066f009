"""The VAE encoder that makes a generator's target latents, held against diffusers'
AutoencoderKL (made here from a config, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from dtdsl.models.vae import VAEConfig, VAEError, find_vae, load_vae
from tests.hf_models import make_unet, make_vae


@pytest.mark.parametrize("shift", [None, 0.1])
def test_latents_equal_diffusers(tmp_path, shift):
    from diffusers import AutoencoderKL

    make_vae(tmp_path / "vae", shift=shift)
    cfg = VAEConfig.read(tmp_path / "vae")
    ours = load_vae(cfg)
    theirs = AutoencoderKL.from_pretrained(tmp_path / "vae").eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        dist = theirs.encode(x).latent_dist
        mean, logvar = ours.moments(x)
        torch.testing.assert_close(mean, dist.mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logvar, dist.logvar, rtol=1e-4, atol=1e-5)
        eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))
        want = (dist.mean + dist.std * eps - (shift or 0.0)) * theirs.config.scaling_factor
        torch.testing.assert_close(ours.latents(x, eps), want, rtol=1e-4, atol=1e-5)
    assert cfg.downscale == 2 and mean.shape == (2, 4, 16, 16)
    assert not any(p.requires_grad for p in ours.parameters())


def test_a_pipelines_vae_is_found_and_bad_folders_say_why(tmp_path):
    make_unet(tmp_path / "sd")
    assert find_vae(tmp_path / "sd" / "unet") is None
    make_vae(tmp_path / "sd" / "vae")
    assert find_vae(tmp_path / "sd" / "unet") == tmp_path / "sd" / "vae"
    with pytest.raises(VAEError, match="no config.json"):
        VAEConfig.read(tmp_path / "nothing")
    with pytest.raises(VAEError, match="not an AutoencoderKL"):
        VAEConfig.read(tmp_path / "sd" / "unet")
    cfg = VAEConfig.read(tmp_path / "sd" / "vae")
    for f in (tmp_path / "sd" / "vae").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(VAEError, match="no safetensors"):
        load_vae(cfg)
