"""The training objective behind one interface, asked by the step, the held-out loss, the gradient
monitor, the diagnostics and the export instead of each deciding it:

    objective = make_objective(name, noise_scheduler, device, **its settings)
    timesteps, importance = objective.timestep_sampler.sample(batch, generator)  # [0, T): noisier as they grow
    noisy = objective.add_noise(clean, noise, timesteps)      # x_t = a x_0 + b noise, fp32
    target = objective.target(clean, noise, timesteps)        # c x_0 + d noise, fp32
    output = unet(noisy, objective.model_timesteps(timesteps)).sample
    loss = per_sample_loss(output, target) * objective.loss_weight(timesteps)

`noise_scheduler` is the scheduler that samples the trained model and is exported with it. Every
objective describes its path by the coefficients (a, b, c, d) of each training index; SNR = a^2/b^2
and the Bayes-optimal loss follow from them alike for every objective. A new objective is one class
here (its coefficients, sampler, scheduler and `settings`, the config fields it takes), its name in
OBJECTIVES and core/choices.py, and those settings' flags in training/config.py.
"""
from __future__ import annotations

import numpy as np
import torch
from diffusers import DDPMScheduler

from diffusion_extras.core import losses
from diffusion_extras.core.choices import OBJECTIVE_NAMES
from diffusion_extras.core.timesteps import TimestepSampler, make_timestep_sampler
from diffusion_extras.core.vlb import ReverseProcess


