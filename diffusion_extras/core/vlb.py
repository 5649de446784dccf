"""The variational bound of a DDPM in bits per dimension (Ho et al. 2020, Eq. 5), and the learned
reverse-process variance of improved-diffusion (Nichol & Dhariwal 2021), all in fp32.

    L = L_T + sum_{t>1} L_{t-1} + L_0, per image; divided by the dimensions and ln 2: bits/dim
    L_T     = KL(q(x_T | x_0) || N(0, I))                          the prior term (no parameters)
    L_{t-1} = KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))         Gaussian KL, closed form
    L_0     = -log p(x_0 | x_1), the discretized Gaussian decoder (256 bins of [-1, 1])
Indices here are diffusers' (t = 0 .. T-1): the decoder is the term at t = 0.

With `learned_range` (diffusers' name) the UNet outputs 2C channels: the prediction (epsilon, v
or x_0) and C values v in [-1, 1] that interpolate the log variance between the posterior
variance (clipped at t = 0, as improved-diffusion) and beta_t:  log sigma^2 = f log beta_t +
(1 - f) log beta~_t with f = (v + 1) / 2, which is what DDPMScheduler(variance_type=
"learned_range") samples with. diffusers has the sampler but no bound, hence this module; the
tests check it against a float64 computation written out by hand.
"""
from __future__ import annotations

import math

import torch

from diffusion_extras.core.choices import VARIANCE_TYPES
from diffusion_extras.core.losses import log_alphas_cumprod

LEARNED = "learned_range"


def output_channels(image_channels: int, variance_type: str) -> int:
    """The UNet's out_channels: the prediction, plus the variance values when they are learned."""
    return 2 * image_channels if variance_type == LEARNED else image_channels


def split_output(model_output: torch.Tensor, image_channels: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prediction, variance values or None) of a UNet output with C or 2C channels."""
    if model_output.shape[1] == 2 * image_channels:
        return model_output[:, :image_channels], model_output[:, image_channels:]
    return model_output, None


def normal_kl(mean1, log_variance1, mean2, log_variance2) -> torch.Tensor:
    """KL(N(mean1, e^lv1) || N(mean2, e^lv2)) per element, in nats."""
    return 0.5 * (-1.0 + log_variance2 - log_variance1 + torch.exp(log_variance1 - log_variance2)
                  + (mean1 - mean2) ** 2 * torch.exp(-log_variance2))


def _log_normal_mass(lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """log(Phi(upper) - Phi(lower)) for lower < upper, without cancellation: mirrored so that the
    interval lies mostly below 0, where log_ndtr keeps its precision."""
    mirror = lower > 0
    lower, upper = torch.where(mirror, -upper, lower), torch.where(mirror, -lower, upper)
    log_upper, log_lower = torch.special.log_ndtr(upper), torch.special.log_ndtr(lower)
    return log_upper + torch.log((-torch.expm1(log_lower - log_upper)).clamp_min(1e-30))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log p(x) per element for x on the 256-level grid of [-1, 1] under N(mean, e^{2 log_scale})
    integrated over each level's bin (width 2/255), the outer bins open-ended (Ho et al. 2020,
    Eq. 13). The exact normal CDF; improved-diffusion uses a tanh approximation of it."""
    centered, inverse_scale = x - mean, torch.exp(-log_scale)
    upper = inverse_scale * (centered + 1.0 / 255.0)
    lower = inverse_scale * (centered - 1.0 / 255.0)
    return torch.where(x < -0.999, torch.special.log_ndtr(upper),
                       torch.where(x > 0.999, torch.special.log_ndtr(-lower), _log_normal_mass(lower, upper)))


