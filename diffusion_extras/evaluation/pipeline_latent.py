"""A latent diffusion pipeline: a frozen autoencoder (an AutoencoderKL, or a VQModel or an
AutoencoderTiny, whose deterministic latents it decodes as diffusers' LDMPipeline does), a
UNet2DModel trained on its normalised latents (with a class embedding or without) and any
diffusers scheduler:

    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    images = pipe(batch_size=4, num_inference_steps=50, generator=torch.manual_seed(0)).images
    images = pipe(class_labels=pipe.get_label_ids(["3", "7"]), guidance_scale=2.0).images  # class-conditional
    latents = pipe(batch_size=4, output_type="latent").images   # the UNet's latents, not decoded

The trainer saves a copy of this file and of pipeline_class_conditional.py (its guidance, imported
relatively) beside model_index.json, whose `_class_name` is ["pipeline_latent",
"LatentDiffusionPipeline"]: diffusers loads both without the training package (its custom-pipeline
convention copies a module's relative imports with it). torch and diffusers only.
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKL, AutoencoderTiny, ImagePipelineOutput, UNet2DModel, VQModel

# diffusers copies only the loaded file's own relative imports into its module cache (trust_remote_code):
# each file the pipeline needs is imported here directly, pipeline_class_conditional's pipeline_backbone too
from .pipeline_backbone import sample_shape
from .pipeline_class_conditional import (
    DEFAULT_GUIDANCE_SCALE,
    ClassConditionalPipeline,
    _randn,
    guided_step,
    initial_noise_sigma,
)

PIPELINE_CLASS = "LatentDiffusionPipeline"


def latent_normalization(vae_config, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale) per latent channel, the UNet's latents being (z - shift) x scale: with the
    VAE config's latents_mean and latents_std (SDXL's convention) shift = mean and scale =
    scaling_factor / std; else shift = shift_factor (SD3's; 0 when None) and scale = scaling_factor."""
    scaling = float(vae_config.get("scaling_factor") or 1.0)
    mean, std = vae_config.get("latents_mean"), vae_config.get("latents_std")
    if mean is not None and std is not None:
        return (torch.tensor(mean, dtype=torch.float32).reshape(channels),
                scaling / torch.tensor(std, dtype=torch.float32).reshape(channels))
    shift = float(vae_config.get("shift_factor") or 0.0)
    return torch.full((channels,), shift), torch.full((channels,), scaling)


def vae_scale_factor(vae_config) -> int:
    """Pixels per latent along each side: the encoder halves the image once per block but the last
    (diffusers' pipelines compute their vae_scale_factor so; an AutoencoderTiny config may name only
    its encoder's blocks)."""
    blocks = vae_config.get("block_out_channels") or vae_config.get("encoder_block_out_channels")
    return 2 ** (len(blocks) - 1)


