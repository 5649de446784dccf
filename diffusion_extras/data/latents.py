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
import itertools
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_extras.data import batch_order, decode_cache
from diffusion_extras.data.decode_cache import DecodedImages
from diffusion_extras.evaluation.pipeline_latent import encode_posterior  # the one VAE encode: pyproject's exception

LATENT_FORMAT = 1  # bump when the stored layout of latents changes
FINGERPRINT_FORMAT = 2  # of vae_fingerprint; checkpoints without it hold an earlier release's (earlier_fingerprints)
LEGACY_HASH_BUDGET = 1 << 30  # bytes hashed at most to recompute an earlier release's fingerprints
ENCODE_BATCH = 32  # images per VAE encoder call
STATISTICS_IMAGES = 2048  # streamed images the per-channel statistics are measured on (a VAE config without them)


@dataclass(frozen=True)
class Encoder:
    """The frozen VAE that encodes the training images, and what the stored latents depend on."""
    vae: object          # diffusers AutoencoderKL, VQModel or AutoencoderTiny (eval, no gradients), on the device
    views: int           # 1, or 2 with --random_flip: the image and its mirror, each encoded
    fingerprint: str     # of the VAE's config and weights: names the cache
    factor: int = 1      # pixels per latent along each side (the cache's size check)
    earlier_fingerprints: tuple = ()  # an earlier release's fingerprints of this VAE (a resumed checkpoint's)

    @classmethod
    def of(cls, vae, random_flip: bool, factor: int = 1, earlier_fingerprints: tuple = ()) -> Encoder:
        return cls(vae, 2 if random_flip else 1, vae_fingerprint(vae), factor, tuple(earlier_fingerprints))


def vae_fingerprint(vae) -> str:
    """sha256 of what the latents depend on, equal in every interpreter: the VAE's class, the config
    fields its config.json names (public ones, sorted) and every weight's name, dtype, shape and
    bytes (a second for a Stable Diffusion VAE). Not diffusers' private keys: `_use_default_values`
    is a list built from a set, whose order follows PYTHONHASHSEED, and `_name_or_path` is where the
    folder was; nor the fields diffusers filled with its defaults, which a diffusers upgrade that
    adds an argument would change without changing a weight."""
    digest = hashlib.sha256(json.dumps([type(vae).__name__, stored_config(vae.config)], sort_keys=True,
                                       default=str).encode())
    return _with_weights(digest, vae, shapes=True)


def stored_config(config) -> dict:
    """The public fields of a diffusers config that its config.json named (not those diffusers
    filled with its defaults, which it lists in `_use_default_values`)."""
    defaulted = set(config.get("_use_default_values") or ())
    return {key: value for key, value in config.items() if not key.startswith("_") and key not in defaulted}


def _with_weights(digest, vae, shapes: bool) -> str:
    for name, tensor in vae.state_dict().items():
        digest.update(name.encode())
        if shapes:
            digest.update(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:20]


