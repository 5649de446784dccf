"""Sampling and scoring an image-conditioned model (pipeline_image_conditioned.py): the samples of
given conditions, made through the exported pipeline's own __call__ with each image's noise seeded
from (seed, image) (as sampling.generate's), and how close they come to the images the conditions
were made from: PSNR and SSIM (super-resolution also scores the bicubic upsampling, its baseline),
and, for digits, the class a digit classifier sees in them (evaluation/digits.py). The trainer's
grids and --eval_steps and the evaluate command share these."""
from __future__ import annotations

import numpy as np
import torch

from diffusion_extras.core import stop_flag
from diffusion_extras.evaluation import digits, distributed
from diffusion_extras.evaluation.pipeline_backbone import predict
from diffusion_extras.evaluation.pipeline_image_conditioned import (
    ImageConditionedPipeline,
    back_project,
    degrade,
    upsample,
)
from diffusion_extras.evaluation.sampling import image_seed


def conditioned_pipeline(unet, scheduler, vae, conditioning: dict) -> ImageConditionedPipeline:
    """The pipeline around a UNet (a sampling copy, or a loaded one) and a sampling scheduler, its
    progress bar off; `conditioning`: {"conditioning": kind, "sr_factor": n}."""
    pipeline = ImageConditionedPipeline(unet=unet, scheduler=scheduler, vae=vae, **conditioning)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def stop_between_steps(pipeline, step, timestep, callback_kwargs) -> dict:
    """callback_on_step_end: a preempted run gives the sampling up between denoising steps."""
    stop_flag.check()
    return {}


def sample_conditioned(pipeline: ImageConditionedPipeline, inputs: dict, indices: range, num_inference_steps: int,
                       seed: int, guidance_scale: float, guidance_interval: tuple[float, float] | None = None,
                       back_projection_steps: int = 0, noise_level: int | None = None) -> np.ndarray:
    """uint8 [N, H, W, C]: the samples of `inputs` ({"image": ..., "mask_image": ... for inpainting},
    N tensors in [0, 1] as the pipeline takes them), the images numbered `indices` (image i with
    noise from image_seed(seed, i)), so an image is the same in any chunk of any batch size (to the
    UNet's float rounding across batch sizes). back_projection_steps, noise_level (None: the
    pipeline's default): the pipeline's (super-resolution)."""
    generators = [torch.Generator().manual_seed(image_seed(seed, index)) for index in indices]
    arguments = {name: value for name, value in inputs.items() if name in ("image", "mask_image")}
    if back_projection_steps:
        arguments["back_projection_steps"] = back_projection_steps
    if noise_level is not None:
        arguments["noise_level"] = noise_level
    images = pipeline(**arguments, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                      generator=generators, output_type="np", guidance_interval=guidance_interval,
                      callback_on_step_end=stop_between_steps).images
    return (images * 255).round().astype(np.uint8)


def batch(inputs: dict, first: int, count: int) -> dict:
    """Images first..first+count-1 of every tensor in `inputs`."""
    return {name: value[first:first + count] for name, value in inputs.items()}


def conditioned_samples(pipeline: ImageConditionedPipeline, inputs: dict, num_inference_steps: int, seed: int,
                        guidance_scale: float, batch_size: int, rank: int = 0, num_ranks: int = 1,
                        guidance_interval: tuple[float, float] | None = None,
                        back_projection_steps: int = 0, noise_level: int | None = None) -> np.ndarray | None:
    """The samples of all of `inputs` (sample_conditioned), on rank 0 (None elsewhere): over the
    ranks of a launch a collective, batch k (images k x batch_size on) made by rank k mod num_ranks,
    as metrics.sample_features shares its images."""
    count = len(inputs["image"])
    with stop_flag.interruptible():  # a stop gives up on every rank before the gather (core/stop_flag.py)
        made = {first: sample_conditioned(pipeline, batch(inputs, first, batch_size),
                                          range(first, min(first + batch_size, count)), num_inference_steps, seed,
                                          guidance_scale, guidance_interval, back_projection_steps, noise_level)
                for first in range(rank * batch_size, count, num_ranks * batch_size)}
    if num_ranks > 1:
        made = distributed.gather_to_main(made, rank, num_ranks)
        if rank != 0:
            return None
    return np.concatenate([made[first] for first in sorted(made)])


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Tensors [N, C, H, W] in [0, 1] -> uint8 [N, H, W, C]."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


# ----------------------------------------------------------------------------- scores
def psnr(images: np.ndarray, references: np.ndarray) -> np.ndarray:
    """Per image, the peak signal-to-noise ratio in dB of uint8 [N, H, W, C] against the references
    (255 the peak; an identical image: inf)."""
    error = ((images.astype(np.float64) - references.astype(np.float64)) ** 2).reshape(len(images), -1).mean(1)
    with np.errstate(divide="ignore"):
        return 10 * np.log10(255.0 ** 2 / error)


