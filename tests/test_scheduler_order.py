"""Every sampler of the package with every scheduler a user may swap in (DDPMScheduler's
`compatibles`): the package's sampler (sampling.generate, behind the grids, `sample` and
`evaluate`), the debug images' denoising strip, the class-conditional pipeline, the latent
pipeline and the image-conditioned pipeline. diffusers' pipelines call `set_timesteps` before they
scale the starting noise by `init_noise_sigma`, which for sigma-based schedulers (Euler, Heun, LMS,
KDPM2, ...) depends on the inference timesteps. A freshly loaded pipeline's first call must equal
its second call with the same seed, and both must equal a loop written in diffusers' order
(diffusers' own DDPMPipeline where it applies)."""
import inspect

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DDPMPipeline, DDPMScheduler, UNet2DModel

from diffusion_extras.core.losses import ddpm_scheduler
from diffusion_extras.evaluation import sampling
from diffusion_extras.evaluation.pipeline_class_conditional import ClassConditionalPipeline
from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline, upsample
from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
from diffusion_extras.monitoring.debug_images import denoising_strip

STEPS = 4
# The scheduler config the trainer exports (diffusers' "leading" timestep spacing written out, which a
# swapped-in Euler takes; DDPMScheduler()'s own config leaves it to each scheduler's default). clip_sample
# off: with it on, DDIM's step in the package recomputes its noise from the clipped x0
# (scheduler_step_output), which diffusers' pipelines do not; that choice is tested in test_guidance.
CONFIG = ddpm_scheduler(clip_sample=False).config
# sorted: `compatibles` is built from a set, whose order differs between processes (xdist's workers
# must collect the same tests in the same order); without the optional dependencies' dummies
COMPATIBLE = sorted((cls for cls in DDPMScheduler().compatibles
                     if not cls.__module__.startswith("diffusers.utils.dummy")), key=lambda cls: cls.__name__)


def tiny_unet(channels: int, sample_size: int, condition_channels: int = 0, **options) -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=sample_size, in_channels=channels + condition_channels, out_channels=channels,
                       layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D",) * 2,
                       up_block_types=("UpBlock2D",) * 2, norm_num_groups=4, **options)


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=1, out_channels=1, latent_channels=2, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, norm_num_groups=4, sample_size=8)


def recording(unet) -> list:
    """The list that collects every input x_t (as the scheduler scaled it) the UNet is called with."""
    inputs = []
    unet.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    return inputs


def generators(seed: int, count: int) -> list:
    return [torch.Generator().manual_seed(seed + index) for index in range(count)]


