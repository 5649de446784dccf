"""Test helpers shared by several test modules (test modules import from here, never from each other)."""
import torch
from conftest import TINY_RECIPE

# 3 -> 2 channels, two blocks: factor 2 (8 px images -> 4x4 latents); ~15k parameters
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=[8, 8], layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                norm_num_groups=4, sample_size=8)
LATENT_MODEL = {**TINY_RECIPE["model"], "in_channels": 2, "out_channels": 2}  # the tiny UNet on TINY_VAE's latents


def save_tiny_vae(path, seed: int = 0, **overrides) -> str:
    """A tiny AutoencoderKL saved with save_pretrained (TINY_VAE with `overrides`); returns the folder."""
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    AutoencoderKL(**{**TINY_VAE, **overrides}).save_pretrained(path)
    return str(path)
