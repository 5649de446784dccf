"""Latent diffusion's training data: every decoded image encoded once by the frozen VAE, in batches
on the accelerator, and stored by the decode-once cache's machinery (decode_cache: keyed by the
dataset's fingerprint, the preprocessing and the VAE's weights, the disk checked first, published
by one rename). What is stored is the VAE's posterior, mean and std, of the image and, with
--random_flip, of its mirror (a flip of the latent is not the latent of the flip); each step draws
its latent mean + std x eps with eps from (seed, micro-step), as EDM2 does, so a resume is bit-exact.

With --streaming there is no cache: the stream's pixel batches are encoded as they arrive, on the
accelerator (`Posterior.encoder`), each image flipped before it is encoded where the step's flip
says, and drawn from with the same eps: the same latents as the cached path's for the same images
(to the VAE's float rounding: its convolutions are not bit-identical across batch sizes).

Stored per image as a [h, w, views x 2 x C] float32 "image" (views: 1, or 2 with flips; mean then
std; C latent channels), so DecodedImages, MicroBatches and the batch order serve latents unchanged;
`Posterior` turns such a batch into the UNet's normalised input.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_extras.data import batch_order, decode_cache
from diffusion_extras.data.decode_cache import DecodedImages

LATENT_FORMAT = 1  # bump when the stored layout of latents changes
ENCODE_BATCH = 32  # images per VAE encoder call
STATISTICS_IMAGES = 2048  # streamed images the per-channel statistics are measured on (a VAE config without them)


@dataclass(frozen=True)
class Encoder:
    """The frozen VAE that encodes the training images, and what the stored latents depend on."""
    vae: object          # diffusers AutoencoderKL (eval, no gradients), on the device that encodes
    views: int           # 1, or 2 with --random_flip: the image and its mirror, each encoded
    fingerprint: str     # of the VAE's config and weights: names the cache
    factor: int = 1      # pixels per latent along each side (the cache's size check)

    @classmethod
    def of(cls, vae, random_flip: bool, factor: int = 1) -> Encoder:
        return cls(vae, 2 if random_flip else 1, vae_fingerprint(vae), factor)


def vae_fingerprint(vae) -> str:
    """sha256 of the VAE's config and every weight's bytes (a second for a Stable Diffusion VAE)."""
    digest = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode())
    for name, tensor in vae.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:20]


@dataclass(frozen=True)
class Posterior:
    """How a latent run's batches hold the posterior, and the UNet input drawn from it:
    (mean + std x eps - shift) x scale, per latent channel. Cached, a batch is the stored posteriors
    [B, views x 2 x C, h, w]; streamed (`encoder` set), it is pixels [B, C, H, W], encoded here."""
    channels: int          # latent channels C
    views: int             # 1, or 2 with --random_flip
    shift: torch.Tensor    # [C]: the VAE config's shift_factor or latents_mean, or the measured mean
    scale: torch.Tensor    # [C]: its scaling_factor (/ latents_std), or 1 / the measured std
    encoder: Encoder | None = None  # --streaming: the VAE that encodes each batch, on its device

    def latent_shape(self, batch_shape) -> tuple:
        factor = 1 if self.encoder is None else self.encoder.factor
        return (self.channels, *(side // factor for side in batch_shape[-2:]))

    def model_input(self, batch: torch.Tensor, device, flip: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None) -> torch.Tensor:
        """The normalised latent of each image (its mirror's where `flip`): mean + std x `noise`,
        or the mean alone without noise."""
        mean, std = self.stored(batch, device, flip) if self.encoder is None else self.encoded(batch, device, flip)
        return self.draw(mean, std, device, noise)

    def draw(self, mean: torch.Tensor, std: torch.Tensor, device, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The normalised latent mean + std x `noise` (the mean alone without noise)."""
        latent = mean if noise is None else mean + std * noise
        shift, scale = (value.to(device).view(1, -1, 1, 1) for value in (self.shift, self.scale))
        return (latent - shift) * scale

    def stored(self, batch: torch.Tensor, device, flip: torch.Tensor | None) -> tuple:
        """(mean, std) of each image, or of its mirror where `flip`, read from stored posteriors."""
        size, _, height, width = batch.shape
        posterior = batch.to(device, non_blocking=True).view(size, self.views, 2, self.channels, height, width)
        chosen = posterior[:, 0]
        if flip is not None and self.views == 2:
            chosen = torch.where(flip.view(-1, 1, 1, 1, 1), posterior[:, 1], chosen)
        return chosen.unbind(1)

    @torch.no_grad()
    def encoded(self, batch: torch.Tensor, device, flip: torch.Tensor | None) -> tuple:
        """(mean, std) of each streamed image, mirrored first where `flip` (encode_pixels)."""
        vae_device = next(self.encoder.vae.parameters()).device
        pixels = batch_order.to_model_input(batch, vae_device, None if flip is None else flip.to(vae_device))
        return self.encode_pixels(pixels, device)

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor, device) -> tuple:
        """(mean, std) on `device` of images in [-1, 1], encoded ENCODE_BATCH at a time on the VAE's
        device (outside autocast: fp32, as the cache encodes)."""
        pixels = pixels.to(next(self.encoder.vae.parameters()).device)
        parts = [encode(self.encoder.vae, pixels[first:first + ENCODE_BATCH])
                 for first in range(0, len(pixels), ENCODE_BATCH)]
        return tuple(torch.cat(values).to(device, non_blocking=True) for values in zip(*parts))


