"""Tests for diffusion_extras/monitoring/debug_images.py through the training command line: raw vs EMA samples
beside each grid, and the denoising strip, as PNGs and tracker images."""
import glob
import os

import numpy as np
import torch
from diffusers import UNet2DModel
from helpers import run_training
from PIL import Image
from safetensors.torch import load_file

from diffusion_extras.cli import common as cli
from diffusion_extras.evaluation import sampling
from diffusion_extras.monitoring.debug_images import recorded_steps

STEPS, SAMPLER_STEPS = 3, 10


def grid_cells(grid: np.ndarray, nrow: int, size: int, padding: int = 2) -> list[np.ndarray]:
    """The images of a sampling.image_grid, row by row."""
    rows = (grid.shape[0] - padding) // (size + padding)
    return [grid[padding + r * (size + padding):padding + r * (size + padding) + size,
                 padding + c * (size + padding):padding + c * (size + padding) + size]
            for r in range(rows) for c in range(nrow)]


def test_debug_images_show_raw_beside_ema_and_the_denoising_trajectory(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(), out, "--max_train_steps", STEPS, "--save_images_steps", STEPS, "--checkpointing_steps",
                 STEPS, "--learning_rate", 1e-2, "--ddpm_num_inference_steps", SAMPLER_STEPS, "--logger", "tensorboard")
    prefix = out / "samples" / f"step_{STEPS:06d}"
    ema_grid = np.asarray(Image.open(f"{prefix}.png"))
    both = np.asarray(Image.open(f"{prefix}_raw_vs_ema.png"))
    width = ema_grid.shape[1]
    raw_half, ema_half = both[:, :width], both[:, -width:]
    np.testing.assert_array_equal(ema_half, ema_grid)  # the EMA side is the sample grid's seeds

    # The raw side: the checkpoint's raw weights sampled with the same seeds.
    unet = UNet2DModel.from_config(UNet2DModel.load_config(out / "unet"))
    unet.load_state_dict(load_file(out / f"checkpoint-{STEPS}" / "model.safetensors"))
    scheduler = sampling.make_scheduler("ddim", cli.load_pipeline(str(out)).scheduler.config)
    raw = np.asarray(sampling.image_grid(sampling.generate(unet, scheduler, 4, SAMPLER_STEPS, seed=0)))
    assert np.abs(raw.astype(int) - raw_half).max() <= 1  # uint8 rounding of ~1e-7 kernel differences
    assert np.abs(raw_half.astype(int) - ema_half).max() > 10  # raw and EMA weights differ visibly

    # Strip: per seed an x_t row and an x_0 row, one column per recorded timestep.
    strip = np.asarray(Image.open(f"{prefix}_denoising.png"))
    columns = len(recorded_steps(SAMPLER_STEPS))
    cells = grid_cells(strip, columns, 8)
    assert columns == 10 and len(cells) == 4 * 2 * columns
    for seed_index in range(4):
        x_t_row = cells[2 * seed_index * columns:(2 * seed_index + 1) * columns]
        x0_row = cells[(2 * seed_index + 1) * columns:(2 * seed_index + 2) * columns]
        noise = torch.randn((1, 1, 8, 8), generator=torch.Generator().manual_seed(sampling.image_seed(0, seed_index)))
        np.testing.assert_array_equal(x_t_row[0], sampling.to_uint8(noise)[0, ..., 0])  # starts from the seed's noise
        final = grid_cells(ema_grid, 2, 8)[seed_index]
        assert np.abs(x0_row[-1].astype(int) - final).max() <= 1  # the last x_0 prediction is the sample
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(glob.glob(str(out / "logs" / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    assert {"raw_vs_ema", "denoising", "samples"} <= set(events.Tags()["images"])


def test_without_ema_only_the_denoising_strip_is_written(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(save_images_steps=1000), out, "--max_train_steps", 2, "--no-use_ema")
    written = sorted(os.path.basename(p) for p in glob.glob(str(out / "samples" / "*.png")))
    assert written == ["step_000002.png", "step_000002_denoising.png"]


def test_save_images_steps_0_draws_no_grid_debug_image_or_plot(tmp_path, fresh_accelerate):
    """--save_images_steps 0: no sampling at all, not even at the end; the pipeline is still exported."""
    from helpers import tiny_run

    from diffusion_extras.training import loop
    loop.train(tiny_run(tmp_path, "--max_train_steps", 2, "--save_images_steps", 0, "--use_ema"))
    out = tmp_path / "run"
    assert not (out / "samples").exists() and not (out / "images").exists()
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").exists()
