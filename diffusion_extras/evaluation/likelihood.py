"""Negative log-likelihood in bits/dim of images under a saved DDPM: the variational bound
(core/vlb.py) summed over every timestep, as improved-diffusion's `calc_bpd_loop` reports it.

    bits/dim = L_T (prior) + sum_{t=1}^{T-1} L_t (KL terms) + L_0 (discretized decoder)

Each term is one UNet call per image at a noisy x_t ~ q(x_t | x_0), so the full bound costs T
forwards per image. `timestep_stride` k > 1 is a strided estimator: the decoder and prior exactly,
and the KL terms in blocks of k consecutive timesteps, each block counted as k (its length) times
the term at its middle timestep (a midpoint Riemann sum; the terms vary smoothly with t).
Works for fixed (fixed_small, fixed_large) and learned (learned_range, 2C-output UNet) variances.
"""
from __future__ import annotations

import numpy as np
import torch

from diffusion_extras.core import losses, vlb
from diffusion_extras.core.choices import VARIANCE_TYPES
from diffusion_extras.data.batch_order import mix_seed
from diffusion_extras.evaluation.pipeline_backbone import predict

NLL_STREAM = 0x4E4C4C  # "NLL": the noise seeds of the bound's x_t draws


def kl_blocks(num_train_timesteps: int, stride: int) -> list[tuple[int, int]]:
    """(timestep, weight) pairs covering t = 1 .. T-1 once: the middle of each block of `stride`."""
    blocks = []
    for first in range(1, num_train_timesteps, stride):
        last = min(first + stride, num_train_timesteps) - 1
        blocks.append(((first + last) // 2, last - first + 1))
    return blocks


@torch.no_grad()
def bits_per_dim(unet, scheduler, images: np.ndarray, batch_size: int = 64, device=None, seed: int = 0,
                 timestep_stride: int = 1) -> dict:
    """The bound in bits/dim of uint8 `images` [N, H, W, C] (mean over images) and its parts.
    `scheduler`: the pipeline's (its betas, prediction_type and variance_type)."""
    config = scheduler.config
    variance_type = config.get("variance_type", "fixed_small")
    if variance_type not in VARIANCE_TYPES:
        raise ValueError(f"the bound needs variance_type {', '.join(VARIANCE_TYPES)}; this scheduler has "
                         f"{variance_type!r}")
    if timestep_stride < 1:
        raise ValueError(f"timestep_stride must be at least 1 (got {timestep_stride})")
    device = torch.device(device) if device is not None else next(unet.parameters()).device
    process = vlb.ReverseProcess.from_scheduler(scheduler, device)
    schedule = losses.NoiseSchedule.from_scheduler(scheduler, device)
    blocks = [(0, 1)] + kl_blocks(process.num_train_timesteps, timestep_stride)
    was_training = unet.training
    unet.eval()
    parts = {"prior": [], "decoder": [], "kl": []}
    try:
        for first in range(0, len(images), batch_size):
            clean = torch.from_numpy(images[first:first + batch_size]).permute(0, 3, 1, 2).to(device)
            clean = clean.float() / 127.5 - 1  # the 256-level grid of [-1, 1] the decoder integrates over
            terms = [_term(unet, process, schedule, clean, t, config.prediction_type, variance_type,
                           mix_seed(seed, NLL_STREAM, first, t)) * weight for t, weight in blocks]
            parts["prior"].append(process.prior_term(clean).double().cpu())
            parts["decoder"].append(terms[0].double().cpu())
            parts["kl"].append(torch.stack(terms[1:]).sum(0).double().cpu())
    finally:
        unet.train(was_training)
    prior, decoder, kl = (torch.cat(parts[name]) for name in ("prior", "decoder", "kl"))
    total = prior + decoder + kl
    return {"nll_bits_per_dim": float(total.mean()), "nll_bits_per_dim_std": float(total.std()) if len(total) > 1
            else 0.0, "nll_prior_bits_per_dim": float(prior.mean()), "nll_decoder_bits_per_dim": float(decoder.mean()),
            "nll_kl_bits_per_dim": float(kl.mean()), "nll_images": len(total), "nll_timestep_stride": timestep_stride,
            "nll_unet_calls_per_image": len(blocks)}


def _term(unet, process, schedule, clean, t: int, prediction_type: str, variance_type: str,
          noise_seed: int) -> torch.Tensor:
    """L_t of each image at one x_t drawn from q(x_t | x_0) (CPU noise, so any device draws the same)."""
    timesteps = torch.full((len(clean),), t, dtype=torch.long, device=clean.device)
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(noise_seed)).to(clean.device)
    noisy = schedule.add_noise(clean, noise, timesteps)
    output = predict(unet, noisy, timesteps).float()  # a class-conditional UNet: "no class"
    prediction, variance_values = vlb.split_output(output, clean.shape[1])
    return process.bound_term(prediction, variance_values, clean, noisy, timesteps, prediction_type, variance_type)