@torch.no_grad()
def encode_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior's (mean, std), float32, of pixels in [-1, 1] on its device, encoded in fp32
    outside autocast: the one encode of the package (the trainer's latent cache and stream,
    data/latents.py, and the image-conditioned pipeline's condition import it from here, as exported
    pipelines load without the package). A deterministic encoder (a VQModel's latents before
    quantisation, which its decoder quantises, as diffusers' LDMPipeline decodes them; an
    AutoencoderTiny's) has std 0: every draw is its latent."""
    with torch.autocast(pixels.device.type, enabled=False):
        output = vae.encode(pixels.to(vae.dtype))
    distribution = getattr(output, "latent_dist", None)
    if distribution is None:
        return output.latents.float(), torch.zeros_like(output.latents, dtype=torch.float32)
    return distribution.mean.float(), distribution.std.float()


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The UNet's normalised latents [B, C, h, w] -> images in [-1, 1], fp32: un-normalised, then
    the VAE's decoder. A VAE whose config says force_upcast decodes in fp32 and is given back in the
    dtype it had (as diffusers' SDXL pipeline upcasts for the decode only)."""
    shift, scale = (value.to(latents.device).view(1, -1, 1, 1)
                    for value in latent_normalization(vae.config, latents.shape[1]))
    dtype = vae.dtype
    upcast = bool(vae.config.get("force_upcast")) and dtype != torch.float32
    if upcast:
        vae.to(torch.float32)
    try:
        return vae.decode((latents.float() / scale + shift).to(vae.dtype)).sample.float()
    finally:
        if upcast:
            vae.to(dtype)


class LatentDiffusionPipeline(ClassConditionalPipeline):
    """Image generation in a VAE's latent space, unconditional or class-conditional (classifier-free
    guidance, autoguidance and the guidance interval as ClassConditionalPipeline)."""

    model_cpu_offload_seq = "unet->vae"

    def __init__(self, vae: AutoencoderKL | VQModel | AutoencoderTiny, unet: UNet2DModel, scheduler,
                 id2label: dict | None = None, guide: UNet2DModel | None = None,
                 condition_dropout: float | None = None):
        super().__init__(unet=unet, scheduler=scheduler, id2label=id2label, guide=guide,
                         condition_dropout=condition_dropout)
        self.register_modules(vae=vae)
        self.vae_scale_factor = vae_scale_factor(vae.config)  # pixels per latent, as diffusers' pipelines name it

    @torch.no_grad()
    def __call__(self, class_labels: list[int] | None = None, batch_size: int = 1,
                 guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
                 generator: torch.Generator | list[torch.Generator] | None = None, num_inference_steps: int = 50,
                 output_type: str = "pil", return_dict: bool = True,
                 guidance_interval: tuple[float, float] | None = None, autoguidance: bool | None = None,
                 eta: float = 0.0, latents: torch.Tensor | None = None):
        """`batch_size` images of an unconditional UNet, or images of `class_labels` (ids; see
        get_label_ids) of a class-conditional one, guided as ClassConditionalPipeline.__call__.
        eta: DDIM's (as diffusers' LDMPipeline; schedulers without one ignore it). latents: the
        starting noise [B, C, h, w] (unit Gaussian, scaled here by init_noise_sigma), instead of
        drawing it from `generator`. output_type: "pil", "np" (float [N, H, W, C] in [0, 1]), "pt",
        or "latent" (the UNet's normalised latents, not decoded)."""
        unet, device = self.unet, self._execution_device
        conditional = unet.config.num_class_embeds is not None
        if conditional != (class_labels is not None):
            raise ValueError("a class-conditional UNet needs class_labels (ids, see get_label_ids)" if conditional
                             else "this UNet is unconditional: give batch_size, not class_labels")
        guide = self.guide_for(autoguidance)
        labels = None
        if conditional:
            labels = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1).to(device)
            if len(labels) == 0 or labels.min() < 0 or labels.max() >= unet.config.num_class_embeds - 1:
                raise ValueError(f"class_labels must be ids in [0, {unet.config.num_class_embeds - 1}); "
                                 f"got {list(class_labels)}")
            batch_size = len(labels)
            self.check_guidance(guidance_scale, guide)
        elif guide is None:
            guidance_scale = 1.0  # nothing to guide with: the UNet's own prediction
        shape = (batch_size, *sample_shape(unet))
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"Unexpected latents shape, got {tuple(latents.shape)}, expected {shape}")
        self.scheduler.set_timesteps(num_inference_steps, device=device)  # before init_noise_sigma, as diffusers
        noise = _randn(shape, generator, device) if latents is None else latents.to(device, torch.float32)
        latents = noise * initial_noise_sigma(self.scheduler)
        for step in self.progress_bar(range(len(self.scheduler.timesteps))):  # fp32 whatever the UNet's dtype
            latents = guided_step(self.scheduler, unet, latents, step, labels, guidance_scale, generator,
                                  guide=guide, guidance_interval=guidance_interval, eta=eta)
        if output_type == "latent":
            images = latents
        else:
            images = (decode_latents(self.vae, latents) / 2 + 0.5).clamp(0, 1)
            if output_type != "pt":
                images = images.cpu().permute(0, 2, 3, 1).numpy()
                if output_type == "pil":
                    images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)


__all__ = ["LatentDiffusionPipeline", "decode_latents", "encode_posterior", "latent_normalization",
           "vae_scale_factor"]
