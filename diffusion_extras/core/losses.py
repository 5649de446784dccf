"""Noising, training targets, SNR and min-SNR weights, and the per-sample loss, all in fp32.

Why not DDPMScheduler.add_noise / get_velocity directly: they cast the schedule to the sample's
dtype (with bf16 samples, as diffusers' train_unconditional.py passes them, the first timesteps
lose their noise) and build alphas_cumprod as an fp32 product (5e-4 relative error in 1 - abar at
t = 0). `NoiseSchedule` computes the schedule and SNR in float64 log space from the scheduler's
own betas, keeps fp32 device copies, and the tests check it against a float64 reference and
against add_noise/get_velocity.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler


def ddpm_scheduler(num_train_timesteps: int = 1000, beta_schedule: str = "linear", prediction_type: str = "epsilon",
                   rescale_betas_zero_snr: bool = False, variance_type: str = "fixed_small",
                   clip_sample: bool = True) -> DDPMScheduler:
    """The run's DDPMScheduler: its betas define the noise schedule, and it is exported with the
    pipeline; its variance_type (learned_range for a 2C-output UNet) is what DDPMPipeline samples with.
    `clip_sample`: whether sampling clips each x0 estimate to [-1, 1], the pixels' range (diffusers'
    default); off for latents, which are not bounded so (Stable Diffusion's schedulers set it off)."""
    # Zero terminal SNR needs sampling to start at t = T-1 (Lin et al. 2024, Sec. 3.3): "trailing"
    # spacing does, diffusers' default "leading" starts below it. Set here, the exported scheduler
    # config carries it, so DDPMPipeline.from_pretrained samples from the zero-SNR step too.
    spacing = "trailing" if rescale_betas_zero_snr else "leading"
    return DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
                         prediction_type=prediction_type, timestep_spacing=spacing,
                         rescale_betas_zero_snr=rescale_betas_zero_snr, variance_type=variance_type,
                         clip_sample=clip_sample)


def log_alphas_cumprod(betas: torch.Tensor) -> torch.Tensor:
    """log abar_t as a float64 cumulative sum of log(1 - beta): abar_t far below 1e-7 (and exactly 0
    under zero terminal SNR, where beta_T = 1 gives -inf) stays accurate."""
    return torch.cumsum(torch.log1p(-betas.double()), dim=0)


class NoiseSchedule:
    """Per-timestep coefficients of x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, on one device."""

    def __init__(self, betas: torch.Tensor, device=None):
        # in log space, so SNR at the noisy end is not rounded away
        log_abar = log_alphas_cumprod(betas)
        alphas_cumprod = torch.exp(log_abar)
        self.alphas_cumprod = alphas_cumprod.float().to(device)
        self.sqrt_alphas_cumprod = alphas_cumprod.sqrt().float().to(device)
        self.sqrt_one_minus_alphas_cumprod = (-torch.expm1(log_abar)).clamp_min(0).sqrt().float().to(device)
        # SNR = abar / (1 - abar) from logs: exp(log abar - log(1 - abar)); exactly 0 at abar = 0.
        log_snr = log_abar - torch.log(-torch.expm1(log_abar))
        self.snr = torch.exp(log_snr).float().to(device)
        self.num_train_timesteps = len(betas)

    @classmethod
    def from_scheduler(cls, scheduler, device=None) -> NoiseSchedule:
        # zero-terminal-SNR schedules end with beta_T = 1: log1p(-1) = -inf keeps abar_T = 0 exact.
        return cls(scheduler.betas, device)

    def _gather(self, table: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return table[timesteps].view(-1, 1, 1, 1)

    def add_noise(self, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        clean, noise = clean.float(), noise.float()
        return (self._gather(self.sqrt_alphas_cumprod, timesteps) * clean
                + self._gather(self.sqrt_one_minus_alphas_cumprod, timesteps) * noise)

    def target(self, prediction_type: str, clean: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
        """What the network learns to output: noise (epsilon), velocity (v_prediction), or x_0 (sample)."""
        if prediction_type == "epsilon":
            return noise.float()
        if prediction_type == "v_prediction":
            # v = sqrt(abar) eps - sqrt(1 - abar) x_0 (Salimans & Ho 2022), as diffusers' get_velocity.
            return (self._gather(self.sqrt_alphas_cumprod, timesteps) * noise.float()
                    - self._gather(self.sqrt_one_minus_alphas_cumprod, timesteps) * clean.float())
        if prediction_type == "sample":
            return clean.float()
        raise ValueError(f"unknown prediction_type {prediction_type!r}")


def min_snr_weight(snr: torch.Tensor, snr_gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weight (Hang et al. 2023) for the loss of each prediction type.

    The paper weights the x_0-space error by min(SNR, gamma). Each prediction type's error is a
    fixed multiple of the x_0-space error, so the weight on its own loss divides by that multiple:
      epsilon:      ||eps - eps_hat||^2 = SNR ||x0 - x0_hat||^2       -> min(SNR, gamma) / SNR
      v_prediction: ||v - v_hat||^2 = (SNR + 1) ||x0 - x0_hat||^2     -> min(SNR, gamma) / (SNR + 1)
      sample:       the x_0-space error itself                        -> min(SNR, gamma)
    At SNR = 0 (zero terminal SNR, Lin et al. 2024) the formulas give 0/0 (epsilon) or 0: that
    step is where the model learns the data mean, so it keeps the unit weight of the unweighted
    loss instead of silently dropping out (diffusers PR #6307 made the same choice).
    """
    snr = snr.float()
    clipped = torch.clamp(snr, max=snr_gamma)
    if prediction_type == "epsilon":
        # min(SNR, g)/SNR == 1 where SNR <= g: written as a where() so SNR = 0 never divides.
        weight = torch.where(snr > snr_gamma, snr_gamma / snr.clamp_min(snr_gamma), torch.ones_like(snr))
    elif prediction_type == "v_prediction":
        weight = clipped / (snr + 1)
    elif prediction_type == "sample":
        weight = clipped
    else:
        raise ValueError(f"unknown prediction_type {prediction_type!r}")
    return torch.where(snr == 0, torch.ones_like(weight), weight)


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: str = "l2",
                    huber_c: float = 0.001) -> torch.Tensor:
    """Mean over pixels of each sample's error, in fp32 whatever the model's output dtype."""
    prediction, target = prediction.float(), target.float()
    if loss_type == "l2":
        error = F.mse_loss(prediction, target, reduction="none")
    elif loss_type == "huber":
        # pseudo-Huber 2c(sqrt(x^2 + c^2) - c) (Song & Dhariwal 2023): ~x^2 near 0, ~2c|x| far out.
        # Written as 2c x^2 / (sqrt(x^2 + c^2) + c): the textbook form cancels in fp32 for small x.
        squared = (prediction - target) ** 2
        error = 2 * huber_c * squared / (torch.sqrt(squared + huber_c ** 2) + huber_c)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return error.flatten(1).mean(dim=1)
