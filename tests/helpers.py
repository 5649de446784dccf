"""Helpers that several test modules share (plain functions; the fixtures live in conftest.py)."""
import os

import numpy as np
from conftest import TINY_RECIPE

# 3 -> 2 channels, two blocks: factor 2 (8 px images -> 4x4 latents); ~15k parameters
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=[8, 8], layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                norm_num_groups=4, sample_size=8)
LATENT_MODEL = {**TINY_RECIPE["model"], "in_channels": 2, "out_channels": 2}  # the tiny UNet on TINY_VAE's latents


def save_tiny_vae(path, seed: int = 0, **overrides) -> str:
    """A tiny AutoencoderKL saved with save_pretrained (TINY_VAE with `overrides`); returns the folder."""
    import torch
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    AutoencoderKL(**{**TINY_VAE, **overrides}).save_pretrained(path)
    return str(path)


def first_step_inputs(tmp_path, *flags, **recipe):
    """One optimizer step of an in-process tiny run (conftest.tiny_run with `flags` and `recipe`):
    (the clean inputs of its micro-batches, the UNet's inputs [B, C + condition, H, W] of its calls),
    as the step made them. Use with the fresh_accelerate fixture."""
    from conftest import tiny_run

    from diffusion_extras.training import loop, step
    from diffusion_extras.training.hooks import Hooks

    cleans, inputs = [], []
    hooks = Hooks(model_input=lambda run, clean, micro_step: cleans.append(clean.clone()) or clean)
    run = tiny_run(tmp_path, *flags, hooks=hooks, **recipe)
    run.learner.unet.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        step.optimizer_step(run, loop.make_batches(run))
    finally:
        run.accelerator.end_training()
    return cleans, inputs


def paired_images(count: int, height: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(`count` random grey uint8 images [N, H, W], their pairs): each image's mask, white where the
    image is brighter than mid-grey, so the pair of any crop or flip of an image is the same crop
    or flip of its mask (a condition the tests can recompute from the image alone)."""
    images = np.random.default_rng(seed).integers(0, 256, (count, height, width), dtype=np.uint8)
    return images, np.where(images > 127, 255, 0).astype(np.uint8)


def write_paired_parquet(path, images: np.ndarray, pairs: np.ndarray, column: str) -> str:
    """Grey uint8 images [N, H, W] and their pairs as one parquet file of two image columns, `image`
    and `column`; returns its path."""
    import datasets
    from PIL import Image

    features = datasets.Features({"image": datasets.Image(), column: datasets.Image()})
    datasets.Dataset.from_dict({"image": [Image.fromarray(image) for image in images],
                                column: [Image.fromarray(pair) for pair in pairs]}, features=features) \
        .to_parquet(str(path))
    return str(path)


def write_paired_folders(folder, images: np.ndarray, pairs: np.ndarray, pair_extension: str = ".bmp") -> tuple:
    """The images as PNGs under folder/images/<i % 2>/<i>.png and each pair at the same relative path
    under folder/pairs/ (as `pair_extension` files); returns (the images' folder, the pairs' folder)."""
    from PIL import Image

    for index, (image, pair) in enumerate(zip(images, pairs)):
        for part, array, extension in (("images", image, ".png"), ("pairs", pair, pair_extension)):
            os.makedirs(os.path.join(folder, part, str(index % 2)), exist_ok=True)
            Image.fromarray(array).save(os.path.join(folder, part, str(index % 2), f"{index}{extension}"))
    return os.path.join(folder, "images"), os.path.join(folder, "pairs")


def same_values(a, b) -> bool:
    """Whether two (nested dicts / lists / tuples of) tensors and plain values are bitwise equal."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def assert_same_training(a, b, step: int) -> None:
    """Two runs' output folders trained alike, bit for bit: the same loss at each of the `step`
    steps, the same exported weights, and in checkpoint-`step` the same weights and every saved
    state (optimizer, LR schedule, EMA, diagnostics, ...)."""
    import torch
    from conftest import load_unet_weights, read_history
    from safetensors.torch import load_file

    losses = [[row["loss"] for row in read_history(run) if "loss" in row] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == step, losses
    assert same_values(load_unet_weights(a), load_unet_weights(b)), "exported weights differ"
    folders = [os.path.join(run, f"checkpoint-{step}") for run in (a, b)]
    names = sorted(name for name in os.listdir(folders[0]) if name.endswith((".bin", ".safetensors")))
    assert "optimizer.bin" in names and "model.safetensors" in names
    for name in names:
        load = load_file if name.endswith(".safetensors") else lambda path: torch.load(path, weights_only=True)
        assert same_values(*(load(os.path.join(folder, name)) for folder in folders)), f"checkpoint-{step}/{name}"
