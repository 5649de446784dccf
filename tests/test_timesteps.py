import math

import pytest
import torch

from diffusion_extras.core.timesteps import LossAwareTimestepSampler


def warmed(T=8, loss_of_t=None):
    sampler = LossAwareTimestepSampler(T, warmup_samples_per_timestep=3, decay=0.5, uniform_fraction=0.01)
    loss_of_t = loss_of_t or (lambda t: 0.1 * (t + 1))
    for _ in range(3):
        t = torch.arange(T)
        sampler.update(t, torch.tensor([loss_of_t(i) for i in range(T)]))
    return sampler


def test_uniform_until_every_timestep_is_seen():
    sampler = LossAwareTimestepSampler(4, warmup_samples_per_timestep=2)
    sampler.update(torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.ones(7))
    assert torch.allclose(sampler.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))
    sampler.update(torch.tensor([3]), torch.tensor([5.0]))
    assert not torch.allclose(sampler.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))


def test_probabilities_follow_root_second_moment_with_floor():
    sampler = warmed()
    root = torch.tensor([0.1 * (t + 1) for t in range(8)], dtype=torch.float64)  # constant losses
    expected = root / root.sum() * 0.99 + 0.01 / 8
    assert torch.allclose(sampler.probabilities(), expected)


def test_importance_weights_keep_the_loss_unbiased():
    sampler = warmed(T=8)
    losses = torch.tensor([0.3, 0.1, 2.0, 0.5, 0.05, 1.0, 0.7, 0.2], dtype=torch.float64)
    p = sampler.probabilities()
    assert torch.isclose((p * (1 / (8 * p)) * losses).sum(), losses.mean())  # exact expectation
    t, w = sampler.sample(200_000, torch.Generator().manual_seed(0))
    estimate = (w.double() * losses[t]).mean().item()
    assert estimate == pytest.approx(losses.mean().item(), rel=0.02)
    assert torch.allclose(w.double(), 1 / (8 * p[t]), rtol=1e-6)


def test_repeated_timesteps_and_nonfinite_losses():
    sampler = LossAwareTimestepSampler(3, warmup_samples_per_timestep=1, decay=0.5)
    sampler.update(torch.tensor([0, 0, 1, 2]), torch.tensor([1.0, 3.0, float("nan"), 2.0]))
    # t=0: two losses at once, the mean of squares (5) initialises; t=1 saw only a NaN: not counted
    assert sampler.second_moment.tolist() == [5.0, 0.0, 4.0] and sampler.counts.tolist() == [2.0, 0.0, 1.0]
    sampler.update(torch.tensor([0]), torch.tensor([1.0]))
    assert sampler.second_moment[0].item() == pytest.approx(0.5 * 5.0 + 0.5 * 1.0)
    assert math.isfinite(sampler.probabilities().sum().item())


def test_state_dict_round_trip_samples_identically():
    a = warmed()
    b = LossAwareTimestepSampler(8, warmup_samples_per_timestep=3, decay=0.5, uniform_fraction=0.01)
    b.load_state_dict(a.state_dict())
    ta, wa = a.sample(64, torch.Generator().manual_seed(3))
    tb, wb = b.sample(64, torch.Generator().manual_seed(3))
    assert torch.equal(ta, tb) and torch.equal(wa, wb)


def test_both_samplers_share_one_interface():
    from diffusion_extras.core.timesteps import UniformTimesteps, make_timestep_sampler
    uniform = make_timestep_sampler("uniform", 50)
    assert isinstance(uniform, UniformTimesteps) and not uniform.learns_from_losses
    timesteps, weights = uniform.sample(64, torch.Generator().manual_seed(3))
    # the draw of the DDPM algorithm itself, t ~ U{0..T-1}, all weights 1
    assert torch.equal(timesteps, torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(3)))
    assert weights is None
    aware = make_timestep_sampler("loss_aware", 50)
    assert isinstance(aware, LossAwareTimestepSampler) and aware.learns_from_losses
    timesteps, weights = aware.sample(64, torch.Generator().manual_seed(3))
    assert timesteps.shape == weights.shape == (64,) and torch.allclose(weights, torch.ones(64))  # uniform until warm
