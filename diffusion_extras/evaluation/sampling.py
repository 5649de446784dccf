"""Image generation from a trained UNet2DModel: seeded sampling, grids, saved images.

Reproducibility contract of `generate`: image i of a call with `seed` is drawn from its own CPU
generator seeded from (seed, i), so its noise (initial and per-step) does not depend on the batch
size, the device or the other images, and the global torch RNG is never touched (the training
loop's exact resume relies on that). The command line lives in `diffusion_extras/cli/sample.py`, and
loading a saved pipeline in `diffusion_extras/cli/common.py`.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from diffusion_extras.core import stop_flag
from diffusion_extras.data.batch_order import mix_seed
from diffusion_extras.evaluation.choices import ALL_SCHEDULERS, FLOW_SCHEDULERS, SCHEDULERS, TIMESTEP_SPACINGS
from diffusion_extras.evaluation.pipeline_backbone import predict, sample_shape
from diffusion_extras.evaluation.pipeline_class_conditional import (
    guided_step,
    initial_noise_sigma,
    scale_model_input,
    scheduler_model_output,
    scheduler_step,
    unconditional_inputs,
)
from diffusion_extras.evaluation.pipeline_latent import decode_latents

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # by choices.SAMPLING_DTYPES


def make_scheduler(name: str | None, config, timestep_spacing: str | None = None):
    """A sampling scheduler built from the training scheduler's config (betas, prediction type; a
    flow model's shift). `name` None: the model's default (default_scheduler). `timestep_spacing`
    (diffusers': leading, linspace, trailing) places its steps; by default the config's, except that a
    zero-terminal-SNR schedule is sampled with "trailing" timesteps, which start at the zero-SNR step
    (Lin et al. 2024, Sec. 3.3), also for pipelines whose config predates that setting. A DDPM scheduler
    on a flow model's config (or the reverse) is refused: from_config would fill the missing betas with
    defaults and sample wrong without an error."""
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    name = default_scheduler(config) if name is None else name
    if name not in ALL_SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(ALL_SCHEDULERS)}")
    flow_model = is_flow_config(config)
    offered = FLOW_SCHEDULERS if flow_model else SCHEDULERS
    if name not in offered:
        model = "a flow-matching" if flow_model else "a DDPM"
        raise ValueError(f"scheduler {name!r} cannot sample {model} model; choose one of {', '.join(offered)}")
    if timestep_spacing is not None and timestep_spacing not in TIMESTEP_SPACINGS:
        raise ValueError(f"unknown timestep spacing {timestep_spacing!r}; choose one of {', '.join(TIMESTEP_SPACINGS)}")
    if flow_model:  # its sigmas are spaced by the shift (timestep_spacing is not one of its settings)
        if timestep_spacing is not None:
            raise ValueError("a flow-matching model's steps are placed by its scheduler's shift: drop the timestep "
                             "spacing")
        if name == "dpm":  # DPM-Solver++ on the flow sigmas, shifted as the model was trained
            return DPMSolverMultistepScheduler(num_train_timesteps=config["num_train_timesteps"],
                                               use_flow_sigmas=True, prediction_type="flow_prediction",
                                               flow_shift=flow_shift(config))
        return FlowMatchEulerDiscreteScheduler.from_config(config, shift=flow_shift(config))
    classes = {"ddpm": DDPMScheduler, "ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}
    if timestep_spacing is None and config.get("rescale_betas_zero_snr"):
        timestep_spacing = "trailing"
    overrides = {"timestep_spacing": timestep_spacing} if timestep_spacing else {}
    return classes[name].from_config(config, **overrides)


def default_scheduler(config) -> str:
    """The sampler a model gets unless one is named: DDIM for DDPM, Euler for a flow-matching model."""
    return FLOW_SCHEDULERS[0] if is_flow_config(config) else "ddim"


def flow_shift(config) -> float:
    """A flow model's sigma shift from its scheduler config: FlowMatchEulerDiscreteScheduler's `shift`,
    or DPM-Solver's `flow_shift` where a DPM-Solver on the flow sigmas was saved in its place."""
    return float(config.get("shift", config.get("flow_shift", 1.0)))


def is_flow_config(config) -> bool:
    """Whether a scheduler config (a pipeline's scheduler/, the run's) is a flow-matching model's."""
    return str(config.get("_class_name", "")).startswith("FlowMatch") or (
        "shift" in config and "beta_start" not in config) or config.get("prediction_type") == "flow_prediction"


def training_sampler(config):
    """The sampler of a run's grids, debug images and FID, from its scheduler's config: DDIM for
    DDPM, Euler for a flow-matching model."""
    return make_scheduler(None, config)


def class_rows(class_names: list, per_class: int, max_classes: int = 10) -> list[int]:
    """Class ids for a grid of one row per class (the first `max_classes` classes), `per_class` each."""
    return [label for label in range(min(len(class_names), max_classes)) for _ in range(per_class)]


def image_seed(seed: int, index: int) -> int:
    """A 63-bit seed for image `index`, decorrelated from its neighbours (the trainer's mix_seed)."""
    return mix_seed(seed, index)


def _image_shape(unet) -> tuple[int, int, int]:
    # in_channels, not out_channels: a learned-variance UNet outputs 2*C channels for C image channels.
    return sample_shape(unet)


def to_uint8(sample: torch.Tensor) -> np.ndarray:
    """Images in [-1, 1] [N, C, H, W] -> uint8 [N, H, W, C] (clipped, rounded)."""
    images = (sample.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return (images * 255).round().astype(np.uint8)


def _denoise_batch(unet, scheduler, generators, num_inference_steps, device, dtype, step_bar,
                   class_labels=None, guidance_scale: float = 1.0, guide=None, guidance_interval=None, vae=None):
    shape = (len(generators),) + _image_shape(unet)
    sample = torch.cat([torch.randn((1,) + shape[1:], generator=g) for g in generators]).to(device)
    # Fresh solver state per batch (DPM-Solver keeps a history of model outputs). Timesteps before the
    # noise scale, as diffusers' pipelines: a sigma scheduler's init_noise_sigma follows its timesteps.
    scheduler.set_timesteps(num_inference_steps, device=device)
    sample = sample * initial_noise_sigma(scheduler)
    net_dtype = next(unet.parameters()).dtype
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if guide is not None and class_labels is None:  # autoguidance of the unconditional model
        class_labels = unconditional_inputs(unet, len(sample), device).get("class_labels")
    for step, t in enumerate(scheduler.timesteps):
        stop_flag.check()  # a preempted run gives the grid up between denoising steps
        if class_labels is not None or guide is not None:  # the pipeline's guided step (fp32 combination)
            sample = guided_step(scheduler, unet, sample, step, class_labels, guidance_scale, generators, dtype,
                                 guide, guidance_interval)
            step_bar.update(len(generators))
            continue
        model_input = scale_model_input(scheduler, sample, t).to(net_dtype)
        with autocast:  # a class-conditional UNet without labels: its "no class" prediction
            model_output = predict(unet, model_input, t)
        # x_t stays fp32 whatever the network precision: rounding it each step accumulates error.
        model_output = scheduler_model_output(scheduler, model_output.float(), sample)  # 2C: DDPM's variance
        # the guided path's step function: an unguided sample equals one guided by the model itself
        sample = scheduler_step(scheduler, model_output, t, sample, generators)
        step_bar.update(len(generators))
    return to_uint8(sample if vae is None else decode_latents(vae, sample))


@torch.no_grad()
def generate(unet, scheduler, num_images: int, num_inference_steps: int = 50, seed: int = 0,
             batch_size: int | None = None, device=None, dtype=torch.float32, progress: bool = False,
             *, start_index: int = 0, class_labels=None, guidance_scale: float = 1.0, guide=None,
             guidance_interval: tuple[float, float] | None = None, vae=None) -> np.ndarray:
    """Sample `num_images` images as uint8 [N, H, W, C].

    `scheduler` is only read (a copy is stepped), so the training noise scheduler may be passed.
    `dtype` is the precision the UNet runs in (autocast); the sampler state stays fp32.
    `start_index` offsets the image indices, so chunks of one long run reproduce that run.
    `class_labels` (one class id per image) samples a class-conditional UNet with classifier-free
    guidance at `guidance_scale` (the ClassConditionalPipeline's guidance); without them such a UNet
    samples its unconditional ("no class") model. `guide` (a weaker UNet of the same kind) replaces
    the "no class" branch (autoguidance; also for unconditional UNets), and `guidance_interval`
    (low, high] in noise level sigma limits guidance to those steps (ClassConditionalPipeline.__call__).
    `vae`: the UNet samples latents, decoded by it (pipeline_latent.decode_latents) into the images.
    The noise is the same whatever `batch_size`; the UNet's batched kernels are not bit-identical
    across batch sizes (~1e-7), which a long deterministic (DDIM) run can amplify: bit-exact
    reproduction needs the same seed, device and batch size.
    """
    if num_images < 1 or num_inference_steps < 1:
        raise ValueError("num_images and num_inference_steps must be positive")
    batch_size = batch_size or num_images
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if class_labels is not None and len(class_labels) != num_images:
        raise ValueError(f"give one class label per image ({num_images}), got {len(class_labels)}")
    parameter = next(unet.parameters())
    device = torch.device(device) if device is not None else parameter.device
    scheduler = type(scheduler).from_config(scheduler.config)
    modes = {module: module.training for net in (unet, guide) if net is not None for module in net.modules()}
    for net in (unet, guide):
        if net is not None:
            net.eval()
    images = []
    try:
        with tqdm(total=num_images * num_inference_steps, disable=not progress,
                  unit="img-step", desc="sampling") as step_bar:
            for first in range(0, num_images, batch_size):
                indices = range(start_index + first, start_index + min(first + batch_size, num_images))
                generators = [torch.Generator("cpu").manual_seed(image_seed(seed, i)) for i in indices]
                labels = (None if class_labels is None else
                          torch.as_tensor(class_labels[first:first + len(indices)], dtype=torch.long, device=device))
                images.append(_denoise_batch(unet, scheduler, generators, num_inference_steps,
                                             device, dtype, step_bar, labels, guidance_scale, guide,
                                             guidance_interval, vae))
    finally:
        for module, was_training in modes.items():
            module.training = was_training
    return np.concatenate(images)


def grid_columns(count: int) -> int:
    """Images per row of a near-square grid of `count` images."""
    return math.ceil(math.sqrt(count))


def image_grid(images: np.ndarray, nrow: int | None = None, padding: int = 2) -> Image.Image:
    """A near-square grid (nrow images per row, default grid_columns), `padding` black pixels between
    and around images."""
    if images.ndim != 4 or images.dtype != np.uint8 or len(images) == 0:
        raise ValueError(f"expected a non-empty uint8 array [N, H, W, C], got {images.dtype} {images.shape}")
    count, height, width, channels = images.shape
    nrow = nrow or grid_columns(count)
    ncol = math.ceil(count / nrow)
    grid = np.zeros((padding + ncol * (height + padding), padding + nrow * (width + padding), channels),
                    dtype=np.uint8)
    for index, image in enumerate(images):
        top = padding + (index // nrow) * (height + padding)
        left = padding + (index % nrow) * (width + padding)
        grid[top:top + height, left:left + width] = image
    return Image.fromarray(grid[..., 0] if channels == 1 else grid)


def save_images(images: np.ndarray, output_dir: str, grid_name: str = "grid.png") -> list[str]:
    """Write 000000.png, 000001.png, ... and the grid; return the written paths, grid last."""
    os.makedirs(output_dir, exist_ok=True)
    paths = []
    for index, image in enumerate(images):
        path = os.path.join(output_dir, f"{index:06d}.png")
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)
        paths.append(path)
    grid_path = os.path.join(output_dir, grid_name)
    image_grid(images).save(grid_path)
    return paths + [grid_path]
