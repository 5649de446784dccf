"""An image-conditioned DDPM pipeline: super-resolution, inpainting or image-to-image with a
UNet2DModel that takes the condition as extra input channels after x_t (SR3 and Palette concatenate
the conditioning image; Stable Diffusion inpainting the mask and the masked image), in pixels or in
the latents of a VAE (vae/), with any diffusers scheduler:

    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    pipe(image=low_resolution).images                      # super_resolution: sr_factor x larger
    pipe(image=photo, mask_image=mask).images              # inpainting: white = to fill; the rest kept
    pipe(image=conditioning_image).images                  # image-to-image
    pipe(image=..., num_inference_steps=50, guidance_scale=2.0, generator=torch.manual_seed(0),
         output_type="np")                                 # guidance on the image (trained with dropout)

Images are PIL images (any mode), numpy arrays (channels-last) or torch tensors (channels-first),
uint8, uint16 or float in [0, 1], one, a batch or a list, laid out as diffusers' VaeImageProcessor
reads them and converted to the model's channels as the trainer converts (pipeline_images.py); any
size whose sides the UNet (and the VAE) can halve, square or not; an inpainting mask in any common
form (pipeline_masks.py). The trainer saves a copy of this file beside model_index.json with
pipeline_class_conditional.py, pipeline_latent.py, pipeline_images.py and pipeline_masks.py (its
relative imports), so diffusers loads the folder without the training package. torch and diffusers
only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderTiny, DDPMScheduler, ImagePipelineOutput, UNet2DModel, VQModel
from diffusers.image_processor import VaeImageProcessor

# diffusers copies only the loaded file's own relative imports into its module cache (trust_remote_code):
# each file the pipeline needs is imported here directly, pipeline_class_conditional's pipeline_backbone too
from .pipeline_backbone import sample_shape  # noqa: F401
from .pipeline_class_conditional import (
    PackagePipeline,
    _randn,
    check_guidance_trained,
    guided_step,
    initial_noise_sigma,
)
from .pipeline_images import WHITE, image_batch
from .pipeline_latent import decode_latents, encode_posterior, latent_normalization, vae_scale_factor
from .pipeline_masks import binary_masks, mask_processor

PIPELINE_MODULE = "pipeline_image_conditioned"  # this file's name in an exported folder, without .py
PIPELINE_CLASS = "ImageConditionedPipeline"
CONDITIONING_KINDS = ("super_resolution", "inpainting", "image")
# No guidance by default: a model trained without --conditioning_dropout_prob has no dropped-condition
# prediction to guide with. A literal: the commands read it from this file's text (evaluation/choices.py).
DEFAULT_IMAGE_GUIDANCE_SCALE = 1.0
# The noise level a super-resolution model trained with conditioning augmentation (max_noise_level > 0)
# is sampled at unless told: diffusers' StableDiffusionUpscalePipeline's default.
DEFAULT_NOISE_LEVEL = 20


def condition_channels(kind: str, channels: int) -> int:
    """The condition's channels for `channels`-channel samples (pixels, or latents): an image of
    theirs, and for inpainting the mask before it (none for the trainer's --conditioning none)."""
    return 0 if kind == "none" else channels + (kind == "inpainting")


def sample_channels(kind: str, in_channels: int) -> int:
    """The channels of x_t of a UNet with `in_channels` inputs conditioned on `kind`: the inverse of
    condition_channels (in_channels = C + condition_channels(kind, C)). The one rule: the pipeline,
    the trainer's model line and data channels, and a fine-tune's base read it here."""
    return in_channels if kind == "none" else (in_channels - (kind == "inpainting")) // 2


def quantize(images: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] rounded to 8-bit levels, as a saved image is."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1


def shrink(images: torch.Tensor, factor: int) -> torch.Tensor:
    """Bicubic downsampling by `factor`, antialiased as an image is shrunk (SR3): training's
    degradation before its rounding to 8 bits."""
    height, width = images.shape[-2:]
    return F.interpolate(images.float(), size=(height // factor, width // factor), mode="bicubic", antialias=True,
                         align_corners=False)


def degrade(images: torch.Tensor, factor: int) -> torch.Tensor:
    """The low-resolution input that super-resolution learns from, of images [B, C, H, W] in [-1, 1]:
    shrunk by `factor`, rounded to 8 bits as the low-resolution images users bring are."""
    return quantize(shrink(images, factor))


def back_project(images: torch.Tensor, low_resolution: torch.Tensor, factor: int, steps: int) -> torch.Tensor:
    """Iterative back-projection (Irani & Peleg 1991) of upscaled `images` [B, C, H, W] in [-1, 1]
    onto their `low_resolution` input: `steps` times, the bicubic upsampling of what the input and
    the images shrunk as training degrades them differ by is added, so that the images, shrunk
    again, come back as the input; clamped to [-1, 1] at the end. Affine in `images` (before the
    clamp), so the back-projection of a mean of samples is the mean of theirs."""
    images = images.float()
    for _ in range(steps):
        difference = low_resolution.float() - shrink(images, factor)
        images = images + F.interpolate(difference, size=images.shape[-2:], mode="bicubic", align_corners=False)
    return images.clamp(-1, 1)


def noise_low_resolution(images: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Conditioning augmentation (Ho et al. 2021, cascaded diffusion; diffusers' Stable Diffusion x4
    upscaler): low-resolution `images` [B, C, h, w] in [-1, 1] noised with `noise` to `levels` [B]
    (integers >= 0), the forward process of DDPM's linear schedule (DDPMScheduler's defaults, 1,000
    steps) after that many of its steps: sqrt(abar) x + sqrt(1 - abar) noise, level 0 the images as
    given (the upscaler's low_res_scheduler.add_noise counts its timesteps from one step in)."""
    alphas_cumprod = torch.cat([torch.ones(1), DDPMScheduler().alphas_cumprod]).to(images.device)
    abar = alphas_cumprod[levels.long().to(images.device)].float().view(-1, 1, 1, 1)
    return abar.sqrt() * images.float() + (1 - abar).sqrt() * noise.float()


def upsample(low_resolution: torch.Tensor, factor: int) -> torch.Tensor:
    """Bicubic upsampling by `factor`, clamped to [-1, 1]: super-resolution's condition, and the
    bicubic baseline it is measured against."""
    height, width = low_resolution.shape[-2:]
    return F.interpolate(low_resolution.float(), size=(height * factor, width * factor), mode="bicubic",
                         align_corners=False).clamp(-1, 1)


def pixel_condition(kind: str, image: torch.Tensor, mask: torch.Tensor | None = None, factor: int = 1) -> torch.Tensor:
    """The condition in pixels [B, Cc, H, W]: super_resolution, the low-resolution `image` upsampled;
    inpainting, the `mask` (1 = to fill) and the image with the masked pixels set to 0 (grey);
    image, the conditioning image itself."""
    if kind == "super_resolution":
        return upsample(image, factor)
    if kind == "inpainting":
        return torch.cat([mask, image * (mask < 0.5)], dim=1)
    return image


@torch.no_grad()
def encode_normalised(vae, pixels: torch.Tensor) -> torch.Tensor:
    """The VAE posterior's mean of pixels in [-1, 1] (a VQModel's or AutoencoderTiny's deterministic
    latents; pipeline_latent.encode_posterior, the trainer's encode), normalised as the UNet's latents
    are (pipeline_latent.latent_normalization)."""
    shift, scale = (value.to(pixels.device).view(1, -1, 1, 1)
                    for value in latent_normalization(vae.config, vae.config.latent_channels))
    mean, _ = encode_posterior(vae, pixels)
    return (mean - shift) * scale


def latent_condition(kind: str, pixels: torch.Tensor, vae) -> torch.Tensor:
    """A pixel condition (pixel_condition) in the latent space: its image encoded by the same VAE
    (LDM, Stable Diffusion inpainting), an inpainting mask pooled to the latents' size (a latent is
    to be filled where any of its pixels is)."""
    if kind != "inpainting":
        return encode_normalised(vae, pixels)
    encoded = encode_normalised(vae, pixels[:, 1:])
    factor = pixels.shape[-1] // encoded.shape[-1]
    return torch.cat([F.max_pool2d(pixels[:, :1], factor), encoded], dim=1)


class ImageConditionedPipeline(PackagePipeline):
    """Super-resolution, inpainting or image-to-image generation with a UNet2DModel whose input is
    x_t and the condition's channels, in pixels or, with a `vae`, in its latents."""

    model_cpu_offload_seq = "vae->unet->vae"
    _optional_components = ["vae"]  # latent models only

    def __init__(self, unet: UNet2DModel, scheduler, vae: AutoencoderKL | VQModel | AutoencoderTiny | None = None,
                 conditioning: str = "super_resolution", sr_factor: int = 4,
                 conditioning_dropout_prob: float | None = None, max_noise_level: int = 0,
                 background: list[int] | None = None):
        super().__init__()
        if conditioning not in CONDITIONING_KINDS:
            raise ValueError(f"conditioning {conditioning!r} is not one of {', '.join(CONDITIONING_KINDS)}")
        self.register_modules(unet=unet, scheduler=scheduler, vae=vae)
        # conditioning_dropout_prob: the trainer's, which taught the prediction without the image that
        # guidance needs (check_guidance); None: not recorded. max_noise_level: the highest noise level
        # of conditioning augmentation in training (0: none), as diffusers' upscaler records it.
        # background: the RGB (0..255) the trainer composited transparent images on (--background),
        # on which transparent inputs are composited alike; None (an older export): white
        self.register_to_config(conditioning=conditioning, sr_factor=int(sr_factor),
                                conditioning_dropout_prob=conditioning_dropout_prob,
                                max_noise_level=int(max_noise_level),
                                background=None if background is None else [int(v) for v in background])
        # pixels per latent, as diffusers' pipelines name it (1: a pixel model)
        self.vae_scale_factor = vae_scale_factor(vae.config) if vae is not None else 1
        # [0, 1] <-> [-1, 1] and the outputs' types, built once (image_batch reads the inputs' layouts)
        self.image_processor = VaeImageProcessor(do_resize=False, vae_latent_channels=-1)
        self.mask_processor = mask_processor()

    @property
    def sample_channels(self) -> int:
        """The channels of x_t (pixels, or latents): the UNet's input less the condition's."""
        return sample_channels(self.config.conditioning, self.unet.config.in_channels)

    @property
    def image_channels(self) -> int:
        """The channels of the images it takes and makes: 1 (grayscale) or 3 (RGB)."""
        return self.vae.config.in_channels if self.vae is not None else self.sample_channels

    @property
    def background(self) -> tuple:
        """The RGB (0..255) transparent inputs are composited on: the run's --background."""
        return tuple(self.config.get("background") or WHITE)

    @property
    def size_multiple(self) -> int:
        """What each side of an output image must be a multiple of: the UNet halves it once per
        block but the last, after the VAE's downsampling."""
        return 2 ** (len(self.unet.config.block_out_channels) - 1) * self.vae_scale_factor

    def preprocess_image(self, image) -> torch.Tensor:
        """The `image` argument (image_batch: any PIL mode, numpy, torch, lists) -> fp32 [B, C, H, W] in
        [-1, 1] on the execution device, C the pipeline's image channels."""
        images = image_batch(image, self.image_channels, background=self.background)
        return self.image_processor.preprocess(images).float().to(self._execution_device)

    def prepare_mask(self, mask_image, pixels: torch.Tensor) -> torch.Tensor | None:
        """An inpainting pipeline's mask_image for its images `pixels` [B, C, H, W]: fp32 [B, 1, H, W]
        of 0 and 1 (1 = to fill) on the execution device, read by the one mask rule
        (pipeline_masks.binary_masks: every common form; another size of the same aspect resized
        as diffusers' mask processor resizes); one mask for all the images or one each. None for
        the other kinds, which refuse a mask."""
        kind = self.config.conditioning
        if kind != "inpainting":
            if mask_image is not None:
                raise ValueError(f"mask_image is for inpainting; this pipeline's conditioning is {kind}")
            return None
        if mask_image is None:
            raise ValueError("an inpainting pipeline needs mask_image (white = to fill)")
        mask = binary_masks(mask_image, tuple(pixels.shape[-2:]), processor=self.mask_processor)
        if len(mask) not in (1, len(pixels)):
            raise ValueError(f"mask_image holds {len(mask)} masks for {len(pixels)} images; give one mask, or one "
                             "per image")
        return mask.to(self._execution_device).expand(len(pixels), 1, *pixels.shape[-2:])

    def check_guidance(self, guidance_scale: float) -> None:
        """Guidance on the image of a model trained without --conditioning_dropout_prob refused
        (check_guidance_trained): its prediction without the image was never trained."""
        check_guidance_trained(guidance_scale, self.config.get("conditioning_dropout_prob"),
                               "--conditioning_dropout_prob")

    def noise_levels(self, noise_level: int | None, count: int) -> torch.Tensor | None:
        """The UNet's class_labels: `noise_level` (default DEFAULT_NOISE_LEVEL) for each of `count`
        images of a model trained with conditioning augmentation, None for one trained without (where
        a noise_level is refused: the model never saw one)."""
        maximum = self.config.get("max_noise_level", 0)
        if not maximum:
            if noise_level:
                raise ValueError(f"noise_level={noise_level}: this model was trained without conditioning "
                                 "augmentation (--max_noise_level): leave noise_level out")
            return None
        noise_level = DEFAULT_NOISE_LEVEL if noise_level is None else noise_level
        if not 0 <= noise_level <= maximum:
            raise ValueError(f"noise_level={noise_level}: it must lie in [0, max_noise_level {maximum}]")
        return torch.full((count,), int(noise_level), dtype=torch.long, device=self._execution_device)

    def check_size(self, height: int, width: int) -> None:
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"the output would be {height}x{width} (height x width); this pipeline's UNet"
                             f"{' and VAE need' if self.vae is not None else ' needs'} sides that are multiples of "
                             f"{multiple}: crop or pad the input")

    @torch.no_grad()
    def __call__(self, image, mask_image=None, num_inference_steps: int = 50,
                 guidance_scale: float = DEFAULT_IMAGE_GUIDANCE_SCALE,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, guidance_interval: tuple[float, float] | None = None,
                 callback_on_step_end=None, eta: float = 0.0, latents: torch.Tensor | None = None,
                 back_projection_steps: int = 0, num_images_per_prompt: int = 1, noise_level: int | None = None):
        """Images made from `image`: for super_resolution the low-resolution input (the output is
        sr_factor x its size), for inpainting the image whose `mask_image` pixels (white, >= 0.5) are
        filled (the others come back as given), for image-to-image the conditioning image (the output
        has its size). guidance_scale > 1 guides on the image (the prediction with the condition
        dropped as the weak one; refused for a model whose export records that it trained without
        --conditioning_dropout_prob), within
        guidance_interval (low, high] of noise level sigma if given (ClassConditionalPipeline's
        guidance). A list of generators gives image i its own noise. output_type: "pil", "np" (float
        [N, H, W, C] in [0, 1]), "pt" ([N, C, H, W] in [0, 1]) or, with a VAE, "latent". eta: DDIM's
        (schedulers without one ignore it); latents: the starting noise [B, C, h, w] (unit Gaussian,
        scaled here by the scheduler's initial sigma) instead of drawing it from `generator`
        (LatentDiffusionPipeline's).
        callback_on_step_end(pipe, step, t, {"latents": x_t}) -> dict runs after each step, as in
        diffusers' pipelines (a returned "latents" replaces x_t). back_projection_steps (super-resolution
        only; default 0, none): that many steps of iterative back-projection (back_project) of each
        output onto its input, so that the output, shrunk as training degrades images, gives the
        input back (the analogue of inpainting's kept pixels); docs/conditioning.md has its gains.
        num_images_per_prompt: samples of each input image (diffusers' img2img pipelines' name), image
        i's at outputs i x n ... i x n + n - 1 (a list of generators: one per output).
        noise_level (a super-resolution model trained with --max_noise_level; default 20, diffusers'
        upscaler's): the input is noised to that level (noise_low_resolution, its noise drawn from
        `generator` before the initial noise, as diffusers' upscaler draws it) before it conditions
        the model, which is told the level."""
        kind, device = self.config.conditioning, self._execution_device
        if back_projection_steps and (kind != "super_resolution" or back_projection_steps < 0):
            raise ValueError(f"back_projection_steps={back_projection_steps}: a count of steps >= 0, for "
                             f"super-resolution only (this pipeline's conditioning is {kind})")
        if back_projection_steps and output_type == "latent" and self.vae is not None:
            raise ValueError("back_projection_steps works on pixels: ask for output_type 'pil', 'np' or 'pt'")
        self.check_guidance(guidance_scale)
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt={num_images_per_prompt}: give at least 1")
        pixels = self.preprocess_image(image)
        mask = self.prepare_mask(mask_image, pixels)
        if num_images_per_prompt > 1:  # each image (and its mask) n times, in turn
            pixels, mask = (x if x is None else x.repeat_interleave(num_images_per_prompt, 0) for x in (pixels, mask))
        levels = self.noise_levels(noise_level, len(pixels))
        condition = pixel_condition(kind, self.augmented(pixels, levels, generator), mask, self.config.sr_factor)
        self.check_size(*condition.shape[-2:])
        if self.vae is not None:
            condition = latent_condition(kind, condition, self.vae)
        # diffusers' order: the schedule first, then the initial noise at its sigma (init_noise_sigma
        # is the first step's for Euler-type schedulers, which set_timesteps computes; 1 for flow ones)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        shape = (len(condition), self.sample_channels, *condition.shape[-2:])
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"Unexpected latents shape, got {tuple(latents.shape)}, expected {shape}")
        noise = _randn(shape, generator, device) if latents is None else latents.to(device, torch.float32)
        sample = noise * initial_noise_sigma(self.scheduler)
        for step in self.progress_bar(range(len(self.scheduler.timesteps))):  # x_t stays fp32
            sample = guided_step(self.scheduler, self.unet, sample, step, levels, guidance_scale, generator,
                                 guidance_interval=guidance_interval, condition=condition, eta=eta)
            if callback_on_step_end is not None:
                returned = callback_on_step_end(self, step, self.scheduler.timesteps[step], {"latents": sample})
                sample = (returned or {}).get("latents", sample)
        if output_type == "latent" and self.vae is not None:
            images = sample
        else:
            images = sample if self.vae is None else decode_latents(self.vae, sample)
            if back_projection_steps:
                images = back_project(images, pixels.to(images.device), self.config.sr_factor, back_projection_steps)
            if mask is not None:  # the pixels outside the mask, as given
                images = torch.where(mask >= 0.5, images, pixels)
            images = self.image_processor.postprocess(images, output_type=output_type)
        self.maybe_free_model_hooks()  # after the VAE's decode, as diffusers' pipelines free them
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def augmented(self, pixels: torch.Tensor, levels: torch.Tensor | None, generator) -> torch.Tensor:
        """The low-resolution input noised to `levels` (noise_low_resolution), its noise drawn from
        `generator`; as given, and nothing drawn, at level 0 or without augmentation (so noise_level=0
        samples as a call that noises nothing)."""
        if levels is None or not levels.any():
            return pixels
        return noise_low_resolution(pixels, _randn(pixels.shape, generator, pixels.device), levels)


__all__ = ["CONDITIONING_KINDS", "DEFAULT_IMAGE_GUIDANCE_SCALE", "DEFAULT_NOISE_LEVEL", "ImageConditionedPipeline",
           "back_project", "condition_channels", "degrade", "encode_normalised", "latent_condition",
           "noise_low_resolution", "pixel_condition", "quantize", "sample_channels", "shrink", "upsample"]