class ReverseProcess:
    """Per-timestep tables of q(x_{t-1} | x_t, x_0) and of the model's p(x_{t-1} | x_t), computed in
    float64 from the scheduler's betas and kept as fp32 copies on one device."""

    def __init__(self, betas: torch.Tensor, device=None):
        betas = betas.double()
        log_abar = log_alphas_cumprod(betas)
        alphas_cumprod, one_minus = torch.exp(log_abar), -torch.expm1(log_abar)
        previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        posterior_variance = betas * (1 - previous) / one_minus  # 0 at t = 0
        clipped = torch.cat([posterior_variance[1:2], posterior_variance[1:]])  # as improved-diffusion
        tables = {
            "posterior_log_variance_clipped": clipped.log(),
            "log_betas": betas.log(),  # learned_range's upper end
            "fixed_large_log_variance": torch.cat([posterior_variance[1:2], betas[1:]]).log(),
            "posterior_mean_coef1": betas * previous.sqrt() / one_minus,
            "posterior_mean_coef2": (1 - previous) * (1 - betas).sqrt() / one_minus,
            "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
            "sqrt_one_minus_alphas_cumprod": one_minus.sqrt(),
            "log_one_minus_alphas_cumprod": one_minus.log(),
        }
        for name, values in tables.items():
            setattr(self, name, values.float().to(device))
        self.num_train_timesteps = len(betas)

    @classmethod
    def from_scheduler(cls, scheduler, device=None) -> ReverseProcess:
        return cls(scheduler.betas, device)

    @staticmethod
    def _at(table: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return table[timesteps].view(-1, 1, 1, 1)

    def predicted_clean(self, prediction_type: str, prediction: torch.Tensor, noisy: torch.Tensor,
                        timesteps: torch.Tensor) -> torch.Tensor:
        """x_0 implied by the network's prediction (unclipped, as in the training bound)."""
        a, s = self._at(self.sqrt_alphas_cumprod, timesteps), self._at(self.sqrt_one_minus_alphas_cumprod, timesteps)
        if prediction_type == "epsilon":
            return (noisy - s * prediction) / a
        if prediction_type == "v_prediction":
            return a * noisy - s * prediction
        if prediction_type == "sample":
            return prediction
        raise ValueError(f"unknown prediction_type {prediction_type!r}")

    def posterior_mean(self, clean: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return (self._at(self.posterior_mean_coef1, timesteps) * clean
                + self._at(self.posterior_mean_coef2, timesteps) * noisy)

    def model_log_variance(self, variance_type: str, variance_values: torch.Tensor | None,
                           timesteps: torch.Tensor) -> torch.Tensor:
        """log sigma_t^2 of p(x_{t-1} | x_t): fixed (small: the posterior's, large: beta_t) or learned."""
        if variance_type == "fixed_small":
            return self._at(self.posterior_log_variance_clipped, timesteps)
        if variance_type == "fixed_large":
            return self._at(self.fixed_large_log_variance, timesteps)
        if variance_type != LEARNED:
            raise ValueError(f"unknown variance_type {variance_type!r}; one of {', '.join(VARIANCE_TYPES)}")
        if variance_values is None:
            raise ValueError("variance_type learned_range needs a UNet with 2C output channels")
        fraction = (variance_values.float() + 1) / 2
        return (fraction * self._at(self.log_betas, timesteps)
                + (1 - fraction) * self._at(self.posterior_log_variance_clipped, timesteps))

    def bound_term(self, prediction: torch.Tensor, variance_values: torch.Tensor | None, clean: torch.Tensor,
                   noisy: torch.Tensor, timesteps: torch.Tensor, prediction_type: str,
                   variance_type: str) -> torch.Tensor:
        """L_{t-1} of each sample in bits/dim: the decoder NLL where t = 0, the KL elsewhere. fp32
        whatever the inputs' precision. For the training term pass the prediction detached: the
        bound then trains only the variance (improved-diffusion's stop-gradient, Sec. 3.1)."""
        prediction, clean, noisy = prediction.float(), clean.float(), noisy.float()
        with torch.autocast(noisy.device.type, enabled=False):
            model_mean = self.posterior_mean(self.predicted_clean(prediction_type, prediction, noisy, timesteps),
                                             noisy, timesteps)
            model_log_variance = self.model_log_variance(variance_type, variance_values, timesteps)
            true_mean = self.posterior_mean(clean, noisy, timesteps)
            kl = normal_kl(true_mean, self._at(self.posterior_log_variance_clipped, timesteps),
                           model_mean, model_log_variance)
            decoder_nll = -discretized_gaussian_log_likelihood(clean, model_mean, 0.5 * model_log_variance)
            first = (timesteps == 0).view(-1, 1, 1, 1)
            return _bits_per_dim(torch.where(first, decoder_nll, kl))

    def prior_term(self, clean: torch.Tensor) -> torch.Tensor:
        """L_T of each sample in bits/dim: KL(q(x_T | x_0) || N(0, I)), ~0 for a well-made schedule."""
        last = torch.full((len(clean),), self.num_train_timesteps - 1, device=clean.device, dtype=torch.long)
        mean = self._at(self.sqrt_alphas_cumprod, last) * clean.float()
        log_variance = self._at(self.log_one_minus_alphas_cumprod, last)
        return _bits_per_dim(normal_kl(mean, log_variance, torch.zeros_like(mean), torch.zeros_like(mean)))


def _bits_per_dim(per_element: torch.Tensor) -> torch.Tensor:
    return per_element.flatten(1).mean(dim=1) / math.log(2.0)
