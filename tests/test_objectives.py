"""The objective seam (core/objectives.py): the DDPM objective computes exactly what NoiseSchedule and
min_snr_weight compute (the step's losses are unchanged by the seam), the generic Bayes-optimal loss
from (a, b, c, d) equals the DDPM closed form, and a third objective, written as one class, trains
through the trainer's own step with nothing else changed."""
import math

import pytest
import torch
from diffusers import DDPMScheduler
from helpers import tiny_run

from diffusion_extras.core import objectives
from diffusion_extras.core.losses import NoiseSchedule, log_alphas_cumprod, min_snr_weight
from diffusion_extras.core.timesteps import UniformTimesteps
from diffusion_extras.monitoring.diagnostics import bayes_optimal_loss


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddpm_noising_target_and_weight_are_noise_schedules_bit_for_bit(prediction_type):
    scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2", rescale_betas_zero_snr=True)
    objective = objectives.make_objective("ddpm", scheduler, prediction_type=prediction_type, snr_gamma=5.0)
    schedule = NoiseSchedule.from_scheduler(scheduler)
    timesteps = torch.tensor([0, 1, 500, 998, 999])
    clean, noise = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    assert torch.equal(objective.add_noise(clean, noise, timesteps), schedule.add_noise(clean, noise, timesteps))
    assert torch.equal(objective.target(clean, noise, timesteps),
                       schedule.target(prediction_type, clean, noise, timesteps))
    assert torch.equal(objective.loss_weight(timesteps), min_snr_weight(schedule.snr[timesteps], 5.0, prediction_type))
    assert torch.equal(objectives.DDPM(scheduler, snr_gamma=0.0).loss_weight(timesteps), torch.ones(5))
    assert objective.model_timesteps(timesteps) is timesteps
    # the generic MMSE s^2 (cb - ad)^2 / (a^2 s^2 + b^2) is the DDPM closed form of the diagnostics
    torch.testing.assert_close(objective.bayes_optimal_loss(0.6),
                               bayes_optimal_loss(torch.exp(log_alphas_cumprod(scheduler.betas)), 0.6, prediction_type),
                               rtol=1e-6, atol=1e-12)


class TrigFlow(objectives.Objective):
    """A third objective for the test: x_t = cos(pi s / 2) x_0 + sin(pi s / 2) noise, predicting
    v = cos noise - sin x_0 (TrigFlow, Lu & Song 2024), s = (i + 1) / T uniform, timestep s T."""
    name = "trigflow"
    target_name = "v"

    def __init__(self, noise_scheduler, device=None):
        self.noise_scheduler, self.device, self.num_train_timesteps = noise_scheduler, device, 1000
        self.timestep_sampler = UniformTimesteps(1000, device)

    def coefficients(self, timesteps):
        angle = (timesteps.float() + 1) / 1000 * math.pi / 2
        return angle.cos(), angle.sin(), -angle.sin(), angle.cos()

    def model_timesteps(self, timesteps):
        return (timesteps.float() + 1)


def test_a_third_objective_is_one_class_and_the_step_asks_it(tmp_path, fresh_accelerate):
    """The step's UNet input and timestep are the new objective's, from its coefficients alone."""
    from diffusion_extras.training import loop, step
    from diffusion_extras.training.hooks import Hooks

    cleans, calls = [], []
    hooks = Hooks(model_input=lambda run, clean, micro_step: cleans.append(clean.clone()) or clean)
    run = tiny_run(tmp_path, hooks=hooks)
    try:
        run.objective = TrigFlow(run.objective.noise_scheduler, run.accelerator.device)
        run.learner.unet.register_forward_pre_hook(lambda module, args: calls.append([a.detach().clone()
                                                                                       for a in args[:2]]))
        loss = step.optimizer_step(run, loop.make_batches(run))
        noise, index, *_ = step.micro_step_randomness(run, 0, cleans[0].shape[1:])
    finally:
        run.accelerator.end_training()
    a, b, _, _ = (k.view(-1, 1, 1, 1) for k in TrigFlow(None).coefficients(index))
    [(noisy, timesteps)] = calls
    torch.testing.assert_close(noisy, a * cleans[0] + b * noise)
    assert torch.equal(timesteps, index.float() + 1) and torch.isfinite(loss)
    # SNR = cot^2 and the v-target's MMSE s^2 / (cos^2 s^2 + sin^2) from the same coefficients (fp32
    # ones: cos near pi / 2 keeps few significant bits)
    angle = (torch.arange(1000, dtype=torch.float64) + 1) / 1000 * math.pi / 2
    torch.testing.assert_close(TrigFlow(None).snr(), 1 / angle.tan() ** 2, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(TrigFlow(None).bayes_optimal_loss(0.5),
                               0.25 / (angle.cos() ** 2 * 0.25 + angle.sin() ** 2), rtol=1e-5, atol=0)