@torch.no_grad()
def diffusers_order(unet, scheduler, shape, generator, condition=None, **conditioning) -> torch.Tensor:
    """Sampling in the order of diffusers' pipelines: timesteps first, then the starting noise
    scaled by the scheduler's init_noise_sigma, then per timestep scale_model_input, the UNet and
    step, passing a generator where the step takes one (prepare_extra_step_kwargs). `condition`:
    channels after the scaled x_t in the UNet's input (an image condition, not scaled)."""
    scheduler.set_timesteps(STEPS)
    noise = torch.cat([torch.randn((1, *shape[1:]), generator=g) for g in generator])
    sample = noise * scheduler.init_noise_sigma
    extra = {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(sample, t)
        if condition is not None:
            model_input = torch.cat([model_input, condition], dim=1)
        model_output = unet(model_input, t, **conditioning).sample
        sample = scheduler.step(model_output, t, sample, **extra).prev_sample
    return sample


def assert_same_inputs(actual: list, expected: list):
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(got, want, msg=lambda message, step=step: f"UNet input {step}: {message}")


@pytest.mark.parametrize("scheduler_class", COMPATIBLE, ids=lambda c: c.__name__)
def test_the_package_sampler_follows_diffusers_order(scheduler_class):
    """Two images in one batch from sampling.generate, whose per-image generators are seeded by
    image_seed, against the diffusers-order loop with the same generators."""
    unet = tiny_unet(1, 8)
    inputs = recording(unet)
    images = sampling.generate(unet, scheduler_class.from_config(CONFIG), 2, STEPS, seed=5)
    ours = list(inputs)
    inputs.clear()
    seeds = [torch.Generator().manual_seed(sampling.image_seed(5, index)) for index in range(2)]
    expected = diffusers_order(unet, scheduler_class.from_config(CONFIG), (2, 1, 8, 8), seeds)
    assert_same_inputs(ours, inputs)
    assert np.abs(images.astype(int) - sampling.to_uint8(expected).astype(int)).max() <= 1


def gives_x0(scheduler_class) -> bool:
    """Whether the scheduler's step returns an x0 estimate, which the denoising strip shows."""
    scheduler = scheduler_class.from_config(CONFIG)
    scheduler.set_timesteps(STEPS)
    sample = torch.zeros(1, 1, 2, 2)
    return hasattr(scheduler.step(sample, scheduler.timesteps[0], sample), "pred_original_sample")


# The trainer's strip samples with DDIM; the others that give an x0 estimate, the sigma schedulers among them
@pytest.mark.parametrize("scheduler_class", [cls for cls in COMPATIBLE if gives_x0(cls)], ids=lambda c: c.__name__)
def test_the_denoising_strip_follows_diffusers_order(scheduler_class):
    unet = tiny_unet(1, 8)
    inputs = recording(unet)
    denoising_strip(unet, scheduler_class.from_config(CONFIG), 2, STEPS, seed=5)
    ours = list(inputs)
    inputs.clear()
    seeds = [torch.Generator().manual_seed(sampling.image_seed(5, index)) for index in range(2)]
    diffusers_order(unet, scheduler_class.from_config(CONFIG), (2, 1, 8, 8), seeds)
    assert_same_inputs(ours, inputs)


def test_the_package_sampler_equals_diffusers_ddpm_pipeline():
    unet = tiny_unet(1, 8)
    images = sampling.generate(unet, DDPMScheduler.from_config(CONFIG), 2, STEPS, seed=5)
    pipeline = DDPMPipeline(unet=unet, scheduler=DDPMScheduler.from_config(CONFIG))
    pipeline.set_progress_bar_config(disable=True)
    seeds = [torch.Generator().manual_seed(sampling.image_seed(5, index)) for index in range(2)]
    expected = pipeline(batch_size=2, num_inference_steps=STEPS, generator=seeds, output_type="np").images
    np.testing.assert_array_equal(images, (expected * 255).round().astype(np.uint8))


def fresh_pipeline(kind: str, scheduler_class, folder):
    """A pipeline of `kind` with a `scheduler_class` scheduler, saved and loaded back, and its call."""
    scheduler = scheduler_class.from_config(CONFIG)
    if kind == "class-conditional":
        pipeline = ClassConditionalPipeline(unet=tiny_unet(1, 8, num_class_embeds=3), scheduler=scheduler,
                                            id2label={0: "a", 1: "b"})
        call = dict(class_labels=[0, 1], guidance_scale=1.0, output_type="pt")
    elif kind == "latent":
        pipeline = LatentDiffusionPipeline(vae=tiny_vae(), unet=tiny_unet(2, 4), scheduler=scheduler)
        call = dict(batch_size=2, output_type="latent")
    else:  # 2x super-resolution of two 4x4 images in [0, 1]
        pipeline = ImageConditionedPipeline(unet=tiny_unet(1, 8, condition_channels=1), scheduler=scheduler,
                                            conditioning="super_resolution", sr_factor=2)
        call = dict(image=LOW_RESOLUTION, output_type="pt")
    pipeline.save_pretrained(folder)
    loaded = type(pipeline).from_pretrained(folder)
    assert type(loaded.scheduler) is scheduler_class
    loaded.set_progress_bar_config(disable=True)
    return loaded, call


LOW_RESOLUTION = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["class-conditional", "latent", "image-conditioned"])
@pytest.mark.parametrize("scheduler_class", COMPATIBLE, ids=lambda c: c.__name__)
def test_a_fresh_pipelines_first_call_equals_its_second_and_diffusers_order(kind, scheduler_class, tmp_path):
    pipeline, call = fresh_pipeline(kind, scheduler_class, tmp_path / "pipeline")
    inputs = recording(pipeline.unet)
    calls = []
    for _ in range(2):
        inputs.clear()
        images = pipeline(**call, num_inference_steps=STEPS, generator=generators(3, 2)).images
        calls.append((images, list(inputs)))
    (first, first_inputs), (second, second_inputs) = calls
    assert torch.equal(first, second)
    assert_same_inputs(first_inputs, second_inputs)
    inputs.clear()
    conditioning = {"class_labels": torch.tensor([0, 1])} if kind == "class-conditional" else {}
    if kind == "image-conditioned":
        conditioning["condition"] = upsample(LOW_RESOLUTION * 2 - 1, 2)
    shape = (2, pipeline.unet.config.out_channels, *(pipeline.unet.config.sample_size,) * 2)
    expected = diffusers_order(pipeline.unet, scheduler_class.from_config(CONFIG), shape, generators(3, 2),
                               **conditioning)
    assert_same_inputs(first_inputs, inputs)
    if kind == "latent":
        torch.testing.assert_close(first, expected)
    elif kind == "image-conditioned":
        torch.testing.assert_close(first, (expected / 2 + 0.5).clamp(0, 1))
