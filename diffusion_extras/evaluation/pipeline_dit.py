"""A DiT pipeline: a DiTTransformer2DModel trained by this trainer, with any number of classes or
none, any diffusers scheduler and classifier-free guidance with the model's own "no class" entry,
called as diffusers' DiTPipeline is:

    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    images = pipe(class_labels=pipe.get_label_ids(["3", "7"]), guidance_scale=2.0,
                  num_inference_steps=50, generator=torch.manual_seed(0)).images
    images = unconditional_pipe(batch_size=4, generator=torch.manual_seed(0)).images
    latents = latent_pipe(class_labels=[3], output_type="latent").images  # a latent DiT's, not decoded

Why not DiTPipeline itself: it takes ImageNet's "no class" (1000) whatever the model's number of
classes, always guides (an unconditional model has nothing to guide with), and reads a DDPM-type
scheduler's step (its learned sigma split assumes latents). Here the sampling loop is the
class-conditional pipeline's (guided_step): the same guidance, learned-variance handling and
scheduler order.

A DiT trained on a VAE's latents has the VAE as `vae` (DiTPipeline's name too), which decodes its
samples as the latent pipeline does (decode_latents: the latents un-normalised by the VAE config's
scaling, then decoded); a pixel-space DiT has none.

Self-contained (torch and diffusers only): the trainer saves a copy beside model_index.json, whose
`_class_name` is ["pipeline_dit", "DiTClassPipeline"], with the files it imports relatively.
"""
from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel, ImagePipelineOutput

# diffusers copies only the loaded file's own relative imports into its module cache (trust_remote_code):
# each file the pipeline needs is imported here directly
from .pipeline_backbone import null_class, sample_shape
from .pipeline_class_conditional import (
    DEFAULT_GUIDANCE_SCALE,
    LabelledPipeline,
    _randn,
    guided_step,
    initial_noise_sigma,
)
from .pipeline_latent import decode_latents

PIPELINE_MODULE = "pipeline_dit"  # this file's name in an exported folder, without .py
PIPELINE_CLASS = "DiTClassPipeline"


class DiTClassPipeline(LabelledPipeline):
    """Image generation with a DiTTransformer2DModel (`transformer`, DiTPipeline's name for it),
    class-conditional with classifier-free guidance when `id2label` names its classes, else
    unconditional."""

    model_cpu_offload_seq = "transformer->vae"
    # vae: a latent DiT's; guide: autoguidance's weaker DiT (check_guide), saved in guide/ when there is one
    _optional_components = ["vae", "guide"]

    def __init__(self, transformer: DiTTransformer2DModel, scheduler, vae=None, id2label: dict | None = None,
                 condition_dropout: float | None = None, guide=None):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae, guide=guide)
        self.register_labels(id2label, condition_dropout)

    @torch.no_grad()
    def __call__(self, class_labels: list[int] | None = None, guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
                 generator: torch.Generator | list[torch.Generator] | None = None, num_inference_steps: int = 50,
                 output_type: str = "pil", return_dict: bool = True,
                 guidance_interval: tuple[float, float] | None = None, batch_size: int = 1,
                 autoguidance: bool | None = None):
        """Images of `class_labels` (ids; see get_label_ids) with classifier-free guidance at
        `guidance_scale` (1: none; the "no class" prediction is the model's own entry,
        num_embeds_ada_norm), only where the noise level is in `guidance_interval` (low, high] when
        given (ClassConditionalPipeline.__call__). autoguidance: guide with the saved weaker model
        `self.guide` instead of the "no class" prediction (Karras et al. 2024); None: when the
        pipeline has one. An unconditional model (no id2label) takes no class_labels and makes
        `batch_size` images, unguided unless it has a guide. output_type: "pil", "np" or "pt", and
        for a latent DiT "latent" (its normalised latents, not decoded)."""
        transformer, device = self.transformer, self._execution_device
        guide = self.guide_for(autoguidance)
        if self.id2label:
            if class_labels is None:
                raise ValueError(f"a class-conditional DiT needs class_labels (ids in [0, {len(self.id2label)}), "
                                 "or names through get_label_ids)")
            labels = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1).to(device)
            classes = null_class(transformer)  # the ids below "no class"
            if len(labels) == 0 or labels.min() < 0 or labels.max() >= classes:
                raise ValueError(f"class_labels must be ids in [0, {classes}); got {list(class_labels)}")
            self.check_guidance(guidance_scale, guide)
        elif class_labels is not None:
            raise ValueError("this DiT is unconditional: leave class_labels out and give batch_size")
        else:
            labels = None
            if guide is None:
                guidance_scale = 1.0  # nothing to guide with: the "no class" model alone
        shape = (len(labels) if labels is not None else batch_size, *sample_shape(transformer))
        # timesteps first (diffusers' order): a sigma scheduler's init_noise_sigma follows them
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        sample = _randn(shape, generator, device) * initial_noise_sigma(self.scheduler)
        for step in self.progress_bar(range(len(self.scheduler.timesteps))):  # x_t stays fp32
            sample = guided_step(self.scheduler, transformer, sample, step, labels, guidance_scale, generator,
                                 guide=guide, guidance_interval=guidance_interval)
        if getattr(self, "vae", None) is not None:
            if output_type == "latent":
                self.maybe_free_model_hooks()
                return ImagePipelineOutput(images=sample) if return_dict else (sample,)
            sample = decode_latents(self.vae, sample)
        elif output_type == "latent":
            raise ValueError('output_type "latent" is for a DiT trained on a VAE\'s latents; this one is in pixels')
        return self.images_output(sample, output_type, return_dict)


__all__ = ["DiTClassPipeline"]
