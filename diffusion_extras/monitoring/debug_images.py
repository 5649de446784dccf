"""Debug images for poor samples: the same seeds from the raw and the EMA weights side by side, and
a denoising strip (x_t and the predicted x_0 along the sampling trajectory).

Raw vs EMA tells a bad average (EMA too long for the run, or still warming up) from a bad model;
the strip shows where along t the sample goes wrong: a predicted x_0 that is already wrong at high
noise points at the high-t loss, one that goes wrong late at the low-t detail.
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from diffusion_extras.core import stop_flag
from diffusion_extras.evaluation.pipeline_backbone import predict
from diffusion_extras.evaluation.pipeline_class_conditional import (
    initial_noise_sigma,
    is_flow_scheduler,
    scale_model_input,
    scheduler_model_output,
    scheduler_step_output,
    unconditional_inputs,
)
from diffusion_extras.evaluation.sampling import _image_shape, image_grid, image_seed, to_uint8


def side_by_side(left: np.ndarray, right: np.ndarray, gap: int = 4) -> Image.Image:
    """Two image sets as grids, `left` | `right`, with a white gap between them."""
    grids = [np.asarray(image_grid(images)) for images in (left, right)]
    grids = [grid[..., None] if grid.ndim == 2 else grid for grid in grids]
    separator = np.full((grids[0].shape[0], gap, grids[0].shape[2]), 255, np.uint8)
    joined = np.concatenate([grids[0], separator, grids[1]], axis=1)
    return Image.fromarray(joined[..., 0] if joined.shape[2] == 1 else joined)


def recorded_steps(num_inference_steps: int, count: int = 10) -> list[int]:
    """Indices into the sampling loop, evenly spaced, first and last included."""
    return sorted(set(np.linspace(0, num_inference_steps - 1, min(count, num_inference_steps)).round().astype(int)))


@torch.no_grad()
def denoising_strip(unet, scheduler, num_seeds: int, num_inference_steps: int, seed: int = 0, device=None,
                    count: int = 10) -> tuple[Image.Image, list[int]]:
    """Per seed two rows, x_t above the predicted x_0, at `count` timesteps of a run of `scheduler`
    (DDIM, or a flow model's Euler; left: most noise).
    Seeds are those of `sampling.generate`, so the strips follow the grid's first images.
    Returns the image and the timesteps shown."""
    device = torch.device(device) if device is not None else next(unet.parameters()).device
    scheduler = type(scheduler).from_config(scheduler.config)
    scheduler.set_timesteps(num_inference_steps, device=device)
    generators = [torch.Generator("cpu").manual_seed(image_seed(seed, i)) for i in range(num_seeds)]
    sample = torch.cat([torch.randn((1,) + _image_shape(unet), generator=g) for g in generators]).to(device)
    sample = sample * initial_noise_sigma(scheduler)
    keep, columns, timesteps = set(recorded_steps(num_inference_steps, count)), [], []
    was_training = unet.training
    unet.eval()
    try:
        for index, t in enumerate(scheduler.timesteps):
            stop_flag.check()  # a preempted run gives the strip up between denoising steps
            labels = unconditional_inputs(unet, len(sample), device)  # a class-conditional UNet: "no class"
            model_output = predict(unet, scale_model_input(scheduler, sample, t), t, **labels).float()
            model_output = scheduler_model_output(scheduler, model_output, sample)  # 2C: DDIM takes the mean part
            output = scheduler_step_output(scheduler, model_output, t, sample, generators)  # as the grid steps
            if index in keep:
                columns.append((to_uint8(sample), to_uint8(predicted_clean(scheduler, index, sample, model_output,
                                                                          output))))
                timesteps.append(int(t))
            sample = output.prev_sample
    finally:
        unet.train(was_training)
    # Rows: seed 0 x_t, seed 0 x_0, seed 1 x_t, ...; columns: the recorded timesteps.
    cells = [column[kind][row] for row in range(num_seeds) for kind in (0, 1) for column in columns]
    return image_grid(np.stack(cells), nrow=len(columns)), timesteps


def predicted_clean(scheduler, index: int, sample, model_output, output):
    """x_0 as the scheduler's step estimated it; a flow scheduler's step gives none: x_0 = x_t - sigma v."""
    if is_flow_scheduler(scheduler):
        return sample - float(scheduler.sigmas[index]) * model_output
    return output.pred_original_sample
