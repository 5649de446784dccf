"""Timestep sampling behind one interface: uniform, or importance sampling by each timestep's
loss second moment (--timestep_sampling).

    sampler = make_timestep_sampler(kind, num_train_timesteps, device)
    timesteps, weights = sampler.sample(batch_size, generator)  # weights: None when all are 1
    if sampler.learns_from_losses:                                # then it also has state to checkpoint
        sampler.update(timesteps, unweighted_losses)

Loss-aware sampling (Nichol & Dhariwal 2021, Sec. 3.3) draws t with probability proportional to
sqrt(E[L_t^2]) and weights each sample's loss by 1 / (T p_t), so the expected weighted loss
equals the uniform-t loss (unbiased) while the gradient variance drops. Their version keeps the
last 10 losses per timestep in Python lists; this one keeps an exponential moving average of
L_t^2 per timestep in one device tensor, updated with the whole global batch (gathered), so every
rank holds the same distribution without any host sync, and it goes into the checkpoint.
"""
from __future__ import annotations

from typing import Protocol

import torch


class TimestepSampler(Protocol):
    """The interface both samplers have (the loss-aware one adds update, state_dict, load_state_dict)."""
    learns_from_losses: bool

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class UniformTimesteps:
    """t uniform in [0, T): the DDPM objective as written (Ho et al. 2020, Algorithm 1)."""
    learns_from_losses = False

    def __init__(self, num_train_timesteps: int, device=None):
        self.num_train_timesteps, self.device = num_train_timesteps, device

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        """(timesteps [B] long, None: every loss weight is 1)."""
        timesteps = torch.randint(0, self.num_train_timesteps, (batch_size,), generator=generator, device=self.device)
        return timesteps, None


class LossAwareTimestepSampler:
    learns_from_losses = True  # update() after each micro-batch; its state goes into checkpoints

    def __init__(self, num_train_timesteps: int, device=None, warmup_samples_per_timestep: int = 10,
                 decay: float = 0.9, uniform_fraction: float = 0.001):
        self.num_train_timesteps = num_train_timesteps
        self.warmup = warmup_samples_per_timestep  # uniform until every t has this many losses
        self.decay = decay                          # EMA of L_t^2 per observation of t
        self.uniform_fraction = uniform_fraction    # floor: every t keeps some probability
        self.second_moment = torch.zeros(num_train_timesteps, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_train_timesteps, dtype=torch.float64, device=device)

    def probabilities(self) -> torch.Tensor:
        """p_t; uniform until warm (decided on the device, no host read)."""
        T = self.num_train_timesteps
        uniform = torch.full((T,), 1.0 / T, dtype=torch.float64, device=self.counts.device)
        weights = self.second_moment.clamp_min(0).sqrt()
        p = weights / weights.sum().clamp_min(1e-30)
        p = p * (1 - self.uniform_fraction) + self.uniform_fraction / T
        warm = (self.counts >= self.warmup).all() & (weights.sum() > 0)
        return torch.where(warm, p, uniform)

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps [B] long, loss weights [B] fp32 = 1 / (T p_t))."""
        p = self.probabilities()
        timesteps = torch.multinomial(p, batch_size, replacement=True, generator=generator)
        weights = (1.0 / (self.num_train_timesteps * p[timesteps])).float()
        return timesteps, weights

    @torch.no_grad()
    def update(self, timesteps: torch.Tensor, losses: torch.Tensor) -> None:
        """Fold a batch of unweighted per-sample losses into the per-timestep second moments.
        A timestep seen k times in the batch decays k times, as if seen one after another."""
        losses = losses.detach().to(torch.float64)
        finite = torch.isfinite(losses)
        losses, hits = torch.where(finite, losses, torch.zeros_like(losses)), finite.to(torch.float64)
        seen = torch.zeros_like(self.counts).index_add_(0, timesteps, hits)
        squared_sum = torch.zeros_like(self.counts).index_add_(0, timesteps, losses ** 2)
        mean_squared = squared_sum / seen.clamp_min(1)
        keep = self.decay ** seen
        first = self.counts == 0  # first observation initialises instead of decaying from 0
        target = torch.where(first, mean_squared, self.second_moment)
        self.second_moment = torch.where(seen > 0, keep * target + (1 - keep) * mean_squared, self.second_moment)
        self.counts += seen

    def state_dict(self) -> dict:
        return {"second_moment": self.second_moment.cpu(), "counts": self.counts.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.second_moment = state["second_moment"].to(self.second_moment.device, torch.float64)
        self.counts = state["counts"].to(self.counts.device, torch.float64)


SAMPLERS = {"uniform": UniformTimesteps, "loss_aware": LossAwareTimestepSampler}  # by choices.TIMESTEP_SAMPLING


def make_timestep_sampler(kind: str, num_train_timesteps: int, device=None):
    """The sampler --timestep_sampling names (uniform or loss_aware)."""
    return SAMPLERS[kind](num_train_timesteps, device)