class Objective:
    """The interface; the defaults here are the generic forms of the coefficients."""
    name: str
    settings: tuple = ()                       # the config fields (flags) its constructor takes, by name
    target_name: str                           # what the network predicts, in the field's words (plots, card)
    noise_scheduler: object                    # samples the trained model; exported with the pipeline
    timestep_sampler: TimestepSampler          # the training indices (with importance weights, or None)
    reverse_process: ReverseProcess | None = None  # DDPM's posterior tables: a learned variance's bound term
    num_train_timesteps: int

    def coefficients(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(a, b, c, d) per index, fp32 [B]: x_t = a x_0 + b noise, target = c x_0 + d noise."""
        raise NotImplementedError

    def add_noise(self, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        a, b, _, _ = (k.view(-1, 1, 1, 1) for k in self.coefficients(timesteps))
        return a * clean.float() + b * noise.float()

    def target(self, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        _, _, c, d = (k.view(-1, 1, 1, 1) for k in self.coefficients(timesteps))
        return c * clean.float() + d * noise.float()

    def loss_weight(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Each sample's weight on its simple loss, fp32 [B] (1: unweighted)."""
        return torch.ones(timesteps.shape, device=timesteps.device)

    def model_timesteps(self, timesteps: torch.Tensor) -> torch.Tensor:
        """What the UNet is given as its timestep for these training indices."""
        return timesteps

    def noise_axis(self) -> tuple[str, str, np.ndarray]:
        """How the diagnostics' plots place the training indices: (axis label, short symbol, the value
        of each index, float64 [T]); DDPM's timestep t itself."""
        return "timestep t", "t", np.arange(self.num_train_timesteps, dtype=np.float64)

    def snr(self) -> torch.Tensor:
        """a^2 / b^2 per training index, float64 [T] (inf where b = 0)."""
        a, b, _, _ = self._table()
        return a * a / (b * b)

    def bayes_optimal_loss(self, sigma_data: float) -> torch.Tensor:
        """The lowest per-dimension MSE any model reaches at each index for x_0 ~ N(0, sigma_data^2),
        float64 [T]. x_t and the target are jointly Gaussian: the MMSE of y = c x_0 + d eps from
        x_t = a x_0 + b eps is Var(y) - Cov(y, x_t)^2 / Var(x_t) = s^2 (c b - a d)^2 / (a^2 s^2 + b^2),
        s = sigma_data (a linear denoiser reaches it for any data of that variance)."""
        a, b, c, d = self._table()
        variance = torch.as_tensor(float(sigma_data), dtype=torch.float64) ** 2
        noisy_variance = (a * a * variance + b * b).clamp_min(torch.finfo(torch.float64).tiny)
        return variance * (c * b - a * d) ** 2 / noisy_variance

    def _table(self) -> tuple[torch.Tensor, ...]:
        """(a, b, c, d) of every index, float64 on the CPU (the diagnostics' and report's resolution)."""
        indices = torch.arange(self.num_train_timesteps, device=self.device)
        return tuple(k.double().cpu() for k in self.coefficients(indices))


class DDPM(Objective):
    """Ho et al. 2020 on the scheduler's betas: x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, the
    network predicting eps, v or x_0 (prediction_type), min-SNR weights (snr_gamma; 0 or None: off)."""
    name = "ddpm"
    settings = ("prediction_type", "snr_gamma", "timestep_sampling")

    def __init__(self, noise_scheduler: DDPMScheduler, device=None, prediction_type: str = "epsilon",
                 snr_gamma: float | None = None, timestep_sampling: str = "uniform"):
        self.noise_scheduler, self.device = noise_scheduler, device
        self.prediction_type, self.snr_gamma, self.target_name = prediction_type, snr_gamma, prediction_type
        self.schedule = losses.NoiseSchedule.from_scheduler(noise_scheduler, device)
        self.num_train_timesteps = self.schedule.num_train_timesteps
        self.timestep_sampler = make_timestep_sampler(timestep_sampling, self.num_train_timesteps, device)
        self.reverse_process = ReverseProcess.from_scheduler(noise_scheduler, device)

    def coefficients(self, timesteps):
        return self._with_target(self.schedule.sqrt_alphas_cumprod[timesteps],
                                 self.schedule.sqrt_one_minus_alphas_cumprod[timesteps])

    def _with_target(self, a, b):
        """(a, b, c, d): the target eps = (x_t - a x_0) / b, v = a eps - b x_0 or x_0 itself."""
        one, zero = torch.ones_like(a), torch.zeros_like(a)
        c, d = {"epsilon": (zero, one), "v_prediction": (-b, a), "sample": (one, zero)}[self.prediction_type]
        return a, b, c, d

    # noising and targets as NoiseSchedule computes them (the tests hold it to float64 and to diffusers)
    def add_noise(self, clean, noise, timesteps):
        return self.schedule.add_noise(clean, noise, timesteps)

    def target(self, clean, noise, timesteps):
        return self.schedule.target(self.prediction_type, clean, noise, timesteps)

    def _table(self):
        # float64 from the betas (as NoiseSchedule): the Bayes-optimal curve keeps its precision at both ends
        abar = torch.exp(losses.log_alphas_cumprod(self.noise_scheduler.betas))
        return self._with_target(abar.sqrt(), (1 - abar).clamp_min(0).sqrt())

    def loss_weight(self, timesteps):
        if not self.snr_gamma:
            return super().loss_weight(timesteps)
        return losses.min_snr_weight(self.schedule.snr[timesteps], self.snr_gamma, self.prediction_type)


class FlowSigmas:
    """Training indices of the flow path drawn as diffusers' SD3 and FLUX scripts draw them: u from
    `compute_density_for_timestep_sampling` (logit-normal, mode, else uniform; drawn from the step's
    generator, so a function of (seed, micro-step)), the scheduler's index (u T) into its shifted sigma
    table, counted here from the clean end (index T - 1 - that one)."""
    learns_from_losses = False

    def __init__(self, num_train_timesteps: int, weighting_scheme: str, logit_mean: float, logit_std: float,
                 mode_scale: float, device=None):
        self.num_train_timesteps, self.device = num_train_timesteps, device
        self.density = dict(weighting_scheme=weighting_scheme, logit_mean=logit_mean, logit_std=logit_std,
                            mode_scale=mode_scale)

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(batch_size=batch_size, device=self.device, generator=generator,
                                                  **self.density)
        # u reaches 1 (mode at u = 0; a sigmoid rounding to 1): the scripts' index T is past the table
        scheduler_index = (u * self.num_train_timesteps).long().clamp(0, self.num_train_timesteps - 1)
        return self.num_train_timesteps - 1 - scheduler_index, None


class FlowMatching(Objective):
    """Rectified flow (Liu et al. 2023; Lipman et al. 2023) as diffusers' flow schedulers sample it:
    x_t = (1 - sigma) x_0 + sigma noise, the network predicting the velocity noise - x_0 at timestep
    sigma T; sigma from the FlowMatchEulerDiscreteScheduler's table (its `shift` included, as the SD3
    script trains), weighted by `compute_loss_weighting_for_sd3` (Esser et al. 2024, Sec. 3.1)."""
    name = "flow_matching"
    settings = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale")
    target_name = "velocity"

    def __init__(self, noise_scheduler, device=None, weighting_scheme: str = "logit_normal", logit_mean: float = 0.0,
                 logit_std: float = 1.0, mode_scale: float = 1.29):
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        self.noise_scheduler, self.device = noise_scheduler, device
        self.num_train_timesteps = len(noise_scheduler.sigmas)
        # the scheduler's tables run from sigma 1 down; index i here is entry T - 1 - i there
        self.sigmas = noise_scheduler.sigmas.flip(0).float().to(device)
        self.timestep_table = noise_scheduler.timesteps.flip(0).float().to(device)
        self.weights = compute_loss_weighting_for_sd3(weighting_scheme, self.sigmas).float()
        self.timestep_sampler = FlowSigmas(self.num_train_timesteps, weighting_scheme, logit_mean, logit_std,
                                           mode_scale, device)

    def coefficients(self, timesteps):
        sigma = self.sigmas[timesteps]
        return 1.0 - sigma, sigma, -torch.ones_like(sigma), torch.ones_like(sigma)

    def add_noise(self, clean, noise, timesteps):  # the scripts' order of operations
        sigma = self.sigmas[timesteps].view(-1, 1, 1, 1)
        return sigma * noise.float() + (1.0 - sigma) * clean.float()

    def target(self, clean, noise, timesteps):
        return noise.float() - clean.float()

    def loss_weight(self, timesteps):
        return self.weights[timesteps]

    def model_timesteps(self, timesteps):
        return self.timestep_table[timesteps]

    def noise_axis(self):
        """The noise level sigma of each index (shifted as trained), the practitioner's axis for a flow."""
        return "noise level sigma", "sigma", self.sigmas.double().cpu().numpy()


def flow_scheduler(num_train_timesteps: int = 1000, shift: float = 1.0):
    """The flow model's exported scheduler: diffusers' FlowMatchEulerDiscreteScheduler with `shift`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)


OBJECTIVES = {cls.name: cls for cls in (DDPM, FlowMatching)}
assert tuple(OBJECTIVES) == OBJECTIVE_NAMES, "core/choices.py names the objectives in this order"


def make_objective(name: str, noise_scheduler, device=None, **settings) -> Objective:
    """The objective `name` (--objective) on `noise_scheduler`, with its settings by keyword."""
    return OBJECTIVES[name](noise_scheduler, device, **settings)
