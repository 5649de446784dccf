"""With --rescale_betas_zero_snr every sampler starts at the zero-SNR step (trailing timesteps):
in-training grids and FID, the sample CLI, and DDPMPipeline.from_pretrained of the export."""
import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler
from helpers import run_cli, tiny_run

from diffusion_extras.evaluation import metrics as evaluation
from diffusion_extras.evaluation import sampling
from diffusion_extras.training import artifacts, models
from diffusion_extras.training.config import parse_config

ZERO_SNR = ("--rescale_betas_zero_snr", "--prediction_type", "v_prediction")


def first_timestep(scheduler, steps=10) -> int:
    scheduler = type(scheduler).from_config(scheduler.config)
    scheduler.set_timesteps(steps)
    return int(scheduler.timesteps[0])


@pytest.mark.parametrize("name", sampling.SCHEDULERS)
def test_samplers_start_at_the_zero_snr_step(name):
    zero_snr = DDPMScheduler(rescale_betas_zero_snr=True, prediction_type="v_prediction")
    assert first_timestep(sampling.make_scheduler(name, zero_snr.config)) == 999
    # an export from before the setting (rescaled, spacing "leading") is sampled with trailing too
    assert zero_snr.config.timestep_spacing == "leading"
    assert sampling.make_scheduler(name, DDPMScheduler().config).config.timestep_spacing != "trailing"
    # a spacing asked for is the one used, on either schedule
    assert sampling.make_scheduler(name, zero_snr.config, "leading").config.timestep_spacing == "leading"
    assert first_timestep(sampling.make_scheduler(name, DDPMScheduler().config, "trailing")) == 999


def test_exported_scheduler_config_loads_with_trailing_spacing(tmp_path):
    config = parse_config([*ZERO_SNR, "--config", "configs/digits.yaml"])
    scheduler = models.build_noise_scheduler(config)
    assert scheduler.alphas_cumprod[-1] < 1e-6  # zero terminal SNR
    unet = models.build_unet(config)
    models.export_pipeline(unet, scheduler, str(tmp_path))
    loaded = DDPMPipeline.from_pretrained(str(tmp_path)).scheduler
    assert loaded.config.rescale_betas_zero_snr and loaded.config.timestep_spacing == "trailing"
    assert first_timestep(loaded) == 999
    assert torch.equal(loaded.alphas_cumprod, scheduler.alphas_cumprod)


def test_in_training_grid_and_fid_sample_from_the_zero_snr_step(tmp_path, monkeypatch, fresh_accelerate):
    run = tiny_run(tmp_path, *ZERO_SNR, "--max_train_steps", 1, "--eval_steps", 1, "--feature_extractor", "tiny",
                   "--eval_num_samples", 4)
    seen = []

    def record(original):
        def wrapped(unet, scheduler, *args, **kwargs):
            seen.append(first_timestep(scheduler, run.config.ddpm_num_inference_steps))
            return original(unet, scheduler, *args, **kwargs)
        return wrapped
    monkeypatch.setattr(sampling, "generate", record(sampling.generate))
    monkeypatch.setattr(evaluation, "sample_features", record(evaluation.sample_features))
    unet, config = run.accelerator.unwrap_model(run.learner.unet), run.config
    target = artifacts.Target(config.output_dir, 1, run.accelerator, run.history)
    artifacts.save_sample_grid(unet, run.extras.ema, run.objective.noise_scheduler, target, config.eval_batch_size,
                               config.ddpm_num_inference_steps, config.seed)
    artifacts.evaluate(unet, run.extras.ema, run.objective.noise_scheduler, run.extras.evaluation, target,
                       config.eval_num_samples, config.ddpm_num_inference_steps, config.seed, config.eval_batch_size)
    assert seen[:1] == [999] and seen[-1] == 999 and len(seen) >= 2


def test_sample_cli_samples_from_the_zero_snr_step(tmp_path, monkeypatch):
    config = parse_config([*ZERO_SNR, "--config", "configs/digits.yaml"])
    scheduler = DDPMScheduler(rescale_betas_zero_snr=True, prediction_type="v_prediction")  # an older export
    models.export_pipeline(models.build_unet(config), scheduler, str(tmp_path / "pipe"))
    seen, original = [], sampling.generate

    def generate(unet, scheduler, num_images, num_inference_steps, **kwargs):
        seen.append(first_timestep(scheduler, num_inference_steps))
        return original(unet, scheduler, num_images, 1, **kwargs)
    monkeypatch.setattr(sampling, "generate", generate)  # the command imports it when it runs
    run_cli(["-m", "diffusion_extras.sample", tmp_path / "pipe", "--num_images", "1", "--num_inference_steps", "10",
             "--device", "cpu", "--output", tmp_path / "images"])
    assert seen == [999]
