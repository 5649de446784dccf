import math

import pytest
import torch
from diffusers import DDPMScheduler

from diffusion_extras.core.losses import NoiseSchedule, min_snr_weight, per_sample_loss


@pytest.mark.parametrize("kwargs", [{}, {"beta_schedule": "squaredcos_cap_v2"},
                                    {"beta_schedule": "scaled_linear", "rescale_betas_zero_snr": True}])
def test_noising_and_targets_match_diffusers_in_fp32(kwargs):
    scheduler = DDPMScheduler(**kwargs)
    schedule = NoiseSchedule.from_scheduler(scheduler)
    generator = torch.Generator().manual_seed(0)
    clean = torch.rand(6, 3, 4, 4, generator=generator) * 2 - 1
    noise = torch.randn(6, 3, 4, 4, generator=generator)
    timesteps = torch.tensor([0, 1, 10, 500, 998, 999])
    # exact reference in float64
    abar = torch.cumprod(1 - scheduler.betas.double(), 0)[timesteps].view(-1, 1, 1, 1)
    noisy64 = abar.sqrt() * clean.double() + (1 - abar).sqrt() * noise.double()
    velocity64 = abar.sqrt() * noise.double() - (1 - abar).sqrt() * clean.double()
    assert torch.allclose(schedule.add_noise(clean, noise, timesteps).double(), noisy64, atol=1e-6)
    assert torch.allclose(schedule.target("v_prediction", clean, noise, timesteps).double(), velocity64, atol=1e-6)
    # diffusers' fp32 cumprod rounds 1 - abar at t = 0 by ~5e-4 relative, hence the looser bound
    assert torch.allclose(schedule.add_noise(clean, noise, timesteps), scheduler.add_noise(clean, noise, timesteps),
                          atol=2e-5)
    assert torch.allclose(schedule.target("v_prediction", clean, noise, timesteps),
                          scheduler.get_velocity(clean, noise, timesteps), atol=2e-5)
    assert torch.equal(schedule.target("epsilon", clean, noise, timesteps), noise)
    assert torch.equal(schedule.target("sample", clean, noise, timesteps), clean)


def test_noising_stays_fp32_for_low_precision_inputs():
    """diffusers' script noises in bf16: at t = 0, sqrt(1 - abar) ~ 0.01 and x0 ~ 1 round so that
    the noise vanishes. Here bf16 inputs are promoted and the first timestep keeps its noise."""
    schedule = NoiseSchedule.from_scheduler(DDPMScheduler())
    clean = torch.full((1, 1, 2, 2), 0.7, dtype=torch.bfloat16)
    noise = torch.full((1, 1, 2, 2), 0.3, dtype=torch.bfloat16)
    noisy = schedule.add_noise(clean, noise, torch.tensor([0]))
    assert noisy.dtype == torch.float32
    expected = math.sqrt(1 - 1e-4) * clean.double() + math.sqrt(1e-4) * noise.double()
    assert torch.allclose(noisy.double(), expected, atol=1e-7)
    assert not torch.equal(noisy, clean.float())


def test_snr_from_log_space_schedule():
    scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2")
    schedule = NoiseSchedule.from_scheduler(scheduler)
    alphas_cumprod = torch.cumprod(1 - scheduler.betas.double(), 0)
    reference = alphas_cumprod / (1 - alphas_cumprod)
    assert torch.allclose(schedule.snr.double(), reference, rtol=1e-5)
    assert schedule.snr.dtype == torch.float32


def test_zero_terminal_snr_is_exactly_zero():
    schedule = NoiseSchedule.from_scheduler(DDPMScheduler(beta_schedule="scaled_linear", rescale_betas_zero_snr=True))
    assert schedule.snr[-1].item() == 0.0 and schedule.snr[-2].item() > 0
    assert schedule.sqrt_alphas_cumprod[-1].item() == 0.0 and schedule.sqrt_one_minus_alphas_cumprod[-1].item() == 1.0


@pytest.mark.parametrize("snr", [0.01, 0.5, 1.0, 4.99, 5.0, 5.01, 20.0, 1e4])
def test_min_snr_weights_closed_form(snr):
    """Hang et al. 2023: x0-space weight min(SNR, g); per type divided by that type's error multiple."""
    gamma = 5.0
    s = torch.tensor([snr], dtype=torch.float32)
    m = min(snr, gamma)
    assert min_snr_weight(s, gamma, "epsilon").item() == pytest.approx(m / snr, rel=1e-6)
    assert min_snr_weight(s, gamma, "v_prediction").item() == pytest.approx(m / (snr + 1), rel=1e-6)
    assert min_snr_weight(s, gamma, "sample").item() == pytest.approx(m, rel=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_min_snr_weight_at_zero_snr_is_finite_and_nonzero(prediction_type):
    weights = min_snr_weight(torch.tensor([0.0, 1e-8, 3.0]), 5.0, prediction_type)
    assert torch.isfinite(weights).all()
    assert weights[0].item() == 1.0


def test_min_snr_weights_equal_in_x0_space():
    """The three types' weighted losses agree for the same x0 error: the weights are consistent."""
    gamma, snr = 5.0, torch.tensor([0.3, 2.0, 9.0])
    x0_error = torch.tensor([0.2, 0.05, 0.01])
    eps_error = snr * x0_error            # ||eps - eps_hat||^2 = SNR ||x0 - x0_hat||^2
    v_error = (snr + 1) * x0_error        # ||v - v_hat||^2 = (SNR + 1) ||x0 - x0_hat||^2
    a = min_snr_weight(snr, gamma, "epsilon") * eps_error
    b = min_snr_weight(snr, gamma, "v_prediction") * v_error
    c = min_snr_weight(snr, gamma, "sample") * x0_error
    assert torch.allclose(a, b) and torch.allclose(b, c)


def test_per_sample_loss_l2_and_huber():
    prediction = torch.tensor([[0.0, 0.0], [1.0, 3.0]]).view(2, 1, 1, 2)
    target = torch.zeros(2, 1, 1, 2)
    assert per_sample_loss(prediction, target).tolist() == [0.0, 5.0]
    tiny = torch.full((1, 1, 1, 1), 1e-4)
    assert per_sample_loss(tiny, torch.zeros_like(tiny), "huber", 0.1).item() == pytest.approx(1e-8, rel=1e-3)
    big = torch.full((1, 1, 1, 1), 100.0)
    assert per_sample_loss(big, torch.zeros_like(big), "huber", 0.1).item() == pytest.approx(2 * 0.1 * 100, rel=1e-2)
    half = per_sample_loss(prediction.bfloat16(), target.bfloat16())
    assert half.dtype == torch.float32
