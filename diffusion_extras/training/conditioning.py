"""Image conditions in training (--conditioning): the condition of each image, made from the
batch the data source serves (the image, with a stored condition beside it: data/conditioning.py)
with the exported pipeline's own functions (evaluation/pipeline_image_conditioned.py), so that
training and sampling condition alike:

    super_resolution   the image degraded by --sr_factor (antialiased bicubic, 8-bit), upsampled back
    inpainting         the mask (stored, or random_mask from (seed, micro-step, image)) and the masked image
    image              the stored conditioning image

In a latent run the target is the image's latent (the posterior drawn with the step's eps) and the
condition is encoded by the same VAE (its mean, normalised as the latents; a mask pooled to their
size); the images are encoded in the step, as a streamed latent run's are. --conditioning_dropout_prob
replaces a drawn share of the conditions by zeros; --max_noise_level noises super-resolution's
low-resolution inputs to a drawn level that the UNet is told (conditioning augmentation). Every
random choice is a function of (seed, micro-step, image): a resume and any number of ranks
condition alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from diffusion_extras.data import batch_order
from diffusion_extras.data.conditioning import random_masks
from diffusion_extras.data.images import BACKGROUNDS
from diffusion_extras.data.latents import Posterior
from diffusion_extras.evaluation.pipeline_image_conditioned import (
    degrade,
    latent_condition,
    noise_low_resolution,
    pixel_condition,
)

MASK_STREAM = 0x4D41534B  # seed stream of the random inpainting masks


class ConditionNoise(NamedTuple):
    """Super-resolution's conditioning augmentation of a batch (--max_noise_level): each low-resolution
    input's noise level (the UNet's class_labels) and its noise, drawn from (seed, micro-step)."""
    levels: torch.Tensor  # long [B], 0 to max_noise_level
    noise: torch.Tensor   # [B, C, H / sr_factor, W / sr_factor]


@dataclass(frozen=True)
class ImageCondition:
    """A run's image condition: its kind and what its batches hold."""
    kind: str                  # super_resolution, inpainting or image
    image_channels: int        # C: each image's channels in a batch (pixels)
    stored_channels: int       # S: a stored condition's channels after them (a mask 1, an image C); 0: derived
    sr_factor: int             # super_resolution's factor
    seed: int                  # the run's seed: random masks are drawn from (seed, micro-step, image)
    vae: object | None = None  # latent diffusion: the frozen VAE that encodes the condition (on the device)
    dropout: float | None = None  # --conditioning_dropout_prob: guidance on the image needs it > 0 (None: not known)
    max_noise_level: int = 0   # super_resolution's conditioning augmentation: levels 0..this (0: none)
    background: tuple = BACKGROUNDS["white"]  # --background: the RGB transparent images were composited on

    def pipeline_config(self) -> dict:
        """What the exported ImageConditionedPipeline records of it."""
        return {"conditioning": self.kind, "sr_factor": self.sr_factor, "conditioning_dropout_prob": self.dropout,
                "max_noise_level": self.max_noise_level, "background": list(self.background)}

    def low_resolution_shape(self, batch_shape) -> tuple | None:
        """(C, h, w) of the low-resolution inputs of a batch of `batch_shape` [B, C + S, H, W] that
        conditioning augmentation noises; None without it."""
        if not self.max_noise_level:
            return None
        height, width = batch_shape[-2:]
        return (self.image_channels, height // self.sr_factor, width // self.sr_factor)

    def mask_seeds(self, micro_step: int, first: int, count: int) -> list[int]:
        """The random masks' seeds of images first..first+count-1 of a global micro-batch."""
        return [batch_order.mix_seed(self.seed, micro_step, MASK_STREAM, index)
                for index in range(first, first + count)]

    def split(self, pixels: torch.Tensor, mask_seeds: list[int],
              augmentation: ConditionNoise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the images, their condition in pixels) of a batch in [-1, 1] [B, C + S, H, W];
        super-resolution's low-resolution inputs noised by `augmentation` where given."""
        images, stored = pixels[:, :self.image_channels], pixels[:, self.image_channels:]
        if self.kind == "super_resolution":
            low_resolution = degrade(images, self.sr_factor)
            if augmentation is not None:
                low_resolution = noise_low_resolution(low_resolution, augmentation.noise, augmentation.levels)
            return images, pixel_condition(self.kind, low_resolution, factor=self.sr_factor)
        if self.kind == "inpainting":
            if self.stored_channels:
                mask = (stored > 0).float()  # a stored mask, binarised at half its range
            else:  # drawn on the CPU; pinned, its copy to a GPU does not wait for the stream (no host sync)
                mask = torch.from_numpy(random_masks(*images.shape[-2:], mask_seeds))
                if images.device.type == "cuda":
                    mask = mask.pin_memory()
                mask = mask.to(images.device, non_blocking=True)
            return images, pixel_condition(self.kind, images, mask)
        return images, stored

    def in_model_space(self, condition: torch.Tensor) -> torch.Tensor:
        """A pixel condition as the UNet takes it: as it is, or encoded by the VAE (latent_condition)."""
        return condition if self.vae is None else latent_condition(self.kind, condition, self.vae)

    def inputs(self, batch: torch.Tensor, device, mask_seeds: list[int], flip: torch.Tensor | None = None,
               posterior: Posterior | None = None, noise: torch.Tensor | None = None,
               drops: torch.Tensor | None = None,
               augmentation: ConditionNoise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the UNet's clean input, its condition) of a data source's batch: pixels in [-1, 1], flipped
        where `flip` (image and stored condition together); with a `posterior` the images' latents
        (drawn with `noise`; the means without). `drops`: conditions replaced by zeros;
        `augmentation`: super-resolution's inputs noised (conditioning augmentation)."""
        images, condition = self.split(batch_order.to_model_input(batch, device, flip), mask_seeds, augmentation)
        clean = images if posterior is None else posterior.draw(*posterior.encode_pixels(images, device), device, noise)
        condition = self.in_model_space(condition)
        if drops is not None:
            condition = torch.where(drops.view(-1, 1, 1, 1), torch.zeros_like(condition), condition)
        return clean, condition

    def fixed_inputs(self, batch: torch.Tensor, device, posterior: Posterior | None = None) -> tuple:
        """`inputs` with fixed masks (the same at every call: the held-out loss, the gradient probe)
        and the latents' means: what clean_input gives the monitors of a conditional run (with
        conditioning augmentation, at level 0: pipeline_class_conditional.unconditional_inputs)."""
        return self.inputs(batch, device, self.mask_seeds(batch_order.VALIDATION_STREAM, 0, len(batch)),
                           posterior=posterior)


def for_run(kind: str, image_channels: int, stored_channels: int, sr_factor: int, seed: int,
            vae=None, dropout: float | None = None, max_noise_level: int = 0,
            background: tuple = BACKGROUNDS["white"]) -> ImageCondition | None:
    """The run's ImageCondition, or None for --conditioning none."""
    if kind == "none":
        return None
    return ImageCondition(kind, image_channels, stored_channels, sr_factor, seed, vae, dropout, max_noise_level,
                          background)


def conditions_of(spec: ImageCondition, images: np.ndarray, seed: int) -> dict:
    """What the pipeline takes for stored images [N, C + S, H, W] (a source's reference or held-out
    images, any dtype): {"images": the targets, "image": the pipeline's `image` argument,
    "mask_image": its mask (inpainting), "shown": the condition as a grid shows it}, each a float
    tensor in [0, 1] (masks 0 or 1), with fixed masks from `seed`."""
    pixels = batch_order.to_model_input(torch.from_numpy(np.ascontiguousarray(images)), "cpu")
    targets, condition = spec.split(pixels, spec.mask_seeds(seed, 0, len(images)))
    unit = (lambda x: (x + 1) / 2)  # noqa: E731  [-1, 1] -> [0, 1], as diffusers' image processor takes tensors
    found = {"images": unit(targets), "shown": unit(condition[:, -targets.shape[1]:])}
    if spec.kind == "super_resolution":
        found["image"] = unit(degrade(targets, spec.sr_factor))
    elif spec.kind == "inpainting":
        found["image"], found["mask_image"] = unit(targets), condition[:, :1]
    else:
        found["image"] = unit(condition)
    return found