def encode(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior's (mean, std), float32, of pixels in [-1, 1] on its device: what the cache
    stores and what a stream's batches are turned into."""
    with torch.autocast(pixels.device.type, enabled=False):
        distribution = vae.encode(pixels.to(vae.dtype)).latent_dist
    return distribution.mean.float(), distribution.std.float()


def model_input(batch: torch.Tensor, device, flip=None, posterior: Posterior | None = None, noise=None):
    """The UNet's clean input of a data source's batch: pixels in [-1, 1] (batch_order.to_model_input),
    or with a `posterior` the normalised latent drawn with `noise`."""
    if posterior is None:
        return batch_order.to_model_input(batch, device, flip)
    return posterior.model_input(batch, device, flip, noise)


@torch.no_grad()
def iter_encoded(images: DecodedImages, encoder: Encoder, progress: bool = False):
    """Each image's posterior as [h, w, views x 2 x C] float32, in order, encoded ENCODE_BATCH at a
    time on the VAE's device. The images share one shape (latent runs center-crop)."""
    from tqdm.auto import tqdm

    device = next(encoder.vae.parameters()).device
    with tqdm(total=len(images), desc="encoding latents once", disable=not progress) as bar:
        for first in range(0, len(images), ENCODE_BATCH):
            rows = range(first, min(first + ENCODE_BATCH, len(images)))
            pixels = torch.from_numpy(np.stack([images.image(row) for row in rows])).permute(0, 3, 1, 2)
            pixels = batch_order.to_model_input(pixels, device)
            views = [pixels, pixels.flip(-1)][:encoder.views]
            parts = [part for view in views for part in encode(encoder.vae, view)]  # mean, std of each view
            stored = torch.cat(parts, dim=1).permute(0, 2, 3, 1).cpu().numpy()
            bar.update(len(rows))
            yield from stored


def encoded_sample(pixels: np.ndarray, encoder: Encoder) -> DecodedImages:
    """The posteriors of stored pixel images [N, C, H, W] (a stream's first images), every view
    encoded as the cache encodes it: what a stream's per-channel statistics are measured on."""
    images = DecodedImages.from_arrays(list(pixels.transpose(0, 2, 3, 1)), pixels.shape[1])
    return DecodedImages.from_arrays(list(iter_encoded(images, encoder)),
                                     encoder.views * 2 * encoder.vae.config.latent_channels)


def cached_latents(images: DecodedImages, encoder: Encoder, dataset, cache_dir: str | None, pixel_key: tuple,
                   progress: bool = False) -> DecodedImages:
    """The posteriors of `images` (decoded from `dataset` as `pixel_key` says), encoded once and
    stored beside the decoded images (decode_cache), or in memory for an in-memory dataset."""
    latent_channels = encoder.vae.config.latent_channels
    channels = encoder.views * 2 * latent_channels
    located = decode_cache.cache_location(dataset, cache_dir, *pixel_key, "latents", LATENT_FORMAT,
                                          encoder.fingerprint, encoder.views)
    if located is None:
        return DecodedImages.from_arrays(list(iter_encoded(images, encoder, progress)), channels)
    root, directory = located
    if not os.path.isdir(directory):  # published whole by one rename: present means complete
        height, width = (int(side) // encoder.factor for side in images.shapes[0])
        decode_cache.check_cache_space(root, len(images), (height, width), channels, 4)
        start = time.perf_counter()
        decode_cache.write_cache(directory, iter_encoded(images, encoder, progress))
        print(f"encoded {len(images)} images once ({encoder.views} view(s), {latent_channels} latent channels) "
              f"into {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return DecodedImages.load(directory, channels, "float32")


def channel_statistics(latents: DecodedImages, posterior_channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per latent channel, the mean and std of the latents training draws (mean + std x eps) over
    every stored view: E[z] = E[mean], Var[z] = Var[mean] + E[std^2]. Exact (float64), one pass."""
    total = np.zeros(posterior_channels)
    total_square = np.zeros(posterior_channels)
    count = 0
    for index in range(len(latents)):
        views = latents.image(index).astype(np.float64).reshape(-1, 2, posterior_channels)  # [h*w*views, 2, C]
        mean, std = views[:, 0], views[:, 1]
        total += mean.sum(0)
        total_square += (mean ** 2 + std ** 2).sum(0)
        count += len(views)
    average = total / count
    return average, np.sqrt(np.maximum(total_square / count - average ** 2, 0.0))