def earlier_fingerprints(vae, config: dict):
    """The fingerprints releases before FINGERPRINT_FORMAT 2 gave this VAE: sha256 of
    json.dumps(dict(config)), whose `_use_default_values` came in the order of the interpreter's
    string hashes, then the weights. One per order of that list (`config`: the VAE's config as
    loaded, before the run registers measured statistics in it); None when hashing every order
    would pass LEGACY_HASH_BUDGET (n! orders of the whole weights: an SD VAE config of 2022 lists 8)."""
    defaulted = list(config.get("_use_default_values") or ())
    weight_bytes = sum(t.numel() * t.element_size() for t in vae.state_dict().values())
    if math.factorial(len(defaulted)) * max(weight_bytes, 1) > LEGACY_HASH_BUDGET:
        return None
    return (_with_weights(hashlib.sha256(json.dumps({**config, "_use_default_values": list(order)} if defaulted
                                                    else config, sort_keys=True, default=str).encode()),
                          vae, shapes=False)
            for order in itertools.permutations(defaulted))


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

    def normalised(self, batch: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each image's normalised posterior: its mean's (mean - shift) x scale (model_input without
        noise) and its std x scale."""
        mean, std = self.stored(batch, device, None) if self.encoder is None else self.encoded(batch, device, None)
        shift, scale = (value.to(device).view(1, -1, 1, 1) for value in (self.shift, self.scale))
        return (mean - shift) * scale, std * scale

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
        parts = [encode_posterior(self.encoder.vae, pixels[first:first + ENCODE_BATCH])
                 for first in range(0, len(pixels), ENCODE_BATCH)]
        return tuple(torch.cat(values).to(device, non_blocking=True) for values in zip(*parts))


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

    with tqdm(total=len(images), desc="encoding latents once", disable=not progress) as bar:
        for first in range(0, len(images), ENCODE_BATCH):
            rows = range(first, min(first + ENCODE_BATCH, len(images)))
            stored = encoded_rows(images, encoder, rows)
            bar.update(len(rows))
            yield from stored


def encoded_rows(images: DecodedImages, encoder: Encoder, rows: range) -> np.ndarray:
    """The posteriors [len(rows), h, w, views x 2 x C] of those images, encoded in one batch on the
    VAE's device (as iter_encoded encodes them)."""
    device = next(encoder.vae.parameters()).device
    pixels = torch.from_numpy(np.stack([images.image(row) for row in rows])).permute(0, 3, 1, 2)
    pixels = batch_order.to_model_input(pixels, device)
    views = [pixels, pixels.flip(-1)][:encoder.views]
    with torch.no_grad():
        parts = [part for view in views for part in encode_posterior(encoder.vae, view)]  # each view's mean, std
    return torch.cat(parts, dim=1).permute(0, 2, 3, 1).cpu().numpy()


def encoded_sample(pixels: np.ndarray, encoder: Encoder) -> DecodedImages:
    """The posteriors of stored pixel images [N, C, H, W] (a stream's first images), every view
    encoded as the cache encodes it: what a stream's per-channel statistics are measured on."""
    images = DecodedImages.from_arrays(list(pixels.transpose(0, 2, 3, 1)), pixels.shape[1])
    return DecodedImages.from_arrays(list(iter_encoded(images, encoder)),
                                     encoder.views * 2 * encoder.vae.config.latent_channels)


def cached_latents(images: DecodedImages, encoder: Encoder, dataset, cache_dir: str | None, pixel_key: tuple,
                   progress: bool = False) -> DecodedImages:
    """The posteriors of `images` (decoded from `dataset` as `pixel_key` says), encoded once and
    stored beside the decoded images (decode_cache), or in memory for an in-memory dataset. A cache
    that an earlier release keyed by one of the encoder's `earlier_fingerprints` (a resumed
    checkpoint's) is taken over where its first batch is what this VAE encodes, not encoded again."""
    latent_channels = encoder.vae.config.latent_channels
    channels = encoder.views * 2 * latent_channels
    key = (*pixel_key, "latents", LATENT_FORMAT)
    located = decode_cache.cache_location(dataset, cache_dir, *key, encoder.fingerprint, encoder.views)
    if located is None:
        return DecodedImages.from_arrays(list(iter_encoded(images, encoder, progress)), channels)
    root, directory = located
    if not os.path.isdir(directory):  # published whole by one rename: present means complete
        earlier = [decode_cache.cache_location(dataset, cache_dir, *key, fingerprint, encoder.views)[1]
                   for fingerprint in encoder.earlier_fingerprints]
        if not take_over_earlier_cache(earlier, directory, images, encoder, channels):
            height, width = (int(side) // encoder.factor for side in images.shapes[0])
            decode_cache.check_cache_space(root, len(images), (height, width), channels, 4)
            start = time.perf_counter()
            decode_cache.write_cache(directory, iter_encoded(images, encoder, progress))
            print(f"encoded {len(images)} images once ({encoder.views} view(s), {latent_channels} latent channels) "
                  f"into {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return DecodedImages.load(directory, channels, "float32")


def take_over_earlier_cache(earlier: list, directory: str, images: DecodedImages, encoder: Encoder,
                            channels: int) -> bool:
    """Whether one of the `earlier` cache folders (keyed by an earlier release's fingerprint of
    this VAE) was moved to `directory`: one whose images are these and whose first batch is what
    this VAE encodes now (to float rounding across devices; another VAE differs at once)."""
    for folder in earlier:
        if not os.path.isfile(os.path.join(folder, "shapes.npy")):
            continue
        stored = DecodedImages.load(folder, channels, "float32")
        if len(stored) != len(images) or not (stored.shapes == images.shapes // encoder.factor).all():
            continue
        rows = range(min(ENCODE_BATCH, len(images)))
        expected = np.stack([stored.image(row) for row in rows])
        if not np.allclose(encoded_rows(images, encoder, rows), expected, rtol=1e-3,
                           atol=1e-3 * max(1.0, float(np.abs(expected).max()))):
            continue
        try:
            os.rename(folder, directory)
        except OSError:  # another node took it first
            if not os.path.isdir(directory):
                raise
        print(f"latents: the cache an earlier release encoded with this VAE ({folder}) is used as it is, "
              f"now under {directory}", flush=True)
        return True
    return False


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
