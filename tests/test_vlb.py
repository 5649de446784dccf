"""Tests for diffusion_extras/core/vlb.py: the bound's terms against a float64 computation written
out element by element from the formulas (Ho et al. 2020 Eq. 5-7 and 13; Nichol & Dhariwal 2021 Eq. 15)."""
import math

import pytest
import torch
from diffusers import DDPMScheduler
from helpers import VLB_BETAS, VLB_T, vlb_term_by_hand

from diffusion_extras.core import vlb


@pytest.mark.parametrize("variance_type", ["fixed_small", "learned_range"])
def test_bound_term_matches_a_float64_hand_computation(variance_type):
    generator = torch.Generator().manual_seed(0)
    timesteps = torch.tensor([0, 0, 0, 1, 4, 9])
    # x0 on the 8-bit grid, the edges included (the open-ended bins)
    clean = torch.tensor([-1.0, 1.0, 10 / 127.5 - 1, 0.2, -0.6, 0.9]).view(6, 1, 1, 1)
    clean = torch.round((clean + 1) * 127.5) / 127.5 - 1
    noise = torch.randn(6, 1, 1, 1, generator=generator)
    abar = torch.cumprod(1 - torch.tensor(VLB_BETAS, dtype=torch.float64), 0)[timesteps].view(-1, 1, 1, 1)
    noisy = (abar.sqrt() * clean + (1 - abar).sqrt() * noise).float()
    eps_hat = noise + 0.3 * torch.randn(6, 1, 1, 1, generator=generator)  # a model that is off by a little
    values = torch.rand(6, 1, 1, 1, generator=generator) * 2 - 1
    process = vlb.ReverseProcess(torch.tensor(VLB_BETAS))
    got = process.bound_term(eps_hat, values if variance_type == "learned_range" else None, clean, noisy,
                             timesteps, "epsilon", variance_type)
    expected = [vlb_term_by_hand(clean[i].item(), noisy[i].item(), eps_hat[i].item(), values[i].item(), int(t),
                           variance_type) for i, t in enumerate(timesteps)]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, rel=2e-4, abs=1e-6)


def test_prior_term_and_learned_variance_bounds():
    process = vlb.ReverseProcess(torch.tensor(VLB_BETAS))
    clean = torch.tensor([0.5]).view(1, 1, 1, 1)
    abar = math.prod(1 - b for b in VLB_BETAS)
    mean, var = math.sqrt(abar) * 0.5, 1 - abar
    expected = 0.5 * (-1 - math.log(var) + var + mean ** 2) / math.log(2)
    assert process.prior_term(clean).item() == pytest.approx(expected, rel=1e-5)
    t = torch.tensor([3, 3])
    ends = process.model_log_variance("learned_range", torch.tensor([-1.0, 1.0]).view(2, 1, 1, 1), t).flatten()
    # v = -1: the posterior variance, v = 1: beta_t; diffusers' learned_range interpolates the same ends
    scheduler = DDPMScheduler(num_train_timesteps=VLB_T, trained_betas=VLB_BETAS, variance_type="learned_range")
    for value, end in zip((-1.0, 1.0), ends):
        assert scheduler._get_variance(3, torch.tensor(value)).item() == pytest.approx(end.item(), rel=1e-5)


def test_split_output_and_channels():
    output = torch.arange(2 * 3 * 2 * 2.0).view(2, 3, 2, 2)
    assert vlb.split_output(output, 3) == (output, None)
    doubled = torch.cat([output, -output], 1)
    prediction, values = vlb.split_output(doubled, 3)
    assert torch.equal(prediction, output) and torch.equal(values, -output)
    assert vlb.output_channels(3, "learned_range") == 6 and vlb.output_channels(3, "fixed_small") == 3


def test_bound_term_is_fp32_and_finite_under_bf16():
    process = vlb.ReverseProcess(torch.tensor(VLB_BETAS))
    timesteps = torch.tensor([0, 5])
    clean = torch.zeros(2, 1, 2, 2)
    prediction = torch.randn(2, 1, 2, 2).bfloat16()
    values = torch.zeros(2, 1, 2, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        term = process.bound_term(prediction, values.bfloat16(), clean, torch.randn(2, 1, 2, 2), timesteps,
                                  "epsilon", "learned_range")
    assert term.dtype == torch.float32 and torch.isfinite(term).all()
    term.sum().backward()
    assert torch.isfinite(values.grad).all() and values.grad.abs().sum() > 0


def test_diffusers_ddpm_step_samples_the_learned_variance_the_bound_trains():
    """DDPMScheduler(variance_type="learned_range").step on a 2C output draws x_{t-1} from the
    N(mean, sigma^2) whose log sigma^2 the bound uses (t > 0; at t = 0 it adds no noise)."""
    scheduler = DDPMScheduler(num_train_timesteps=VLB_T, trained_betas=VLB_BETAS, variance_type="learned_range",
                              clip_sample=False)
    scheduler.set_timesteps(VLB_T)
    process = vlb.ReverseProcess(torch.tensor(VLB_BETAS))
    generator = torch.Generator().manual_seed(1)
    noisy, eps_hat = torch.randn(2, 1, 3, 3, generator=generator), torch.randn(2, 1, 3, 3, generator=generator)
    values = torch.rand(2, 1, 3, 3, generator=generator) * 2 - 1
    t = torch.tensor([4, 4])
    stepped = scheduler.step(torch.cat([eps_hat, values], 1), 4, noisy, generator=torch.Generator().manual_seed(2))
    mean = process.posterior_mean(process.predicted_clean("epsilon", eps_hat, noisy, t), noisy, t)
    noise = torch.randn(noisy.shape, generator=torch.Generator().manual_seed(2))
    expected = mean + torch.exp(0.5 * process.model_log_variance("learned_range", values, t)) * noise
    assert torch.allclose(stepped.prev_sample, expected, atol=1e-5)