def ssim(images: np.ndarray, references: np.ndarray, window: int = 11, sigma: float = 1.5) -> np.ndarray:
    """Per image, the structural similarity (Wang et al. 2004) of uint8 [N, H, W, C] against the
    references: the Gaussian-weighted window (11 px, sigma 1.5; shrunk to the image for small
    ones), K1 0.01, K2 0.03, L 255, averaged over the valid windows and the channels, as
    scikit-image's structural_similarity(gaussian_weights=True) computes it. By hand: neither
    torch nor diffusers has it, and scikit-image is not a dependency."""
    x, y = (torch.from_numpy(np.ascontiguousarray(a)).double().permute(0, 3, 1, 2) for a in (images, references))
    size = min(window, *x.shape[-2:])
    size -= 1 - size % 2  # odd
    taps = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma ** 2))
    taps /= taps.sum()

    def blur(values):  # the valid windows only, per channel: the Gaussian is separable, rows then columns
        # (in float64 a grouped conv2d of the 2-D window took 5x longer on a CPU)
        return (values.unfold(2, size, 1) @ taps).unfold(3, size, 1) @ taps
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2, blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    index = (2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return index.mean(dim=(1, 2, 3)).numpy()


def bicubic(images: np.ndarray, factor: int, back_projection_steps: int = 0) -> np.ndarray:
    """Super-resolution's baseline: uint8 [N, H, W, C] degraded as training degrades them, then
    upsampled bicubically (the condition the model starts from), and back-projected onto the
    degraded images `back_projection_steps` times (the pipeline's back_projection_steps)."""
    pixels = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    low = degrade(pixels, factor)
    return to_uint8((back_project(upsample(low, factor), low, factor, back_projection_steps) + 1) / 2)


def closeness(samples: np.ndarray, references: np.ndarray, prefix: str = "") -> dict[str, float]:
    """{prefix + "psnr": mean dB (inf images left out), prefix + "ssim": mean} of uint8 samples."""
    values = psnr(samples, references)
    finite = values[np.isfinite(values)]
    return {f"{prefix}psnr": float(finite.mean()) if len(finite) else float("inf"),
            f"{prefix}ssim": float(ssim(samples, references).mean())}


def scores(kind: str, samples: np.ndarray, targets: np.ndarray, sr_factor: int = 1,
           back_projection_steps: int = 0) -> dict[str, float]:
    """How close the samples (uint8 [N, H, W, C]) come to the images their conditions were made from:
    psnr, ssim; super-resolution also bicubic_psnr, bicubic_ssim (its baseline), and with
    back_projection_steps (the samples') bicubic_back_projected_psnr and _ssim; digits (every target
    one of scikit-learn's: digits.recognised) also digit_accuracy (of the samples) and
    reference_digit_accuracy (of the targets: the classifier's ceiling)."""
    values = closeness(samples, targets)
    if kind == "super_resolution":
        values.update(closeness(bicubic(targets, sr_factor), targets, prefix="bicubic_"))
        if back_projection_steps:
            values.update(closeness(bicubic(targets, sr_factor, back_projection_steps), targets,
                                    prefix="bicubic_back_projected_"))
    known = digits.recognised(targets)
    if known is not None:
        labels, classifier = known
        values.update(digit_accuracy=classifier.accuracy(samples, labels),
                      reference_digit_accuracy=classifier.accuracy(targets, labels))
    return values


@torch.no_grad()
def inpaint_by_replacement(unet, scheduler, images: torch.Tensor, masks: torch.Tensor, num_inference_steps: int,
                           indices: range, seed: int) -> np.ndarray:
    """An unconditional UNet's completions (the baseline an inpainting model is measured against):
    images [N, C, H, W] in [-1, 1] whose `masks` (1 = to fill) are filled by the replacement method
    (Song et al. 2021; RePaint without resampling): after each sampling step the known pixels are
    replaced by the image noised to the next step's level. `scheduler`: one with add_noise (DDPM,
    DDIM), set here; image i's noise from image_seed(seed, i). uint8 [N, H, W, C], the known pixels
    as given."""
    from diffusion_extras.evaluation.pipeline_class_conditional import _randn, scheduler_model_output, scheduler_step

    device = next(unet.parameters()).device
    images, masks = images.to(device), masks.to(device)
    generators = [torch.Generator().manual_seed(image_seed(seed, index)) for index in indices]
    scheduler.set_timesteps(num_inference_steps, device=device)
    sample = _randn(images.shape, generators, device) * scheduler.init_noise_sigma
    timesteps = scheduler.timesteps
    for step, t in enumerate(timesteps):
        stop_flag.check()
        output = predict(unet, scheduler.scale_model_input(sample, t), t)
        sample = scheduler_step(scheduler, scheduler_model_output(scheduler, output, sample), t, sample, generators)
        if step + 1 < len(timesteps):
            known = scheduler.add_noise(images, _randn(images.shape, generators, device), timesteps[step + 1:step + 2])
            sample = masks * sample + (1 - masks) * known
    return to_uint8((masks * sample + (1 - masks) * images + 1) / 2)
