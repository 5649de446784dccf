"""--variance_type learned_range end to end: one tiny learned-variance run through the
command line, shared by every test here, and each path that samples its 2C-channel UNet."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMPipeline, DDPMScheduler, DPMSolverMultistepScheduler
from helpers import read_history, run_cli, run_training, tiny_unet, write_tiny_recipe

from diffusion_extras.core import vlb
from diffusion_extras.evaluation.pipeline_class_conditional import guided_model_output, scheduler_model_output
from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics
from diffusion_extras.training import checkpointing, models, step
from diffusion_extras.training.config import ConfigError, parse_config, resume_policy

# Every periodic sampler at step 2 and at the end: grids and debug images (DDIM), held-out loss,
# the gradient probe, FID (DDIM, tiny features), post-hoc EMA snapshots, checkpoints.
EVERY_PATH = ("--variance_type", "learned_range", "--max_train_steps", 4, "--save_images_steps", 2,
              "--validation_split", 0.25, "--validation_steps", 2, "--grad_diagnostics_steps", 2,
              "--posthoc_ema", "--posthoc_ema_snapshot_steps", 2, "--eval_steps", 4,
              "--feature_extractor", "tiny", "--eval_num_samples", 8, "--checkpointing_steps", 4)


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("learned_run")
    result = run_training(write_tiny_recipe(folder), folder / "run", *EVERY_PATH)
    return SimpleNamespace(output=folder / "run", log=result.stdout + result.stderr)




@pytest.mark.xdist_group("test_learned_variance.learned_run")
def test_run_exports_a_ddpm_pipeline_that_samples_with_the_learned_variance(learned_run):
    out = learned_run.output
    with open(out / "scheduler" / "scheduler_config.json") as fh:
        assert json.load(fh)["variance_type"] == "learned_range"
    pipeline = DDPMPipeline.from_pretrained(out)
    assert pipeline.unet.config.in_channels == 1 and pipeline.unet.config.out_channels == 2
    images = pipeline(batch_size=2, num_inference_steps=5, generator=torch.Generator().manual_seed(0),
                      output_type="np").images
    assert images.shape == (2, 8, 8, 1) and np.isfinite(images).all()
    # every sampler of the run went through: grids and debug images, held-out loss, gradients, FID
    for suffix in ("", "_raw_vs_ema", "_denoising"):
        assert (out / "samples" / f"step_000004{suffix}.png").is_file()
    history = read_history(out)
    assert any("validation/ema_loss" in row for row in history)
    assert any(key.startswith("grad") for row in history for key in row)
    assert any("fid" in key for row in history for key in row)
    assert all(np.isfinite(row["loss"]) for row in history if "loss" in row)
    # diagnostics: the bound's terms per bin beside the simple loss's, and the report says which is which
    assert any(key.startswith("vlb_bin/") for row in history for key in row)
    assert "learned_variance_reference" in (out / "training_report.md").read_text()


def test_diagnostics_bin_the_bound_terms_and_sum_them_over_t():
    diagnostics = TimestepDiagnostics(num_train_timesteps=10, num_bins=2, bound_terms=True)
    diagnostics.update_loss(torch.tensor([0, 9]), torch.tensor([1.0, 2.0]))
    diagnostics.update_bound(torch.tensor([0, 1, 9]), torch.tensor([3.0, 1.0, 0.5]))
    window = diagnostics.reduce_and_reset()
    assert window["vlb_bin/00"] == 2.0 and window["vlb_bin/01"] == 0.5
    assert window["vlb_bits_per_dim"] == 5 * 2.0 + 5 * 0.5  # bin width x mean term, summed
    assert window["loss_bin/00"] == 1.0  # the simple loss's bins as before

    # a resume mid-window: the open window's bound terms, the running loss and the totals come back
    diagnostics.update_loss(torch.tensor([1, 8]), torch.tensor([4.0, 6.0]))
    diagnostics.update_bound(torch.tensor([2, 8]), torch.tensor([7.0, 0.25]))
    resumed = TimestepDiagnostics(num_train_timesteps=10, num_bins=2, bound_terms=True)
    resumed.load_state_dict(diagnostics.state_dict())
    np.testing.assert_array_equal(resumed.running_bin_loss, diagnostics.running_bin_loss)
    expected, got = diagnostics.reduce_and_reset(), resumed.reduce_and_reset()
    assert got == expected and got["vlb_bin/00"] == 7.0 and got["vlb_bin/01"] == 0.25


@pytest.mark.xdist_group("test_learned_variance.learned_run")
@pytest.mark.parametrize("scheduler", ["ddpm", "ddim", "dpm"])
def test_sample_command_with_each_scheduler(learned_run, tmp_path, scheduler):
    run_cli(["-m", "diffusion_extras.sample", learned_run.output, "--num_images", 2, "--num_inference_steps", 3,
             "--scheduler", scheduler, "--output", tmp_path, "--device", "cpu"])
    assert len(list(tmp_path.glob("0000*.png"))) == 2


@pytest.mark.xdist_group("test_learned_variance.learned_run")
def test_posthoc_ema_exports_a_learned_variance_pipeline(learned_run, tmp_path):
    run_cli(["-m", "diffusion_extras.posthoc_ema", learned_run.output, "--sigma_rels", "0.1", "--export",
             tmp_path / "best"])
    pipeline = DDPMPipeline.from_pretrained(tmp_path / "best")
    assert pipeline.scheduler.config.variance_type == "learned_range"
    assert pipeline.unet.config.out_channels == 2
    pipeline(batch_size=1, num_inference_steps=2, output_type="np")


def test_schedulers_take_the_variance_only_from_a_learned_ddpm():
    sample, output = torch.zeros(2, 1, 4, 4), torch.randn(2, 2, 4, 4)
    learned = DDPMScheduler(variance_type="learned_range")
    assert scheduler_model_output(learned, output, sample) is output
    for scheduler in (DDPMScheduler(), DDIMScheduler.from_config(learned.config),
                      DPMSolverMultistepScheduler.from_config(learned.config)):
        assert torch.equal(scheduler_model_output(scheduler, output, sample), output[:, :1])
    assert scheduler_model_output(DDIMScheduler(), output[:, :1], sample).shape[1] == 1


def test_guidance_moves_the_prediction_and_keeps_the_conditional_variance():
    class Conditional(torch.nn.Module):
        config = SimpleNamespace(num_class_embeds=3)

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def forward(self, sample, t, class_labels):  # prediction = label, variance value = label / 10
            labels = class_labels.float().view(-1, 1, 1, 1) * self.weight
            return SimpleNamespace(sample=torch.cat([labels.expand_as(sample), labels.expand_as(sample) / 10], 1))

    out = guided_model_output(Conditional(), torch.zeros(1, 1, 2, 2), 5, torch.tensor([1]), guidance_scale=3.0)
    # uncond: "no class" = 2; guided prediction 2 + 3 (1 - 2) = -1; variance: the conditional's 0.1
    assert torch.allclose(out[:, :1], torch.full((1, 1, 2, 2), -1.0))
    assert torch.allclose(out[:, 1:], torch.full((1, 1, 2, 2), 0.1))


def test_bound_term_trains_only_the_variance():
    process = vlb.ReverseProcess(DDPMScheduler(num_train_timesteps=20).betas)
    run = SimpleNamespace(objective=SimpleNamespace(reverse_process=process),
                          config=SimpleNamespace(prediction_type="epsilon", variance_type="learned_range"))
    prediction = torch.randn(3, 1, 4, 4, requires_grad=True)
    values = torch.zeros(3, 1, 4, 4, requires_grad=True)
    clean, noisy = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    term = step.bound_term(run, prediction, values, clean, noisy, torch.tensor([0, 7, 19]))
    term.sum().backward()
    assert prediction.grad is None and values.grad.abs().sum() > 0


def test_model_gets_2c_outputs_and_settings_are_checked(tmp_path):
    config = parse_config(["--variance_type", "learned_range", "--output_dir", str(tmp_path)])
    assert models.build_unet(config).config.out_channels == 2  # the digits recipe's UNet, 1 channel
    on_data = parse_config(["--variance_type", "learned_range", "--dataset_name", "some/rgb",
                            "--output_dir", str(tmp_path)])
    assert models.model_for_data(on_data, 3).model["out_channels"] == 6  # the model that follows the data
    assert resume_policy("variance_type") == "refuse"
    unet_folder = tmp_path / "unet"
    tiny_unet(channels=1, out_channels=2).save_pretrained(unet_folder)
    with pytest.raises(ConfigError, match="add --variance_type learned_range"):
        models.build_unet(parse_config(["--model_config_name_or_path", str(unet_folder),
                                        "--resolution", "8", "--output_dir", str(tmp_path)]))
    with pytest.raises(ConfigError, match="--prediction_type v_prediction"):
        parse_config(["--variance_type", "learned_range", "--rescale_betas_zero_snr"])
    with pytest.raises(ConfigError, match="--vlb_weight must be >= 0"):
        parse_config(["--vlb_weight=-1"])


@pytest.mark.xdist_group("test_learned_variance.learned_run")
def test_resume_refuses_a_change_of_variance_type(learned_run):
    checkpoint = str(learned_run.output / "checkpoint-4")
    saved = checkpointing.read_train_state(checkpoint)["config"]
    with pytest.raises(checkpointing.CheckpointError, match="variance_type: 'learned_range' -> 'fixed_small'"):
        checkpointing.check_resumable(checkpoint, {**saved, "variance_type": "fixed_small"})
    _, applied = checkpointing.check_resumable(checkpoint, {**saved, "vlb_weight": 0.01})  # a weight: applied
    assert applied == {"vlb_weight": (0.001, 0.01)}
