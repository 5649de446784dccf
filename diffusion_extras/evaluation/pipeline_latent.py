"""A latent diffusion pipeline: a frozen AutoencoderKL, a UNet2DModel trained on its normalised
latents and any diffusers scheduler.

This file is self-contained (torch and diffusers only): the trainer saves a copy beside
model_index.json, so DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) loads it
without the training package (diffusers' custom-pipeline convention).
"""
from __future__ import annotations

import torch


def latent_normalization(vae_config, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale) per latent channel, the UNet's latents being (z - shift) x scale: with the
    VAE config's latents_mean and latents_std (SDXL's convention) shift = mean and scale =
    scaling_factor / std; else shift = shift_factor (SD3's; 0 when None) and scale = scaling_factor."""
    scaling = float(vae_config.get("scaling_factor") or 1.0)
    mean, std = vae_config.get("latents_mean"), vae_config.get("latents_std")
    if mean is not None and std is not None:
        return (torch.tensor(mean, dtype=torch.float32).reshape(channels),
                scaling / torch.tensor(std, dtype=torch.float32).reshape(channels))
    shift = float(vae_config.get("shift_factor") or 0.0)
    return torch.full((channels,), shift), torch.full((channels,), scaling)
