"""Image generation from a trained UNet2DModel: seeded sampling, grids, pipeline loading.

Reproducibility contract of `generate`: image i of a call with `seed` is drawn from its own CPU
generator seeded from (seed, i), so its noise (initial and per-step) does not depend on the batch
size, the device or the other images, and the global torch RNG is never touched (the training
loop's exact resume relies on that). The command line lives in `diffusion_extras/sample.py`.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from .data import mix_seed

SCHEDULERS = ("ddpm", "ddim", "dpm")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; a clear error when cuda is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None


def make_scheduler(name: str, config):
    """A sampling scheduler built from the training scheduler's config (betas, prediction type).
    A zero-terminal-SNR schedule is sampled with "trailing" timesteps, which start at the zero-SNR
    step (Lin et al. 2024, Sec. 3.3), also for pipelines whose config predates that setting."""
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

    classes = {"ddpm": DDPMScheduler, "ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}
    if name not in classes:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    overrides = {"timestep_spacing": "trailing"} if config.get("rescale_betas_zero_snr") else {}
    return classes[name].from_config(config, **overrides)


def image_seed(seed: int, index: int) -> int:
    """A 63-bit seed for image `index`, decorrelated from its neighbours (the trainer's mix_seed)."""
    return mix_seed(seed, index)


def _image_shape(unet) -> tuple[int, int, int]:
    size = unet.config.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    # in_channels, not out_channels: a learned-variance UNet outputs 2*C channels for C image channels.
    return unet.config.in_channels, height, width


def _to_uint8(sample: torch.Tensor) -> np.ndarray:
    images = (sample.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return (images * 255).round().astype(np.uint8)


def _denoise_batch(unet, scheduler, generators, num_inference_steps, device, dtype, step_bar):
    shape = (len(generators),) + _image_shape(unet)
    sample = torch.cat([torch.randn((1,) + shape[1:], generator=g) for g in generators]).to(device)
    sample = sample * scheduler.init_noise_sigma
    # Fresh solver state per batch (DPM-Solver keeps a history of model outputs).
    scheduler.set_timesteps(num_inference_steps, device=device)
    net_dtype = next(unet.parameters()).dtype
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(sample, t).to(net_dtype)
        with autocast:
            model_output = unet(model_input, t).sample
        # x_t stays fp32 whatever the network precision: rounding it each step accumulates error.
        sample = scheduler.step(model_output.float(), t, sample, generator=generators).prev_sample
        step_bar.update(len(generators))
    return _to_uint8(sample)


@torch.no_grad()
def generate(unet, scheduler, num_images: int, num_inference_steps: int = 50, seed: int = 0,
             batch_size: int | None = None, device=None, dtype=torch.float32, progress: bool = False,
             *, start_index: int = 0) -> np.ndarray:
    """Sample `num_images` images as uint8 [N, H, W, C].

    `scheduler` is only read (a copy is stepped), so the training noise scheduler may be passed.
    `dtype` is the precision the UNet runs in (autocast); the sampler state stays fp32.
    `start_index` offsets the image indices, so chunks of one long run reproduce that run.
    The noise is the same whatever `batch_size`; the UNet's batched kernels are not bit-identical
    across batch sizes (~1e-7), which a long deterministic (DDIM) run can amplify: bit-exact
    reproduction needs the same seed, device and batch size.
    """
    if num_images < 1 or num_inference_steps < 1:
        raise ValueError("num_images and num_inference_steps must be positive")
    batch_size = batch_size or num_images
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    parameter = next(unet.parameters())
    device = torch.device(device) if device is not None else parameter.device
    scheduler = type(scheduler).from_config(scheduler.config)
    modes = {module: module.training for module in unet.modules()}
    unet.eval()
    images = []
    try:
        with tqdm(total=num_images * num_inference_steps, disable=not progress,
                  unit="img-step", desc="sampling") as step_bar:
            for first in range(0, num_images, batch_size):
                indices = range(start_index + first, start_index + min(first + batch_size, num_images))
                generators = [torch.Generator("cpu").manual_seed(image_seed(seed, i)) for i in indices]
                images.append(_denoise_batch(unet, scheduler, generators, num_inference_steps,
                                             device, dtype, step_bar))
    finally:
        for module, was_training in modes.items():
            module.training = was_training
    return np.concatenate(images)


def image_grid(images: np.ndarray, nrow: int | None = None, padding: int = 2) -> Image.Image:
    """A near-square grid (nrow images per row), `padding` black pixels between and around images."""
    if images.ndim != 4 or images.dtype != np.uint8 or len(images) == 0:
        raise ValueError(f"expected a non-empty uint8 array [N, H, W, C], got {images.dtype} {images.shape}")
    count, height, width, channels = images.shape
    nrow = nrow or math.ceil(math.sqrt(count))
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


def _check_pipeline_folder(path: str) -> None:
    index_path = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"{path} is not a diffusers pipeline folder (no model_index.json); pass the "
                         "output_dir that train_ddpm.py saved, or a folder written by save_pretrained")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{index_path} is not readable JSON ({error})") from None
    unet_class = (index.get("unet") or [None, None])[-1]
    if unet_class != "UNet2DModel" or "scheduler" not in index:
        raise ValueError(f"{path} holds a {index.get('_class_name', 'unknown')} with unet {unet_class}; "
                         "expected an unconditional DDPMPipeline (UNet2DModel + scheduler)")


def _is_offline_error(error: BaseException) -> bool:
    """True when loading failed for want of a network (offline mode, DNS, refused, timeout)."""
    while error is not None:
        name = type(error).__name__
        if isinstance(error, (ConnectionError, TimeoutError)) or name in (
                "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "gaierror", "LocalEntryNotFoundError"):
            return True
        error = error.__cause__ or error.__context__
    return False


def _load_from_hub(repo_id: str, dtype):
    from diffusers import DDPMPipeline
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its "Couldn't connect" warning would repeat our error
    try:
        return DDPMPipeline.from_pretrained(repo_id, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - hub failures come as OSError, HTTP or value errors
        if _is_offline_error(error):
            raise ValueError(f"{repo_id!r} is not a local folder and the Hub is offline (nor is it in "
                             "the local Hub cache); pass the folder that train_ddpm.py saved") from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{repo_id!r} is not a local folder and could not be loaded from the Hub: "
                         f"{first_line}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity)


def load_pipeline(name_or_path: str, device="cpu", dtype=torch.float32):
    """A DDPMPipeline from a local save_pretrained folder or a Hub id, moved to `device`."""
    from diffusers import DDPMPipeline, UNet2DModel
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        _check_pipeline_folder(path)
        try:
            pipeline = DDPMPipeline.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, EnvironmentError) as error:
            raise ValueError(f"could not load the pipeline in {path}: "
                             f"{str(error).strip().splitlines()[0]}") from None
    elif os.path.exists(path):
        raise ValueError(f"{path} is a file; pass the pipeline folder (the one with model_index.json)")
    else:
        try:
            validate_repo_id(name_or_path)
        except HFValidationError:
            raise FileNotFoundError(f"pipeline folder {path} does not exist") from None
        pipeline = _load_from_hub(name_or_path, dtype)
        if not isinstance(pipeline.unet, UNet2DModel):
            raise ValueError(f"{name_or_path} has a {type(pipeline.unet).__name__}; expected a UNet2DModel")
    return pipeline.to(device)
