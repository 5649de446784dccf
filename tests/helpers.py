"""Test helpers shared by several test modules (test modules import from here, never from each other)."""
import json
import os
import shutil

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


# ----------------------------------------------------------------------------- what users bring
HUB_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hub_configs")  # see its README.md
TINY_WIDTH = 8  # channels of every block of a model built from a corpus config (GroupNorm groups of 4)


def hub_config(path: str) -> dict:
    """A config of the corpus, tests/hub_configs/<path>, as its repository stores it."""
    with open(os.path.join(HUB_CONFIGS, path)) as fh:
        return json.load(fh)


def tiny_hub_config(path: str) -> dict:
    """The corpus config at `path` with its widths reduced for a CPU: TINY_WIDTH channels per block,
    one layer per block, GroupNorm groups of 4. Every other field as stored, absent ones absent."""
    values = hub_config(path)
    return {**values, "block_out_channels": [TINY_WIDTH] * len(values["block_out_channels"]),
            "layers_per_block": 1, "norm_num_groups": 4}


def save_from_hub_config(folder, path: str, seed: int = 0) -> str:
    """Weights built (from torch.manual_seed(seed)) from tiny_hub_config(path), saved with
    save_pretrained into `folder`, whose config.json then holds that config in the corpus file's
    form (its fields, in its order): what a user's download of that repo holds, narrower."""
    import diffusers
    values = tiny_hub_config(path)
    torch.manual_seed(seed)
    getattr(diffusers, values["_class_name"]).from_config(values).save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        fh.write(json.dumps(values, indent=2) + "\n")
    return str(folder)


def save_google_ddpm_form(folder, repo: str, seed: int = 0) -> str:
    """A pipeline folder laid out as google/ddpm-* repos store theirs: the UNet's config.json and
    weights at the root beside scheduler_config.json and model_index.json (no unet/, scheduler/;
    diffusers loads a missing subfolder from the root), from the corpus folder `repo`. Without a
    stored model_index.json in the corpus, none is written."""
    save_from_hub_config(folder, f"{repo}/config.json", seed)
    for name in ("scheduler_config.json", "model_index.json"):
        if os.path.isfile(os.path.join(HUB_CONFIGS, repo, name)):
            shutil.copyfile(os.path.join(HUB_CONFIGS, repo, name), os.path.join(folder, name))
    return str(folder)
